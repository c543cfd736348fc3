"""Tensor parallelism inside a pipeline stage: DTensor `parallelize_module` on each block.

Megatron's split: the first matmul of attention and MLP column-wise, the second row-wise, so a
block needs one all-reduce per half in forward and one in backward, and its input and output are
replicated (full) tensors on every tp rank. That is what lets a stage boundary connect stages of
different tp degrees: every rank of a stage holds the whole activation (see hetero.py).

The token embedding and the output head are vocabulary-parallel by default (Megatron's split, as
torchtitan applies it): the embedding row-wise (each rank holds vocab/tp rows; the looked-up rows of
the other ranks come in one all-reduce) and the head column-wise, so each rank computes vocab/tp
logits and the cross entropy runs over the sharded logits (torch's loss_parallel: two small
all-reduces of per-token max and sum instead of gathering b*s*vocab logits). A weight the head
ties to the embedding is sharded once and serves both. Norms and position embeddings stay whole.

Sequence parallelism (sequence_parallel=True, Korthikanti et al. 2022 as torchtitan's
parallelize_llama applies it): between the matmul pairs the activation is sharded on the sequence
(Shard(1): each tp rank holds s/tp positions), not replicated. The norms run on their shard
(SequenceParallel; their weights become Replicate DTensors whose gradients DTensor all-reduces);
PrepareModuleInput all-gathers the normed shard into the attention and the MLP, whose first matmuls
stay ColwiseParallel; the second matmuls are RowwiseParallel(output_layouts=Shard(1)), a
reduce-scatter where plain tp all-reduces. Same communication volume, and the residual stream, the
norms' inputs and the dropout masks shrink by tp. The vocabulary-parallel embedding reduce-scatters
into Shard(1); the head is ColwiseParallel(input_layouts=Shard(1)), so its input is gathered once and
its logits stay vocabulary-sharded for loss_parallel. A whole embedding (or GPT-2's learned
positions) is scattered on the sequence (a local slice; backward all-gathers), a whole head's input
all-gathered.
Stage boundaries carry the sequence-sharded activation (b, s/tp, h), each tp rank to the same tp
rank of the next stage, as torchtitan does: the send is tp times smaller, no all-gather is spent at
a stage's end, and the micro-batches a schedule keeps in flight are stored sharded. The next stage
recovers the whole length for its positions (HFStage.sequence_shards). hrlplan's own executor
(hetero.py) does the same inside a replica whose stages share one tp; stages of unequal tp keep whole
activations at their boundaries and do not use it.

Packed documents (data.packing=document|balanced, models/documents.py) need nothing of their own here:
each rank attends per document on its local heads (the block's q/k/v are column-sharded by head), the
(positions, document ids) stay whole beside a sequence-sharded activation (the attention runs on the
gathered sequence; GPT-2's position embedding is scattered to the shard like the token embedding), and
stage_loss gives a vocabulary-parallel head the packed token-weighted loss under loss_parallel.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)

from hrlplan.families import FAMILIES, GENERIC_HF, family_for
from hrlplan.models.documents import is_packed_targets, sharded_packed_micro_batch_loss
from hrlplan.models.hf import causal_lm_loss, sharded_causal_lm_loss

log = logging.getLogger(__name__)
_said_whole: set = set()   # (vocab, tp) already reported as kept whole, so a process says it once


SEQUENCE = Shard(1)   # (batch, sequence, hidden): sequence parallelism's layout of a block's input and output


def _gathered(kwarg: Optional[str] = None) -> PrepareModuleInput:
    """All-gather a sequence-sharded input (positional, or the keyword `kwarg`) into the whole one."""
    if kwarg is not None:
        return PrepareModuleInput(input_kwarg_layouts={kwarg: SEQUENCE},
                                  desired_input_kwarg_layouts={kwarg: Replicate()}, use_local_output=True)
    return PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),), use_local_output=True)


def _row_out(sequence_parallel: bool) -> RowwiseParallel:
    return RowwiseParallel(output_layouts=SEQUENCE) if sequence_parallel else RowwiseParallel()


def _llama_plan(sequence_parallel: bool = False) -> Dict[str, object]:
    plan: Dict[str, object] = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": _row_out(sequence_parallel),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": _row_out(sequence_parallel)}
    if sequence_parallel:   # the decoder layer calls self_attn with keywords only, its mlp positionally
        plan.update({"input_layernorm": SequenceParallel(), "self_attn": _gathered("hidden_states"),
                     "post_attention_layernorm": SequenceParallel(), "mlp": _gathered()})
    return plan


def _gpt2_plan(sequence_parallel: bool = False) -> Dict[str, object]:
    plan: Dict[str, object] = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": _row_out(sequence_parallel),
                               "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": _row_out(sequence_parallel)}
    if sequence_parallel:   # GPT2Block passes the hidden states to attn and mlp positionally
        plan.update({"ln_1": SequenceParallel(), "attn": _gathered(), "ln_2": SequenceParallel(), "mlp": _gathered()})
    return plan


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


def parallelize_stage(part: nn.Module, tp_mesh: DeviceMesh, vocab_parallel: bool = True,
                      sequence_parallel: bool = False) -> nn.Module:
    """Shard every block of an HFStage over `tp_mesh` (in place), and its embedding and head unless
    vocab_parallel is False (see shard_vocabulary); sequence_parallel: the activations between the
    matmul pairs, and the stage's input and output, sharded on the sequence (see the module's doc).
    Returns the part."""
    part.loss_mesh = None
    tp = tp_mesh.size()
    if tp == 1:
        return part
    blocks = getattr(part.base, part.blocks_attr).values()
    shard_blocks = BLOCK_PLANS.get(family_for(GENERIC_HF.arch_family, part.model_type).tp_plan)
    if shard_blocks is None:
        supported = sorted(t for f in FAMILIES if f.tp_plan in BLOCK_PLANS for t in f.model_types)
        raise NotImplementedError(f"tensor parallel for {part.model_type} is not implemented; "
                                  f"supported: {', '.join(supported)}")
    shard_blocks(part.model_type, blocks, tp_mesh, sequence_parallel)
    vocab_sharded = vocab_parallel and shard_vocabulary(part, tp_mesh, sequence_parallel)
    if sequence_parallel:
        _shard_stage_ends(part, tp_mesh, vocab_sharded)
    return part


def _shard_llama_blocks(model_type: str, blocks, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    tp = tp_mesh.size()
    for block in blocks:
        attn = block.self_attn
        config_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        if config_heads[0] % tp or config_heads[1] % tp:
            raise ValueError(f"{model_type}: {config_heads[0]} heads / {config_heads[1]} kv heads are not "
                             f"divisible by tp={tp}")
        parallelize_module(block, tp_mesh, _llama_plan(sequence_parallel))


def _shard_gpt2_blocks(model_type: str, blocks, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    for block in blocks:
        _prepare_gpt2_block(block, tp_mesh.size())
        parallelize_module(block, tp_mesh, _gpt2_plan(sequence_parallel))


def _shard_stage_ends(part: nn.Module, tp_mesh: DeviceMesh, vocab_sharded: bool) -> None:
    """Sequence parallelism at the stage's ends, beside what shard_vocabulary did: the final norm on
    its shard; a whole embedding's output and GPT-2's position embedding scattered on the sequence;
    a whole head's input gathered. HFStage.sequence_shards tells a later stage the whole length."""
    part.sequence_shards = tp_mesh.size()
    plan: Dict[str, object] = {}
    scatter = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=SEQUENCE, use_local_output=True)
    embedding = _token_embedding(part)
    if embedding is not None and not vocab_sharded:
        plan[_name_in(part, embedding)] = scatter
    if part.first and hasattr(part.base, "wpe"):   # GPT-2's learned position embedding
        plan[_name_in(part, part.base.wpe)] = scatter
    if part.last:
        norm = part.base.ln_f if hasattr(part.base, "ln_f") else part.base.norm
        plan[_name_in(part, norm)] = SequenceParallel()
        if not vocab_sharded:
            plan["lm_head"] = _gathered()
    if plan:
        parallelize_module(part, tp_mesh, plan)


