"""Shape-aware GPU compute: a transformer block's kernels costed from their shapes.

A block's forward is four GEMMs -- QKV (T x h -> 3h/tp), attention output (T x h/tp -> h), MLP up
(T x h -> W/tp) and down (T x W/tp -> h), T the tokens of a micro-batch, W the MLP's width from the
block's matmul parameters -- plus the attention core and the elementwise work. Backward runs two
GEMMs per forward GEMM (input and weight gradients, transposed shapes).

- GEMM: a roofline, max(FLOPs / (peak x GEMM_PEAK_FRACTION x tile efficiency), bytes / HBM
  bandwidth). Tile efficiency is the wave quantisation of 128 x 128 output tiles over the SMs and the
  padding of M and N to whole tiles, times K / (K + GEMM_K_HALF) for the per-tile prologue/epilogue:
  it is what makes small micro-batches, narrow tp shards and small hidden sizes slow.
- Attention core: fused (scaled_dot_product_attention's flash kernel) at the speed FlashAttention-2's
  own benchmark measured on that GPU at that sequence length (FLASH2_FWD_BWD); unfused (Megatron's
  batched GEMMs around a fused softmax) and GPUs without a published curve at ATTENTION_FRACTION.
- Norms, activations, residual adds, dropout: memory-bound, ELEMENTWISE_BYTES per token moved at
  HBM bandwidth x MEMORY_FRACTION.
Every constant is global (one GPU model for every model and cluster); docs/cost-model.md lists each
with its source, or says it has none. bench/published.py checks them, through the command line,
against Megatron-LM's measured table; none is set from it. A device's compute_efficiency calibration, or a CPU,
keeps the flat FLOPs / (peak x efficiency) model.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Tuple

GEMM_PEAK_FRACTION = 0.80    # of the datasheet dense peak: what cuBLAS sustains on large GEMMs (cited)
GEMM_TILE = 128
# bench/fit_kernel_constants.py on docs/measurements/h200_kernels.json (torch 2.11 on one H200):
GEMM_K_HALF = 112            # K at which a tile's main loop is half its time (fitted to the measured GEMMs)
MEMORY_FRACTION = 0.71       # of HBM bandwidth, the median elementwise kernel's (copy, add, GELU, norms)
GEMM_MEMORY_FRACTION = 0.40  # of HBM bandwidth, the median memory-bound GEMM's (operands and output moved)
KERNEL_LAUNCH_S = 10.3e-6    # the interval of back-to-back eager kernels
# the fused attention core on a GPU without a measured or published rate (FLASH2_FWD_BWD): no source
ATTENTION_FRACTION = 0.45
# Norms, residual adds, bias + activation, rotary, dropout of a block: ELEMENTWISE_H[runtime] x h +
# ELEMENTWISE_W x W/tp values per token read or written in forward, twice that in backward.
# megatron: a count of its fused block (two norms 2h each, two bias-dropout-adds 3h each plus a one-byte
#   mask counted as half a value, bias + GeLU 2W/tp).
# torch: measured -- Hugging Face's eager Llama and GPT-2 blocks (fp32 norms, rotary, unfused
#   activations, dropout: many more, smaller kernels), what the measured whole blocks took beyond their
#   GEMMs and attention, median of six (bench/fit_kernel_constants.py).
# Under sequence parallelism a tp rank norms and adds only its tokens/tp (Korthikanti et al. 2022, sec.
# 4.2.2): the whole h term is divided by tp. Without it, the part outside the tp-sharded attention and
# MLP -- the two norms and two residual adds, ELEMENTWISE_H_REPLICATED -- runs whole on every tp rank and
# only the rest divides by tp. megatron: all of its 12h is norms and bias-dropout-adds. torch: a count of
# Hugging Face's eager Llama block outside its attention and MLP: each LlamaRMSNorm moves 18h (cast to
# fp32 1 + 2, pow 2 + 2, mean 2, scale 2 + 2, cast back 2 + 1, times the weight 1 + 1, in 16-bit values),
# each residual add 3h (two reads, one write): 2 x 18 + 2 x 3 = 42h of the measured 110h.
ELEMENTWISE_H = {"megatron": 12.0, "torch": 110.0}
ELEMENTWISE_H_REPLICATED = {"megatron": 12.0, "torch": 42.0}
ELEMENTWISE_W = 2.0
# SMs a Transformer Engine userbuffers communication kernel takes beside an overlapped GEMM (its
# default num_sm for the "pipeline" and "bulk" methods, transformer_engine/pytorch/module/base.py)
TE_COMM_SMS = 16
# an unfused attention's passes over its scores beyond its GEMMs' (forward: softmax read + write,
# dropout read + write; backward: dropout's read + write, softmax's two reads + write), plus a mask byte
UNFUSED_SCORE_PASSES = (4, 5)
# Bytes per logit the loss moves (forward, backward), beside the head's GEMM. megatron: a count of
# megatron/core/tensor_parallel/cross_entropy.py's unfused vocab-parallel cross-entropy (the default;
# --cross-entropy-loss-fusion is off), each op one pass over the logits: forward .float() 2 + 4, max 4,
# in-place subtract of the max 4 + 4, exp in place 4 + 4, sum 4, divide in place 4 + 4 (38); backward
# the in-place multiply by the loss's gradient 4 + 4 and the cast back to 16 bits 4 + 2 (14). Other
# runtimes: the fp32 logits written and read with a 16-bit read, bpv + 12 each way (no count).
LOSS_BYTES = {"megatron": (38, 14)}
# Bytes an AdamW step moves per fp32 parameter (counts, not measurements). fused (torch's fused=True,
# Apex / Transformer Engine FusedAdam): the parameter, gradient and both moments read, the parameter and
# moments written, 7 x 4. foreach (torch's multi-tensor path, which this package's runtime takes for
# DTensor parameters: devices.optimizer_impl): one pass per op -- weight decay 8, exp_avg lerp 12,
# exp_avg_sq mul 8 and addcmul 12, sqrt 8, divide 8, add eps 8, addcdiv into the parameter 16 -- 80.
OPTIMIZER_STEP_BYTES = {"fused": 7 * 4, "foreach": 80}
# The gradient clipping before it: the norm reads the gradients (4); torch's clip_grads_with_norm_
# then scales them whatever the norm (read + write, 8 more); Megatron scales only a gradient over the limit.
CLIP_BYTES = {"megatron": 4, "torch": 12}
# (HBM bytes/s, SMs) by the whole tokens of the device name, the first row whose tokens the name has
# (see docs/cost-model.md for the sources). "H100 96GB": the HBM2e part of Meta's Grand Teton hosts,
# 2.4 TB/s (pytorch/torchtitan docs/performance.md), before the 80 GB HBM3 SXM5 part.
GPU_FACTS = (("H200", 4.8e12, 132), ("H100 96GB", 2.4e12, 132), ("H100", 3.35e12, 132), ("H800", 3.35e12, 132),
             ("H20", 4.0e12, 78),
             ("A100", 2.04e12, 108), ("A800", 2.04e12, 108), ("V100", 0.9e12, 80), ("L40S", 0.86e12, 142),
             ("A10", 0.6e12, 72), ("L4", 0.3e12, 58), ("T4", 0.32e12, 40), ("MI300X", 5.3e12, 304))

# FlashAttention-2's measured forward + backward speed in 16-bit, causal mask, head dimension 128, by
# sequence length: TFLOP/s as its benchmark counts them, and the datasheet dense peak of the part.
# Dao-AILab/flash-attention README.md "Performance", panel (d) of assets/flash2_a100_fwd_bwd_benchmark.png
# (A100 80GB SXM4) and assets/flash2_h100_fwd_bwd_benchmark.png (H100 80GB SXM5), commit 0251105a.
# H200: measured, torch 2.11's scaled_dot_product_attention on one H200 in the same count
# (docs/measurements/h200_kernels.json "attention", bench/fit_kernel_constants.py) -- the kernel torch
# picks on SM90 reaches 1.6x FlashAttention-2's published H100 rate; the H100 keeps FlashAttention-2's.
FLASH2_FWD_BWD = {
    "A100": (312e12, ((512, 99), (1024, 133), (2048, 155), (4096, 173), (8192, 182), (16384, 189))),
    "H100": (989e12, ((512, 163), (1024, 221), (2048, 265), (4096, 294), (8192, 308), (16384, 328))),
    "H200": (989.4e12, ((512, 146.7), (1024, 266.1), (2048, 356.5), (4096, 466.3), (8192, 519.1), (16384, 546.1))),
}
# That benchmark counts a causal pass as half of 4 s d FLOPs per query and forward + backward as 3.5
# forwards; the cost model charges 3 forwards of the whole 4 s h per token. Equal times need a fraction
# of the peak of 3 / (3.5 / 2) = 12/7 times the measured rate over the peak.
FLASH2_COUNT_RATIO = 3.0 / 1.75


def flash_attention_fraction(name: str, seq_len: float) -> Optional[float]:
    """The fraction of the datasheet peak the cost model's fused attention runs at on this GPU and
    sequence length (FLASH2_FWD_BWD, linear in log2 of the length, clamped to its ends); None for a
    GPU without a published curve."""
    entry = _table_entry(name)
    curve = FLASH2_FWD_BWD.get(entry[0].split()[0]) if entry else None   # its part's curve ("H100 96GB": H100's)
    if curve is None:
        return None
    peak, points = curve
    x = math.log2(max(float(seq_len), 1.0))
    xs = [math.log2(s) for s, _ in points]
    if x <= xs[0]:
        tflops = points[0][1]
    elif x >= xs[-1]:
        tflops = points[-1][1]
    else:
        i = next(j for j in range(1, len(xs)) if x <= xs[j])
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        tflops = points[i - 1][1] + w * (points[i][1] - points[i - 1][1])
    return FLASH2_COUNT_RATIO * tflops * 1e12 / peak


def _table_entry(name: str) -> Optional[Tuple[str, float, int]]:
    """The GPU_FACTS row whose key is a whole token of the name ('NVIDIA A100-SXM4-80GB' -> A100): an
    A10G or an L40 is not taken for an A10 or an L4."""
    for key, bw, sms in GPU_FACTS:
        if name_has_key(name, key):
            return key, bw, sms
    return None


def name_has_key(name: str, key: str) -> bool:
    """Whether every whole token of a table key ('H100 96GB') is a token of the device name."""
    return set(key.upper().split()) <= set(re.split(r"[\s\-_/]+", name.upper()))


def in_kernel_table(name: str) -> bool:
    """Whether GPU_FACTS knows the device (its HBM bandwidth and SM count are then the part's own)."""
    return _table_entry(name) is not None


def gpu_facts(name: str, peak: float) -> Tuple[float, int]:
    """(HBM bandwidth, SM count) of a device name. A GPU the table lacks gets a guess -- a 150
    FLOP/byte ridge and an A100's 108 SMs -- that the cost model reports as such (cost_options'
    kernel_table_missing in every prediction's breakdown, and a warning)."""
    entry = _table_entry(name)
    return (entry[1], entry[2]) if entry else (peak / 150.0, 108)


def gemm_seconds(m: float, n: float, k: float, bpv: int, sustained: float, hbm: float, sms: int,
                 k_half: Optional[float] = None, launch: Optional[float] = None,
                 memory_fraction: Optional[float] = None) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM at `sustained` FLOP/s on large shapes: the roofline of
    its FLOPs at that rate times the tile efficiency (wave quantisation of GEMM_TILE^2 output tiles
    over the SMs, M and N padded to whole tiles, K / (K + k_half)) and its operands' bytes at HBM
    bandwidth x GEMM_MEMORY_FRACTION, plus one kernel launch. The constants default to the module's (bench/fit_kernel_constants.py
    passes its own)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    k_half = GEMM_K_HALF if k_half is None else k_half
    tiles_m, tiles_n = math.ceil(m / GEMM_TILE), math.ceil(n / GEMM_TILE)
    tiles = tiles_m * tiles_n
    waves = math.ceil(tiles / sms)
    eff = (tiles / (waves * sms)) * (m / (tiles_m * GEMM_TILE)) * (n / (tiles_n * GEMM_TILE)) * k / (k + k_half)
    traffic = bpv * (m * k + k * n + m * n) / (hbm * (GEMM_MEMORY_FRACTION if memory_fraction is None else memory_fraction))
    return max(2.0 * m * n * k / (sustained * eff), traffic) + (KERNEL_LAUNCH_S if launch is None else launch)


