"""Event-timeline simulation of one pipeline step, micro-batch by micro-batch and stage by stage.

Each pipeline position (a device group) executes a fixed list of operations -- F (forward), B
(backward; for zero-bubble only the input-gradient half) and W (weight gradient, zero-bubble) --
in the order the schedule prescribes. An operation starts when its device group is free and its
inputs have arrived (the previous stage's activation or the next stage's gradient, plus the
point-to-point delay). The order lists depend only on (schedule, pp, stages per rank,
micro-batches), so they are built once and cached together with a topological order of every
operation; simulating a plan is then one pass over that order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

F, B, W = 0, 1, 2
# Fraction of a stage's activations that zero-bubble keeps after B for the later W pass (the
# inputs of the weight-gradient matmuls).
ZB_W_ACTIVATION_SHARE = 0.3


def virtual_stage(schedule: str, pp: int, stages_per_rank: int, position: int, chunk: int) -> int:
    """Which model stage a position runs as its chunk-th stage (mirrors Plan.stage_group)."""
    if stages_per_rank == 1:
        return position
    if schedule == "zero_bubble" and stages_per_rank == 2:
        return position if chunk == 0 else 2 * pp - 1 - position
    return chunk * pp + position


def _interleaved_sequence(pp: int, v: int, m: int, backward: bool) -> List[Tuple[int, int]]:
    """Megatron's order of (chunk, micro-batch) on one position: groups of pp micro-batches per chunk."""
    seq = []
    for t in range(m * v):
        group = t // pp
        chunk = group % v
        if backward:
            chunk = v - 1 - chunk
        mb = (t // (pp * v)) * pp + t % pp
        if mb < m:
            seq.append((chunk, mb))
    # m not a multiple of pp: the formula skips some micro-batches; append them in order.
    for chunk in (range(v - 1, -1, -1) if backward else range(v)):
        for mb in range(m):
            if (chunk, mb) not in seq:
                seq.append((chunk, mb))
    return seq


def _v_shape_orders(pp: int, m: int, cap: float) -> List[List[Tuple[int, int, int]]]:
    """ZB-V (Qi et al., 2024): position p runs model stages p (down leg) and 2pp-1-p (up leg).
    The static order comes from a unit-time list schedule: whenever a position is free it runs a
    ready backward (B) if any, else a ready forward (F) while the activations it holds stay within
    `cap` chunk-activations (a B leaves ZB_W_ACTIVATION_SHARE of one until its W), else a pending
    weight-gradient pass (W), which thereby fills the bubbles. With cap = 2pp a position never
    holds more than 1F1B's first stage does (pp micro-batches of a whole stage), as in the paper."""
    n = 2 * pp
    f_end = {}
    b_end = {}
    nf = [0] * n           # next micro-batch to run forward / backward, per model stage
    nb = [0] * n
    pending: List[List[Tuple[int, int]]] = [[] for _ in range(pp)]
    held = [0.0] * pp
    orders: List[List[Tuple[int, int, int]]] = [[] for _ in range(pp)]
    total = 3 * n * m
    done = 0
    t = 0
    idle = 0
    while done < total:
        progressed = False
        finished = []
        for p in range(pp):
            stages = (n - 1 - p, p)    # prefer the up leg: it is nearer the loss and frees memory sooner
            op = None
            for k in stages:
                j = nb[k]
                if j < m:
                    dep = f_end.get((k, j)) if k == n - 1 else b_end.get((k + 1, j))
                    if dep is not None and dep < t:
                        op = (B, k, j)
                        break
            if op is None and held[p] + 1.0 <= cap + 1e-9:
                for k in stages:
                    j = nf[k]
                    if j < m:
                        dep = t - 1 if k == 0 else f_end.get((k - 1, j))
                        if dep is not None and dep < t:
                            op = (F, k, j)
                            break
            if op is None and pending[p]:
                k, j = pending[p].pop(0)
                op = (W, k, j)
            if op is None:
                continue
            kind, k, j = op
            orders[p].append(op)
            finished.append(op)
            if kind == F:
                nf[k] += 1
                held[p] += 1.0
            elif kind == B:
                nb[k] += 1
                held[p] -= 1.0 - ZB_W_ACTIVATION_SHARE
                pending[p].append((k, j))
            else:
                held[p] -= ZB_W_ACTIVATION_SHARE
            done += 1
            progressed = True
        for kind, k, j in finished:   # results become visible at the end of the time step
            if kind == F:
                f_end[(k, j)] = t
            elif kind == B:
                b_end[(k, j)] = t
        idle = 0 if progressed else idle + 1
        if idle > 2:
            return []  # every position is stuck under this cap
        t += 1
    return orders


def _torch_zbv_orders(pp: int, m: int) -> List[List[Tuple[int, int, int]]]:
    """torch.distributed.pipelining's ScheduleZBVZeroBubble order (the runtime's ZB-V), per position:
    warm-up forwards of both legs, then F, B, W of the down leg and of the up leg in turn, W right
    after its B while forwards remain, deferred in the cool-down (its _calculate_single_rank_operations)."""
    n = 2 * pp
    n_micro = max(2 * pp - 1, m)
    orders = []
    for rank in range(pp):
        ops: List[Tuple[int, int, int]] = []
        c0, c1 = rank, n - 1 - rank
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (pp - rank) - 1):
            ops.append((F, c0, f0)); f0 += 1
        for _ in range(rank):
            ops.append((F, c1, f1)); f1 += 1
            ops.append((F, c0, f0)); f0 += 1
        for _ in range(pp - rank):
            ops += [(F, c1, f1), (B, c1, b1), (W, c1, b1)]
            f1 += 1; b1 += 1
        while f1 < f0 or f0 < n_micro:
            if f0 < n_micro:
                ops.append((F, c0, f0)); f0 += 1
            ops += [(B, c0, b0), (W, c0, b0), (F, c1, f1), (B, c1, b1), (W, c1, b1)]
            b0 += 1; f1 += 1; b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            ops += [(B, c0, b0), (B, c1, b1)]
            b0 += 1; b1 += 1
        for _ in range(pp - rank):
            ops += [(B, c0, b0), (W, c0, w0)]
            b0 += 1; w0 += 1
        ops += [(W, c1, j) for j in range(w1, b1)] + [(W, c0, j) for j in range(w0, b0)]
        orders.append([op for op in ops if op[2] < m])
    return orders


