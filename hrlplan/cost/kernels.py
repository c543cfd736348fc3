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

GEMM_PEAK_FRACTION = 0.80    # of the datasheet dense peak: what cuBLAS sustains on large GEMMs
GEMM_TILE = 128
GEMM_K_HALF = 96             # K at which a tile's main loop is half its time
ATTENTION_FRACTION = 0.45    # attention core without a measured curve (unfused, or a GPU FLASH2_FWD_BWD lacks)
MEMORY_FRACTION = 0.80       # of HBM bandwidth reached by elementwise kernels
KERNEL_LAUNCH_S = 4e-6
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
FLASH2_FWD_BWD = {
    "A100": (312e12, ((512, 99), (1024, 133), (2048, 155), (4096, 173), (8192, 182), (16384, 189))),
    "H100": (989e12, ((512, 163), (1024, 221), (2048, 265), (4096, 294), (8192, 308), (16384, 328))),
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
    tokens = set(re.split(r"[\s\-_/]+", name.upper()))
    for key, bw, sms in GPU_FACTS:
        if set(key.split()) <= tokens:
            return key, bw, sms
    return None


def in_kernel_table(name: str) -> bool:
    """Whether GPU_FACTS knows the device (its HBM bandwidth and SM count are then the part's own)."""
    return _table_entry(name) is not None


def gpu_facts(name: str, peak: float) -> Tuple[float, int]:
    """(HBM bandwidth, SM count) of a device name. A GPU the table lacks gets a guess -- a 150
    FLOP/byte ridge and an A100's 108 SMs -- that the cost model reports as such (cost_options'
    kernel_table_missing in every prediction's breakdown, and a warning)."""
    entry = _table_entry(name)
    return (entry[1], entry[2]) if entry else (peak / 150.0, 108)


@dataclass(frozen=True)
class GpuKernels:
    peak: float          # dense FLOP/s the GEMM fraction applies to
    hbm: float           # bytes/s
    sms: int
    gemm_fraction: float = GEMM_PEAK_FRACTION
    name: str = ""       # the device's name: its FlashAttention-2 curve, where one is published

    def gemm(self, m: float, n: float, k: float, bpv: int) -> float:
        """Seconds of one (m x k) @ (k x n) GEMM."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        tiles_m, tiles_n = math.ceil(m / GEMM_TILE), math.ceil(n / GEMM_TILE)
        tiles = tiles_m * tiles_n
        waves = math.ceil(tiles / self.sms)
        eff = (tiles / (waves * self.sms)) * (m / (tiles_m * GEMM_TILE)) * (n / (tiles_n * GEMM_TILE))
        eff *= k / (k + GEMM_K_HALF)
        compute = 2.0 * m * n * k / (self.peak * self.gemm_fraction * eff)
        traffic = bpv * (m * k + k * n + m * n) / (self.hbm * MEMORY_FRACTION)
        return max(compute, traffic) + KERNEL_LAUNCH_S

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


def block_times(k: GpuKernels, meta, matmul_params: float, tokens: float, tp: int, bpv: int,
                attention_flops_per_token: float, fused_attention: bool = True) -> Tuple[float, float, float]:
    """(forward, backward, attention core forward) seconds of one block on one micro-batch. An
    attention that is not fused writes its a x s scores per token and reads them back through the
    softmax, dropout and the product with V (six 16-bit passes and a one-byte mask, Megatron's fused
    softmax included): memory-bound work that shrinks relative to the GEMMs as h grows."""
    h = float(meta.hidden_size)
    a, w = block_widths(meta, matmul_params)
    fwd = bwd = 0.0
    for m, n, kk in ((tokens, 3 * a / tp, h), (tokens, h, a / tp), (tokens, w / tp, h), (tokens, h, w / tp)):
        f, b = k.gemm_fwd_bwd(m, n, kk, bpv)
        fwd, bwd = fwd + f, bwd + b
    flash = flash_attention_fraction(k.name, meta.seq_len) if fused_attention and bpv == 2 else None
    core = tokens * attention_flops_per_token / tp / (k.peak * (flash or ATTENTION_FRACTION))
    if not fused_attention:
        core += k.elementwise(tokens * meta.num_heads * meta.seq_len / tp * (6 * bpv + 1))
    # norms, residual adds, bias + activation, dropout: ~12h replicated + 2W/tp values read or written per token
    moved = k.elementwise(tokens * bpv * (12.0 * h + 2.0 * w / tp))
    return fwd + core + moved, bwd + 2.0 * core + 2.0 * moved, core


def head_times(k: GpuKernels, meta, tokens: float, tp: int, bpv: int) -> Tuple[float, float]:
    """(forward, backward) of the output head on a micro-batch: its GEMM (vocabulary over `tp`
    shards when vocabulary-parallel, else tp=1) and the cross-entropy over fp32 logits."""
    h = float(meta.hidden_size)
    v = meta.head_flops_fwd_per_token / (2.0 * h)   # the head's output width, as its FLOPs count it
    if v <= 0:
        return 0.0, 0.0
    f, b = k.gemm_fwd_bwd(tokens, v / tp, h, bpv)
    loss = k.elementwise(tokens * (v / tp) * (bpv + 3 * 4))
    return f + loss, b + loss


def kernels_for(device, peak: float, measured: bool) -> Optional[GpuKernels]:
    """The kernel model of a CUDA device (None for a CPU). A probed peak is already a sustained GEMM
    rate: it is used whole; a datasheet peak is discounted by GEMM_PEAK_FRACTION."""
    if device.kind != "cuda":
        return None
    hbm, sms = gpu_facts(device.name, peak)
    return GpuKernels(peak=peak, hbm=hbm, sms=sms, gemm_fraction=1.0 if measured else GEMM_PEAK_FRACTION,
                      name=device.name)
