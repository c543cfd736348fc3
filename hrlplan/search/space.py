"""The search space shared by every planner: device pools, device-group orders, (pp, tp, dp),
micro-batching -- and turning a chosen Layout into a validated, launchable Plan.

Launch rule: torchrun starts the same --nproc-per-node on every node, so a plan uses whole nodes
(or the same number of devices on each node) and a pipeline group is either a slice of one node
or a set of whole nodes. Tensor parallelism never crosses a node.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from hrlplan import schedules
from hrlplan.config import TrainConfig, section
from hrlplan.cost.context_parallel import context_parallel_degrees
from hrlplan.cost.model import Layout
from hrlplan.errors import UserError
from hrlplan.plan import RECOMPUTE_MODES, Plan, homogeneous_plan
from hrlplan.plan.checks import sequence_parallel_divides
from hrlplan.search.placement import place_on_ranks
from hrlplan.cluster import node_bandwidth, node_orders
from hrlplan.search.splits import in_flight

MAX_TYPE_ORDERS = 24


@dataclass(frozen=True)
class Pool:
    """The devices a plan may use: whole nodes, `nproc` devices each, in node order."""
    nodes: Tuple[int, ...]
    nproc: int
    label: str

    def size(self) -> int:
        return len(self.nodes) * self.nproc


@dataclass(frozen=True)
class Config:
    """Everything but the layer split: the high-level decision."""
    pool: Pool
    type_order: Tuple[str, ...]
    pp: int
    tp: int
    dp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    stages_per_rank: int
    # Nodes in pipeline order when the order follows the links, not the types (() = by type, then
    # node number): see SearchSpace.orders.
    node_order: Tuple[int, ...] = ()
    # FSDP2's reshard_after_forward (SearchSpace.reshard_options: searched where it can save memory)
    reshard_after_forward: bool = False
    # context parallelism: each group holds tp * dp * cp devices (SearchSpace.degrees_with_cp)
    cp: int = 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank


class SearchSpace:
    def __init__(self, meta, cluster, planner_cfg: Dict[str, Any], train_cfg: TrainConfig):
        train_cfg = section(TrainConfig, train_cfg)   # typed, or a script's plain mapping
        self.meta, self.cluster = meta, cluster
        self.cfg, self.train = planner_cfg, train_cfg
        self.node_devices: Dict[int, List[int]] = {}
        for d in sorted(cluster.devices, key=lambda d: (d.node, d.local_rank)):
            self.node_devices.setdefault(d.node, []).append(d.rank)
        self.node_type = {n: cluster.devices[ds[0]].name for n, ds in self.node_devices.items()}
        self.stages_per_rank = int(train_cfg.stages_per_rank or 1)
        # registry names (an alias resolved by the configured stages per rank), in the order given
        named = list(planner_cfg.get("schedules") or []) or [str(train_cfg.schedule)]
        self.schedules = list(dict.fromkeys(schedules.get(s, self.stages_per_rank).name for s in named))
        self.global_batch = int(train_cfg.global_batch_size)
        mbs = train_cfg.microbatches
        self.fixed_microbatches = None if mbs in (None, "auto") else int(mbs)
        self.recompute_modes = recompute_modes(planner_cfg)
        self._chains: Optional[Tuple[List[List[int]], List[List[float]]]] = None
        self.sim = None   # make_plan binds the simulator: layouts then pick each stage's recomputation
        self.allow_sequence_parallel = True
        self.pools = self._pools()

    # ------------------------------------------------------------ pools and orders
    def _pools(self) -> List[Pool]:
        sizes = {len(v) for v in self.node_devices.values()}
        nodes = tuple(sorted(self.node_devices))
        must_launch_all = self.cluster.source in ("probe", "file")
        if len(sizes) != 1 and must_launch_all:
            raise ValueError(f"cluster '{self.cluster.name}' has nodes with {sorted(sizes)} workers; a probed "
                             "job launches the same nproc-per-node everywhere, so every node must have the same count")
        nproc = min(sizes)
        pools = [Pool(nodes, nproc, "all")]
        types = sorted(set(self.node_type.values()))
        if not must_launch_all and len(types) > 1:  # presets: leaving a slow type out may win
            for t in types:
                sub = tuple(n for n in nodes if self.node_type[n] == t)
                pools.append(Pool(sub, nproc, f"only {t}"))
        if must_launch_all and self.cfg.get("allow_idle_ranks", True):
            # A probed job launches every worker, but fewer may train faster (shared cores, slow
            # links): the first k workers of every node, or every worker of the first j nodes;
            # the rest stay idle (the plan's unused_ranks).
            for k in _divisors(nproc)[:-1]:
                pools.append(Pool(nodes, k, f"{k} of {nproc} per node"))
            for j in _divisors(len(nodes))[:-1]:
                pools.append(Pool(nodes[:j], nproc, f"{j} of {len(nodes)} nodes"))
        return pools

    def type_orders(self, pool: Pool) -> List[Tuple[str, ...]]:
        types = sorted({self.node_type[n] for n in pool.nodes})
        return list(itertools.islice(itertools.permutations(types), MAX_TYPE_ORDERS))

    def orders(self, pool: Pool) -> List[Tuple[Tuple[str, ...], Tuple[int, ...]]]:
        """(type order, node order) pairs to lay the pool out in: every type order (node order within
        a type), then, on a probed cluster of more than two nodes with a measured bandwidth matrix,
        hrlplan.cluster.node_orders limited to the pool's nodes -- chains along the fastest links, so
        that a pipeline keeps its boundaries (and a multi-node group its members) off a slow link.
        A chain is added only where its links beat every type order's (uniform links add none)."""
        out = [(t, ()) for t in self.type_orders(pool)]
        if len(pool.nodes) <= 2 or not self._link_aware():
            return out

        if self._chains is None:   # up to 8! permutations: once per space, not per pool
            self._chains = node_orders(self.cluster), node_bandwidth(self.cluster)
        chains, bw = self._chains

        def score(nodes):   # node_orders' own: the slowest hop, then the sum of the hops
            hops = [bw[a][b] for a, b in zip(nodes, nodes[1:])]
            return min(hops), sum(hops)

        seen = {tuple(self._node_sequence(pool, t)) for t, _ in out}
        best = max(score(n) for n in seen)
        for order in chains:
            nodes = tuple(n for n in order if n in pool.nodes)
            if nodes not in seen and score(nodes) > best:
                seen.add(nodes)
                out.append((tuple(dict.fromkeys(self.node_type[n] for n in nodes)), nodes))
        return out

    def _link_aware(self) -> bool:
        return self.cluster.source in ("probe", "file") and bool(self.cluster.bandwidth) \
            and len(self.node_devices) > 2

    def _node_sequence(self, pool: Pool, type_order: Sequence[str], node_order: Sequence[int] = ()) -> List[int]:
        if node_order:
            return list(node_order)
        rank = {t: i for i, t in enumerate(type_order)}
        return sorted(pool.nodes, key=lambda n: (rank[self.node_type[n]], n))

    def ordered_devices(self, pool: Pool, type_order: Sequence[str], node_order: Sequence[int] = ()) -> List[int]:
        """Pool devices in pipeline order: the node order if given, else node types in type order
        and nodes in their order within a type (so neighbouring groups share nodes and fast links)."""
        return [d for n in self._node_sequence(pool, type_order, node_order) for d in self.node_devices[n][:pool.nproc]]

    # ------------------------------------------------------------ structural choices
    def parallel_degrees(self, pool: Pool) -> Iterator[Tuple[int, int, int]]:
        n = pool.size()
        max_pp = int(self.cfg.get("max_pp", 64))
        max_tp = int(self.cfg.get("max_tp", 8))
        for pp in range(1, min(max_pp, n) + 1):
            if n % pp or pp * self.stages_per_rank > self.meta.n_layer:
                continue
            group = n // pp
            if not (group % pool.nproc == 0 or pool.nproc % group == 0):
                continue  # a group must be a slice of one node or whole nodes
            for tp in range(1, min(max_tp, pool.nproc, group) + 1):
                if group % tp or pool.nproc % tp or (tp > 1 and self.meta.num_heads % tp):
                    continue
                yield pp, tp, group // tp

    def context_parallel_degrees(self, pool: Pool, tp: int, group: int) -> List[int]:
        """cp degrees of a layout with `group` devices per position at tp: train.context_parallel, or
        with planner.max_cp > 1 every degree up to it that runs (cost.context_parallel_degrees)."""
        kinds = sorted({self.cluster.devices[d].kind for n in pool.nodes for d in self.node_devices[n][:pool.nproc]})
        requested, max_cp = int(self.train.context_parallel or 1), int(self.cfg.get("max_cp", 1))
        return [cp for cp in context_parallel_degrees(self.meta.seq_len, group, tp, kinds, requested, search=max_cp > 1)
                if cp <= max(max_cp, requested)]

    def degrees_with_cp(self, pool: Pool) -> Iterator[Tuple[int, int, int, int]]:
        """(pp, tp, dp, cp): parallel_degrees' groups of tp * dp devices split into dp * cp."""
        for pp, tp, dp in self.parallel_degrees(pool):
            for cp in self.context_parallel_degrees(pool, tp, tp * dp):
                yield pp, tp, dp // cp, cp

    def microbatchings(self, pp: int, dp: int, schedule: str, stages_per_rank: int = 1) -> List[Tuple[int, int]]:
        if self.global_batch % dp:
            return []
        per_replica = self.global_batch // dp
        if self.fixed_microbatches is not None:
            m = self.fixed_microbatches
            options = [(per_replica // m, m)] if per_replica % m == 0 else []
        else:
            divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
            wanted = [int(x) for x in self.cfg.get("microbatch_sizes") or []]
            sizes = [d for d in divisors if d in wanted] or divisors
            options = [(mb, per_replica // mb) for mb in sizes]
        spec = schedules.SCHEDULES[schedule]
        return [(mb, m) for mb, m in options
                if not (pp > 1 and m < pp) and spec.microbatch_refusal(pp, m, stages_per_rank) is None]

    def stages_per_rank_of(self, schedule: str, pp: int) -> int:
        """A looped multi-stage schedule's configured stages per rank, a V schedule's 2, else 1;
        without a pipeline, 1 wherever the schedule takes it."""
        spec = schedules.SCHEDULES[schedule]
        if pp == 1 and spec.takes(1):
            return 1
        return spec.stages_per_rank_for(self.stages_per_rank)

    def configs(self) -> Iterator[Config]:
        for pool in self.pools:
            for order, node_order in self.orders(pool):
                for pp, tp, dp, cp in self.degrees_with_cp(pool):
                    for schedule in self.schedules:
                        v = self.stages_per_rank_of(schedule, pp)
                        if v * pp > self.meta.n_layer:
                            continue
                        for mb, m in self.microbatchings(pp, dp, schedule, v):
                            for reshard in self.reshard_options(pp, dp * cp):   # FSDP shards over dp * cp
                                yield Config(pool, order, pp, tp, dp, mb, m, schedule, v, node_order, reshard, cp)

    def reshard_options(self, pp: int, dp: int) -> Tuple[bool, ...]:
        """FSDP2's reshard_after_forward, both ways for FSDP over dp > 1 without pipelining (where
        torchtitan reshards by default); under pipelining kept gathered, torchtitan's choice: a
        stage runs a forward per micro-batch and would all-gather its weights again for each."""
        if pp == 1 and dp > 1 and str(self.train.dp_mode) == "fsdp":
            return (False, True)
        return (False,)

    def sequence_parallel(self, c: Config) -> bool:
        """Sequence parallelism on every tp > 1 layout whose sequence it shards evenly, not searched: it
        moves the same bytes as the all-reduces it replaces (an all-gather and a reduce-scatter each)
        and holds less activation memory, so no layout is faster or smaller without it
        (cost.model.StageCostModel.stage). Where tp (x cp) does not divide the sequence the runtimes
        refuse it (plan/checks.sequence_parallel_divides): such a layout is planned and priced without.
        The replica search's space (hrlplan's own executor) follows plan/checks.HETERO_SEQUENCE_PARALLEL."""
        return self.allow_sequence_parallel and c.tp > 1 \
            and sequence_parallel_divides(int(self.meta.seq_len or 0), c.tp, c.cp)

    def groups(self, c: Config) -> Tuple[Tuple[int, ...], ...]:
        devs = self.ordered_devices(c.pool, c.type_order, c.node_order)
        size = c.tp * c.dp * c.cp
        return tuple(tuple(devs[g * size:(g + 1) * size]) for g in range(c.pp))

    def layout(self, c: Config, spans: Sequence[Tuple[int, int]],
               recompute: Optional[Sequence[str]] = None) -> Layout:
        spans = tuple((int(a), int(b)) for a, b in spans)
        groups = self.groups(c)
        if recompute is None:
            recompute = self.choose_recompute(c, spans, groups)
        return Layout(spans=spans, groups=groups, tp=c.tp, dp=c.dp, microbatch_size=c.microbatch_size,
                      num_microbatches=c.num_microbatches, schedule=c.schedule, stages_per_rank=c.stages_per_rank,
                      recompute=tuple(recompute) if any(m != "none" for m in recompute) else (),
                      sequence_parallel=self.sequence_parallel(c), reshard_after_forward=c.reshard_after_forward,
                      cp=c.cp)

    def choose_recompute(self, c: Config, spans, groups) -> Tuple[str, ...]:
        """Each stage's cheapest recomputation mode whose memory fits (none, selective, full: each
        only adds backward time) among planner.recompute's; SplitTables applies the same rule."""
        modes = self.recompute_modes
        if self.sim is None or modes == ("none",):
            return (modes[0],) * len(spans)

        sim, n = self.sim, len(spans)
        flight = in_flight(c.schedule, c.pp, c.stages_per_rank, c.num_microbatches)
        out = []
        for k, (a, b) in enumerate(spans):
            g = groups[schedules.SCHEDULES[c.schedule].stage_rank(k, c.pp, c.stages_per_rank)]
            limit = min(sim.devices.memory_limit(d, sim.opts.memory_margin) for d in g)
            chosen = modes[-1]
            for mode in modes:
                cost = sim.costs.stage(a, b, k == 0, k == n - 1, g, c.tp, c.dp, c.microbatch_size, c.pp,
                                       links=sim.links(g, c.tp, c.dp), recompute=mode,
                                       microbatches=c.num_microbatches, **self.stage_options(c))
                if cost.static_memory + flight[k] * cost.activation <= limit:
                    chosen = mode
                    break
            out.append(chosen)
        return tuple(out)


    def stage_options(self, c: Config) -> Dict[str, bool]:
        """The layout-wide options StageCostModel.stage takes beside recompute, for configuration c."""
        return {"sequence_parallel": self.sequence_parallel(c), "reshard_after_forward": c.reshard_after_forward}


def recompute_modes(planner_cfg: Dict[str, Any]) -> Tuple[str, ...]:
    """planner.recompute: auto searches none/selective/full per stage (selective: op-level SAC);
    a mode restricts to it."""
    value = str(planner_cfg.get("recompute", "auto"))
    if value == "auto":
        return RECOMPUTE_MODES
    if value not in RECOMPUTE_MODES:
        raise UserError(f"planner.recompute={value} is not one of auto, {', '.join(RECOMPUTE_MODES)}")
    return (value,)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------- Layout -> Plan
def launch_for(cluster, layout: Layout) -> Tuple[Dict[str, Any], Dict[int, int]]:
    """meta.launch (uniform nproc-per-node) and the map cluster device -> plan rank.

    Plan ranks follow torchrun's order: node_rank-major, then local rank over the node's visible
    devices. Nodes the plan leaves out are not launched at all.
    """
    return launch_of_devices(cluster, sorted({d for g in layout.groups for d in g}))


def launch_of_devices(cluster, used: Sequence[int]) -> Tuple[Dict[str, Any], Dict[int, int]]:
    by_node: Dict[int, List[int]] = {}
    for d in used:
        by_node.setdefault(cluster.devices[d].node, []).append(d)
    counts = {len(v) for v in by_node.values()}
    if len(counts) != 1:
        raise ValueError(f"layout uses {sorted(counts)} devices on different nodes; not launchable uniformly")
    nproc = counts.pop()
    rank_of: Dict[int, int] = {}
    visible, hosts = [], []
    for node in sorted(by_node):
        devs = sorted(by_node[node], key=lambda d: cluster.devices[d].local_rank)
        visible.append(",".join(str(cluster.devices[d].local_rank) for d in devs))
        hosts.append(cluster.devices[devs[0]].hostname)
        for d in devs:
            rank_of[d] = len(rank_of)
    launch = {"nnodes": len(by_node), "nproc_per_node": nproc, "per_node_visible_devices": visible,
              "hosts": hosts, "rank_to_device": [d for d, _ in sorted(rank_of.items(), key=lambda x: x[1])]}
    return launch, rank_of


def to_plan(meta, cluster, layout: Layout, result, planner_meta: Dict[str, Any]) -> Plan:
    """The plan of a layout. On a probed cluster the job launches every worker: a layout on fewer
    devices becomes a plan on the job's ranks with the others in unused_ranks."""
    plan, rank_of = _compact_plan(meta, cluster, layout, result, planner_meta)
    if cluster.source not in ("probe", "file") or len(rank_of) == cluster.world_size:
        return plan
    job_launch, job_rank = launch_of_devices(cluster, range(len(cluster.devices)))
    used = sorted(rank_of, key=rank_of.get)       # devices in compact-rank order
    return place_on_ranks(plan, [job_rank[d] for d in used], cluster.world_size, job_launch)


def _compact_plan(meta, cluster, layout: Layout, result, planner_meta: Dict[str, Any]):
    launch, rank_of = launch_for(cluster, layout)
    rank_order = [rank_of[d] for g in layout.groups for d in g]
    memory = [0.0] * len(rank_of)
    for d, r in rank_of.items():
        memory[r] = float(result.memory_bytes.get(d, 0.0))
    breakdown = {k: v for k, v in result.breakdown.items() if k != "memory_bytes_per_device"}
    predicted = {"step_time_s": float(result.step_time_s), "bubble_fraction": float(result.bubble_fraction),
                 "memory_bytes_per_rank": [int(x) for x in memory], "breakdown": _plain(breakdown)}
    plan_meta = {"launch": launch, "predicted": predicted, "planner": _plain(planner_meta),
                 "cluster": cluster.name, "device_types_per_stage": [cluster.devices[g[0]].name for g in layout.groups]}
    return homogeneous_plan(meta.name, meta.n_layer, list(layout.spans), dp=layout.dp, tp=layout.tp,
                            microbatch_size=layout.microbatch_size, num_microbatches=layout.num_microbatches,
                            schedule=layout.schedule, stages_per_rank=layout.stages_per_rank, meta=plan_meta,
                            rank_order=rank_order, recompute=list(layout.recompute) or None,
                            sequence_parallel=layout.sequence_parallel,
                            reshard_after_forward=_reshard_field(layout), cp=layout.cp), rank_of


def _reshard_field(layout: Layout) -> Optional[bool]:
    """The plan's reshard_after_forward: null where it is the default (or no FSDP over dp > 1 runs),
    else the layout's choice written out."""
    default = len(layout.spans) == 1
    if layout.dp * layout.cp == 1 or layout.reshard_after_forward == default:
        return None
    return layout.reshard_after_forward


def _plain(x: Any) -> Any:
    """YAML-safe: numpy scalars and tuples to Python floats and lists."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        return x.item()
    return x
