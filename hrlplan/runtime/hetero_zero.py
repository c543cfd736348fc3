"""The sharded optimizer across heterogeneous replicas (ZeRO-1, as Megatron's distributed optimizer):
the ranks that reduce a bucket together (a rank set of hetero_sync.py) each step one slice of it.

- Slices. Member i of a flat set of n owns slice i of every bucket's flat values (cost/replica_sync.
  member_slice: the bucket padded to a multiple of n, so reduce_scatter_single and
  all_gather_single take equal parts); in an in-node-first set rail member i owns rail part i, on
  every node alike (HSDP's sharding within a node). Its master weights for that slice are fp32 Parameters,
  one per run of items of one weight-decay class (a segment), and a real torch.optim.AdamW steps
  them: AdamW's moments exist for the slice alone. Buckets of a set of one member, and the
  parameters in them, are stepped in place by the same AdamW.
- Gradients. hetero_sync.py's reduce leaves each member its slice of the summed, batch-weighted
  bucket (reduce-scatter, or the in-node-first all-reduce then the slice); the gradient norm is the
  square root of the sum of every member's slice squares over the world, each value once (a tp
  stage's replicated tensors from tp rank 0's set alone), and clipping scales the slices.
- Gather. After the step each member's updated slice goes to every member of a flat set by
  all_gather_single (torch 2.13's name for all_gather_into_tensor), which gloo and NCCL both run
  on equal parts; gloo refuses all_gather of unequal parts, hence the padding. A reduce-scatter and
  an all-gather move the same bytes as the one all-reduce they replace, where an all-reduce then a
  slice and a gather would move half as much again. In an in-node-first set each rail member
  broadcasts its updated part in its node (the reduce's last phase, moved after the step): nothing
  more crosses nodes than the replicated optimizer's reduce sends. The slices travel in the
  reduce's dtype: bfloat16 training keeps bfloat16-valued weights beside fp32 masters (as Megatron's
  bf16 parameters), float32 training gathers float32 and stays exact.
- Overlap. The gathers are issued after the step in the forward's order (the reverse of the
  buckets') and waited for as late as the next forward allows: a forward pre-hook on every module
  with parameters of its own (HeteroPipelineEngine.make_optimizer) waits for and unpacks the
  bucket of each of them still in flight (Megatron's overlapped parameter gather, FSDP2's
  prefetch). Whatever reads the weights otherwise waits for all (wait_all: a checkpoint, the step).
- Checkpoints. The optimizer's param_groups are the stage's own parameters, grouped as the replicated
  AdamW's (trainer.make_optimizer: decay on matrices), and state_dict() gathers each parameter's whole
  state (step, exp_avg, exp_avg_sq) from the slices; load_state_dict() takes the same and keeps this
  member's slices. A checkpoint of either optimizer therefore loads into the other, on any layout
  (torch.distributed.checkpoint reshards it). The whole state exists on a rank only while a
  checkpoint is written or read.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from hrlplan.cost.replica_sync import primary_owner, rail_slices
from hrlplan.runtime.hetero_sync import Bucket, GradientReducer, Item, _local, _shard_dim

STATE_KEYS = ("exp_avg", "exp_avg_sq")
HYPER = ("lr", "betas", "eps", "weight_decay")   # what the LR schedule or a loaded checkpoint may change


def decays(param: torch.Tensor) -> bool:
    """Weight decay on matrices (embeddings included), none on biases and norms: make_optimizer's rule."""
    return param.dim() >= 2


class Piece(NamedTuple):
    """The part of one item inside this member's slice: flat positions [lo, hi) of the bucket, and
    where the item starts in the bucket."""
    item: Item
    lo: int
    hi: int
    item_start: int


class Segment(NamedTuple):
    """A run of pieces of one weight-decay class: one fp32 master Parameter over [lo, hi) of the bucket."""
    param: nn.Parameter
    lo: int
    hi: int
    decay: bool


class ShardedBucket(NamedTuple):
    index: int            # in reducer.buckets
    bucket: Bucket
    lo: int               # this member's slice of the bucket's flat
    hi: int
    pieces: Tuple[Piece, ...]
    segments: Tuple[Segment, ...]