@dataclass(frozen=True)
class GpuKernels:
    peak: float          # dense FLOP/s the GEMM fraction applies to
    hbm: float           # bytes/s
    sms: int
    gemm_fraction: float = GEMM_PEAK_FRACTION
    name: str = ""       # the device's name: its FlashAttention-2 curve, where one is published

    def gemm(self, m: float, n: float, k: float, bpv: int) -> float:
        """Seconds of one (m x k) @ (k x n) GEMM."""
        return gemm_seconds(m, n, k, bpv, self.peak * self.gemm_fraction, self.hbm, self.sms)

    def gemm_fwd_bwd(self, m: float, n: float, k: float, bpv: int) -> Tuple[float, float]:
        """(forward, backward): backward is dX = dY W^T (m x n x k) and dW = X^T dY (k x n over m)."""
        return self.gemm(m, n, k, bpv), self.gemm(m, k, n, bpv) + self.gemm(k, n, m, bpv)

    def elementwise(self, nbytes: float) -> float:
        return nbytes / (self.hbm * MEMORY_FRACTION)


def block_widths(meta, matmul_params: float) -> Tuple[float, float]:
    """(attention projection width, MLP width W) of a block: 4h^2 of attention, the rest MLP (two
    GEMMs of h x W each -- a gated MLP's gate+up and down have the same FLOPs as that)."""
    h = float(meta.hidden_size)
    attn = min(4.0 * h * h, matmul_params)
    return attn / (4.0 * h), max(matmul_params - attn, 0.0) / (2.0 * h)


