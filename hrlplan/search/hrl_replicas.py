"""Hierarchical RL over heterogeneous replicas (issue 35), for where hetero_exact cannot prove.

High level (ReplicaPolicy, this module): for each device type, one option -- off, or `count`
replicas of `size` devices (HeteroSpace's node slices and whole-node multiples) -- scored by a small
MLP over instance-relative features of the option (its share of the type's devices, the type's
speed and memory against the model's needs, ...) and sampled from their softmax. Rows of the global
batch go to the chosen replicas in proportion to their devices' sustained FLOP/s, on the grid of
B/steps rows, then once more in proportion to each replica's simulated speed.

Low level: each replica's template (pipeline stages, layer boundaries, tp per stage, micro-batching)
from the existing HRL planner's shipped generalist (search.hrl: its configuration scores and greedy
boundary rollouts on the replica's ReplicaSpace); where that policy cannot be loaded (another
feature layout), the configurations' cost estimates and the exact planner's min-max DP splits.

Trained with REINFORCE over generated heterogeneous clusters (2-4 device types, uneven counts and
node sizes, 16-1024 GPUs, memory-limited fast types); the shipped weights plan zero-shot.

    python -m hrlplan.search.train_replicas [--minutes 5] [--out <file>]   # retrain (train_replicas.py)
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from hrlplan import schedules
from hrlplan.cluster import spec_from_preset
from hrlplan.config import ExactPlannerConfig, TrainConfig, section
from hrlplan.cost.simulator import Simulator
from hrlplan.search.common import cost_options
from hrlplan.search.estimate import ConfigEstimator
from hrlplan.errors import UserError
from hrlplan.search.hetero import HeteroSpace, Replica, ReplicaSpace, hetero_plan, place, same_tp_required
from hrlplan.search.hetero_exact import nproc_candidates, row_grid
from hrlplan.search.hrl.agent import PlanningEnv
from hrlplan.search.hrl.policy import generalist_path, load_policy
from hrlplan.search.instances import load_meta
from hrlplan.search.splits import SplitTables

FEATURES = 11
POLICY_FILE = Path(__file__).resolve().parent / "hrl" / "pretrained" / "replicas.pth"
OFF = (0, 0)
INFEASIBLE_REWARD = -3.0


class ReplicaPolicy(nn.Module):
    """Scores every option of one device type; softmax over them."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.net(feats).squeeze(-1)


def load_replica_policy(path: Optional[Path] = None) -> ReplicaPolicy:
    policy = ReplicaPolicy()
    path = Path(path or POLICY_FILE)
    if path.exists():
        policy.load_state_dict(torch.load(path, weights_only=True))
    return policy


@dataclass
class Template:
    time_s: float
    layout: Any


class LowLevel:
    """Templates of (type, size, rows): the generalist's configuration scores and greedy boundaries."""

    def __init__(self, sim, meta, cluster, planner_cfg, train, space: HeteroSpace, top: int = 2):
        self.sim, self.meta, self.cluster, self.space, self.top = sim, meta, cluster, space, top
        self.cfg = {k: v for k, v in planner_cfg.items() if k != "heterogeneous"}
        self.train = train
        self.cache: Dict[tuple, Template] = {}
        self.policy = self._generalist()
        self.source = "shipped generalist (search.hrl)" if self.policy is not None else "estimates + DP splits"

    @staticmethod
    def _generalist():
        try:
            return load_policy(generalist_path())
        except (UserError, OSError):   # another feature layout or no weights: the DP fallback below
            return None

    def template(self, t: str, size: int, rows: int, tp: Optional[int]) -> Template:
        key = (t, size, rows, tp)
        if key not in self.cache:
            rs = ReplicaSpace(self.meta, self.cluster, self.cfg, dict(self.train, global_batch_size=rows,
                                                                      microbatches="auto"),
                              self.space.first_replica_pool(t, size), tp=tp)
            rs.sim = self.sim
            self.cache[key] = self._search(rs)
        return self.cache[key]

    def _search(self, rs: ReplicaSpace) -> Template:
        best = Template(math.inf, None)
        for layout in (self._policy_layouts(rs) if self.policy is not None else None) or self._dp_layouts(rs):
            r = self.sim.evaluate(layout)
            if r.feasible and r.step_time_s < best.time_s:
                best = Template(r.step_time_s, layout)
        return best

    def _policy_layouts(self, rs: ReplicaSpace) -> List[Any]:
        try:
            env = PlanningEnv(self.sim, rs)
            with torch.no_grad():
                order = torch.argsort(self.policy.high_logits(env.inst, env.cfeat), descending=True).tolist()
            gen = torch.Generator().manual_seed(0)
            out = []
            for idx in order[:self.top]:
                ep = env.rollout(self.policy, idx, True, gen, 0.0)
                if ep["layout"] is not None:
                    out.append(ep["layout"])
            return out
        except (ValueError, RuntimeError):   # no configuration, or features the weights do not fit
            return []

    def _dp_layouts(self, rs: ReplicaSpace) -> List[Any]:
        configs = list(rs.configs())
        if not configs:
            return []
        est = ConfigEstimator(self.sim, rs)
        ranked = sorted(configs, key=lambda c: est.estimate(c).step_s)[:self.top]
        out = []
        for c in ranked:
            tables = SplitTables(self.sim, rs, c)
            if tables.minmax() < math.inf:
                spans = next(iter(tables.candidates()), None)
                if spans is not None:
                    out.append(rs.layout(c, spans, recompute=tables.recompute_of(spans)))
        return out


