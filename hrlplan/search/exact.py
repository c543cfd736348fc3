"""Exact planner: the simulator's best plan over every high-level Config and every layer split.

For each Config (pool, device-group order, pp/tp/dp, micro-batching, schedule) the min-max DP
over `SplitTables` proposes a few good splits (least bottleneck, then least fill/drain), which
set an incumbent; then a branch-and-bound simulates every split whose lower bound on the step
time beats the incumbent (see SplitTables.splits_below). The bounds are built from the
simulator's own base durations, so a split or Config left unsimulated is provably no faster:
the result is the simulator's optimum, not the DP's. tests/test_planner.py checks it against
brute force over every split, and against HRL and random search on generated instances.

Budgets: max_evaluations caps DP cells, max_simulations the simulator calls of the
branch-and-bound. Beyond either the planner says it gave up and does not claim optimality.

A packed-documents run (data.packing=document|balanced; the caller puts the corpus's lengths in
planner_cfg["packed_lengths"]: LengthDistribution.to_dict() plus "packing") trains micro-batches whose
work depends on the documents they hold, so the fixed-length step is not what it trains: the search
keeps its PACKED_TOP_K fastest candidates and re-ranks them by their mean packed step
(cost/lengths.rank_by_packed_step: steps sampled from the corpus, packed as the run packs them, through
the simulator's timeline with each micro-batch's own work). The optimum is then the fixed-length
search's, re-ranked, not proven under the packed step.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

from hrlplan import schedules
from hrlplan.cost.lengths import LengthDistribution, rank_by_packed_step
from hrlplan.search.common import Scored, Tracker
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.search.splits import SplitTables

DEFAULTS = ExactPlannerConfig()
# how many of the fastest fixed-length candidates a packed run's step re-ranks (each costs a dozen
# sampled steps, each dispatched and simulated: about 0.2-1 s a candidate on a CPU)
PACKED_TOP_K = 4
PACKED_SAMPLED_STEPS = 12


def zb_floor(sim, config) -> float:
    """A split backward's calibrated B + W may cost less than one plain backward: bounds shrink with it."""
    if not schedules.get(config.schedule, config.stages_per_rank).split_backward:
        return 1.0
    factors = sim.devices.overheads.zb_backward_factors(config.microbatch_size * sim.meta.seq_len)
    return 1.0 if factors is None else min(1.0, factors[0] + factors[1])


def lower_bound(sim, space, config) -> float:
    """Its whole work spread perfectly over its devices at their nominal rate: an estimate to try
    promising configurations first. Not a proof (the cost model's GEMM efficiency depends on
    shapes and may beat the nominal rate); pruning uses the split tables' bounds only."""
    meta = sim.meta
    tokens = space.global_batch * meta.seq_len
    flops = tokens * meta.training_flops_per_token()
    devs = [d for g in space.groups(config) for d in g]
    rate = sum(sim.devices.throughput(d, config.microbatch_size * meta.seq_len) for d in devs)
    return flops / rate * sim.devices.time_scale * zb_floor(sim, config)


