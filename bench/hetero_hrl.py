"""The learned replica policy (hrlplan/search/hrl_replicas.py) against exact's sub-space and the
baselines at equal simulator calls (issue 35).

    python bench/hetero_hrl.py [--calls 150] [--generated 12] [--exact-s 30] [--out bench/results/hetero_hrl.json]

Instances: bench/hetero.py's mixed presets and generated clusters (other seeds than the policy's
training clusters: zero-shot). Per instance: exact = search_hetero within --exact-s (proven or not);
hrl = the policy's greedy decision and samples until --calls simulator evaluations; random / SA /
SH = random search, simulated annealing and successive halving at the calls hrl used. Targets:
hrl >= 0.99x exact where exact proves its sub-space, >= 1.05x the best baseline where it cannot.
Times are the simulator's predicted step times (x = the other's step / hrl's step: above 1, hrl is faster).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hetero as bench_hetero  # noqa: E402  (bench/hetero.py: the instances)
from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.config import TrainConfig, section  # noqa: E402
from hrlplan.cost.simulator import Simulator  # noqa: E402
from hrlplan.search.common import cost_options  # noqa: E402
from hrlplan.search.config import ExactPlannerConfig  # noqa: E402
from hrlplan.search.hetero_baselines import Sampler, annealing, random_search, successive_halving  # noqa: E402
from hrlplan.search.hetero_exact import search_hetero  # noqa: E402
from hrlplan.search.hrl_replicas import search_hrl_replicas  # noqa: E402
from hrlplan.search.instances import load_meta, load_preset_config  # noqa: E402

BASELINES = (("random", random_search), ("sa", annealing), ("sh", successive_halving))


def run(arch: str, cluster_cfg: dict, gbs: int, calls: int, exact_s: float) -> dict:
    meta, cluster = load_meta(arch), spec_from_preset(cluster_cfg)
    train = section(TrainConfig, dict(global_batch_size=gbs, schedule="1f1b", stages_per_rank=1,
                                      microbatches="auto", dtype="bfloat16", dp_mode="fsdp"))
    cfg = dict(asdict(ExactPlannerConfig()), hetero_time_s=exact_s)
    row = {"arch": arch, "cluster": cluster_cfg["name"], "gpus": cluster.world_size, "global_batch": gbs}
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    t = time.perf_counter()
    exact = search_hetero(sim, meta, cluster, cfg, train, math.inf)
    row.update(exact_s=exact["predicted"]["step_time_s"] if exact["plan"] is not None else math.inf,
               exact_proven=exact["proven"], exact_calls=sim.evaluations, exact_time_s=time.perf_counter() - t)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    t = time.perf_counter()
    hrl = search_hrl_replicas(sim, meta, cluster, cfg, train, calls)
    row.update(hrl_s=hrl["step_time_s"], hrl_calls=hrl["calls"], hrl_time_s=time.perf_counter() - t,
               low_level=hrl["low_level"], hrl_layout=hrl["plan"].layout()[:200] if hrl["plan"] else None)
    for name, fn in BASELINES:
        sim = Simulator(meta, cluster, cost_options(cfg, train))
        best, _ = fn(Sampler(sim, meta, cluster, cfg, train, seed=0), hrl["calls"],
                     deadline=time.perf_counter() + 10 * max(row["hrl_time_s"], 10.0))
        row[f"{name}_s"], row[f"{name}_calls"] = best, sim.evaluations
    return row


def x(other: float, mine: float) -> float:
    if math.isfinite(mine):
        return other / mine if math.isfinite(other) else math.inf
    return math.nan if math.isfinite(other) else 1.0


def headline(rows) -> dict:
    proven = [x(r["exact_s"], r["hrl_s"]) for r in rows if r["exact_proven"]]
    unproven = [x(min(r[f"{b}_s"] for b, _ in BASELINES), r["hrl_s"]) for r in rows if not r["exact_proven"]]
    finite = [v for v in unproven if math.isfinite(v)]
    return {"instances": len(rows), "exact_proven": len(proven),
            "hrl_vs_exact_where_proven_min": min(proven, default=None),
            "hrl_vs_exact_where_proven_median": statistics.median(proven) if proven else None,
            "hrl_vs_best_baseline_where_unproven_median": statistics.median(finite) if finite else None,
            "hrl_vs_best_baseline_where_unproven_min": min(finite, default=None),
            "hrl_vs_exact_where_unproven_median": statistics.median(
                [x(r["exact_s"], r["hrl_s"]) for r in rows if not r["exact_proven"]] or [math.nan])}


def table(rows) -> str:
    ms = lambda v: f"{v * 1e3:9.4g}" if math.isfinite(v) else "        -"  # noqa: E731
    head = (f"{'model':11} {'cluster':26} {'gpus':>4} {'exact ms':>9} {'proof':>5} {'hrl ms':>9} {'calls':>5} "
            f"{'random':>9} {'SA':>9} {'SH':>9} {'xExact':>6} {'xBase':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        base = min(r[f"{b}_s"] for b, _ in BASELINES)
        lines.append(f"{r['arch']:11} {r['cluster'][:26]:26} {r['gpus']:>4} {ms(r['exact_s'])} "
                     f"{'yes' if r['exact_proven'] else 'no':>5} {ms(r['hrl_s'])} {r['hrl_calls']:>5} "
                     f"{ms(r['random_s'])} {ms(r['sa_s'])} {ms(r['sh_s'])} {x(r['exact_s'], r['hrl_s']):6.3f} "
                     f"{x(base, r['hrl_s']):6.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=150)
    ap.add_argument("--generated", type=int, default=12)
    ap.add_argument("--exact-s", type=float, default=30.0)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="bench/results/hetero_hrl.json")
    args = ap.parse_args(argv)
    instances = [(a, load_preset_config(p), b) for a, p, b in bench_hetero.PRESETS[:7]]
    instances += [bench_hetero.generated(s) for s in range(args.generated)]
    instances = [i for i in instances if args.only in i[1]["name"]]
    bench_hetero.run_and_report(instances, lambda arch, cfg, gbs: run(arch, cfg, gbs, args.calls, args.exact_s),
                                table, headline, args.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
