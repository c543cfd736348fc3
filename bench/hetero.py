"""Heterogeneous-replica planner benchmark (issue 35): the planned plan vs the best single-template
plan vs the best plan on one device type, and the replica-space baselines at equal simulator calls.

    python bench/hetero.py [--quick] [--only SUBSTRING] [--generated N] [--out bench/results/hetero.json]

Instances: the mixed presets (a100-v100-mix, h800-h20-mix, three-type-mix, h800-h20-256, three-type-256),
HSPMD's uneven 24 H20 + 15 H800 (nodes of 8, 8, 8, 8, 7), and generated mixed clusters (2-4 real GPU
types, uneven node counts, nodes of 4 or 8, 16-1024 GPUs) with GPT-2 / Llama models.
Columns: planned = make_plan exact with planner.heterogeneous=true (never slower than single: the
single template is a candidate), single = that planner's single-template candidate
(search/hetero_single.py: bounded by simulator calls, not by the clock, so any reference search with
the same settings finds the same template -- `--check-single` reruns it and records that it does),
1-type = the same search on one device type's nodes alone, replica = the best plan of the replica sub-spaces (by type,
and the single template's own replicas plus replicas on the nodes it leaves idle; proven where
'proof' says so) and what it lost on against the single template where it lost; random / SA / SH =
random search, simulated annealing and successive halving over the replica space at the planner's
simulator calls.
Times are the simulator's predicted step times.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.config import TrainConfig, section  # noqa: E402
from hrlplan.cost.simulator import Simulator  # noqa: E402
from hrlplan.errors import UserError  # noqa: E402
from hrlplan.search import layout_of, make_plan  # noqa: E402
from hrlplan.search.common import cost_options  # noqa: E402
from hrlplan.search.config import ExactPlannerConfig  # noqa: E402
from hrlplan.search.hetero_single import single_template_search  # noqa: E402
from hrlplan.search.hetero_baselines import Sampler, annealing, random_search, successive_halving  # noqa: E402
from hrlplan.search.space import SearchSpace  # noqa: E402
from hrlplan.search.instances import load_meta, load_preset_config  # noqa: E402

PRESETS = [("gpt2", "a100-v100-mix", 128), ("gpt2-xl", "a100-v100-mix", 256), ("llama-7b", "a100-v100-mix", 256),
           ("gpt2-medium", "h800-h20-mix", 160), ("llama-7b", "h800-h20-mix", 320),
           ("gpt2-xl", "three-type-mix", 192), ("llama-7b", "three-type-mix", 384),
           ("llama-70b", "h800-h20-256", 1024), ("llama-70b", "three-type-256", 1024)]
GPUS = {"H100-80GB": (80, 989, 450), "A100-80GB": (80, 312, 300), "A100-40GB": (40, 312, 300),
        "V100-32GB": (32, 125, 150), "H800-80GB": (80, 989, 200), "H20-96GB": (96, 148, 450),
        "L40S-48GB": (48, 362, 64)}
MODELS_BY_SIZE = [(64, ("gpt2", "gpt2-medium")), (256, ("gpt2-xl", "llama-7b")), (4096, ("llama-7b", "llama-70b"))]


def hspmd_uneven():
    """HSPMD's 24 H20 + 15 H800: H20 in 3 nodes of 8, H800 in nodes of 8 and 7."""
    groups = [dict(count=3, device="H20-96GB", devices_per_node=8, memory_gb=96, tflops=148, intra_node_GBps=450),
              dict(count=1, device="H800-80GB", devices_per_node=8, memory_gb=80, tflops=989, intra_node_GBps=200),
              dict(count=1, device="H800-80GB", devices_per_node=7, memory_gb=80, tflops=989, intra_node_GBps=200)]
    return dict(name="hspmd-24h20-15h800", node_groups=groups, inter_node_GBps=25, inter_node_latency_us=5,
                intra_node_latency_us=2)


def generated(seed: int) -> tuple:
    """A mixed cluster config of 2-4 real GPU types, uneven counts, 16-1024 GPUs, and a model for its size."""
    rng = np.random.default_rng(1000 + seed)
    n_types = int(rng.integers(2, 5))
    names = list(rng.choice(sorted(GPUS), size=n_types, replace=False))
    per_node = int(rng.choice([4, 8]))
    target = int(2 ** rng.uniform(4, 10))
    weights = rng.dirichlet(np.ones(n_types))
    groups = []
    for name, w in zip(names, weights):
        count = max(1, int(round(w * target / per_node)))
        mem, tflops, intra = GPUS[name]
        groups.append(dict(count=count, device=name, devices_per_node=per_node, memory_gb=mem, tflops=tflops,
                           intra_node_GBps=intra))
    world = sum(g["count"] * per_node for g in groups)
    while world > 1024:
        big = max(groups, key=lambda g: g["count"])
        big["count"] -= 1
        world -= per_node
    arch = next(rng.choice(archs) for limit, archs in MODELS_BY_SIZE if world <= limit)
    gbs = int(2 ** math.ceil(math.log2(max(world, 16)))) * int(rng.choice([1, 2]))
    cfg = dict(name=f"gen{seed}-{'+'.join(n.split('-')[0] for n in names)}", node_groups=groups,
               inter_node_GBps=float(rng.choice([12.5, 25, 50])), inter_node_latency_us=5, intra_node_latency_us=2)
    return str(arch), cfg, gbs