def _pieces(bucket: Bucket, lo: int, hi: int) -> List[Piece]:
    out, start = [], 0
    for item in bucket.items:
        a, b = max(lo, start), min(hi, start + item.numel)
        if a < b:
            out.append(Piece(item, a, b, start))
        start += item.numel
    return out


def _segments(pieces: List[Piece], master: torch.Tensor, lo: int) -> Tuple[Segment, ...]:
    runs: List[List[Piece]] = []
    for piece in pieces:
        if runs and decays(runs[-1][-1].item.param) == decays(piece.item.param):
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return tuple(Segment(nn.Parameter(master[run[0].lo - lo:run[-1].hi - lo].clone()), run[0].lo, run[-1].hi,
                         decays(run[0].item.param)) for run in runs)


class ShardedReplicaOptimizer(torch.optim.Optimizer):
    """AdamW over this rank's slices (module docstring). `params`: the stage's own parameters (the
    checkpoint's and the LR schedule's view); `reducer`: the engine's, after attach(), its sharded
    reduce on; `hyper`: lr, betas, weight_decay; `impl`: AdamW's implementation flags."""

    def __init__(self, params: List[nn.Parameter], reducer: GradientReducer, hyper: Dict, impl: Dict[str, bool]):
        self.reducer = reducer
        self.sharded: List[ShardedBucket] = []
        stepped_whole = set()
        with torch.no_grad():
            for k, bucket in enumerate(reducer.buckets):
                if not reducer.shards(bucket):
                    continue
                lo, hi = reducer.slice_of(bucket)
                master = reducer.pack_values(bucket, lambda item: item.param)[lo:hi]
                pieces = _pieces(bucket, lo, hi)
                self.sharded.append(ShardedBucket(k, bucket, lo, hi, tuple(pieces), _segments(pieces, master, lo)))
                stepped_whole.update(id(item.param) for item in bucket.items)
        self.in_place = [p for p in params if id(p) not in stepped_whole]   # sets of one member
        groups = []
        for decayed in (True, False):
            groups.append([s.param for sb in self.sharded for s in sb.segments if s.decay == decayed]
                          + [p for p in self.in_place if decays(p) == decayed])
        self.inner = torch.optim.AdamW([{"params": g} for g in groups], lr=hyper["lr"],
                                       betas=hyper["betas"], **impl)
        # the stage's parameters in the replicated AdamW's groups, with its group keys (a checkpoint
        # of either optimizer then names the same groups and settings)
        super().__init__([{"params": [p for p in params if decays(p)], "weight_decay": hyper["weight_decay"]},
                          {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
                         dict(self.inner.defaults))
        for group in self.inner.param_groups:   # moments now: their keys name the state before any step
            for p in group["params"]:
                self.inner.state[p] = _fresh_state(p, impl)
        self.pending: Dict[int, tuple] = {}   # bucket index -> its gather in flight (sb, flat, works)
        self.bucket_of = {id(item.param): sb.index for sb in self.sharded for item in sb.bucket.items}
        self._view = self._state_view(params, impl)
        self.state = self._view
        self._sync_hyper()

    # ------------------------------------------------------------ one step
    def _sync_hyper(self) -> None:
        for mine, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: mine[k] for k in HYPER if k in mine})

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def take_gradients(self) -> None:
        """After the reduce: each segment's gradient from this member's slice (hetero_sync.shard_grads);
        the parameters of sets of one member keep their own."""
        for sb in self.sharded:
            grad = self.reducer.shard_grads[sb.index]
            for seg in sb.segments:
                seg.param.grad = grad[seg.lo - sb.lo:seg.hi - sb.lo]

    def squared_norm(self, tp_index: int) -> torch.Tensor:
        """This rank's share of the squared global gradient norm from its slices: each value once
        (a replicated tensor of a tp stage counts in tp rank 0's set only; a whole unit's values once)."""
        total = torch.zeros(1)
        for sb in self.sharded:
            if not primary_owner(self.reducer.rank, self.reducer.groups[sb.bucket.ranks].hier):
                continue
            grad = self.reducer.shard_grads[sb.index]
            for piece in sb.pieces:
                item = piece.item
                if item.whole or _shard_dim(item.param) is not None or tp_index == 0:
                    total += grad[piece.lo - sb.lo:piece.hi - sb.lo].double().pow(2).sum().float().cpu()
        return total

    def scale_gradients(self, coef: torch.Tensor) -> None:
        for sb in self.sharded:
            self.reducer.shard_grads[sb.index].mul_(coef.to(self.reducer.shard_grads[sb.index].device))

    @torch.no_grad()
    def step(self, closure=None):
        self.wait_all()
        self._sync_hyper()
        if any(s.param.grad is None for sb in self.sharded for s in sb.segments):
            self.take_gradients()
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.reducer.shard_grads = {}
        self._issue_gathers()
        return None

    def wait_for(self, params) -> None:
        """The gathers of these parameters' buckets done and unpacked (a forward pre-hook's)."""
        for p in params:
            k = self.bucket_of.get(id(p))
            if k is not None and k in self.pending:
                self._complete(k)

    def wait_all(self) -> None:
        for k in list(self.pending):
            self._complete(k)

    @torch.no_grad()
    def _complete(self, k: int) -> None:
        """Unpack into the stage's parameters (the owner's too: its masters keep fp32, its weights
        take the gathered values, as everyone's)."""
        sb, whole, works = self.pending.pop(k)
        for work in works:
            work.wait()
        self.reducer.unpack(sb.bucket, whole, lambda item: item.param.data)

    def _issue_gathers(self) -> None:
        """Every member's updated slice to every member (module docstring: all_gather_single in a flat
        set, each rail's broadcast in node in an in-node-first one), in the reduce's dtype, issued in
        the forward's order, not waited for."""
        for sb in reversed(self.sharded):
            groups = self.reducer.groups[sb.bucket.ranks]
            members = len(sb.bucket.ranks)
            numel = sum(i.numel for i in sb.bucket.items)
            device = _local(sb.bucket.items[0].param).device
            if groups.hier is None:
                size = -(-numel // members)
                mine = torch.zeros(size, dtype=self.reducer.dtype, device=device)
                self._fill(sb, mine, sb.lo)
                whole = mine.new_empty(size * members)
                works = [dist.all_gather_single(whole, mine, group=groups.whole, async_op=True)]
            else:
                whole = torch.zeros(numel, dtype=self.reducer.dtype, device=device)
                self._fill(sb, whole, 0)
                parts = rail_slices(numel, len(groups.hier.rails))
                works = [dist.broadcast(whole.narrow(0, a, b - a), src=groups.node[i], group=groups.node_spread,
                                        async_op=True)
                         for i, (a, b) in enumerate(parts) if b > a and groups.node_spread is not None]
            self.pending[sb.index] = (sb, whole, works)

    @staticmethod
    def _fill(sb: ShardedBucket, out: torch.Tensor, origin: int) -> None:
        """This member's masters into `out`, whose first value is the bucket's value `origin`."""
        for seg in sb.segments:
            out[seg.lo - origin:seg.hi - origin].copy_(seg.param)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self):
        """Each parameter's whole AdamW state, gathered from the members' slices (collective). The
        weights' gathers first: a checkpoint reads the model's tensors (written after this)."""
        self.wait_all()
        full = self._gather_state()
        kept = self.state
        self.state = full
        try:
            return super().state_dict()
        finally:
            self.state = kept

    def load_state_dict(self, state_dict) -> None:
        """A whole state (either optimizer's): this member keeps its slices and the in-place parameters',
        and takes its masters from the stage's weights, loaded before (checkpoint.py's order)."""
        self.wait_all()
        super().load_state_dict(state_dict)
        full, self.state = self.state, self._view
        step = next((v["step"] for v in full.values() if "step" in v), None)
        with torch.no_grad():
            for sb in self.sharded:
                # the masters from the weights the checkpoint loaded first (checkpoint.py: model, then optimizer)
                master = self.reducer.pack_values(sb.bucket, lambda item: item.param)
                for seg in sb.segments:
                    seg.param.copy_(master[seg.lo:seg.hi])
                for key in STATE_KEYS:
                    flat = self.reducer.pack_values(sb.bucket, lambda item: full[item.param][key])
                    for seg in sb.segments:
                        self.inner.state[seg.param][key].copy_(flat[seg.lo:seg.hi])
                for seg in sb.segments:
                    if step is not None:
                        self.inner.state[seg.param]["step"].copy_(step)
            for p in self.in_place:
                for key, value in full.get(p, {}).items():
                    target = self.inner.state[p][key]
                    _local(target).copy_(_local(value).to(_local(target).dtype))
        self._sync_hyper()

    def _gather_state(self) -> Dict[nn.Parameter, Dict[str, torch.Tensor]]:
        out: Dict[nn.Parameter, Dict[str, torch.Tensor]] = {}
        for p in self.in_place:
            out[p] = dict(self.inner.state[p])
        for sb in self.sharded:
            groups = self.reducer.groups[sb.bucket.ranks]
            numel = sum(i.numel for i in sb.bucket.items)
            counts = primary_owner(self.reducer.rank, groups.hier)
            step = None
            for key in STATE_KEYS:
                # each value from its one counting owner, summed over the set: exact (a checkpoint is rare)
                whole = torch.zeros(numel, dtype=torch.float32, device=_local(sb.bucket.items[0].param).device)
                for seg in sb.segments:
                    if counts:
                        whole[seg.lo:seg.hi].copy_(self.inner.state[seg.param][key])
                    step = self.inner.state[seg.param]["step"]
                dist.all_reduce(whole, group=groups.whole)
                for item in sb.bucket.items:
                    out.setdefault(item.param, {})[key] = _like_param(item.param)
                self.reducer.unpack(sb.bucket, whole, lambda item: out[item.param][key])
            step = _agreed_step(step, sb, self.reducer)
            for item in sb.bucket.items:
                out[item.param]["step"] = step.clone()
        return out

    def _state_view(self, params: List[nn.Parameter], impl: Dict[str, bool]) -> Dict:
        """What `self.state` shows between checkpoints, per stage parameter: the in-place ones' AdamW
        state; a sharded one's pieces of its segments' moments (empty where this member holds none of
        it). It names the state's keys before any step (torch.distributed.checkpoint's load reads
        them) and holds every moment this rank keeps exactly once (the memory meter reads it)."""
        view: Dict = {p: self.inner.state[p] for p in self.in_place}
        steps = [self.inner.state[s.param]["step"] for sb in self.sharded for s in sb.segments]
        step = steps[0] if steps else _fresh_state(torch.zeros(0), impl)["step"]
        for sb in self.sharded:
            for piece in sb.pieces:
                seg = next(s for s in sb.segments if s.lo <= piece.lo and piece.hi <= s.hi)
                entry = view.setdefault(piece.item.param, {"step": step})
                for key in STATE_KEYS:
                    part = self.inner.state[seg.param][key][piece.lo - seg.lo:piece.hi - seg.lo]
                    entry[key] = part if key not in entry else torch.cat([entry[key], part])
        for p in params:
            if p not in view:
                view[p] = {"step": step, **{key: torch.zeros(0) for key in STATE_KEYS}}
        return view


def _fresh_state(p: torch.Tensor, impl: Dict[str, bool]) -> Dict[str, torch.Tensor]:
    """AdamW's lazily made state, made now (its step counter where AdamW keeps it)."""
    on_device = bool(impl.get("fused") or impl.get("capturable"))
    step = torch.zeros((), dtype=_get_scalar_dtype(), device=p.device) if on_device else \
        torch.tensor(0.0, dtype=_get_scalar_dtype())
    return {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _like_param(param: torch.Tensor) -> torch.Tensor:
    """A zero tensor shaped and placed as the parameter (a DTensor's state is a DTensor, as AdamW's)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(torch.zeros_like(param.to_local(), dtype=torch.float32), param.device_mesh,
                                  param.placements, run_check=False, shape=param.shape, stride=param.stride())
    return torch.zeros_like(param, dtype=torch.float32)


def _agreed_step(step, sb: ShardedBucket, reducer: GradientReducer) -> torch.Tensor:
    """The step count (the same on every member; one whose slice is empty has none: taken as the max)."""
    value = torch.tensor([float(step) if step is not None else -1.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=reducer.groups[sb.bucket.ranks].whole)
    return torch.tensor(value.item(), dtype=_get_scalar_dtype())
