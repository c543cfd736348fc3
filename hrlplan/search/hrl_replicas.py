"""Hierarchical RL over heterogeneous replicas (issue 35), for where hetero_exact cannot prove.

High level (ReplicaPolicy, this module): for each device type, one option -- off, or `count`
replicas of one shape (a node slice, whole nodes, or a slice across nodes: HeteroSpace's shapes) --
scored by a small MLP over instance-relative features of the option (its share of the type's
devices, the type's speed and memory against the model's needs, ...) and sampled from their
softmax. Each sample is a proposal: the device grouping and which replicas each type trains.

Low level (search/hrl_replica_low.py): rows per replica on the grid of B/steps rows, chosen by a
small exact DP that minimises the largest estimated replica step; each replica's template (stage
count, tp, micro-batching, layer boundaries) from the exact planner's min-max DP split over the
configurations with the best estimates, simulated. Estimates cost no simulator call.

Search (search_hrl_replicas): many proposals are drawn (the greedy one first, then samples, plus
each type alone) and screened by their estimated step; the best-screened are simulated in full
(templates, then the plan with its cross-replica reduce), each once more with rows rebalanced by
what the simulation showed, until the simulator calls or the deadline run out. The best simulated
plan is kept.

Trained with REINFORCE over generated heterogeneous clusters (2-4 device types, uneven counts and
node sizes, 16-1024 GPUs, memory-limited fast types) on the screening estimate; the shipped weights
plan zero-shot.

    python -m hrlplan.search.train_replicas [--minutes 4] [--out <file>]   # retrain (train_replicas.py)
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from hrlplan import schedules
from hrlplan.cluster import spec_from_preset
from hrlplan.config import ExactPlannerConfig, TrainConfig, section
from hrlplan.cost.replica_sync import REPLICATED
from hrlplan.cost.simulator import Simulator
from hrlplan.search.common import cost_options
from hrlplan.search.hetero import BOTH_OPTIMIZERS, HeteroSpace, Replica, Shape, hetero_plan, place, same_tp_required
from hrlplan.search.hetero_exact import nproc_candidates, row_grid
from hrlplan.search.hrl_replica_low import ReplicaTemplates
from hrlplan.search.hrl_replica_sync import sync_estimate
from hrlplan.search.instances import load_meta

FEATURES = 12
POLICY_FILE = Path(__file__).resolve().parent / "hrl" / "pretrained" / "replicas.pth"
OFF = None
INFEASIBLE_REWARD = -3.0
DEFAULT_TIME_S = 40.0   # the whole search, under planning's 60 s at 1024 GPUs
LOW_LEVEL = "estimate-screened proposals; exact planner's min-max DP splits (search/splits.py)"

Entry = Tuple[str, Shape, int]   # (device type, replica shape, replica count)


class ReplicaPolicy(nn.Module):
    """Scores every option of one device type; softmax over them."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.net(feats).squeeze(-1)


def load_replica_policy(path: Optional[Path] = None) -> ReplicaPolicy:
    """The shipped weights; weights of another feature layout are not used (a fresh policy is)."""
    policy = ReplicaPolicy()
    path = Path(path or POLICY_FILE)
    if path.exists():
        state = torch.load(path, weights_only=True)
        if state.get("net.0.weight", torch.empty(0, 0)).shape[-1] == FEATURES:
            policy.load_state_dict(state)
    return policy


