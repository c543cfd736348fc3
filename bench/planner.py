"""Planner benchmark: exact vs HRL vs random (equal simulator evaluations) on >= 24 instances.

    python bench/planner.py [--quick] [--only SUBSTRING] [--train-steps N] [--held-out N] [--out bench/results/planner.json]

For each instance: exact optimum where tractable (proven_optimal), the HRL result (the shipped
generalist fine-tuned with train_steps updates on the instance, then samples), random search with
as many simulator evaluations as HRL used, the ratios exact/hrl and exact/random (1.0 = optimal),
zero-shot (the generalist with no training on the instance; "0shot s" is its whole planning time),
planning and training times. Then the generalist zero-shot on held-out generated instances (random
model shapes and GPU mixes from hrlplan.search.hrl.generate, seeds never used in its training).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan import schedules  # noqa: E402
from hrlplan.errors import UserError  # noqa: E402
from hrlplan.search import make_plan  # noqa: E402
from hrlplan.search.config import ExactPlannerConfig, HRLPlannerConfig, RandomPlannerConfig  # noqa: E402
from hrlplan.search.instances import load_cluster, load_meta  # noqa: E402

EVERY_SCHEDULE = tuple(schedules.SCHEDULES)   # one space holding every registry schedule (planner.schedules)

# (arch, cluster preset, global batch, schedule or schedules, stages per rank)
INSTANCES = [
    ("gpt2", "a100x8-1n", 64, "1f1b", 1),
    ("gpt2", "a100x8-2n", 128, "gpipe", 1),
    ("gpt2", "a100-v100-mix", 128, "1f1b", 1),
    ("gpt2-medium", "a100x8-1n", 64, "1f1b", 1),
    ("gpt2-medium", "a100x8-4n", 256, "interleaved_1f1b", 2),
    ("gpt2-medium", "h800-h20-mix", 160, "1f1b", 1),
    ("gpt2-xl", "a100x8-2n", 128, "1f1b", 1),
    ("gpt2-xl", "a100-v100-mix", 256, "1f1b", 1),
    ("gpt2-xl", "h100x8-4n", 256, "interleaved_zero_bubble", 1),
    ("gpt2-medium", "a100x8-2n", 128, "zbv", 2),
    ("gpt2-medium", "a100x8-1n", 64, "dualpipev", 2),
    ("gpt2", "a100x8-1n", 64, "interleaved_zero_bubble", 2),
    ("gpt2", "a100x8-1n", 64, EVERY_SCHEDULE, 2),
    ("gpt2-xl", "three-type-mix", 192, "1f1b", 1),
    ("gpt2-xl", "h800-h20-mix", 320, "gpipe", 1),
    ("llama-7b", "a100x8-1n", 64, "1f1b", 1),
    ("llama-7b", "a100x8-4n", 256, "1f1b", 1),
    ("llama-7b", "h100x8-4n", 256, "interleaved_1f1b", 2),
    ("llama-7b", "a100-v100-mix", 256, "1f1b", 1),
    ("llama-7b", "h800-h20-mix", 320, "1f1b", 1),
    ("llama-7b", "three-type-mix", 384, "1f1b", 1),
    ("llama-7b", "h100x8-16n", 512, "1f1b", 1),
    ("llama-7b", "a100x8-32n", 1024, "1f1b", 1),
    ("llama-70b", "a100x8-4n", 128, "1f1b", 1),
    ("llama-70b", "h100x8-16n", 512, "1f1b", 1),
    ("llama-70b", "h800-h20-mix", 320, "1f1b", 1),
    ("llama-70b", "a100x8-32n", 1024, "1f1b", 1),
    ("llama-70b", "h800-h20-256", 1024, "1f1b", 1),
    ("llama-70b", "three-type-256", 1024, "1f1b", 1),
    ("llama-70b", "a100x8-128n", 2048, "1f1b", 1),
]


def run(instance, train_steps: int, samples: int, seed: int) -> dict:
    arch, preset, gbs, schedule, v = instance
    meta, cluster = load_meta(arch), load_cluster(preset)
    several = isinstance(schedule, tuple)
    space = {"schedules": list(schedule)} if several else {}
    train = dict(global_batch_size=gbs, schedule=schedules.DEFAULT if several else schedule, stages_per_rank=v,
                 microbatches="auto", dtype="bfloat16", dp_mode="fsdp")
    row = {"arch": arch, "cluster": preset, "gpus": cluster.world_size, "types": len(cluster.device_types()),
           "schedule": "every" if several else schedule, "global_batch": gbs}
    t = time.perf_counter()
    exact, _ = make_plan(meta, cluster, dict(asdict(ExactPlannerConfig()), **space), train)
    row.update(exact_s=exact.meta["predicted"]["step_time_s"], exact_time_s=time.perf_counter() - t,
               exact_proven=exact.meta["planner"]["proven_optimal"], exact_layout=exact.layout(),
               # where the replica search runs: which passes of search/hetero_single.py ended the single template
               exact_single_search=exact.meta["planner"].get("single_template_search"))
    hrl_cfg = dict(asdict(HRLPlannerConfig()), train_steps=train_steps, samples=samples, seed=seed, progress=False,
                   **space)
    row["chosen_schedule"] = exact.schedule
    t = time.perf_counter()
    hrl, _ = make_plan(meta, cluster, hrl_cfg, train)
    p = hrl.meta["planner"]
    row.update(hrl_s=hrl.meta["predicted"]["step_time_s"], hrl_total_s=time.perf_counter() - t,
               hrl_train_s=p["train_time_s"], hrl_infer_s=p["inference_time_s"], evaluations=p["evaluations"],
               hrl_layout=hrl.layout())
    try:
        rnd, _ = make_plan(meta, cluster, dict(asdict(RandomPlannerConfig()), samples=p["evaluations"], seed=seed,
                                               **space), train)
        row["random_s"] = rnd.meta["predicted"]["step_time_s"]
    except UserError:  # random found no feasible plan at all
        row["random_s"] = float("inf")
    row["hrl_ratio"] = row["exact_s"] / row["hrl_s"]
    row["random_ratio"] = row["exact_s"] / row["random_s"]
    # zero-shot: the policy without any training on this instance
    t = time.perf_counter()
    zs, _ = make_plan(meta, cluster, dict(hrl_cfg, train_steps=0), train)
    row["zero_shot_total_s"] = time.perf_counter() - t
    row["zero_shot_ratio"] = row["exact_s"] / zs.meta["predicted"]["step_time_s"]
    row["zero_shot_infer_s"] = zs.meta["planner"]["inference_time_s"]
    row["policy"] = zs.meta["planner"]["policy"]
    return row


def held_out(count: int, samples: int, seed: int) -> list:
    """Zero-shot generalist vs exact on generated instances from the held-out seed range."""
    from hrlplan.search.hrl.generate import HELD_OUT_SEEDS, random_instance

    rows, s = [], HELD_OUT_SEEDS.start + 50   # the pretraining script's own evaluation uses the first seeds
    while len(rows) < count and s < HELD_OUT_SEEDS.stop:
        inst = random_instance(s)
        s += 1
        try:
            t = time.perf_counter()
            exact, _ = make_plan(inst.meta, inst.cluster, asdict(ExactPlannerConfig()), inst.train)
            exact_t = time.perf_counter() - t
        except UserError:
            continue
        if not exact.meta["planner"]["proven_optimal"]:
            continue
        cfg = dict(asdict(HRLPlannerConfig()), train_steps=0, samples=samples, seed=seed, progress=False)
        t = time.perf_counter()
        zs, _ = make_plan(inst.meta, inst.cluster, cfg, inst.train)
        rows.append({"seed": s - 1, "instance": inst.label, "gpus": inst.cluster.world_size,
                     "types": len(inst.cluster.device_types()), "exact_s": exact.meta["predicted"]["step_time_s"],
                     "zero_shot_s": zs.meta["predicted"]["step_time_s"], "zero_shot_total_s": time.perf_counter() - t,
                     "exact_time_s": exact_t, "policy": zs.meta["planner"]["policy"],
                     "zero_shot_ratio": exact.meta["predicted"]["step_time_s"] / zs.meta["predicted"]["step_time_s"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first 6 instances, 10 training steps")
    ap.add_argument("--only", default=None,
                    help="instances whose 'arch preset batch schedule v' contains this; several: comma-separated")
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--held-out", type=int, default=10, help="generated held-out instances (zero-shot)")
    ap.add_argument("--out", default="bench/results/planner.json")
    args = ap.parse_args()
    wanted = [w.strip() for w in args.only.split(",")] if args.only else []
    items = [i for i in INSTANCES if not wanted or any(w in " ".join(map(str, i)) for w in wanted)]
    if args.quick:
        items, args.train_steps = items[:6], min(args.train_steps, 10)
    rows = []
    head = (f"{'arch':<12}{'cluster':<16}{'gpus':>5}{'sched':>10}{'exact ms':>11}{'prov':>5}{'hrl/ex':>8}"
            f"{'rnd/ex':>8}{'0shot':>7}{'evals':>7}{'train s':>8}{'infer s':>8}{'0shot s':>8}{'exact s':>8}")
    print(head)
    print("-" * len(head))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for inst in items:
        r = run(inst, args.train_steps, args.samples, args.seed)
        rows.append(r)
        # written as it goes: a run cut short (the large instances take minutes each) keeps its rows
        out.write_text(json.dumps({"rows": rows, "held_out": [], "summary": None, "args": vars(args)}, indent=1))
        print(f"{r['arch']:<12}{r['cluster']:<16}{r['gpus']:>5}{r['schedule'][:9]:>10}{r['exact_s'] * 1e3:>11.1f}"
              f"{'y' if r['exact_proven'] else 'n':>5}{r['hrl_ratio']:>8.3f}{r['random_ratio']:>8.3f}"
              f"{r['zero_shot_ratio']:>7.3f}{r['evaluations']:>7}{r['hrl_train_s']:>8.1f}{r['hrl_infer_s']:>8.2f}"
              f"{r['zero_shot_total_s']:>8.2f}{r['exact_time_s']:>8.2f}", flush=True)
    held = held_out(args.held_out, args.samples, args.seed) if args.held_out > 0 and not args.only else []
    if held:
        print(f"\nzero-shot on held-out generated instances (policy: {held[0]['policy']})")
        print(f"{'instance':<84}{'exact ms':>11}{'0shot':>7}{'0shot s':>8}{'exact s':>8}")
        for h in held:
            print(f"{h['instance']:<84}{h['exact_s'] * 1e3:>11.1f}{h['zero_shot_ratio']:>7.3f}"
                  f"{h['zero_shot_total_s']:>8.2f}{h['exact_time_s']:>8.2f}", flush=True)
    tract = [r for r in rows if r["exact_proven"]]
    summary = {
        "instances": len(rows), "tractable": len(tract),
        "hrl_min_ratio_tractable": min((r["hrl_ratio"] for r in tract), default=None),
        "zero_shot_min_ratio_tractable": min((r["zero_shot_ratio"] for r in tract), default=None),
        "hrl_beats_or_ties_random": sum(r["hrl_s"] <= r["random_s"] * (1 + 1e-12) for r in rows),
        "max_hrl_train_s": max((r["hrl_train_s"] for r in rows), default=None),
        "policy": rows[0]["policy"] if rows else None,
        "held_out": len(held),
        "zero_shot_min_ratio_held_out": min((h["zero_shot_ratio"] for h in held), default=None),
        "zero_shot_mean_ratio_held_out": (sum(h["zero_shot_ratio"] for h in held) / len(held)) if held else None,
    }
    print(json.dumps(summary, indent=1))
    out.write_text(json.dumps({"rows": rows, "held_out": held, "summary": summary, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
