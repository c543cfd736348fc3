"""Baselines over the heterogeneous-replica space (hrlplan.search.hetero) at a given number of
simulator calls: random search, simulated annealing and successive halving. All sample the space
hetero_exact proves over, with any rows per replica (not only its grid) and random layer splits,
and predict each plan in full (predict_any_plan). bench/hetero.py runs them at the exact search's
simulator calls, bench/hetero_hrl.py at the learned replica policy's.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from hrlplan.search.hetero import (BOTH_OPTIMIZERS, HeteroSpace, Replica, ReplicaSpace, hetero_plan, place,
                                  same_tp_required)
from hrlplan.search.hetero_exact import nproc_candidates


@dataclass(frozen=True)
class Choice:
    """One device type's replicas: `count` of `size` devices, `rows` each, config index, split cuts."""
    device_type: str
    size: int
    count: int
    rows: int
    config: int
    cuts: Tuple[int, ...]
    tp: Optional[int] = None   # one tp degree across replicas where the model needs it (GPT-2)


class Sampler:
    def __init__(self, sim, meta, cluster, planner_cfg, train_cfg, seed: int = 0):
        self.sim, self.meta, self.cluster = sim, meta, cluster
        self.cfg = {k: v for k, v in planner_cfg.items() if k != "heterogeneous"}
        self.train = {k: getattr(train_cfg, k) for k in train_cfg.__dataclass_fields__}
        self.B = int(train_cfg.global_batch_size)
        self.rng = random.Random(seed)
        self.space = HeteroSpace(cluster, nproc_candidates(cluster)[0])
        self._configs: Dict[tuple, Tuple[ReplicaSpace, list]] = {}
        self.tp_rule = same_tp_required(meta)

    def configs(self, t: str, size: int, rows: int, tp: Optional[int]):
        key = (t, size, rows, tp)
        if key not in self._configs:
            rs = ReplicaSpace(self.meta, self.cluster, self.cfg, dict(self.train, global_batch_size=rows,
                                                                      microbatches="auto"),
                              self.space.first_replica_pool(t, size), tp=tp)
            rs.sim = self.sim
            self._configs[key] = (rs, list(rs.configs()))
        return self._configs[key]

    def random_cuts(self, n_stages: int) -> Tuple[int, ...]:
        return tuple(sorted(self.rng.sample(range(1, self.meta.n_layer), n_stages - 1)))

    def random_choice(self, t: str, rows_left: int, last: bool, tp: Optional[int]) -> Optional[Choice]:
        shapes = [(s, k) for s in self.space.replica_sizes(t) for k in self.space.replica_counts(t, s)
                  if (rows_left % k == 0 if last else k < rows_left)]
        self.rng.shuffle(shapes)
        for size, k in shapes[:8]:
            rows = rows_left // k if last else self.rng.randint(1, (rows_left - 1) // k)
            _, configs = self.configs(t, size, rows, tp)
            if configs:
                c = self.rng.randrange(len(configs))
                return Choice(t, size, k, rows, c, self.random_cuts(configs[c].n_stages), tp)
        return None

    def random_state(self) -> Optional[List[Choice]]:
        types = self.space.types[:]
        self.rng.shuffle(types)
        types = types[:self.rng.randint(1, len(types))]
        tp = self.rng.choice([1, 2, 4, 8]) if self.tp_rule else None
        left, out = self.B, []
        for i, t in enumerate(types):
            choice = self.random_choice(t, left, i == len(types) - 1, tp)
            if choice is None:
                return None
            out.append(choice)
            left -= choice.count * choice.rows
        return out

    def score(self, state: List[Choice]) -> Tuple[float, Any]:
        replicas = []
        for ch in state:
            rs, configs = self.configs(ch.device_type, ch.size, ch.rows, ch.tp)
            c = configs[ch.config]
            bounds = (0,) + ch.cuts + (self.meta.n_layer,)
            layout = rs.layout(c, [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)])
            replicas += [Replica(ch.device_type, place(layout, self.space.replica_devices(ch.device_type, ch.size, k)))
                         for k in range(ch.count)]
        plan, predicted = hetero_plan(self.meta, self.cluster, replicas, str(self.train["schedule"]), {}, sim=self.sim,
                                      optimizers=BOTH_OPTIMIZERS)
        return (predicted["step_time_s"] if predicted["feasible"] else math.inf), plan

    def neighbour(self, state: List[Choice]) -> Optional[List[Choice]]:
        """Move one split boundary, change one type's configuration, or trade rows between two types."""
        state = list(state)
        i = self.rng.randrange(len(state))
        ch = state[i]
        move = self.rng.random()
        tp = ch.tp
        _, configs = self.configs(ch.device_type, ch.size, ch.rows, tp)
        if move < 0.5 and ch.cuts:
            cuts = list(ch.cuts)
            j = self.rng.randrange(len(cuts))
            lo = cuts[j - 1] + 1 if j else 1
            hi = cuts[j + 1] - 1 if j + 1 < len(cuts) else self.meta.n_layer - 1
            cuts[j] = self.rng.randint(lo, hi)
            state[i] = replace(ch, cuts=tuple(cuts))
        elif move < 0.8 or len(state) < 2:
            c = self.rng.randrange(len(configs))
            state[i] = replace(ch, config=c, cuts=self.random_cuts(configs[c].n_stages))
        else:   # rows from one type to another, in whole replicas' worth
            j = self.rng.choice([x for x in range(len(state)) if x != i])
            a, b = state[i], state[j]
            if a.rows - b.count < 1:
                return None
            a2, b2 = replace(a, rows=a.rows - b.count), replace(b, rows=b.rows + a.count)
            for k, ch2 in ((i, a2), (j, b2)):
                _, cf = self.configs(ch2.device_type, ch2.size, ch2.rows, tp)
                if not cf:
                    return None
                c = min(ch2.config, len(cf) - 1)
                cuts = ch2.cuts if cf[c].n_stages == len(ch2.cuts) + 1 else self.random_cuts(cf[c].n_stages)
                state[k] = replace(ch2, config=c, cuts=cuts)
        return state


