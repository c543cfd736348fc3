"""What the cross-replica gradient sync of a heterogeneous plan costs: the buckets runtime/
hetero_sync.py cuts and the collectives it runs for them (cost/replica_sync.py: one fact in one
place), when each starts within the ranks' last backward and when each rank is done."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

from hrlplan.cost.replica_sync import (BUCKET_MB, RankSet, bucket_key, cut_buckets, embedding_unit_params,
                                       node_hierarchy, scatter_in_node, unit_holders, unit_order,
                                       unit_rank_sets)
from hrlplan.cost.simulator import Simulator


def _unit_bytes(meta, bytes_per_value: int = 4) -> Dict[str, float]:
    """Gradient bytes the heterogeneous executor reduces per unit: in the training dtype (runtime/
    hetero_sync.py sends bfloat16 buckets under bfloat16, float32 otherwise). A tied head's weight is
    the embedding's (model_meta counts it there: head_params is then the final norm alone), the
    embedding's units as replica_sync.embedding_unit_params splits them."""
    b = float(bytes_per_value)
    out = {u: p * b for u, p in embedding_unit_params(meta).items()}
    out["final"] = float(meta.head_params) * b
    for i, p in enumerate(meta.block_params):
        out[f"block{i}"] = float(p) * b
    return out


def replica_own_step_s(result) -> float:
    """A replica's own step as the heterogeneous executor runs it, from its homogeneous (dp 1)
    simulation `result`: that step less the small all-reduces after its pipeline (step_collectives_s).
    Those are the homogeneous runtime's -- above all runtime/parallel.py's TiedEmbeddingSync, the whole
    tied embedding gradient in fp32 between the first and the last stage (13.4 ms of gpt2-xl's 219.8 on
    gen3, across nodes at 25 GB/s) -- and the heterogeneous executor runs none of them: it reduces the
    tied unit in its cross-replica buckets (in the training dtype, over every holder, in-node first)
    and the norm and loss over the world, which cost/plans.py prices for the whole plan. The bound a
    replica plan's step never goes under (cost/plans.py) and the replica searches prune by."""
    return result.step_time_s - float(result.breakdown.get("step_collectives_s", 0.0))


class SyncBucket(NamedTuple):
    """One bucket of runtime/hetero_sync.py: its rank set, units (backward order), bytes per member,
    the seconds of its reduce (an all-reduce, in-node first where cost/replica_sync.node_hierarchy says
    so; under the sharded optimizer a flat set's reduce-scatter) and of the sharded optimizer's
    all-gather of the updated slices after the step (0: replicated, or a set of one)."""
    ranks: RankSet
    units: Tuple[str, ...]
    nbytes: float
    seconds: float
    gather_s: float = 0.0


def sync_buckets(plan, meta, sim: Simulator, devices: List[int],
                 cap_bytes: float = BUCKET_MB * 2 ** 20, sharded: bool = False) -> List[SyncBucket]:
    """The cross-replica buckets the runtime cuts for `plan` (devices: plan rank -> cluster device),
    in its global start order: every unit over its rank set, whole units per bucket up to the cap.
    sharded: the sharded optimizer's reduce and gather (cost/replica_sync.replica_optimizer)."""
    pipes = plan.as_pipelines()
    embed = list(embedding_unit_params(meta))   # the runtime's embedding units (adjacent, last in order)
    order = unit_order(plan.n_layer, embed)
    unit_sets, ordered = unit_rank_sets(pipes, unit_holders(pipes, plan.n_layer, embed,
                                                            "embed" if meta.tied_embeddings else None), order)
    value_bytes = sim.opts.bytes_per_value
    sizes = _unit_bytes(meta, value_bytes)
    tp_of = {st_rank: st.tp for pipe in pipes for st in pipe.stages for st_rank in st.ranks}
    by_set: Dict[RankSet, List[_UnitItem]] = {}
    for unit in order:
        for ranks, whole in unit_sets.get(unit, []):
            share = 1 if whole else tp_of[ranks[0]]
            by_set.setdefault(ranks, []).append(_UnitItem(unit, sizes.get(unit, 0.0) / value_bytes / share))
    position = {u: i for i, u in enumerate(order)}
    set_index = {r: i for i, r in enumerate(ordered)}
    node_of = {r: sim.cluster.devices[devices[r]].node for r in range(len(devices))}
    keyed = []
    for ranks, items in by_set.items():
        if len(ranks) < 2:
            continue
        for cut in cut_buckets(items, cap_bytes, value_bytes):
            nbytes = sum(i.numel for i in cut) * value_bytes
            timing = bucket_seconds(sim, devices, node_of, ranks, nbytes, sharded)
            seconds, gather = timing if sharded else (timing, 0.0)
            keyed.append((bucket_key(position, set_index, ranks, cut[0].unit),
                          SyncBucket(ranks, tuple(i.unit for i in cut), nbytes, seconds, gather)))
    return [b for _, b in sorted(keyed, key=lambda kb: kb[0])]


