"""The shape of a heterogeneous plan's cross-replica gradient sync, as pure facts both sides read:
runtime/hetero_sync.py runs it, cost/plans.py costs it (one fact in one place).

- Units and holders: a parameter unit (an embedding parameter, block i, final norm + head) is
  held by one stage of every replica; a tied head's weight is the embedding's unit, held by the
  last stage too (unit_holders).
- Rank sets: holders at one tp degree reduce shard by shard (tp rank t of every holder); holders at
  different tp degrees reduce the whole unit over all their ranks (unit_rank_sets).
- Buckets: a rank's units in the order backward finishes them (unit_order), cut per rank set into
  buckets of whole units of at least BUCKET_MB (cut_buckets); buckets start in one global order,
  (first unit's position, rank set's index) (bucket_key).
- Hierarchy: a rank set spanning several nodes with some node holding two or more of its ranks is
  reduced in-node first (node_hierarchy): each node's members all-reduce the bucket among
  themselves, then `rails` all-reduces across nodes each carry 1/rails of it (member i of every
  node, i < rails = the fewest members any node has), then member i broadcasts its part in its node.
  The inter-node link then carries 1/rails of what a flat ring over every member would send
  through it. Where every node holds exactly `rails` members the in-node phases are a reduce-scatter
  (member i keeps its node's sum of rail part i) and, after the rails, an all-gather (scatter_in_node).
- The optimizer across replicas (replica_optimizer, plan.meta's `replica_optimizer`): "sharded"
  (ZeRO-1, as Megatron's distributed optimizer): each member owns a slice of every bucket's flat
  (member_slice), steps only that slice (master weights and AdamW moments for it alone) and the
  updated slices go to every member. A flat set reduce-scatters its buckets (slice i of n) and
  all-gathers the slices after the step. An in-node-first set shards over its rails, as HSDP does
  within a node: it runs the in-node all-reduce and the rails' all-reduces, and then, instead of
  each rail's broadcast in its node, rail member i steps rail part i (the same on every node: the
  same sums and state) and broadcasts the updated part in its node after the step; members on no
  rail step nothing. The link across nodes carries what it carried, the step runs on 1/rails.
  "replicated": every member steps the whole unit. A set of one member steps its units in place.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from hrlplan.errors import UserError
from hrlplan.plan.checks import REPLICA_OPTIMIZERS, REPLICATED, SHARDED

Holder = Tuple[int, int]   # (pipeline, stage)
RankSet = Tuple[int, ...]
BUCKET_MB = 25.0   # torch DDP's default bucket_cap_mb
# Sharded: the same bytes on the wire where a set reduces flat (reduce-scatter + all-gather = one
# all-reduce), the optimizer's time and state over n; but its all-gather after the step is exposed,
# so it is sometimes slower: a plan's choice (the planner predicts both). Replicated by default: a
# plan's step is then never under its slowest replica's own, the bound search/hetero_exact prunes by.
DEFAULT_REPLICA_OPTIMIZER = REPLICATED


def replica_optimizer(plan) -> str:
    """How a heterogeneous plan's replicas step their optimizer (module docstring): plan.meta's
    `replica_optimizer`, else DEFAULT_REPLICA_OPTIMIZER."""
    value = (getattr(plan, "meta", None) or {}).get("replica_optimizer", DEFAULT_REPLICA_OPTIMIZER)
    if value not in REPLICA_OPTIMIZERS:
        raise UserError(f"plan meta.replica_optimizer={value!r} is not one of {', '.join(REPLICA_OPTIMIZERS)}: "
                        "fix the plan file's meta.replica_optimizer or delete the key")
    return value


def member_slice(numel: int, ranks: RankSet, rank: int, hier: Optional["Hierarchy"]) -> Tuple[int, int]:
    """The slice of a bucket of `numel` values `rank` steps under the sharded optimizer (module
    docstring): its shard_slice in a flat set, its rail's part in an in-node-first one (none off the rails)."""
    if hier is None:
        return shard_slice(numel, len(ranks), ranks.index(rank))
    rail = next((i for i, members in enumerate(hier.rails) if rank in members), None)
    return (0, 0) if rail is None else rail_slices(numel, len(hier.rails))[rail]


def primary_owner(rank: int, hier: Optional["Hierarchy"]) -> bool:
    """Whether `rank`'s slice counts once for the set (the gradient norm, a gathered checkpoint): in an
    in-node-first set each rail part is stepped on every node, and the first node's counts."""
    return hier is None or rank in hier.nodes[0]


