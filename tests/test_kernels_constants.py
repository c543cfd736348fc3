"""Issue 33: the GPU constants of cost/kernels.py come from a measurement of the runtime (the committed
H200 file, re-derived by bench/fit_kernel_constants.py) or a citation; the optimizer step is costed
from its bytes; Megatron's own selective recomputation, tp-comm overlap and parameter-gather overlap."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hrlplan.cost import CostOptions, kernels
from hrlplan.cost.model import StageCostModel

from test_cost import llama7b_meta
from test_cost_keys import preset

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "docs" / "measurements" / "h200_kernels.json"


def test_the_module_constants_are_what_the_fit_derives_from_the_committed_measurement():
    sys.path.insert(0, str(ROOT / "bench"))
    import fit_kernel_constants

    before = (kernels.MEMORY_FRACTION, kernels.KERNEL_LAUNCH_S, kernels.GEMM_K_HALF)
    out = fit_kernel_constants.derive(json.loads(MEASURED.read_text()))
    assert (kernels.MEMORY_FRACTION, kernels.KERNEL_LAUNCH_S, kernels.GEMM_K_HALF) == before   # restored
    assert out["device"] == "NVIDIA H200"
    assert kernels.MEMORY_FRACTION == out["MEMORY_FRACTION"]["value"]
    assert kernels.KERNEL_LAUNCH_S == pytest.approx(out["KERNEL_LAUNCH_S"], rel=0.01)
    assert kernels.GEMM_K_HALF == out["GEMM_K_HALF"]["value"]
    assert kernels.ELEMENTWISE_H["torch"] == out["ELEMENTWISE_H_torch"]["value"]
    assert kernels.FLASH2_FWD_BWD["H200"][1] == tuple(out["fused_attention_fwd_bwd_tflops"])
    # the cited GEMM fraction and the largest measured GEMM agree within 2%
    assert out["GEMM_PEAK_FRACTION_check"]["fraction_of_peak"] == pytest.approx(kernels.GEMM_PEAK_FRACTION, abs=0.02)
    # the sum of the pieces against the measured Llama blocks: within 5%
    llama = [b["ratio"] for b in out["blocks_with_module_constants"] if b["block"].startswith("llama")]
    assert len(llama) == 4 and all(0.95 <= r <= 1.05 for r in llama)


def _stage(opts: CostOptions, tp: int = 8, dp: int = 1, recompute: str = "none", sp: bool = True, nodes: int = 1):
    meta = llama7b_meta()
    cluster = preset("a100x8-1n", count=nodes)
    model = StageCostModel(meta, cluster, opts)
    group = tuple(range(tp * dp))
    return model, model.stage(0, 8, True, False, group, tp, dp, 1, 1, recompute=recompute, microbatches=4,
                              sequence_parallel=sp)


def test_the_optimizer_step_of_an_uncalibrated_gpu_is_its_bytes_at_hbm_speed():
    """Clipping + AdamW over the parameters a rank steps, at HBM speed: this package's runtime steps
    DTensor parameters (tp, FSDP) with torch's foreach path, plain ones fused; Megatron's FusedAdam."""
    model, c = _stage(CostOptions(bytes_per_value=2, dp_mode="replicate"), tp=2, dp=4, sp=False)
    per_rank = model.span_params(0, 8, True, False, 1, 2)
    rate = 2.04e12 * kernels.MEMORY_FRACTION
    assert c.optimizer == pytest.approx(per_rank * (80 + 12) / rate, rel=1e-9)   # tp 2: DTensor, foreach
    _, sharded = _stage(CostOptions(bytes_per_value=2, dp_mode="fsdp"), tp=2, dp=4, sp=False)
    assert sharded.optimizer == pytest.approx(c.optimizer / 4, rel=1e-9)   # FSDP / the distributed optimizer: a shard
    model, plain = _stage(CostOptions(bytes_per_value=2, dp_mode="replicate"), tp=1, dp=4, sp=False)
    assert plain.optimizer == pytest.approx(model.span_params(0, 8, True, False, 1, 1) * (28 + 12) / rate, rel=1e-9)
    _, megatron = _stage(CostOptions(bytes_per_value=2, dp_mode="replicate", runtime="megatron"), tp=2, dp=4, sp=False)
    assert megatron.optimizer == pytest.approx(per_rank * (28 + 4) / rate, rel=1e-9)


def test_megatron_selective_reruns_the_attention_core_and_keeps_no_scores():
    """Korthikanti et al. 2022: selective recomputes QK^T, softmax, dropout and the product with V;
    memory keeps 34h/tp per token under sequence parallelism (the 5as/h term goes)."""
    opts = CostOptions(bytes_per_value=2, dp_mode="replicate", runtime="megatron", fused_attention=False,
                       receive_buffers=False)
    model, none = _stage(opts)
    _, selective = _stage(opts, recompute="selective")
    meta = model.meta
    tokens = meta.seq_len
    core = kernels.unfused_attention_core(model.kernels[0], meta, tokens, 8, 2)[0]
    assert selective.fwd == pytest.approx(none.fwd)
    assert selective.bwd - none.bwd == pytest.approx(8 * core, rel=1e-6)   # 8 blocks, no collective again
    h = meta.hidden_size
    assert selective.activation == pytest.approx(8 * tokens * 34 * h / 8, rel=1e-9)
    scores = 5 * meta.num_heads * meta.seq_len / 8
    assert none.activation == pytest.approx(8 * tokens * (34 * h / 8 + scores), rel=1e-9)


def test_tp_comm_overlap_hides_the_sequence_parallel_collectives_under_the_gemms():
    """The collectives go under the GEMMs; the GEMMs then run as Transformer Engine's userbuffers run
    them (kernels.tp_overlap_gemms): the forward differs by the chunked GEMMs' extra time less the
    hidden communication."""
    base = dict(bytes_per_value=2, dp_mode="replicate", runtime="megatron", fused_attention=True)
    model, exposed = _stage(CostOptions(**base))
    _, overlapped = _stage(CostOptions(**base, tp_comm_overlap=True))
    assert exposed.tp_comm_fwd > 0
    assert overlapped.tp_comm_fwd < exposed.tp_comm_fwd and overlapped.tp_comm_bwd < exposed.tp_comm_bwd
    meta, k, tokens = model.meta, model.kernels[0], float(model.meta.seq_len)
    a, w = kernels.block_widths(meta, float(meta.block_matmul_params[0]))
    h = float(meta.hidden_size)
    shapes = ((tokens, 3 * a / 8, h), (tokens, h, a / 8), (tokens, w / 8, h), (tokens, h, w / 8))
    chunked = sum(kernels.tp_overlap_gemms(k, shapes, 8, 2))
    plain = sum(sum(k.gemm_fwd_bwd(*s, 2)) for s in shapes)
    assert chunked > plain   # smaller row blocks and SMs given to the communication kernel
    # the stage's forward is a third of forward + backward (the 1:2 split uncalibrated), for 8 blocks
    assert overlapped.fwd - exposed.fwd == pytest.approx(
        8 * (chunked - plain) / 3 - (exposed.tp_comm_fwd - overlapped.tp_comm_fwd), rel=1e-6)
    _, no_sp = _stage(CostOptions(**base, tp_comm_overlap=True), sp=False)   # Megatron needs SP for it
    assert no_sp.tp_comm_fwd == pytest.approx(exposed.tp_comm_fwd)


def test_unfused_attention_is_costed_by_its_gemms_and_score_passes():
    meta = llama7b_meta()
    k = kernels.GpuKernels(peak=312e12, hbm=2.04e12, sms=108, name="A100-80GB")
    fwd, bwd = kernels.unfused_attention_core(k, meta, 4096, 1, 2)
    s, d, heads = meta.seq_len, meta.hidden_size // meta.num_heads, meta.num_heads
    batch = 4096 / s * heads
    gemms = k.gemm(batch * s, s, d, 2) + k.gemm(batch * s, d, s, 2)
    assert fwd == pytest.approx(gemms + k.elementwise(batch * s * s * (4 * 2 + 1)))
    assert bwd > fwd
    # small K (the head dimension): the score GEMM is far from the large-GEMM rate
    assert k.gemm(batch * s, s, d, 2) > 2 * batch * s * s * d / (312e12 * kernels.GEMM_PEAK_FRACTION) * 1.3


def test_fsdp_gathers_its_weights_under_the_first_forward_when_dp_overlaps():
    meta = llama7b_meta()
    cluster = preset("a100x8-1n", count=2)
    group = tuple(range(16))
    kw = dict(recompute="none", microbatches=4)
    over = StageCostModel(meta, cluster, CostOptions(bytes_per_value=2, dp_mode="fsdp", dp_overlap=True))
    plain = StageCostModel(meta, cluster, CostOptions(bytes_per_value=2, dp_mode="fsdp", dp_overlap=False))
    a = over.stage(0, 32, True, True, group, 1, 16, 1, 1, **kw)
    b = plain.stage(0, 32, True, True, group, 1, 16, 1, 1, **kw)
    assert a.dp_sync == pytest.approx(b.dp_sync / 2 + max(b.dp_sync / 2 - a.fwd, 0.0))
    assert a.dp_sync < b.dp_sync


def test_tp_overlap_gemms_follow_transformer_engines_default_splits(h100):
    """Ring-exchange GEMMs run in tp row chunks, pipeline ones in 4 beside TE_COMM_SMS SMs, bulk ones
    whole beside them; at tp 1 nothing is split."""
    k = h100
    t, h = 4096.0, 8192.0
    shapes = ((t, 3 * h / 8, h), (t, h, h / 8), (t, 4 * h / 8, h), (t, h, 4 * h / 8))
    fwd, _ = kernels.tp_overlap_gemms(k, shapes, 8, 2)
    rate = 989e12 * kernels.GEMM_PEAK_FRACTION
    beside = 132 - kernels.TE_COMM_SMS
    expect = (8 * kernels.gemm_seconds(t / 8, 3 * h / 8, h, 2, rate, 3.35e12, 132)
              + 4 * kernels.gemm_seconds(t / 4, h, h / 8, 2, rate, 3.35e12, beside)
              + 8 * kernels.gemm_seconds(t / 8, 4 * h / 8, h, 2, rate, 3.35e12, 132)
              + 4 * kernels.gemm_seconds(t / 4, h, 4 * h / 8, 2, rate, 3.35e12, beside))
    assert fwd == pytest.approx(expect, rel=1e-12)


@pytest.fixture
def h100():
    return kernels.GpuKernels(peak=989e12, hbm=3.35e12, sms=132, name="H100-80GB")


def _block_forward_without_and_with_sp(k, hidden: int, heads: int, seq: int, tp: int, runtime: str):
    """block_times' forward of one block (12h^2 weights, bf16, fused attention, one sequence of
    `seq` tokens) on a tp rank, without and with sequence parallelism."""
    meta = SimpleNamespace(hidden_size=hidden, num_heads=heads, seq_len=seq)
    args = (k, meta, 12 * hidden ** 2, float(seq), tp, 2, 4.0 * seq * hidden, True, runtime)
    return kernels.block_times(*args)[0], kernels.block_times(*args, sequence_parallel=True)[0]


def test_sequence_parallel_shards_megatrons_norms_and_residuals(h100):
    """Under sequence parallelism a Megatron tp rank norms and adds tokens/tp (the h term over tp);
    without it they run whole on every rank."""
    whole, sharded = _block_forward_without_and_with_sp(h100, 8192, 64, 4096, 8, "megatron")
    h_term = h100.elementwise(4096 * 2 * kernels.ELEMENTWISE_H["megatron"] * 8192)
    assert whole - sharded == pytest.approx(h_term * (1 - 1 / 8), rel=1e-9)


def test_torch_norms_and_residual_adds_stay_whole_without_sequence_parallelism(h100):
    """runtime=torch: without sequence parallelism a tp rank runs the norms and residual adds
    (ELEMENTWISE_H_REPLICATED, a count of the eager Llama block) whole and only the rest of the measured
    110h over tp; with it all of it over tp. Megatron's 12h is all norms and adds: whole, or over tp."""
    assert kernels.elementwise_h_per_rank("torch", 1, False) == kernels.ELEMENTWISE_H["torch"]
    assert kernels.elementwise_h_per_rank("torch", 8, False) == pytest.approx(42.0 + (110.0 - 42.0) / 8)
    assert kernels.elementwise_h_per_rank("torch", 8, True) == pytest.approx(110.0 / 8)
    assert kernels.elementwise_h_per_rank("megatron", 8, False) == 12.0
    whole, sharded = _block_forward_without_and_with_sp(h100, 4096, 32, 2048, 4, "torch")
    replicated = h100.elementwise(2048 * 2 * kernels.ELEMENTWISE_H_REPLICATED["torch"] * 4096)
    assert whole - sharded == pytest.approx(replicated * (1 - 1 / 4), rel=1e-9)


def test_megatrons_loss_moves_its_cross_entropy_passes(h100):
    """Megatron's unfused vocab-parallel cross-entropy: 38 bytes per logit forward, 14 backward."""
    k = h100
    meta = SimpleNamespace(hidden_size=2048, head_flops_fwd_per_token=2.0 * 2048 * 131072)
    mf, mb = kernels.head_times(k, meta, 4096, 1, 2, "megatron")
    tf, tb = kernels.head_times(k, meta, 4096, 1, 2, "torch")
    logits = 4096 * 131072
    assert mf - tf == pytest.approx(k.elementwise(logits * (38 - 14)), rel=1e-9)
    assert mb == pytest.approx(tb, rel=1e-12)