class _UnitItem(NamedTuple):
    unit: str
    numel: float


def bucket_seconds(sim: Simulator, devices, node_of, ranks: RankSet, nbytes: float, sharded: bool = False):
    """A bucket's all-reduce: one ring over its ranks, or in-node first (node all-reduce, the rails'
    all-reduces of 1/rails each across nodes, each rail's part broadcast in its node; where the
    nodes hold a rail each, replica_sync.scatter_in_node, a reduce-scatter and an all-gather in node
    instead of the all-reduce and the broadcasts). sharded: (the
    reduce, the gather after the step) as the sharded optimizer splits them (cost/replica_sync.py):
    a ring's reduce-scatter and all-gather, each half its all-reduce (its first or second half), or
    the in-node-first phases with the broadcasts in node moved after the step."""
    hier = node_hierarchy(ranks, node_of)
    if hier is None:
        ring = _ring_allreduce_s(sim, [devices[r] for r in ranks], nbytes)
        return (ring / 2.0, ring / 2.0) if sharded else ring
    part = nbytes / len(hier.rails)
    in_node = max(_ring_allreduce_s(sim, [devices[r] for r in node], nbytes) for node in hier.nodes)
    across = max(_ring_allreduce_s(sim, [devices[r] for r in rail], part) for rail in hier.rails)
    spread = max(len(hier.rails) * _broadcast_s(sim, [devices[r] for r in node], part) for node in hier.nodes)
    if scatter_in_node(hier):   # the in-node reduce-scatter and all-gather: half the all-reduce each
        # (the sharded optimizer's gathers after the step still broadcast each rail's part: hetero_zero.py)
        return (in_node / 2.0 + across, spread) if sharded else in_node / 2.0 + across + in_node / 2.0
    return (in_node + across, spread) if sharded else in_node + across + spread


def _ring_allreduce_s(sim: Simulator, ring: List[int], nbytes: float) -> float:
    n = len(ring)
    if n < 2:
        return 0.0
    dev = sim.devices
    lat = dev.overheads.allreduce_latency
    bw, ring_lat = dev.ring_bw_lat(ring)
    return dev.overheads.allreduce(n, nbytes, 2.0 * (n - 1) / n * nbytes / bw
                                   + ((n - 1) * lat if lat else 2.0 * (n - 1) * ring_lat))


def _broadcast_s(sim: Simulator, ring: List[int], nbytes: float) -> float:
    """A pipelined broadcast: the bytes once over the slowest hop, the latency down the chain."""
    n = len(ring)
    if n < 2:
        return 0.0
    lat = sim.devices.overheads.allreduce_latency
    bw, ring_lat = sim.devices.ring_bw_lat(ring)
    return nbytes / bw + (lat if lat else (n - 1) * ring_lat)


def unit_done_fraction(meta, layers: Tuple[int, int], first: bool, last: bool) -> Dict[str, float]:
    """Per unit a stage holds: the share of its backward done when that unit's gradient is final
    (post-accumulate-grad hooks): the head's first, then blocks last to first, the embedding input
    at the end (a tied head's copy on a later stage with the head)."""
    head = float(meta.head_flops_fwd_per_token) if last else 0.0
    blocks = [float(meta.block_flops_fwd_per_token[i]) for i in range(*layers)]
    total = head + sum(blocks) or 1.0
    out: Dict[str, float] = {}
    if last:
        out["final"] = head / total
        if not first:
            out["embed"] = head / total
    done = head
    for i, w in zip(reversed(range(*layers)), reversed(blocks)):
        done += w
        out[f"block{i}"] = done / total
    if first:
        out["embed"] = 1.0
    return out


