"""What a stage's ranks hold: activations per micro-batch (by recompute mode and tp), the state of
mixed-precision AdamW, and FSDP2's unsharded parameters and gradients as the runtime uses them.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), per token of one block in 16-bit values, without sequence parallelism:
  - replicated over tp (every tp rank keeps them): the two norms' inputs, the attention and MLP
    inputs, dropout masks -- 10h;
  - sharded over tp: q, k, v, the attention output, the MLP's hidden activations -- the rest;
  - attention scores (5 a s): only an attention that materialises the s x s matrix stores them.
    torch's scaled_dot_product_attention (the runtime's attention) never does: its fused kernels
    keep q, k, v, the output and a log-sum-exp per row, so `fused_attention` (default) drops them.
ModelMeta's block_activation_bytes_per_token carries block 0's measured saved bytes plus 5as for
Hugging Face models (hrlplan.activations), or Korthikanti's figure where the measurement cannot run
(meta.extra['block_activations'] says which); other families (HRM) are taken as they are, all
sharded over tp.

Beyond what the schedule holds, a rank's peak has what one backward works with (stage_transient:
the gradients of a block's widest intermediates, a rebuilt block with full recomputation, the
loss's fp32 gradients on the last stage; zero-bubble's input-gradient pass also keeps every weight's
input gradient until its weight pass) and torch pipelining's per-micro-batch receive buffers.
Measured against live tensor storages on gpt2-tiny (two widths and sequence lengths) and
llama-tiny, 1 to 4 stages, every schedule: within 7% per rank (bench/runtime.py, tests/test_memory.py).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

RECOMPUTE_MODES = ("none", "selective", "full")
# Mixed-precision AdamW keeps fp32 parameters, fp32 gradients and two fp32 moments per parameter.
STATE_BYTES_PER_PARAM = 16
# Gradients FSDP2 accumulates unsharded between micro-batches: in its reduce dtype (float32 here).
UNSHARDED_GRAD_BYTES = 4


def block_activation_terms(meta) -> Tuple[float, float, float]:
    """(replicated, sharded, scores) bytes per token of one block, 16-bit values, mean over blocks."""
    n = max(len(meta.block_activation_bytes_per_token), 1)
    total = sum(meta.block_activation_bytes_per_token) / n
    if meta.family != "hf":
        return 0.0, total, 0.0
    h = float(meta.hidden_size)
    scores = 5.0 * meta.num_heads * meta.seq_len
    replicated = min(10.0 * h, max(total - scores, 0.0))
    return replicated, max(total - scores - replicated, 0.0), scores


def held_per_token(meta, tp: int, recompute: str, fused_attention: bool = True) -> float:
    """Bytes per token (16-bit values) one block keeps for its backward between forward and backward.

    none: everything; selective: the attention core's own tensors are recomputed (the scores,
    Korthikanti's selective recomputation; with SDPA nothing of the core is stored anyway, so
    selective saves no memory over none there); full: only the block's input (torch.utils.checkpoint
    keeps the wrapped block's arguments), 2h replicated over tp."""
    if recompute == "full":
        return 2.0 * meta.hidden_size
    rep, shard, scores = block_activation_terms(meta)
    kept_scores = 0.0 if (fused_attention or recompute == "selective") else scores
    return rep + (shard + kept_scores) / tp


def live_per_token(meta, tp: int, fused_attention: bool = True) -> float:
    """Bytes per token of one block's full activations: what recomputation rebuilds for the one
    block whose backward runs (the transient a full-recompute stage adds at its peak)."""
    return held_per_token(meta, tp, "none", fused_attention)