def planned_by(plan, info) -> str:
    if not plan.heterogeneous:
        return "single template"
    if "learned replica policy" in plan.meta["planner"].get("note", ""):
        return "learned replica policy"
    return "exact, anchored on the single template" if "single-template" in info["chosen"]["summary"] \
        else "exact sub-space"


def one_type_configs(cfg: dict):
    types = sorted({g["device"] for g in cfg["node_groups"]})
    for t in types:
        yield t, dict(cfg, name=f"{cfg['name']}-{t}", node_groups=[g for g in cfg["node_groups"] if g["device"] == t])


def idle_ceiling(cluster, groups) -> float:
    """What the devices a single template leaves idle could add at most: every device's peak FLOP/s
    over the peak of those it uses (a compute-bound step spread perfectly; sync, memory and bubble
    only lower it). Below 1.15 the idle-median target cannot be met on that instance."""
    used = {d for g in groups for d in g}
    return sum(d.peak_flops for d in cluster.devices) / sum(cluster.devices[d].peak_flops for d in used)


def run(arch: str, cluster_cfg: dict, gbs: int, budget_s: float, baseline_s: float, check_single: bool) -> dict:
    meta, cluster = load_meta(arch), spec_from_preset(cluster_cfg)
    train = dict(global_batch_size=gbs, schedule="1f1b", stages_per_rank=1, microbatches="auto", dtype="bfloat16",
                 dp_mode="fsdp")
    cfg = dict(asdict(ExactPlannerConfig()), hetero_time_s=budget_s)
    row = {"arch": arch, "cluster": cluster_cfg["name"], "gpus": cluster.world_size,
           "types": len(set(cluster.device_types())), "node_sizes": sorted(set(cluster.node_sizes())),
           "global_batch": gbs}
    one = []
    for t, sub in one_type_configs(cluster_cfg):
        best_s, proven = single_template(meta, spec_from_preset(sub), cfg, train)
        one.append((best_s, t, proven))
    row["one_type_s"], row["one_type"], row["one_type_proven"] = min(one)
    t0 = time.perf_counter()
    evaluations0 = 0
    try:
        plan, info = make_plan(meta, cluster, dict(cfg, heterogeneous="true"), train)
    except UserError as e:
        row.update(planned_s=math.inf, planned_error=str(e)[:500], plan_time_s=time.perf_counter() - t0)
        return row
    row["plan_time_s"] = time.perf_counter() - t0
    hetero = info["planner"]["heterogeneous"]
    # the single-template optimum: the plan itself, or the runner-up a replica plan beat
    single = info["runner_up"] if plan.heterogeneous else info["chosen"]
    if single is None:
        row.update(single_s=math.inf, single_idle=cluster.world_size)
    else:
        groups = single["layout"]["groups"] if plan.heterogeneous else layout_of(plan).groups
        row.update(single_s=single["step_time_s"], single_layout=single["summary"],
                   single_idle=cluster.world_size - sum(len(g) for g in groups),
                   idle_ceiling=idle_ceiling(cluster, groups))
    row.update(planned_s=plan.meta["predicted"]["step_time_s"], planned_kind="replicas" if plan.heterogeneous else
               "single template", planned_layout=plan.layout()[:300], proof=hetero["proven"],
               template_searches=hetero["template_searches"], rounds=hetero["rounds"], hetero_time_s=hetero["time_s"],
               learned=hetero.get("learned_replicas"), planned_by=planned_by(plan, info),
               hetero_note=hetero["note"][-400:],
               evaluations=info["planner"]["evaluations"] - evaluations0)
    if plan.heterogeneous:
        row.update(replica_s=row["planned_s"], replica_summary=info["chosen"]["summary"],
                   cross_replica_reduce_s=plan.meta["predicted"]["breakdown"].get("cross_replica_reduce_s"))
    elif "best_replica_plan" in hetero:
        best = hetero["best_replica_plan"]
        row.update(replica_s=best["step_time_s"], replica_summary=best["summary"], lost_on=best["lost_mostly_on"],
                   lost_on_s=best["lost_on_s"])
    else:
        tail = hetero["note"].split("anchored on")[-1]
        anchored_none = "anchored on" in hetero["note"] and "no plan that fits" in tail and "cut short" not in tail
        memory = ("memory (no plan found that fits at dp 1: unsharded state, receive buffers without "
                  "sequence parallelism)" if anchored_none else "")
        if hetero.get("out_of_time"):
            lost = (f"{memory} in the anchored sub-space; time budget in the by-type one" if memory
                    else "time budget (no replica plan assembled)")
        else:
            lost = memory or "memory (no replica of the sub-spaces fits)"
        row.update(replica_s=math.inf, lost_on=lost)
    row["single_proven"] = bool(info["planner"].get("proven_optimal")) if not plan.heterogeneous else None
    if check_single:
        # the reference: the same work-bounded search with the same settings (hetero_single.py) -- the
        # planner's own candidate at any load, so the planned plan is never slower by construction
        ref_s, _ = single_template(meta, cluster, cfg, train)
        row["single_reference_s"], row["single_reference_equal"] = ref_s, ref_s == row.get("single_s", math.inf)
    row.update(baselines(meta, cluster, cfg, train, row["evaluations"], baseline_s))
    return row


