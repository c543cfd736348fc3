"""The heterogeneous-replica space: a plan is a set of data-parallel replicas (HSPMD-style
`Plan.pipelines`), each on its own devices with its own template and share of the global batch.

A replica takes equal slices of one node (a divisor of nproc-per-node) or whole nodes, all of one
device type, so the job still launches one nproc-per-node: nodes with fewer devices than that
nproc stay out of the launch, and nodes a plan leaves out are idle (not launched on a preset,
`unused_ranks` on a probed cluster, which launches every worker). A replica's template is
everything the exact planner chooses for one data-parallel replica (dp 1): stage count, layer
split, tp, micro-batch size and count, recomputation -- searched by `search_exact` itself on
the replica's devices (ReplicaSpace).

Heterogeneous plans run on hrlplan's own executor (hrlplan.runtime.hetero), which offers gpipe and
1f1b, and whose GPT-2 replicas hold a block at one tp degree (`same_tp_required`: resumable).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hrlplan.cost.model import Layout
from hrlplan.cost.plans import predict_any_plan
from hrlplan.cost.replica_sync import REPLICATED, SHARDED
from hrlplan.cost.replica_sync_cost import replica_own_step_s
from hrlplan.errors import UserError
from hrlplan.plan import HETERO_SCHEDULES, Plan
from hrlplan.plan.checks import HETERO_SEQUENCE_PARALLEL
from hrlplan.search.common import Scored, Tracker
from hrlplan.search.exact import search_exact
from hrlplan.search.hetero_single import SINGLE_TEMPLATE, single_template_search
from hrlplan.search.space import Pool, SearchSpace, _divisors, _plain, launch_of_devices
from hrlplan.families import family_of_meta

MODES = ("auto", "true", "false")


def hetero_mode(planner_cfg: Dict[str, Any]) -> str:
    """planner.heterogeneous: auto | true | false (booleans accepted)."""
    raw = planner_cfg.get("heterogeneous", "auto")
    value = str(raw).lower() if not isinstance(raw, bool) else ("true" if raw else "false")
    if value not in MODES:
        raise UserError(f"planner.heterogeneous={raw!r} is not one of auto, true, false")
    return value


def wants_hetero(planner_cfg: Dict[str, Any], cluster) -> bool:
    """auto: on where a single template cannot use the cluster evenly -- several device types or
    nodes of different sizes."""
    mode = hetero_mode(planner_cfg)
    if mode != "auto":
        return mode == "true"
    return len(set(cluster.device_types())) > 1 or len(set(cluster.node_sizes())) > 1


def why_not_hetero(train_cfg) -> str:
    """'' when the run's settings allow heterogeneous replicas, else the reason."""
    if str(train_cfg.schedule) not in HETERO_SCHEDULES:
        return (f"train.schedule={train_cfg.schedule}: heterogeneous replicas run on hrlplan's executor, which offers "
                f"{' and '.join(HETERO_SCHEDULES)}")
    if int(train_cfg.stages_per_rank or 1) != 1:
        return "train.stages_per_rank > 1: heterogeneous replicas hold one stage per rank"
    if train_cfg.microbatches not in (None, "auto"):
        return "train.microbatches is fixed: replica shares need their own micro-batch counts"
    return ""


def same_tp_required(meta) -> bool:
    """GPT-2 replicas holding a block at different tp degrees train (runtime/hetero_sync.py maps their
    gradients through Hugging Face's layout) but cannot resume: a checkpoint keeps each block in one
    replica's layout. The planner keeps them at one tp, so every plan it writes can be resumed."""
    return family_of_meta(meta).tp_layout_per_degree


class OutOfTime(Exception):
    pass


class TimedSimulator:
    """A simulator whose evaluations stop at a deadline: past it, `evaluate` raises OutOfTime, so a
    search ends at once; the layouts it did simulate are kept (`tracker`) -- search_exact_until
    returns their best. Everything else is the wrapped simulator's."""

    def __init__(self, sim, deadline: float):
        self._sim, self.deadline, self.tracker = sim, deadline, Tracker()

    def __getattr__(self, name):
        return getattr(self._sim, name)

    @property
    def evaluations(self) -> int:
        return self._sim.evaluations

    @evaluations.setter
    def evaluations(self, value: int) -> None:
        self._sim.evaluations = value

    def evaluate(self, layout, detail: bool = False, contention=None):
        if time.perf_counter() > self.deadline:
            raise OutOfTime()
        result = self._sim.evaluate(layout, detail=detail, contention=contention)
        self.tracker.offer(Scored(layout, result))
        return result


