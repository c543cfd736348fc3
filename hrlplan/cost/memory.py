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

import dataclasses
from typing import Any, Dict, Tuple

import numpy as np

from hrlplan.plan import RECOMPUTE_MODES  # noqa: F401 (one list of modes: the plan's)
from hrlplan.families import is_language_model
# Mixed-precision AdamW keeps fp32 parameters, fp32 gradients and two fp32 moments per parameter.
STATE_BYTES_PER_PARAM = 16
# Gradients FSDP2 accumulates unsharded between micro-batches: in its reduce dtype (float32 here).
UNSHARDED_GRAD_BYTES = 4


# Packed documents (data.packing=document|balanced, models/documents.py): a block's attention runs
# document by document, and the block keeps one more tokens x hidden tensor than with one whole-row
# SDPA (measured with saved-tensor hooks on gpt2 stages: exactly 2 x 128 bytes a token more for two
# width-32 fp32 blocks, from 1 to 64 documents a row), sharded over tp with the heads.
PACKED_EXTRA_HIDDEN_TENSORS = 1


def packed_meta(meta):
    """`meta` as a packed-documents run holds it: each block's kept bytes per token (16-bit values)
    plus PACKED_EXTRA_HIDDEN_TENSORS x hidden; other families unchanged (they take no packed rows)."""
    if not is_language_model(meta) or not meta.block_activation_bytes_per_token:
        return meta
    extra = 2.0 * PACKED_EXTRA_HIDDEN_TENSORS * float(meta.hidden_size)
    return dataclasses.replace(meta, block_activation_bytes_per_token=[
        float(b) + extra for b in meta.block_activation_bytes_per_token])


def block_activation_terms(meta) -> Tuple[float, float, float]:
    """(replicated, sharded, scores) bytes per token of one block, 16-bit values, mean over blocks."""
    n = max(len(meta.block_activation_bytes_per_token), 1)
    total = sum(meta.block_activation_bytes_per_token) / n
    if not is_language_model(meta):
        return 0.0, total, 0.0
    h = float(meta.hidden_size)
    scores = 5.0 * meta.num_heads * meta.seq_len
    replicated = min(10.0 * h, max(total - scores, 0.0))
    return replicated, max(total - scores - replicated, 0.0), scores


# Block families whose attention projects q, k and v in one matmul (HF's fused c_attn / query_key_value).
FUSED_QKV_BLOCKS = ("GPT2Block", "GPTBigCodeBlock", "GPTNeoXLayer", "FalconDecoderLayer", "BloomBlock")


def held_per_token(meta, tp: int, recompute: str, fused_attention: bool = True,
                   sequence_parallel: bool = False, compiled: bool = False) -> float:
    """Bytes per token (16-bit values) one block keeps for its backward between forward and backward.

    none: everything; selective: op-level selective activation checkpointing (runtime/recompute.py):
    the block's input, the outputs of every other matmul and of the attention kernel
    (op_sac_saved_per_token); full: only the block's input (torch.utils.checkpoint keeps the
    wrapped block's arguments), 2h. With sequence parallelism (tp > 1) the block input and the
    norms are sharded over tp as well. `compiled` (train.compile): what the compiled block's
    graph saves instead of eager's (compiled_saved_per_token), where that is less."""
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        return 2.0 * meta.hidden_size / (tp if sp else 1)
    none = _held_without_recompute(meta, tp, fused_attention, sp)
    if recompute == "selective" and is_language_model(meta):
        # compiled with the op policy, the partitioner keeps what the policy marks as saved
        return min(op_sac_saved_per_token(meta, tp, sp), none)
    if compiled and is_language_model(meta):
        return min(compiled_saved_per_token(meta, tp, sp), none)
    return none   # another family's blocks: nothing claimed for the op policy or compile


def _held_without_recompute(meta, tp: int, fused_attention: bool, sp: bool) -> float:
    rep, shard, scores = block_activation_terms(meta)
    kept_scores = 0.0 if fused_attention else scores
    # sequence parallelism shards the replicated terms too (Korthikanti et al. 2022: 34sbh/t):
    # measured on llama-tiny at tp 2, it saves more than that (tests/test_sp_memory.py)
    return (rep if not sp else rep / tp) + (shard + kept_scores) / tp