def _name_in(part: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in part.named_modules() if m is module)


def _token_embedding(part: nn.Module) -> Optional[nn.Module]:
    if not part.first:
        return None
    return part.base.wte if hasattr(part.base, "wte") else part.base.embed_tokens


def vocabulary_divides(vocab: int, tp: int) -> bool:
    """Whether the runtime shards the embedding and head over tp: the vocabulary splits evenly (the
    tied weight and both loss all-reduces then have equal shards on every rank, and a heterogeneous
    plan's gradient reduction cuts whole copies into the same pieces DTensor holds)."""
    return tp > 1 and vocab % tp == 0


def shard_vocabulary(part: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> bool:
    """Vocabulary-parallel token embedding (RowwiseParallel: rows sharded, replicated ids in, the
    all-reduced embedding out -- reduce-scattered on the sequence under sequence_parallel) and
    column-parallel head whose logits stay sharded on the vocabulary (ColwiseParallel, output
    Shard(-1), handed on as the local vocab/tp columns; its input gathered from the sequence
    shards under sequence_parallel); part.loss_mesh is
    then the mesh the loss runs over (stage_loss). A head tied to the embedding in this part stays
    one Parameter. False (and the part left whole, said once) when the vocabulary does not split
    evenly over tp; a part with neither is left alone."""
    embedding = _token_embedding(part)
    head = part.lm_head if part.last else None
    if embedding is None and head is None:
        return False
    tp = tp_mesh.size()
    vocab = embedding.num_embeddings if embedding is not None else head.out_features
    if not vocabulary_divides(vocab, tp):
        if (vocab, tp) not in _said_whole and tp_mesh.get_local_rank() == 0:
            log.warning("vocabulary %d is not divisible by tp=%d: the token embedding and output head stay "
                        "whole on every tp rank (pad the vocabulary to a multiple of tp to shard them)", vocab, tp)
        _said_whole.add((vocab, tp))
        return False
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    plan = {}
    between = SEQUENCE if sequence_parallel else Replicate()
    if embedding is not None:
        plan[_name_in(part, embedding)] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1))
    parallelize_module(part, tp_mesh, plan)
    if tied:   # each style distributed its own copy; the head takes the embedding's sharded Parameter
        head.weight = embedding.weight
    if embedding is not None:
        embedding.weight.register_hook(_as_sharded_grad)
    if head is not None:
        part.loss_mesh = tp_mesh
    return True


