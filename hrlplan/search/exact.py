"""Exact planner: enumerate every high-level Config; for each, the min-max DP finds the least
achievable bottleneck over all layer splits, a second DP the least total time among splits within
a small slack of it, and the simulator scores those few splits.

The DP is exact for its objective (the bottleneck stage's busy time per micro-batch, with the
fill/drain total as tie-break); the final choice is the simulator's. tests/test_planner.py checks
the result against brute force over every split. When the DP would touch more than
max_evaluations (stage, span) cells the planner gives up on exactness, says so, and searches
configurations in order of a cheap lower bound until the budget is spent.
"""
from __future__ import annotations

import time
from typing import Any, Dict

from hrlplan.search.common import Scored, Tracker
from hrlplan.search.splits import SplitTables


def lower_bound(sim, space, config) -> float:
    """No plan of this config is faster than its whole work spread perfectly over its devices."""
    meta = sim.meta
    tokens = space.global_batch * meta.seq_len
    flops = tokens * meta.training_flops_per_token()
    devs = [d for g in space.groups(config) for d in g]
    rate = sum(sim.devices.throughput(d, config.microbatch_size * meta.seq_len) for d in devs)
    return flops / rate * sim.devices.time_scale


def search_exact(sim, space, planner_cfg: Dict[str, Any]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    budget = int(planner_cfg.get("max_evaluations", 2_000_000))
    configs = list(space.configs())
    L = sim.meta.n_layer
    planned_cells = sum(c.n_stages * L * (L + 1) // 2 for c in configs)
    bounds = {c: lower_bound(sim, space, c) for c in configs}
    # Promising configurations first (bound x the equal-stage bubble factor), so that a good
    # incumbent prunes the rest early; the pruning itself only uses the rigorous bounds.
    configs.sort(key=lambda c: bounds[c] * (c.num_microbatches + c.pp - 1) / c.num_microbatches)
    tracker = Tracker()
    cells = 0
    skipped = 0
    gave_up = False
    for c in configs:
        if tracker.best is not None and bounds[c] >= tracker.best.time:
            skipped += 1  # provably no better: its whole work spread perfectly already loses
            continue
        if cells >= budget:
            gave_up = True
            break
        tables = SplitTables(sim, space, c)
        cells += tables.cells
        bottleneck = tables.minmax()
        # Every split keeps some stage busy >= bottleneck for each of the m micro-batches.
        if tracker.best is not None and c.num_microbatches * bottleneck * sim.devices.time_scale >= tracker.best.time:
            skipped += 1
            continue
        for spans in tables.candidates():
            layout = space.layout(c, spans)
            tracker.offer(Scored(layout, sim.evaluate(layout), c))
    searched = not gave_up
    note = ("optimal over every configuration and layer split (min-max DP; pruned configurations are provably "
            "slower)" if searched else
            f"gave up after {cells:,} DP cells (max_evaluations={budget:,}; all configurations need up to "
            f"{planned_cells:,}); the result is the best of the most promising configurations, not proven optimal")
    return {"tracker": tracker, "evaluations": sim.evaluations, "dp_cells": cells, "configs": len(configs),
            "configs_pruned_by_bound": skipped, "proven_optimal": searched, "note": note,
            "time_s": time.perf_counter() - t0}