def compiled_saved_per_token(meta, tp: int, sp: bool) -> float:
    """Bytes per token (16-bit) a regionally compiled block (runtime/compile.py) saves for backward.
    AOTAutograd's partitioner saves a min cut between forward and backward and recomputes the
    cheap elementwise ops (norms, activations, rotary, residual adds) from it; what it keeps is:
      - the block's input (its first norm's backward starts from it);
      - each distinct matmul input, for the weight gradients: the attention's input (q, k and v
        share it), the output projection's (the attention's output, laid out again), the MLP's
        input and its down projection's (tokens x ffn);
      - scaled_dot_product_attention's q, k, v, output and fp32 log-sum-exp;
      - the MLP nonlinearity's inputs: gate and up (gated) or the up projection's output;
      - each norm's fp32 statistics (mean and 1/rms: 2 values; RMSNorm has one).
    Measured tensor by tensor on llama-tiny and gpt2-tiny (tests/test_compile_memory.py), this is
    what torch 2.13's inductor saves exactly; the residual stream between attention and MLP is not
    kept (its norm's backward is rebuilt from the norm's output). Over tp as eager's terms are: the
    whole-width ones replicated (sharded under SP), the rest sharded."""
    x = meta.extra or {}
    h = float(meta.hidden_size)
    q, kv = float(x.get("query_width") or h), float(x.get("kv_width") or h)
    ffn = ffn_width(meta)
    norms = float(x.get("norms_per_block") or 2)
    replicated = 2.0 * (h + h + h) + 4.0 * 2 * norms       # input, attention and MLP inputs, norm statistics
    nonlinearity = (2 if x.get("gated_mlp") else 1) * ffn
    sharded = 2.0 * (q + (q + 2 * kv + q) + ffn + nonlinearity) + 4.0 * meta.num_heads
    return replicated / (tp if sp else 1) + sharded / tp


def block_matmuls(meta):
    """One block's matmuls in forward order: (input width, output width, row-parallel) per token.
    Row-parallel projections (attention out, MLP down) make whole-width partial sums on every tp rank."""
    x = meta.extra or {}
    h = float(meta.hidden_size)
    q, kv, ffn = float(x.get("query_width") or h), float(x.get("kv_width") or h), ffn_width(meta)
    attn = [(h, q + 2 * kv, False)] if x.get("block_class") in FUSED_QKV_BLOCKS else \
        [(h, q, False), (h, kv, False), (h, kv, False)]
    mlp = [(h, ffn, False)] * (2 if x.get("gated_mlp") else 1) + [(ffn, h, True)]
    return attn + [(q, h, True)] + mlp


# train.float8's rule for which linears torchao swaps (runtime/float8.py applies it, the cost model
# prices it): both dims multiples of 16 (torch._scaled_mm), and not small -- torchao's tensorwise
# auto-filter skips K <= 4096 in and N <= 1024 out, where the casts cost more than fp8 gains.
FLOAT8_DIM_MULTIPLE = 16


def float8_small(in_features: float, out_features: float) -> bool:
    return in_features <= 4096 and out_features <= 1024


def float8_swaps(in_features: float, out_features: float, skip_small: bool = True) -> bool:
    """Whether a block linear of these (whole, before tp) dims runs in fp8."""
    if int(in_features) % FLOAT8_DIM_MULTIPLE or int(out_features) % FLOAT8_DIM_MULTIPLE:
        return False
    return not (skip_small and float8_small(in_features, out_features))


def float8_flops_share(meta) -> float:
    """The share of a block's forward FLOPs in the linears train.float8 swaps (block_matmuls)."""
    flops = sum(meta.block_flops_fwd_per_token) / max(len(meta.block_flops_fwd_per_token), 1)
    fp8 = sum(2.0 * i * o for i, o, _ in block_matmuls(meta) if float8_swaps(i, o))
    return min(fp8 / flops, 1.0) if flops > 0 and is_language_model(meta) else 0.0