def _as_sharded_grad(grad: torch.Tensor) -> torch.Tensor:
    """DTensor has no row-sharded embedding backward (torch 2.13): it computes the whole vocab x
    hidden gradient, replicated, on every tp rank. Keep this rank's rows (a local slice, no
    communication), so the gradient is laid out as the weight is: the tied-weight all-reduce across
    stages and the optimizer then see vocab/tp rows. FSDP2 does the same slicing for its own
    parameters, so this hook matters where no FSDP wraps the stage."""
    if isinstance(grad, DTensor) and grad.placements != (Shard(0),):
        return grad.redistribute(placements=[Shard(0)])
    return grad


def replicate_partial_grads(part: nn.Module, accumulations: int) -> int:
    """SequenceParallel leaves its norms' Replicate weights Partial gradients (each tp rank's sum over
    its own positions; torch sums them only when an optimizer or a norm touches the DTensor). An
    executor that reduces local gradients across replicas itself (hetero.py) needs the whole value
    on every tp rank: after the `accumulations`-th accumulation of a step (its micro-batches), one
    all-reduce over the tp ranks per such weight makes the gradient Replicate. Runs before hooks
    registered later (the reducer's). Returns how many weights it watches."""
    watched = 0
    for param in part.parameters():
        if not (isinstance(param, DTensor) and all(isinstance(pl, Replicate) for pl in param.placements)):
            continue
        seen = [0]

        def settle(p: torch.Tensor, seen=seen) -> None:
            seen[0] += 1
            if seen[0] % accumulations == 0 and isinstance(p.grad, DTensor) \
                    and any(pl.is_partial() for pl in p.grad.placements):
                p.grad = p.grad.redistribute(placements=[Replicate()] * len(p.grad.placements))

        param.register_post_accumulate_grad_hook(settle)
        watched += 1
    return watched


def loss_context(parts) -> object:
    """torch's loss_parallel() where one of `parts` ends in a vocabulary-sharded head: the cross
    entropy's forward and its backward must both run inside it (whole steps are wrapped: it is not
    reentrant), else a nullcontext."""
    sharded = any(getattr(p, "loss_mesh", None) is not None for p in parts)
    return loss_parallel() if sharded else nullcontext()


def stage_loss(parts):
    """The loss function for the stage that ends in the head: causal_lm_loss, or its sharded-logits
    form over the head's tp mesh."""
    mesh = next((p.loss_mesh for p in parts if getattr(p, "loss_mesh", None) is not None), None)
    if mesh is None:
        return causal_lm_loss
    return lambda logits, targets: _sharded_loss(logits, targets, mesh)


def _sharded_loss(logits: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if is_packed_targets(logits, targets):   # data.packing=document|balanced: token-weighted over the step
        return sharded_packed_micro_batch_loss(logits, targets, mesh)
    return sharded_causal_lm_loss(logits, targets, mesh)


# families.py's tp_plan -> how a stage's blocks are sharded
BLOCK_PLANS = {"llama": _shard_llama_blocks, "gpt2": _shard_gpt2_blocks}
