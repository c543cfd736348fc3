"""Does the planner pick the fastest layout on emulated heterogeneous workers? (issue 35)

    python bench/hetero_pick.py [--rounds 3] [--steps 20] [--shares 1,0.33,0.33] [--out bench/results/hetero_pick.json]
                                [--only LAYOUT,...] [--actions]

Three local workers, one uncapped and two capped to a third of a core (cluster.cpu_shares,
launch/cpu_quota.py), gpt2-tiny at global batch 12. Each round calibrates the capped workers afresh,
asks exact with planner.heterogeneous=true for its pick and with =false for the best single
template, then trains every layout once -- the pick, the single template and the hand-written ones
(heterogeneous among them) -- round-robin, so a shared host's drift hits every layout alike, each
predicted from the same calibration. A layout's measured figure is its mean step (the measured
steps' total over their count: a capped worker stalls once every few steps when its quota runs out,
which a median step leaves out); the median step is kept beside it. Reported: the measured figure per
layout over the rounds (median, min-max), Spearman(predicted, measured) over the layouts' medians,
and the pick's measured rank (target: the fastest, or within the fastest's spread).

Diagnosis (--actions; always in the json, under runs[].ranks): per rank the simulator's forward and
backward of its stage beside the median wall and CPU time of the ones it ran, a capped rank's
predicted CPU per step (cost/quota_cpu.py: what bounds its step at its share) beside the CPU per step
it measured and its parts (gloo's transport threads among them), and a capped worker's cgroup
throttling counts (over the whole worker: start-up included). Where CPU time agrees
with the prediction and wall exceeds it, the rank waited (throttled, cores shared); where CPU time
is off, compute is mis-costed. The load average is recorded per layout and round: on a busy host a
cap of a third of a core may not bind (the uncapped worker then gets no more than the capped).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _measure  # noqa: E402  (bench/_measure.py: the ranking, shared with runtime.py)
from runtime import _calibrate_worker, threads_for  # noqa: E402  (bench/runtime.py: probe + calibrate a job)

BATCH = 12
# The planner may take every micro-batch size the hand-written layouts use (every divisor of the batch):
# with the default sizes (powers of two) fast-only's one micro-batch of 12 was outside its space, and
# calibration timed no block above 4 sequences.
MICROBATCH_SIZES = [d for d in range(1, BATCH + 1) if BATCH % d == 0]
ARCH = ["arch=gpt2-tiny", "train.lr=3e-3", f"train.global_batch_size={BATCH}", "logger.mode=disabled",
        "train.checkpoint_interval=0", "train.schedule=1f1b",
        f"planner.microbatch_sizes=[{','.join(map(str, MICROBATCH_SIZES))}]"]


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
    """The same stages, idle ranks, form and micro-batching: a homogeneous plan's layout() leaves its
    micro-batches out, and one micro-batch of 12 on the fast worker was taken for three of 4."""
    def key(p):
        return (p.layout(), tuple(p.unused_ranks), p.heterogeneous,
                tuple((q.microbatch_size, q.num_microbatches) for q in p.as_pipelines()))
    return key(a) == key(b)


def gloo_thread_cpu_s() -> float:
    """CPU seconds so far of this process's gloo transport threads (gloo_tcp_loop; /proc schedstat, ns):
    a pipeline's sends and receives cost the quota there, beside the main thread's work."""
    total = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            if (task / "comm").read_text().strip().startswith("gloo"):
                total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _cpu_metered_worker(config, plan_yaml: str, metrics_file: bool):
    """launch/local_run's worker, each rank also writing to cpu-rank<r>.json the CPU time (all its
    threads, user + system: what a quota meters, loopback copies included) of every training step
    and of its parts: the schedule (forward_backward; of it, the recorded forwards and backwards),
    gradient sync and clipping, the optimizer steps; and of it, gloo's transport threads'."""
    from hrlplan.launch.local_run import _worker
    from hrlplan.runtime.trainer import PipelineTrainer

    steps: List[Dict[str, float]] = []
    plain = PipelineTrainer.train_step

    def metered(fn, key):
        def run(*args, **kwargs):
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                steps[-1][key] = steps[-1].get(key, 0.0) + time.process_time() - c0
        return run

    def train_step(self, batch, step):
        if not getattr(self, "_cpu_metered", False):
            self._cpu_metered = True
            self.engine.forward_backward = metered(self.engine.forward_backward, "schedule")
            self.engine.sync_and_clip = metered(self.engine.sync_and_clip, "sync_and_clip")
            for opt in self.optimizers.values():
                opt.step = metered(opt.step, "optimizer")
        steps.append({})
        c0, g0 = time.process_time(), gloo_thread_cpu_s()
        out = plain(self, batch, step)
        steps[-1]["step"] = time.process_time() - c0
        steps[-1]["gloo_threads"] = gloo_thread_cpu_s() - g0
        steps[-1]["actions"] = sum(e.get("cpu_s") or 0.0 for e in self.recorder.events)
        return out

    PipelineTrainer.train_step = train_step
    # wrapping optimizer.step after the learning-rate scheduler wrapped it is what torch warns about
    warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)` has been overridden.*")
    try:
        return _worker(config, plan_yaml, metrics_file)
    finally:
        PipelineTrainer.train_step = plain
        if steps:
            (Path(config.run_dir) / f"cpu-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(steps))


def train_capped(plan, config, shares: List[Optional[float]], run_dir: Path) -> Dict[str, Any]:
    """Train `plan` on its used workers, each keeping its job rank's CPU share. The summary gains
    `used` (the job rank of each trained rank) and `throttling` (each capped worker's cgroup cpu.stat)."""
    from hrlplan.config import as_config
    from hrlplan.launch import cpu_quota
    from hrlplan.launch.local import launch_workers
    from hrlplan.runtime.timing import mean_step_time
    from hrlplan.search.placement import compact

    trained, used = compact(plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = as_config(config)
    cfg.run_dir = str(run_dir)
    threads_for(trained.world_size)
    for old in run_dir.glob("cpu-rank*.json"):
        old.unlink()
    summary = launch_workers(_cpu_metered_worker, (cfg, trained.to_yaml(), False), trained.world_size,
                             name="hetero-pick", cpu_shares=[shares[r] for r in used])[0]
    cpu = {}
    for i in range(trained.world_size):
        if (run_dir / f"cpu-rank{i}.json").exists():
            steps = json.loads((run_dir / f"cpu-rank{i}.json").read_text())
            cpu[used[i]] = {k: mean_step_time([s.get(k, 0.0) for s in steps]) for k in steps[0]}
    return dict(summary, used=used, cpu_per_step=cpu,
                throttling={used[i]: s for i, s in enumerate(cpu_quota.last_job_throttling) if s})


def per_rank_actions(predicted_stages: List[Dict[str, Any]], summary: Dict[str, Any],
                     quota_work: Sequence[Dict[str, Any]] = ()) -> Dict[int, Dict[str, Any]]:
    """Per job rank: the simulator's forward / backward / send of the stage it runs (its device's
    name) beside the median wall and CPU time of the forwards and backwards it ran (the trainer's
    recorded actions, every measured step): where wall exceeds CPU the rank waited inside the action
    (a quota's throttling, cores shared); where CPU exceeds the prediction the compute is mis-costed.
    quota_work: the prediction's breakdown["quota_cpu_work"] (cost/quota_cpu.py), a capped rank's
    predicted CPU per step (its replica's position: a cross-replica reduce not included), beside the
    CPU per step it measured."""
    from hrlplan.runtime.timing import action_medians

    events = (summary.get("measured") or {}).get("events") or []
    used = summary.get("used") or []
    out: Dict[int, Dict[str, Any]] = {}
    for st in predicted_stages:
        for rank in st["devices"]:
            out[rank] = {"device": st["device_type"], "layers": st["layers"], "predicted_fwd_ms": st["fwd_s"] * 1e3,
                         "predicted_bwd_ms": st["bwd_s"] * 1e3, "predicted_send_ms": st["send_s"] * 1e3,
                         "predicted_busy_ms": st["busy_s"] * 1e3}
    for entry in quota_work:
        for rank in entry["devices"]:
            out.setdefault(rank, {})["predicted_cpu_per_step_ms"] = entry["work_s"] * 1e3
            if entry.get("parts_s"):
                out[rank]["predicted_cpu_per_step_parts_ms"] = {k: v * 1e3 for k, v in entry["parts_s"].items()}
    for trained_rank, job_rank in enumerate(used):
        mine = [dict(e, stage=0) for e in events if e.get("rank") == trained_rank]
        wall, cpu = action_medians(mine).get(0, {}), action_medians(mine, cpu=True).get(0, {})
        row = out.setdefault(job_rank, {})
        for kind in ("F", "B"):
            if kind in wall:
                row[f"measured_{kind}_wall_ms"] = wall[kind] * 1e3
            if kind in cpu:
                row[f"measured_{kind}_cpu_ms"] = cpu[kind] * 1e3
        parts = (summary.get("cpu_per_step") or {}).get(job_rank)
        if parts:
            row["measured_cpu_per_step_ms"] = parts["step"] * 1e3
            row["measured_cpu_per_step_parts_ms"] = {k: v * 1e3 for k, v in parts.items() if k != "step"}
        stat = (summary.get("throttling") or {}).get(job_rank)
        if stat:
            row["throttled"] = {k: stat.get(k) for k in ("nr_periods", "nr_throttled", "throttled_time")}
    return out


def action_lines(name: str, ranks: Dict[int, Dict[str, Any]]) -> List[str]:
    def ms(row, key):
        return f"{row[key]:6.2f}" if key in row else "    --"
    out = []
    for rank, row in sorted(ranks.items()):
        th = row.get("throttled")
        throttled = f" throttled {th['nr_throttled']}/{th['nr_periods']} periods" if th else ""
        out.append(f"    {name:20s} rank {rank} {row.get('device', '?'):9s} F pred {ms(row, 'predicted_fwd_ms')} wall "
                   f"{ms(row, 'measured_F_wall_ms')} cpu {ms(row, 'measured_F_cpu_ms')} | B pred "
                   f"{ms(row, 'predicted_bwd_ms')} wall {ms(row, 'measured_B_wall_ms')} cpu "
                   f"{ms(row, 'measured_B_cpu_ms')} | send {ms(row, 'predicted_send_ms')} | CPU per step "
                   f"{ms(row, 'measured_cpu_per_step_ms')}"
                   + (f" (pred {ms(row, 'predicted_cpu_per_step_ms')})" if "predicted_cpu_per_step_ms" in row else "")
                   + throttled)
        for label, key in (("CPU per step", "measured_cpu_per_step_parts_ms"),
                           ("predicted", "predicted_cpu_per_step_parts_ms")):
            parts = row.get(key)
            if parts:
                out.append(" " * 36 + f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items())))
    return out