def single_template_of(sim) -> Optional[Scored]:
    """The best single-template layout single_template_search found with this simulator, or None
    (the replica search anchors replica plans on it where make_plan does not hand it over itself)."""
    tracker = SINGLE_TEMPLATE.get(sim)
    return tracker.best if tracker is not None else None


def search_exact_until(sim, space, cfg: Dict[str, Any], deadline: float, budget_key: str) -> Dict[str, Any]:
    """A replica template's search_exact stopped at `deadline` (a 1024-GPU template search runs to
    its 20k simulations at ~0.1 s each): then the best layout simulated so far, not proven, the note
    naming `budget_key`. A whole-cluster space -- the single template -- is searched by work, not
    until the deadline (single_template_search, hetero_single.py): the same template at any load,
    so that a reference search with the same settings finds the planner's own candidate."""
    if not isinstance(space, ReplicaSpace):
        return single_template_search(sim, space, cfg)
    t0 = time.perf_counter()
    timed = TimedSimulator(sim, deadline)
    own = space.sim
    space.sim = timed
    # the deadline as branch and bound's own clock too: its split enumeration can run for a minute
    # between two simulations without finding a split below the incumbent (llama-70b on 9 L40S
    # nodes: 76 s), where only search_exact's threshold sees the time
    own_limit = float(cfg.get("max_search_s") or float("inf"))
    cfg = dict(cfg, max_search_s=max(1e-3, min(own_limit, deadline - t0)))
    try:
        out = search_exact(timed, space, cfg)
        if not out["proven_optimal"] and time.perf_counter() > deadline:
            out = _out_of_time(timed, sim, t0, budget_key)
    except OutOfTime:
        out = _out_of_time(timed, sim, t0, budget_key)
    finally:
        space.sim = own
    return out


def _out_of_time(timed: TimedSimulator, sim, t0: float, budget_key: str) -> Dict[str, Any]:
    return {"tracker": timed.tracker, "evaluations": sim.evaluations, "proven_optimal": False,
            "out_of_time": True, "time_s": time.perf_counter() - t0,
            "note": f"gave up at {budget_key}; the best of the {len(timed.tracker.history)} feasible layouts "
                    "simulated, not proven optimal"}


@dataclass(frozen=True, order=True)
class Shape:
    """A replica's devices: `per_node` devices (a divisor of nproc-per-node) on each of `nodes` nodes
    of one type. (nproc, j) is j whole nodes, (q, 1) a slice of one node; (q, j) with q < nproc and
    j > 1 is a slice across nodes -- the nproc/q replicas of a node group then hold each stage on the
    same nodes, so their gradient all-reduce stays inside a node, as a single template's dp peers do."""
    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes

    def label(self, nproc: int) -> str:
        if self.nodes == 1:
            return f"{self.per_node}"
        return f"{self.size}" if self.per_node == nproc else f"{self.size} ({self.per_node}/node)"


