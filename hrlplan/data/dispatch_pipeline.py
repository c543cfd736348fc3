"""The pipeline step that a dispatch's order of micro-batches makes (data/dispatch.py's step_of).

data/ sits below cost/ and cannot ask the planner's simulator; this is its 1F1B recurrence for equal
stages and no sends, in a few lines, so a trainer's dispatch sees the order of its micro-batches. A
caller holding the simulator passes its own step_of instead (cost/lengths.simulated_step_of).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

# (each bin's time, in micro-batch order; the bins) -> the step's time
StepOf = Callable[[Sequence[float], Sequence[Any]], float]


def one_f_one_b(stages: int, forward_share: float = 1.0 / 3.0) -> StepOf:
    """The step of each replica's pipeline of `stages` equal stages running 1F1B, its bins in order
    as its micro-batches (bin time t: forward_share * t / stages forward, the rest backward, on each
    stage), the slowest replica's. Unlike replica_times' flow shop it sees the order: a pipeline's
    fill waits on its first micro-batch's forward, its drain on its last's backward, and in the steady
    state a position runs one micro-batch's backward beside another's forward (lock-step). The
    recurrence of cost/timeline.py's simulate_timeline for 1F1B with no sends (tested equal); a caller
    with the planner's simulator passes its own step_of (cost/lengths.simulated_step_of)."""
    if stages < 1:
        raise ValueError(f"stages must be at least 1 (the pipeline's depth), got {stages}")

    def step_of(times: Sequence[float], bins: Sequence[Any]) -> float:
        per_replica: Dict[int, List[float]] = {}
        for t, b in zip(times, bins):
            per_replica.setdefault(b.replica, []).append(t / stages)
        return max((_one_f_one_b_makespan(ts, stages, forward_share) for ts in per_replica.values()), default=0.0)

    return step_of


def _one_f_one_b_makespan(times: Sequence[float], p: int, forward_share: float) -> float:
    """One pipeline: position q runs min(p - 1 - q, m) forwards, then forward-backward pairs, then
    the remaining backwards; an operation starts when its position is free and its input is ready."""
    m = len(times)
    orders = []
    for q in range(p):
        warm = min(p - 1 - q, m)
        ops = [(0, j) for j in range(warm)]
        for j in range(m - warm):
            ops += [(0, warm + j), (1, j)]
        ops += [(1, j) for j in range(m - warm, m)]
        orders.append(ops)
    f_end = [[-1.0] * m for _ in range(p)]
    b_end = [[-1.0] * m for _ in range(p)]
    free, nxt = [0.0] * p, [0] * p
    left = p * 2 * m
    while left:
        progressed = False
        for q in range(p):
            while nxt[q] < len(orders[q]):
                kind, j = orders[q][nxt[q]]
                if kind == 0:
                    ready = f_end[q - 1][j] if q > 0 else 0.0
                else:
                    ready = b_end[q + 1][j] if q < p - 1 else f_end[q][j]
                if ready < 0:
                    break
                start = max(free[q], ready)
                free[q] = start + times[j] * (forward_share if kind == 0 else 1.0 - forward_share)
                (f_end if kind == 0 else b_end)[q][j] = free[q]
                nxt[q] += 1
                left -= 1
                progressed = True
        if not progressed:   # pragma: no cover (the order above never deadlocks)
            raise RuntimeError(f"1F1B order stalled at pp={p}, m={m}")
    return max(free)
