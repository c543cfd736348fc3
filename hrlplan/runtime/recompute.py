"""Activation recomputation of a stage's blocks, as the plan's `recompute` asks (torchtitan's way).

full: every block wrapped in torch's checkpoint_wrapper (torch.utils.checkpoint, non-reentrant):
its forward keeps only the block's inputs, and backward runs the block's forward again.
selective: every block under selective activation checkpointing (torch.utils.checkpoint with
create_selective_checkpoint_contexts) whose policy recomputes the attention core only -- the
scaled_dot_product_attention kernels, or the softmax and batched matmuls of an eager attention --
and keeps every other op's output, as Korthikanti et al. 2022 recompute attention's core.
Apply after tensor parallel and before FSDP (torchtitan's order): FSDP then shards the wrapped blocks.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hrlplan.plan import RECOMPUTE_MODES


def _attention_core_ops():
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable", "_softmax", "bmm", "baddbmm")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _core_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE if func in _CORE else CheckpointPolicy.MUST_SAVE


_CORE = _attention_core_ops()


def _selective_context():
    return create_selective_checkpoint_contexts(_core_policy)


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    """The block, checkpointed as `mode` asks (none: unchanged)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return block
    if mode == "full":
        return checkpoint_wrapper(block)
    return checkpoint_wrapper(block, context_fn=partial(_selective_context))


def apply_recompute(part: nn.Module, mode: str) -> nn.Module:
    """Wrap every block of an HFStage (its ModuleDict of blocks) in place; returns the part."""
    if mode == "none":
        return part
    blocks = getattr(part.base, part.blocks_attr)
    for name in list(blocks.keys()):
        blocks[name] = wrap_block(blocks[name], mode)
    return part
