"""How much the pair probe's figure moves between runs on this host: the quickest of each size's
round trips (measure.ping_pong since round 6) against their mean (what it took before), fitted from
the same timed round trips.

    flock /tmp/hrlplan-measure.lock python bench/ping_pong_noise.py [--trials 30] [--repeats 3]

Two gloo processes on this machine; each trial times `repeats` round trips of each of the probe's
CPU sizes (probe_p2p_mb/16 and probe_p2p_mb) one by one on rank 0, then fits (bandwidth, latency)
both ways (measure.fit_latency_bandwidth). Prints each estimator's median and min-max over the
trials, and writes JSON (bench/results/ping_pong_noise.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.measure import _round_trip, fit_latency_bandwidth  # noqa: E402


def _worker(rank: int, port: int, sizes, trials: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device("cpu")
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    _round_trip(bufs[-1], 1 - rank, rank == 0, device)   # connection setup
    rows = []
    for _ in range(trials):
        samples = [[_round_trip(b, 1 - rank, rank == 0, device) / 2 for _ in range(repeats)] for b in bufs]
        if rank == 0:
            quickest = fit_latency_bandwidth(list(sizes), [min(s) for s in samples])
            mean = fit_latency_bandwidth(list(sizes), [statistics.fmean(s) for s in samples])
            rows.append({"quickest": quickest, "mean": mean, "one_way_s": samples})
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "max_over_min": max(values) / min(values) if min(values) > 0 else float("inf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="round trips per size (cluster.probe_repeats)")
    ap.add_argument("--p2p-mb", type=float, default=4.0, help="cluster.probe_p2p_mb")
    ap.add_argument("--out", default="bench/results/ping_pong_noise.json")
    args = ap.parse_args()
    big = int(args.p2p_mb * 2**20)
    sizes = (max(big // 16, 1), big)
    raw = Path(args.out).with_suffix(".raw.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(29500 + os.getpid() % 1000, sizes, args.trials, args.repeats, str(raw)), nprocs=2)
    rows = json.loads(raw.read_text())
    summary = {"sizes": sizes, "trials": args.trials, "repeats": args.repeats, "wall_s": time.perf_counter() - t0,
               "load_before": load_before, "load_after": os.getloadavg()}
    print(f"{args.trials} trials x {args.repeats} round trips of {sizes[0]:,} and {sizes[1]:,} bytes; "
          f"load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'estimator':<10}{'bandwidth GB/s median (min-max) max/min':>44}"
          f"{'latency us median (min-max) max/min':>42}")
    for name in ("quickest", "mean"):
        bw = _spread([r[name][0] / 1e9 for r in rows])
        lat = _spread([r[name][1] * 1e6 for r in rows])
        summary[name] = {"bandwidth_GBps": bw, "latency_us": lat}
        print(f"{name:<10}{bw['median']:>14.3f} ({bw['min']:.3f}-{bw['max']:.3f}) {bw['max_over_min']:>8.2f}x"
              f"{lat['median']:>14.1f} ({lat['min']:.1f}-{lat['max']:.1f}) {lat['max_over_min']:>8.2f}x")
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
