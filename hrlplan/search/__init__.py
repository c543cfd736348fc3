"""Planners: exact (enumeration + min-max DP), hrl (hierarchical policy), random, manual.

    plan, info = make_plan(meta, cluster, planner_cfg, train_cfg)

planner_cfg: the planner's settings, a mapping (like Config.planner: its schema depends on the
planner chosen, see hrlplan.config's planner dataclasses); train_cfg: the TrainConfig (or its plain
mapping) -- global_batch_size, schedule, stages_per_rank, microbatches ("auto" or an int), dtype, dp_mode.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from typing import Any, Dict, Tuple

from hrlplan.config import TrainConfig, section
from hrlplan.cost.model import Layout
from hrlplan.cost.plans import layout_of_plan, predict_any_plan, rank_devices
from hrlplan.cost.simulator import SimResult, Simulator
from hrlplan.errors import UserError
from hrlplan.plan import Plan, check_fits
from hrlplan.search.common import Scored, cost_options, describe, why_better
from hrlplan.search.exact import search_exact
from hrlplan.search.hetero import (BOTH_OPTIMIZERS, hetero_mode, hetero_plan, hetero_summary, wants_hetero,
                                   why_not_hetero)
from hrlplan.search.hetero_exact import DEFAULT_TIME_S
from hrlplan.search.hetero_search import search_hetero
from hrlplan.search.hetero_single import single_template_search
from hrlplan.search.hrl_replicas import search_hrl_replicas
from hrlplan.search.hrl import search_hrl
from hrlplan.search.random_search import search_random
from hrlplan.search.space import SearchSpace, _plain, to_plan

PLANNERS = ("exact", "hrl", "random", "manual")


def make_plan(meta, cluster, planner_cfg: Dict[str, Any], train_cfg: TrainConfig) -> Tuple[Plan, Dict[str, Any]]:
    """Returns (validated Plan, info dict for plan_info.json)."""
    cfg, train_cfg = dict(planner_cfg), section(TrainConfig, train_cfg)
    name = str(cfg.get("name", "exact"))
    if name not in PLANNERS:
        raise UserError(f"planner.name '{name}' is unknown; choose one of {', '.join(PLANNERS)}")
    t0 = time.perf_counter()
    sim = Simulator(meta, cluster, cost_options(cfg, train_cfg))
    if name == "manual":
        return _manual(meta, cluster, cfg, sim, t0)
    space = SearchSpace(meta, cluster, cfg, train_cfg)
    space.sim = sim
    if name == "exact":
        out = _single_template_exact(sim, space, cfg, cluster, train_cfg, t0)
    elif name == "random":
        out = search_random(sim, space, cfg)
    else:
        out = search_hrl(sim, space, cfg)
    tracker = out.pop("tracker")
    hetero = _hetero_search(meta, cluster, cfg, train_cfg, sim, name, tracker, t0)
    if hetero is not None and hetero.get("plan") is not None:
        return _hetero_result(meta, cluster, sim, tracker, out, hetero, name, cfg, t0)
    if tracker.best is None:
        over_memory = least_memory_need(sim, space)
        if over_memory:
            note = (hetero or {}).get("note") or ""
            replicas = note[note.index("no replica"):] if "no replica" in note else ""   # per device type
            over_memory = f"{over_memory}; {replicas}" if replicas else over_memory
            raise UserError(f"no plan fits {meta.name} on {cluster.summary()}: {over_memory}. Try more devices, "
                            "train.dtype=bfloat16, a smaller global_batch_size, a larger planner.max_pp, or "
                            "planner.memory_margin closer to 1")
        why = tracker.first_reason or "no configuration satisfies the batch/micro-batch constraints"
        raise UserError(f"no feasible plan for {meta.name} on {cluster.summary()}: {why}. Try a smaller "
                        "global_batch_size or microbatch sizes, bfloat16, more devices, or a larger planner.max_pp")
    best = tracker.best
    detail = sim.evaluate(best.layout, detail=True)
    planner_meta = {"name": name, "evaluations": out.get("evaluations", sim.evaluations),
                    "time_s": time.perf_counter() - t0, "seed": cfg.get("seed", 0),
                    **{k: v for k, v in out.items() if k not in ("evaluations", "time_s", "history")}}
    if hetero is not None:
        planner_meta["heterogeneous"] = hetero_info(hetero)
    plan = to_plan(meta, cluster, best.layout, detail, planner_meta)
    if cluster.source in ("probe", "file") and plan.world_size != cluster.world_size:
        raise AssertionError(f"planner used {plan.world_size} of {cluster.world_size} probed workers")
    info = _info(meta, cluster, sim, best, detail, tracker.runner_up, planner_meta, out.get("history"))
    return plan, info


LEAST_NEED_BUDGET_S = 10.0


def least_memory_need(sim, space) -> str:
    """When nothing fits: over every configuration (at its even layer split), the one whose worst
    device is least over its memory, as "smallest need X GiB on device Y, capacity Z"; "" when
    some configuration fits or none exists."""
    L = sim.meta.n_layer
    best, cut = None, False
    # the refusal must come quickly: a 516-GPU space scored in full took most of a 151 s "no plan fits"
    deadline = time.perf_counter() + LEAST_NEED_BUDGET_S
    for c in space.configs():
        if time.perf_counter() > deadline:
            cut = True
            break
        bounds = [round(i * L / c.n_stages) for i in range(c.n_stages + 1)]
        result = sim.evaluate(space.layout(c, list(zip(bounds[:-1], bounds[1:]))))
        if result.feasible:
            return ""
        worst = max(((need / sim.devices.memory_limit(d, sim.opts.memory_margin), d, need)
                     for d, need in result.memory_bytes.items()), default=None)
        if worst is not None and (best is None or worst[0] < best[0]):
            best = worst
    if best is None:
        return ""
    _, d, need = best
    dev = sim.cluster.devices[d]
    limit = sim.devices.memory_limit(d, sim.opts.memory_margin)
    scored = f" (of the configurations scored in {LEAST_NEED_BUDGET_S:g} s)" if cut else ""
    return (f"smallest need{scored} {need / 2**30:.2f} GiB on device {d} ({dev.name}), capacity "
            f"{limit / 2**30:.2f} GiB ({sim.opts.memory_margin:g} x {dev.memory_bytes / 2**30:.2f} GiB)")


def _info(meta, cluster, sim, best: Scored, detail, runner_up, planner_meta, history=None) -> Dict[str, Any]:
    info = {
        "model": meta.name, "cluster": cluster.summary(), "cluster_devices": cluster.world_size, "planner": planner_meta,
        "chosen": {"summary": describe(best.layout), "step_time_s": detail.step_time_s,
                   "bubble_fraction": detail.bubble_fraction, "breakdown": detail.breakdown, "stages": detail.stages},
        "runner_up": None,
        "why": why_better(sim, best, runner_up),
    }
    if runner_up is not None:
        r = sim.evaluate(runner_up.layout, detail=True)
        info["runner_up"] = {"summary": describe(runner_up.layout), "step_time_s": r.step_time_s,
                             "breakdown": r.breakdown, "layout": {"spans": runner_up.layout.spans,
                                                                   "groups": runner_up.layout.groups}}
    if history:
        info["best_step_time_history"] = history[-200:]
    return _plain(info)


def layout_of(plan: Plan) -> Layout:
    """A plan back in the simulator's terms (plan ranks -> cluster devices via meta.launch)."""
    return layout_of_plan(plan)