class HeteroSpace:
    """Device types, their launchable nodes under one nproc-per-node, and the replica shapes."""

    def __init__(self, cluster, nproc: int, max_node_multiples: int = 12, nodes: Optional[Sequence[int]] = None):
        """`nodes`: only these nodes (the ones a single template leaves idle: hetero_anchor.py)."""
        self.cluster, self.nproc = cluster, nproc
        by_node: Dict[int, List[int]] = {}
        for d in sorted(cluster.devices, key=lambda d: (d.node, d.local_rank)):
            by_node.setdefault(d.node, []).append(d.rank)
        self.node_devices = {n: ds[:nproc] for n, ds in by_node.items()
                             if len(ds) >= nproc and (nodes is None or n in set(nodes))}
        self.type_nodes: Dict[str, List[int]] = {}
        for n in sorted(self.node_devices):
            self.type_nodes.setdefault(cluster.devices[self.node_devices[n][0]].name, []).append(n)
        self.max_node_multiples = max_node_multiples

    @property
    def types(self) -> List[str]:
        return sorted(self.type_nodes)

    def launchable_devices(self) -> int:
        return sum(len(v) for v in self.node_devices.values())

    def _node_multiples(self, device_type: str) -> List[int]:
        nodes = len(self.type_nodes[device_type])
        if nodes > self.max_node_multiples:
            return sorted({2 ** i for i in range(1, nodes.bit_length()) if 2 ** i <= nodes} | {nodes})
        return list(range(2, nodes + 1))

    def replica_shapes(self, device_type: str, sliced: bool = True) -> List[Shape]:
        """Slices of a node, whole-node multiples (every count on small types; powers of two and the
        full count beyond max_node_multiples), then with `sliced` the same node counts at a slice of
        each node (the replicas of a node group side by side on its nodes)."""
        shapes = [Shape(q, 1) for q in _divisors(self.nproc)]
        multiples = self._node_multiples(device_type)
        shapes += [Shape(self.nproc, j) for j in multiples]
        if sliced:
            shapes += [Shape(q, j) for j in multiples for q in reversed(_divisors(self.nproc)[:-1])]
        return shapes

    def replica_sizes(self, device_type: str) -> List[int]:
        """The sizes of the node slices and whole-node multiples (replica_shapes without sliced ones)."""
        return [s.size for s in self.replica_shapes(device_type, sliced=False)]

    def shape_of(self, size: int) -> Shape:
        return Shape(size, 1) if size <= self.nproc else Shape(self.nproc, size // self.nproc)

    def shape_counts(self, device_type: str, shape: Shape) -> List[int]:
        """How many replicas of `shape` fill whole nodes of the type (1..all its nodes)."""
        nodes = len(self.type_nodes[device_type])
        if shape.nodes == 1:
            return [used * self.nproc // shape.per_node for used in range(1, nodes + 1)
                    if (used * self.nproc) % shape.per_node == 0]
        return [groups * self.nproc // shape.per_node for groups in range(1, nodes // shape.nodes + 1)]

    def replica_counts(self, device_type: str, size: int) -> List[int]:
        return self.shape_counts(device_type, self.shape_of(size))

    def shape_devices(self, device_type: str, shape: Shape, index: int) -> Tuple[int, ...]:
        """The devices of the type's index-th replica of `shape`: node group index // (nproc/q), slice
        index % (nproc/q) of each of its nodes; node order, then local rank."""
        nodes = self.type_nodes[device_type]
        if shape.nodes == 1 or shape.per_node == self.nproc:   # consecutive devices in node order
            flat = [d for n in nodes for d in self.node_devices[n]]
            return tuple(flat[index * shape.size:(index + 1) * shape.size])
        side = self.nproc // shape.per_node
        group, part = divmod(index, side)
        lo = part * shape.per_node
        return tuple(d for n in nodes[group * shape.nodes:(group + 1) * shape.nodes]
                     for d in self.node_devices[n][lo:lo + shape.per_node])

    def replica_devices(self, device_type: str, size: int, index: int) -> Tuple[int, ...]:
        return self.shape_devices(device_type, self.shape_of(size), index)

    def shape_pool(self, device_type: str, shape: Shape) -> Pool:
        """The first replica's pool: its nodes, `per_node` devices on each (the first ones)."""
        nodes = self.type_nodes[device_type]
        return Pool(tuple(nodes[:shape.nodes]), shape.per_node, f"{shape.label(self.nproc)} of {device_type}")

    def first_replica_pool(self, device_type: str, size: int) -> Pool:
        return self.shape_pool(device_type, self.shape_of(size))


class ReplicaSpace(SearchSpace):
    """The exact planner's space restricted to one replica: one pool, dp 1, optionally one tp."""

    def __init__(self, meta, cluster, planner_cfg, train_cfg, pool: Pool, tp: Optional[int] = None):
        self._replica_pool, self._fixed_tp = pool, tp
        super().__init__(meta, cluster, planner_cfg, train_cfg)
        # whether the heterogeneous executor (runtime/hetero.py) runs sequence parallelism in a replica
        # of one tp > 1 (the replica space's layouts keep one tp): the plan checks' one fact
        self.allow_sequence_parallel = HETERO_SEQUENCE_PARALLEL

    def _pools(self) -> List[Pool]:
        return [self._replica_pool]

    def parallel_degrees(self, pool: Pool):
        for pp, tp, dp in super().parallel_degrees(pool):
            if dp == 1 and (self._fixed_tp is None or tp == self._fixed_tp):
                yield pp, tp, dp


@dataclass
class Replica:
    """One replica as placed: its devices (pipeline order) and its dp-1 layout on them."""
    device_type: str
    layout: Layout

    @property
    def rows(self) -> int:
        return self.layout.microbatch_size * self.layout.num_microbatches

    @property
    def devices(self) -> List[int]:
        return [d for g in self.layout.groups for d in g]


def place(layout: Layout, devices: Sequence[int]) -> Layout:
    """A replica's layout moved onto other devices of the same shape (same order of slots)."""
    old = [d for g in layout.groups for d in g]
    move = dict(zip(old, devices))
    return dataclasses.replace(layout, groups=tuple(tuple(move[d] for d in g) for g in layout.groups))


BOTH_OPTIMIZERS = (REPLICATED, SHARDED)


def sharding_saves_at_most_s(sim, layout: Layout, result=None) -> float:
    """The most the sharded optimizer can take off a replica's own step (cost/plans.py: a sharded plan's
    step is never under each replica's step less its optimizer plus what its ranks step, and a rank
    steps at least the optimizer's per-call cost): its optimizer step less that per-call cost. A
    replica plan's step is never under its slowest replica's own step less this, under either
    optimizer -- the lower bound the replica searches prune by. `result`: the layout's detailed
    simulation where the caller has it (else one simulator call)."""
    if result is None or not result.breakdown:
        result = sim.evaluate(layout, detail=True)
    if not result.feasible:
        return 0.0
    fixed = sim.devices.overheads.optimizer_fixed(1, layout.tp) * sim.devices.time_scale
    # and what its homogeneous step pays that the heterogeneous executor does not run (the tied
    # embedding's all-reduce, cost/replica_sync_cost.replica_own_step_s): cost/plans.py bounds by that
    return max(0.0, float(result.breakdown.get("optimizer_s", 0.0)) - fixed) \
        + result.step_time_s - replica_own_step_s(result)


def hetero_plan(meta, cluster, replicas: List[Replica], schedule: str, planner_meta: Dict[str, Any],
                sim=None, optimizers: Optional[Sequence[str]] = None) -> Tuple[Plan, Dict[str, Any]]:
    """The validated Plan (pipelines, launch, unused ranks, prediction) of a set of replicas and the
    simulator's prediction for it (predict_any_plan: every replica at dp 1, the cross-replica reduce).
    `optimizers`: the faster of these (plan.meta's replica_optimizer: every replica steps its whole
    model, or the replicas shard the step -- cost/replica_sync.py; the sharded one's all-gather after
    the step is exposed, so either may win; BOTH_OPTIMIZERS tries the two); None: the cost model's
    default, no key in the plan."""
    used = sorted(d for r in replicas for d in r.devices)
    live = cluster.source in ("probe", "file")
    launch, rank_of = launch_of_devices(cluster, range(cluster.world_size) if live else used)
    pipelines = []
    for r in replicas:
        lay = r.layout
        last = len(lay.spans) - 1
        stages = [{"layers": list(span), "ranks": [rank_of[d] for d in lay.groups[k]], "tp": lay.tp_of(k), "dp": 1,
                   "embedding": k == 0, "head": k == last, "recompute": lay.recompute_of(k)}
                  for k, span in enumerate(lay.spans)]
        for k, st in enumerate(stages):
            if lay.sequence_parallel and lay.tp_of(k) > 1:
                st["sequence_parallel"] = True
        pipelines.append({"stages": stages, "num_microbatches": lay.num_microbatches, "batch_size": r.rows})
    unused = sorted(rank_of[d] for d in rank_of if d not in set(used))
    best = None
    for mode in (optimizers[:1 if len(replicas) == 1 else None] if optimizers else [None]):
        meta_out = {"launch": launch, "planner": _plain(planner_meta), "cluster": cluster.name,
                    "device_types_per_pipeline": [r.device_type for r in replicas]}
        if mode is not None:
            meta_out["replica_optimizer"] = mode
        plan = Plan.from_dict({"model": meta.name, "n_layer": meta.n_layer, "world_size": len(rank_of),
                               "global_batch_size": sum(r.rows for r in replicas), "schedule": schedule,
                               "pipelines": pipelines, "unused_ranks": unused, "meta": meta_out},
                              source="heterogeneous planner")
        predicted = predict_any_plan(plan, meta, cluster, sim=sim)
        key = (not predicted["feasible"], predicted["step_time_s"])
        if best is None or key < best[0]:
            best = (key, plan, predicted)
    _, plan, predicted = best
    plan.meta["predicted"] = _plain({"step_time_s": predicted["step_time_s"],
                                     "bubble_fraction": predicted["bubble_fraction"],
                                     "memory_bytes_per_rank": predicted["memory_bytes_per_rank"],
                                     "breakdown": predicted["breakdown"]})
    return plan, predicted


def hetero_summary(replicas: List[Replica]) -> str:
    """'8xA100: 2 x [pp2 tp4, 4 micro-batches of 2] + 8xV100: ...' -- replicas grouped by type and shape."""
    groups: Dict[tuple, int] = {}
    for r in replicas:
        lay = r.layout
        key = (r.device_type, len(r.devices), lay.pp, lay.tp, lay.microbatch_size, lay.num_microbatches)
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{n} x {t} replica of {size} (pp{pp} tp{tp}, {m} micro-batches of {mb})"
             for (t, size, pp, tp, mb, m), n in groups.items()]
    return " + ".join(parts)