def shard_slice(numel: int, members: int, index: int) -> Tuple[int, int]:
    """Member `index`'s slice of a bucket of `numel` values over `members`: the bucket padded to a
    multiple of `members` (reduce_scatter_tensor's and all_gather_into_tensor's equal parts), cut
    to the real values (the last members' slices may be shorter or empty)."""
    part = -(-numel // members)
    return min(index * part, numel), min((index + 1) * part, numel)


def unit_order(n_layer: int, embed_units: Sequence[str]) -> List[str]:
    """Units in the order backward finishes them: final, block n-1 .. block 0, the embeddings."""
    return ["final"] + [f"block{i}" for i in reversed(range(n_layer))] + list(embed_units)


def embedding_unit_params(meta) -> Dict[str, float]:
    """The embedding units the cost model reduces, in the runtime's order, and their parameters: the
    runtime makes each embedding parameter its own unit (runtime/hetero.py embedding_units), and only
    a tied one has a second holder (the last stage). A tied model's embedding is then the tied unit
    "embed" (the head's matrix) and the rest "embed_rest" (GPT-2's positions: held by the first stage
    alone, reduced over the first stages only); an untied one's is "embed" alone."""
    whole = float(meta.embedding_params)
    if not meta.tied_embeddings:
        return {"embed": whole}
    tied = min(float(meta.head_matmul_params), whole)
    return {"embed": tied, "embed_rest": whole - tied} if whole > tied else {"embed": tied}


def unit_holders(pipes, n_layer: int, embed_units: List[str], tied_unit: Optional[str]) -> Dict[str, List[Holder]]:
    """Which (pipeline, stage) hold each parameter unit: an embedding parameter, block i, or the
    final norm + head; a tied head's weight is the embedding's unit, held by the last stage too."""
    out: Dict[str, List[Holder]] = {u: [] for u in embed_units + [f"block{i}" for i in range(n_layer)] + ["final"]}
    for p, pipe in enumerate(pipes):
        last = len(pipe.stages) - 1
        for s, st in enumerate(pipe.stages):
            for u in embed_units:
                if s == 0 or (u == tied_unit and s == last):
                    out[u].append((p, s))
            for i in range(*st.layers):
                out[f"block{i}"].append((p, s))
            if s == last:
                out["final"].append((p, s))
    return out


def unit_rank_sets(pipes, holders: Dict[str, List[Holder]], order: Sequence[str]
                   ) -> Tuple[Dict[str, List[Tuple[RankSet, bool]]], List[RankSet]]:
    """(unit -> [(rank set, whole?)], every rank set in the global order): one set per tp index where
    the holders share a tp degree, else one whole-unit set over all their ranks."""
    unit_sets: Dict[str, List[Tuple[RankSet, bool]]] = {}
    ordered: Dict[RankSet, None] = {}   # insertion-ordered set
    for unit in order:
        hs = holders.get(unit, [])
        if not hs:
            continue
        tps = {pipes[p].stages[s].tp for p, s in hs}
        if len(tps) == 1:
            sets = [(tuple(sorted({pipes[p].stages[s].ranks[t] for p, s in hs})), False) for t in range(tps.pop())]
        else:
            sets = [(tuple(sorted({r for p, s in hs for r in pipes[p].stages[s].ranks})), True)]
        unit_sets[unit] = sets
        ordered.update((ranks, None) for ranks, _ in sets)
    return unit_sets, list(ordered)


def cut_buckets(items: Sequence, cap_bytes: float, value_bytes: int) -> List[List]:
    """Whole units, in the given order, grouped until a bucket holds at least cap_bytes. Items have
    .unit and .numel. Pure: every member of a group cuts the same buckets from the same sequence."""
    buckets: List[List] = []
    current: List = []
    size = 0.0
    for i, item in enumerate(items):
        current.append(item)
        size += item.numel * value_bytes
        unit_ends = i + 1 == len(items) or items[i + 1].unit != item.unit
        if unit_ends and size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def bucket_key(position: Dict[str, int], set_index: Dict[RankSet, int], ranks: RankSet, first_unit: str):
    """The global start order of buckets (every rank sorts its own by it)."""
    return position[first_unit], set_index[ranks]


class Hierarchy(NamedTuple):
    nodes: Tuple[RankSet, ...]   # the rank set's members per node (nodes in order of their first member)
    rails: Tuple[RankSet, ...]   # rail i: member i of every node


def node_hierarchy(ranks: RankSet, node_of: Sequence) -> Optional[Hierarchy]:
    """The in-node-first reduce of a rank set (module docstring), or None where a flat all-reduce
    sends no more across nodes: all on one node, or one member per node."""
    members: Dict[object, List[int]] = {}
    for r in ranks:
        members.setdefault(node_of[r], []).append(r)
    if len(members) < 2 or len(members) == len(ranks):
        return None
    nodes = tuple(tuple(m) for m in members.values())
    rails = min(len(m) for m in nodes)
    return Hierarchy(nodes, tuple(tuple(m[i] for m in nodes) for i in range(rails)))


def scatter_in_node(hier: Optional[Hierarchy]) -> bool:
    """Whether an in-node-first reduce runs its in-node phases as a reduce-scatter and an all-gather
    (NCCL's and HSDP's hierarchical all-reduce): where every node holds exactly `rails` members, member
    i is rail i on its node, so a reduce-scatter leaves it its node's sum of rail part i -- all the
    rail needs -- and an all-gather returns the parts: each phase half an all-reduce in node, where
    the all-reduce and the rails' broadcasts cost one and a half (gpt2-xl's tied embedding on gen3:
    3.3 ms for 4.25). A node with more members than rails keeps the all-reduce and the broadcasts
    (its members off the rails need the whole sum)."""
    return hier is not None and all(len(node) == len(hier.rails) for node in hier.nodes)


def rail_slices(numel: int, rails: int) -> List[Tuple[int, int]]:
    """(start, end) of each rail's part of a bucket of `numel` values: as equal as whole values allow."""
    base, extra = divmod(numel, rails)
    out, start = [], 0
    for i in range(rails):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out
