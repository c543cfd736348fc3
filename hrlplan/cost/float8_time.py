"""train.float8's casts in time: what dynamic scaling adds to a block beside its fp8 matmuls.

The cost model runs the linears torchao swaps (memory.float8_swaps) at the fp8 peak; without this
their gain would be an upper bound, since every fp8 matmul first needs its operands scaled and cast.
torchao's Float8Linear with dynamic tensorwise scaling (torchao/float8/float8_linear.py,
matmul_with_hp_or_float8_args -- the recipe runtime/float8.py converts to) keeps the high-precision
input and weight for backward and casts, per linear:
  forward   the input (tokens x in) and the weight (in x out), each to e4m3;
  backward  the output's gradient (tokens x out) to e5m2 twice -- for the input gradient and, in the
            other layout, for the weight gradient -- and the weight and the input again.
Each cast is an amax (a reduction over the tensor) then a scale-and-cast; both are memory-bound, so
their time is their bytes at HBM bandwidth x kernels.MEMORY_FRACTION, at least one launch each.

How many bytes depends on whether the block is compiled (train.compile):
- eager: the ops as torchao writes them (float8_utils.tensor_to_amax: max(abs(x)), an abs tensor
  written and read back; float8_training_tensor._ToFloat8ConstrFunc: x.to(float32) * scale, clamp,
  .to(float8)), every cast on its own -- EAGER_AMAX_PASSES and the fp32 passes of eager_cast_bytes;
- compiled: torchao's own roofline for the tensorwise recipe (torchao/testing/training/roofline_utils.py,
  get_tensor_memory_traffic_ovhd_s with fusion modelling): the input's and the output gradient's amax
  fuse with the op that made them and one kernel writes both fp8 layouts; the weight's amax reads it
  once and two kernels cast it, one per layout. torchtitan's docs/float8.md calls compile "required
  for competitive performance" for this reason.
Counted per swapped linear, as torchao's roofline counts them (q, k and v each cast their shared input).
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

from hrlplan.cost import kernels
from hrlplan.cost.memory import block_matmuls, float8_swaps, op_sac_recomputed_fraction
from hrlplan.families import is_language_model

FP8_BYTES = 1
FP32_BYTES = 4
# max(abs(x)) in eager: abs reads and writes the tensor, max reads it back (bytes per element x bpv)
EAGER_AMAX_PASSES = 3


def eager_cast_kernels(bytes_per_value: int) -> List[float]:
    """Bytes per element of each kernel one eager dynamic cast runs: the amax (abs, max), then
    to(float32) (none when already fp32), the multiply by the scale, the clamp, the cast to fp8."""
    amax = [2.0 * bytes_per_value, float(bytes_per_value)]
    upcast = [] if bytes_per_value == FP32_BYTES else [float(bytes_per_value + FP32_BYTES)]
    return amax + upcast + [2.0 * FP32_BYTES, 2.0 * FP32_BYTES, float(FP32_BYTES + FP8_BYTES)]


def linear_cast_kernels(m: float, k: float, n: float, bytes_per_value: int, compiled: bool
                        ) -> Tuple[List[float], List[float]]:
    """(forward, backward) kernels' bytes of one swapped linear's casts: `m` tokens, `k` in, `n` out
    (this rank's shard). See the module's doc for which tensors and why."""
    b = float(bytes_per_value)
    if not compiled:
        per = eager_cast_kernels(bytes_per_value)
        fwd = [x * numel for numel in (m * k, k * n) for x in per]
        bwd = [x * numel for numel in (m * n, m * n, k * n, m * k) for x in per]
        return fwd, bwd
    fused_two_layouts = b + 2 * FP8_BYTES   # amax fused upstream; one read, both fp8 layouts written
    fwd = [fused_two_layouts * m * k, b * k * n, (b + FP8_BYTES) * k * n]
    bwd = [fused_two_layouts * m * n, (b + FP8_BYTES) * k * n]
    return fwd, bwd


def swapped_linears(meta, tp: int) -> List[Tuple[float, float]]:
    """(in, out) of this rank's shard of each linear of a block that train.float8 swaps: column-
    parallel ones split their output over tp, row-parallel ones their input (memory.block_matmuls)."""
    if not is_language_model(meta):
        return []
    return [(i / tp, o) if row else (i, o / tp) for i, o, row in block_matmuls(meta) if float8_swaps(i, o)]


def _seconds(kernel_bytes: Iterable[float], hbm: float) -> float:
    rate = hbm * kernels.MEMORY_FRACTION
    return sum(max(x / rate, kernels.KERNEL_LAUNCH_S) for x in kernel_bytes)


def block_cast_seconds(meta, device, tokens: float, tp: int, bytes_per_value: int, compiled: bool
                       ) -> Tuple[float, float]:
    """(forward, backward) seconds one block's float8 casts take on `device` (a cluster DeviceInfo)
    for a micro-batch of `tokens` on each rank; (0, 0) off CUDA (train.float8 is refused there)."""
    if getattr(device, "kind", "cpu") != "cuda":
        return 0.0, 0.0
    hbm, _ = kernels.gpu_facts(device.name, device.peak_flops)
    fwd = bwd = 0.0
    for k, n in swapped_linears(meta, tp):
        f, b = linear_cast_kernels(tokens, k, n, bytes_per_value, compiled)
        fwd, bwd = fwd + _seconds(f, hbm), bwd + _seconds(b, hbm)
    return fwd, bwd


def stage_cast_seconds(meta, devices, tokens: float, tp: int, bytes_per_value: int, compiled: bool,
                       recompute: str = "none") -> Tuple[float, float]:
    """(forward, backward) per block on the slowest of `devices`: what StageCostModel.stage adds
    per block to a stage's forward and backward under train.float8. Full recomputation reruns the
    forward, its casts included; op-level selective reruns every other matmul's
    (memory.op_sac_recomputed_fraction of the FLOPs: the casts are counted by the same share)."""
    fwd, bwd = max((block_cast_seconds(meta, d, tokens, tp, bytes_per_value, compiled) for d in devices),
                   key=lambda fb: fb[0] + fb[1], default=(0.0, 0.0))
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += fwd * op_sac_recomputed_fraction(meta)
    return fwd, bwd
