"""Does the planner pick the fastest layout on emulated heterogeneous workers? (issue 35)

    python bench/hetero_pick.py [--rounds 3] [--steps 12] [--shares 1,0.33,0.33] [--out bench/results/hetero_pick.json]

Three local workers, one uncapped and two capped to a third of a core (cluster.cpu_shares,
launch/cpu_quota.py), gpt2-tiny at global batch 12. Each round calibrates the capped workers afresh,
asks exact with planner.heterogeneous=true for its pick and with =false for the best single
template, then trains every layout once -- the pick, the single template and the hand-written ones
(heterogeneous among them) -- round-robin, so a shared host's drift hits every layout alike, each
predicted from the same calibration. Reported: the measured median per layout with its min-max
spread, Spearman(predicted, measured) over the layouts' medians, and the pick's measured rank
(target: the fastest, or within the fastest's spread). The load average is recorded: on a busy
host a cap of a third of a core may not bind (the uncapped worker then gets no more than the capped).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _measure  # noqa: E402  (bench/_measure.py: the ranking, shared with runtime.py)
from runtime import _calibrate_worker, threads_for  # noqa: E402  (bench/runtime.py: probe + calibrate a job)

BATCH = 12
ARCH = ["arch=gpt2-tiny", "train.lr=3e-3", f"train.global_batch_size={BATCH}", "logger.mode=disabled",
        "train.checkpoint_interval=0", "train.schedule=1f1b"]


def hand_written(world: int) -> Dict[str, Any]:
    """Layouts of gpt2-tiny (6 blocks) over 3 workers: rank 0 fast, ranks 1-2 slow."""
    from hrlplan.plan import Plan, homogeneous_plan, launch_meta

    def homo(spans, dp=1, m=1):
        plan = homogeneous_plan("gpt2-tiny", 6, spans, dp=dp, tp=1, microbatch_size=BATCH // (m * dp),
                                num_microbatches=m, schedule="1f1b")
        if plan.world_size < world:
            plan.unused_ranks = list(range(plan.world_size, world))
            plan.world_size = world
            plan.meta["launch"] = launch_meta(world)
        return plan

    def replicas(pipes):
        """pipes: [(rows, m, [(layers, rank), ...])] -> a heterogeneous plan over `world` ranks."""
        used = {r for _, _, stages in pipes for _, r in stages}
        out = []
        for rows, m, stages in pipes:
            last = len(stages) - 1
            out.append({"batch_size": rows, "num_microbatches": m,
                        "stages": [{"layers": list(span), "ranks": [r], "tp": 1, "dp": 1, "embedding": k == 0,
                                    "head": k == last, "recompute": "none"} for k, (span, r) in enumerate(stages)]})
        return Plan.from_dict({"model": "gpt2-tiny", "n_layer": 6, "world_size": world, "global_batch_size": BATCH,
                               "schedule": "1f1b", "pipelines": out,
                               "unused_ranks": sorted(set(range(world)) - used),
                               "meta": {"launch": launch_meta(world)}}, source="bench/hetero_pick.py")

    whole = (0, 6)
    return {
        "fast-only": homo([whole], m=1),
        "dp3-even": homo([whole], dp=3, m=1),
        "pp3-2/2/2-m4": homo([(0, 2), (2, 4), (4, 6)], m=4),
        "pp3-4/1/1-m4": homo([(0, 4), (4, 5), (5, 6)], m=4),
        "replicas-8/2/2": replicas([(8, 1, [(whole, 0)]), (2, 1, [(whole, 1)]), (2, 1, [(whole, 2)])]),
        "replicas-6/3/3": replicas([(6, 1, [(whole, 0)]), (3, 1, [(whole, 1)]), (3, 1, [(whole, 2)])]),
        "fast+pp2-slow-8/4": replicas([(8, 1, [(whole, 0)]), (4, 2, [((0, 3), 1), ((3, 6), 2)])]),
    }


def same_layout(a, b) -> bool:
    key = lambda p: (p.layout(), tuple(p.unused_ranks), p.heterogeneous)  # noqa: E731
    return key(a) == key(b)


def train_capped(plan, config, shares: List[Optional[float]], run_dir: Path) -> Dict[str, Any]:
    """Train `plan` on its used workers, each keeping its job rank's CPU share."""
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers
    from hrlplan.launch.local_run import _worker
    from hrlplan.search.placement import compact

    trained, used = compact(plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = as_config(config)
    cfg.run_dir = str(run_dir)
    threads_for(trained.world_size)
    return launch_workers(_worker, (cfg, trained.to_yaml(), False), trained.world_size, name="hetero-pick",
                          cpu_shares=[shares[r] for r in used])[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--shares", default="1,0.33,0.33", help="per worker; 1 = uncapped")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hetero_pick.json"))
    ap.add_argument("--run-dir", default="/tmp/hrlplan-bench-hetero-pick")
    args = ap.parse_args()

    from hrlplan.cluster import ClusterSpec
    from hrlplan.compose import compose
    from hrlplan.launch.local import launch_workers
    from hrlplan.model_meta import introspect
    from hrlplan.runtime.calibrate import predict_plan
    from hrlplan.runtime.timing import median_step_time
    from hrlplan.search import make_plan
    from hrlplan.search.config import ExactPlannerConfig

    shares = [None if float(s) >= 1 else float(s) for s in args.shares.split(",")]
    world = len(shares)
    config = compose([*ARCH, f"train.steps={args.steps}"])
    meta = introspect(config["arch"], seq_len=int(config["data"]["seq_len"]))
    candidates = hand_written(world)
    runs: Dict[str, List[Dict[str, float]]] = {}
    picks: List[str] = []
    loads = []
    for r in range(args.rounds):
        t0 = time.time()
        threads_for(world)
        out = launch_workers(_calibrate_worker, (config,), world, name="hetero-pick-calibrate", cpu_shares=shares)[0]
        calibrated = ClusterSpec.from_dict(out["calibrated"])
        exact = asdict(ExactPlannerConfig())
        pick, _ = make_plan(meta, calibrated, dict(exact, heterogeneous="true"), config["train"])
        single, _ = make_plan(meta, calibrated, dict(exact, heterogeneous="false"), config["train"])
        for label, plan in (("pick", pick), ("single", single)):
            name = next((n for n, p in candidates.items() if same_layout(p, plan)), None)
            if name is None:
                name = f"{label}-{r}"
                candidates[name] = plan
            if label == "pick":
                picks.append(name)
        print(f"[hetero-pick] round {r + 1}/{args.rounds}: calibrated in {time.time() - t0:.0f} s (flops per worker "
              f"{[round(d.peak_flops / 1e9, 1) for d in calibrated.devices]} GFLOP/s); pick {picks[-1]}: "
              f"{pick.layout()}", flush=True)
        for name, plan in candidates.items():
            predicted = predict_plan(plan, meta, calibrated, config["train"])["step_time_s"]
            try:
                summary = train_capped(plan, config, shares, Path(args.run_dir) / name)
            except Exception as e:   # one layout's failure must not hide the others' figures
                print(f"[hetero-pick]   {name:20s} FAILED: {str(e)[:200]}", flush=True)
                continue
            step = median_step_time([h["train/step_time_s"] for h in summary["history"]])
            runs.setdefault(name, []).append({"measured_s": step, "predicted_s": predicted})
            print(f"[hetero-pick]   {name:20s} {step * 1e3:8.2f} ms (predicted {predicted * 1e3:8.2f} ms)", flush=True)
        loads.append(os.getloadavg())
    rows = {n: dict(_measure.timing_row([x["measured_s"] for x in xs], [x["predicted_s"] for x in xs]),
                    layout=candidates[n].layout(), runs=xs) for n, xs in runs.items()}
    pick = statistics.mode(picks)
    rank = _measure.ranking(rows, pick)
    report = {"world": world, "shares": shares, "rounds": args.rounds, "steps": args.steps, "layouts": rows,
              "picks": picks, "pick": pick, **rank, "load_average": loads}
    print()
    print("\n".join(_measure.timing_lines(rows, rank, label="layout")))
    print(f"load average per round: {loads}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