class ReplicaEnv:
    """One instance as the high-level policy sees it: per type its options and their features."""

    def __init__(self, sim, meta, cluster, planner_cfg, train_cfg, share_steps: int = 16):
        self.sim, self.meta, self.cluster = sim, meta, cluster
        self.train = {k: getattr(train_cfg, k) for k in train_cfg.__dataclass_fields__}
        self.B = int(train_cfg.global_batch_size)
        self.schedule = str(train_cfg.schedule)
        self.space = HeteroSpace(cluster, nproc_candidates(cluster)[0])
        self.grid_unit = row_grid(self.B, share_steps)[0]
        self.low = LowLevel(sim, meta, cluster, planner_cfg, self.train, self.space)
        self.tp = None
        self.deadline = math.inf   # past it, a decision's plan is not rebalanced (search_hrl_replicas sets it)
        if same_tp_required(meta):   # one tp across replicas (GPT-2): the generalist's favourite, 1
            self.tp = 1
        self.options: Dict[str, List[Tuple[int, int]]] = {}
        self.features: Dict[str, torch.Tensor] = {}
        speed = {t: self._type_flops(t) for t in self.space.types}
        fastest = max(speed.values())
        world = self.space.launchable_devices()
        need = meta.total_params * 16.0   # weights, gradients and Adam state in bytes, unsharded
        for t in self.space.types:
            devices = len(self.space.type_nodes[t]) * self.space.nproc
            mem = cluster.devices[self.space.node_devices[self.space.type_nodes[t][0]][0]].memory_bytes
            opts = [OFF] + [(s, k) for s in self.space.replica_sizes(t) for k in self.space.replica_counts(t, s)
                            if k * self.grid_unit <= self.B]
            self.options[t] = opts
            self.features[t] = torch.tensor([[
                0.0 if o == OFF else math.log2(o[0]) / 10, 0.0 if o == OFF else math.log2(o[1]) / 10,
                0.0 if o == OFF else o[0] * o[1] / devices, speed[t] / fastest, devices / world,
                math.log(max(mem * (o[0] or 1) / need, 1e-3)) / 5, 1.0 if o == OFF else 0.0,
                math.log2(self.B) / 12, math.log10(max(meta.total_params, 1)) / 11,
                0.0 if o == OFF else min(o[0] / self.space.nproc, 4.0), len(self.space.types) / 4]
                for o in opts], dtype=torch.float32)

    def _type_flops(self, t: str) -> float:
        d = self.space.node_devices[self.space.type_nodes[t][0]][0]
        return self.sim.devices.throughput(d, self.meta.seq_len)

    def rows_for(self, chosen: List[Tuple[str, int, int]], speeds: Dict[str, float]) -> Optional[List[int]]:
        """Rows per replica of each chosen (type, size, count), in proportion to `speeds` (per device),
        in grid units, summing to B; None if some replica would get none."""
        unit, units = self.grid_unit, self.B // self.grid_unit
        weight = [speeds[t] * s for t, s, _ in chosen]
        total = sum(w * k for w, (_, _, k) in zip(weight, chosen))
        per = [max(1, int(units * w / total)) for w in weight]
        # fix the sum: add or take units where the relative error is largest, keeping >= 1 per replica
        for _ in range(4 * units):
            left = units - sum(p * k for p, (_, _, k) in zip(per, chosen))
            if left == 0:
                return [p * unit for p in per]
            candidates = [i for i, (_, _, k) in enumerate(chosen) if (k <= left if left > 0 else per[i] > 1)]
            if not candidates:
                return None
            ideal = [units * w / total for w in weight]
            i = max(candidates, key=lambda j: (ideal[j] - per[j]) if left > 0 else (per[j] - ideal[j]))
            per[i] += 1 if left > 0 else -1
        return None

    def assemble(self, chosen: List[Tuple[str, int, int]]) -> Tuple[float, Any, Any]:
        """The plan of the chosen options: rows by FLOP/s, then once rebalanced by the templates' speed."""
        speeds = {t: self._type_flops(t) for t, _, _ in chosen}
        best = (math.inf, None, None)
        for attempt in range(2):
            if attempt and time.perf_counter() > self.deadline:
                break
            rows = self.rows_for(chosen, speeds)
            if rows is None:
                return best
            templates = [self.low.template(t, s, r, self.tp) for (t, s, _), r in zip(chosen, rows)]
            if any(tm.layout is None for tm in templates):
                return best
            replicas = [Replica(t, place(tm.layout, self.space.replica_devices(t, s, i)))
                        for (t, s, k), tm in zip(chosen, templates) for i in range(k)]
            plan, predicted = hetero_plan(self.meta, self.cluster, replicas, self.schedule, {}, sim=self.sim)
            if predicted["feasible"] and predicted["step_time_s"] < best[0]:
                best = (predicted["step_time_s"], plan, replicas)
            # rows per second of each type's replica, per device: the next split's weights
            speeds = {t: r / tm.time_s / s for (t, s, _), r, tm in zip(chosen, rows, templates)}
        return best


