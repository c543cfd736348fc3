"""Gradient synchronisation across heterogeneous replicas (hetero.py's executor): bucketed, in the
training dtype where that is safe, overlapped with the last micro-batch's backward, in-node first
where a group spans nodes. cost/replica_sync.py holds the shape (units, rank sets, buckets, order,
hierarchy) as pure facts; cost/replica_sync_cost.py costs exactly that.

What it does, exactly:
- Units. A parameter unit (an embedding parameter, block i, final norm + head) is reduced over
  the ranks holding it. Holders at one tp degree reduce shard by shard: tp rank t of every holder
  forms one group (1/tp of the unit each). Holders at different tp degrees reduce the whole unit
  over all their ranks: each tp rank places its shard in a zero tensor of the whole shape (a
  replicated tensor contributes 1/tp of itself), so no all-gather is needed.
- Weights. Every contribution is multiplied by its pipeline's share of the global batch before the
  sum, so the update equals one process on the global batch.
- Buckets. A rank's units are ordered as backward finishes them -- final, block n-1 .. block 0,
  then the embeddings -- and cut, per group of ranks, into buckets of whole units of at least
  BUCKET_MB (the last one smaller). All members of a group hold the same units of it, so they
  cut the same buckets.
- Dtype. bfloat16 training sends bfloat16 buckets (half the bytes; each gradient was computed
  under bf16 autocast, so one more rounding per add among a handful of replicas is within its own
  precision, as torch DDP's bf16_compress_hook does); float32 training reduces in float32.
  Gradients are kept and unpacked in float32.
- Overlap. A post-accumulate-grad hook on each parameter counts its accumulations; the last
  micro-batch's (the m-th of the step) makes it final and counts its bucket down, and a bucket whose
  gradients are all final is packed and its all-reduce started (async) while backward goes on. Buckets start in one global order
  (the order above, then the group's rank order) on every rank, so each group sees its
  collectives in the same order everywhere (required by NCCL and gloo): a bucket finished early
  waits for the buckets before it. `finish()` (before clipping) starts what is left and waits.
- In node first. A group spanning nodes with two or more of its ranks on some node (ranks' nodes:
  their host names, all-gathered once) reduces each bucket in three phases: an all-reduce among
  its members on each node, then per rail (member i of every node) an all-reduce of 1/rails of the
  bucket across nodes, then each rail's part broadcast within its node. Each phase is issued once
  the previous one is complete on this rank (checked at every hook, then waited for in finish()),
  on groups of its own, and never ahead of an earlier bucket's same phase, so every group sees
  its collectives in the bucket order. Where every node holds exactly one member per rail
  (replica_sync.scatter_in_node) the first phase is a reduce-scatter in node (member i keeps its
  node's sum of rail part i) and the third an all-gather of the parts: half an all-reduce each.
- Sharded optimizer (cost/replica_sync.replica_optimizer, hetero_zero.py): a set of two or more
  members reduce-scatters each bucket instead (flat), or runs the in-node-first phases but the last
  (each rail member keeps its rail's part: the broadcast in node comes after the step); finish()
  leaves each member its slice of the summed bucket (shard_grads, cost/replica_sync.member_slice)
  and frees the parameters' own gradients, which nothing reads after that.
- GPT-2 under tp is stored in nn.Linear form with q/k/v rows regrouped per tp degree
  (tensor_parallel.py); where its holders mix tp degrees, each holder maps its whole-shape
  contribution to the Hugging Face Conv1D layout before the sum and back after it.
"""
from __future__ import annotations

import os
import socket
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from hrlplan.cost.replica_sync import (BUCKET_MB, Hierarchy, Holder, RankSet, bucket_key, cut_buckets,  # noqa: F401
                                       member_slice, node_hierarchy, rail_slices, scatter_in_node, unit_rank_sets)
from hrlplan.plan import PipelinePlan
from hrlplan.runtime.tensor_parallel import qkv_row_order

GPT2_LINEAR = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")   # Conv1D in HF, nn.Linear under tp