def single_template(meta, cluster, cfg, train):
    """(best single-template step, proven): the planner's own single-template search
    (hetero_single.single_template_search: bounded by simulator calls, not by the clock, so every
    call with the same settings finds the same template)."""
    train = section(TrainConfig, train)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = SearchSpace(meta, cluster, cfg, train)
    space.sim = sim
    out = single_template_search(sim, space, cfg)
    best = out["tracker"].best
    return (best.time if best is not None else math.inf), bool(out["proven_optimal"])


def baselines(meta, cluster, cfg, train, calls: int, time_cap_s: float) -> dict:
    """Random search and annealing at the exact search's simulator calls (or the time cap, said so)."""
    out = {}
    train = section(TrainConfig, train)
    for name, fn in (("random", random_search), ("sa", annealing), ("sh", successive_halving)):
        sim = Simulator(meta, cluster, cost_options(cfg, train))
        sampler = Sampler(sim, meta, cluster, cfg, train, seed=0)
        best, _ = fn(sampler, calls, deadline=time.perf_counter() + time_cap_s)
        out[f"{name}_s"], out[f"{name}_calls"] = best, sim.evaluations
        out[f"{name}_capped"] = sim.evaluations < calls
    return out


def ratio(a: float, b: float) -> float:
    return b / a if a and math.isfinite(a) and math.isfinite(b) else (math.inf if math.isfinite(a) else math.nan)


def table(rows) -> str:
    head = (f"{'model':11} {'cluster':26} {'gpus':>4} {'planned ms':>10} {'single':>8} {'1-type':>8} "
            f"{'replica':>8} {'xS':>5} {'x1T':>5} {'rand':>8} {'SA':>8} {'SH':>8} {'plan s':>6}  kind / lost on")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = lambda x: f"{x * 1e3:8.4g}" if x is not None and math.isfinite(x) else "       -"  # noqa: E731
        what = r.get("planned_by", r.get("planned_kind", "error"))
        if r.get("lost_on"):
            what += f" (replicas lost on {lost_text(r)})"
        if r.get("planned_error"):
            what += f": {r['planned_error'][:120]}"
        lines.append(f"{r['arch']:11} {r['cluster'][:26]:26} {r['gpus']:>4} {ms(r.get('planned_s')):>10} "
                     f"{ms(r.get('single_s'))} {ms(r.get('one_type_s'))} {ms(r.get('replica_s'))} "
                     f"{ratio(r.get('planned_s'), r.get('single_s')):5.2f} "
                     f"{ratio(r.get('planned_s'), r.get('one_type_s')):5.2f} "
                     f"{ms(r.get('random_s'))} {ms(r.get('sa_s'))} {ms(r.get('sh_s'))} {r.get('plan_time_s', 0):6.1f}  {what}")
    return "\n".join(lines)


def lost_text(r: dict) -> str:
    """'sync +8.4 ms' -- the component the
    best replica plan lost most on and by how much; a time budget or memory where none was assembled."""
    parts = r.get("lost_on_s") or {}
    if not parts:
        return str(r["lost_on"])
    if str(r["lost_on"]).startswith("nothing"):   # none of the five parts: the optimizer or the step's collectives
        return (f"the rest of the step {(r['replica_s'] - r['single_s']) * 1e3:+.3g} ms (no more sync, bubble, compute, "
                "p2p or tp: the optimizer step, unsharded in each replica where FSDP shards it, or the step's collectives)")
    key = f"{r['lost_on']}_s"
    out = f"{r['lost_on']} {parts.get(key, 0.0) * 1e3:+.3g} ms"
    return out