def _manual(meta, cluster, cfg, sim, t0) -> Tuple[Plan, Dict[str, Any]]:
    if not cfg.get("plan_file"):
        raise UserError("planner=manual needs planner.plan_file=<plan.yaml>")
    plan = Plan.load(cfg["plan_file"])
    if plan.n_layer != meta.n_layer:
        raise UserError(f"{cfg['plan_file']}: n_layer is {plan.n_layer} but the model {meta.name} has "
                        f"{meta.n_layer} blocks; re-plan for this model (or set the arch's depth to {plan.n_layer})")
    if plan.heterogeneous or not plan.uniform_tp:
        # Layouts cannot express it: the cost model's per-pipeline prediction (cross-replica reduce included)
        any_plan = predict_any_plan(plan, meta, cluster, sim=sim)
        devices = rank_devices(plan)
        result = SimResult(any_plan["feasible"], any_plan["step_time_s"], reason=any_plan["reason"],
                           over_memory=bool(any_plan.get("time_only")),
                           bubble_fraction=any_plan["bubble_fraction"],
                           memory_bytes={devices[r]: m for r, m in enumerate(any_plan["memory_bytes_per_rank"])},
                           breakdown=dict(any_plan["breakdown"], memory_bytes_per_device={}),
                           stages=any_plan["stages"])
    else:
        result = sim.evaluate(layout_of(plan), detail=True)
    over_memory = not result.feasible and result.over_memory
    if over_memory:
        if not cfg.get("allow_over_memory"):
            raise UserError(f"{cfg['plan_file']} does not fit: {result.reason}. Use more pipeline stages, a smaller "
                            "microbatch_size, recomputation or bfloat16 -- or planner.allow_over_memory=true to "
                            "run it anyway")
        # a time-only prediction: the same plan with memory left unchecked
        oom_reason = result.reason
        unchecked = Simulator(meta, cluster, dataclasses.replace(sim.opts, memory_margin=float("inf")))
        memory = result.memory_bytes
        result = unchecked.evaluate(layout_of(plan), detail=True) if plan.uniform_tp and not plan.heterogeneous \
            else result
        result.memory_bytes = memory or result.memory_bytes
    if result.feasible or (over_memory and math.isfinite(result.step_time_s)):   # a time-only figure too
        predicted = plan.meta.setdefault("predicted", {})
        predicted.update({"step_time_s": result.step_time_s, "bubble_fraction": result.bubble_fraction,
                          "memory_bytes_per_rank": [int(result.memory_bytes.get(d, 0)) for d in rank_devices(plan)],
                          "breakdown": _plain({k: v for k, v in result.breakdown.items()
                                               if k != "memory_bytes_per_device"})})
    plan.meta["planner"] = {"name": "manual", "evaluations": 1, "time_s": time.perf_counter() - t0,
                            "plan_file": str(cfg["plan_file"]),
                            "simulator": (f"allowed over memory: {oom_reason}" if over_memory else
                                          "fits" if result.feasible else result.reason)}
    if not over_memory:
        check_fits(plan, cluster, source=str(cfg["plan_file"]))
    info = {"model": meta.name, "cluster": cluster.summary(), "cluster_devices": cluster.world_size,
            "planner": plan.meta["planner"],
            "chosen": {"summary": describe(layout_of(plan)), "step_time_s": result.step_time_s,
                       "breakdown": result.breakdown, "stages": result.stages},
            "runner_up": None, "why": {"text": "a manual plan: no search was run"}}
    return plan, _plain(info)