def sample(env: ReplicaEnv, policy: ReplicaPolicy, gen: torch.Generator, greedy: bool = False):
    """One high-level decision per type; (chosen options, log-probability, entropy)."""
    logp, entropy, chosen = torch.zeros(()), torch.zeros(()), []
    for t in env.space.types:
        logits = policy(env.features[t])
        probs = torch.softmax(logits, 0)
        i = int(torch.argmax(probs)) if greedy else int(torch.multinomial(probs, 1, generator=gen))
        logp = logp + torch.log(probs[i] + 1e-12)
        entropy = entropy - (probs * torch.log(probs + 1e-12)).sum()
        if env.options[t][i] != OFF:
            chosen.append((t, *env.options[t][i]))
    return chosen, logp, entropy


def search_hrl_replicas(sim, meta, cluster, planner_cfg, train_cfg, calls: int, seed: int = 0,
                        policy: Optional[ReplicaPolicy] = None, deadline: float = math.inf) -> Dict[str, Any]:
    """Zero-shot: the greedy decision, then samples, until `calls` simulator evaluations are spent
    (or the deadline passes). Returns {step_time_s, plan, calls, time_s, low_level, decisions}."""
    policy = policy or load_replica_policy()
    gen = torch.Generator().manual_seed(seed)
    start, t0 = sim.evaluations, time.perf_counter()
    env = ReplicaEnv(sim, meta, cluster, planner_cfg, train_cfg)
    env.deadline = deadline
    best, seen, first = (math.inf, None, None), set(), True
    while sim.evaluations - start < calls and time.perf_counter() < deadline:
        with torch.no_grad():
            chosen, _, _ = sample(env, policy, gen, greedy=first)
        first = False
        key = tuple(chosen)
        if not chosen or key in seen:
            sim.evaluations += 1   # a repeated or empty draw counts, or a converged policy never stops
            continue
        seen.add(key)
        got = env.assemble(chosen)
        if got[0] < best[0]:
            best = got
    return {"step_time_s": best[0], "plan": best[1], "replicas": best[2], "calls": sim.evaluations - start,
            "time_s": time.perf_counter() - t0, "low_level": env.low.source, "decisions": len(seen)}