def optimizer_bytes_per_param(runtime: str, dtensor: bool) -> float:
    """A parameter's bytes through clipping and AdamW: Megatron's FusedAdam; this package's runtime
    fused on plain CUDA parameters, foreach on DTensor ones (FSDP2 shards, tp's sharded linears)."""
    impl = "foreach" if runtime != "megatron" and dtensor else "fused"
    return OPTIMIZER_STEP_BYTES[impl] + CLIP_BYTES.get(runtime, CLIP_BYTES["torch"])


def optimizer_step_s(k: GpuKernels, params: float, bytes_per_param: float) -> float:
    """Seconds of clipping and an AdamW step over `params` parameters on this GPU: memory-bound,
    `bytes_per_param` (optimizer_bytes_per_param) at HBM bandwidth x MEMORY_FRACTION."""
    return params * bytes_per_param / (k.hbm * MEMORY_FRACTION)


def block_times(k: GpuKernels, meta, matmul_params: float, tokens: float, tp: int, bpv: int,
                attention_flops_per_token: float, fused_attention: bool = True,
                runtime: str = "megatron", sequence_parallel: bool = False,
                tp_overlap: bool = False) -> Tuple[float, float, float]:
    """(forward, backward, attention core forward) seconds of one block on one micro-batch: its four
    GEMMs and their backward (as Transformer Engine's comm-GEMM overlap runs them where `tp_overlap`:
    tp_overlap_gemms), the attention core (fused: at the GPU's measured fused-attention rate;
    unfused: unfused_attention_core), and the runtime's ELEMENTWISE values per token at HBM speed
    (twice in backward; the norms and residual adds on a sequence-parallel stage's shard of the tokens)."""
    h = float(meta.hidden_size)
    a, w = block_widths(meta, matmul_params)
    shapes = ((tokens, 3 * a / tp, h), (tokens, h, a / tp), (tokens, w / tp, h), (tokens, h, w / tp))
    if tp_overlap and tp > 1:
        fwd, bwd = tp_overlap_gemms(k, shapes, tp, bpv)
    else:
        fwd = bwd = 0.0
        for m, n, kk in shapes:
            f, b = k.gemm_fwd_bwd(m, n, kk, bpv)
            fwd, bwd = fwd + f, bwd + b
    if fused_attention:
        flash = flash_attention_fraction(k.name, meta.seq_len) if bpv == 2 else None
        core = tokens * attention_flops_per_token / tp / (k.peak * (flash or ATTENTION_FRACTION))
        core_bwd = 2.0 * core
    else:
        core, core_bwd = unfused_attention_core(k, meta, tokens, tp, bpv)
    per_h = elementwise_h_per_rank(runtime, tp, sequence_parallel)
    moved = k.elementwise(tokens * bpv * (per_h * h + ELEMENTWISE_W * w / tp))
    return fwd + core + moved, bwd + core_bwd + 2.0 * moved, core


