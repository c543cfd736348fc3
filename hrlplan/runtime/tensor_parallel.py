"""Tensor parallelism inside a pipeline stage: DTensor `parallelize_module` on each block.

Megatron's split: the first matmul of attention and MLP column-wise, the second row-wise, so a
block needs one all-reduce per half in forward and one in backward, and its input and output are
replicated (full) tensors on every tp rank. That is what lets a stage boundary connect stages of
different tp degrees: every rank of a stage holds the whole activation (see hetero.py).

Embeddings, norms and the output head stay replicated: on the small models this runtime trains
they are cheap, and keeping them whole keeps the loss computation identical to one process.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

LLAMA_STYLE = {"llama", "mistral", "qwen2", "qwen3"}


def _llama_plan() -> Dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def _gpt2_plan() -> Dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}


def conv1d_to_linear(conv: nn.Module, row_order: torch.Tensor | None = None) -> nn.Linear:
    """GPT-2's Conv1D (y = x W + b, W of shape in x out) as nn.Linear, which DTensor TP can shard."""
    weight = conv.weight.detach().t()
    bias = conv.bias.detach()
    if row_order is not None:
        weight, bias = weight[row_order], bias[row_order]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=True, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def qkv_row_order(embed: int, tp: int) -> torch.Tensor:
    """c_attn stacks [q | k | v]; a column-wise shard must hold q, k and v of the same heads, so
    the output rows are reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (one block per tp rank)."""
    width = embed // tp
    idx = [part * embed + t * width + i for t in range(tp) for part in range(3) for i in range(width)]
    return torch.tensor(idx)


def _prepare_gpt2_block(block: nn.Module, tp: int) -> None:
    attn, mlp = block.attn, block.mlp
    embed = attn.embed_dim
    if attn.num_heads % tp:
        raise ValueError(f"GPT-2 has {attn.num_heads} heads, not divisible by tp={tp}")
    attn.c_attn = conv1d_to_linear(attn.c_attn, qkv_row_order(embed, tp))
    attn.c_proj = conv1d_to_linear(attn.c_proj)
    mlp.c_fc = conv1d_to_linear(mlp.c_fc)
    mlp.c_proj = conv1d_to_linear(mlp.c_proj)
    attn.split_size = embed // tp   # the local q/k/v width after column sharding
    attn.num_heads //= tp


def parallelize_stage(part: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard every block of an HFStage over `tp_mesh` (in place); returns the part."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    if tp == 1:
        return part
    blocks = getattr(part.base, part.blocks_attr).values()
    if part.model_type in LLAMA_STYLE:
        config_heads = None
        for block in blocks:
            attn = block.self_attn
            config_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
            if config_heads[0] % tp or config_heads[1] % tp:
                raise ValueError(f"{part.model_type}: {config_heads[0]} heads / {config_heads[1]} kv heads are not "
                                 f"divisible by tp={tp}")
            parallelize_module(block, tp_mesh, _llama_plan())
    elif part.model_type == "gpt2":
        for block in blocks:
            _prepare_gpt2_block(block, tp)
            parallelize_module(block, tp_mesh, _gpt2_plan())
    else:
        raise NotImplementedError(f"tensor parallel for {part.model_type} is not implemented; "
                                  f"supported: gpt2, {', '.join(sorted(LLAMA_STYLE))}")
    return part
