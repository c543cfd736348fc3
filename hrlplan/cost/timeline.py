"""Event-timeline simulation of one pipeline step, micro-batch by micro-batch and stage by stage.

Each pipeline position (a device group) executes a fixed list of operations -- F (forward), B
(backward; for split-backward schedules only the input-gradient half), W (weight gradient) and BW
(a whole backward inside a split-backward schedule) --
in the order the schedule prescribes. An operation starts when its device group is free and its
inputs have arrived (the previous stage's activation or the next stage's gradient, plus the
point-to-point delay). The order lists depend only on (schedule, pp, stages per rank,
micro-batches): hrlplan.cost.schedule_orders builds them once per schedule (one generator per order
family) and caches them with a topological order of every operation; simulating a plan is then one
pass over that order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from hrlplan import schedules
from hrlplan.cost.schedule_orders import (  # noqa: F401 (re-exported: the timeline's operations)
    B, BW, F, W, ZB_W_ACTIVATION_SHARE, Structure, structure, virtual_stage)

@dataclass
class TimelineResult:
    makespan: float                 # last operation's end, over every position
    end: List[float]                # per position
    busy: List[float]               # per position: compute time
    peak_activation: List[float]    # per position: activation bytes held at the worst moment
    last_backward: List[float]      # per position: duration of its final B (+W) (overlap window)
    # per position: the activation peak before its first backward (gradients do not exist yet: the
    # step began with zero_grad(set_to_none)) and after it (gradients held beside the activations)
    peak_before_grads: List[float] = field(default_factory=list)
    peak_with_grads: List[float] = field(default_factory=list)


class _Ledger:
    """What both timelines record as an operation ends: its inputs' readiness for the next stages,
    each position's clock, busy time, activations held and final backward."""

    def __init__(self, pp: int, n: int, m: int, split_backward: bool, activation: Sequence[float], fill: Optional[float],
                 trace: Optional[List[Tuple[int, int, int, int, float, float]]], sent_after=()):
        self.f_end: List[List[Optional[float]]] = [[fill] * m for _ in range(n)]
        # a forward paired with a backward in one action is sent when the pair ends (Structure.sent_after)
        self.held_forwards = {f for f, _ in sent_after}
        self.releases = {partner: f for f, partner in sent_after}
        self.b_end: List[List[Optional[float]]] = [[fill] * m for _ in range(n)]
        self.free, self.busy, self.held, self.peak, self.last_b = ([0.0] * pp for _ in range(5))
        self.peak_pre, self.peak_post, self.backed = [0.0] * pp, [0.0] * pp, [False] * pp
        self.keep = ZB_W_ACTIVATION_SHARE if split_backward else 0.0
        self.activation, self.trace = activation, trace

    def start_forward(self, pos: int, k: int) -> None:
        self.held[pos] += self.activation[k]
        if self.held[pos] > self.peak[pos]:
            self.peak[pos] = self.held[pos]
        side = self.peak_post if self.backed[pos] else self.peak_pre
        side[pos] = max(side[pos], self.held[pos])

    def finish(self, pos: int, kind: int, k: int, j: int, start: float, end: float) -> None:
        dur = end - start
        self.free[pos] = end
        self.busy[pos] += dur
        if self.trace is not None:
            self.trace.append((pos, kind, k, j, start, end))
        if (kind, k, j) in self.releases:
            _, fk, fj = self.releases[(kind, k, j)]
            self.f_end[fk][fj] = end
        if kind == F:
            if (F, k, j) not in self.held_forwards:
                self.f_end[k][j] = end
        elif kind in (B, BW):
            self.b_end[k][j] = end
            self.held[pos] -= self.activation[k] * (1.0 if kind == BW else 1.0 - self.keep)
            self.last_b[pos] = dur
            self.backed[pos] = True
        else:
            self.held[pos] -= self.activation[k] * self.keep
            self.last_b[pos] += dur

    def result(self) -> TimelineResult:
        return TimelineResult(makespan=max(self.free), end=self.free, busy=self.busy, peak_activation=self.peak,
                              last_backward=self.last_b, peak_before_grads=self.peak_pre,
                              peak_with_grads=self.peak_post)


