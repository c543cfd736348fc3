"""Parallelisms over a DeviceMesh, applied as separate functions (torchtitan style).

The mesh is (pp, dp, cp, tp) with the plan's own rank layout: mesh[g, d, c, t] =
device_groups[g][(d*cp + c)*tp + t], so a planner can place device groups on any ranks
(heterogeneous clusters). cp is 1 unless the plan shards sequences (context parallelism); FSDP then
shards over dp and cp together (fsdp_mesh), as torchtitan's dp_shard_cp does.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hrlplan.errors import UserError
from hrlplan.plan import Plan
from hrlplan.validate.train_options import context_parallel_refusal

MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The plan's mesh. A cp > 1 plan on a device without torch's ring attention (CPU) is refused
    here too, in one line (the launcher refuses it before workers start)."""
    refused = context_parallel_refusal(plan.cp, device_type)
    if refused:
        raise UserError(refused)
    tp = plan.stages[0].tp
    layout = torch.tensor(plan.device_groups, dtype=torch.int).reshape(plan.pp, plan.dp, plan.cp, tp)
    return DeviceMesh(device_type, layout, mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks FSDP shards over and reduces gradients across: dp, or dp and cp flattened (the cp
    ranks of a dp replica hold the same weights and see different tokens of the same sequences)."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def rank_coords(plan: Plan, rank: int) -> Dict[str, int]:
    """(pp group, dp index, cp index, tp index) of a rank."""
    tp, cp = plan.stages[0].tp, plan.cp
    for g, group in enumerate(plan.device_groups):
        if rank in group:
            pos = group.index(rank)
            return {"pp": g, "dp": pos // (tp * cp), "cp": (pos // tp) % cp, "tp": pos % tp}
    raise ValueError(f"rank {rank} is not in any device group of the plan (world_size {plan.world_size})")


def apply_data_parallel(part: nn.Module, dp_mesh: DeviceMesh, mode: str, block_container: Optional[nn.Module],
                        mp_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = False) -> nn.Module:
    """FSDP2 (fully_shard, per block then the stage root) or replicate, over the dp sub-mesh.

    reshard_after_forward (FSDP2's): True frees each block's gathered weights after its forward
    and all-gathers them again in backward (one all-gather more per block and step, one block's
    whole weights live instead of the stage's); False keeps them gathered from forward to backward,
    which a pipeline schedule wants (many forwards per step: see torch_engine.reshard_after_forward).
    The last block is never resharded (backward needs it at once, as torchtitan leaves it), nor
    the stage root (FSDP2 keeps a root's weights for backward itself).

    DistributedDataParallel is not used: it crashes under torch pipelining (parameter-index rebuild
    across micro-batches), while FSDP2 and replicate_with_fsdp match a one-process run exactly.
    """
    if dp_mesh.size() == 1:
        return part
    if mode == "replicate":
        return replicate(part, mesh=dp_mesh)
    if mode != "fsdp":
        raise ValueError(f"train.dp_mode={mode!r}: choose fsdp or replicate")

    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else MixedPrecisionPolicy()
    if block_container is not None:
        blocks = list(block_container.children())
        for k, block in enumerate(blocks):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and k < len(blocks) - 1,
                        mp_policy=mp)
    # None: FSDP2's own rule, which keeps a root's weights after forward (backward needs them at once)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=None if reshard_after_forward else False, mp_policy=mp)
    return part


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class TiedEmbeddingSync:
    """Keeps a tied input embedding / output head identical when they live on different stages.

    Torch pipelining has no notion of tied weights across stages; as in Megatron, the first and
    last stage each hold a copy (equal at init) and sum their gradients before every update.
    Under a vocabulary-parallel tp both copies are Shard(0) DTensors laid out alike, so the ranks at
    one (dp, tp) position of the two stages sum the same rows of their local shards.
    """

    def __init__(self, plan: Plan, rank: int, tied: bool):
        self.param: Optional[nn.Parameter] = None
        self.embedding: Optional[nn.Parameter] = None
        self.group = None
        first_group = plan.device_groups[plan.stage_group(0)]
        last_group = plan.device_groups[plan.stage_group(plan.num_stages - 1)]
        self.active = tied and first_group != last_group
        # ZBV puts the first and the last stage on one rank: two stage modules of one process would
        # share one Parameter, which torch's per-stage gradient scaling divides twice. They get
        # separate copies here too (see untie), whose gradients are summed locally.
        self.local = tied and first_group == last_group and plan.num_stages > 1
        if not self.active:
            return
        for pos in range(len(first_group)):  # every rank creates every group, in the same order
            ranks = sorted({first_group[pos], last_group[pos]})
            group = dist.new_group(ranks)
            if rank in ranks:
                self.group = group

    @staticmethod
    def untie(all_parts: List[nn.Module]) -> None:
        """Give the last stage's head its own copy of the tied weight (call before wrapping)."""
        head = all_parts[-1].lm_head
        head.weight = nn.Parameter(head.weight.detach().clone())

    def bind(self, parts: Dict[int, nn.Module], plan: Plan) -> None:
        last = plan.num_stages - 1
        if self.local and 0 in parts and last in parts:
            base = parts[0].base
            self.embedding = base.wte.weight if hasattr(base, "wte") else base.embed_tokens.weight
            self.param = parts[last].lm_head.weight
            return
        if not self.active:
            return
        if 0 in parts:
            self.param = parts[0].base.wte.weight if hasattr(parts[0].base, "wte") else parts[0].base.embed_tokens.weight
        last = plan.num_stages - 1
        if last in parts:
            self.param = parts[last].lm_head.weight

    def is_duplicate(self, param: nn.Parameter, parts: Dict[int, nn.Module], plan: Plan) -> bool:
        """The head's copy is left out of the gradient norm (the embedding's copy counts once)."""
        return (self.active or self.local) and (plan.num_stages - 1) in parts and param is self.param

    def sync_grads(self) -> None:
        if self.embedding is not None and self.param is not None:
            total = _local(self.embedding.grad) + _local(self.param.grad)
            _local(self.embedding.grad).copy_(total)
            _local(self.param.grad).copy_(total)
            return
        if self.active and self.param is not None and self.param.grad is not None:
            dist.all_reduce(_local(self.param.grad), group=self.group)


def _by_mesh(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Plain tensors apart from DTensors, and DTensors by mesh: torch's norm and clip helpers
    refuse to mix them (tensor parallel leaves norms plain and shards the linears)."""
    groups: Dict[object, List[torch.Tensor]] = {}
    for t in tensors:
        mesh = getattr(t, "device_mesh", None)
        groups.setdefault(id(mesh) if mesh is not None else None, []).append(t)
    return list(groups.values())


def clip_grad_norm(params: List[nn.Parameter], max_norm: float, pp_group, skip: List[nn.Parameter]) -> torch.Tensor:
    """Global gradient norm over all pipeline stages (and dp/tp shards), then clip in place."""
    skip_ids = {id(p) for p in skip}
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip_ids]
    sq = torch.zeros(1, device=params[0].device if params else "cpu")
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        sq = sq + norm.float().reshape(1).to(sq.device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()[0]
    if max_norm and max_norm > 0:
        for group in _by_mesh([p for p in params if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