class ReplicaEnv:
    """One instance as the high-level policy sees it: per type its options and their features."""

    def __init__(self, sim, meta, cluster, planner_cfg, train_cfg, share_steps: int = 16, top: int = 2,
                 slack=(0.0,)):
        self.sim, self.meta, self.cluster = sim, meta, cluster
        self.train = {k: getattr(train_cfg, k) for k in train_cfg.__dataclass_fields__}
        self.B = int(train_cfg.global_batch_size)
        self.schedule = str(train_cfg.schedule)
        self.space = HeteroSpace(cluster, nproc_candidates(cluster)[0])
        self.grid_unit = row_grid(self.B, share_steps)[0]
        self.low = ReplicaTemplates(sim, meta, cluster, planner_cfg, self.train, self.space, top=top, slack=slack)
        self.deadline = math.inf   # past it, a proposal's plan is not rebalanced (search_hrl_replicas sets it)
        # the optimizers a proposal's plan is predicted with, the faster kept: the one the sync estimate
        # models (hrl_replica_sync.py: the replicated reduce); search_hrl_replicas assesses both, as exact does
        self.optimizers: Tuple[str, ...] = (REPLICATED,)
        # one tp across replicas (GPT-2): each proposal screened at every tp degree, the best kept
        self.tps: List[Optional[int]] = [None]
        if same_tp_required(meta):
            self.tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= int(planner_cfg.get("max_tp", 8))
                        and tp <= self.space.nproc and meta.num_heads % tp == 0]
        self.options: Dict[str, List[Optional[Tuple[Shape, int]]]] = {}
        self.features: Dict[str, torch.Tensor] = {}
        speed = {t: self._type_flops(t) for t in self.space.types}
        fastest = max(speed.values())
        world = self.space.launchable_devices()
        need = meta.total_params * 16.0   # weights, gradients and Adam state in bytes, unsharded
        nproc = self.space.nproc
        for t in self.space.types:
            nodes = len(self.space.type_nodes[t])
            devices = nodes * nproc
            mem = cluster.devices[self.space.node_devices[self.space.type_nodes[t][0]][0]].memory_bytes
            opts = [OFF] + [(s, k) for s in self.space.replica_shapes(t) for k in self.space.shape_counts(t, s)
                            if k * self.grid_unit <= self.B]
            self.options[t] = opts
            rows = []
            for o in opts:
                s, k = o if o is not None else (Shape(1, 1), 0)
                size = s.size if o is not None else 1
                rows.append([0.0 if o is None else math.log2(size) / 10, 0.0 if o is None else math.log2(k) / 10,
                             0.0 if o is None else size * k / devices, speed[t] / fastest, devices / world,
                             math.log(max(mem * size / need, 1e-3)) / 5, 1.0 if o is None else 0.0,
                             math.log2(self.B) / 12, math.log10(max(meta.total_params, 1)) / 11,
                             0.0 if o is None else s.per_node / nproc, 0.0 if o is None else s.nodes / nodes,
                             len(self.space.types) / 4])
            self.features[t] = torch.tensor(rows, dtype=torch.float32)

    def _type_flops(self, t: str) -> float:
        d = self.space.node_devices[self.space.type_nodes[t][0]][0]
        return self.sim.devices.throughput(d, self.meta.seq_len)

    def rows_for(self, chosen, speeds: Dict[str, float]) -> Optional[List[int]]:
        """Rows per replica of each chosen (type, shape or size, count), in proportion to `speeds`
        (per device), in grid units, summing to B; None if some replica would get none."""
        unit, units = self.grid_unit, self.B // self.grid_unit
        weight = [speeds[t] * (s.size if isinstance(s, Shape) else s) for t, s, _ in chosen]
        total = sum(w * k for w, (_, _, k) in zip(weight, chosen))
        per = [max(1, int(units * w / total)) for w in weight]
        ideal = [units * w / total for w in weight]
        for _ in range(4 * units):   # fix the sum where the relative error is largest, >= 1 per replica
            left = units - sum(p * k for p, (_, _, k) in zip(per, chosen))
            if left == 0:
                return [p * unit for p in per]
            candidates = [i for i, (_, _, k) in enumerate(chosen) if (k <= left if left > 0 else per[i] > 1)]
            if not candidates:
                return None
            i = max(candidates, key=lambda j: (ideal[j] - per[j]) if left > 0 else (per[j] - ideal[j]))
            per[i] += 1 if left > 0 else -1
        return None

    def screen(self, chosen: List[Entry], correction=None) -> Tuple[float, Optional[int], Optional[List[int]]]:
        """(estimated step, tp, rows per replica of each entry): the best tp's row allocation."""
        best: Tuple[float, Optional[int], Optional[List[int]]] = (math.inf, None, None)
        for tp in self.tps:
            est, rows = self.low.allocate(chosen, self.B, self.grid_unit, tp, correction)
            if rows is not None:
                est += self.sync_estimate(chosen, tp, rows)
            if est < best[0]:
                best = (est, tp, rows)
        return best

    def sync_estimate(self, chosen: List[Entry], tp: Optional[int], rows: List[int]) -> float:
        """The cross-replica gradient sync left exposed, as the simulator's buckets run it (in node
        first; search/hrl_replica_sync.py), without a simulator call."""
        return sync_estimate(self, chosen, tp, rows)

    def assemble(self, chosen: List[Entry], tp: Optional[int], rows: List[int]) -> Tuple[float, Any, Any]:
        """The simulated plan of the chosen entries at these rows: (step, plan, replicas); inf where a
        template or the plan does not fit."""
        templates = [self.low.template((t, s, r, tp)) for (t, s, _), r in zip(chosen, rows)]
        if any(tm.layout is None for tm in templates):
            return math.inf, None, None
        replicas = [Replica(t, place(tm.layout, self.space.shape_devices(t, s, i)))
                    for (t, s, k), tm in zip(chosen, templates) for i in range(k)]
        plan, predicted = hetero_plan(self.meta, self.cluster, replicas, self.schedule, {}, sim=self.sim,
                                      optimizers=self.optimizers)
        if not predicted["feasible"]:
            return math.inf, None, None
        return predicted["step_time_s"], plan, replicas

    def correction(self, chosen: List[Entry], tp: Optional[int], rows: List[int]) -> Dict[tuple, float]:
        """Simulated / estimated replica step per entry, where its template is known."""
        out = {}
        for (t, s, _), r in zip(chosen, rows):
            tm = self.low.templates.get((t, s, r, tp))
            est = self.low.estimate((t, s, r, tp))
            if tm is not None and tm.layout is not None and 0 < est < math.inf:
                out[(t, s)] = tm.time_s / est
        return out