def op_sac_saved_per_token(meta, tp: int, sp: bool) -> float:
    """Bytes per token (16-bit) one block keeps under the op-level policy (runtime/recompute.py,
    torchtitan's): its input (sharded under SP), the outputs of the 1st, 3rd, ... matmul (sharded
    over tp, a row-parallel one whole), the attention kernel's output and fp32 log-sum-exp, and under
    SP the two reduce-scatters' outputs. Everything else is recomputed in backward."""
    h = float(meta.hidden_size)
    q = float((meta.extra or {}).get("query_width") or h)
    shard = float(tp) if sp else 1.0
    saved = 2.0 * h / shard
    for _, out, row in block_matmuls(meta)[0::2]:
        saved += 2.0 * (out if row else out / tp)
    saved += 2.0 * q / tp + 4.0 * meta.num_heads / tp
    if sp:
        saved += 2 * 2.0 * h / tp
    return saved


def op_sac_recomputed_fraction(meta) -> float:
    """The share of a block's forward FLOPs the op policy reruns in backward: its 2nd, 4th, ...
    matmuls (the cheap ops it also reruns are not counted; the attention kernel's output is kept)."""
    flops = sum(meta.block_flops_fwd_per_token) / max(len(meta.block_flops_fwd_per_token), 1)
    rerun = sum(2.0 * i * o for i, o, _ in block_matmuls(meta)[1::2])
    return min(rerun / flops, 1.0) if flops > 0 and is_language_model(meta) else 1.0


def live_per_token(meta, tp: int, fused_attention: bool = True, sequence_parallel: bool = False,
                   compiled: bool = False) -> float:
    """Bytes per token of one block's full activations: what recomputation rebuilds for the one
    block whose backward runs (the transient a full-recompute stage adds at its peak)."""
    return held_per_token(meta, tp, "none", fused_attention, sequence_parallel, compiled=compiled)


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


# Under sequence parallelism a block's backward also holds whole-sequence gradients on every tp rank:
# the all-gathered gradient of a row-parallel projection's sequence-sharded output and the whole
# partial gradient a column-parallel projection reduce-scatters back to sequence shards -- two
# tokens x h tensors (measured on llama-tiny and gpt2-tiny at tp 2: tests/test_sp_memory.py).
SP_BACKWARD_WHOLE_TENSORS = 2


def block_backward_per_token(meta, tp: int, sequence_parallel: bool = False) -> float:
    """Bytes per token (16-bit values, as the activations) one block's backward holds at its peak
    beside the saved activations: BACKWARD_FFN_TENSORS gradients of the ffn width, sharded over tp
    (and SP_BACKWARD_WHOLE_TENSORS of the hidden width under sequence parallelism)."""
    whole = SP_BACKWARD_WHOLE_TENSORS * float(meta.hidden_size) if sequence_parallel and tp > 1 else 0.0
    return 2.0 * (BACKWARD_FFN_TENSORS * ffn_width(meta) / tp + whole)


def weight_gradient_temporary(meta, tp: int) -> float:
    """Bytes of a block's largest weight gradient (hidden x ffn, fp32) as its backward makes it,
    before autograd adds it into the gradient accumulated by earlier micro-batches."""
    return UNSHARDED_GRAD_BYTES * ffn_width(meta) * meta.hidden_size / tp


def loss_backward_per_token(meta, vocab_tp: int) -> float:
    """Bytes per token the loss's backward holds at once (fp32): LOSS_BACKWARD_FP32_TENSORS x vocab."""
    return 4.0 * LOSS_BACKWARD_FP32_TENSORS * meta.vocab_size / vocab_tp if is_language_model(meta) else 0.0