def random_search(sampler: Sampler, calls: int, deadline: float = math.inf) -> Tuple[float, Any]:
    best, best_plan = math.inf, None
    start = sampler.sim.evaluations
    while sampler.sim.evaluations - start < calls and time.perf_counter() < deadline:
        state = sampler.random_state()
        if state is None:
            sampler.sim.evaluations += 1   # a failed draw counts, or an empty space would never end
            continue
        t, plan = sampler.score(state)
        if t < best:
            best, best_plan = t, plan
    return best, best_plan


def annealing(sampler: Sampler, calls: int, deadline: float = math.inf, t0: float = 0.1,
              restarts_every: int = 200) -> Tuple[float, Any]:
    """Simulated annealing on log step time; a random restart when stuck infeasible."""
    best, best_plan = math.inf, None
    start = sampler.sim.evaluations
    state, cur = None, math.inf
    step = 0
    while sampler.sim.evaluations - start < calls and time.perf_counter() < deadline:
        step += 1
        if state is None or (cur == math.inf and step % 10 == 0) or step % restarts_every == 0 and cur > best:
            state = sampler.random_state()
            if state is None:
                sampler.sim.evaluations += 1
                continue
            cur, plan = sampler.score(state)
        else:
            nxt = sampler.neighbour(state)
            if nxt is None:
                sampler.sim.evaluations += 1
                continue
            t, plan = sampler.score(nxt)
            temp = t0 * max(1e-3, 1 - (sampler.sim.evaluations - start) / calls)
            if t < cur or (t < math.inf and sampler.rng.random() < math.exp(-(math.log(t) - math.log(cur)) / temp)):
                state, cur = nxt, t
        if cur < best:
            best, best_plan = cur, plan
    return best, best_plan


def successive_halving(sampler: Sampler, calls: int, deadline: float = math.inf, eta: int = 2) -> Tuple[float, Any]:
    """Successive halving over random replica plans: a population scored once, the better half kept
    and each survivor improved by neighbour moves (first improvement) with twice the calls per
    round, until the calls are spent."""
    best, best_plan = math.inf, None
    start = sampler.sim.evaluations

    def left() -> int:
        return calls - (sampler.sim.evaluations - start) if time.perf_counter() < deadline else 0

    population = []
    while len(population) < max(4, calls // 8) and left() > 0:
        state = sampler.random_state()
        if state is None:
            sampler.sim.evaluations += 1
            continue
        t, plan = sampler.score(state)
        population.append((t, state, plan))
    moves = 1
    while population and left() > 0:
        population.sort(key=lambda x: x[0])
        if population[0][0] < best:
            best, best_plan = population[0][0], population[0][2]
        population = population[:max(1, len(population) // eta)]
        improved = []
        for t, state, plan in population:
            for _ in range(moves):
                if left() <= 0:
                    break
                nxt = sampler.neighbour(state)
                if nxt is None:
                    sampler.sim.evaluations += 1
                    continue
                t2, plan2 = sampler.score(nxt)
                if t2 < t:
                    t, state, plan = t2, nxt, plan2
            improved.append((t, state, plan))
        population = improved
        moves *= eta
    for t, _, plan in population:
        if t < best:
            best, best_plan = t, plan
    return best, best_plan