# Below this share of a core for the uncapped worker, other processes took the cores: every worker got
# about what the capped ones are allowed (at load 14-23: 0.16-0.4 of a core, fast-only 3-7x its quiet
# step), so the layouts' order says nothing about heterogeneous planning.
BUSY_HOST_SHARE = 0.7


def uncapped_core_share(runs: Dict[str, List[Dict[str, Any]]], shares: List[Optional[float]]) -> Optional[float]:
    """The median over rounds of fast-only's CPU per step over its mean step on the uncapped worker."""
    uncapped = next((r for r, s in enumerate(shares) if s is None), None)
    got = [x["ranks"][uncapped]["measured_cpu_per_step_ms"] / 1e3 / x["measured_s"] for x in runs.get("fast-only", [])
           if uncapped is not None and "measured_cpu_per_step_ms" in x["ranks"].get(uncapped, {}) and x["measured_s"]]
    return statistics.median(got) if got else None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shares", default="1,0.33,0.33", help="per worker; 1 = uncapped")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hetero_pick.json"))
    ap.add_argument("--run-dir", default="/tmp/hrlplan-bench-hetero-pick")
    ap.add_argument("--only", default="", help="comma-separated layout names (diagnosis): the others are not trained")
    ap.add_argument("--actions", action="store_true", help="print each rank's predicted vs measured forward/backward")
    return ap.parse_args(argv)