def _work_table(micro_batch_work: Optional[Sequence[Sequence[float]]], n: int, m: int) -> Optional[List[List[float]]]:
    """micro_batch_work checked against the step's n model stages and m micro-batches."""
    if micro_batch_work is None:
        return None
    rows = [list(map(float, row)) for row in micro_batch_work]
    if len(rows) != n or any(len(row) != m for row in rows):
        raise ValueError(f"micro_batch_work must be [stage][micro-batch], {n} x {m}; got "
                         f"{len(rows)} x {sorted({len(r) for r in rows})}")
    if any(x < 0 or x != x for row in rows for x in row):
        raise ValueError("micro_batch_work holds a negative or NaN multiplier")
    return rows


def simulate_timeline(schedule: str, pp: int, stages_per_rank: int, m: int,
                      fwd: Sequence[float], bwd: Sequence[float], wgt: Sequence[float],
                      send_fwd: Sequence[float], send_bwd: Sequence[float],
                      activation: Sequence[float], first_fwd_extra: Optional[Sequence[float]] = None,
                      last_bwd_extra: Optional[Sequence[float]] = None,
                      recv_handshake: Optional[Sequence[float]] = None,
                      trace: Optional[List[Tuple[int, int, int, int, float, float]]] = None,
                      micro_batch_work: Optional[Sequence[Sequence[float]]] = None,
                      backward_work: Optional[Sequence[Sequence[float]]] = None) -> TimelineResult:
    """Per model stage k: fwd/bwd/wgt durations of one micro-batch, send_fwd[k] the delay of k's
    activation to k+1, send_bwd[k] the delay of the gradient from k+1 back to k, activation[k] the
    bytes one micro-batch keeps on k until its backward. first_fwd_extra[k] lengthens stage k's
    first forward of the step and last_bwd_extra[k] its last backward (zero-bubble: its last W),
    as FSDP's all-gathers and gradient reduces do. recv_handshake[k] (rendezvous transports such as
    gloo's, where a send waits for its receive to be posted): an operation of stage k that receives
    from another position starts no sooner than this long after its position gets to it, even when
    the message was sent long before (the receive's notice has to reach the sender, which then sends);
    a send that is late still arrives send_* after it was made. `trace`, when given, gets one
    (position, kind, stage, micro-batch, start, end) per operation, in execution order.
    micro_batch_work[k][j] (mixed-length data: cost/lengths.py) multiplies stage k's fwd/bwd/wgt for
    micro-batch j, which then differ from one micro-batch to the next; None: every one alike.
    backward_work, where given, multiplies the backward and weight-gradient times instead (a forward
    and a backward need not follow a micro-batch's contents alike: attention's backward is a larger
    multiple of its forward than a matmul's)."""
    st = structure(schedule, pp, stages_per_rank, m)
    n = pp * stages_per_rank
    work = _work_table(micro_batch_work, n, m)
    back = _work_table(backward_work, n, m) if backward_work is not None else work
    last = n - 1
    split = schedules.get(schedule, stages_per_rank).split_backward
    book = _Ledger(pp, n, m, split, activation, 0.0, trace, st.sent_after)
    f_end, b_end, free = book.f_end, book.b_end, book.free
    # the operation that finishes a micro-batch's weight gradients (where the last one's reduce goes)
    completes = (W, BW) if split else (B,)
    f_extra = first_fwd_extra if first_fwd_extra is not None and any(first_fwd_extra) else None
    b_extra = last_bwd_extra if last_bwd_extra is not None and any(last_bwd_extra) else None
    hs = recv_handshake if recv_handshake is not None and any(recv_handshake) else None
    seen_f = [False] * n
    done_b = [0] * n
    for pos, kind, k, j in st.order:
        if kind == F:
            ready = f_end[k - 1][j] + send_fwd[k - 1] if k > 0 else 0.0
            dur = fwd[k] if work is None else fwd[k] * work[k][j]
            if f_extra is not None and not seen_f[k]:
                seen_f[k] = True
                dur += f_extra[k]
            book.start_forward(pos, k)
        elif kind in (B, BW):
            ready = b_end[k + 1][j] + send_bwd[k] if k < last else f_end[k][j]
            dur = bwd[k] if kind == B else bwd[k] + wgt[k]
            if back is not None:
                dur *= back[k][j]
        else:
            ready = b_end[k][j]
            dur = wgt[k] if back is None else wgt[k] * back[k][j]
        if b_extra is not None and kind in completes:
            done_b[k] += 1
            if done_b[k] == m:
                dur += b_extra[k]
        at = free[pos]
        if hs is not None and kind != W and ((kind == F and k > 0 and send_fwd[k - 1] > 0)
                                             or (kind in (B, BW) and k < last and send_bwd[k] > 0)):
            at += hs[k]
        start = at if at > ready else ready
        book.finish(pos, kind, k, j, start, start + dur)
    return book.result()