def stage_transient(meta, tp: int, vocab_tp: int, tokens: float, scale: float, recompute: str, n_blocks,
                    last: bool, fused_attention: bool = True, sequence_parallel: bool = False,
                    compiled: bool = False):
    """Bytes of the largest working set one backward of this stage adds on top of what the schedule
    holds (one backward runs at a time on a rank): a block's (block_backward_per_token and its fresh
    weight gradient; with full recomputation the block is rebuilt first, and that backward works
    beside its rebuilt activations (rebuilt_beyond_held: what it adds to the held); op-level selective first rebuilds what it did not keep, beside
    those gradients: measured, tests/test_sp_memory.py), or the loss's on the last stage. `scale`
    converts the 16-bit convention to the run's activation bytes; `n_blocks` may be an array (0: no block)."""
    repeats = getattr(meta, "block_repeats", 1)
    work = (tokens * block_backward_per_token(meta, tp, sequence_parallel) * scale * repeats
            + weight_gradient_temporary(meta, tp))
    live = live_per_token(meta, tp, fused_attention, sequence_parallel, compiled=compiled)
    if recompute == "full":
        work = work + tokens * live * scale * repeats   # the rebuilt block, then its backward beside it
    elif recompute == "selective":
        kept = held_per_token(meta, tp, recompute, fused_attention, sequence_parallel, compiled=compiled)
        work = work + (live - kept) * tokens * scale * repeats
    head = tokens * loss_backward_per_token(meta, vocab_tp) if last else 0.0
    if isinstance(n_blocks, np.ndarray):
        return np.maximum(np.where(n_blocks > 0, work, 0.0), head)
    return max(work if n_blocks else 0.0, head)


def rebuilt_beyond_held(transient, activation, block_input):
    """What a full-recomputation stage's rebuilt block adds at its peak beyond the activations the
    schedule holds. That peak is the backward of the stage's first block, when the gradients exist:
    by then the micro-batch has given back all it held (its later blocks' inputs, the head's
    logits) but the first block's input, so the rebuilt block's `transient` counts less that.
    (Counting the whole held micro-batch beside it over-predicted llama-tiny's peak by 24%.)"""
    freed = activation - block_input
    if isinstance(freed, np.ndarray) or isinstance(transient, np.ndarray):
        return np.maximum(transient - freed, 0.0)
    return max(transient - freed, 0.0)


def float8_cast_bytes(meta, tp: int, tokens: float) -> float:
    """train.float8's casts beside a block's backward: torchao's Float8Linear (dynamic tensorwise)
    keeps its high-precision input and weight for backward and casts them to fp8 (1 byte) at each
    matmul, the output's gradient too: the widest linear's weight (h x ffn), its input and its output's
    gradient (tokens x ffn), one byte each, sharded over tp."""
    ffn = ffn_width(meta)
    return (ffn * meta.hidden_size + 2.0 * tokens * ffn) / tp


def reduce_scatter_buffer_bytes(block_params_per_rank: float, shards: int) -> float:
    """FSDP2's reduce-scatter of one block's gradients (in a step's last backward, or each backward
    with one micro-batch): the gradients copied into one flat fp32 input and the 1/shards output.
    It lies beside a full-recomputation stage's rebuilt block, whose peak comes when the gradients
    exist (measured: llama-tiny, dp 2, two micro-batches, +5.4% under-predicted without it); the
    other modes peak before any gradient exists, where no reduce-scatter runs."""
    return UNSHARDED_GRAD_BYTES * block_params_per_rank * (1.0 + 1.0 / shards) if shards > 1 else 0.0


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
    return 4.0 * meta.seq_len * meta.hidden_size if is_language_model(meta) else 0.0


def state_split(params_per_rank, dp: int, dp_mode: str, bytes_per_value: int, microbatches: int,
                gathered_params=None) -> Dict[str, Any]:
    """static_state_bytes by kind: weights (fp32 master, plus FSDP2's unsharded compute copy),
    gradients (the most that exist at once) and optimizer (two fp32 moments). FSDP2 with more
    than one micro-batch accumulates unsharded fp32 gradients until the step's last backward and
    frees them as it reduce-scatters them into 4/dp-byte shards; with one micro-batch each block's
    gradient is reduce-scattered as it is made: only the shards accumulate. `gathered_params`: the
    parameters unsharded at once (reshard_after_forward: gathered_under_reshard); None: all of them."""
    p = params_per_rank
    if dp_mode == "fsdp" and dp > 1:
        grads = UNSHARDED_GRAD_BYTES if microbatches > 1 else 4.0 / dp
        gathered = p if gathered_params is None else gathered_params
        return {"weights": p * 4.0 / dp + gathered * bytes_per_value, "gradients": p * grads,
                "optimizer": p * 8.0 / dp}
    return {"weights": p * 4.0, "gradients": p * 4.0, "optimizer": p * 8.0}