def elementwise_h_per_rank(runtime: str, tp: int, sequence_parallel: bool) -> float:
    """A tp rank's share of a block's ELEMENTWISE_H values per token (in h): all of it over tp under
    sequence parallelism; without it the norms and residual adds (ELEMENTWISE_H_REPLICATED) whole and
    the rest, inside the sharded attention and MLP, over tp."""
    total, replicated = ELEMENTWISE_H[runtime], ELEMENTWISE_H_REPLICATED[runtime]
    if sequence_parallel or tp <= 1:
        return total / max(tp, 1)
    return replicated + (total - replicated) / tp


def tp_overlap_gemms(k: GpuKernels, shapes, tp: int, bpv: int) -> Tuple[float, float]:
    """(forward, backward) seconds of a block's four GEMMs (QKV, attention output, MLP up, MLP down:
    `shapes`) under Transformer Engine's userbuffers comm-GEMM overlap (Megatron-Core's --tp-comm-overlap),
    as its default configuration (transformer_engine/pytorch/module/base.py initialize_ub) runs them:
    - "ring_exchange" (the all-gathers: QKV and MLP-up forward, attention-output and MLP-down input
      gradients): the GEMM in tp chunks of tokens/tp rows, one per ring step (num_splits = tp);
    - "pipeline" (the reduce-scatters: attention-output and MLP-down forward): 4 chunks of tokens/4 rows
      (num_splits 4), beside a 16-SM communication kernel (num_sm 16);
    - "bulk" (QKV and MLP-up input and weight gradients): the whole GEMM beside a 16-SM kernel;
    - the other two weight gradients run alone.
    A GEMM beside a communication kernel gets the SMs it leaves (TE_COMM_SMS)."""
    def chunked(m, n, kk, splits, sms):
        return splits * gemm_seconds(m / splits, n, kk, bpv, k.peak * k.gemm_fraction, k.hbm, sms)
    beside = max(k.sms - TE_COMM_SMS, 1)
    (qm, qn, qk), (om, on, ok), (um, un, uk), (dm, dn, dk) = shapes
    fwd = (chunked(qm, qn, qk, tp, k.sms) + chunked(om, on, ok, 4, beside)
           + chunked(um, un, uk, tp, k.sms) + chunked(dm, dn, dk, 4, beside))
    bwd = (chunked(qm, qk, qn, 1, beside) + chunked(qk, qn, qm, 1, beside)       # QKV: bulk dgrad, wgrad
           + chunked(om, ok, on, tp, k.sms) + k.gemm(ok, on, om, bpv)            # attention output
           + chunked(um, uk, un, 1, beside) + chunked(uk, un, um, 1, beside)     # MLP up: bulk
           + chunked(dm, dk, dn, tp, k.sms) + k.gemm(dk, dn, dm, bpv))           # MLP down
    return fwd, bwd


