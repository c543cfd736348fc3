"""Exact over a stated sub-space of heterogeneous-replica plans (hrlplan.search.hetero).

The sub-space ("replicas grouped by device type"): every device type trains k_t >= 0 replicas of
one shape s_t (q devices on each of j nodes of that type, q a divisor of nproc-per-node: a slice of a
node, whole nodes, or a slice across nodes, the replicas filling whole nodes), all with one template
and b_t rows of the global batch each (b_t on a grid of B/steps rows), sum_t k_t b_t = B.

1. For each type, replica shape and row count b on the grid, the replica's template is the exact
   planner's optimum (search_exact over ReplicaSpace: dp 1 on the first replica's devices -- every
   replica of a type has identical devices and links on a preset) for a batch of b rows: the
   replica's own step time T(t, s, b).
2. An integer program (HiGHS) picks at most one (shape, count, rows) option per type, rows summing
   to B, minimising max T': a lower bound on every plan of the sub-space it has not excluded. T' is
   T less the most the sharded optimizer can save on that replica (hetero.sharding_saves_at_most_s:
   its optimizer step less the per-call cost): the simulator's step of a plan waits for its slowest
   replica, then adds the cross-replica gradient reduce and the optimizer, which the sharded one
   splits across replicas. Each solution is assembled and predicted in full (predict_any_plan, sync
   included) with either optimizer, the faster kept, then cut off (a no-good cut); the loop stops
   when the bound reaches the best predicted step -- that plan is then optimal over the sub-space,
   each plan at the faster of its two optimizers -- or on the round / time budget (then it says so).

The incumbent passed in (the single-template optimum) bounds the loop from the start, so the
result is a heterogeneous plan only where it beats it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from hrlplan.search.common import Scored
from hrlplan.search.estimate import estimates
from hrlplan.search.splits import SplitTables
from hrlplan.solver import quiet_highs
from hrlplan.search.hetero_single import DEFAULT_HETERO_TIME_S, exact_proved
from hrlplan.search.hetero_state import (UNBOUNDED_MEMBERS, WHOLE_STATE_BYTES, sharded_state_simulator,
                                         state_bytes_per_param)
from hrlplan.search.hetero import (BOTH_OPTIMIZERS, HeteroSpace, Replica, ReplicaSpace, Shape, hetero_plan, place,
                                  search_exact_until, sharding_saves_at_most_s)

DEFAULT_SHARE_STEPS = 16
DEFAULT_TIME_S = DEFAULT_HETERO_TIME_S   # the replica search's time from the planning's start
DEFAULT_MAX_ROUNDS = 300
DEFAULT_TEMPLATE_SIMS = 400   # as planner.hetero_template_simulations defaults
TP_ANY = 0
STATE_BYTES_PER_PARAM = WHOLE_STATE_BYTES   # a replica's state per parameter at dp 1 (cost/memory.state_split)


def members_of(key: tuple) -> int:
    """A template key's optimizer-state assumption: 0, the replica's whole state; k >= 2, the state
    sharded over k replicas (hetero_state.py), for replicas whose whole state fits no template."""
    return key[5] if len(key) > 5 else 0


@dataclass(frozen=True)
class Option:
    device_type: str
    shape: Shape
    count: int
    rows: int       # per replica
    tp: int         # TP_ANY unless the model needs one tp across replicas
    time_s: float   # a lower bound on the replica's own step time at its best template
    nproc: int
    # the replicas' own layouts where they are placed already (the single template's slices:
    # hetero_anchor.py); empty: `count` replicas of the table's template for `key`
    layouts: tuple = field(default=(), compare=False, repr=False)
    # 0: the template holds its whole optimizer state; k: sharded over the option's k replicas (members_of)
    members: int = 0

    @property
    def size(self) -> int:
        return self.shape.size

    @property
    def key(self) -> tuple:
        key = (self.nproc, self.device_type, self.shape, self.rows, self.tp)
        return key + (self.members,) if self.members else key


def row_grid(global_batch: int, steps: int) -> List[int]:
    """Rows per replica: multiples of the unit B/g, g the least divisor of B that is >= steps."""
    g = next(d for d in range(min(steps, global_batch), global_batch + 1) if global_batch % d == 0)
    unit = global_batch // g
    return [unit * i for i in range(1, g + 1)]


class TemplateTable:
    """Per (nproc, type, size, rows, tp): a rigorous lower bound on the replica's step time from the
    split tables alone (the exact planner's own pruning bound: m x bottleneck per configuration),
    and on demand its exact optimum (search_exact on the replica) with the layout."""

    def __init__(self, sim, meta, cluster, planner_cfg, train_cfg, deadline: float):
        self.sim, self.meta, self.cluster = sim, meta, cluster
        self.cfg = {k: v for k, v in planner_cfg.items() if k != "heterogeneous"}
        # a replica's branch and bound can run to 10^4 simulations (48 blocks, 16 stages, 128
        # micro-batches); beyond this cap (planner.hetero_template_simulations) its template is the
        # best found and the result unproven; each search also stops at a quarter of the time left
        self.cfg["max_simulations"] = min(int(planner_cfg.get("max_simulations", 10 ** 9)),
                                          int(planner_cfg.get("hetero_template_simulations", DEFAULT_TEMPLATE_SIMS)))
        self.train = dict(train_cfg) if isinstance(train_cfg, dict) else {
            k: getattr(train_cfg, k) for k in train_cfg.__dataclass_fields__}
        self.deadline = deadline
        self.search_deadline = float("inf")
        self.bounds: Dict[tuple, float] = {}
        self.bottlenecks: Dict[tuple, float] = {}
        self.peaks: Dict[tuple, float] = {}
        self.guesses: Dict[tuple, Dict[Any, float]] = {}
        self.table: Dict[tuple, Tuple[float, Any]] = {}
        # per key: the most the sharded optimizer can take off its template's step (lower_bound_s)
        self.savings: Dict[tuple, float] = {}
        self.searches = 0
        self.unproven = 0
        self.out_of_time = False
        self._state_sims: Dict[int, Any] = {}

    def sim_for(self, key):
        """The simulator a key's templates are searched with: the plain one, or one whose replicas keep
        the sharded optimizer's state over members_of(key) replicas."""
        members = members_of(key)
        if not members:
            return self.sim
        if members not in self._state_sims:
            self._state_sims[members] = sharded_state_simulator(self.sim, members)
        return self._state_sims[members]

    def _space(self, key) -> ReplicaSpace:
        nproc, device_type, shape, rows, tp = key[:5]
        space = self._spaces[nproc]
        train = dict(self.train, global_batch_size=rows, microbatches="auto")
        rs = ReplicaSpace(self.meta, self.cluster, self.cfg, train, space.shape_pool(device_type, shape),
                          tp=tp or None)
        rs.sim = self.sim_for(key)
        return rs

    def bind(self, spaces: Dict[int, HeteroSpace]) -> None:
        self._spaces = spaces

    def bound(self, key) -> Optional[float]:
        """None when out of time; inf when no configuration fits the replica's memory. A key whose state
        is sharded gets the bound of the relaxation where moments and masters vanish (UNBOUNDED_MEMBERS):
        its memory admits every split any members count admits, so one bound serves them all."""
        if key in self.bounds:
            return self.bounds[key]
        if members_of(key) not in (0, UNBOUNDED_MEMBERS):
            relaxed = self.bound(key[:5] + (UNBOUNDED_MEMBERS,))
            if relaxed is not None:
                self.bounds[key] = relaxed
            return relaxed
        if time.perf_counter() > self.deadline:
            self.out_of_time = True
            return None
        sim = self.sim_for(key)
        if not self.may_hold_state(key):
            self.bounds[key] = float("inf")
            return self.bounds[key]
        scale, floor = sim.devices.time_scale, min(0.0, sim.devices.overheads.step)
        best = float("inf")
        rs = self._space(key)
        for c in rs.configs():
            if not self.buffers_may_fit(key, c, rs):
                continue
            # A split's memory only grows with the micro-batch count (receive buffers, activations in
            # flight), so the bottleneck at min(m, pp) micro-batches bounds the one at m from below:
            # tables shared by every row count with the same micro-batch size.
            probe = replace(c, num_microbatches=min(c.num_microbatches, c.pp))
            shared = (rs._replica_pool, probe, members_of(key))
            if shared not in self.bottlenecks:
                self.bottlenecks[shared] = SplitTables(sim, rs, probe).minmax()
            best = min(best, (c.num_microbatches * self.bottlenecks[shared] + floor) * scale)
        self.bounds[key] = best
        return best

    def may_hold_state(self, key) -> bool:
        """False when the replica's devices together cannot hold its training state: at dp 1 every
        parameter is held at least once with 16 bytes (fp32 weights and gradients, two fp32 moments:
        cost/memory.state_split), or with the sharded optimizer's hetero_state.state_bytes_per_param
        (its key's members), whatever the split -- a proof that no configuration fits, found without
        bounding any (a 70B model's one-node slices cost minutes of split tables)."""
        nproc, device_type, shape = key[:3]
        devices = self._spaces[nproc].shape_devices(device_type, shape, 0)
        capacity = sum(self.sim.devices.memory_limit(d, self.sim.opts.memory_margin) for d in devices)
        return state_bytes_per_param(members_of(key)) * float(self.meta.total_params) <= capacity

    def buffers_may_fit(self, key, c, space: Optional[ReplicaSpace] = None) -> bool:
        """False when a configuration of pp > 1 stages cannot hold torch pipelining's receive buffers
        (cost/memory.receive_buffer_bytes: one message per micro-batch, kept from step to step, the
        full activation on each tp rank, 1/tp of it where the replica space runs sequence parallelism:
        ReplicaSpace.allow_sequence_parallel), whatever its split
        and micro-batch size: a last stage's rank holds one message per row of the replica (a middle
        stage's two), and the replica's devices together hold its state (may_hold_state) plus two per row
        and stage boundary and tp rank. Rows, not micro-batches, set them: the bound's shared split tables, probed
        at a few micro-batches, do not see them."""
        if c.pp == 1 or not self.sim.opts.receive_buffers:
            return True
        nproc, device_type, shape, rows = key[:4]
        devices = self._spaces[nproc].shape_devices(device_type, shape, 0)
        limits = [self.sim.devices.memory_limit(d, self.sim.opts.memory_margin) for d in devices]
        space = space or self._space(key)
        # a message per row on each tp rank: the full activation, its 1/tp under sequence parallelism
        row = rows * self.sim.costs.activation_message(1, c.tp if space.sequence_parallel(c) else 1)
        if max(limits) < row * (2 if c.pp > 2 else 1):
            return False
        # every stage holds c.tp ranks (the replica space's layouts keep one tp), each with its messages
        state = state_bytes_per_param(members_of(key)) * float(self.meta.total_params)
        return state + 2 * (c.pp - 1) * c.tp * row <= sum(limits)

    def estimate(self, key) -> float:
        """Past the bounding deadline, in place of a bound: the replica's rows at its devices' summed
        sustained peak (exact.lower_bound's estimate over a whole pool; no split tables, one sum per
        shape: thousands of options in well under a second) -- an order for the program, not a
        bound: the result is then unproven (out_of_time), never claimed."""
        if not self.may_hold_state(key):
            return float("inf")
        nproc, device_type, shape, rows = key[:4]
        if (nproc, device_type, shape) not in self.peaks:
            devices = self._spaces[nproc].shape_devices(device_type, shape, 0)
            self.peaks[(nproc, device_type, shape)] = sum(self.sim.devices.flops[d] for d in devices)
        meta = self.meta
        return rows * meta.seq_len * meta.training_flops_per_token() / self.peaks[(nproc, device_type, shape)] \
            * self.sim.devices.time_scale

    def exact(self, key) -> Tuple[float, Any]:
        if key not in self.table and key not in self.bounds and not self._may_fit(key):
            # never bounded (out of time, so unproven): no configuration fits by search/estimate.py's
            # memory model -- out without a template search (70B replicas: 1-2 s each under load)
            self.unproven += 1
            self.table[key] = (float("inf"), None)
        if key not in self.table:
            # one search takes at most a quarter of what is left, so that plans get assembled (an
            # unfinished template is the best found, and the result unproven)
            now = time.perf_counter()
            sim = self.sim_for(key)
            calls = sim.evaluations
            out = search_exact_until(sim, self._space(key), self.cfg,
                                     min(self.search_deadline, now + max(1.0, (self.search_deadline - now) / 4)),
                                     "a quarter of what was left of planner.hetero_time_s")
            if sim is not self.sim:   # the planner's count holds every call
                self.sim.evaluations += sim.evaluations - calls
            self.out_of_time = self.out_of_time or time.perf_counter() > self.search_deadline
            self.searches += 1
            self.unproven += not exact_proved(out, self.cfg)
            best = out["tracker"].best
            if best is None and out.get("out_of_time"):
                best = self._quick(key)
            self.table[key] = (best.time, best.layout) if best is not None else (float("inf"), None)
            if best is not None:
                self.savings[key] = sharding_saves_at_most_s(sim, best.layout)
        return self.table[key]

    def lower_bound_s(self, key) -> float:
        """The exact template's step less the most the sharded optimizer can save on it: what no plan
        holding this replica is faster than, under either optimizer (inf: no template fits)."""
        return self.exact(key)[0] - self.savings.get(key, 0.0)

    def _guesses(self, key) -> Dict[Any, float]:
        """search/estimate.py's memory-aware estimate per configuration of the replica (inf: does not fit)."""
        if key not in self.guesses:
            rs = self._space(key)
            configs = list(rs.configs())
            self.guesses[key] = dict(zip(configs, (e.step_s for e in estimates(self.sim_for(key), rs, configs))))
        return self.guesses[key]

    def _may_fit(self, key) -> bool:
        return self.may_hold_state(key) and min(self._guesses(key).values(), default=float("inf")) < float("inf")

    def _quick(self, key, tries: int = 3) -> Optional[Scored]:
        """A template when the search ran out before simulating any that fits: the DP split of the
        configurations with the best bounds (a plan to assemble, not a proof)."""
        rs = self._space(key)

        def bound(c):
            shared = (rs._replica_pool, replace(c, num_microbatches=min(c.num_microbatches, c.pp)),
                      members_of(key) and UNBOUNDED_MEMBERS)
            if shared not in self.bottlenecks:   # never bounded (the bounding ran out): its estimate
                return guesses.get(c, float("inf"))
            return c.num_microbatches * self.bottlenecks[shared]
        guesses = self._guesses(key)
        for c in sorted((c for c in guesses if bound(c) < float("inf")), key=bound)[:tries]:
            tables = SplitTables(rs.sim, rs, c)
            spans = next(iter(tables.candidates()), None)
            if spans is not None:
                layout = rs.layout(c, spans, recompute=tables.recompute_of(spans))
                result = rs.sim.evaluate(layout)
                if result.feasible:
                    return Scored(layout, result, c)
        return None


def nproc_candidates(cluster) -> List[int]:
    """One nproc-per-node for the launch: a probed job launches every worker (its node size); a
    preset may launch any of its node sizes (nodes with fewer devices then stay out)."""
    sizes = sorted(set(cluster.node_sizes()), reverse=True)
    return sizes[:1] if cluster.source in ("probe", "file") else sizes


def balance_distance(space: HeteroSpace, device_type: str, shape: Shape, rows: int, global_batch: int) -> float:
    """How far a replica's rows per unit of peak FLOP/s are from the whole cluster's, B over every
    launchable device's peak (|log| of the ratio; 0: as loaded as a perfectly balanced plan). Options
    near 0 are the ones a balanced plan is made of: they are bounded first, so that a budget ending
    the bounding leaves those (every type has some), not the small shapes that sort first."""
    cluster = space.cluster
    total = sum(cluster.devices[d].peak_flops for ds in space.node_devices.values() for d in ds)
    first = space.type_nodes[device_type][0]
    mine = shape.size * cluster.devices[space.node_devices[first][0]].peak_flops
    return abs(math.log((rows / mine) / (global_batch / total)))


def enumerate_options(table: TemplateTable, space: HeteroSpace, global_batch: int, steps: int,
                      tps: List[int]) -> List[Option]:
    """Every (type, shape, count, rows, tp) option with its bound, nearest the balance point first
    (balance_distance), so that a budget ending the bounding leaves the options a balanced plan needs."""
    grid = row_grid(global_batch, steps)
    todo = []
    for t in space.types:
        for shape in space.replica_shapes(t):
            counts = space.shape_counts(t, shape)
            for tp in tps:
                if tp != TP_ANY and (shape.size % tp or tp > shape.per_node):
                    continue
                for rows in grid:
                    fitting = [k for k in counts if k * rows <= global_batch]
                    if fitting:
                        order = (balance_distance(space, t, shape, rows, global_batch), rows, t, tp, shape)
                        todo.append((order, (t, shape, tp, rows, fitting)))
    out = []
    for _, (t, shape, tp, rows, fitting) in sorted(todo, key=lambda x: x[0]):
        key = (space.nproc, t, shape, rows, tp)
        bound = _bound_or_estimate(table, key)
        if bound < float("inf"):
            out.extend(Option(t, shape, k, rows, tp, bound, space.nproc) for k in fitting)
            continue
        # no template holds the whole optimizer state: the option's k >= 2 replicas may shard it; its
        # template assumes the largest power of two <= k (a template search per ladder step, not per k)
        relaxed = _bound_or_estimate(table, key + (UNBOUNDED_MEMBERS,))
        if relaxed < float("inf"):
            ladder = {k: 1 << (k.bit_length() - 1) for k in fitting if k >= 2}
            out.extend(Option(t, shape, k, rows, tp, relaxed, space.nproc, members=m) for k, m in ladder.items()
                       if table.may_hold_state(key + (m,)))
    return out


def _bound_or_estimate(table: TemplateTable, key: tuple) -> float:
    bound = table.bound(key)
    # out of time (table.out_of_time: unproven): the rest by estimate, not dropped
    return table.estimate(key) if bound is None else bound


class ShareProgram:
    """The integer program over options: one per type at most, rows summing to B, min max T."""

    def __init__(self, options: List[Option], global_batch: int, incumbent: float, required: Tuple[str, ...] = ()):
        """`required`: device types (option groups) of which one option must be chosen."""
        import highspy
        self.options = options
        h = quiet_highs()   # no banner on the console
        h.setOptionValue("mip_rel_gap", 0.0)
        self.h = h
        inf = highspy.kHighsInf
        n = len(options)
        for _ in options:
            h.addVar(0.0, 1.0)
        z = n
        h.addVar(0.0, inf)
        h.changeColsIntegrality(n, list(range(n)), [highspy.HighsVarType.kInteger] * n)
        h.changeColCost(z, 1.0)
        by_type: Dict[str, List[int]] = {}
        by_tp: Dict[int, List[int]] = {}
        self.by_key: Dict[tuple, List[int]] = {}
        self.z, self.time_row = z, []
        for i, o in enumerate(options):
            by_type.setdefault(o.device_type, []).append(i)
            by_tp.setdefault(o.tp, []).append(i)
            self.by_key.setdefault(o.key, []).append(i)
            self.time_row.append(h.getNumRow())
            h.addRow(0.0, inf, 2, [i, z], [-o.time_s, 1.0])           # z >= T_i x_i
        for t, idx in by_type.items():
            h.addRow(1.0 if t in required else 0.0, 1.0, len(idx), idx, [1.0] * len(idx))
        h.addRow(global_batch, global_batch, n, list(range(n)), [float(o.count * o.rows) for o in options])
        if len(by_tp) > 1:   # one tp degree across replicas: y_tp selects it, x_i <= y_tp(i)
            first = h.getNumCol()
            tps = sorted(by_tp)
            for _ in tps:
                h.addVar(0.0, 1.0)
            h.changeColsIntegrality(len(tps), list(range(first, first + len(tps))),
                                    [highspy.HighsVarType.kInteger] * len(tps))
            h.addRow(1.0, 1.0, len(tps), list(range(first, first + len(tps))), [1.0] * len(tps))
            for j, tp in enumerate(tps):
                for i in by_tp[tp]:
                    h.addRow(-inf, 0.0, 2, [i, first + j], [1.0, -1.0])
        if incumbent < inf:
            h.changeColBounds(z, 0.0, incumbent)

    def set_time(self, key: tuple, time_s: float) -> None:
        """An option's bound replaced by its exact time (inf: it fits no template, so it is out)."""
        for i in self.by_key[key]:
            if time_s == float("inf"):
                self.h.changeColBounds(i, 0.0, 0.0)
            else:
                self.h.changeCoeff(self.time_row[i], i, -time_s)

    def solve(self) -> Optional[Tuple[float, List[int]]]:
        import highspy
        self.h.run()
        if self.h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        values = self.h.getSolution().col_value
        chosen = [i for i in range(len(self.options)) if values[i] > 0.5]
        return self.h.getInfo().objective_function_value, chosen

    def cut(self, chosen: List[int]) -> None:
        """Exclude exactly this selection (any other selection differs in some x)."""
        import highspy
        others = [i for i in range(len(self.options)) if i not in set(chosen)]
        idx = chosen + others
        vals = [1.0] * len(chosen) + [-1.0] * len(others)
        self.h.addRow(-highspy.kHighsInf, len(chosen) - 1.0, len(idx), idx, vals)


def replicas_of(options: List[Option], spaces: Dict[int, HeteroSpace], table: TemplateTable) -> List[Replica]:
    out = []
    for o in options:
        if o.layouts:
            out.extend(Replica(o.device_type, lay) for lay in o.layouts)
            continue
        space = spaces[o.nproc]
        _, layout = table.table[o.key]
        for k in range(o.count):
            out.append(Replica(o.device_type, place(layout, space.shape_devices(o.device_type, o.shape, k))))
    return out


@dataclass
class ShareSearch:
    """What the share loops of one replica search share: the model, the budget, the best plan so far
    (`best_s` starts at the incumbent) and the rounds spent."""
    sim: Any
    meta: Any
    cluster: Any
    schedule: str
    global_batch: int
    spaces: Dict[int, HeteroSpace]
    table: TemplateTable
    deadline: float
    max_rounds: int
    time_limit: str   # what the deadline is, as a note names it
    best_s: float
    best: Optional[tuple] = None
    rounds: int = 0

    def assess(self, options: List[Option], required: Tuple[str, ...] = (),
               placement: Optional[Dict[int, HeteroSpace]] = None) -> str:
        """The integer program's loop over `options`: solve, replace the chosen options' bounds by
        their exact templates' times, assemble and predict every selection whose templates are
        known, cut off the assessed ones; until the bound reaches the best plan (a proof over the
        options) or the rounds or time run out: then what ran out, else ''. `placement`: the spaces
        whose nodes the replicas go on (default: the whole cluster's)."""
        program = ShareProgram(options, self.global_batch, self.best_s, required)
        assessed = set()
        while True:
            if self.rounds >= self.max_rounds:
                return f"planner.hetero_max_rounds={self.max_rounds}"
            if time.perf_counter() > self.deadline:
                return self.time_limit
            solution = program.solve()
            if solution is None:
                return ""
            bound, chosen = solution
            if bound >= self.best_s:
                return ""
            unrefined = {options[i].key for i in chosen} - set(self.table.table)
            for key in unrefined:   # bounds in the solution: replace them by the exact templates' times
                program.set_time(key, self.table.lower_bound_s(key))
            selection = tuple(chosen)
            if selection not in assessed and all(self.table.table[options[i].key][1] is not None for i in chosen):
                # every selection whose templates are known is a plan: assess it at once, so that a
                # good incumbent exists early even where the budget ends the proof
                assessed.add(selection)
                self.rounds += 1
                replicas = replicas_of([options[i] for i in chosen], placement or self.spaces, self.table)
                # the faster of both optimizers: the program's bound is below either's step
                plan, predicted = hetero_plan(self.meta, self.cluster, replicas, self.schedule, {}, sim=self.sim,
                                              optimizers=BOTH_OPTIMIZERS)
                if predicted["feasible"] and predicted["step_time_s"] < self.best_s:
                    self.best_s, self.best = predicted["step_time_s"], (plan, predicted, replicas)
                    program.h.changeColBounds(program.z, 0.0, self.best_s)
            if not unrefined:   # the bound was exact for this selection: it is assessed, cut it off
                program.cut(chosen)