def bucket_bytes() -> int:
    """BUCKET_MB, or HRLPLAN_GRAD_BUCKET_MB where set (the tests cut small buckets to check the overlap)."""
    return int(float(os.environ.get("HRLPLAN_GRAD_BUCKET_MB", BUCKET_MB)) * 2**20)


def reduce_dtype(train_dtype: str) -> torch.dtype:
    """The dtype buckets travel in (see the module docstring)."""
    return torch.bfloat16 if str(getattr(train_dtype, "value", train_dtype)) == "bfloat16" else torch.float32


class Item(NamedTuple):
    """One parameter in a bucket: whole=True when its group mixes tp degrees (whole-shape contribution)."""
    unit: str
    name: str
    param: nn.Parameter
    whole: bool
    numel: int


class Bucket(NamedTuple):
    ranks: RankSet
    items: Tuple[Item, ...]


def gpt2_layout(name: str, tp: int, hidden: int) -> Optional[Tuple[bool, Optional[torch.Tensor]]]:
    """How a GPT-2 parameter of a tp>1 stage differs from Hugging Face's Conv1D layout: (transposed,
    q/k/v row order or None); None where it does not (norms, embeddings, tp 1)."""
    if tp == 1:
        return None
    for module in GPT2_LINEAR:
        if f".{module}." in f".{name}":
            weight = name.endswith(".weight")
            order = qkv_row_order(hidden, tp) if module == "attn.c_attn" else None
            if not weight and order is None:
                return None
            return weight, order
    return None


def to_hf(full: torch.Tensor, layout) -> torch.Tensor:
    """A whole-shape tensor in the tp layout -> Hugging Face's Conv1D layout."""
    if layout is None:
        return full
    transposed, order = layout
    if order is not None:
        full = full[torch.argsort(order.to(full.device))]
    return full.t() if transposed else full


def from_hf(full: torch.Tensor, layout) -> torch.Tensor:
    """The inverse of to_hf."""
    if layout is None:
        return full
    transposed, order = layout
    full = full.t() if transposed else full
    return full[order.to(full.device)] if order is not None else full


class _SetGroups(NamedTuple):
    """The process groups one rank set's buckets use on this rank: flat, or in-node first."""
    flat: object                  # the whole set (None: one member, or in-node first)
    hier: Optional[Hierarchy]
    node: RankSet                 # this rank's node's members of the set
    node_reduce: object           # phase 1 over them (None: alone on its node)
    node_spread: object           # phase 3 over them, a group apart so each group sees one phase in order
    rail: Optional[int]           # this rank's rail (None: on none)
    rail_group: object
    whole: object = None          # the whole set, flat (the sharded optimizer's gathers; None: one member)