def calibrate_and_plan(config, meta, shares: List[Optional[float]], candidates: Dict[str, Any], r: int,
                       run_dir: Path):
    """One round's calibration of the emulated workers, and exact's pick (heterogeneous=true) and best
    single template (=false) on it, each added to `candidates` under a hand-written layout's name when
    it is one (same_layout), else as pick-<r> / single-<r>. (calibrated cluster, the pick's name, the
    record without its raw measurements)."""
    from hrlplan.cluster import ClusterSpec
    from hrlplan.launch.local import launch_workers
    from hrlplan.search import make_plan
    from hrlplan.search.config import ExactPlannerConfig

    t0 = time.time()
    threads_for(len(shares))
    out = launch_workers(_calibrate_worker, (config,), len(shares), name="hetero-pick-calibrate", cpu_shares=shares)[0]
    calibrated = ClusterSpec.from_dict(out["calibrated"])
    exact = dict(asdict(ExactPlannerConfig()), microbatch_sizes=MICROBATCH_SIZES)
    pick, _ = make_plan(meta, calibrated, dict(exact, heterogeneous="true"), config["train"])
    single, _ = make_plan(meta, calibrated, dict(exact, heterogeneous="false"), config["train"])
    names = {}
    for label, plan in (("pick", pick), ("single", single)):
        name = next((n for n, p in candidates.items() if same_layout(p, plan)), None)
        if name is None:
            name = f"{label}-{r}"
            candidates[name] = plan
        names[label] = name
    print(f"[hetero-pick] round {r + 1}: calibrated in {time.time() - t0:.0f} s (flops per worker "
          f"{[round(d.peak_flops / 1e9, 1) for d in calibrated.devices]} GFLOP/s); pick {names['pick']}: "
          f"{pick.layout()}; single template {names['single']}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"calibration-{r}.json").write_text(json.dumps(out["calibrated"], default=float))
    record = out["calibrated"].get("calibration") or {}
    return calibrated, names["pick"], {k: v for k, v in record.items() if k != "measurements"}


def measure_layout(name: str, plan, config, meta, calibrated, shares: List[Optional[float]], run_dir: Path,
                   actions: bool) -> Optional[Dict[str, Any]]:
    """Predict `plan` on this round's calibration and train it on the capped workers: its run's
    figures (mean and median step, prediction, load, each rank's actions), None when it failed (one
    layout's failure must not hide the others' figures)."""
    from hrlplan.cost.plans import options_for_train, predict_any_plan
    from hrlplan.launch.local import Interrupted
    from hrlplan.runtime.timing import mean_step_time, median_step_time

    prediction = predict_any_plan(plan, meta, calibrated, options_for_train(config["train"]))
    predicted = prediction["step_time_s"]
    try:
        summary = train_capped(plan, config, shares, run_dir / name.replace("/", "_"))
    except Interrupted:   # the bench was stopped (SIGTERM, Ctrl-C): not one layout's failure
        raise
    except Exception as e:
        print(f"[hetero-pick]   {name:20s} FAILED: {str(e)[:200]}", flush=True)
        return None
    times = [h["train/step_time_s"] for h in summary["history"]]
    step, median = mean_step_time(times), median_step_time(times)
    ranks = per_rank_actions(prediction["stages"], summary, prediction.get("breakdown", {}).get("quota_cpu_work") or ())
    load = os.getloadavg()[0]
    print(f"[hetero-pick]   {name:20s} {step * 1e3:8.2f} ms mean step, median {median * 1e3:8.2f} "
          f"(predicted {predicted * 1e3:8.2f} ms), load {load:.1f}", flush=True)
    if actions:
        print("\n".join(action_lines(name, ranks)), flush=True)
        print(f"    steps (ms): {[round(t * 1e3, 1) for t in times]}")
    return {"measured_s": step, "median_step_s": median, "predicted_s": predicted, "load": load,
            "step_times_s": times, "ranks": ranks}


def report(args, shares, candidates, runs, picks, loads, calibrations) -> Dict[str, Any]:
    """The table over the rounds (median, min-max per layout), Spearman and the pick's rank, printed;
    the report written to args.out."""
    rows = {n: dict(_measure.timing_row([x["measured_s"] for x in xs], [x["predicted_s"] for x in xs]),
                    layout=candidates[n].layout(), runs=xs) for n, xs in runs.items()}
    pick = statistics.mode(picks)
    rank = _measure.ranking(rows, pick)
    out = {"world": len(shares), "shares": shares, "rounds": args.rounds, "steps": args.steps, "layouts": rows,
           "picks": picks, "pick": pick, **rank, "load_average": loads,
           "calibrations": calibrations, "uncapped_core_share": uncapped_core_share(runs, shares)}
    print()
    print("\n".join(_measure.timing_lines(rows, rank, label="layout")))
    print(f"load average per round: {loads}")
    share = out["uncapped_core_share"]
    if share is not None:
        print(f"the uncapped worker trained fast-only on {share:.2f} of a core (CPU per step / step)"
              + ("" if share >= BUSY_HOST_SHARE else f": below {BUSY_HOST_SHARE}, the host was too busy for "
                 "this bench to see the caps (capped workers got no less than the uncapped); rerun when quiet"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=float))
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    from hrlplan.compose import compose
    from hrlplan.model_meta import introspect

    args = parse_args(argv)
    shares = [None if float(s) >= 1 else float(s) for s in args.shares.split(",")]
    config = compose([*ARCH, f"train.steps={args.steps}"])
    meta = introspect(config["arch"], seq_len=int(config["data"]["seq_len"]))
    candidates = hand_written(len(shares))
    only = set(args.only.split(",")) if args.only else None
    runs: Dict[str, List[Dict[str, Any]]] = {}
    picks: List[str] = []
    loads, calibrations = [], []
    for r in range(args.rounds):
        calibrated, pick, record = calibrate_and_plan(config, meta, shares, candidates, r, Path(args.run_dir))
        picks.append(pick)
        calibrations.append(record)
        for name, plan in candidates.items():   # round-robin: a shared host's drift hits every layout alike
            if only is None or name in only:
                got = measure_layout(name, plan, config, meta, calibrated, shares, Path(args.run_dir), args.actions)
                if got is not None:
                    runs.setdefault(name, []).append(got)
        loads.append(os.getloadavg())
    report(args, shares, candidates, runs, picks, loads, calibrations)


if __name__ == "__main__":
    main()