def search_exact(sim, space, planner_cfg: Dict[str, Any]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    budget = int(planner_cfg.get("max_evaluations", DEFAULTS.max_evaluations))
    sim_budget = int(planner_cfg.get("max_simulations", DEFAULTS.max_simulations))
    time_budget = float(planner_cfg.get("max_search_s", DEFAULTS.max_search_s) or float("inf"))
    deadline = t0 + time_budget
    configs = list(space.configs())
    L = sim.meta.n_layer
    planned_cells = sum(c.n_stages * L * (L + 1) // 2 for c in configs)
    bounds = {c: lower_bound(sim, space, c) for c in configs}
    # Promising configurations first (estimate x the equal-stage bubble factor), so that a good
    # incumbent prunes the rest early; the pruning itself only uses the rigorous bounds.
    configs.sort(key=lambda c: bounds[c] * (c.num_microbatches + c.pp - 1) / c.num_microbatches)
    scale = sim.devices.time_scale
    # the simulator's step = (pipeline end + collectives + optimizer + step constant) x scale;
    # everything but a negative calibrated constant only adds to the makespan the bounds cover
    step_floor = min(0.0, sim.devices.overheads.step)
    packed = planner_cfg.get("packed_lengths")
    tracker = Tracker(keep=int(planner_cfg.get("packed_top_k", PACKED_TOP_K)) if packed else 0)
    cells = simulations = skipped = 0
    least_need = float("inf")
    gave_up = ""

    def incumbent_in_table_units() -> float:
        return float("inf") if tracker.best is None else tracker.best.time / scale - step_floor

    def threshold() -> float:
        """The incumbent; past the deadline -inf, which ends the split enumeration at once (its
        partial splits can run long between two simulations: V-shaped schedules' weaker bounds)."""
        nonlocal gave_up
        if time.perf_counter() > deadline and tracker.best is not None:
            gave_up = gave_up or f"max_search_s={time_budget:g} s of branch and bound"
            return float("-inf")
        return incumbent_in_table_units()

    def offer(c, spans, tables) -> None:
        nonlocal simulations
        simulations += 1
        layout = space.layout(c, spans, recompute=tables.recompute_of(spans))
        tracker.offer(Scored(layout, sim.evaluate(layout), c))

    for c in configs:
        if cells >= budget:
            gave_up = f"max_evaluations={budget:,} DP cells (all configurations need up to {planned_cells:,})"
            break
        if time.perf_counter() > deadline and tracker.best is not None:   # past it: keep the first plan found
            gave_up = gave_up or f"max_search_s={time_budget:g} s of branch and bound"
            break
        tables = SplitTables(sim, space, c)
        cells += tables.cells
        bottleneck = tables.minmax()
        if bottleneck == float("inf"):
            least_need = min(least_need, tables.least_memory_need())
            continue
        # Every split keeps some stage busy >= bottleneck for each of the m micro-batches.
        if c.num_microbatches * bottleneck >= incumbent_in_table_units():
            skipped += 1
            continue
        for spans in tables.candidates():
            offer(c, spans, tables)
        if simulations >= sim_budget:
            # out of simulations: the remaining configurations get their DP splits only -- no proof
            # (their branch and bound is skipped whether or not a split beats the incumbent)
            gave_up = gave_up or (f"max_simulations={sim_budget:,} simulator calls in the layer-split search "
                                  "(later configurations were scored at their DP splits only)")
            continue
        for spans in tables.splits_below(threshold):
            if simulations >= sim_budget:
                gave_up = (f"max_simulations={sim_budget:,} simulator calls in the layer-split search "
                           "(later configurations were scored at their DP splits only)")
                break
            offer(c, spans, tables)
    proven = not gave_up
    note = ("optimal under the simulator over every configuration and layer split (branch and bound: "
            "every configuration or split left out is provably slower)" if proven else
            f"gave up after {gave_up}; the result is the best of what was searched, not proven optimal "
            "(raise the budget to search on)")
    out = {"tracker": tracker, "evaluations": sim.evaluations, "dp_cells": cells, "configs": len(configs),
           "split_simulations": simulations, "configs_pruned_by_bound": skipped, "proven_optimal": proven,
           "note": note, "least_memory_need": least_need, "time_s": time.perf_counter() - t0}
    if packed:
        out["packed_rerank"] = rerank_by_packed_step(sim, tracker, packed)
        if out["packed_rerank"].get("chosen_changed"):
            out["note"] += ("; then re-ranked by the packed step of the corpus's documents among the "
                            f"{len(tracker.top)} fastest (not proven under the packed step)")
    out["time_s"] = time.perf_counter() - t0
    return out


def rerank_by_packed_step(sim, tracker: Tracker, packed: Dict[str, Any], seed: int = 0) -> Dict[str, Any]:
    """tracker.best becomes the fastest of tracker.top by the mean packed step (rank_by_packed_step)
    of `packed` ({budget, lengths, packing}); the one it replaces becomes the runner-up. Only one-row
    micro-batches at the corpus's budget are costed packed; where the fixed-length best is not one,
    nothing is re-ranked (`skipped` says why). Returns what plan_info.json records."""
    distribution = LengthDistribution.from_dict(packed)
    packing = str(packed.get("packing", "balanced"))
    best = tracker.best
    if best is None:
        return {"skipped": "no feasible candidate"}
    why = _why_not_packed(best.layout, sim, distribution)
    if why:
        return {"skipped": why}
    candidates = [s for s in tracker.top if not _why_not_packed(s.layout, sim, distribution)]
    ranked = rank_by_packed_step(sim, [s.layout for s in candidates], distribution, packing,
                                 steps=PACKED_SAMPLED_STEPS, seed=seed)
    chosen = candidates[ranked[0][1]]
    out = {"packing": packing, "candidates": len(candidates), "sampled_steps": PACKED_SAMPLED_STEPS,
           "ranked": [{"rank_by_fixed_step": i, "fixed_step_s": candidates[i].time, "packed_step_s": t}
                      for t, i in ranked],
           "chosen_changed": chosen is not best}
    if chosen is not best:
        tracker.runner_up, tracker.best = best, chosen
    return out


def _why_not_packed(layout, sim, distribution: LengthDistribution) -> Optional[str]:
    if layout.microbatch_size != 1:
        return f"micro-batches of {layout.microbatch_size} rows (packed steps are costed for one-row micro-batches)"
    if sim.meta.seq_len != distribution.budget:
        return f"costed at {sim.meta.seq_len} tokens, the corpus's pieces at {distribution.budget}"
    return None
