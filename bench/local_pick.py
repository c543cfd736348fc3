"""Does the planner pick the fastest layout on this machine? The README's main job (gpt2-tiny,
global batch 8, every CPU worker of this host -- 2 here) against hand-written layouts.

    python bench/local_pick.py [--rounds 5] [--steps 20] [--out bench/results/local_pick.json]

Each round calibrates afresh (as `python pretrain.py` does when its cache is empty), asks the
exact planner for its pick from that calibration, then runs every layout once -- round-robin, so
slow drifts of a shared host hit every layout alike -- and predicts each from the same
calibration. Reported per layout: the measured median step time over the rounds and its spread,
the median prediction and whether it falls inside the measured range, and each rank's measured
peak memory (live tensor storages) against the memory model's; across layouts, Spearman's
rank correlation of predicted vs measured medians and the measured rank of the planner's pick
(target: the fastest, or within the measured spread of the fastest). A layout that leaves a
worker idle runs on its used workers only, as the job runs it once the idle one has left.
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
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _measure  # noqa: E402  (bench/_measure.py: memory per rank and the ranking, shared with runtime.py)
from runtime import ARCH, specs_for, threads_for  # noqa: E402  (bench/runtime.py: probe + calibrate a job)


def layouts(world: int) -> Dict[str, Any]:
    """Hand-written layouts of gpt2-tiny (6 blocks, batch 8) over `world` workers (2 on this host)."""
    from hrlplan.plan import homogeneous_plan, launch_meta

    def hp(spans, dp=1, m=4, schedule="1f1b", v=1, tp=1):
        plan = homogeneous_plan("gpt2-tiny", 6, spans, dp=dp, tp=tp, microbatch_size=8 // (m * dp), num_microbatches=m,
                                schedule=schedule, stages_per_rank=v)
        if plan.world_size < world:   # the job launches every worker; the others stay idle
            plan.unused_ranks = list(range(plan.world_size, world))
            plan.world_size = world
            plan.meta["launch"] = launch_meta(world)
        return plan

    quarter = [(0, 2), (2, 3), (3, 5), (5, 6)]
    return {
        "1worker-m1": hp([(0, 6)], m=1), "1worker-m2": hp([(0, 6)], m=2),
        "dp2": hp([(0, 6)], dp=2, m=1), "dp2-m2": hp([(0, 6)], dp=2, m=2), "tp2": hp([(0, 6)], m=1, tp=2),
        "pp2-1f1b-3/3-m2": hp([(0, 3), (3, 6)], m=2), "pp2-1f1b-4/2-m2": hp([(0, 4), (4, 6)], m=2),
        "pp2-1f1b-2/4-m2": hp([(0, 2), (2, 6)], m=2), "pp2-1f1b-3/3-m4": hp([(0, 3), (3, 6)], m=4),
        "pp2-gpipe-3/3-m4": hp([(0, 3), (3, 6)], schedule="gpipe"),
        "pp2-interleaved-m4": hp(quarter, schedule="interleaved_1f1b", v=2),
    }


def same_layout(a, b) -> bool:
    key = lambda p: (p.layout(), p.dp, p.microbatch_size, p.num_microbatches, p.schedule,  # noqa: E731
                     tuple(tuple(s.ranks) for s in p.stages), tuple(p.unused_ranks))
    return key(a) == key(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "local_pick.json"))
    ap.add_argument("--run-dir", default="/tmp/hrlplan-bench-local-pick")
    args = ap.parse_args()

    from hrlplan.cluster import default_nproc_per_node
    from hrlplan.compose import compose
    from hrlplan.model_meta import introspect
    from hrlplan.launch.local_run import train_plan
    from hrlplan.runtime.calibrate import predict_plan
    from hrlplan.runtime.timing import median_step_time
    from hrlplan.search import make_plan
    from hrlplan.search.config import ExactPlannerConfig
    from hrlplan.search.placement import compact

    world = default_nproc_per_node("auto")
    config = compose([*ARCH, f"train.steps={args.steps}"])
    meta = introspect(config["arch"], seq_len=int(config["data"]["seq_len"]))
    candidates = layouts(world)
    runs: Dict[str, List[Dict[str, float]]] = {}
    picks: List[str] = []
    for r in range(args.rounds):
        t0 = time.time()
        _, calibrated = specs_for(world, config)
        pick, _ = make_plan(meta, calibrated, asdict(ExactPlannerConfig()), config["train"])
        name = next((n for n, p in candidates.items() if same_layout(p, pick)), None)
        if name is None:
            name = f"pick-{len(picks)}"
            candidates[name] = pick
        picks.append(name)
        print(f"[local-pick] round {r + 1}/{args.rounds}: calibrated in {time.time() - t0:.0f} s; the planner "
              f"picks {name} ({pick.layout()}, {pick.num_microbatches}x{pick.microbatch_size}, idle "
              f"{pick.unused_ranks})", flush=True)
        for lname, plan in candidates.items():
            predicted = predict_plan(plan, meta, calibrated, config["train"])["step_time_s"]
            trained, _ = compact(plan)
            threads_for(trained.world_size)
            try:
                summary = train_plan(trained, config, Path(args.run_dir) / lname)
            except Exception as e:   # one layout's failure must not hide the others' figures
                print(f"[local-pick]   {lname:20s} FAILED: {str(e)[:200]}", flush=True)
                continue
            step = median_step_time([h["train/step_time_s"] for h in summary["history"]])
            # memory per used rank: measured (trained as the compact plan) vs the model's tensor bytes
            used = [r for r in range(plan.world_size) if r not in set(plan.unused_ranks)]
            memory = _measure.memory_per_rank(plan, summary, meta, calibrated, config["train"], used=used)
            runs.setdefault(lname, []).append({"measured_s": step, "predicted_s": predicted, "memory": memory})
            print(f"[local-pick]   {lname:20s} {step * 1e3:7.2f} ms (predicted {predicted * 1e3:7.2f} ms)", flush=True)

    rows = {}
    for lname, xs in runs.items():
        rows[lname] = dict(_measure.timing_row([x["measured_s"] for x in xs], [x["predicted_s"] for x in xs]),
                           layout=candidates[lname].layout(), idle_ranks=candidates[lname].unused_ranks, runs=xs,
                           memory_per_rank=xs[-1]["memory"],
                           memory_error_per_rank=[x["error"] for x in xs[-1]["memory"]])
    pick = statistics.mode(picks)
    rank = _measure.ranking(rows, pick)
    report = {"world": world, "rounds": args.rounds, "steps": args.steps, "layouts": rows, "picks": picks,
              "pick": pick, **rank, "load_average": os.getloadavg()}
    print()
    print("\n".join(_measure.timing_lines(rows, rank, label="layout")))
    print("memory per rank (measured peak vs predicted tensor bytes; split MiB measured/predicted):")
    for n in rank["measured_order"]:
        print("\n".join(_measure.memory_lines(n, rows[n]["memory_per_rank"])))
    report.update(_measure.memory_summary({n: x["memory_per_rank"] for n, x in rows.items()}))
    print(f"memory: {report['memory_ranks_within_10pct']} of {report['memory_ranks']} ranks within 10% of the "
          f"prediction (max |error| {report['memory_max_abs_error'] or 0:.1%})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