def node_keys() -> List[str]:
    """Every rank's node: its host name, or rank // HRLPLAN_SYNC_NODE_SIZE where set (the tests
    emulate several nodes on one machine). A collective over the world."""
    size = os.environ.get("HRLPLAN_SYNC_NODE_SIZE")
    mine = str(dist.get_rank() // int(size)) if size else socket.gethostname()
    out: List[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [str(k) for k in out]


def make_set_groups(ordered: Sequence[RankSet], rank: int, node_of: Sequence[str],
                    sharded: bool = False) -> Dict[RankSet, _SetGroups]:
    """Every rank creates every group, in the same order (new_group is collective over the world).
    sharded: an in-node-first set gets a flat group too, for the optimizer's gathers."""
    out: Dict[RankSet, _SetGroups] = {}
    for ranks in ordered:
        hier = node_hierarchy(ranks, node_of)
        if hier is None:
            flat = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                out[ranks] = _SetGroups(flat, None, (), None, None, None, None, flat)
            continue
        whole = dist.new_group(list(ranks)) if sharded else None
        mine: Dict[str, object] = {"node": ()}
        for node in hier.nodes:
            reduce_group, spread_group = (dist.new_group(list(node)), dist.new_group(list(node))) \
                if len(node) > 1 else (None, None)
            if rank in node:
                mine.update(node=node, node_reduce=reduce_group, node_spread=spread_group)
        for i, rail in enumerate(hier.rails):
            group = dist.new_group(list(rail))
            if rank in rail:
                mine.update(rail=i, rail_group=group)
        if rank in ranks:
            out[ranks] = _SetGroups(None, hier, mine["node"], mine.get("node_reduce"), mine.get("node_spread"),
                                    mine.get("rail"), mine.get("rail_group"), whole)
    return out


class _Reduce:
    """One bucket's all-reduce in flight: one call, or three phases in-node first (replica_sync.py),
    each phase issued once the previous is complete on this rank."""

    PHASES = 3

    def __init__(self, bucket: "Bucket", buf: torch.Tensor, groups: _SetGroups, scatter: bool = False):
        """scatter: a flat set reduce-scatters (the sharded optimizer): `part` receives this member's
        padded slice (shard_slice) of the sum."""
        self.bucket, self.buf, self.groups = bucket, buf, groups
        self.works: List[object] = []
        self.part: Optional[torch.Tensor] = None
        # what the phase in flight receives in padded slots, and where in buf it lands once complete
        self.landing: List[Tuple[torch.Tensor, int, int]] = []
        self.issued = 0   # phases issued, of `phases`
        self.phases = self.PHASES - 1 if scatter and groups.hier is not None else self.PHASES
        if groups.hier is None:
            if groups.flat is not None and scatter:
                members = len(bucket.ranks)
                size = -(-buf.numel() // members)
                padded = torch.cat([buf, buf.new_zeros(size * members - buf.numel())])
                self.part = buf.new_empty(size)
                self.works = [dist.reduce_scatter_single(self.part, padded, group=groups.flat, async_op=True)]
            elif groups.flat is not None:
                self.works = [dist.all_reduce(buf, group=groups.flat, async_op=True)]
            self.issued = self.PHASES
        else:
            self.issue_next()

    def complete(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self._land()

    def _land(self) -> None:
        """Copy what a completed reduce-scatter or all-gather in node received into buf."""
        for piece, start, end in self.landing:
            self.buf[start:end].copy_(piece)
        self.landing = []

    def issue_next(self) -> None:
        """The next phase (module docstring), the previous one complete on this rank."""
        g, buf = self.groups, self.buf
        parts = rail_slices(buf.numel(), len(g.hier.rails))
        self._land()
        slot = parts[0][1] - parts[0][0]   # the largest part: rail_slices puts the extra values first
        if scatter_in_node(g.hier) and g.node_reduce is not None and self.issued in (0, 2):
            self._issue_in_node_slots(parts, slot)
        elif self.issued == 0 and g.node_reduce is not None:
            self.works = [dist.all_reduce(buf, group=g.node_reduce, async_op=True)]
        elif self.issued == 1 and g.rail is not None and parts[g.rail][1] > parts[g.rail][0]:
            start, end = parts[g.rail]
            self.works = [dist.all_reduce(buf.narrow(0, start, end - start), group=g.rail_group, async_op=True)]
        elif self.issued == 2 and g.node_spread is not None:   # (a part may be empty: fewer values than rails)
            self.works = [dist.broadcast(buf.narrow(0, start, end - start), src=g.node[i], group=g.node_spread,
                                         async_op=True) for i, (start, end) in enumerate(parts) if end > start]
        else:
            self.works = []
        self.issued += 1

    def _issue_in_node_slots(self, parts: List[Tuple[int, int]], slot: int) -> None:
        """Phase 1 as a reduce-scatter (this member keeps its node's sum of its rail's part) or phase 3
        as an all-gather of the rails' parts, on parts padded to equal slots (gloo's equal parts).
        A node group's rank i is its member i (new_group sorts), rail i."""
        g, buf = self.groups, self.buf
        start, end = parts[g.rail]
        if self.issued == 0:
            padded = buf.new_zeros(slot * len(parts))
            for i, (a, b) in enumerate(parts):
                padded[i * slot:i * slot + b - a].copy_(buf[a:b])
            mine = buf.new_empty(slot)
            self.works = [dist.reduce_scatter_single(mine, padded, group=g.node_reduce, async_op=True)]
            self.landing = [(mine[:end - start], start, end)]
        else:
            mine = buf.new_zeros(slot)
            mine[:end - start].copy_(buf[start:end])
            gathered = buf.new_empty(slot * len(parts))
            self.works = [dist.all_gather_single(gathered, mine, group=g.node_spread, async_op=True)]
            self.landing = [(gathered[i * slot:i * slot + b - a], a, b) for i, (a, b) in enumerate(parts) if i != g.rail]


class GradientReducer:
    """This rank's buckets, their groups, the hooks that start them and the wait (module docstring)."""

    def __init__(self, plan, pipes: List[PipelinePlan], holders: Dict[str, List[Holder]], rank: int,
                 order: Sequence[str], dtype: torch.dtype = torch.float32, node_of: Optional[Sequence[str]] = None,
                 sharded: bool = False):
        """node_of: every rank's node (default node_keys()); sharded: the sharded optimizer's reduce
        (module docstring)."""
        self.rank, self.dtype, self.sharded = rank, dtype, sharded
        self.weights = [p.batch_size / plan.global_batch_size for p in pipes]
        self.holders = holders
        self.position = {u: i for i, u in enumerate(order)}
        # unit -> [(rank set, whole?)]: one group per tp index, or one whole-unit group across tp degrees
        self.unit_groups, ordered = unit_rank_sets(pipes, holders, order)
        self.groups = make_set_groups(ordered, rank, node_keys() if node_of is None else node_of, sharded)
        self.group_rank = {ranks: i for i, ranks in enumerate(ordered)}
        self.buckets: List[Bucket] = []
        self.started_in_backward = 0   # buckets the last step started from the hooks (the overlap)
        # the last step's launches in order: (bucket index, started from the backward's hooks?), what
        # cost/replica_sync_cost.bucket_launches predicts (tests/test_hetero_sync_order.py)
        self.last_step_launches: List[Tuple[int, bool]] = []
        self.shard_grads: Dict[int, torch.Tensor] = {}   # sharded: bucket index -> this member's slice, fp32

    def shards(self, bucket: Bucket) -> bool:
        """Whether this bucket's optimizer is sharded over its members (sets of one step in place)."""
        return self.sharded and len(bucket.ranks) > 1

    def slice_of(self, bucket: Bucket) -> Tuple[int, int]:
        """This member's slice of the bucket's flat values (cost/replica_sync.member_slice)."""
        return member_slice(sum(i.numel for i in bucket.items), bucket.ranks, self.rank, self.groups[bucket.ranks].hier)

    def canonical(self, unit: str) -> Holder:
        """The holder whose copy counts in the global gradient norm (first pipeline, first stage)."""
        return min(self.holders[unit])

    def attach(self, params: List[Tuple[str, str, nn.Parameter]], me: Holder, tp_index: int, tp: int,
               microbatches: int, layout_of: Callable[[str], object], cap_bytes: Optional[int] = None) -> None:
        """params: (unit, canonical name, parameter) of this rank's stage; microbatches: the backward
        passes of a step (a gradient is final at its microbatches-th accumulation); layout_of(canonical
        name): its GPT-2 tp layout (gpt2_layout) or None. Cuts the buckets and registers the hooks."""
        self.me, self.tp_index, self.tp, self.microbatches = me, tp_index, tp, microbatches
        self.layout_of = layout_of
        by_ranks: Dict[RankSet, List[Item]] = {}
        for unit, name, param in sorted(params, key=lambda x: (self.position[x[0]], x[1])):
            for ranks, whole in self.unit_groups[unit]:
                if self.rank in ranks:
                    numel = int(torch.Size(param.shape).numel()) if whole else _local(param).numel()
                    by_ranks.setdefault(ranks, []).append(Item(unit, name, param, whole, numel))
        value_bytes = torch.tensor([], dtype=self.dtype).element_size()
        cap_bytes = bucket_bytes() if cap_bytes is None else cap_bytes
        keyed = []
        for ranks, items in by_ranks.items():
            for cut in cut_buckets(items, cap_bytes, value_bytes):
                keyed.append((bucket_key(self.position, self.group_rank, ranks, cut[0].unit), Bucket(ranks, tuple(cut))))
        self.buckets = [b for _, b in sorted(keyed, key=lambda kb: kb[0])]
        self.bucket_of: Dict[int, List[int]] = {}
        for k, bucket in enumerate(self.buckets):
            for item in bucket.items:
                self.bucket_of.setdefault(id(item.param), []).append(k)
        self._reset()
        for param in {id(p): p for _, _, p in params}.values():
            if id(param) in self.bucket_of:
                param.register_post_accumulate_grad_hook(self._on_grad)

    # ------------------------------------------------------------ one step
    def _on_grad(self, param: nn.Parameter) -> None:
        """A parameter's gradient was accumulated: on its last micro-batch's, its bucket counts down,
        and the buckets ready in order start."""
        self.seen[id(param)] = self.seen.get(id(param), 0) + 1
        if self.seen[id(param)] != self.microbatches:
            return
        for k in self.bucket_of[id(param)]:
            self.pending[k] -= 1
        while len(self.launched) < len(self.buckets) and self.pending[len(self.launched)] <= 0:
            self._start(self.buckets[len(self.launched)], in_backward=True)
            self.started_in_backward += 1
        self._progress(block=False)

    def _reset(self) -> None:
        self.seen: Dict[int, int] = {}
        self.pending = [len(b.items) for b in self.buckets]
        self.launched: List[_Reduce] = []
        self.launches: List[Tuple[int, bool]] = []

    def _start(self, bucket: Bucket, in_backward: bool = False) -> None:
        self.launches.append((len(self.launched), in_backward))
        weight = self.weights[self.me[0]]
        flats = []
        for item in bucket.items:
            if item.param.grad is None:
                item.param.grad = torch.zeros_like(item.param)
            refuse_partial_grad(item.name, item.param.grad)
            if item.whole:
                part = to_hf(self._whole_contribution(item.param.grad, weight), self.layout_of(item.name))
            else:
                part = _local(item.param.grad).detach().float() * weight
            flats.append(part.reshape(-1).to(self.dtype))
        self.launched.append(_Reduce(bucket, torch.cat(flats), self.groups[bucket.ranks], scatter=self.shards(bucket)))

    def _progress(self, block: bool) -> None:
        """Issue the next phases of in-node-first buckets whose previous phase is complete. A bucket
        issues phase p only after every bucket before it has: each group then sees its collectives
        in the bucket order on every member. block: drive them all to their last phase."""
        ahead = _Reduce.PHASES
        for red in self.launched:
            while red.issued < min(ahead, red.phases):
                if not red.complete():
                    if not block:
                        break
                    red.wait()
                red.issue_next()
            ahead = _Reduce.PHASES if red.issued >= red.phases else red.issued

    def _whole_contribution(self, grad, weight: float) -> torch.Tensor:
        """This rank's share of a whole-shape sum over every tp rank of every holder: its shard in
        place (zeros elsewhere), or 1/tp of a replicated tensor."""
        local = _local(grad).detach().float()
        dim = _shard_dim(grad)
        if dim is None:
            return local * (weight / self.tp)
        whole = torch.zeros(tuple(grad.shape), dtype=torch.float32, device=local.device)
        torch.chunk(whole, self.tp, dim=dim)[self.tp_index].copy_(local)
        return whole * weight

    def finish(self) -> None:
        """Start the buckets backward did not, wait for all, unpack (sharded: keep this member's slice
        in shard_grads and free the gradients); ready for the next step."""
        for bucket in self.buckets[len(self.launched):]:
            self._start(bucket)
        self._progress(block=True)
        launched, self.last_step_launches = self.launched, self.launches
        self._reset()
        self.shard_grads = {}
        for k, red in enumerate(launched):
            red.wait()
            bucket, buf = red.bucket, red.buf
            if self.shards(bucket):
                lo, hi = self.slice_of(bucket)
                mine = red.part[:hi - lo] if red.part is not None else buf[lo:hi]
                self.shard_grads[k] = mine.float()
                for item in bucket.items:
                    item.param.grad = None
                continue
            with torch.no_grad():
                self.unpack(bucket, buf, lambda item: item.param.grad)

    def unpack(self, bucket: Bucket, flat: torch.Tensor, target_of: Callable[[Item], torch.Tensor]) -> None:
        """Copy a bucket's whole flat (its layout: whole items in Hugging Face's) into each item's
        tensor of this rank's shape, `target_of(item)` (its gradient, weight or optimizer state)."""
        offset = 0
        for item in bucket.items:
            piece = flat[offset:offset + item.numel].float()
            offset += item.numel
            target = target_of(item)
            local = _local(target)
            if item.whole:
                layout = self.layout_of(item.name)
                piece = from_hf(piece.reshape(_hf_shape(item.param.shape, layout)), layout)
                dim = _shard_dim(item.param)
                if dim is not None:
                    piece = torch.chunk(piece, self.tp, dim=dim)[self.tp_index]
            local.copy_(piece.reshape(local.shape).to(local.dtype))

    def pack_values(self, bucket: Bucket, value_of: Callable[[Item], torch.Tensor]) -> torch.Tensor:
        """A bucket's whole flat (fp32) of one value per item (`value_of(item)`: a tensor of the
        parameter's shape on this rank, a DTensor's local shard). Same-tp items pack locally; whole
        items are summed over the set from each parameter's canonical holder's ranks alone (its shard
        in place, a replicated tensor from tp rank 0), so the sum is the value, exactly. A collective
        over the set where it has whole items."""
        flats = []
        for item in bucket.items:
            local = _local(value_of(item)).detach().float()
            if not item.whole:
                flats.append(local.reshape(-1))
                continue
            canonical = self.canonical(item.unit) == self.me
            whole = torch.zeros(tuple(item.param.shape), dtype=torch.float32, device=local.device)
            dim = _shard_dim(item.param)
            if canonical and dim is not None:
                torch.chunk(whole, self.tp, dim=dim)[self.tp_index].copy_(local)
            elif canonical and self.tp_index == 0:
                whole.copy_(local)
            flats.append(to_hf(whole, self.layout_of(item.name)).reshape(-1))
        flat = torch.cat(flats) if flats else torch.zeros(0)
        if any(item.whole for item in bucket.items):
            dist.all_reduce(flat, group=self.groups[bucket.ranks].whole)
        return flat


def refuse_partial_grad(name: str, grad: torch.Tensor) -> None:
    """A gradient is packed as its Shard placement says, or else as Replicate (each tp rank holds the
    whole value). A Partial one -- SequenceParallel's norm weights: each tp rank's sum over its own
    positions -- is neither: packed as Replicate it would be summed across replicas but never over tp
    (a per-rank partial sum for the update). tensor_parallel.replicate_partial_grads sums it over tp
    at the step's last accumulation, before this reducer's hook; one still Partial here is a bug, so
    it stops the step rather than train on a wrong gradient."""
    partial = [p for p in getattr(grad, "placements", ()) if p.is_partial()]
    if partial:
        raise RuntimeError(f"hetero_sync: the gradient of {name} is Partial over tp ({partial[0]}) when its bucket is packed; "
                           "the cross-replica reduce needs it Replicate or Shard "
                           "(runtime/tensor_parallel.replicate_partial_grads sums it over tp first)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_dim(t) -> Optional[int]:
    for placement in getattr(t, "placements", ()):
        if isinstance(placement, Shard):
            return placement.dim
    return None


def _hf_shape(shape, layout) -> Tuple[int, ...]:
    shape = tuple(shape)
    return shape[::-1] if layout is not None and layout[0] else shape