def simulate_shared_timeline(schedule: str, pp: int, stages_per_rank: int, m: int,
                             fwd: Sequence[float], bwd: Sequence[float], wgt: Sequence[float],
                             send_fwd: Sequence[float], send_bwd: Sequence[float], activation: Sequence[float],
                             first_fwd_extra: Optional[Sequence[float]] = None,
                             recv_handshake: Optional[Sequence[float]] = None,
                             ranks: Optional[Sequence[int]] = None, contention: float = 1.0,
                             all_ranks: Optional[int] = None,
                             trace: Optional[List[Tuple[int, int, int, int, float, float]]] = None,
                             micro_batch_work: Optional[Sequence[Sequence[float]]] = None,
                             backward_work: Optional[Sequence[Sequence[float]]] = None) -> TimelineResult:
    """simulate_timeline for positions that share too few cores: the durations are each operation's
    time with one rank alone on the cores, and while operations run their work progresses at
    1 / slowdown, the slowdown linear in the ranks busy between the two points calibration measures
    -- 1 with one rank busy, `contention` with all of them (ranks[pos]: position pos's ranks). A
    rank waiting in a bubble leaves its core to the others, which one slowdown for the whole step
    cannot say. Measured on pp2 x dp2 and pp2 x tp2 over 2 shared cores (ten calibrated runs each):
    the mean-field busy share predicted -10..-14% of the step time, ideal processor sharing
    (contention x busy / all ranks, i.e. no other tenants) +11..+15%, this -2..-4% and +2%. Same
    operations, orders, inputs and handshake as simulate_timeline (equal to it when nothing is
    slowed); event-driven, so slower: the simulator uses it only when ranks outnumber cores.
    micro_batch_work, backward_work as in simulate_timeline."""
    ranks = list(ranks) if ranks is not None else [1] * pp
    # `contention` was measured with `all_ranks` busy (the whole job): a plan that leaves ranks
    # idle never reaches it
    total = float(all_ranks if all_ranks is not None else sum(ranks))
    split = schedules.get(schedule, stages_per_rank).split_backward
    run = _SharedCoresRun(schedule, pp, stages_per_rank, m, (fwd, bwd, wgt), send_fwd, send_bwd, first_fwd_extra,
                          recv_handshake, _Ledger(pp, pp * stages_per_rank, m, split, activation, None, trace,
                                                  structure(schedule, pp, stages_per_rank, m).sent_after),
                          _work_table(micro_batch_work, pp * stages_per_rank, m),
                          _work_table(backward_work, pp * stages_per_rank, m))
    now = 0.0
    while True:
        run.start_ready(now)
        active = sum(ranks[pos] for pos in range(pp) if run.running[pos] is not None)
        starts = [p[0] for p in run.pending if p is not None]
        if not active and not starts:
            break
        slowdown = 1.0 + (contention - 1.0) * max(active - 1.0, 0.0) / (total - 1.0) if total > 1 else contention
        later = min([now + r[1] * slowdown for r in run.running if r is not None] + starts)
        for r in run.running:
            if r is not None:
                r[1] -= (later - now) / slowdown
        now = later
        run.finish_done(now)
    if any(run.nxt[pos] < len(run.ops[pos]) for pos in range(pp)):
        raise RuntimeError(f"shared-cores timeline stalled for {schedule} pp={pp} v={stages_per_rank} m={m}")
    return run.book.result()