# ---------------------------------------------------------------- heterogeneous replicas
def _single_template_exact(sim, space, cfg, cluster, train_cfg, t0) -> Dict[str, Any]:
    """search_exact; where the replica search follows, bounded by work instead (search/hetero_single.py:
    the same template at any load -- the one bench/hetero.py compares the planned plan with)."""
    if not wants_hetero(cfg, cluster) or why_not_hetero(train_cfg):
        return search_exact(sim, space, cfg)
    return single_template_search(sim, space, cfg)


def _hetero_search(meta, cluster, cfg, train_cfg, sim, name, tracker, t0):
    """The replica search where planner.heterogeneous asks for it (auto: several device types or node
    sizes): exact's search_hetero (the learned policy where it cannot prove), or under planner=hrl the
    learned replica policy alone; the single-template result is the bar. None where it does not run."""
    mode = hetero_mode(cfg)
    if not wants_hetero(cfg, cluster):
        return None
    if name not in ("exact", "hrl"):
        if mode == "true":
            raise UserError(f"planner.heterogeneous=true needs planner.name=exact or hrl (the heterogeneous-replica "
                            f"searches are theirs); planner.name is {name}")
        return None
    reason = why_not_hetero(train_cfg)
    if reason:
        if mode == "true":
            raise UserError(f"planner.heterogeneous=true cannot plan replicas: {reason}")
        return {"plan": None, "skipped": reason}
    if importlib.util.find_spec("highspy") is None:
        if mode == "true":
            raise UserError("planner.heterogeneous=true needs the highspy package (pip install highspy)")
        return {"plan": None, "skipped": "the highspy package is not installed (pip install highspy)"}
    # no incumbent: the best replica plan is found (and reported) even where the single template wins;
    # a quarter of the time stays for the learned replica policy where exact cannot prove its sub-space
    whole = float(cfg.get("hetero_time_s", DEFAULT_TIME_S))
    if name == "hrl":
        hetero = _learned_replicas_only(sim, meta, cluster, cfg, train_cfg, time.perf_counter() + whole)
    else:
        hetero = search_hetero(sim, meta, cluster, dict(cfg, hetero_time_s=whole * 0.75), train_cfg, float("inf"),
                               started=t0, single=tracker.best)
        if not hetero["proven"]:
            hetero = _with_learned_replicas(sim, meta, cluster, cfg, train_cfg, hetero, t0 + whole)
    if hetero["plan"] is not None and hetero.get("replicas"):
        # the searches assess plans with the replicated optimizer; the sharded one may be faster
        hetero["plan"], hetero["predicted"] = hetero_plan(meta, cluster, hetero["replicas"], str(train_cfg.schedule),
                                                          {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
    single = tracker.best.time if tracker.best is not None else float("inf")
    if hetero["plan"] is not None and hetero["predicted"]["step_time_s"] >= single:
        hetero["lost"] = lost_on(sim, hetero, tracker.best)
        hetero["plan"] = None
    return hetero


def _learned_replicas_only(sim, meta, cluster, cfg, train_cfg, deadline: float) -> Dict[str, Any]:
    """planner=hrl on a heterogeneous cluster: the learned replica policy's plan (search/hrl_replicas.py:
    the high level groups devices into replicas, the low level splits them), zero-shot, no proof."""
    learned = search_hrl_replicas(sim, meta, cluster, cfg, train_cfg, calls=10 ** 9, deadline=deadline)
    plan = learned["plan"]
    predicted = predict_any_plan(plan, meta, cluster, sim=sim) if plan is not None else None
    found = "its best plan" if plan is not None else "no replica plan that fits"
    return {"plan": plan, "predicted": predicted, "replicas": learned.get("replicas"), "proven": False,
            "note": f"the learned replica policy (search/hrl_replicas.py), zero-shot: {found} in "
                    f"{learned['calls']} simulator calls; not a proof (planner=exact proves a sub-space)",
            "sub_space": "sampled by the learned replica policy", "rounds": learned["calls"], "template_searches": 0,
            "options": 0, "time_s": learned["time_s"], "nproc_per_node": [], "out_of_time": False,
            "learned_replicas": {k: learned[k] for k in ("step_time_s", "calls", "time_s", "low_level", "decisions")}}


def _with_learned_replicas(sim, meta, cluster, cfg, train_cfg, hetero: Dict[str, Any], deadline: float):
    """hetero_exact's result, or the learned replica policy's plan (search/hrl_replicas.py) where it is
    faster: exact could not prove its sub-space, so the policy's sample of a wider one may win."""
    learned = search_hrl_replicas(sim, meta, cluster, cfg, train_cfg, calls=10 ** 9, deadline=deadline)
    hetero["learned_replicas"] = {k: learned[k] for k in ("step_time_s", "calls", "time_s", "low_level", "decisions")}
    mine = hetero["predicted"]["step_time_s"] if hetero["plan"] is not None else float("inf")
    if learned["plan"] is None or learned["step_time_s"] >= mine:
        return hetero
    plan = learned["plan"]
    predicted = predict_any_plan(plan, meta, cluster, sim=sim)
    hetero.update(plan=plan, predicted=predicted, replicas=learned["replicas"],
                  note=hetero["note"] + "; the plan is the learned replica policy's (search/hrl_replicas.py), "
                                        "faster than the best found in the sub-space")
    return hetero


def lost_on(sim, hetero: Dict[str, Any], single: Scored) -> Dict[str, Any]:
    """The best replica plan against the single template: its time and where it lost (the
    components of the simulator's step, replica plan minus single template, largest first)."""
    mine = hetero["predicted"]["breakdown"]
    theirs = sim.evaluate(single.layout, detail=True).breakdown
    sync = mine.get("cross_replica_reduce_exposed_s", 0.0) + mine.get("dp_comm_exposed_s", 0.0)
    parts = {"sync_s": sync - theirs.get("dp_comm_exposed_s", 0.0),
             "bubble_s": mine.get("bubble_s", 0.0) - theirs.get("bubble_s", 0.0),
             "compute_s": mine.get("compute_s", 0.0) - theirs.get("compute_s", 0.0),
             "p2p_comm_s": mine.get("p2p_comm_s", 0.0) - theirs.get("p2p_comm_s", 0.0),
             "tp_comm_s": mine.get("tp_comm_s", 0.0) - theirs.get("tp_comm_s", 0.0),
             # each replica steps its whole model where FSDP shards the step over dp
             "optimizer_s": mine.get("optimizer_s", 0.0) - theirs.get("optimizer_s", 0.0)}
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    return {"summary": hetero_summary(hetero["replicas"]), "step_time_s": hetero["predicted"]["step_time_s"],
            "single_template_step_time_s": single.time, "lost_on_s": dict(ranked),
            "lost_mostly_on": ranked[0][0][:-2] if ranked[0][1] > 0 else "nothing (ties)"}


def hetero_info(hetero: Dict[str, Any]) -> Dict[str, Any]:
    """plan_info.json's planner.heterogeneous: what the replica search proved, or why it did not run."""
    if "skipped" in hetero:
        return {"ran": False, "why": hetero["skipped"]}
    keys = ("proven", "note", "sub_space", "rounds", "template_searches", "options", "time_s", "nproc_per_node",
            "out_of_time")
    out = {"ran": True, **{k: hetero[k] for k in keys}}
    if "learned_replicas" in hetero:
        out["learned_replicas"] = hetero["learned_replicas"]
    if "anchored" in hetero:   # the single template's replicas plus the idle nodes' (search/hetero_anchor.py)
        out["anchored"] = hetero["anchored"]
    if "lost" in hetero:
        out["best_replica_plan"] = hetero["lost"]
    out["chosen"] = "heterogeneous replicas" if hetero.get("plan") is not None else \
        "the single-template plan (no replica plan of the sub-space is faster)"
    return out


def _hetero_result(meta, cluster, sim, tracker, out, hetero, name, cfg, t0) -> Tuple[Plan, Dict[str, Any]]:
    plan, predicted = hetero["plan"], hetero["predicted"]
    planner_meta = {"name": name, "evaluations": sim.evaluations, "time_s": time.perf_counter() - t0,
                    "seed": cfg.get("seed", 0),
                    **{k: v for k, v in out.items() if k not in ("evaluations", "time_s", "history")},
                    "proven_optimal": bool(out.get("proven_optimal")) and hetero["proven"],
                    "heterogeneous": hetero_info(hetero)}
    planner_meta["note"] = hetero["note"]
    plan.meta["planner"] = _plain(planner_meta)
    check_fits(plan, cluster, source="heterogeneous planner")
    summary = hetero_summary(hetero["replicas"])
    chosen = {"summary": summary, "step_time_s": predicted["step_time_s"],
              "bubble_fraction": predicted["bubble_fraction"], "breakdown": predicted["breakdown"],
              "stages": predicted["stages"]}
    info = {"model": meta.name, "cluster": cluster.summary(), "cluster_devices": cluster.world_size,
            "planner": planner_meta, "chosen": chosen, "runner_up": None}
    single = tracker.best
    if single is None:
        info["why"] = {"text": f"{summary}: no single template fits {meta.name} on {cluster.summary()}"}
    else:
        r = sim.evaluate(single.layout, detail=True)
        info["runner_up"] = {"summary": describe(single.layout), "step_time_s": r.step_time_s,
                             "breakdown": r.breakdown, "layout": {"spans": single.layout.spans,
                                                                  "groups": single.layout.groups}}
        gain = r.step_time_s / predicted["step_time_s"] - 1
        info["why"] = {"text": f"{summary} takes {predicted['step_time_s'] * 1e3:.4g} ms per step vs the best single "
                               f"template {describe(single.layout)} at {r.step_time_s * 1e3:.4g} ms ({gain:+.1%} "
                               f"slower); cross-replica gradient reduce "
                               f"{predicted['breakdown'].get('cross_replica_reduce_s', 0.0) * 1e3:.3g} ms",
                       "runner_up_step_time_s": r.step_time_s}
    return plan, _plain(info)