# Backward's working set, beside what the forward saved (saved tensors are freed node by node as the
# backward goes, so its peak is at the first op that makes new gradients, the MLP's): the gradient
# of the MLP's hidden activation (tokens x ffn) its down projection passes back, the one the
# nonlinearity or gate passes on (a gated MLP: gate and up), and an elementwise temporary of the
# nonlinearity's backward -- three tokens x ffn tensors in the activations' dtype. Measured on
# GPT-2 (composite tanh GELU) and Llama (SwiGLU) blocks at two widths: 2.5-3.0 of them.
BACKWARD_FFN_TENSORS = 3
# The loss's backward (fp32 cross entropy, whatever the model's dtype): the gradient of the
# log-probabilities and of the logits beside it, two fp32 tokens x vocab tensors (measured: exactly 2).
LOSS_BACKWARD_FP32_TENSORS = 2


def ffn_width(meta) -> float:
    """The MLP's hidden width (introspection's extra['ffn_size']; 4h where it is unknown)."""
    return float((meta.extra or {}).get("ffn_size") or 4 * meta.hidden_size)


def block_backward_per_token(meta, tp: int) -> float:
    """Bytes per token (16-bit values, as the activations) one block's backward holds at its peak
    beside the saved activations: BACKWARD_FFN_TENSORS gradients of the ffn width, sharded over tp."""
    return 2.0 * BACKWARD_FFN_TENSORS * ffn_width(meta) / tp


def weight_gradient_temporary(meta, tp: int) -> float:
    """Bytes of a block's largest weight gradient (hidden x ffn, fp32) as its backward makes it,
    before autograd adds it into the gradient accumulated by earlier micro-batches."""
    return UNSHARDED_GRAD_BYTES * ffn_width(meta) * meta.hidden_size / tp


def loss_backward_per_token(meta, vocab_tp: int) -> float:
    """Bytes per token the loss's backward holds at once (fp32): LOSS_BACKWARD_FP32_TENSORS x vocab."""
    return 4.0 * LOSS_BACKWARD_FP32_TENSORS * meta.vocab_size / vocab_tp if meta.family == "hf" else 0.0


def stage_transient(meta, tp: int, vocab_tp: int, tokens: float, scale: float, recompute: str, n_blocks,
                    last: bool, fused_attention: bool = True):
    """Bytes of the largest working set one backward of this stage adds on top of what the schedule
    holds (one backward runs at a time on a rank): a block's (block_backward_per_token and its fresh
    weight gradient; with full recomputation the block is rebuilt first: its activations and their
    gradients, 2x one block, measured), or the loss's on the last stage. `scale` converts the 16-bit
    convention to the run's activation bytes; `n_blocks` may be an array (0: no block)."""
    repeats = getattr(meta, "block_repeats", 1)
    work = tokens * block_backward_per_token(meta, tp) * scale * repeats + weight_gradient_temporary(meta, tp)
    if recompute == "full":
        work = max(work, 2.0 * tokens * live_per_token(meta, tp, fused_attention) * scale * repeats)
    head = tokens * loss_backward_per_token(meta, vocab_tp) if last else 0.0
    if isinstance(n_blocks, np.ndarray):
        return np.maximum(np.where(n_blocks > 0, work, 0.0), head)
    return max(work if n_blocks else 0.0, head)


def weight_input_grads_per_token(meta, tp: int) -> float:
    """Bytes per token (16-bit values) of the gradients at every weight's input of one block: what
    zero-bubble's input-gradient pass (torch's stage_backward_input) keeps for the weight-gradient
    pass -- the outputs of q/k/v, the attention's and the MLP's projections and the norms."""
    x = meta.extra or {}
    h = float(meta.hidden_size)
    q, kv = float(x.get("query_width") or h), float(x.get("kv_width") or h)
    up = ffn_width(meta) * (2 if x.get("gated_mlp") else 1)
    norms = float(x.get("norms_per_block") or 2) * h
    return 2.0 * ((q + 2 * kv + up) / tp + 2 * h + norms)


