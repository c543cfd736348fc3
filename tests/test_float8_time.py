"""train.float8's dynamic-scaling casts in time (hrlplan/cost/float8_time.py): which tensors are cast
(torchao's Float8Linear), their bytes eager and compiled (torchao's own roofline when compiled), and
what they take off the fp8 peak's gain on a Llama-2-7B block. No run: the cost model's terms."""
from __future__ import annotations

import pytest

from hrlplan.cluster import DeviceInfo
from hrlplan.cost import float8_time as ft
from hrlplan.cost import kernels
from hrlplan.cost.model import CostOptions, StageCostModel
from hrlplan.search.instances import load_cluster
from test_cost import llama7b_meta


def _llama7b(seq=4096):
    meta = llama7b_meta(seq)
    meta.extra = dict(meta.extra or {}, ffn_size=11008, gated_mlp=True, query_width=4096, kv_width=4096,
                      block_class="LlamaDecoderLayer")
    return meta


def test_compiled_casts_are_torchaos_tensorwise_roofline():
    """torchao/testing/training/roofline_utils.py (tensorwise, fusion modelled): input and grad_output
    read once in bf16 and written in both fp8 layouts (amax fused upstream); the weight's amax reads
    it, then one cast per layout."""
    m, k, n = 4096.0, 1024.0, 2048.0
    fwd, bwd = ft.linear_cast_kernels(m, k, n, 2, compiled=True)
    assert fwd == [(2 + 2) * m * k, 2 * k * n, (2 + 1) * k * n]
    assert bwd == [(2 + 2) * m * n, (2 + 1) * k * n]


def test_eager_casts_run_each_op_of_torchaos_code_for_six_casts():
    """Eager: max(abs(x)) (abs written and read back), to(float32), * scale, clamp, to(float8) -- 33
    bytes an element from bf16 -- for input and weight forward, grad_output twice, weight and input
    again backward."""
    assert sum(ft.eager_cast_kernels(2)) == 3 * 2 + (2 + 4) + 8 + 8 + 5 == 33
    assert sum(ft.eager_cast_kernels(4)) == 3 * 4 + 8 + 8 + 5   # fp32: no upcast
    m, k, n = 512.0, 256.0, 128.0
    fwd, bwd = ft.linear_cast_kernels(m, k, n, 2, compiled=False)
    assert sum(fwd) == 33 * (m * k + k * n)
    assert sum(bwd) == 33 * (2 * m * n + k * n + m * k)
    cf, cb = ft.linear_cast_kernels(m, k, n, 2, compiled=True)
    assert sum(cf) + sum(cb) < (sum(fwd) + sum(bwd)) / 5


def test_swapped_linears_are_the_float8_rule_sharded_over_tp():
    meta = _llama7b()
    whole = ft.swapped_linears(meta, 1)
    assert whole == [(4096, 4096)] * 4 + [(4096, 11008)] * 2 + [(11008, 4096)]   # q k v o gate up down
    # column-parallel split their output, row-parallel (o, down) their input
    assert ft.swapped_linears(meta, 8) == [(4096, 512)] * 3 + [(512, 4096)] + [(4096, 1376)] * 2 + [(1376, 4096)]
    small = _llama7b()
    small.hidden_size, small.extra = 1024, dict(small.extra, ffn_size=1024, query_width=1024, kv_width=1024)
    assert ft.swapped_linears(small, 1) == []   # torchao's small-matmul rule: K <= 4096 and N <= 1024


def test_casts_are_bytes_at_hbm_speed_and_nothing_off_cuda():
    meta, h100 = _llama7b(), load_cluster("h100x8-4n").devices[0]
    hbm, _ = kernels.gpu_facts(h100.name, h100.peak_flops)
    f1, b1 = ft.block_cast_seconds(meta, h100, 4096, 1, 2, compiled=True)
    f2, b2 = ft.block_cast_seconds(meta, h100, 8192, 1, 2, compiled=True)
    fwd, bwd = zip(*(ft.linear_cast_kernels(4096, k, n, 2, True) for k, n in ft.swapped_linears(meta, 1)))
    assert f1 == pytest.approx(sum(map(sum, fwd)) / (hbm * kernels.MEMORY_FRACTION))
    assert b1 == pytest.approx(sum(map(sum, bwd)) / (hbm * kernels.MEMORY_FRACTION))
    assert f1 < f2 < 2 * f1 and b1 < b2 < 2 * b1   # the weights' casts do not grow with tokens
    cpu = DeviceInfo(rank=0, node=0, local_rank=0, hostname="host", kind="cpu", name="cpu", memory_bytes=2 ** 34,
                     peak_flops=1e11)
    assert ft.block_cast_seconds(meta, cpu, 4096, 1, 2, compiled=True) == (0.0, 0.0)


def test_recomputation_casts_the_rerun_forward_again():
    meta, h100 = _llama7b(), load_cluster("h100x8-4n").devices[0]
    fwd, bwd = ft.stage_cast_seconds(meta, [h100], 4096, 1, 2, True, "none")
    assert ft.stage_cast_seconds(meta, [h100], 4096, 1, 2, True, "full") == pytest.approx((fwd, bwd + fwd))
    _, selective = ft.stage_cast_seconds(meta, [h100], 4096, 1, 2, True, "selective")
    assert bwd < selective < bwd + fwd


def _block_gain(meta, cluster, tp, compiled):
    """bf16 / fp8 step time of the 32 blocks on tp GPUs: (upper bound without the casts, with the casts
    as the stage cost charges them: n_blocks x stage_cast_seconds)."""
    def stage(float8):
        model = StageCostModel(meta, cluster, CostOptions(bytes_per_value=2, float8=float8, compile=compiled,
                                                          compile_speedup=1.0))
        cost = model.stage(0, 32, False, False, list(range(tp)), tp, 1, 1, 1, microbatches=1)
        return cost.fwd + cost.bwd
    cast_f, cast_b = ft.stage_cast_seconds(meta, cluster.devices[:tp], 4096, tp, 2, compiled)
    base, charged = stage(False), stage(True)   # the stage cost adds n_blocks x stage_cast_seconds itself
    return base / (charged - 32 * (cast_f + cast_b)), base / charged


def test_casts_bring_the_fp8_gain_below_its_upper_bound():
    """Llama-2-7B at 4096 tokens on H100s: compiled, the gain stays above 1 but below the fp8 peak's
    bound (torchtitan reports 1.2-1.5x for Llama 3 8B-70B, compiled); eager, torchao's unfused casts
    cost more than fp8 gains -- why torchtitan's float8 docs call compile required."""
    meta, cluster = _llama7b(), load_cluster("h100x8-4n")
    upper, compiled = _block_gain(meta, cluster, 1, compiled=True)
    _, eager = _block_gain(meta, cluster, 1, compiled=False)
    print(f"llama-7b tp1: upper {upper:.2f}x, compiled {compiled:.2f}x, eager {eager:.2f}x")
    assert 1.2 < compiled < upper
    assert eager < 1.0 < compiled
    upper8, compiled8 = _block_gain(meta, cluster, 8, compiled=True)
    assert 1.0 < compiled8 < upper8 and compiled8 < compiled   # narrower shards: casts weigh more
