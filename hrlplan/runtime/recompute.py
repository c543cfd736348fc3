"""Activation recomputation of a stage's blocks, as the plan's `recompute` asks (torchtitan's way).

none: nothing recomputed; every block keeps what autograd saves.
full: every block wrapped in torch's checkpoint_wrapper (torch.utils.checkpoint, non-reentrant):
its forward keeps only the block's inputs, and backward runs the block's forward again.
selective: op-level selective activation checkpointing (torchtitan's `op` policy, the one the
torch-native trainers run at scale): every block under torch.utils.checkpoint with
create_selective_checkpoint_contexts, whose policy keeps (MUST_SAVE) the outputs of the matmuls
-- all but every second one, counted per block in forward and again in the recomputation --, of
the attention kernels (scaled_dot_product_attention) and of the tensor-parallel reduce-scatters
(sequence parallelism's: backward need not communicate again to rebuild them), and recomputes
every other op (norms, activations, rotary, residual adds, the skipped matmuls). It holds about
half of what `none` holds for the matmuls and nothing for the cheap ops, and costs backward about
half the matmul FLOPs of a block's forward plus its cheap ops. (hrlplan's `selective` once
recomputed only the attention core, which under SDPA saves nothing.)
Apply after tensor parallel and before FSDP (torchtitan's order): FSDP then shards the wrapped blocks.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hrlplan.plan import RECOMPUTE_MODES


def _ops(namespace, names):
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


# A linear without bias dispatches aten.mm, with a bias aten.addmm (GPT-2): both count as matmuls.
MATMULS = _ops(torch.ops.aten, ("mm", "addmm"))
ALWAYS_SAVED = _ops(torch.ops.aten, (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "max",   # Float8's amax: cheap to keep, costly to recompute in lockstep (torchtitan keeps it)
)) | _ops(torch.ops._c10d_functional, ("reduce_scatter_tensor",))


def _op_policy(counts: Dict[str, int]):
    def policy(ctx, func, *args, **kwargs):
        if func in MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            # every second matmul is recomputed: the forward and the recomputation count alike,
            # so both pick the same ones
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in ALWAYS_SAVED else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def op_selective_context():
    """The (forward, recompute) contexts of one checkpointed block call: a fresh matmul count each."""
    return create_selective_checkpoint_contexts(_op_policy(defaultdict(int)))


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    """The block, checkpointed as `mode` asks (none: unchanged)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return block
    if mode == "full":
        return checkpoint_wrapper(block)
    return checkpoint_wrapper(block, context_fn=op_selective_context)


def apply_recompute(part: nn.Module, mode: str) -> nn.Module:
    """Wrap every block of an HFStage (its ModuleDict of blocks) in place; returns the part."""
    if mode == "none":
        return part
    blocks = getattr(part.base, part.blocks_attr)
    for name in list(blocks.keys()):
        blocks[name] = wrap_block(blocks[name], mode)
    return part
