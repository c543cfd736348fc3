"""Schedule benchmark: each registry schedule's measured bubble beside the simulator's, on CPU.

    python bench/schedules.py [--repeats 5] [--steps 4] [--pad-ms 0] [--only gpipe,zbv]
                              [--out bench/results/schedules.json]

Every schedule of hrlplan.schedules runs on 2 gloo ranks, two stages per rank where it takes them,
4 micro-batches of gpt2-tiny (n_embd 128, one block per stage with two stages per rank, two
otherwise), --repeats times interleaved with the others (round r runs every schedule once). Per run,
from the last step's measured actions (hrlplan.runtime.timing): the measured bubble (idle over
busy + idle, every rank from the step's barrier to the last action's end), the simulator's bubble
for the schedule's order (hrlplan.cost.timeline) replayed with that step's median action durations
and free communication (replayed_bubble), and the registry's analytic bubble. Reported per schedule:
medians with their min-max over the runs, and the median of measured - replayed.

On a shared CPU the actions' lengths follow the machine's load; --pad-ms N adds N ms of sleep to
every forward, input-gradient and weight pass (tests/_padded_schedules.py), which the load does
not stretch (tests/test_schedule_training.py checks the order itself, untimed): what remains
between measured and replayed is the order and gloo's per-message delay.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYERS, MICROBATCHES, BATCH = 4, 4, 32
ARCH = ["arch=gpt2-tiny", f"arch.n_layer={LAYERS}", "arch.n_embd=128", "logger.mode=disabled",
        "train.checkpoint_interval=0"]


def cases(only: List[str]) -> List[tuple]:
    from hrlplan.schedules import SCHEDULES

    chosen = [(name, spec.stages_per_rank_for(2)) for name, spec in SCHEDULES.items() if not only or name in only]
    unknown = set(only) - set(SCHEDULES)
    if unknown:
        raise SystemExit(f"bench/schedules.py: error: --only names {', '.join(sorted(unknown))}; "
                         f"the registry has {', '.join(SCHEDULES)}")
    return chosen


def run_once(schedule: str, v: int, steps: int, pad_s: float, batch: int) -> Dict[str, float]:
    from hrlplan.compose import compose
    from hrlplan.launch.local_run import train_plan
    from hrlplan.plan import homogeneous_plan
    from hrlplan.runtime.timing import analytic_bubble, measured_bubble, replayed_bubble

    n = 2 * v
    per = LAYERS // n
    plan = homogeneous_plan("gpt2-tiny", LAYERS, [(i * per, (i + 1) * per) for i in range(n)], dp=1, tp=1,
                            microbatch_size=batch // MICROBATCHES, num_microbatches=MICROBATCHES,
                            schedule=schedule, stages_per_rank=v)
    overrides = [*ARCH, f"train.global_batch_size={batch}", f"train.schedule={schedule}",
                 f"train.stages_per_rank={v}"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if pad_s > 0:
            from _padded_schedules import train_padded
            summary = train_padded(plan, overrides, Path(tmp), steps, {"F": pad_s, "B": pad_s, "W": pad_s})
        else:
            config = compose([*overrides, f"train.steps={steps}"])
            summary = train_plan(plan, config, tmp, metrics_file=False)
    events = summary["measured"]["events"]
    ranks = sorted({e["rank"] for e in events})
    return {"measured": measured_bubble([{"events": [e for e in events if e["rank"] == r]} for r in ranks]),
            "replayed": replayed_bubble(schedule, 2, MICROBATCHES, v, events),
            "analytic": analytic_bubble(schedule, 2, MICROBATCHES, v),
            "step_s": summary["measured"]["step_time_s"], "wall_s": time.perf_counter() - t0}


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the last one is measured")
    ap.add_argument("--pad-ms", type=float, default=0.0, help="sleep added to every F, B and W pass")
    ap.add_argument("--only", default="", help="comma-separated registry names")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "schedules.json"))
    args = ap.parse_args(argv)
    chosen = cases([s for s in args.only.split(",") if s])
    batch = MICROBATCHES if args.pad_ms > 0 else BATCH   # padded: one row per micro-batch, the sleep dominates
    runs: Dict[str, List[Dict[str, float]]] = {f"{s}-v{v}": [] for s, v in chosen}
    for r in range(args.repeats):
        for schedule, v in chosen:
            result = run_once(schedule, v, args.steps, args.pad_ms / 1e3, batch)
            runs[f"{schedule}-v{v}"].append(result)
            print(f"round {r + 1}/{args.repeats} {schedule:24s} v={v}  measured {result['measured']:.3f}  "
                  f"replayed {result['replayed']:.3f}  ({result['wall_s']:.0f} s)", flush=True)
    report = {}
    print(f"\n{'schedule':28s} {'measured (min-max)':>22s} {'replayed (min-max)':>22s} {'analytic':>9s} "
          f"{'meas-repl':>10s}")
    for key, rs in runs.items():
        measured, replayed = spread([x["measured"] for x in rs]), spread([x["replayed"] for x in rs])
        diff = statistics.median(x["measured"] - x["replayed"] for x in rs)
        report[key] = {"measured_bubble": measured, "replayed_bubble": replayed, "analytic_bubble": rs[0]["analytic"],
                       "measured_minus_replayed": diff, "step_s": spread([x["step_s"] for x in rs]), "runs": rs}
        print(f"{key:28s} {measured['median']:8.3f} ({measured['min']:.3f}-{measured['max']:.3f}) "
              f"{replayed['median']:8.3f} ({replayed['min']:.3f}-{replayed['max']:.3f}) {rs[0]['analytic']:9.3f} "
              f"{diff:+10.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "steps": args.steps, "pad_ms": args.pad_ms,
                               "microbatches": MICROBATCHES, "batch": batch, "schedules": report}, indent=1))
    print(f"\nwritten {out}")
    return report


if __name__ == "__main__":
    main()
