"""What the cross-replica gradient sync costs on bench/hetero.py's GPT-2 instances (issue 35): for
each, the planner's single template and its best replica plan, and that replica plan's sync
(cross_replica_reduce_s, the part of it exposed after the pipeline, and what it lost to the single
template on sync). Pure simulation.

    python bench/hetero_sync.py [--budget-s 50] [--plans DIR] [--out FILE] [--instances hspmd,gen3,...]

--plans DIR: where a plan file for an instance exists (saved by an earlier run), that plan is
re-predicted on this tree besides the fresh search, so one replica plan's sync is compared across
two trees (the simulator before and after a change).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hrlplan.search as search  # noqa: E402
from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.config import TrainConfig, section  # noqa: E402
from hrlplan.cost.plans import predict_any_plan  # noqa: E402
from hrlplan.plan import Plan  # noqa: E402
from hrlplan.search.common import cost_options  # noqa: E402
from hrlplan.search.config import ExactPlannerConfig  # noqa: E402
from hrlplan.search.instances import load_meta, load_preset_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hetero import generated, hspmd_uneven  # noqa: E402

# bench/hetero.py's GPT-2 instances whose best replica plan lost (or tied) on sync last round
INSTANCES = [("preset", "gpt2", "a100-v100-mix", 128), ("preset", "gpt2-xl", "a100-v100-mix", 256),
             ("preset", "gpt2-medium", "h800-h20-mix", 160), ("generated", 0), ("generated", 3)]
TRAIN = dict(schedule="1f1b", stages_per_rank=1, microbatches="auto", dtype="bfloat16", dp_mode="fsdp")


def instance(spec):
    if spec[0] == "preset":
        _, arch, preset, gbs = spec
        return arch, load_preset_config(preset), gbs
    if spec[0] == "hspmd":   # bench/hetero.py's HSPMD instance
        return "llama-7b", hspmd_uneven(), 312
    return generated(spec[1])


def named_instance(name: str):
    """--instances: 'hspmd' or 'genN' (bench/hetero.py's generated seed N)."""
    if name == "hspmd":
        return ("hspmd",)
    if name.startswith("gen") and name[3:].isdigit():
        return ("generated", int(name[3:]))
    raise SystemExit(f"bench/hetero_sync.py: error: --instances: {name!r} is neither hspmd nor genN")


def sync_parts(predicted) -> dict:
    b = predicted.get("breakdown") or {}
    return {"step_s": predicted.get("step_time_s"), "cross_replica_reduce_s": b.get("cross_replica_reduce_s"),
            "cross_replica_reduce_exposed_s": b.get("cross_replica_reduce_exposed_s"),
            "cross_replica_collectives": b.get("cross_replica_collectives"),
            "step_collectives_s": b.get("step_collectives_s")}


def run(spec, budget_s: float, plans_dir: Path) -> dict:
    arch, cfg_cluster, gbs = instance(spec)
    meta, cluster = load_meta(arch), spec_from_preset(cfg_cluster)
    train = dict(TRAIN, global_batch_size=gbs)
    cfg = dict(asdict(ExactPlannerConfig()), hetero_time_s=budget_s, heterogeneous="true")
    captured = {}
    real_lost_on = search.lost_on

    def keep_plan(sim, hetero, single):
        captured["plan"] = hetero["plan"]
        return real_lost_on(sim, hetero, single)

    search.lost_on = keep_plan
    try:
        t0 = time.perf_counter()
        plan, info = search.make_plan(meta, cluster, cfg, train)
    finally:
        search.lost_on = real_lost_on
    hetero = info["planner"]["heterogeneous"]
    replica = plan if plan.heterogeneous else captured.get("plan")
    single = info["runner_up"] if plan.heterogeneous else info["chosen"]
    row = {"arch": arch, "cluster": cfg_cluster["name"], "plan_time_s": time.perf_counter() - t0,
           "planned_kind": "replicas" if plan.heterogeneous else "single template",
           "single_s": single["step_time_s"] if single else math.inf,
           "single_step_collectives_s": (single or {}).get("breakdown", {}).get("step_collectives_s"),
           "single_dp_comm_exposed_s": (single or {}).get("breakdown", {}).get("dp_comm_exposed_s"),
           "planned_s": plan.meta["predicted"]["step_time_s"]}
    if not plan.heterogeneous and "best_replica_plan" in hetero:
        best = hetero["best_replica_plan"]
        row.update(replica_summary=best["summary"], lost_on=best["lost_mostly_on"], lost_on_s=best["lost_on_s"])
    opts = cost_options(cfg, section(TrainConfig, train))
    if replica is not None:
        row["replica"] = sync_parts(predict_any_plan(replica, meta, cluster, opts))
        if plans_dir:
            plans_dir.mkdir(parents=True, exist_ok=True)
            path = plans_dir / f"{arch}-{cfg_cluster['name']}.yaml"
            if path.exists():   # the earlier tree's replica plan, re-predicted on this one
                row["saved_replica"] = sync_parts(predict_any_plan(Plan.load(path), meta, cluster, opts))
            else:
                replica.save(path)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=50.0)
    ap.add_argument("--plans", default="", help="directory of replica plans to save / re-predict")
    ap.add_argument("--out", default="bench/results/hetero_sync.json")
    ap.add_argument("--instances", default="", help="comma-separated hspmd / genN (default: the GPT-2 list)")
    args = ap.parse_args(argv)
    rows = []
    for spec in [named_instance(n) for n in args.instances.split(",")] if args.instances else INSTANCES:
        row = run(spec, args.budget_s, Path(args.plans) if args.plans else None)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
