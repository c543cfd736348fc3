"""Multi-node benchmark on the shaped 3-node box (launch/local_slurm/start-multinode.sh; root).

    sudo python bench/multinode.py [--steps 30] [--global-batch 12] [--shape node2-node3:rate=1gbit]
                                   [--out bench/results/multinode.json] [--keep-box]

Starts the box with LINK_SHAPE (node2<->node3 at 1 Gbit/s by default; an already running box in
the same SLURM_MN_DIR is restarted with that shape), then runs one 3-node job (one task per node,
hydra-submitit-launcher) per layout, one after another, all with the same global batch:
the planner's pick (planner=exact, no calibration) and hand-written layouts:
  pp3 in node order (its second boundary crosses the shaped link), pp3 with node1 in the middle
  (no boundary on the shaped link; torch pipelining refuses pp groups out of rank order today, so
  it reports the error), pp3 gpipe, dp3 (FSDP's collectives cross every link), pp2 over the fast
  node1-node2 link and over the shaped node2-node3 link (third node idle), and one node alone.
Reports each layout's measured median step time (steps after the first) and the planner's
prediction, and the probe's bandwidth for every node pair against the configured shaping.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.plan import homogeneous_plan, launch_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOCAL_SLURM = ROOT / "launch" / "local_slurm"
N_LAYER = 6


def hand_layouts(global_batch: int):
    """name -> plan for 3 ranks (rank k on node k+1) of gpt2-tiny, all with `global_batch`."""
    from hrlplan.search.placement import place_on_ranks

    thirds = [(0, 2), (2, 4), (4, 6)]
    mb3 = global_batch // 6   # 6 micro-batches through a 3-stage pipeline
    out = {
        "pp3 node1>node2>node3 1f1b": homogeneous_plan("gpt2-tiny", N_LAYER, thirds, 1, 1, mb3, 6, "1f1b"),
        "pp3 node2>node1>node3 1f1b": homogeneous_plan("gpt2-tiny", N_LAYER, thirds, 1, 1, mb3, 6, "1f1b",
                                                       rank_order=[1, 0, 2]),
        "pp3 node1>node2>node3 gpipe": homogeneous_plan("gpt2-tiny", N_LAYER, thirds, 1, 1, mb3, 6, "gpipe"),
        "dp3 (fsdp)": homogeneous_plan("gpt2-tiny", N_LAYER, [(0, 6)], 3, 1, global_batch // 3, 1, "1f1b"),
    }
    one = homogeneous_plan("gpt2-tiny", N_LAYER, [(0, 6)], 1, 1, global_batch, 1, "1f1b")
    out["node1 alone (2 idle)"] = place_on_ranks(one, [0], 3, launch_meta(3))
    two = homogeneous_plan("gpt2-tiny", N_LAYER, [(0, 3), (3, 6)], 1, 1, global_batch // 4, 4, "1f1b")
    out["pp2 node1>node2 (node3 idle)"] = place_on_ranks(two, [0, 1], 3, launch_meta(3))
    out["pp2 node2>node3 (node1 idle)"] = place_on_ranks(two, [1, 2], 3, launch_meta(3))
    for plan in out.values():
        plan.meta.setdefault("launch", launch_meta(3))
    return out


def run_job(env, sweep: Path, steps: int, global_batch: int, extra) -> dict:
    cmd = [str(LOCAL_SLURM / "mn-run"), sys.executable, "pretrain.py", "-m", "hydra/launcher=submitit_slurm",
           f"hydra.sweep.dir={sweep}", "hydra.launcher.partition=debug", "hydra.launcher.nodes=3",
           "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_per_cpu=null",
           "hydra.launcher.mem_gb=2", f"train.steps={steps}", f"train.global_batch_size={global_batch}",
           "train.checkpoint_interval=0", "planner.calibrate=false", "logger.mode=disabled", *extra]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    run = sweep / "0"
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][-300:]}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["train/step_time_s"] for r in records][1:]
    import yaml

    plan = yaml.safe_load((run / "plan.yaml").read_text())
    predicted = ((plan.get("meta") or {}).get("predicted") or {}).get("step_time_s")
    return {"measured_step_s": statistics.median(times), "predicted_step_s": predicted,
            "layout": f"pp{plan['pp']} groups {plan['device_groups']} mb {plan['microbatch_size']}x"
                      f"{plan['num_microbatches']} {plan['schedule']} unused {plan.get('unused_ranks') or []}",
            "cluster": json.loads((run / "cluster.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--shape", default="node2-node3:rate=1gbit,delay=0.5ms")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multinode.json"))
    ap.add_argument("--keep-box", action="store_true", help="leave the box running afterwards")
    args = ap.parse_args()
    env = dict(os.environ, LINK_SHAPE=args.shape, WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    start = subprocess.run(["bash", str(LOCAL_SLURM / "start-multinode.sh"), "3"], env=env, capture_output=True,
                           text=True)
    if start.returncode:
        sys.exit(f"bench/multinode.py: the box did not start: {start.stderr.strip()[-600:]}")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hrlplan-bench-mn-{int(time.time())}"
    results = {}
    try:
        results["planner pick"] = run_job(env, work / "planner", args.steps, args.global_batch, [])
        print(f"planner pick: {results['planner pick'].get('layout', results['planner pick'].get('error'))}",
              flush=True)
        for name, plan in hand_layouts(args.global_batch).items():
            path = work / f"{len(results)}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(path)
            results[name] = run_job(env, work / f"job{len(results)}", args.steps, args.global_batch,
                                    ["planner=manual", f"planner.plan_file={path}"])
            print(f"{name}: {results[name].get('measured_step_s', results[name].get('error'))}", flush=True)
    finally:
        if not args.keep_box:
            subprocess.run(["bash", str(LOCAL_SLURM / "stop-multinode.sh")], env=env, capture_output=True)
    report(results, args)


def report(results: dict, args) -> None:
    cluster = results["planner pick"].get("cluster") or {}
    hosts = [d["hostname"] for d in cluster.get("devices", [])]
    bw = cluster.get("bandwidth") or []
    probe = {f"{hosts[a]}-{hosts[b]}": bw[a][b] * 8 / 1e9 for a in range(len(hosts)) for b in range(a + 1, len(hosts))}
    print(f"\nconfigured shaping: {args.shape}; probe's point-to-point bandwidth (Gbit/s):")
    for pair, gbit in probe.items():
        print(f"  {pair}: {gbit:.2f}")
    print(f"\n{'layout':32} {'measured ms':>12} {'predicted ms':>13}  plan")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:32} {'failed':>12} {'':>13}  {r['error']}")
            continue
        pred = f"{r['predicted_step_s'] * 1e3:.1f}" if r.get("predicted_step_s") else "-"
        print(f"{name:32} {r['measured_step_s'] * 1e3:12.1f} {pred:>13}  {r['layout']}")
    hand = {k: v["measured_step_s"] for k, v in results.items() if k != "planner pick" and "measured_step_s" in v}
    pick = results["planner pick"].get("measured_step_s")
    if hand and pick:
        best, worst = min(hand, key=hand.get), max(hand, key=hand.get)
        print(f"\nplanner pick {pick * 1e3:.1f} ms; best hand-written {best} {hand[best] * 1e3:.1f} ms; "
              f"worst {worst} {hand[worst] * 1e3:.1f} ms; pick/best = {pick / hand[best]:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in results.values():
        r.pop("cluster", None)
    out.write_text(json.dumps({"shape": args.shape, "steps": args.steps, "global_batch": args.global_batch,
                               "probe_gbit_s": probe, "layouts": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
