"""Episodes, REINFORCE with a learned baseline, and the hrl planner's search.

An episode: the high-level policy picks a Config, the low-level policy then places the stage
boundaries one by one, the simulator scores the plan. Reward: -log(step time / the instance's best
configuration estimate), so rewards are comparable across instances (about 0 for a plan as good
as the most promising configuration's estimate); infeasible plans get a fixed penalty.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch
from tqdm import tqdm

from hrlplan.search.common import Scored, Tracker
from hrlplan.search.estimate import ConfigEstimator
from hrlplan.search.exact import lower_bound
from hrlplan.search.hrl.features import SLACKS, StageGuide, config_features, instance_features
from hrlplan.search.hrl.policy import HierarchicalPolicy, generalist_path, load_policy
from hrlplan.search.splits import SplitTables

INFEASIBLE_REWARD = -3.0
TABLE_CACHE = 48


class PlanningEnv:
    """One (model, cluster, train settings) instance as the policies see it."""

    def __init__(self, sim, space):
        self.sim, self.space = sim, space
        space.sim = space.sim or sim   # layouts pick each stage's recomputation against this simulator
        self.configs = list(space.configs())
        if not self.configs:
            raise ValueError("no configuration satisfies the batch/micro-batch constraints")
        self.inst = torch.from_numpy(instance_features(sim, space))
        estimator = ConfigEstimator(sim, space)
        self.estimates = [estimator.estimate(c) for c in self.configs]
        self.cfeat = torch.from_numpy(config_features(sim, space, self.configs, self.estimates))
        finite = [e.step_s for e in self.estimates if np.isfinite(e.step_s)]
        if finite:
            self.reference = min(finite)
        else:
            self.reference = min(lower_bound(sim, space, c) for c in self.configs)
        self._tables: "OrderedDict[int, dict]" = OrderedDict()

    def guide(self, idx: int, slack: float = 0.0):
        entry = self._tables.get(idx)
        if entry is not None:
            self._tables.move_to_end(idx)
        else:
            entry = {"tables": SplitTables(self.sim, self.space, self.configs[idx])}
            self._tables[idx] = entry
            if len(self._tables) > TABLE_CACHE:
                self._tables.popitem(last=False)
        if slack not in entry:
            entry[slack] = StageGuide(self.sim, entry["tables"], slack)
        return entry["tables"], entry[slack]

    def rollout(self, policy: HierarchicalPolicy, idx: int, greedy: bool, gen: torch.Generator,
                slack: float = 0.0) -> Dict[str, Any]:
        tables, guide = self.guide(idx, slack)
        n, L = tables.n, tables.L
        steps, offsets, masks, actions = [], [], [], []
        start, spans = 0, []
        for k in range(n - 1):
            step, offs, mask, bounds = guide.step(k, start)
            if not mask.any():  # nothing near the target fits: take the nearest legal boundary
                row = tables.time[k, start]
                legal = [b for b in range(start + 1, L - (n - 1 - k) + 1) if np.isfinite(row[b])]
                if not legal:
                    return {"layout": None, "steps": steps, "offsets": offsets, "masks": masks, "actions": actions}
                b = min(legal, key=lambda x: abs(x - guide.target(k, start)))
            else:
                with torch.no_grad():
                    logits = policy.low_logits(self.inst, torch.from_numpy(step)[None], torch.from_numpy(offs)[None],
                                               torch.from_numpy(mask)[None])[0]
                a = int(torch.argmax(logits)) if greedy else int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
                steps.append(step)
                offsets.append(offs)
                masks.append(mask)
                actions.append(a)
                b = bounds[a]
            spans.append((start, b))
            start = b
        spans.append((start, L))
        layout = self.space.layout(self.configs[idx], spans)
        return {"layout": layout, "steps": steps, "offsets": offsets, "masks": masks, "actions": actions}

    def reward(self, result) -> float:
        if not result.feasible:
            return INFEASIBLE_REWARD
        return -float(np.log(result.step_time_s / self.reference))


def _episodes(env: PlanningEnv, policy, count: int, gen: torch.Generator, tracker: Tracker, greedy=False):
    with torch.no_grad():
        probs = torch.softmax(policy.high_logits(env.inst, env.cfeat), 0)
    idxs = torch.multinomial(probs, count, replacement=True, generator=gen).tolist()
    slacks = torch.randint(len(SLACKS), (count,), generator=gen).tolist()
    out = []
    for idx, si in zip(idxs, slacks):
        ep = env.rollout(policy, idx, greedy, gen, SLACKS[si])
        ep["config"] = idx
        if ep["layout"] is None:
            ep["reward"] = INFEASIBLE_REWARD
            tracker.infeasible += 1
        else:
            res = env.sim.evaluate(ep["layout"])
            tracker.offer(Scored(ep["layout"], res, env.configs[idx]))
            ep["reward"] = env.reward(res)
        out.append(ep)
    return out


def update(env: PlanningEnv, policy: HierarchicalPolicy, opt, episodes: List[Dict[str, Any]], entropy_coef: float) -> float:
    """One REINFORCE step with the learned baseline V(instance, config) and entropy bonus."""
    idx = torch.tensor([ep["config"] for ep in episodes])
    rewards = torch.tensor([ep["reward"] for ep in episodes], dtype=torch.float32)
    high = torch.log_softmax(policy.high_logits(env.inst, env.cfeat), 0)
    logp = high[idx]
    entropy = -(high.exp() * high).sum()
    owners, steps, offs, masks, acts = [], [], [], [], []
    for i, ep in enumerate(episodes):
        for s, o, m, a in zip(ep["steps"], ep["offsets"], ep["masks"], ep["actions"]):
            owners.append(i)
            steps.append(s)
            offs.append(o)
            masks.append(m)
            acts.append(a)
    if steps:
        mask_t = torch.from_numpy(np.stack(masks))
        low = torch.log_softmax(policy.low_logits(env.inst, torch.from_numpy(np.stack(steps)),
                                                  torch.from_numpy(np.stack(offs)), mask_t), 1)
        chosen = low.gather(1, torch.tensor(acts)[:, None]).squeeze(1)
        logp = logp.index_add(0, torch.tensor(owners), chosen)
        safe = low.masked_fill(~mask_t, 0.0)  # masked entries: 0 * -inf would poison the gradient
        entropy = entropy - (safe.exp() * safe).masked_fill(~mask_t, 0.0).sum(1).mean()
    value = policy.value(env.inst, env.cfeat[idx])
    adv = rewards - value.detach()
    adv = adv / adv.std().clamp_min(0.05) if len(episodes) > 1 else adv
    loss = -(adv * logp).mean() - entropy_coef * entropy + 0.5 * ((value - rewards) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    return float(rewards.mean())


def train_on(env: PlanningEnv, policy, cfg: Dict[str, Any], tracker: Tracker, steps: int,
             gen: torch.Generator, desc: str = "hrl train", opt=None, progress: bool = True):
    opt = opt or torch.optim.Adam(policy.parameters(), lr=float(cfg.get("lr", 3e-3)))
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for _ in bar:
        eps = _episodes(env, policy, int(cfg.get("batch_size", 32)), gen, tracker)
        mean_r = update(env, policy, opt, eps, float(cfg.get("entropy_coef", 0.01)))
        if tracker.best is not None:
            bar.set_postfix(best_ms=f"{tracker.best.time * 1e3:.4g}", reward=f"{mean_r:.3f}")
    return opt


def initial_policy(cfg: Dict[str, Any]) -> tuple:
    ckpt = cfg.get("checkpoint_dir")
    if ckpt:
        if not Path(ckpt).exists():
            if not cfg.get("train_if_missing", True):
                raise FileNotFoundError(f"planner.checkpoint_dir {ckpt} does not exist (train it with `hrlplan train-hrl`)")
        else:
            return load_policy(ckpt), str(ckpt)
    shipped = generalist_path()
    if shipped.exists() and cfg.get("use_pretrained", True):
        return load_policy(shipped), "shipped generalist"
    torch.manual_seed(int(cfg.get("seed", 0)))
    return HierarchicalPolicy(int(cfg.get("hidden", 64))), "untrained"


def refine(env: PlanningEnv, best: Scored, tracker: Tracker, max_evals: int) -> int:
    """Hill-climb the best plan's stage boundaries one block at a time (first improvement)."""
    used = 0
    improved = True
    while improved and used < max_evals:
        improved = False
        cur = tracker.best
        spans = list(cur.layout.spans)
        for k in range(len(spans) - 1):
            for delta in (-1, 1):
                b = spans[k][1] + delta
                if not (spans[k][0] < b < spans[k + 1][1]) or used >= max_evals:
                    continue
                trial = spans[:k] + [(spans[k][0], b), (b, spans[k + 1][1])] + spans[k + 2:]
                layout = env.space.layout(cur.config, trial)
                used += 1
                res = env.sim.evaluate(layout)
                before = tracker.best.time
                tracker.offer(Scored(layout, res, cur.config))
                if tracker.best.time < before - 1e-15:
                    improved = True
                    break
            if improved:
                break
    return used