class _SharedCoresRun:
    """simulate_shared_timeline's state: per position the next operation (pending: start, op, work)
    and the running one (op, work left, start)."""

    def __init__(self, schedule, pp, stages_per_rank, m, durations, send_fwd, send_bwd, first_fwd_extra,
                 recv_handshake, book: "_Ledger", work: Optional[List[List[float]]],
                 backward_work: Optional[List[List[float]]] = None):
        self.ops = structure(schedule, pp, stages_per_rank, m).position_ops
        self.pp, self.last = pp, pp * stages_per_rank - 1
        self.fwd, self.bwd, self.wgt = durations
        self.send_fwd, self.send_bwd = send_fwd, send_bwd
        self.first_fwd_extra, self.recv_handshake = first_fwd_extra, recv_handshake
        self.book, self.work = book, work
        self.back = backward_work if backward_work is not None else work
        self.seen_f = [False] * (pp * stages_per_rank)
        self.nxt = [0] * pp
        self.pending: List[Optional[Tuple[float, Tuple[int, int, int], float]]] = [None] * pp
        self.running: List[Optional[List]] = [None] * pp

    def plan_next(self, pos: int) -> None:
        """The position's next operation, with its start time, once its input exists."""
        kind, k, j = self.ops[pos][self.nxt[pos]]
        f_end, b_end = self.book.f_end, self.book.b_end
        receives = False
        if kind == F:
            ready = f_end[k - 1][j] if k > 0 else 0.0
            if ready is not None and k > 0:
                ready += self.send_fwd[k - 1]
                receives = self.send_fwd[k - 1] > 0
            work = self.fwd[k]
        elif kind in (B, BW):
            ready = b_end[k + 1][j] if k < self.last else f_end[k][j]
            if ready is not None and k < self.last:
                ready += self.send_bwd[k]
                receives = self.send_bwd[k] > 0
            work = self.bwd[k] if kind == B else self.bwd[k] + self.wgt[k]
        else:
            ready, work = b_end[k][j], self.wgt[k]
        scale = self.work if kind == F else self.back
        if scale is not None:
            work *= scale[k][j]
        if ready is None:
            return
        if kind == F and self.first_fwd_extra is not None and not self.seen_f[k]:
            self.seen_f[k] = True
            work += self.first_fwd_extra[k]
        at = self.book.free[pos] + (self.recv_handshake[k] if self.recv_handshake is not None and receives else 0.0)
        self.pending[pos] = (max(at, ready), (kind, k, j), work)

    def start_ready(self, now: float) -> None:
        for pos in range(self.pp):
            if self.running[pos] is None and self.pending[pos] is None and self.nxt[pos] < len(self.ops[pos]):
                self.plan_next(pos)
            p = self.pending[pos]
            if p is not None and p[0] <= now:
                if p[1][0] == F:
                    self.book.start_forward(pos, p[1][1])
                self.running[pos], self.pending[pos] = [p[1], p[2], now], None

    def finish_done(self, now: float) -> None:
        for pos in range(self.pp):
            r = self.running[pos]
            if r is None or r[1] > 1e-12 * max(1.0, now):
                continue
            (kind, k, j), _, start = r
            self.running[pos] = None
            self.nxt[pos] += 1
            self.book.finish(pos, kind, k, j, start, now)