def bucket_launches(plan, meta, buckets: List[SyncBucket], end: Dict[int, float],
                    last_backward: Dict[int, float]) -> Dict[Tuple[int, int], float]:
    """(bucket index, rank) -> when the rank starts that bucket: once its units are final in its
    last backward, and not before the buckets ahead of it in the global order (the runtime starts
    them in order)."""
    done: Dict[int, Dict[str, float]] = {}
    for pipe in plan.as_pipelines():
        n = len(pipe.stages)
        for s, st in enumerate(pipe.stages):
            frac = unit_done_fraction(meta, tuple(st.layers), s == 0, s == n - 1)
            for r in st.ranks:
                done[r] = frac
    launch: Dict[Tuple[int, int], float] = {}
    latest: Dict[int, float] = {}
    for k, b in enumerate(buckets):
        for r in b.ranks:
            ready = end[r] - last_backward[r] * (1.0 - max(done[r].get(u, 1.0) for u in b.units))
            latest[r] = max(latest.get(r, -float("inf")), ready)
            launch[(k, r)] = latest[r]
    return launch


def bucket_times(buckets: List[SyncBucket], launch: Dict[Tuple[int, int], float]) -> Dict[Tuple[int, int], float]:
    """(bucket index, rank) -> when the bucket's collective is done on the rank: it starts once every
    member has started it and finished its earlier buckets (a rank's run in sequence)."""
    cursor: Dict[int, float] = {}
    done: Dict[Tuple[int, int], float] = {}
    for k, b in enumerate(buckets):
        start = max(max(launch[(k, r)], cursor.get(r, -float("inf"))) for r in b.ranks)
        for r in b.ranks:
            cursor[r] = done[(k, r)] = start + b.seconds
    return done


def bucket_finish(buckets: List[SyncBucket], launch: Dict[Tuple[int, int], float],
                  end: Dict[int, float]) -> Dict[int, float]:
    """Per rank, when its pipeline and its buckets are done (bucket_times)."""
    last: Dict[int, float] = {}
    for (_, r), t in bucket_times(buckets, launch).items():
        last[r] = max(last.get(r, -float("inf")), t)
    return {r: max(e, last.get(r, e)) for r, e in end.items()}


def unit_start_fraction(meta, layers: Tuple[int, int], first: bool, last: bool) -> Dict[str, float]:
    """Per unit a stage holds: the share of its forward done when the unit's weights are first used:
    the embedding at the start (a tied head's copy on a later stage with the head), the blocks in
    order, the final norm and head at the end."""
    blocks = [float(meta.block_flops_fwd_per_token[i]) for i in range(*layers)]
    total = (float(meta.head_flops_fwd_per_token) if last else 0.0) + sum(blocks) or 1.0
    out: Dict[str, float] = {"embed": 0.0} if first else {}
    done = 0.0
    for i, w in zip(range(*layers), blocks):
        out[f"block{i}"] = done / total
        done += w
    if last:
        out["final"] = done / total
        out.setdefault("embed", done / total)
    return out


def exposed_gathers(plan, meta, gathers: List[SyncBucket], issued: Dict[int, float], next_step: float,
                    first_forward: Dict[int, Tuple[float, float]]) -> float:
    """How long the sharded optimizer's weight gathers (`gathers`, in the order the runtime issues them:
    the forward's) hold up the next step: each starts once its members have stepped (`issued`), in
    sequence on a rank, and is waited for when the rank's first forward of the next step (starting
    first_forward[r][0] after `next_step`, lasting first_forward[r][1]) first uses one of its units."""
    fraction: Dict[int, Dict[str, float]] = {}
    for pipe in plan.as_pipelines():
        n = len(pipe.stages)
        for s, st in enumerate(pipe.stages):
            frac = unit_start_fraction(meta, tuple(st.layers), s == 0, s == n - 1)
            fraction.update({r: frac for r in st.ranks})
    done = bucket_times(gathers, {(k, r): issued[r] for k, b in enumerate(gathers) for r in b.ranks})
    late = 0.0
    for (k, r), t in done.items():
        start, forward = first_forward[r]
        need = next_step + start + forward * min(fraction[r].get(u, 0.0) for u in gathers[k].units)
        late = max(late, t - need)
    return late