def unfused_attention_core(k: GpuKernels, meta, tokens: float, tp: int, bpv: int) -> Tuple[float, float]:
    """(forward, backward) of an attention core that materialises its scores (Megatron-LM's batched
    GEMMs around its fused scale-mask-softmax): Q K^T (s x s x d) and the product with V (s x d x s)
    per sequence and head, batched along M, on the GEMM model -- small K or N make them memory-bound,
    as measured -- plus the passes over the s x s scores the GEMMs do not make: softmax read and
    written, dropout read and written with its one-byte mask (UNFUSED_SCORE_PASSES, in values)."""
    s, heads = float(meta.seq_len), meta.num_heads / tp
    d = float(meta.hidden_size) / meta.num_heads
    batch = tokens / s * heads
    qk, av = k.gemm(batch * s, s, d, bpv), k.gemm(batch * s, d, s, bpv)
    scores = batch * s * s
    fwd = qk + av + k.elementwise(scores * (UNFUSED_SCORE_PASSES[0] * bpv + 1))
    # backward: dQ, dK (s x d x s each), dP = dO V^T (s x s x d), dV = P^T dO (s x d x s)
    bwd = 3.0 * av + qk + k.elementwise(scores * (UNFUSED_SCORE_PASSES[1] * bpv + 1))
    return fwd, bwd


def head_times(k: GpuKernels, meta, tokens: float, tp: int, bpv: int,
               runtime: str = "torch") -> Tuple[float, float]:
    """(forward, backward) of the output head on a micro-batch: its GEMM (vocabulary over `tp`
    shards when vocabulary-parallel, else tp=1) and the cross-entropy over fp32 logits."""
    h = float(meta.hidden_size)
    v = meta.head_flops_fwd_per_token / (2.0 * h)   # the head's output width, as its FLOPs count it
    if v <= 0:
        return 0.0, 0.0
    f, b = k.gemm_fwd_bwd(tokens, v / tp, h, bpv)
    loss_f, loss_b = (k.elementwise(tokens * (v / tp) * n) for n in LOSS_BYTES.get(runtime, (bpv + 12, bpv + 12)))
    return f + loss_f, b + loss_b


def kernels_for(device, peak: float, measured: bool) -> Optional[GpuKernels]:
    """The kernel model of a CUDA device (None for a CPU). A probed peak is already a sustained GEMM
    rate: it is used whole; a datasheet peak is discounted by GEMM_PEAK_FRACTION."""
    if device.kind != "cuda":
        return None
    hbm, sms = gpu_facts(device.name, peak)
    return GpuKernels(peak=peak, hbm=hbm, sms=sms, gemm_fraction=1.0 if measured else GEMM_PEAK_FRACTION,
                      name=device.name)
