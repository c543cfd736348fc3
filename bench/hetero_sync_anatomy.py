"""Where a single template and the same template run as replicas differ (issue 35): the simulator's
breakdown of bench/hetero.py's single-template plan on an instance, and of its own replica form (its
dp slices as replicas on the heterogeneous executor, cost/plans.predict_any_plan), side by side, with
the replica form's cross-replica buckets (when each starts and ends per stage). Pure simulation.

    python bench/hetero_sync_anatomy.py [--seed 3] [--out bench/results/r6/anatomy-gen3.json]
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.config import TrainConfig, section  # noqa: E402
from hrlplan.cost.plans import predict_any_plan, rank_devices  # noqa: E402
from hrlplan.cost.replica_sync_cost import bucket_launches, bucket_times, sync_buckets  # noqa: E402
from hrlplan.cost.simulator import Simulator  # noqa: E402
from hrlplan.search.common import cost_options  # noqa: E402
from hrlplan.search.config import ExactPlannerConfig  # noqa: E402
from hrlplan.search.hetero import Replica, hetero_plan  # noqa: E402
from hrlplan.search.hetero_anchor import anchor_slices  # noqa: E402
from hrlplan.search.hetero_single import single_template_search  # noqa: E402
from hrlplan.search.instances import load_meta  # noqa: E402
from hrlplan.search.space import SearchSpace  # noqa: E402
import dataclasses  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hetero import generated  # noqa: E402


def single_layout(meta, cluster, cfg, train, cache: Path):
    if cache.exists():
        return pickle.loads(cache.read_bytes())
    sim = Simulator(meta, cluster, cost_options(cfg, section(TrainConfig, train)))
    space = SearchSpace(meta, cluster, cfg, section(TrainConfig, train))
    space.sim = sim
    layout = single_template_search(sim, space, cfg)["tracker"].best.layout
    cache.write_bytes(pickle.dumps(layout))
    return layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    arch, cfg_cluster, gbs = generated(args.seed)
    meta, cluster = load_meta(arch), spec_from_preset(cfg_cluster)
    train = dict(global_batch_size=gbs, schedule="1f1b", stages_per_rank=1, microbatches="auto", dtype="bfloat16",
                 dp_mode="fsdp")
    cfg = dict(asdict(ExactPlannerConfig()), hetero_time_s=50.0)
    out_dir = Path("bench/results/r6")
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = single_layout(meta, cluster, cfg, train, out_dir / f"single-layout-gen{args.seed}.pkl")
    opts = cost_options(cfg, section(TrainConfig, train))
    sim = Simulator(meta, cluster, opts)
    homo = sim.evaluate(layout, detail=True)
    replicas = [Replica(cluster.devices[s[0][0]].name,
                        dataclasses.replace(layout, groups=s, dp=1)) for s in anchor_slices(layout)]
    plan, pred = hetero_plan(meta, cluster, replicas, layout.schedule, {}, sim=Simulator(meta, cluster, opts))
    keys = sorted(set(homo.breakdown) | set(pred["breakdown"]))
    rows = {}
    print(f"{'key':40s} {'single':>14s} {'replicas':>14s}")
    for k in keys:
        a, b = homo.breakdown.get(k), pred["breakdown"].get(k)
        if isinstance(a, (int, float)) or isinstance(b, (int, float)):
            rows[k] = (a, b)
            print(f"{k:40s} {a if a is not None else '-':>14} {b if b is not None else '-':>14}")
    print("step", homo.step_time_s, pred["step_time_s"])
    sim2 = Simulator(meta, cluster, opts)
    devices = rank_devices(plan)
    buckets = sync_buckets(plan, meta, sim2, devices)
    for k, b in enumerate(buckets):
        print(k, b.ranks[:8], b.units[:4], len(b.units), f"{b.nbytes / 2**20:.1f} MiB {b.seconds * 1e3:.3f} ms")
    result = {"single_step_s": homo.step_time_s, "replica_step_s": pred["step_time_s"], "breakdown": rows,
              "buckets": [dict(ranks=b.ranks, units=b.units, mib=b.nbytes / 2**20, ms=b.seconds * 1e3)
                          for b in buckets]}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