# ---------------------------------------------------------------- training
GPU_TYPES = {   # name: (memory GB, dense bf16 TFLOP/s, intra-node GB/s); fast types with little memory included
    "H100-80GB": (80, 989, 450), "H100-24GB": (24, 989, 450), "A100-80GB": (80, 312, 300),
    "A100-40GB": (40, 312, 300), "V100-32GB": (32, 125, 150), "H20-96GB": (96, 148, 450),
    "L40S-48GB": (48, 362, 64), "RTX4090-24GB": (24, 165, 32)}


def training_instance(seed: int, max_gpus: int = 1024) -> Tuple[str, Dict[str, Any], int]:
    """(arch, cluster preset config, global batch): 2-4 device types, uneven node counts and sizes,
    16-max_gpus GPUs, a model for the size."""
    rng = np.random.default_rng(50_000 + seed)
    names = list(rng.choice(sorted(GPU_TYPES), size=int(rng.integers(2, 5)), replace=False))
    target = int(2 ** rng.uniform(4, math.log2(max_gpus)))
    groups = []
    for name, w in zip(names, rng.dirichlet(np.ones(len(names)))):
        per_node = int(rng.choice([4, 8]))
        mem, tflops, intra = GPU_TYPES[name]
        groups.append(dict(count=max(1, int(round(w * target / per_node))), device=name, devices_per_node=per_node,
                           memory_gb=mem, tflops=tflops, intra_node_GBps=intra))
    world = sum(g["count"] * g["devices_per_node"] for g in groups)
    arch = str(rng.choice(["gpt2", "gpt2-medium"] if world <= 64 else ["gpt2-xl", "llama-7b"]))
    gbs = 2 ** math.ceil(math.log2(max(world, 16))) * int(rng.choice([1, 2]))
    return arch, dict(name=f"train{seed}", node_groups=groups, inter_node_GBps=float(rng.choice([12.5, 25, 50])),
                      inter_node_latency_us=5, intra_node_latency_us=2), gbs


def _env_for(seed: int, max_gpus: int) -> ReplicaEnv:
    arch, cfg, gbs = training_instance(seed, max_gpus)
    meta, cluster = load_meta(arch), spec_from_preset(cfg)
    train = section(TrainConfig, dict(global_batch_size=gbs, schedule=schedules.DEFAULT, stages_per_rank=1,
                                      microbatches="auto", dtype="bfloat16", dp_mode="fsdp"))
    planner = asdict(ExactPlannerConfig())
    sim = Simulator(meta, cluster, cost_options(planner, train))
    return ReplicaEnv(sim, meta, cluster, planner, train)


def train_policy(minutes: float = 4.0, instances: int = 24, batch: int = 4, lr: float = 0.02,
                 entropy_coef: float = 0.01, max_gpus: int = 256, seed: int = 0,
                 log=print) -> ReplicaPolicy:
    """REINFORCE over generated clusters: reward -log(step / the best step seen on the instance),
    the batch's mean as baseline; stops after `minutes` of wall time."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = ReplicaPolicy()
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    envs: Dict[int, ReplicaEnv] = {}
    best: Dict[int, float] = {}
    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < minutes * 60:
        i = step % instances
        if i not in envs:
            envs[i] = _env_for(i, max_gpus)
        env = envs[i]
        logps, ents, times = [], [], []
        for _ in range(batch):
            chosen, logp, ent = sample(env, policy, gen)
            t = env.assemble(chosen)[0] if chosen else math.inf
            logps.append(logp)
            ents.append(ent)
            times.append(t)
        finite = [t for t in times if math.isfinite(t)]
        if finite:
            best[i] = min(best.get(i, math.inf), *finite)
        rewards = torch.tensor([-math.log(t / best[i]) if math.isfinite(t) else INFEASIBLE_REWARD
                                for t in times]) if i in best else torch.full((batch,), INFEASIBLE_REWARD)
        adv = rewards - rewards.mean()
        loss = -(adv * torch.stack(logps)).mean() - entropy_coef * torch.stack(ents).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 10 == 0:
            log(f"step {step} ({time.perf_counter() - t0:.0f} s): mean reward {rewards.mean():.3f}")
    return policy
