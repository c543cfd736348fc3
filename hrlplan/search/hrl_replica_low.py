"""The low level of the learned replica planner (search/hrl_replicas.py): one replica's template,
and the rows each chosen replica takes.

- `estimate(key)`: a replica's step time without a simulator call -- per configuration (stage
  count, tp, micro-batching) the min-max layer split's bottleneck from the exact planner's own split
  tables (search/splits.py), times the micro-batches plus the fill and drain, the best over the
  configurations. Tables are shared by every row count with the same micro-batch size, as
  hetero_exact's bounds share them.
- `template(key)`: the replica's layout -- the configurations with the best estimates, each at its
  min-max DP split (and, with `slack`, the near-min-max splits of less total time), simulated; the
  fastest that fits. These are the simulator calls of the low level.
- `allocate(entries)`: rows per chosen (type, shape, count) on the grid of B/steps rows that
  minimise the largest estimated replica step (an exact small DP over the entries), each estimate
  scaled by the entry's correction (simulated / estimated, once a template is known).

Keys are (type, Shape, rows, tp); tp None where replicas may differ in tp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hrlplan.search.hetero import HeteroSpace, ReplicaSpace, Shape
from hrlplan.search.splits import SplitTables

INF = math.inf


@dataclass
class Template:
    time_s: float
    layout: Any


class ReplicaTemplates:
    def __init__(self, sim, meta, cluster, planner_cfg: Dict[str, Any], train: Dict[str, Any], space: HeteroSpace,
                 top: int = 2, slack: Sequence[float] = (0.0,)):
        self.sim, self.meta, self.cluster, self.space = sim, meta, cluster, space
        self.cfg = {k: v for k, v in planner_cfg.items() if k != "heterogeneous"}
        self.train = train
        self.top, self.slack = top, tuple(slack)
        self._ranked: Dict[tuple, List[Tuple[float, Any]]] = {}
        self._fitting: Dict[tuple, Dict[int, List[Tuple[float, Any]]]] = {}
        self._spaces: Dict[tuple, ReplicaSpace] = {}
        self._bottleneck: Dict[tuple, float] = {}
        self._fails_from: Dict[tuple, int] = {}
        self.templates: Dict[tuple, Template] = {}
        ov = sim.devices.overheads
        self._scale, self._step = sim.devices.time_scale, max(0.0, ov.step)

    def replica_space(self, key) -> ReplicaSpace:
        if key not in self._spaces:
            t, shape, rows, tp = key
            rs = ReplicaSpace(self.meta, self.cluster, self.cfg, dict(self.train, global_batch_size=rows,
                                                                      microbatches="auto"),
                              self.space.shape_pool(t, shape), tp=tp)
            rs.sim = self.sim
            self._spaces[key] = rs
        return self._spaces[key]

    def ranked(self, key) -> List[Tuple[float, Any]]:
        """(optimistic estimate, configuration), fastest first: the bottleneck of the tables at
        min(m, pp) micro-batches, which every row count with this micro-batch size shares. Memory
        only grows with the micro-batches (receive buffers, activations in flight), so the estimate
        at the configuration's own m is never below it."""
        if key not in self._ranked:
            rs = self.replica_space(key)
            out = []
            for c in rs.configs():
                probe = replace(c, num_microbatches=min(c.num_microbatches, c.pp))
                shared = (rs._replica_pool, probe)
                if shared not in self._bottleneck:
                    self._bottleneck[shared] = SplitTables(self.sim, rs, probe).minmax()
                b = self._bottleneck[shared]
                if b < INF:
                    out.append((self._step_of(c, b), c))
            out.sort(key=lambda x: x[0])
            self._ranked[key] = out
        return self._ranked[key]

    def _step_of(self, c, bottleneck: float) -> float:
        return (c.num_microbatches + c.n_stages - 1) * bottleneck * self._scale + self._step

    def fitting(self, key, want: int = 1, scan: int = 12) -> List[Tuple[float, Any]]:
        """(estimate, configuration) at the configuration's own micro-batches, fastest first: a
        best-first scan of `ranked` that stops once `want` fit and the next optimistic estimate
        cannot beat them (or after `scan` tables)."""
        cache = self._fitting.setdefault(key, {})
        if want not in cache:
            rs = self.replica_space(key)
            found: List[Tuple[float, Any]] = []
            for n, (optimistic, c) in enumerate(self.ranked(key)):
                if n >= scan or (len(found) >= want and optimistic >= found[want - 1][0]):
                    break
                b = self._bottleneck_of(rs, c)
                if b < INF:
                    found.append((self._step_of(c, b), c))
                    found.sort(key=lambda x: x[0])
            cache[want] = found[:max(want, 1)]
        return cache[want]

    def _bottleneck_of(self, rs: ReplicaSpace, c) -> float:
        shared = (rs._replica_pool, replace(c, num_microbatches=min(c.num_microbatches, c.pp)))
        if c.num_microbatches <= c.pp:
            return self._bottleneck[shared]
        own = (rs._replica_pool, c)
        if own not in self._bottleneck:
            # memory grows with the micro-batches: past a count that does not fit, none does
            if c.num_microbatches >= self._fails_from.get(shared, INF):
                return INF
            self._bottleneck[own] = SplitTables(self.sim, rs, c).minmax()
            if self._bottleneck[own] == INF:
                self._fails_from[shared] = min(self._fails_from.get(shared, INF), c.num_microbatches)
        return self._bottleneck[own]

    def estimate(self, key) -> float:
        r = self.fitting(key)
        return r[0][0] if r else INF

    def template(self, key) -> Template:
        """The best simulated layout over the `top` best-estimated configurations (simulator calls)."""
        if key not in self.templates:
            rs = self.replica_space(key)
            best = Template(INF, None)
            for _, c in self.fitting(key, self.top):
                tables = SplitTables(self.sim, rs, c)
                for spans in tables.candidates(self.slack):
                    layout = rs.layout(c, spans, recompute=tables.recompute_of(spans))
                    r = self.sim.evaluate(layout)
                    if r.feasible and r.step_time_s < best.time_s:
                        best = Template(r.step_time_s, layout)
            self.templates[key] = best
        return self.templates[key]

    def allocate(self, entries: List[Tuple[str, Shape, int]], global_batch: int, unit: int,
                 tp: Optional[int], correction: Optional[Dict[tuple, float]] = None
                 ) -> Tuple[float, Optional[List[int]]]:
        """(estimated plan step, rows per replica of each entry), the rows summing to the batch and
        minimising the largest (corrected) estimate; (inf, None) where no split fits."""
        units = global_batch // unit
        correction = correction or {}

        def cost(i: int, u: int) -> float:
            t, shape, _ = entries[i]
            return self.estimate((t, shape, u * unit, tp)) * correction.get((t, shape), 1.0)

        # best[i][used]: (the least max estimate over entries i.. using `used` units, units of entry i)
        n = len(entries)
        best: List[Dict[int, Tuple[float, int]]] = [dict() for _ in range(n + 1)]
        best[n][0] = (0.0, 0)
        for i in range(n - 1, -1, -1):
            k = entries[i][2]
            for used in range(units + 1):
                top_u = used // k
                choice = (INF, 0)
                for u in range(1, top_u + 1):
                    rest = best[i + 1].get(used - u * k)
                    if rest is None or rest[0] >= choice[0]:
                        continue
                    value = max(cost(i, u), rest[0])
                    if value < choice[0]:
                        choice = (value, u)
                if choice[0] < INF:
                    best[i][used] = choice
        if units not in best[0]:
            return INF, None
        rows, used = [], units
        for i in range(n):
            u = best[i][used][1]
            rows.append(u * unit)
            used -= u * entries[i][2]
        return best[0][units][0], rows
