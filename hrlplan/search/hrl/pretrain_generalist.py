"""Train the generalist HRL policy over a distribution of generated planning instances.

    python -m hrlplan.search.hrl.pretrain_generalist --out hrlplan/search/hrl/pretrained/generalist.pth --minutes 10

Instances come from hrlplan.search.hrl.generate (random transformer shapes on random 1-3-type GPU
clusters, seeds in TRAIN_SEEDS; none resembles a benchmark instance). Each update draws one
instance, plays `--batch` episodes of the hierarchical policy on it against the simulator and
takes a REINFORCE step with the learned baseline (hrlplan.search.hrl.agent.update), so the one set
of weights learns from every instance; the features are instance-relative, so it plans unseen
models and clusters without retraining. At the end the policy is evaluated zero-shot on held-out
generated instances (seeds in HELD_OUT_SEEDS) against the exact planner, and the checkpoint (fp16,
tens of kB) records those figures. The defaults (64 instances, at most 3000 updates or 5 minutes,
10 held-out evaluations) take about 3 to 5 minutes on 2 cores when they are quiet; the shipped
generalist (every registry schedule among the instances) had --minutes 10: 2517 updates in 605 s on
the shared 2-core VM under a load average near 10, after 117 s building its 64 instances.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any, Dict, List

import numpy as np
import torch
from tqdm import tqdm

from hrlplan.cost.simulator import Simulator
from hrlplan.errors import UserError
from hrlplan.search import make_plan
from hrlplan.search.common import Tracker, cost_options
from hrlplan.search.config import ExactPlannerConfig, HRLPlannerConfig
from hrlplan.search.hrl import agent
from hrlplan.search.hrl.agent import PlanningEnv, _episodes, update
from hrlplan.search.hrl.generate import HELD_OUT_SEEDS, TRAIN_SEEDS, random_instance
from hrlplan.search.hrl.policy import HierarchicalPolicy, generalist_path, save_policy
from hrlplan.search.space import SearchSpace

MAX_CONFIGS = 600   # training instances with more configurations are skipped (keeps steps quick)


def _env(inst, cfg: Dict[str, Any]) -> PlanningEnv:
    sim = Simulator(inst.meta, inst.cluster, cost_options(cfg, inst.train))
    return PlanningEnv(sim, SearchSpace(inst.meta, inst.cluster, cfg, inst.train))


def build_env(inst, cfg: Dict[str, Any]):
    space = SearchSpace(inst.meta, inst.cluster, cfg, inst.train)
    configs = sum(1 for _ in space.configs())
    if configs == 0 or configs > MAX_CONFIGS:
        return None
    env = _env(inst, cfg)
    if not any(np.isfinite(e.step_s) for e in env.estimates):
        return None  # nothing fits even by the estimate: no signal to learn from
    return env


def sample_quality(inst, cfg: Dict[str, Any], count: int, seed: int = 0):
    """Mean reward of `count` episodes sampled from the policy `cfg` selects, and their best time."""
    env = build_env(inst, cfg)
    if env is None:  # more configurations than training uses: build it anyway
        env = _env(inst, cfg)
    policy, _ = agent.initial_policy(cfg)
    tracker = Tracker()
    eps = _episodes(env, policy, count, torch.Generator().manual_seed(seed), tracker)
    best = tracker.best.time if tracker.best is not None else float("inf")
    return float(np.mean([e["reward"] for e in eps])), best


def held_out_eval(policy_path, count: int, seed0: int = HELD_OUT_SEEDS.start, samples: int = 128,
                  progress: bool = True) -> List[Dict[str, Any]]:
    """Zero-shot (no training on the instance) ratios exact/hrl on held-out generated instances,
    for the given checkpoint and for the untrained policy (the priors alone)."""
    rows = []
    seed = seed0
    bar = tqdm(total=count, desc="held-out", disable=not progress, leave=False)
    while len(rows) < count and seed < HELD_OUT_SEEDS.stop:
        inst = random_instance(seed)
        seed += 1
        try:
            exact, _ = make_plan(inst.meta, inst.cluster, asdict(ExactPlannerConfig()), inst.train)
        except UserError:
            continue  # does not fit the cluster at all
        if not exact.meta["planner"]["proven_optimal"]:
            continue
        row = {"seed": seed - 1, "instance": inst.label, "gpus": inst.cluster.world_size,
               "types": len(inst.cluster.device_types()), "exact_s": exact.meta["predicted"]["step_time_s"]}
        base = dict(asdict(HRLPlannerConfig()), train_steps=0, samples=samples, progress=False)
        for key, cfg in (("generalist", dict(base, checkpoint_dir=str(policy_path))),
                         ("untrained", dict(base, use_pretrained=False))):
            t = time.perf_counter()
            plan, _ = make_plan(inst.meta, inst.cluster, cfg, inst.train)
            row[key + "_ratio"] = row["exact_s"] / plan.meta["predicted"]["step_time_s"]
            row[key + "_time_s"] = time.perf_counter() - t
            # The policy alone: sampled episodes only (no greedy rollouts, no hill-climb).
            mean_r, best = sample_quality(inst, cfg, samples)
            row[key + "_sample_reward"] = mean_r
            row[key + "_sample_best_ratio"] = row["exact_s"] / best
        rows.append(row)
        bar.update(1)
    bar.close()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(generalist_path()))
    ap.add_argument("--instances", type=int, default=64, help="generated training instances")
    ap.add_argument("--steps", type=int, default=3000, help="policy-gradient updates (at most)")
    ap.add_argument("--minutes", type=float, default=5.0, help="stop training after this long")
    ap.add_argument("--batch", type=int, default=16, help="episodes per update")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--entropy", type=float, default=0.03,
                    help="entropy bonus (keeps the shared policy from collapsing onto a few instances' picks)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--max-gpus", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", type=int, default=10, help="held-out instances to evaluate zero-shot (0: none)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--eval-only", default=None, help="evaluate this checkpoint on held-out instances, no training")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.eval_only:
        report_held_out(args.eval_only, args.eval, not args.no_progress)
        return
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    cfg = dict(asdict(HRLPlannerConfig()), batch_size=args.batch)
    agent.TABLE_CACHE = 16  # many environments live at once

    t0 = time.perf_counter()
    envs, labels = [], []
    seed = TRAIN_SEEDS.start + 1000 * args.seed
    while len(envs) < args.instances:
        inst = random_instance(seed, max_gpus=args.max_gpus)
        seed += 1
        env = build_env(inst, cfg)
        if env is not None:
            envs.append(env)
            labels.append(inst.label)
    build_s = time.perf_counter() - t0
    print(f"{len(envs)} training instances (seeds {TRAIN_SEEDS.start + 1000 * args.seed}..{seed - 1}) built in "
          f"{build_s:.1f}s", flush=True)

    policy = HierarchicalPolicy(args.hidden)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    trackers = [Tracker() for _ in envs]
    first_best: List[float] = [float("nan")] * len(envs)
    recent: List[float] = []
    t1 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="generalist", disable=args.no_progress)
    order: List[int] = []
    steps_done = 0
    for step in bar:
        if time.perf_counter() - t1 > args.minutes * 60:
            break
        if not order:
            order = rng.permutation(len(envs)).tolist()
        i = order.pop()
        eps = _episodes(envs[i], policy, args.batch, gen, trackers[i])
        mean_r = update(envs[i], policy, opt, eps, args.entropy)
        if np.isnan(first_best[i]) and trackers[i].best is not None:
            first_best[i] = trackers[i].best.time
        recent = (recent + [mean_r])[-50:]
        steps_done = step + 1
        bar.set_postfix(reward=f"{np.mean(recent):.3f}", prior=f"{float(policy.high_prior[0].detach()):.1f}")
        if args.no_progress and steps_done % 200 == 0:
            print(f"  update {steps_done}: mean reward (last 50) {np.mean(recent):.4f}, "
                  f"{time.perf_counter() - t1:.0f}s", flush=True)
    bar.close()
    train_s = time.perf_counter() - t1
    extra = {"kind": "generalist", "train_instances": len(envs), "updates": steps_done, "batch": args.batch,
             "lr": args.lr, "entropy": args.entropy, "seed": args.seed, "train_time_s": round(train_s, 1),
             "build_time_s": round(build_s, 1),
             "final_mean_reward_last50": float(np.mean(recent)) if recent else None,
             "train_seeds": [TRAIN_SEEDS.start + 1000 * args.seed, seed - 1]}
    path = save_policy(policy, args.out, extra=extra)
    print(f"trained {steps_done} updates in {train_s:.0f}s; mean reward (last 50) {extra['final_mean_reward_last50']:.4f}; "
          f"wrote {path} ({path.stat().st_size / 1024:.0f} kB)", flush=True)
    if args.eval > 0:
        extra["held_out_zero_shot"] = report_held_out(path, args.eval, not args.no_progress)
        save_policy(policy, args.out, extra=extra)
    print(f"total {time.perf_counter() - t0:.0f}s")


def report_held_out(path, count: int, progress: bool) -> Dict[str, Any]:
    rows = held_out_eval(path, count, progress=progress)
    for r in rows:
        print(f"  held-out {r['instance']:<66} exact/planned: generalist {r['generalist_ratio']:.3f}, untrained "
              f"{r['untrained_ratio']:.3f}; policy samples alone: mean reward {r['generalist_sample_reward']:+.3f} vs "
              f"{r['untrained_sample_reward']:+.3f}, best {r['generalist_sample_best_ratio']:.3f} vs "
              f"{r['untrained_sample_best_ratio']:.3f}")
    summary = {"held_out": len(rows),
               "generalist_min_ratio": min(r["generalist_ratio"] for r in rows),
               "generalist_mean_ratio": float(np.mean([r["generalist_ratio"] for r in rows])),
               "untrained_min_ratio": min(r["untrained_ratio"] for r in rows),
               "untrained_mean_ratio": float(np.mean([r["untrained_ratio"] for r in rows])),
               "generalist_sample_mean_reward": float(np.mean([r["generalist_sample_reward"] for r in rows])),
               "untrained_sample_mean_reward": float(np.mean([r["untrained_sample_reward"] for r in rows])),
               "generalist_sample_best_mean_ratio": float(np.mean([r["generalist_sample_best_ratio"] for r in rows])),
               "untrained_sample_best_mean_ratio": float(np.mean([r["untrained_sample_best_ratio"] for r in rows]))}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
