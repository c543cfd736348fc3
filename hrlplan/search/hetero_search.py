"""The exact replica search as the planner runs it: the anchored sub-space (the single template's
replicas plus replicas on the nodes it leaves idle, search/hetero_anchor.py) first, then the by-type
sub-space (search/hetero_exact.py), both under one share search and one time budget."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from hrlplan.search.hetero import HeteroSpace, same_tp_required
from hrlplan.search.hetero_anchor import anchored_note, search_anchored
from hrlplan.search.hetero_exact import (DEFAULT_MAX_ROUNDS, DEFAULT_SHARE_STEPS, DEFAULT_TIME_S,
                                         STATE_BYTES_PER_PARAM, TP_ANY, ShareSearch, TemplateTable, enumerate_options,
                                         nproc_candidates, row_grid)


def search_hetero(sim, meta, cluster, planner_cfg: Dict[str, Any], train_cfg, incumbent_s: float,
                  started: Optional[float] = None, single=None) -> Dict[str, Any]:
    """The best plan of the sub-space that beats `incumbent_s` (the single-template optimum; inf if
    none fits), or none; with what was proven. Returns {plan, predicted, replicas, proven, note, ...}.
    planner.hetero_time_s bounds the planning time from `started` (default: now), the search
    included; beyond it the result is the best found and says it is not proven. `single`: the
    single-template optimum (a Scored; default: what search_exact_until found with `sim`), whose
    replicas anchor the second sub-space (hetero_anchor.py)."""
    t0 = time.perf_counter()
    whole = float(planner_cfg.get("hetero_time_s", DEFAULT_TIME_S))
    # what the single-template search left, but never under a quarter of it (that search alone may
    # take most of the budget on large clusters: the replica search still gets its turn)
    budget_s = max(whole - (t0 - (started or t0)), whole / 4)
    steps = int(planner_cfg.get("hetero_share_steps", DEFAULT_SHARE_STEPS))
    global_batch = int(train_cfg.global_batch_size)
    # bounding every option gets half the budget (what is left then goes to templates and plans), so
    # that a large instance still assembles plans from the options bounded so far
    table = TemplateTable(sim, meta, cluster, planner_cfg, train_cfg, t0 + budget_s / 2)
    table.search_deadline = t0 + budget_s   # a template search stops there (its best so far, unproven)
    tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= int(planner_cfg.get("max_tp", 8)) and meta.num_heads % tp == 0] \
        if same_tp_required(meta) else [TP_ANY]
    spaces = {n: HeteroSpace(cluster, n) for n in nproc_candidates(cluster)}
    table.bind(spaces)
    limit = f"planner.hetero_time_s={planner_cfg.get('hetero_time_s', DEFAULT_TIME_S)} s"
    search = ShareSearch(sim, meta, cluster, str(train_cfg.schedule), global_batch, spaces, table, t0 + budget_s,
                         int(planner_cfg.get("hetero_max_rounds", DEFAULT_MAX_ROUNDS)), limit, incumbent_s)
    # first the replicas of the single template plus replicas on the devices it leaves idle: a plan
    # from few template searches, where the by-type sub-space may not assemble one in time
    anchored = search_anchored(search, single, steps, tps)
    n_options, gave_up = anchored["options"], anchored["gave_up"]
    for nproc, space in spaces.items():
        options = enumerate_options(table, space, global_batch, steps, tps)
        n_options += len(options)
        if table.out_of_time:
            gave_up = gave_up or f"{limit} ran out while the replica templates were bounded"
        if options:
            gave_up = search.assess(options) or gave_up
    proven = not gave_up and table.unproven == 0
    sub_space = describe_sub_space(row_grid(global_batch, steps), sorted(spaces), tps != [TP_ANY])
    if anchored["sub_space"]:
        sub_space = f"{sub_space}; and {anchored['sub_space']}"
    note = (f"optimal under the simulator over the sub-space: {sub_space}" if proven else
            f"gave up ({gave_up or 'a replica template search ran out of budget'}); best of what was searched in "
            f"the sub-space {sub_space}, not proven")
    if n_options == 0:
        note += "; " + what_did_not_fit(table, spaces, global_batch)
    note += "; " + anchored_note(anchored["info"])
    best = search.best
    return {"plan": best and best[0], "predicted": best and best[1], "replicas": best and best[2],
            "proven": proven, "note": note, "sub_space": sub_space, "rounds": search.rounds,
            "template_searches": table.searches, "options": n_options, "time_s": time.perf_counter() - t0,
            "out_of_time": table.out_of_time or "hetero_time_s" in gave_up, "anchored": anchored["info"],
            "nproc_per_node": sorted(spaces)}


def what_did_not_fit(table: TemplateTable, spaces: Dict[int, HeteroSpace], global_batch: int) -> str:
    """Where no option of the sub-space fits: per device type, its largest replica and why (its
    devices cannot hold the training state, or no configuration of it fits with one grid row's
    activations), in one line."""
    parts = []
    for nproc, space in spaces.items():
        for t in space.types:
            shape = max(space.replica_shapes(t), key=lambda s: (s.size, s.per_node))
            key = (nproc, t, shape, row_grid(global_batch, DEFAULT_SHARE_STEPS)[0], TP_ANY)
            devices = space.shape_devices(t, shape, 0)
            sim = table.sim
            capacity = sum(sim.devices.memory_limit(d, sim.opts.memory_margin) for d in devices)
            need = STATE_BYTES_PER_PARAM * float(table.meta.total_params)
            why = (f"its {len(devices)} devices hold {capacity / 2**30:.0f} GiB, the state needs {need / 2**30:.0f} GiB"
                   if not table.may_hold_state(key) else
                   f"no configuration of its {len(devices)} devices fits (state and activations)")
            parts.append(f"{t} at nproc {nproc}: {why}")
    return "no replica of the sub-space fits: " + "; ".join(parts)


def describe_sub_space(grid: List[int], nprocs: List[int], one_tp: bool) -> str:
    """The sub-space exact proves over, as plan_info.json's planner.heterogeneous.sub_space says it."""
    return (f"replicas grouped by device type (per type: k replicas of one shape -- q devices on each of j "
            f"nodes, q dividing nproc-per-node: a node slice, whole nodes or a slice across nodes -- one "
            f"template, equal rows per replica on a grid of {grid[0]} rows (B/{len(grid)})), "
            f"one nproc-per-node out of {nprocs}" + ("; one tp degree across replicas (GPT-2)" if one_tp else "") +
            "; each template the exact planner's optimum for its replica (where no template holds the "
            "replica's whole optimizer state: with that state sharded over the largest power of two <= the type's "
            "k >= 2 replicas); each "
            "plan predicted with the faster of the replicated and the sharded optimizer across replicas")