def search_hrl(sim, space, cfg: Dict[str, Any]) -> Dict[str, Any]:
    seed = int(cfg.get("seed", 0))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    policy, source = initial_policy(cfg)
    env = PlanningEnv(sim, space)
    tracker = Tracker()
    t0 = time.perf_counter()
    steps = int(cfg.get("train_steps", 0))
    if steps > 0:
        train_on(env, policy, cfg, tracker, steps, gen, progress=bool(cfg.get("progress", True)))
    train_time = time.perf_counter() - t0
    t1 = time.perf_counter()
    # Greedy rollouts of the policy's top configurations, then samples.
    with torch.no_grad():
        top = torch.argsort(policy.high_logits(env.inst, env.cfeat), descending=True)[:int(cfg.get("greedy_configs", 16))].tolist()
    seen = set()
    for idx in top:
        for slack in SLACKS:
            ep = env.rollout(policy, idx, True, gen, slack)
            if ep["layout"] is not None and (idx, ep["layout"].spans) not in seen:
                seen.add((idx, ep["layout"].spans))
                tracker.offer(Scored(ep["layout"], sim.evaluate(ep["layout"]), env.configs[idx]))
    _episodes(env, policy, int(cfg.get("samples", 256)), gen, tracker)
    refined = 0
    if tracker.best is not None and cfg.get("refine", True):
        refined = refine(env, tracker.best, tracker, int(cfg.get("refine_evaluations", 64)))
    return {"tracker": tracker, "evaluations": sim.evaluations, "policy": source, "train_steps": steps,
            "train_time_s": train_time, "inference_time_s": time.perf_counter() - t1, "refine_evaluations": refined,
            "configs": len(env.configs), "history": tracker.history}