# torch's foreach AdamW (_multi_tensor_adamw), the runtime's on CUDA for DTensor parameters (FSDP2, tp;
# devices.optimizer_impl), makes sqrt(exp_avg_sq) of every parameter it steps at once: one fp32 temporary
# of their size beside the weights, gradients and both moments, when no activation is left. The fused
# kernel (CUDA, plain tensors) and the per-parameter loop (CPU) make none.
FOREACH_ADAMW_FP32_TEMPORARIES = 1


def optimizer_step_bytes(params_stepped, foreach: bool):
    """Bytes the optimizer step adds to what the rank holds while it runs (`params_stepped`: the
    parameters this rank's optimizer updates, its FSDP shard; may be an array)."""
    return 4.0 * FOREACH_ADAMW_FP32_TEMPORARIES * params_stepped if foreach else 0.0 * params_stepped


def position_peak_bytes(static, gradients, activations_before_grads, activations_with_grads, transient=0.0,
                        rebuilt=0.0, optimizer_step=0.0):
    """A rank's peak: its `static` state (weights, optimizer, receive buffers, workspace and its
    `gradients`; no transient) and the largest of
      - the activations held before its first backward (the step's zero_grad(set_to_none) left no
        gradient: GPipe's and warm-up's peak), with the `transient` of the backward that follows;
      - the gradients beside what is held after it (1F1B's steady state), with that `transient`;
      - with full recomputation (`rebuilt`: its largest stage_transient), the gradients beside the
        inputs still held: a rebuilt block's transient recurs up to the backward's last block, when
        the gradients exist.
    `transient` is the largest stage_transient of its other stages: one backward runs at a time.
    `optimizer_step` (optimizer_step_bytes): the step's temporaries, beside the gradients once every
    activation is gone."""
    before, after = activations_before_grads, gradients + activations_with_grads
    arrays = any(isinstance(x, np.ndarray) for x in (before, after, transient, rebuilt, optimizer_step))
    top = np.maximum if arrays else max
    held = top(top(before, after) + transient, gradients + optimizer_step)
    if arrays:
        held = np.where(np.asarray(rebuilt) > 0, np.maximum(held, gradients + before + rebuilt), held)
    elif rebuilt:
        held = max(held, gradients + before + rebuilt)
    return static - gradients + held


# FSDP2 with reshard_after_forward (runtime/parallel.py): the stage root's own weights (embedding,
# final norm, head) and the last block are never resharded, and the peak comes at backward's start,
# before it gathers another block: root and last block, RESHARD_GATHERED_BLOCKS more (measured on
# CPU: none, dp 2 with one and with two micro-batches; a GPU's backward prefetch may overlap one
# more block's gather with the last block's backward, one block's 16-bit weights).
RESHARD_GATHERED_BLOCKS = 0


def gathered_under_reshard(root_params, largest_block_params, n_blocks):
    """Parameters FSDP2 holds unsharded at the peak with reshard_after_forward. With several
    micro-batches torch pipelining keeps a non-last backward's gathered weights until the next
    forward reshards them, but activations are then near zero: the peak still comes at a backward's
    start (measured: dp 2, 2 micro-batches, tests/test_memory.py)."""
    return root_params + np.minimum(n_blocks, 1 + RESHARD_GATHERED_BLOCKS) * largest_block_params


def static_state_bytes(params_per_rank, dp: int, dp_mode: str, bytes_per_value: int, microbatches: int):
    """Weights, gradients and AdamW state per rank (params_per_rank: what a rank computes with,
    before dp sharding; may be an array): the sum of state_split. FSDP2 as the runtime applies it
    under torch pipelining: weights and moments sharded over dp, the unsharded compute weights held
    all step (reshard_after_forward=False: pipelining runs many forwards), gradients as
    state_split says. Replicate / no dp: 16 bytes/param whole."""
    return sum(state_split(params_per_rank, dp, dp_mode, bytes_per_value, microbatches).values())


MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "transient", "buffers", "workspace")