def sample(env: ReplicaEnv, policy: ReplicaPolicy, gen: torch.Generator, greedy: bool = False):
    """One high-level decision per type; (chosen entries, log-probability, entropy)."""
    logp, entropy, chosen = torch.zeros(()), torch.zeros(()), []
    for t in env.space.types:
        logits = policy(env.features[t])
        probs = torch.softmax(logits, 0)
        i = int(torch.argmax(probs)) if greedy else int(torch.multinomial(probs, 1, generator=gen))
        logp = logp + torch.log(probs[i] + 1e-12)
        entropy = entropy - (probs * torch.log(probs + 1e-12)).sum()
        if env.options[t][i] is not OFF:
            chosen.append((t, *env.options[t][i]))
    return chosen, logp, entropy


def _alone(env: ReplicaEnv, policy: ReplicaPolicy) -> List[List[Entry]]:
    """Each type alone at each of its options, the policy's favourites first: single-type plans
    are always proposals (where the screening time allows)."""
    scored = []
    for t in env.space.types:
        logits = policy(env.features[t])
        scored += [(-float(logits[i]), j, [(t, *o)]) for j, (i, o) in enumerate(enumerate(env.options[t]))
                   if o is not OFF]
    return [chosen for _, _, chosen in sorted(scored, key=lambda x: (x[0], x[1]))]


def _uniform(env: ReplicaEnv) -> List[List[Entry]]:
    """For each replica size, every type's devices in replicas of about that size (node slices or
    whole nodes, all its nodes used): plans whose replicas are alike in size across types, which
    one-type-at-a-time moves cannot reach from a single-type plan on a fine row grid."""
    out = []
    sizes = sorted({s.size for t in env.space.types for s in env.space.replica_shapes(t, sliced=False)})
    for size in sizes:
        chosen = []
        for t in env.space.types:
            shapes = env.space.replica_shapes(t, sliced=False)
            shape = min(shapes, key=lambda s: (abs(math.log2(s.size / size)), -s.size))
            counts = [k for k in env.space.shape_counts(t, shape) if k * env.grid_unit <= env.B]
            if counts:
                chosen.append((t, shape, max(counts)))
        if len(chosen) > 1:
            out.append(chosen)
    return out


