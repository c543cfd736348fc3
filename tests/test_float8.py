"""train.float8=true: which devices run it (a pure check, refused in one line before workers start
elsewhere), and which of the runtime's modules torchao's float8 conversion swaps (runtime/float8.py):
the blocks' linears, never the embeddings, the output head, dims that are not multiples of 16, or
matmuls too small to gain. The conversion itself runs on CPU (torchao builds Float8Linear there)."""
import pytest
import torch

from hrlplan.errors import ConfigError, UserError
from hrlplan.runtime.float8 import apply_float8, float8_conversion, float8_skip_reason
from hrlplan.validate.train_options import float8_refusal, float8_supported

LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=2"]


def _stage(overrides, on_meta=False):
    from hrlplan.compose import compose
    from hrlplan.models.hf import build_stage_modules
    from hrlplan.runtime.trainer import build_full_model

    cfg = compose(overrides)
    model = build_full_model(cfg["arch"], 0, materialized=not on_meta)
    return build_stage_modules(model, [(0, 2)])[0]


@pytest.mark.parametrize("device, capability, ok", [
    ("cpu", None, False), ("cuda", (7, 0), False), ("cuda", (8, 0), False), ("cuda", (8, 6), False),
    ("cuda", (8, 9), True), ("cuda", (9, 0), True), ("cuda", (10, 0), True), ("cuda", None, False)])
def test_float8_runs_on_gpus_of_compute_capability_8_9_and_up(device, capability, ok):
    assert float8_supported(device, capability) is ok
    assert (float8_refusal(device, capability) is None) is ok