def _position_ops(schedule: str, pp: int, v: int, m: int, pos: int, warmup: int) -> List[Tuple[int, int, int]]:
    fseq = _interleaved_sequence(pp, v, m, backward=False)
    bseq = _interleaved_sequence(pp, v, m, backward=True)
    fops = [(F, virtual_stage(schedule, pp, v, pos, c), j) for c, j in fseq]
    bops = [(B, virtual_stage(schedule, pp, v, pos, c), j) for c, j in bseq]
    if schedule == "gpipe":
        return fops + bops
    zero_bubble = schedule == "zero_bubble"
    ops: List[Tuple[int, int, int]] = list(fops[:warmup])
    deferred: List[Tuple[int, int, int]] = []
    fi, bi = warmup, 0
    # ZB-H1: weight gradients of the first (pp - pos - 1) micro-batches wait for the cool-down,
    # where they fill the gaps left while gradients travel back.
    defer = max(pp - pos - 1, 0)
    while bi < len(bops):
        if fi < len(fops):
            ops.append(fops[fi])
            fi += 1
        ops.append(bops[bi])
        if zero_bubble:
            deferred.append((W,) + bops[bi][1:])
            if fi >= len(fops):  # cool-down: spread the deferred W's over the remaining B's
                remaining = len(bops) - bi
                for _ in range(-(-len(deferred) // remaining)):
                    ops.append(deferred.pop(0))
            elif len(deferred) > defer:
                ops.append(deferred.pop(0))
        bi += 1
    ops.extend(deferred)
    return ops


@dataclass(frozen=True)
class Structure:
    """The cached, duration-independent part of a schedule."""
    position_ops: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    order: Tuple[Tuple[int, int, int, int], ...]   # (position, kind, stage, micro-batch), topological


def _topological(position_ops: Sequence[Sequence[Tuple[int, int, int]]], n_stages: int) -> List[tuple] | None:
    done = set()
    ptr = [0] * len(position_ops)
    order = []
    progress = True
    while progress:
        progress = False
        for pos, ops in enumerate(position_ops):
            while ptr[pos] < len(ops):
                kind, k, j = ops[ptr[pos]]
                if kind == F:
                    dep = (F, k - 1, j) if k > 0 else None
                elif kind == B:
                    dep = (B, k + 1, j) if k < n_stages - 1 else (F, k, j)
                else:
                    dep = (B, k, j)
                if dep is not None and dep not in done:
                    break
                done.add((kind, k, j))
                order.append((pos, kind, k, j))
                ptr[pos] += 1
                progress = True
    return order if all(p == len(ops) for p, ops in zip(ptr, position_ops)) else None


@lru_cache(maxsize=512)
def structure(schedule: str, pp: int, stages_per_rank: int, m: int) -> Structure:
    v = stages_per_rank
    n_stages = pp * v
    if schedule == "zero_bubble" and v == 2:
        ops = _torch_zbv_orders(pp, m)   # the order the runtime runs, when it is executable
        order = _topological(ops, n_stages)
        if order is not None:
            return Structure(tuple(tuple(o) for o in ops), tuple(order))
        cap = 2.0 * pp
        while True:   # a cap too tight for an unusual (pp, m) would stall: loosen it until it runs
            ops = _v_shape_orders(pp, m, cap)
            order = _topological(ops, n_stages) if ops else None
            if order is not None:
                return Structure(tuple(tuple(o) for o in ops), tuple(order))
            if cap > 2.0 * pp * m:
                raise RuntimeError(f"no executable order for {schedule} pp={pp} v={v} m={m}")
            cap += 1.0
    if v == 1:
        warm = [min(pp - pos - 1, m) for pos in range(pp)]
    else:  # Megatron's interleaved warm-up
        warm = [min((pp - pos - 1) * 2 + (v - 1) * pp, m * v) for pos in range(pp)]
    # A warm-up too short for an unusual (pp, v, m) would deadlock the static order: lengthen it
    # for the positions that are stuck until the order is executable.
    for _ in range(4 * m * v + 4):
        ops = [_position_ops(schedule, pp, v, m, pos, warm[pos]) for pos in range(pp)]
        order = _topological(ops, n_stages)
        if order is not None:
            return Structure(tuple(tuple(o) for o in ops), tuple(order))
        warm = [min(w + 1, m * v) for w in warm]
    raise RuntimeError(f"no executable order for {schedule} pp={pp} v={v} m={m}")


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

    def __init__(self, pp: int, n: int, m: int, schedule: str, activation: Sequence[float], fill: Optional[float],
                 trace: Optional[List[Tuple[int, int, int, int, float, float]]]):
        self.f_end: List[List[Optional[float]]] = [[fill] * m for _ in range(n)]
        self.b_end: List[List[Optional[float]]] = [[fill] * m for _ in range(n)]
        self.free, self.busy, self.held, self.peak, self.last_b = ([0.0] * pp for _ in range(5))
        self.peak_pre, self.peak_post, self.backed = [0.0] * pp, [0.0] * pp, [False] * pp
        self.keep = ZB_W_ACTIVATION_SHARE if schedule == "zero_bubble" else 0.0
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
        if kind == F:
            self.f_end[k][j] = end
        elif kind == B:
            self.b_end[k][j] = end
            self.held[pos] -= self.activation[k] * (1.0 - self.keep)
            self.last_b[pos] = dur
            self.backed[pos] = True
        else:
            self.held[pos] -= self.activation[k] * self.keep
            self.last_b[pos] += dur

    def result(self) -> TimelineResult:
        return TimelineResult(makespan=max(self.free), end=self.free, busy=self.busy, peak_activation=self.peak,
                              last_backward=self.last_b, peak_before_grads=self.peak_pre,
                              peak_with_grads=self.peak_post)


def simulate_timeline(schedule: str, pp: int, stages_per_rank: int, m: int,
                      fwd: Sequence[float], bwd: Sequence[float], wgt: Sequence[float],
                      send_fwd: Sequence[float], send_bwd: Sequence[float],
                      activation: Sequence[float], first_fwd_extra: Optional[Sequence[float]] = None,
                      last_bwd_extra: Optional[Sequence[float]] = None,
                      recv_handshake: Optional[Sequence[float]] = None,
                      trace: Optional[List[Tuple[int, int, int, int, float, float]]] = None) -> TimelineResult:
    """Per model stage k: fwd/bwd/wgt durations of one micro-batch, send_fwd[k] the delay of k's
    activation to k+1, send_bwd[k] the delay of the gradient from k+1 back to k, activation[k] the
    bytes one micro-batch keeps on k until its backward. first_fwd_extra[k] lengthens stage k's
    first forward of the step and last_bwd_extra[k] its last backward (zero-bubble: its last W),
    as FSDP's all-gathers and gradient reduces do. recv_handshake[k] (rendezvous transports such as
    gloo's, where a send waits for its receive to be posted): an operation of stage k that receives
    from another position starts no sooner than this long after its position gets to it, even when
    the message was sent long before (the receive's notice has to reach the sender, which then sends);
    a send that is late still arrives send_* after it was made. `trace`, when given, gets one
    (position, kind, stage, micro-batch, start, end) per operation, in execution order."""
    st = structure(schedule, pp, stages_per_rank, m)
    n = pp * stages_per_rank
    last = n - 1
    book = _Ledger(pp, n, m, schedule, activation, 0.0, trace)
    f_end, b_end, free = book.f_end, book.b_end, book.free
    last_kind = W if schedule == "zero_bubble" else B
    f_extra = first_fwd_extra if first_fwd_extra is not None and any(first_fwd_extra) else None
    b_extra = last_bwd_extra if last_bwd_extra is not None and any(last_bwd_extra) else None
    hs = recv_handshake if recv_handshake is not None and any(recv_handshake) else None
    seen_f = [False] * n
    done_b = [0] * n
    for pos, kind, k, j in st.order:
        if kind == F:
            ready = f_end[k - 1][j] + send_fwd[k - 1] if k > 0 else 0.0
            dur = fwd[k]
            if f_extra is not None and not seen_f[k]:
                seen_f[k] = True
                dur += f_extra[k]
            book.start_forward(pos, k)
        elif kind == B:
            ready = b_end[k + 1][j] + send_bwd[k] if k < last else f_end[k][j]
            dur = bwd[k]
        else:
            ready = b_end[k][j]
            dur = wgt[k]
        if b_extra is not None and kind == last_kind:
            done_b[k] += 1
            if done_b[k] == m:
                dur += b_extra[k]
        at = free[pos]
        if hs is not None and kind != W and ((kind == F and k > 0 and send_fwd[k - 1] > 0)
                                             or (kind == B and k < last and send_bwd[k] > 0)):
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
                             trace: Optional[List[Tuple[int, int, int, int, float, float]]] = None) -> TimelineResult:
    """simulate_timeline for positions that share too few cores: the durations are each operation's
    time with one rank alone on the cores, and while operations run their work progresses at
    1 / slowdown, the slowdown linear in the ranks busy between the two points calibration measures
    -- 1 with one rank busy, `contention` with all of them (ranks[pos]: position pos's ranks). A
    rank waiting in a bubble leaves its core to the others, which one slowdown for the whole step
    cannot say. Measured on pp2 x dp2 and pp2 x tp2 over 2 shared cores (ten calibrated runs each):
    the mean-field busy share predicted -10..-14% of the step time, ideal processor sharing
    (contention x busy / all ranks, i.e. no other tenants) +11..+15%, this -2..-4% and +2%. Same
    operations, orders, inputs and handshake as simulate_timeline (equal to it when nothing is
    slowed); event-driven, so slower: the simulator uses it only when ranks outnumber cores."""
    ranks = list(ranks) if ranks is not None else [1] * pp
    # `contention` was measured with `all_ranks` busy (the whole job): a plan that leaves ranks
    # idle never reaches it
    total = float(all_ranks if all_ranks is not None else sum(ranks))
    run = _SharedCoresRun(schedule, pp, stages_per_rank, m, (fwd, bwd, wgt), send_fwd, send_bwd, first_fwd_extra,
                          recv_handshake, _Ledger(pp, pp * stages_per_rank, m, schedule, activation, None, trace))
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
                 recv_handshake, book: "_Ledger"):
        self.ops = structure(schedule, pp, stages_per_rank, m).position_ops
        self.pp, self.last = pp, pp * stages_per_rank - 1
        self.fwd, self.bwd, self.wgt = durations
        self.send_fwd, self.send_bwd = send_fwd, send_bwd
        self.first_fwd_extra, self.recv_handshake = first_fwd_extra, recv_handshake
        self.book = book
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
        elif kind == B:
            ready = b_end[k + 1][j] if k < self.last else f_end[k][j]
            if ready is not None and k < self.last:
                ready += self.send_bwd[k]
                receives = self.send_bwd[k] > 0
            work = self.bwd[k]
        else:
            ready, work = b_end[k][j], self.wgt[k]
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