class Proposals:
    """The greedy decision, replicas of one size on every type, each type alone (the policy's
    favourites first), then `draws` samples, screened by estimate in batches as time allows."""

    def __init__(self, env: ReplicaEnv, policy: ReplicaPolicy, gen: torch.Generator, draws: int):
        self.env, self.seen, self.count, self.uniform = env, set(), 0, set()

        # no_grad around each draw, never around a yield: a generator suspended inside `with no_grad()`
        # leaves gradients off in its caller's thread until it is collected (a cycle here: late), and a
        # later planner's training then failed ("element 0 of tensors does not require grad")
        draw, alone = torch.no_grad()(sample), torch.no_grad()(_alone)

        def stream():
            yield draw(env, policy, gen, greedy=True)[0]
            for chosen in _uniform(env):
                self.uniform.add(tuple(chosen))
                yield chosen
            yield from alone(env, policy)
            for _ in range(draws):
                yield draw(env, policy, gen)[0]
        self.stream = stream()

    def screen(self, until: float) -> List[Tuple[float, List[Entry], Optional[int], List[int]]]:
        """The next proposals screened until `until` (past it, on while none fits, up to the
        search's deadline); fastest estimate first."""
        screened = []
        for chosen in self.stream:
            key = tuple(chosen)
            if chosen and key not in self.seen:
                self.seen.add(key)
                est, tp, rows = self.env.screen(chosen)
                if rows is not None:
                    screened.append((est, chosen, tp, rows))
                    self.count += 1
            now = time.perf_counter()
            if now > until and (screened or now > self.env.deadline):
                break
        return sorted(screened, key=lambda x: x[0])


