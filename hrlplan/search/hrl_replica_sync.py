"""The learned replica planner's screening estimate of a proposal's cross-replica gradient sync
(search/hrl_replicas.py), without a simulator call.

It follows the sync the simulator costs (cost/replica_sync.py, cost/replica_sync_cost.py): buckets
of whole units up to BUCKET_MB, each reduced over one holder per replica, in node first where the
holders share nodes (node all-reduce, rails across nodes, broadcast in node), the blocks' buckets
started within the last backward and the embedding's bucket (final only at its end) exposed after it.
Roughly, per proposal (each replica's configuration the low level's best-estimated one):

- the busiest member is a replica's of the fewest stages: its blocks (the head too at one stage),
  each over its tp where every replica shares one tp, else whole (over every tp rank);
- its blocks fall into one rank set per stage of the deepest replica, each cut into buckets apart;
- a unit's holders are each replica's first device (its first tp devices where tps differ; its last
  too for a tied head's copy of the embedding on a later stage), which decides the node grouping;
- the buckets but the last hide in the shortest last backward (one micro-batch's backward), yet the
  first stage's second last bucket is exposed (its last block is final at the backward's end), and
  the last (the embedding's) always.

On the small plans of tests/test_hrl_replicas.py it is within 2% of the simulator's exposed sync;
on large llama plans it can be off by a few times (the template simulated may differ in stages or tp
from the best-estimated configuration it assumes).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence

from hrlplan.cost.replica_sync import BUCKET_MB, cut_buckets
from hrlplan.cost.replica_sync_cost import bucket_seconds   # the simulator's per-bucket figure (one fact)

BACKWARD_SHARE = 2.0 / 3.0   # of a micro-batch's forward + backward (search/estimate.py's as well)


class _Unit(NamedTuple):   # cost/replica_sync.cut_buckets' item
    unit: str
    numel: float


def _buckets_seconds(sim, holders: Sequence[int], units: List[_Unit]) -> List[float]:
    """Unscaled seconds of each bucket the runtime cuts from `units` (backward order, values per
    member), reduced over `holders` (cluster devices) as the simulator costs a bucket."""
    holders = tuple(sorted(set(holders)))
    if len(holders) < 2:
        return [0.0]
    value = sim.opts.bytes_per_value
    node_of = {d: sim.cluster.devices[d].node for d in holders}
    identity = {d: d for d in holders}
    return [bucket_seconds(sim, identity, node_of, holders, sum(u.numel for u in b) * value)
            for b in cut_buckets(units, BUCKET_MB * 2 ** 20, value)]


def sync_estimate(env, chosen: List, tp: Optional[int], rows: List[int]) -> float:
    """Seconds of the cross-replica sync left exposed after the pipelines end (scaled as the
    simulator's step), for the chosen (type, shape, count) entries at these rows per replica:
    the busiest member's buckets but the last less the shortest last backward they hide in (never
    less than the second last of the first stage's rank set: its last block is final at that
    backward's end), then the last (the embedding's)."""
    replicas = sum(k for _, _, k in chosen)
    if replicas < 2:
        return 0.0
    sim, meta = env.sim, env.meta
    configs, window = [], math.inf
    for (t, s, _), r in zip(chosen, rows):
        fitting = env.low.fitting((t, s, r, tp))
        c = fitting[0][1] if fitting else None
        configs.append((c.pp, c.tp) if c is not None else (s.size, 1))
        if c is not None:   # one micro-batch's backward at the replica's pace: its last backward
            window = min(window, BACKWARD_SHARE * fitting[0][0] / (c.num_microbatches + c.n_stages - 1))
    same_tp = len({tp_ for _, tp_ in configs}) == 1
    # one tp: a unit is reduced shard by shard (1/tp a member); mixed: whole, over every tp rank
    share = configs[0][1] if same_tp else 1
    stages = min(pp for pp, _ in configs)
    apart = meta.tied_embeddings and max(pp for pp, _ in configs) > 1   # the embedding's own rank set
    holders, embed_holders = [], []
    for (t, s, k), (pp, tp_) in zip(chosen, configs):
        for i in range(k):
            devices = env.space.shape_devices(t, s, i)
            first = devices[:1] if same_tp else devices[:tp_]
            holders += first
            embed_holders += first
            if apart and pp > 1:   # the head's copy of the embedding: the last stage
                embed_holders += devices[-1:] if same_tp else devices[-tp_:]
    block = float(sum(meta.block_params)) / max(len(meta.block_params), 1) / share
    held = math.ceil(meta.n_layer / stages)
    # the busiest member's blocks fall in one rank set per stage of a deeper replica holding them:
    # each set cut apart, the later stages' sets final a micro-batch's backward or more before the end
    sets = max(1, min(held, round(max(pp for pp, _ in configs) / stages)))
    groups = [[_Unit(f"block{i}", block) for i in range(held) if i * sets // held == g] for g in range(sets)]
    if stages == 1:
        groups[0].insert(0, _Unit("final", float(meta.head_params) / share))
    embed = [_Unit("embed", float(meta.embedding_params) / share)]
    earlier = [b for g in groups[:-1] for b in _buckets_seconds(sim, holders, g)]
    if apart:
        last = _buckets_seconds(sim, holders, groups[-1]) + _buckets_seconds(sim, embed_holders, embed)
    else:
        last = _buckets_seconds(sim, holders, groups[-1] + embed)
    scale = sim.devices.time_scale
    hidden = window / scale if window < math.inf else 0.0   # the estimates are scaled, the buckets not
    before = max(sum(earlier) + sum(last[:-1]) - hidden, last[-2] if len(last) > 1 else 0.0, 0.0)
    return (before + last[-1]) * scale
