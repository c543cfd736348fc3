"""Sequence parallelism inside a heterogeneous replica, as the simulator predicts it (issue 35): one
replica of a model at tp 8 over `pp` stages on one device type of a preset, with and without
sequence parallelism -- peak memory per rank (receive buffers and activations shrink by the tp) and
step time (the tp traffic stays: reduce-scatter + all-gather instead of all-reduce). Pure simulation,
no measure lock needed.

    python bench/hetero_sp.py [--arch llama-70b] [--cluster h800-h20-256] [--seq-len 4096] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.cost.model import CostOptions  # noqa: E402
from hrlplan.cost.plans import predict_any_plan  # noqa: E402
from hrlplan.plan import PipelinePlan, Plan, StagePlan  # noqa: E402
from hrlplan.plan.checks import validate  # noqa: E402
from hrlplan.search.instances import load_meta, load_preset_config  # noqa: E402


def replica_plan(meta, devices, pp: int, tp: int, microbatches: int, sp: bool) -> Plan:
    """One replica: pp stages of tp ranks each, the layers split evenly, on `devices` (rank -> device)."""
    n = meta.n_layer
    cuts = [round(k * n / pp) for k in range(pp + 1)]
    stages = [StagePlan(layers=[cuts[k], cuts[k + 1]], ranks=list(range(k * tp, (k + 1) * tp)), tp=tp,
                        embedding=k == 0, head=k == pp - 1, sequence_parallel=sp) for k in range(pp)]
    pipe = PipelinePlan(stages=stages, num_microbatches=microbatches, batch_size=microbatches)
    plan = Plan(model=meta.name, n_layer=n, world_size=pp * tp, pp=pp, microbatch_size=1,
                num_microbatches=microbatches, global_batch_size=microbatches, schedule="1f1b", stages=stages,
                device_groups=[list(s.ranks) for s in stages], pipelines=[pipe],
                meta={"launch": {"nnodes": 1, "nproc_per_node": pp * tp, "rank_to_device": list(devices[:pp * tp])}})
    validate(plan)
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-70b")
    ap.add_argument("--cluster", default="h800-h20-256")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the model's record's")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", default="4,5,8,10")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    meta, cluster = load_meta(args.arch, args.seq_len), spec_from_preset(load_preset_config(args.cluster))
    rows = []
    for name in sorted({d.name for d in cluster.devices}):
        devices = [i for i, d in enumerate(cluster.devices) if d.name == name]
        gib = cluster.devices[devices[0]].memory_bytes / 2**30
        for pp in (int(x) for x in args.pp.split(",")):
            if pp * args.tp > len(devices):
                continue
            for sp in (False, True):
                plan = replica_plan(meta, devices, pp, args.tp, 2 * pp, sp)
                r = predict_any_plan(plan, meta, cluster, CostOptions(bytes_per_value=2))
                rows.append({"device": name, "device_gib": gib, "pp": pp, "tp": args.tp, "sp": sp,
                             "feasible": r["feasible"], "step_s": r["step_time_s"],
                             "peak_gib": max(r["memory_bytes_per_rank"]) / 2**30})
    print(f"{args.arch} seq {meta.seq_len}, one replica at tp {args.tp}, 1f1b, 2*pp micro-batches of 1 row")
    print(f"{'device':<10} {'GiB':>5} {'pp':>3}  {'peak no SP':>10} {'peak SP':>8}  {'step no SP':>10} {'step SP':>8}")
    for off, on in zip(rows[::2], rows[1::2]):
        mark = lambda r: "" if r["feasible"] else "*"   # noqa: E731 (over memory: time-only)
        print(f"{off['device']:<10} {off['device_gib']:>5.0f} {off['pp']:>3}  {off['peak_gib']:>9.1f}{mark(off):1} "
              f"{on['peak_gib']:>7.1f}{mark(on):1}  {off['step_s']:>10.3f} {on['step_s']:>8.3f}")
    print("* over the device's memory (the time is predicted anyway)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