def test_refusals_are_one_line_naming_the_key_and_the_device():
    cpu = float8_refusal("cpu")
    a100 = float8_refusal("cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    for why in (cpu, a100):
        assert why.startswith("train.float8=true needs a GPU with fp8 tensor cores") and "\n" not in why
        assert why.endswith("set train.float8=false")
    assert "a CPU run" in cpu and "NVIDIA A100-SXM4-80GB (compute capability 8.0)" in a100


def test_the_launcher_refuses_float8_on_this_cpu_host_before_workers_start():
    from hrlplan.compose import compose
    from hrlplan.validate.host import check_environment

    with pytest.raises(ConfigError, match=r"^train\.float8=true needs a GPU") as err:
        check_environment(compose(["train.float8=true", "train.device=cpu"]), launching=False)
    assert err.value.key == "train.float8"
    check_environment(compose(["train.float8=true", "train.device=cpu", "mode=plan"]), launching=False)  # plans only


def test_the_blocks_linears_are_swapped_and_embeddings_and_head_are_not():
    part = _stage(LLAMA)
    plan = float8_conversion(part, skip_small=False)
    assert plan.pop("model.embed_tokens") == "embedding"
    assert plan.pop("lm_head") == "output head"
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    assert plan == {f"model.layers.{i}.{n}": "float8" for i in range(2) for n in names}


def test_small_matmuls_and_dims_off_16_stay_in_high_precision():
    small = float8_conversion(_stage(LLAMA))   # torchao's rule: K <= 4096 and N <= 1024 do not gain
    assert {v for k, v in small.items() if ".layers." in k} == {"too small to gain"}
    odd = float8_conversion(_stage(LLAMA + ["arch.intermediate_size=100"]), skip_small=False)
    assert odd["model.layers.0.mlp.up_proj"] == odd["model.layers.0.mlp.down_proj"] == "dims not multiples of 16"
    assert odd["model.layers.0.self_attn.q_proj"] == "float8"
    gpt2 = float8_conversion(_stage(["arch=gpt2-tiny", "arch.n_layer=2"]), skip_small=False)
    assert gpt2["transformer.h.0.mlp.c_fc"] == "not an nn.Linear"   # transformers' Conv1D


def test_a_llama_7b_block_swaps_every_linear_at_its_real_size():
    part = _stage(["arch=llama-7b", "arch.num_hidden_layers=2"], on_meta=True)
    plan = float8_conversion(part)
    assert sum(v == "float8" for v in plan.values()) == 14 and plan["lm_head"] == "output head"
    assert float8_skip_reason(torch.nn.Linear(4096, 1024, device="meta"), "x") == "too small to gain"
    assert float8_skip_reason(torch.nn.Linear(4096, 1040, device="meta"), "x") is None


def test_torchao_converts_exactly_the_chosen_linears_and_trains_on_cpu():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    part = _stage(LLAMA)
    x = torch.randint(0, 128, (2, 32))
    reference = part(x).detach()
    assert apply_float8(part, skip_small=False) == 14
    swapped = {n for n, m in part.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == {n for n, v in float8_conversion(part, skip_small=False).items() if v == "float8"}
    assert not isinstance(part.lm_head, Float8Linear)
    out = part(x)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in part.parameters() if p.requires_grad)
    # e4m3 keeps 3 mantissa bits (2^-4 relative per value): the logits follow, not exactly
    relative = ((out.detach() - reference).norm() / reference.norm()).item()
    print(f"float8 vs fp32 logits, relative error {relative:.3g}")
    assert relative < 0.1


def test_a_stage_with_nothing_to_swap_is_refused():
    pytest.importorskip("torchao")
    with pytest.raises(UserError, match=r"^train\.float8=true swaps no linear of this model"):
        apply_float8(_stage(LLAMA))


@pytest.mark.slow
def test_pretrain_refuses_float8_on_cpu_in_one_line(tmp_path):
    from _runs import pretrain

    proc = pretrain(tmp_path / "run", "train.float8=true", "train.steps=1", "logger.mode=disabled", check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hrlplan: error:")]
    assert len(errors) == 1 and errors[0].startswith("hrlplan: error: train.float8=true needs a GPU with fp8")
    assert "Traceback" not in proc.stderr


def _float8_under_tp_worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.tensor_parallel import parallelize_stage

    init_distributed("cpu", {"collective_timeout_min": 5})
    try:
        part = _stage(LLAMA)
        apply_float8(part, skip_small=False)
        x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        alone = part(x).detach()
        parallelize_stage(part, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)),
                          vocab_parallel=False, sequence_parallel=True)
        out = part(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.float().pow(2).mean().backward()
        return ((out.detach() - alone).norm() / alone.norm()).item()
    finally:
        shutdown()


@pytest.mark.slow
def test_float8_linears_under_tp_2_with_sequence_parallel_match_one_process(tmp_path):
    """Conversion first, then the plain tp styles shard the Float8Linears (torchao scales DTensors
    over the whole tensor: the same fp8 values as one process; communication stays high-precision)."""
    pytest.importorskip("torchao")
    from hrlplan.launch.local import launch_workers

    relative = launch_workers(_float8_under_tp_worker, (), 2, name="h14-float8-tp", log_dir=str(tmp_path))
    assert all(r < 1e-5 for r in relative.values()), relative


# ---------------------------------------------------------------- the cost model (no torchao needed)
def test_fp8_peaks_are_the_datasheets_dense_figures():
    from hrlplan.devices import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(2 * peak_flops("NVIDIA H100 80GB HBM3", "bf16"), rel=1e-3)
    assert peak_flops("NVIDIA H200", "float8_e4m3fn") == pytest.approx(1978.9e12)
    assert peak_flops("NVIDIA L40S", "fp8") == pytest.approx(733e12)
    assert peak_flops("NVIDIA GeForce RTX 4090", "fp8") == pytest.approx(330.3e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None   # Ampere: no fp8 tensor cores


def _llama8b_meta():
    import dataclasses

    from test_cost import llama7b_meta

    h, ffn, kv = 4096, 14336, 1024
    mm = 2 * h * h + 2 * h * kv + 3 * h * ffn
    return dataclasses.replace(llama7b_meta(), block_matmul_params=[mm] * 32,
                               block_flops_fwd_per_token=[2.0 * mm + 4.0 * 2048 * h] * 32,
                               extra={"query_width": h, "kv_width": kv, "ffn_size": ffn, "gated_mlp": True,
                                      "block_class": "LlamaDecoderLayer"})


def test_float8_prices_the_swapped_linears_at_the_fp8_peak():
    from hrlplan.cost import memory as cm
    from hrlplan.cost.model import CostOptions, StageCostModel, fp8_speedup
    from test_context_parallel import _h100_node

    meta = _llama8b_meta()
    # the k and v projections (4096 -> 1024) are torchao's small matmuls: they stay in bf16
    swapped = [(i, o) for i, o, _ in cm.block_matmuls(meta) if cm.float8_swaps(i, o)]
    assert (4096, 1024) not in swapped and len(swapped) == 5
    share = cm.float8_flops_share(meta)
    assert 0.8 < share < 0.95

    def stage(**opts):
        costs = StageCostModel(meta, _h100_node(), CostOptions(bytes_per_value=2, **opts))
        return costs.stage(0, 8, False, False, [0], 1, 1, 1, 1)

    bf16, fp8 = stage(), stage(float8=True)
    gain = fp8_speedup(_h100_node().devices[0], 2, True)   # the preset's bf16 peak against the datasheet's fp8
    assert gain == pytest.approx(2.0, rel=0.01)
    assert fp8.compute_fwd == pytest.approx(bf16.compute_fwd * (1 - share + share / gain), rel=1e-6)
    # its casts: the widest linear's weight and two tokens x ffn operands, one byte each
    tokens = 2048
    assert fp8.memory["transient"] - bf16.memory["transient"] == pytest.approx(14336 * 4096 + 2 * tokens * 14336)
