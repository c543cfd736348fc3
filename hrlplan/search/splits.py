"""Layer-split tables, the min-max dynamic programme over uneven layer spans, and the
branch-and-bound that makes the exact planner exact under the simulator.

For one high-level Config, `SplitTables` costs every (stage, [start, end)) at once with numpy: the
time one micro-batch keeps the stage busy (forward + backward, TP included) and whether the
stage's memory fits its devices given how many micro-batches the schedule keeps in flight there.
The busy times are the simulator's own base durations (alone on shared cores: the shared-cores
timeline only slows them), so a bound built from them never exceeds what the simulator charges.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from hrlplan import schedules
from hrlplan.cost.timeline import simulate_timeline
from hrlplan.schedules import Order

INF = float("inf")


@lru_cache(maxsize=256)
def in_flight(schedule: str, pp: int, stages_per_rank: int, m: int) -> Tuple[float, ...]:
    """Peak micro-batches whose activations a virtual stage holds (unit-time run of the schedule)."""
    n = pp * stages_per_rank
    spec = schedules.get(schedule, stages_per_rank)
    if spec.order is Order.FILL_DRAIN:
        return tuple(float(m) for _ in range(n))
    if spec.order is Order.ONE_F_ONE_B and not spec.uses_multi_stage_class(stages_per_rank):
        return tuple(float(min(m, pp - k)) for k in range(n))
    zb = spec.split_backward
    counts = []
    for k in range(n):
        onehot = [1.0 if i == k else 0.0 for i in range(n)]
        r = simulate_timeline(schedule, pp, stages_per_rank, m, [1.0] * n, [1.0 if zb else 2.0] * n,
                              [1.0 if zb else 0.0] * n, [0.0] * n, [0.0] * n, onehot)
        pos = next(p for p in range(pp) if r.peak_activation[p] > 0) if any(r.peak_activation) else 0
        counts.append(r.peak_activation[pos])
    return tuple(counts)


class SplitTables:
    def __init__(self, sim, space, config):
        self.config = config
        self.groups = space.groups(config)
        L = sim.meta.n_layer
        self.L = L
        n = config.n_stages
        self.n = n
        starts, ends = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
        valid = ends > starts
        flight = in_flight(config.schedule, config.pp, config.stages_per_rank, config.num_microbatches)
        layout_probe = space.layout(config, [(0, 1)] * n, recompute=("none",) * n)
        self.stage_group = [layout_probe.stage_group(k) for k in range(n)]
        self.time = np.full((n, L + 1, L + 1), INF)
        # What a stage adds to the path of the first micro-batch down the pipeline and of the last
        # one back up: forward + backward, or (a split backward, whose weight gradients may come
        # later) the forward alone.
        self.chain = np.full((n, L + 1, L + 1), INF)
        self.static = np.zeros(n)
        self.memory_need = np.full((n, L + 1, L + 1), INF)   # need / limit, for "no plan fits"
        ov = sim.devices.overheads
        # the simulator's base durations: alone where ranks share cores (its timeline only slows
        # them), else at the calibrated contention
        base = {"contention": 1.0, "shared_cores": True} if ov.contention > 1.0 else {}
        split = schedules.get(config.schedule, config.stages_per_rank).split_backward
        bwd_floor = 1.0
        if split:
            factors = ov.zb_backward_factors(config.microbatch_size * sim.meta.seq_len)
            if factors is not None:
                bwd_floor = min(1.0, factors[0] + factors[1])
        self.groups_of_stage = []
        # Per stage and span, the cheapest recomputation mode whose memory fits (none, then
        # selective, then full: each only adds backward time), as SearchSpace.layout picks it.
        modes = space.recompute_modes
        self.mode = np.zeros((n, L + 1, L + 1), dtype=np.int8)
        for k in range(n):
            g = self.groups[layout_probe.stage_group(k)]
            self.groups_of_stage.append(g)
            limit = min(sim.devices.memory_limit(d, sim.opts.memory_margin) for d in g)
            for i in reversed(range(len(modes))):   # the cheapest fitting mode is written last
                c = sim.costs.stage(starts, ends, k == 0, k == n - 1, g, config.tp, config.dp,
                                    config.microbatch_size, config.pp, links=sim.links(g, config.tp, config.dp),
                                    recompute=modes[i], microbatches=config.num_microbatches,
                                    **space.stage_options(config), **base)
                busy = c.fwd + c.bwd * bwd_floor
                need = c.static_memory + flight[k] * c.activation
                fits = valid & (need <= limit)
                if i == len(modes) - 1:   # the most frugal mode tells how far off a stage is
                    self.memory_need[k] = np.where(valid, need / limit, INF)
                self.time[k] = np.where(fits, busy, self.time[k])
                self.chain[k] = np.where(fits, c.fwd if split else busy, self.chain[k])
                self.mode[k] = np.where(fits, i, self.mode[k])
        for table in (self.time, self.chain, self.memory_need):
            for k in range(n):
                table[k, :k, :] = INF
                table[k, :, L - (n - 1 - k) + 1:] = INF
                if k == 0:
                    table[k, 1:, :] = INF
                if k == n - 1:
                    table[k, :, :L] = INF
        self.space_modes = modes
        self.m = config.num_microbatches
        self.interleaved = config.stages_per_rank > 1
        self.positions = [layout_probe.stage_group(k) for k in range(n)]
        self.cells = n * L * (L + 1) // 2

    def minmax(self) -> float:
        """The smallest achievable bottleneck (max over stages of busy time per micro-batch)."""
        best = self.time[0, 0, :].copy()
        for k in range(1, self.n):
            best = np.min(np.maximum(best[:, None], self.time[k]), axis=0)
        return float(best[self.L])

    def min_sum_under(self, threshold: float) -> Optional[List[Tuple[int, int]]]:
        """Among splits whose every stage stays within `threshold`, the one with the least total
        busy time (the pipeline's fill and drain); None if there is none."""
        t = np.where(self.time <= threshold * (1 + 1e-12), self.time, INF)
        best = t[0, 0, :].copy()
        args = []
        for k in range(1, self.n):
            total = best[:, None] + t[k]
            args.append(np.argmin(total, axis=0))
            best = np.min(total, axis=0)
        if not np.isfinite(best[self.L]):
            return None
        ends = [self.L]
        for k in range(self.n - 1, 0, -1):
            ends.append(int(args[k - 1][ends[-1]]))
        bounds = [0] + ends[::-1]  # stage starts in order, then L
        return [(bounds[k], bounds[k + 1]) for k in range(self.n)]

    def candidates(self, slack=(0.0, 0.01, 0.03, 0.1)) -> List[List[Tuple[int, int]]]:
        bottleneck = self.minmax()
        if not np.isfinite(bottleneck):
            return []
        out = []
        for s in slack:
            split = self.min_sum_under(bottleneck * (1 + s))
            if split is not None and split not in out:
                out.append(split)
        return out

    def recompute_of(self, spans) -> Tuple[str, ...]:
        modes = self.space_modes
        return tuple(modes[int(self.mode[k, a, b])] for k, (a, b) in enumerate(spans))

    def least_memory_need(self) -> float:
        """The smallest (need / limit) any split can reach on its worst stage (> 1: nothing fits)."""
        best = self.memory_need[0, 0, :].copy()
        for k in range(1, self.n):
            best = np.min(np.maximum(best[:, None], self.memory_need[k]), axis=0)
        return float(best[self.L])

    def splits_below(self, threshold: Callable[[], float]) -> Iterator[List[Tuple[int, int]]]:
        """Every split whose lower bound on the pipeline's makespan is below `threshold()` (table
        units, read again as the caller's incumbent improves), cheapest-looking first.

        The bound: a stage (non-interleaved) cannot start before the first micro-batch has passed
        every stage before it, then runs its m forwards and backwards one after another, and after
        its last backward the gradient still travels back through the earlier stages:
            makespan >= sum_{k<j} chain_k + m * busy_j.
        Multi-stage ranks (looped or V) run all their virtual stages' work after the first micro-batch
        has passed the stages before their first one (stage pos: position pos's lowest), and their
        last operation is that stage's backward (every higher stage's backward of a micro-batch comes
        before it), whose gradient then travels back: makespan >= sum_{k<pos} chain_k + m * sum of
        their busy.
        Partial splits carry the max over their stages so far, which only grows, and a bound on
        any completion (`_completion`): the last stage's term over the least the remaining stages
        can add, and m times the least bottleneck of the remaining blocks."""
        n, L, m = self.n, self.L, self.m
        load = [0.0] * (max(self.positions) + 1)
        before = [0.0] * len(load)   # per position: the chain of the stages before its first one
        chain_to_last, bottleneck, busy_to_last = self._completion()
        n_positions = len(load)

        def rest(k: int, start: int, prefix: float) -> float:
            """No completion of stages k.. from block `start` on beats this."""
            if k == n:
                return 0.0
            tail = 0.0 if self.interleaved else prefix + chain_to_last[k, start]
            return max(tail, m * bottleneck[k, start])

        def extend(k: int, start: int, prefix: float, bound: float, spans: List[Tuple[int, int]]):
            if k == n:
                yield list(spans)
                return
            ends = range(start + 1, L - (n - 1 - k) + 1) if k < n - 1 else (L,)
            options = []
            for e in ends:
                busy = self.time[k, start, e]
                if not np.isfinite(busy):
                    continue
                if self.interleaved:
                    pos = self.positions[k]
                    b = max(bound, (prefix if k == pos else before[pos]) + m * (load[pos] + busy))
                    # the positions share the whole work: one of them runs at least its mean
                    rest_busy = busy_to_last[k + 1, e] if k < n - 1 else 0.0
                    b = max(b, m * (sum(load) + busy + rest_busy) / n_positions)
                else:
                    b = max(bound, prefix + m * busy)
                b = max(b, rest(k + 1, e, prefix + float(self.chain[k, start, e])))
                options.append((b, e, busy))
            options.sort()
            for b, e, busy in options:
                if b >= threshold():
                    break
                pos = self.positions[k]
                load[pos] += busy
                if k == pos:
                    before[pos] = prefix
                spans.append((start, e))
                yield from extend(k + 1, e, prefix + float(self.chain[k, start, e]), b, spans)
                spans.pop()
                load[pos] -= busy

        yield from extend(0, 0, 0.0, 0.0, [])

    def _completion(self):
        """Per (stage k, start block): the least chain_k + ... + chain_{n-2} + m * busy_{n-1}, the
        least bottleneck and the least total busy over every split of blocks [start, L) into stages
        k..n-1."""
        n, L, m = self.n, self.L, self.m
        chain_to_last = np.full((n + 1, L + 1), INF)
        bottleneck = np.full((n + 1, L + 1), INF)
        busy_to_last = np.full((n + 1, L + 1), INF)
        chain_to_last[n - 1] = m * self.time[n - 1, :, L]
        bottleneck[n - 1] = self.time[n - 1, :, L]
        busy_to_last[n - 1] = self.time[n - 1, :, L]
        for k in range(n - 2, -1, -1):
            chain_to_last[k] = np.min(self.chain[k] + chain_to_last[k + 1][None, :], axis=1)
            bottleneck[k] = np.min(np.maximum(self.time[k], bottleneck[k + 1][None, :]), axis=1)
            busy_to_last[k] = np.min(self.time[k] + busy_to_last[k + 1][None, :], axis=1)
        return chain_to_last, bottleneck, busy_to_last

    def even_split(self) -> List[Tuple[int, int]]:
        b = [round(i * self.L / self.n) for i in range(self.n + 1)]
        return [(b[i], b[i + 1]) for i in range(self.n)]