def _halved(env: ReplicaEnv, entry: Entry) -> Optional[Entry]:
    """The entry at the largest replica count of its shape that is at most half its own."""
    t, shape, k = entry
    fewer = [c for c in env.space.shape_counts(t, shape) if c <= k // 2]
    return (t, shape, max(fewer)) if fewer else None


def improve(env: ReplicaEnv, chosen: List[Entry], deadline: float, sweeps: int = 2
            ) -> Tuple[float, List[Entry], Optional[int], Optional[List[int]]]:
    """Coordinate descent on the screening estimate from a proposal: each type in turn takes the
    option (off included) that lowers the estimated step most, the others held; no simulator call."""
    best = (*env.screen(chosen),)
    best = (best[0], list(chosen), best[1], best[2])
    for _ in range(sweeps):
        moved = False
        for t in env.space.types:
            if time.perf_counter() > deadline:
                return best
            others = [e for e in best[1] if e[0] != t]
            # the others as they are, one of them off (a type taking the rows another had), or one at
            # half its replicas (making room on the row grid for this type's)
            keeps = [others] + [[e for e in others if e is not off] for off in others if len(others) > 1]
            keeps += [[halved if e is other else e for e in others] for other in others
                      for halved in [_halved(env, other)] if halved is not None]
            for o in env.options[t]:
                if time.perf_counter() > deadline:
                    return best
                for kept in keeps:
                    trial = sorted(kept + ([] if o is OFF else [(t, *o)]), key=lambda e: e[0])
                    if not trial or trial == best[1]:
                        continue
                    est, tp, rows = env.screen(trial)
                    if est < best[0] * (1 - 1e-9):
                        best, moved = (est, trial, tp, rows), True
        if not moved:
            break
    return best


def search_hrl_replicas(sim, meta, cluster, planner_cfg, train_cfg, calls: int, seed: int = 0,
                        policy: Optional[ReplicaPolicy] = None, deadline: float = math.inf,
                        time_s: float = DEFAULT_TIME_S,
                        draws: int = 64, top: int = 2, slack=(0.0,), improve_top: int = 4) -> Dict[str, Any]:
    """Zero-shot: proposals screened by estimate, the best simulated in full (then once more with
    rows rebalanced by the simulation), until `calls` simulator evaluations are spent or the
    deadline passes. Returns {step_time_s, plan, replicas, calls, time_s, low_level, decisions, ...}."""
    policy = policy or load_replica_policy()
    gen = torch.Generator().manual_seed(seed)
    start, t0 = sim.evaluations, time.perf_counter()
    deadline = min(deadline, t0 + time_s)
    env = ReplicaEnv(sim, meta, cluster, planner_cfg, train_cfg, top=top, slack=slack)
    env.optimizers = BOTH_OPTIMIZERS
    env.deadline = deadline
    proposals = Proposals(env, policy, gen, draws)
    best, simulated, tried, done = (math.inf, None, None), 0, set(), set()

    def left() -> bool:
        return sim.evaluations - start < calls and time.perf_counter() < deadline

    first = True
    while left():
        # each round: screening takes a third of the time left (a fifth more for refining, the first
        # time), then the screened proposals are simulated, the best estimate first
        now = time.perf_counter()
        batch = proposals.screen(now + (deadline - now) / 3)
        if first:   # the best few refined on the estimate (coordinate descent over each type's options)
            until = time.perf_counter() + (deadline - now) / 5
            # the best uniform-size plans first: they reach mixed plans that the others' moves cannot
            starts = [b for b in batch if tuple(b[1]) in proposals.uniform][:2] + batch[:improve_top]
            batch += [improve(env, chosen, until) for _, chosen, _, _ in starts]
            first = False
        batch = sorted({tuple(c): (e, c, tp, r) for e, c, tp, r in sorted(batch, key=lambda x: -x[0])
                        if r is not None and tuple(c) not in done}.values(), key=lambda x: x[0])
        if not batch:
            break
        for est, chosen, tp, rows in batch:
            if not left():
                break
            done.add(tuple(chosen))
            simulated += 1
            for attempt in range(3):
                key = (tuple(chosen), tp, tuple(rows))
                if key in tried:
                    break
                tried.add(key)
                got = env.assemble(chosen, tp, rows)
                if got[0] < best[0]:
                    best = got
                if not left():
                    break
                # rebalance: the estimates corrected by what the templates simulated to
                _, tp2, rows2 = env.screen(chosen, env.correction(chosen, tp, rows))
                if rows2 is None:
                    break
                tp, rows = tp2, rows2
    used = sim.evaluations - start
    # every proposal simulated before the calls ran out: the baselines get the whole budget still
    # (`calls`), `calls_used` says what this search spent
    return {"step_time_s": best[0], "plan": best[1], "replicas": best[2],
            "calls": calls if used < calls and calls < 10 ** 8 else used, "calls_used": used,
            "time_s": time.perf_counter() - t0, "low_level": LOW_LEVEL, "decisions": proposals.count,
            "simulated": simulated}


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


def train_policy(minutes: float = 4.0, instances: int = 24, batch: int = 8, lr: float = 0.02,
                 entropy_coef: float = 0.01, max_gpus: int = 256, seed: int = 0,
                 log=print, max_steps: Optional[int] = None, env_of=None) -> ReplicaPolicy:
    """REINFORCE over generated clusters on the screening estimate (no simulator call): reward
    -log(estimate / the best estimate seen on the instance), the batch's mean as baseline; stops
    after `minutes` of wall time (or `max_steps` updates). `env_of(i)`: the i-th instance's
    ReplicaEnv (default: training_instance(i)'s)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = ReplicaPolicy()
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    envs: Dict[int, ReplicaEnv] = {}
    best: Dict[int, float] = {}
    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < minutes * 60 and (max_steps is None or step < max_steps):
        i = step % instances
        if i not in envs:
            envs[i] = env_of(i) if env_of is not None else _env_for(i, max_gpus)
        env = envs[i]
        logps, ents, times = [], [], []
        for _ in range(batch):
            chosen, logp, ent = sample(env, policy, gen)
            t = env.screen(chosen)[0] if chosen else math.inf
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
