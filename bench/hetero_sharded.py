"""What the sharded optimizer across replicas (runtime/hetero_zero.py) buys the heterogeneous planner
on bench/hetero.py's instances where a single template leaves devices idle (issue 35). Pure simulation.

Per instance: the planner as it is (its replica search assesses plans with the replicated optimizer,
the bound it prunes by holds for that one), and every replica plan that search assessed predicted
again with the sharded optimizer (plan.meta replica_optimizer=sharded): the best of them. Each
against the single-template optimum, with the ceiling: all devices' peak FLOP/s over the single
template's devices' (a replica plan as efficient per FLOP as the single template gains at most
that; one that is more efficient, as on HSPMD's cluster, can pass it).

    python bench/hetero_sharded.py --seeds 0,19,21 --presets gpt2 --budget-s 30
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hetero as bench  # noqa: E402  (bench/hetero.py: its instances)
import hrlplan.search.hetero as search_hetero  # noqa: E402
from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.config import TrainConfig, section  # noqa: E402
from hrlplan.cost import replica_sync  # noqa: E402
from hrlplan.cost.plans import predict_any_plan  # noqa: E402
from hrlplan.errors import UserError  # noqa: E402
from hrlplan.search import make_plan  # noqa: E402
from hrlplan.search.common import cost_options  # noqa: E402
from hrlplan.search.config import ExactPlannerConfig  # noqa: E402
from hrlplan.search.instances import load_meta, load_preset_config  # noqa: E402

KEYS = ("pipeline_end_s", "cross_replica_reduce_s", "cross_replica_reduce_exposed_s", "optimizer_s",
        "optimizer_gather_exposed_s", "bubble_fraction")


def single_devices(plan, info):
    """The cluster devices the single-template optimum uses."""
    if plan.heterogeneous:
        single = info["runner_up"]
        return None if single is None else [d for g in single["layout"]["groups"] for d in g]
    used = set(range(plan.world_size)) - set(plan.unused_ranks)
    return [plan.meta["launch"]["rank_to_device"][r] for r in sorted(used)]


def plan_once(meta, cluster, cfg, train):
    """make_plan, and every replica plan its search predicted (search/hetero.hetero_plan's calls)."""
    seen = []
    predict = search_hetero.predict_any_plan

    def recording(plan, *args, **kwargs):
        out = predict(plan, *args, **kwargs)
        if out["feasible"] or out.get("time_only"):
            seen.append((out["step_time_s"], plan.to_yaml()))
        return out
    search_hetero.predict_any_plan = recording
    t0 = time.perf_counter()
    try:
        plan, info = make_plan(meta, cluster, dict(cfg, heterogeneous="true"), train)
    finally:
        search_hetero.predict_any_plan = predict
    return plan, info, time.perf_counter() - t0, seen


def best_sharded(seen, meta, cluster, opts, top: int) -> dict:
    """The assessed replica plans (the `top` fastest replicated, and those over memory) predicted sharded:
    the fastest."""
    from hrlplan.plan import Plan

    picked = sorted(seen, key=lambda s: s[0])[:top] + [s for s in seen if s[0] == math.inf]
    best = None
    for _, text in {t: (s, t) for s, t in picked}.values():
        plan = Plan.from_yaml(text)
        plan.meta["replica_optimizer"] = replica_sync.SHARDED
        pred = predict_any_plan(plan, meta, cluster, opts)
        if pred["feasible"] and (best is None or pred["step_time_s"] < best[0]["step_time_s"]):
            best = (pred, plan)
    if best is None:
        return {"step_s": math.inf, "assessed": len(seen)}
    pred, plan = best
    return dict({k: pred["breakdown"].get(k) for k in KEYS}, step_s=pred["step_time_s"], layout=plan.layout()[:200],
                assessed=len(seen), replicas=len(plan.as_pipelines()))


def summary(plan, info) -> dict:
    pred = plan.meta["predicted"]
    out = {"kind": "replicas" if plan.heterogeneous else "single template", "step_s": pred["step_time_s"],
           "layout": plan.layout()[:200]}
    out.update({k: pred["breakdown"].get(k) for k in KEYS})
    if not plan.heterogeneous:
        best = info["planner"]["heterogeneous"].get("best_replica_plan")
        if best:
            out.update(best_replica_s=best["step_time_s"], lost_on=best.get("lost_mostly_on"),
                       lost_on_s=best.get("lost_on_s"))
    return out


def run(arch: str, cluster_cfg: dict, gbs: int, budget_s: float) -> dict:
    meta, cluster = load_meta(arch), spec_from_preset(cluster_cfg)
    train = dict(global_batch_size=gbs, schedule="1f1b", stages_per_rank=1, microbatches="auto", dtype="bfloat16",
                 dp_mode="fsdp")
    cfg = dict(asdict(ExactPlannerConfig()), hetero_time_s=budget_s)
    row = {"arch": arch, "cluster": cluster_cfg["name"], "gpus": cluster.world_size, "global_batch": gbs}
    try:
        plan_r, info_r, row["plan_time_s"], seen = plan_once(meta, cluster, cfg, train)
    except UserError as e:
        return dict(row, error=str(e)[:300])
    single = info_r["runner_up"] if plan_r.heterogeneous else info_r["chosen"]
    row["single_s"] = single["step_time_s"] if single else math.inf
    used = single_devices(plan_r, info_r)
    row["single_idle"] = cluster.world_size - len(used) if used is not None else cluster.world_size
    peak = [d.peak_flops for d in cluster.devices]
    row["ceiling"] = sum(peak) / sum(peak[d] for d in used) if used else math.inf
    row["replicated"] = summary(plan_r, info_r)
    opts = cost_options(cfg, section(TrainConfig, train))
    if plan_r.heterogeneous:
        what_if = copy.deepcopy(plan_r)
        what_if.meta["replica_optimizer"] = replica_sync.SHARDED
        pred = predict_any_plan(what_if, meta, cluster, opts)
        row["replicated_plan_sharded"] = dict({k: pred["breakdown"].get(k) for k in KEYS},
                                              step_s=pred["step_time_s"], feasible=pred["feasible"])
    row["sharded"] = best_sharded(seen, meta, cluster, opts, top=30)
    return row


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['cluster']:<32} {r['arch']:<12} error: {r['error'][:80]}"
    rep, sh = r["replicated"], r["sharded"]
    what_if = r.get("replicated_plan_sharded", {}).get("step_s", math.nan)
    return (f"{r['cluster']:<32} {r['arch']:<12} {r['gpus']:>5} idle {r['single_idle']:>4} ceiling {r['ceiling']:5.2f}x "
            f"| single {r['single_s'] * 1e3:9.1f} ms | planned {r['single_s'] / rep['step_s']:5.3f}x "
            f"({rep['kind']}) | that plan sharded {r['single_s'] / what_if:5.3f}x "
            f"| best assessed plan sharded {r['single_s'] / sh['step_s']:5.3f}x (of {sh['assessed']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,3,4,8,19,21", help="generated seeds, comma-separated")
    ap.add_argument("--presets", default="gpt2,hspmd", help="preset instances whose cluster or arch contains one of these")
    ap.add_argument("--budget-s", type=float, default=30.0, help="planner.hetero_time_s per planning")
    ap.add_argument("--out", default="bench/results/hetero_sharded.json")
    args = ap.parse_args(argv)
    wanted = [w for w in args.presets.split(",") if w]
    instances = [(a, load_preset_config(p), b) for a, p, b in bench.PRESETS
                 if any(w == a or w in p for w in wanted)]
    if any("hspmd" in w for w in wanted):
        instances.append(("llama-7b", bench.hspmd_uneven(), 312))
    instances += [bench.generated(int(s)) for s in args.seeds.split(",") if s]
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for arch, cfg, gbs in instances:
        rows.append(run(arch, cfg, gbs, args.budget_s))
        print(line(rows[-1]), flush=True)
        out.write_text(json.dumps({"rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