def sync_matched_s(r: dict) -> float:
    """The best replica plan's step had its gradient sync cost what the single template's does (the
    issue's homogeneous-path sync for replicas; not what the simulator charges today)."""
    if not math.isfinite(r.get("replica_s", math.inf)):
        return math.inf
    return r["replica_s"] - max((r.get("lost_on_s") or {}).get("sync_s", 0.0), 0.0)


def headline(rows) -> dict:
    ok = [r for r in rows if math.isfinite(r.get("planned_s", math.inf))]
    vs_single = [ratio(r["planned_s"], r["single_s"]) for r in ok if math.isfinite(r.get("single_s", math.inf))]
    idle = [ratio(r["planned_s"], r["single_s"]) for r in ok if r.get("single_idle", 0) > 0]
    ceilings = [r["idle_ceiling"] for r in ok if r.get("single_idle", 0) > 0 and "idle_ceiling" in r]
    vs_one = [ratio(r["planned_s"], r["one_type_s"]) for r in ok if math.isfinite(r.get("one_type_s", math.inf))]
    vs_base = [min(ratio(r["planned_s"], r.get(f"{b}_s", math.inf)) for b in ("random", "sa", "sh")) for r in ok]
    return {"instances": len(rows), "planned": len(ok), "replica_plans_chosen": sum(r.get("planned_kind") == "replicas"
                                                                                     for r in ok),
            "min_speedup_vs_single": min(vs_single, default=None),
            "median_speedup_vs_single_where_single_idles": statistics.median(idle) if idle else None,
            "instances_where_single_idles": len(idle),
            "idle_instances_with_ceiling_under_1.15": sum(c < 1.15 for c in ceilings),
            "median_speedup_vs_one_type": statistics.median(vs_one) if vs_one else None,
            "median_speedup_vs_best_baseline": statistics.median([x for x in vs_base if math.isfinite(x)]
                                                                 or [math.nan]),
            "max_plan_time_s": max((r["plan_time_s"] for r in ok), default=None),
            "instances_over_60s": sum(r["plan_time_s"] > 60 for r in ok),
            "replica_wins_if_sync_matched": sum(sync_matched_s(r) < r.get("single_s", math.inf) for r in ok),
            "proven": sum(bool(r.get("proof")) for r in ok)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 presets and 3 generated clusters")
    ap.add_argument("--only", default="", help="instances whose cluster name contains this")
    ap.add_argument("--generated", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=50.0, help="planner.hetero_time_s (the whole planning time)")
    ap.add_argument("--baseline-s", type=float, default=10.0, help="time cap per baseline run")
    ap.add_argument("--check-single", action="store_true",
                    help="rerun the single-template search as a reference and record that it equals the planner's")
    ap.add_argument("--part", default="", help="presets | generated: one half of the instances")
    ap.add_argument("--seeds", default="", help="FIRST:LAST generated seeds (with --part generated)")
    ap.add_argument("--out", default="bench/results/hetero.json")
    ap.add_argument("--combine", nargs="*", default=None,
                    help="print the table of these result files, merged into --out")
    args = ap.parse_args(argv)
    if args.combine is not None:
        rows = [r for f in args.combine for r in json.loads(Path(f).read_text())["rows"]]
        Path(args.out).write_text(json.dumps({"rows": rows, "headline": headline(rows)}, indent=1, default=str))
        print(table(rows))
        print(json.dumps(headline(rows), indent=1))
        return 0
    instances = [(a, load_preset_config(p), b) for a, p, b in PRESETS] + [("llama-7b", hspmd_uneven(), 312)]
    first, last = map(int, args.seeds.split(":")) if args.seeds else (0, args.generated)
    instances += [generated(s) for s in range(first, last)]
    if args.part:
        instances = instances[:len(PRESETS) + 1] if args.part == "presets" else instances[len(PRESETS) + 1:]
    if args.quick:
        instances = instances[:3] + instances[-3:]
    instances = [i for i in instances if args.only in i[1]["name"]]
    run_and_report(instances, lambda arch, cfg, gbs: run(arch, cfg, gbs, args.budget_s, args.baseline_s,
                                                         args.check_single), table, headline, args.out)
    return 0


def run_and_report(instances, run_one, table, headline, out_path: str) -> List[Dict[str, Any]]:
    """Each instance's row as it is done (a line of the table; the JSON rewritten), then the table and
    the headline."""
    rows: List[Dict[str, Any]] = []
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    for arch, cfg, gbs in instances:
        t = time.perf_counter()
        row = run_one(arch, cfg, gbs)
        row["bench_time_s"] = time.perf_counter() - t
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        out.write_text(json.dumps({"rows": rows, "headline": headline(rows)}, indent=1, default=str))
    print()
    print(table(rows))
    print(json.dumps(headline(rows), indent=1))
    return rows

if __name__ == "__main__":
    sys.exit(main())
