"""Each schedule's order: the operations every pipeline position runs, in the order the schedule
prescribes, one generator per order family of the registry (hrlplan.schedules.Order) in
ORDER_GENERATORS. structure() builds and caches one order with a topological order of all its
operations, for hrlplan.cost.timeline to replay with durations.

Operations are (kind, model stage, micro-batch): F forward, B backward (in a split-backward schedule
its input-gradient half), W the weight-gradient half, BW a whole backward (B then W as one action)
inside a split-backward schedule (DualPipeV's).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

from hrlplan import schedules
from hrlplan.schedules import Order

F, B, W, BW = 0, 1, 2, 3   # BW: a whole backward (B then W as one action) inside a split-backward schedule
# Fraction of a stage's activations that zero-bubble keeps after B for the later W pass (the
# inputs of the weight-gradient matmuls).
ZB_W_ACTIVATION_SHARE = 0.3
Op = Tuple[int, int, int]   # (kind, model stage, micro-batch)


def virtual_stage(schedule: str, pp: int, stages_per_rank: int, position: int, chunk: int) -> int:
    """Which model stage a position runs as its chunk-th stage (the registry's placement)."""
    return schedules.get(schedule, stages_per_rank).rank_stages(position, pp, stages_per_rank)[chunk]


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


def _v_shape_orders(pp: int, m: int, cap: float) -> List[List[Op]]:
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
    orders: List[List[Op]] = [[] for _ in range(pp)]
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


def _torch_zbv_orders(pp: int, m: int) -> List[List[Op]]:
    """torch.distributed.pipelining's ScheduleZBVZeroBubble order (the runtime's ZB-V), per position:
    warm-up forwards of both legs, then F, B, W of the down leg and of the up leg in turn, W right
    after its B while forwards remain, deferred in the cool-down (its _calculate_single_rank_operations)."""
    n = 2 * pp
    n_micro = max(2 * pp - 1, m)
    orders = []
    for rank in range(pp):
        ops: List[Op] = []
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


def _torch_interleaved_ops(pp: int, v: int, m: int, rank: int, zero_bubble: bool) -> List[Op]:
    """torch's ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble order on one position (their
    _get_1f1b_rank_ops over flexible rounds of max(1, m // pp); the no-op slots it pads with carry no
    order): `warmup` forwards, then one forward one backward; zero bubble: B is the input gradient
    and each W follows its B `rank` backwards later."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    nxt: dict = {F: {}, B: {}, W: {}}
    ops: List[Op] = []
    backward_steps: List[int] = []

    def emit(kind: int, stage: int) -> None:
        j = nxt[kind].get(stage, 0)
        nxt[kind][stage] = j + 1
        ops.append((kind, stage, j))

    for step in range(total + warmup):
        if step < total:
            emit(F, fwd_stage(step))
        if step >= warmup:
            emit(B, bwd_stage(step))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                emit(W, bwd_stage(backward_steps[len(backward_steps) - 1 - rank]))
    if zero_bubble:
        for step in backward_steps[sum(nxt[W].values()):]:
            emit(W, bwd_stage(step))
    return ops


class _DualPipeVRank:
    """One position's actions as torch's ScheduleDualPipeV._calculate_single_rank_operations emits
    them: its counters per (stage, kind) and its queue of deferred weight passes."""

    def __init__(self):
        self.ops: List[Op] = []
        self.next_mb: dict = {}
        self.weights: List[Tuple[int, int]] = []
        self.pairs: List[Tuple[Op, Op]] = []

    def add(self, kind: int, stage: int) -> None:
        counter = B if kind == BW else kind    # a whole backward counts on the input-gradient counter
        j = self.next_mb.get((stage, counter), 0)
        self.next_mb[(stage, counter)] = j + 1
        self.ops.append((kind, stage, j))
        if kind == B:
            self.weights.append((stage, j))

    def add_pair(self, forward_stage: int, backward_stage: int) -> None:
        """One OVERLAP_F_B action: torch sends the forward's output after the whole pair."""
        self.add(F, forward_stage)
        self.add(BW, backward_stage)
        self.pairs.append((self.ops[-2], self.ops[-1]))

    def weight_if_pending(self) -> None:
        if self.weights:
            stage, j = self.weights.pop(0)
            self.ops.append((W, stage, j))


def _dualpipev_orders(pp: int, m: int) -> Tuple[List[List[Op]], List[Tuple[Op, Op]]]:
    """torch's ScheduleDualPipeV (DeepSeek's DualPipe folded into a V): per position, forwards of the
    down leg, then of both legs, then up-leg B/W/F, then the main F0B1-F1B0 pairs -- a forward of
    one micro-batch and a whole backward of another in one OVERLAP_F_B action, which torch 2.13
    runs one after the other unless a custom overlap function is registered, so F then BW here --,
    then whole backwards and, in the second half of the cool-down, split B with the W's deferred."""
    orders, pairs = [], []
    for rank in range(pp):
        r = _DualPipeVRank()
        s0, s1 = rank, 2 * pp - 1 - rank
        for _ in range((pp - rank - 1) * 2):
            r.add(F, s0)
        for _ in range(rank + 1):
            r.add(F, s0)
            r.add(F, s1)
        for _ in range(pp - rank - 1):
            r.add(B, s1)
            r.weight_if_pending()
            r.add(F, s1)
        for i in range(m - pp * 2 + rank + 1):
            if i == 0 and rank == pp - 1:   # torch runs the last position's first pair as two actions
                r.add(F, s0)
                r.add(BW, s1)
            else:
                r.add_pair(s0, s1)
            r.add_pair(s1, s0)
        for _ in range(pp - rank - 1):
            r.add(BW, s1)
            r.add_pair(s1, s0)
        split = False
        for i in range(rank + 1):
            if i == (rank + 1) // 2 and rank % 2 == 1:
                split = True
            r.add(B if split else BW, s1)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                split = True
            r.add(B if split else BW, s0)
        for _ in range(pp - rank - 1):
            r.weight_if_pending()
            r.add(B if split else BW, s0)
        for _ in range(rank + 1):
            r.weight_if_pending()
        orders.append(r.ops)
        pairs.extend(r.pairs)
    return orders, pairs


def _megatron_ops(spec, pp: int, v: int, m: int, pos: int, warmup: int) -> List[Op]:
    """One position's order in the looped family: fill-drain, 1F1B after `warmup` forwards, or ZB-H1
    (1F1B with each W split off its B)."""
    fseq = _interleaved_sequence(pp, v, m, backward=False)
    bseq = _interleaved_sequence(pp, v, m, backward=True)
    chunks = spec.rank_stages(pos, pp, v)
    fops = [(F, chunks[c], j) for c, j in fseq]
    bops = [(B, chunks[c], j) for c, j in bseq]
    if spec.order is Order.FILL_DRAIN:
        return fops + bops
    zero_bubble = spec.order is Order.ZERO_BUBBLE_H1
    ops: List[Op] = list(fops[:warmup])
    deferred: List[Op] = []
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
    position_ops: Tuple[Tuple[Op, ...], ...]
    order: Tuple[Tuple[int, int, int, int], ...]   # (position, kind, stage, micro-batch), topological
    # ((forward op, the op whose end sends it), ...): a forward paired with a backward in one action
    # (DualPipeV's OVERLAP_F_B), whose output torch sends only once the whole pair has run
    sent_after: Tuple[Tuple[Op, Op], ...] = ()


def _topological(position_ops: Sequence[Sequence[Op]], n_stages: int,
                 sent_after: Sequence[Tuple[Op, Op]] = ()) -> List[tuple] | None:
    """Every operation in an order that respects its inputs (None: the orders deadlock). A BW
    provides what a B does; a forward in `sent_after` provides its output once its partner has run."""
    held = {f for f, _ in sent_after}
    releases = {partner: f for f, partner in sent_after}
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
                elif kind in (B, BW):
                    dep = (B, k + 1, j) if k < n_stages - 1 else (F, k, j)
                else:
                    dep = (B, k, j)
                if dep is not None and dep not in done:
                    break
                if (kind, k, j) not in held:
                    done.add((B if kind == BW else kind, k, j))
                if (kind, k, j) in releases:
                    done.add(releases[(kind, k, j)])
                order.append((pos, kind, k, j))
                ptr[pos] += 1
                progress = True
    return order if all(p == len(ops) for p, ops in zip(ptr, position_ops)) else None


def _executable(ops: Sequence[Sequence[Op]], n_stages: int, sent_after: Sequence[Tuple[Op, Op]] = ()) -> Structure | None:
    order = _topological(ops, n_stages, sent_after) if ops else None
    return None if order is None else Structure(tuple(tuple(o) for o in ops), tuple(order), tuple(sent_after))


def _looped_structure(spec, pp: int, v: int, m: int) -> Structure | None:
    if v == 1:
        warm = [min(pp - pos - 1, m) for pos in range(pp)]
    else:  # Megatron's interleaved warm-up
        warm = [min((pp - pos - 1) * 2 + (v - 1) * pp, m * v) for pos in range(pp)]
    # A warm-up too short for an unusual (pp, v, m) would deadlock the static order: lengthen it
    # for the positions that are stuck until the order is executable.
    for _ in range(4 * m * v + 4):
        st = _executable([_megatron_ops(spec, pp, v, m, pos, warm[pos]) for pos in range(pp)], pp * v)
        if st is not None:
            return st
        warm = [min(w + 1, m * v) for w in warm]
    return None


def _zbv_structure(spec, pp: int, v: int, m: int) -> Structure | None:
    st = _executable(_torch_zbv_orders(pp, m), 2 * pp)   # the order the runtime runs, when it is executable
    cap = 2.0 * pp
    while st is None and cap <= 2.0 * pp * m:   # a cap too tight for an unusual (pp, m) would stall: loosen it
        st = _executable(_v_shape_orders(pp, m, cap), 2 * pp)
        cap += 1.0
    return st


def _one_f_one_b_structure(spec, pp: int, v: int, m: int) -> Structure | None:
    """Schedule1F1B's order with one stage per rank; the interleaved classes' own (torch's flexible
    rounds, which equal Megatron's when pp divides m) when the schedule runs on one of them."""
    if spec.uses_multi_stage_class(v):
        zero_bubble = spec.order is Order.ZERO_BUBBLE_H1
        st = _executable([_torch_interleaved_ops(pp, v, m, rank, zero_bubble) for rank in range(pp)], pp * v)
        if st is not None:
            return st
    return _looped_structure(spec, pp, v, m)


def _dualpipev_structure(spec, pp: int, v: int, m: int) -> Structure | None:
    orders, pairs = _dualpipev_orders(pp, m)
    return _executable(orders, 2 * pp, pairs)


# One order generator per order family of the registry (hrlplan.schedules.Order): (spec, pp, v, m) -> Structure.
ORDER_GENERATORS = {
    Order.FILL_DRAIN: _looped_structure,
    Order.ONE_F_ONE_B: _one_f_one_b_structure,
    Order.ZERO_BUBBLE_H1: _one_f_one_b_structure,
    Order.ZBV: _zbv_structure,
    Order.DUALPIPEV: _dualpipev_structure,
}


@lru_cache(maxsize=512)
def structure(schedule: str, pp: int, stages_per_rank: int, m: int) -> Structure:
    spec = schedules.get(schedule, stages_per_rank)
    st = ORDER_GENERATORS[spec.order](spec, pp, stages_per_rank, m)
    if st is None:
        raise RuntimeError(f"no executable order for {schedule} pp={pp} v={stages_per_rank} m={m}")
    return st



