"""Runtime benchmark: pipeline overhead, measured step time vs the simulator (before and after
calibration), and the measured bubble vs the analytic and simulated ones.

    python bench/runtime.py [--steps 20] [--repeats 5] [--out bench/results/runtime.json] [--only pp2-1f1b,...]

Every plan is run --repeats times (interleaved with the other plans: round r runs every plan once).
Reported per plan: each rank's measured peak memory against the memory model's (and both splits:
weights, gradients, optimizer, activations, other), the measured median step time with its min-max
over the rounds and whether the prediction falls inside; across plans Spearman(predicted, measured)
and the measured rank of the plan predicted fastest (bench/_measure.py, shared with local_pick.py).
In each round, for each world size the plans need, a job of that many CPU workers first probes
this machine and calibrates (hrlplan.runtime.calibrate.calibrate_in_job) with the same process
count the plans run with (on a shared 2-core machine the per-rank speed depends on how many ranks
compete for it); that world's plans then run right after and are predicted from that calibration,
as pretrain.py planner.calibrate=true calibrates and then trains. A plan's error is the median of
its runs' errors; the runs' spread (max - min) / median is reported beside it as the run-to-run
noise a reader should judge the error against. The calibration is fitted from micro-benchmarks and
one one-process reference step only, never from the plans' own step times.
On a GPU machine it also measures GPT-2 124M bf16 MFU on one GPU (pretrain.py end to end, the median
per-step MFU against the GPU's datasheet peak, runtime/mfu.py); without one it says so (--mfu-check-on-cpu runs the
same path on gpt2-tiny on the CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _measure  # noqa: E402  (bench/_measure.py: memory per rank and the ranking, shared with local_pick)

ARCH = ["arch=gpt2-tiny", "train.lr=3e-3", "train.global_batch_size=8", "logger.mode=disabled",
        "train.checkpoint_interval=0"]


def plans() -> Dict[str, Any]:
    from hrlplan.plan import homogeneous_plan
    from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules

    def hp(spans, dp=1, m=4, schedule="1f1b", v=1, tp=1):
        return homogeneous_plan("gpt2-tiny", 6, spans, dp=dp, tp=tp, microbatch_size=8 // (m * dp), num_microbatches=m,
                                schedule=schedule, stages_per_rank=v)

    mods = get_modules("gpt2-tiny")
    one, two = PipelineTemplate("gpt2-tiny", [mods]), PipelineTemplate("gpt2-tiny", [mods[:5], mods[5:]])
    quarter = [(0, 2), (2, 3), (3, 5), (5, 6)]
    return {
        "1stage": hp([(0, 6)], m=1),
        "dp2": hp([(0, 6)], dp=2, m=1),
        "pp2-gpipe": hp([(0, 3), (3, 6)], schedule="gpipe"),
        "pp2-1f1b": hp([(0, 3), (3, 6)]),
        "pp2-1f1b-m2": hp([(0, 3), (3, 6)], m=2),   # what `python pretrain.py` plans for 2 workers here
        "pp2-interleaved": hp(quarter, schedule="interleaved_1f1b", v=2),
        "pp2-zbv": hp(quarter, schedule="zero_bubble", v=2),
        "hetero-1+2": build_plan([one, two], {one: 2, two: 2}, world_size=3, global_batch_size=8, model="gpt2-tiny"),
        "pp2xdp2": hp([(0, 3), (3, 6)], dp=2, m=2),
        "pp4": hp([(0, 3), (3, 4), (4, 5), (5, 6)]),   # what the planner picks for 4 workers here
        "tp2": hp([(0, 6)], m=1, tp=2),
        "pp2xtp2": hp([(0, 3), (3, 6)], m=2, tp=2),
    }


# ---------------------------------------------------------------- MFU: GPT-2 124M, bf16, one GPU
GPU_MFU = ["arch=gpt2", "train.dtype=bfloat16", "train.device=cuda", "cluster.nproc_per_node=1",
           "data.seq_len=1024", "train.global_batch_size=16"]
CPU_MFU_CHECK = ["arch=gpt2-tiny", "cluster.nproc_per_node=1"]   # the same path, runnable without a GPU


def measure_mfu(overrides: List[str], run_dir: Path, steps: int) -> Dict[str, Any]:
    """The whole product path (pretrain.py: probe, plan, train) on one worker; the median of the
    per-step MFU (against the datasheet's dense peak on a known GPU, else the probe's measured
    peak) and tokens/s after the warm-up steps."""
    import subprocess

    from hrlplan.runtime.metrics import read_metrics
    from hrlplan.runtime.timing import SKIP_STEPS

    cmd = [sys.executable, str(ROOT / "pretrain.py"), *overrides, f"train.steps={steps}", "logger.mode=disabled",
           "train.checkpoint_interval=0", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = read_metrics(run_dir)[SKIP_STEPS:]
    return {"overrides": overrides, "steps": steps,
            "mfu": statistics.median(r["train/mfu"] for r in rows),
            "tokens_per_s": statistics.median(r["train/tokens_per_s"] for r in rows)}


# ---------------------------------------------------------------- probe + calibrate in a job of W workers
def _calibrate_worker(config: Dict[str, Any]) -> Dict[str, Any] | None:
    import torch.distributed as dist

    from hrlplan.cluster import probe_distributed
    from hrlplan.runtime.calibrate import calibrate_in_job
    from hrlplan.runtime.distributed import broadcast_object, init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker

    init_distributed("auto", config["train"])   # the training device and backend (NCCL on GPUs)
    prepare_worker()
    try:
        spec = broadcast_object(probe_distributed(config["cluster"], name="bench"))
        uncalibrated = spec.to_dict()
        spec = calibrate_in_job(spec, config["arch"], config["train"], config["data"], planner=config["planner"])
        return {"uncalibrated": uncalibrated, "calibrated": spec.to_dict()} if dist.get_rank() == 0 else None
    finally:
        shutdown()


def threads_for(world: int) -> None:
    """One thread per worker, set before every launch (launch_workers only sets a default, which the
    first launch of this process would otherwise fix for all later ones). One, not cores/world: on
    a machine shared with other jobs a multi-threaded OpenMP region waits for its slowest thread,
    which made one 2-thread worker 5x slower than two 1-thread workers in our measurements."""
    os.environ["OMP_NUM_THREADS"] = "1"


def specs_for(world: int, config: Dict[str, Any]):
    from hrlplan.cluster import ClusterSpec
    from hrlplan.launch.local import launch_workers

    threads_for(world)
    out = launch_workers(_calibrate_worker, (config,), world, name="bench-calibrate")[0]
    return ClusterSpec.from_dict(out["uncalibrated"]), ClusterSpec.from_dict(out["calibrated"])


def rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else float("nan")


def memory_and_ranking(report: Dict[str, Any], runs: Dict[str, List[Dict[str, Any]]]) -> None:
    """Per plan and rank the measured peak memory against the model's (with the splits); per plan the
    measured median step time, its min-max over the rounds and whether the prediction falls inside;
    across plans Spearman(predicted, measured) and the measured rank of the plan predicted fastest
    (overall and per world size: what the planner would pick among these)."""
    memory = {name: next((x["memory"] for x in xs if x.get("memory")), []) for name, xs in runs.items() if xs}
    print("[bench] memory per rank (measured peak vs predicted tensor bytes; split MiB measured/predicted):")
    for name, rows in memory.items():
        report["plans"][name]["memory_per_rank"] = rows
        print("\n".join(_measure.memory_lines(name, rows)), flush=True)
    report.update(_measure.memory_summary(memory))
    print(f"[bench] memory: {report['memory_ranks_within_10pct']} of {report['memory_ranks']} ranks within 10% "
          f"(max |error| {report['memory_max_abs_error'] or 0:.1%}, "
          f"median {report['memory_median_abs_error'] or 0:.1%})")
    timing = {name: _measure.timing_row([x["step"] for x in xs], [x["after"]["step_time_s"] for x in xs])
              for name, xs in runs.items() if xs}
    for name, row in timing.items():
        report["plans"][name]["timing"] = row
    report["ranking"] = _measure.ranking(timing)
    print("\n".join(_measure.timing_lines(timing, report["ranking"])), flush=True)
    report["ranking_per_world"] = {}
    for world in sorted({report["plans"][n]["world_size"] for n in timing}):
        sub = {n: row for n, row in timing.items() if report["plans"][n]["world_size"] == world}
        rank = report["ranking_per_world"][str(world)] = _measure.ranking(sub)
        if len(sub) > 1:
            print(f"[bench] {world} worker(s): Spearman {rank['spearman_predicted_vs_measured']:.2f}, "
                  f"predicted fastest {rank['pick']} measured #{rank['pick_measured_rank']} of {len(sub)} "
                  f"({'within' if rank['pick_within_fastest_spread'] else 'outside'} the fastest's range)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="rounds: runs per plan, each after its own calibration")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "runtime.json"))
    ap.add_argument("--only", default="", help="comma-separated plan names")
    ap.add_argument("--run-dir", default="/tmp/hrlplan-bench-runtime")
    ap.add_argument("--mfu-check-on-cpu", action="store_true",
                    help="without a GPU, run the MFU measurement's path on gpt2-tiny on the CPU")
    args = ap.parse_args()

    from hrlplan.compose import compose
    from hrlplan.model_meta import introspect
    from hrlplan.launch.local_run import train_plan
    from hrlplan.runtime.calibrate import predict_plan
    from hrlplan.runtime.reference import train_single_process
    from hrlplan.runtime.timing import analytic_bubble, median_step_time

    config = compose([*ARCH, f"train.steps={args.steps}"])
    meta = introspect(config["arch"], seq_len=int(config["data"]["seq_len"]))
    chosen = {k: v for k, v in plans().items() if not args.only or k in args.only.split(",")}
    report: Dict[str, Any] = {"model": "gpt2-tiny", "steps": args.steps, "repeats": args.repeats, "machine": f"{os.cpu_count()} CPU cores",
                              "plans": {}, "calibration": {}}
    # Each round calibrates afresh for every world size and runs that world's plans right after, as
    # pretrain.py with planner.calibrate=true does: on a shared machine the load drifts over minutes,
    # so a calibration is compared with the runs it would have planned, not with runs much later.
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in chosen}
    worlds = sorted({p.world_size for p in chosen.values()})
    for r in range(args.repeats):
        for world in worlds:
            t0 = time.time()
            uncalibrated, calibrated = specs_for(world, config)
            cal = {k: v for k, v in calibrated.calibration.items() if k != "measurements"}
            cal["load_average_after"] = os.getloadavg()[0]   # a busy machine biases it
            report["calibration"].setdefault(str(world), []).append(cal)
            # the whole calibrated spec per round, its raw measurements too (~15 kB): predictions, and
            # other fits of the same micro-benchmarks, can be recomputed offline from the report
            report.setdefault("cluster_specs", {}).setdefault(str(world), []).append(calibrated.to_dict())
            print(f"[bench] round {r + 1}/{args.repeats}: probed + calibrated {world} worker(s) in "
                  f"{time.time() - t0:.1f} s", flush=True)
            for name, plan in chosen.items():
                if plan.world_size != world:
                    continue
                threads_for(world)
                after = predict_plan(plan, meta, calibrated, config["train"])
                try:
                    summary = train_plan(plan, config, Path(args.run_dir) / name, predicted=after)
                except Exception as e:   # a runtime failure of one plan must not hide the others' figures
                    print(f"[bench] round {r + 1}/{args.repeats} {name:16s} FAILED: {str(e)[:300]}", flush=True)
                    report.setdefault("failed", {})[name] = str(e)[:1000]
                    continue
                # memory is deterministic (fixed shapes): measured against the model on the plan's first run
                memory = _measure.memory_per_rank(plan, summary, meta, calibrated, config["train"]) \
                    if not any(x.get("memory") for x in runs[name]) else None
                runs[name].append({"step": median_step_time([h["train/step_time_s"] for h in summary["history"]]),
                                   "memory": memory,
                                   "bubble": summary["measured"]["bubble_fraction"],
                                   "loss": summary["history"][-1]["train/lm_loss"],
                                   "phases": summary["measured"].get("phases_s_per_rank", []),
                                   "before": predict_plan(plan, meta, uncalibrated, config["train"]), "after": after})
                print(f"[bench] round {r + 1}/{args.repeats} {name:16s} {runs[name][-1]['step'] * 1e3:7.2f} ms "
                      f"(predicted {after['step_time_s'] * 1e3:.2f} ms)", flush=True)

    for name, plan in chosen.items():
        if not runs[name]:
            continue
        steps = [x["step"] for x in runs[name]]
        step = statistics.median(steps)
        noise = (max(steps) - min(steps)) / step if step else float("nan")
        errors = [rel(x["step"], x["after"]["step_time_s"]) for x in runs[name]]
        errors0 = [rel(x["step"], x["before"]["step_time_s"]) for x in runs[name]]
        # the run whose error is the median one stands for the plan (its prediction and breakdown)
        mid = sorted(range(len(errors)), key=lambda i: errors[i])[len(errors) // 2]
        before, after = runs[name][mid]["before"], runs[name][mid]["after"]
        row = {"layout": plan.layout(), "world_size": plan.world_size, "measured_step_s": step,
               "measured_step_s_runs": steps, "run_to_run_spread": noise,
               "predicted_step_s_uncalibrated": before["step_time_s"], "predicted_step_s_calibrated": after["step_time_s"],
               "predicted_step_s_calibrated_runs": [x["after"]["step_time_s"] for x in runs[name]],
               "predicted_breakdown_runs": [{k: v for k, v in x["after"].get("breakdown", {}).items()
                                             if isinstance(v, (int, float))} for x in runs[name]],
               "measured_phases_runs": [x["phases"] for x in runs[name]],
               "error_uncalibrated": statistics.median(errors0), "error_calibrated": statistics.median(errors),
               "error_calibrated_runs": errors,
               "predicted_breakdown": {k: v for k, v in after.get("breakdown", {}).items()
                                       if isinstance(v, (int, float))},
               "bubble_measured": statistics.median(x["bubble"] for x in runs[name]),
               "bubble_simulated": after["bubble_fraction"],
               "bubble_analytic": analytic_bubble(plan.schedule, plan.pp, plan.num_microbatches, plan.stages_per_rank)
               if not plan.heterogeneous else None,
               "final_loss": runs[name][-1]["loss"],
               # where the step went (per rank, median over the runs) beside the prediction's breakdown
               "measured_phases_s_per_rank": [{k: statistics.median(x["phases"][r][k] for x in runs[name])
                                               for k in runs[name][0]["phases"][r]}
                                              for r in range(len(runs[name][0]["phases"]))]}
        report["plans"][name] = row
        print(f"[bench] {name:16s} measured {step * 1e3:7.2f} ms (spread {noise:5.1%} over {len(steps)}) | simulator "
              f"{before['step_time_s'] * 1e3:7.2f} ms ({row['error_uncalibrated']:+.1%}) -> calibrated "
              f"{after['step_time_s'] * 1e3:7.2f} ms ({row['error_calibrated']:+.1%}; runs "
              + " ".join(f"{e:+.1%}" for e in errors) + f") | bubble measured "
              f"{row['bubble_measured']:.2f} simulated {after['bubble_fraction']:.2f} analytic {row['bubble_analytic']}",
              flush=True)
        b = after.get("breakdown", {})
        print(f"[bench] {'':16s} phases (ms, per rank): " + " | ".join(
            " ".join(f"{k[:5]} {v * 1e3:.1f}" for k, v in ph.items()) for ph in row["measured_phases_s_per_rank"])
            + f" || predicted pipeline_end {b.get('pipeline_end_s', 0) * 1e3:.1f} optimizer "
              f"{b.get('optimizer_s', 0) * 1e3:.1f} collectives {b.get('step_collectives_s', 0) * 1e3:.1f}"
              f" cross-replica {b.get('cross_replica_reduce_s', 0) * 1e3:.1f} overhead "
              f"{b.get('step_overhead_s', 0) * 1e3:.1f}", flush=True)

    if "1stage" in chosen:
        import torch

        from hrlplan.runtime.host import keep_freed_memory

        torch.set_num_threads(1)   # as the pipeline's worker
        keep_freed_memory()
        plain = [h["step_time_s"] for h in train_single_process(config, args.steps)]
        pipe = report["plans"]["1stage"]["measured_step_s"]
        plain_med = median_step_time(plain)
        report["overhead"] = {"plain_loop_step_s": plain_med, "one_stage_pipeline_step_s": pipe,
                              "ratio": pipe / plain_med}
        print(f"[bench] overhead: 1-stage pipeline {pipe * 1e3:.2f} ms vs plain loop {plain_med * 1e3:.2f} ms "
              f"(ratio {pipe / plain_med:.3f})", flush=True)
    memory_and_ranking(report, runs)
    errs = [abs(r["error_calibrated"]) for r in report["plans"].values()]
    errs0 = [abs(r["error_uncalibrated"]) for r in report["plans"].values()]
    report["median_abs_error_uncalibrated"] = statistics.median(errs0) if errs0 else None
    report["median_abs_error_calibrated"] = statistics.median(errs) if errs else None
    report["max_abs_error_calibrated"] = max(errs) if errs else None
    spreads = [r["run_to_run_spread"] for r in report["plans"].values()]
    report["median_run_to_run_spread"] = statistics.median(spreads) if spreads else None
    import torch

    if torch.cuda.is_available() or args.mfu_check_on_cpu:
        report["gpu_mfu_run"] = measure_mfu(GPU_MFU if torch.cuda.is_available() else CPU_MFU_CHECK,
                                            Path(args.run_dir) / "mfu", steps=max(args.steps, 10))
        r = report["gpu_mfu_run"]
        report["gpu_mfu"] = (f"{'GPT-2 124M bf16 on one GPU' if torch.cuda.is_available() else 'CPU check'}: "
                             f"MFU {r['mfu']:.1%} of the datasheet peak, {r['tokens_per_s']:.0f} tokens/s")
    else:
        report["gpu_mfu"] = "no GPU in this run: GPT-2 124M bf16 MFU not measured"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=float))
    print(f"[bench] median |error| uncalibrated {report['median_abs_error_uncalibrated']:.1%}, calibrated "
          f"{report['median_abs_error_calibrated']:.1%} (max {report['max_abs_error_calibrated']:.1%}); median "
          f"run-to-run spread {report['median_run_to_run_spread']:.1%}; {report['gpu_mfu']}; wrote {args.out}")


if __name__ == "__main__":
    main()