def zero_bubble_transient(meta, tp: int, tokens: float, bytes_per_value: int, n_blocks: float) -> float:
    """What a zero-bubble stage's input-gradient pass adds to its backward's working set: it runs with
    retain_graph (nothing it saved is freed as it goes) and keeps, for each of its blocks, the gradients
    at the weights' inputs until the stage's weight-gradient pass (weight_input_grads_per_token)."""
    return n_blocks * tokens * weight_input_grads_per_token(meta, tp) * bytes_per_value / 2.0


def receive_buffer_bytes(message_bytes: float, microbatches: int, first: bool, last: bool) -> float:
    """torch.distributed.pipelining's receive buffers, one per micro-batch and kept from step to step:
    for the stage's input (all but the first stage) and for its output's gradient (all but the last)."""
    return float(microbatches) * message_bytes * ((0 if first else 1) + (0 if last else 1))


def attention_core_flops_per_token(meta) -> float:
    """Forward FLOPs per token of one block's attention core (Q K^T and A V), as model_meta counts them."""
    return 4.0 * meta.seq_len * meta.hidden_size if meta.family == "hf" else 0.0


def state_split(params_per_rank, dp: int, dp_mode: str, bytes_per_value: int, microbatches: int) -> Dict[str, Any]:
    """static_state_bytes by kind: weights (fp32 master, plus FSDP2's unsharded compute copy),
    gradients (the most that exist at once) and optimizer (two fp32 moments). FSDP2 with more
    than one micro-batch accumulates unsharded fp32 gradients until the step's last backward and
    frees them as it reduce-scatters them into 4/dp-byte shards; with one micro-batch each block's
    gradient is reduce-scattered as it is made: only the shards accumulate."""
    p = params_per_rank
    if dp_mode == "fsdp" and dp > 1:
        grads = UNSHARDED_GRAD_BYTES if microbatches > 1 else 4.0 / dp
        return {"weights": p * (4.0 / dp + bytes_per_value), "gradients": p * grads, "optimizer": p * 8.0 / dp}
    return {"weights": p * 4.0, "gradients": p * 4.0, "optimizer": p * 8.0}


def position_peak_bytes(static, gradients, activations_before_grads, activations_with_grads, transient=0.0,
                        rebuilt=0.0):
    """A rank's peak: its `static` state (weights, optimizer, receive buffers, workspace and its
    `gradients`; no transient) and the largest of
      - the activations held before its first backward (the step's zero_grad(set_to_none) left no
        gradient: GPipe's and warm-up's peak), with the `transient` of the backward that follows;
      - the gradients beside what is held after it (1F1B's steady state), with that `transient`;
      - with full recomputation (`rebuilt`: its largest stage_transient), the gradients beside the
        inputs still held: a rebuilt block's transient recurs up to the backward's last block, when
        the gradients exist.
    `transient` is the largest stage_transient of its other stages: one backward runs at a time."""
    before, after = activations_before_grads, gradients + activations_with_grads
    arrays = any(isinstance(x, np.ndarray) for x in (before, after, transient, rebuilt))
    top = np.maximum if arrays else max
    held = top(before, after) + transient
    if arrays:
        held = np.where(np.asarray(rebuilt) > 0, np.maximum(held, gradients + before + rebuilt), held)
    elif rebuilt:
        held = max(held, gradients + before + rebuilt)
    return static - gradients + held


def static_state_bytes(params_per_rank, dp: int, dp_mode: str, bytes_per_value: int, microbatches: int):
    """Weights, gradients and AdamW state per rank (params_per_rank: what a rank computes with,
    before dp sharding; may be an array): the sum of state_split. FSDP2 as the runtime applies it
    under torch pipelining: weights and moments sharded over dp, the unsharded compute weights held
    all step (reshard_after_forward=False: pipelining runs many forwards), gradients as
    state_split says. Replicate / no dp: 16 bytes/param whole."""
    return sum(state_split(params_per_rank, dp, dp_mode, bytes_per_value, microbatches).values())


MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "transient", "buffers", "workspace")
