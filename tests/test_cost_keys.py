"""Issue 33: every option that changes a prediction is a config key; datasheet dtype peaks; devices
the tables lack are named; an over-memory plan's time-only figure and its worst replica's refusal."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hrlplan.cluster import ClusterSpec, DeviceInfo, spec_from_preset
from hrlplan.config import CostConfig
from hrlplan.cost import CostOptions, Layout, Simulator, predict_any_plan
from hrlplan.cost.device_model import matmul_peak
from hrlplan.cost.plans import RUNTIME_DEFAULTS, options_for_train
from hrlplan.errors import UserError
from hrlplan.plan import Plan

from test_cost import llama7b_meta

CONF = Path(__file__).resolve().parents[1] / "conf" / "cluster"


def preset(name: str, **group) -> ClusterSpec:
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    cfg["node_groups"] = [dict(g, **group) for g in cfg["node_groups"]]
    return spec_from_preset(cfg)


def gpu(name: str, peak: float = 100e12, peak_dtype: str = "bf16", rank: int = 0) -> DeviceInfo:
    return DeviceInfo(rank=rank, node=0, local_rank=rank, hostname="n0", kind="cuda", name=name,
                      memory_bytes=80 * 2 ** 30, peak_flops=peak, peak_dtype=peak_dtype)


# ---------------------------------------------------------------- planner.cost
def test_runtime_sets_its_defaults_and_keys_override_them():
    train = {"dtype": "bfloat16", "dp_mode": "replicate"}
    torch_opts = options_for_train(train, {})
    assert (torch_opts.runtime, torch_opts.fused_attention, torch_opts.receive_buffers) == ("torch", True, True)
    mega = options_for_train(train, {"cost": {"runtime": "megatron"}})
    assert (mega.runtime, mega.fused_attention, mega.receive_buffers) == ("megatron", False, False)
    mixed = options_for_train(train, {"cost": {"runtime": "megatron", "fused_attention": True}})
    assert (mixed.fused_attention, mixed.receive_buffers) == (True, False)
    typed = options_for_train(train, {"cost": CostConfig(receive_buffers=False)})
    assert (typed.runtime, typed.fused_attention, typed.receive_buffers) == ("torch", True, False)
    assert set(RUNTIME_DEFAULTS) == {"torch", "megatron"}
    with pytest.raises(UserError, match=r"planner.cost.runtime='jax' is not one of torch, megatron"):
        options_for_train(train, {"cost": {"runtime": "jax"}})


def test_train_keys_reach_the_options():
    o = options_for_train({"dtype": "float32", "dp_mode": "fsdp", "tf32": False, "vocab_parallel": False},
                          {"dp_overlap": False, "memory_margin": 0.8})
    assert (o.bytes_per_value, o.dp_mode, o.tf32, o.vocab_parallel, o.dp_overlap, o.memory_margin) == \
        (4, "fsdp", False, False, False, 0.8)


def test_every_prediction_records_its_options():
    meta, cluster = llama7b_meta(), preset("a100x8-1n")
    lay = Layout(spans=((0, 16), (16, 32)), groups=((0, 1, 2, 3), (4, 5, 6, 7)), tp=4, dp=1, microbatch_size=1,
                 num_microbatches=8, schedule="1f1b")
    opts = options_for_train({"dtype": "bfloat16"}, {"cost": {"runtime": "megatron"}})
    r = Simulator(meta, cluster, opts).evaluate(lay, detail=True)
    shown = r.breakdown["cost_options"]
    assert shown["runtime"] == "megatron" and shown["fused_attention"] is False and shown["receive_buffers"] is False
    assert "kernel_table_missing" not in shown   # an A100 is in the kernel table


def test_unfused_attention_and_receive_buffers_change_the_figure():
    meta, cluster = llama7b_meta(), preset("a100x8-1n")
    lay = Layout(spans=((0, 16), (16, 32)), groups=((0, 1, 2, 3), (4, 5, 6, 7)), tp=4, dp=1, microbatch_size=1,
                 num_microbatches=8, schedule="1f1b")
    fused = Simulator(meta, cluster, CostOptions(bytes_per_value=2)).evaluate(lay)
    unfused = Simulator(meta, cluster, CostOptions(bytes_per_value=2, fused_attention=False)).evaluate(lay)
    assert unfused.step_time_s > fused.step_time_s
    freed = Simulator(meta, cluster, CostOptions(bytes_per_value=2, receive_buffers=False)).evaluate(lay)
    assert max(freed.memory_bytes.values()) < max(fused.memory_bytes.values())


# ---------------------------------------------------------------- datasheet peaks
def test_v100_float32_is_its_fp32_peak_not_a_tf32_guess():
    v100 = gpu("Tesla V100-SXM2-32GB", peak=125e12)
    assert matmul_peak(v100, 4, tf32=True) == pytest.approx(15.7e12)   # no TF32 on Volta
    assert matmul_peak(v100, 4, tf32=False) == pytest.approx(15.7e12)
    assert matmul_peak(v100, 2) == pytest.approx(125e12)


def test_a100_tf32_and_fp32_columns():
    a100 = gpu("NVIDIA A100-SXM4-80GB", peak=312e12)
    assert matmul_peak(a100, 4, tf32=True) == pytest.approx(156e12)
    assert matmul_peak(a100, 4, tf32=False) == pytest.approx(19.5e12)


def test_a_probed_peak_is_converted_from_the_dtype_it_was_measured_in():
    measured_tf32 = gpu("NVIDIA A100-SXM4-80GB", peak=140e12, peak_dtype="tf32")
    assert matmul_peak(measured_tf32, 4, tf32=True) == pytest.approx(140e12)   # was halved again
    assert matmul_peak(measured_tf32, 2) == pytest.approx(280e12)


def test_a_preset_peak_override_slows_the_prediction():
    """cluster.node_groups.N.tflops is the per-device peak a preset (or a key) sets: a power-capped
    part is described by its own figure."""
    meta = llama7b_meta()
    lay = Layout(spans=((0, 32),), groups=((0, 1, 2, 3, 4, 5, 6, 7),), tp=8, dp=1, microbatch_size=4,
                 num_microbatches=4, schedule="1f1b")
    full = Simulator(meta, preset("a100x8-1n"), CostOptions(bytes_per_value=2)).evaluate(lay, detail=True)
    capped = Simulator(meta, preset("a100x8-1n", tflops=234), CostOptions(bytes_per_value=2)).evaluate(lay, detail=True)
    # the FLOP-bound part by 312/234; the memory-bound norms and adds (whole on each rank of a tp 8
    # stage without sequence parallelism) not at all
    assert capped.breakdown["compute_s"] > 1.1 * full.breakdown["compute_s"]
    assert capped.step_time_s > full.step_time_s


def test_a_gpu_missing_from_the_tables_is_named():
    meta = llama7b_meta()
    cluster = ClusterSpec(name="t", devices=[gpu("Radeon Mystery 9000", rank=r) for r in range(2)], backend="nccl",
                          source="preset", intra_node_bw=[300e9])
    lay = Layout(spans=((0, 32),), groups=((0, 1),), tp=2, dp=1, microbatch_size=1, num_microbatches=1,
                 schedule="1f1b")
    shown = Simulator(meta, cluster, CostOptions(bytes_per_value=4)).evaluate(lay, detail=True).breakdown["cost_options"]
    assert shown["kernel_table_missing"] == ["Radeon Mystery 9000"]
    assert shown["datasheet_missing"] == ["Radeon Mystery 9000"]


def test_bfloat16_on_a_part_without_bf16_is_named():
    meta = llama7b_meta()
    lay = Layout(spans=((0, 32),), groups=(tuple(range(8)),), tp=8, dp=1, microbatch_size=1, num_microbatches=1,
                 schedule="1f1b")
    mixed = preset("a100-v100-mix")
    shown = Simulator(meta, mixed, CostOptions(bytes_per_value=2)).evaluate(lay, detail=True).breakdown["cost_options"]
    assert shown["bf16_missing"] == ["V100-32GB"]
    assert "kernel_table_missing" not in shown and "datasheet_missing" not in shown
    # FlashAttention-2 publishes no V100 rate: its fused attention is a guess, and named as one
    assert shown["attention_curve_missing"] == ["V100-32GB"]


# ---------------------------------------------------------------- over memory
def _hetero_over_memory_plan() -> Plan:
    """Two replicas of llama-7b: a two-stage one (ranks 0, 1) and a one-stage one (rank 2), the
    latter further over an 8 GiB device."""
    stage = lambda layers, ranks, e, h: {"layers": layers, "ranks": ranks, "tp": 1, "embedding": e, "head": h}  # noqa: E731
    return Plan.from_dict({
        "model": "llama-7b", "n_layer": 32, "world_size": 3, "global_batch_size": 4, "schedule": "1f1b",
        "pipelines": [
            {"stages": [stage([0, 16], [0], True, False), stage([16, 32], [1], False, True)],
             "num_microbatches": 2, "batch_size": 2},
            {"stages": [stage([0, 32], [2], True, True)], "num_microbatches": 2, "batch_size": 2}],
        "meta": {"launch": {"nnodes": 1, "nproc_per_node": 3, "per_node_visible_devices": ["0,1,2"]}}})


def test_over_memory_hetero_plan_gets_a_time_only_figure_and_the_worst_replicas_refusal():
    meta = llama7b_meta(seq=512)
    devices = [DeviceInfo(rank=r, node=0, local_rank=r, hostname="n0", kind="cuda", name="A100-80GB",
                          memory_bytes=8 * 2 ** 30, peak_flops=312e12) for r in range(3)]
    cluster = ClusterSpec(name="t", devices=devices, backend="nccl", source="preset", intra_node_bw=[300e9])
    plan = _hetero_over_memory_plan()
    opts = CostOptions(bytes_per_value=2)
    pred = predict_any_plan(plan, meta, cluster, opts)
    assert not pred["feasible"] and pred["time_only"]
    assert pred["reason"].startswith("out of memory on device 2 ")
    assert "(replica 1 of 2; 2 over memory)" in pred["reason"]
    assert 0 < pred["step_time_s"] < float("inf")
    # the time-only figure is the plan's time with memory unchecked
    roomy = ClusterSpec(name="t", devices=[DeviceInfo(**dict(d.__dict__, memory_bytes=2 ** 50)) for d in devices],
                        backend="nccl", source="preset", intra_node_bw=[300e9])
    fits = predict_any_plan(plan, meta, roomy, opts)
    assert fits["feasible"] and fits["step_time_s"] == pytest.approx(pred["step_time_s"])
    assert pred["memory_bytes_per_rank"] == fits["memory_bytes_per_rank"]


def test_manual_over_memory_hetero_plan_is_refused_by_its_worst_replica_or_timed(tmp_path):
    from hrlplan.search import make_plan

    meta = llama7b_meta(seq=512)
    devices = [DeviceInfo(rank=r, node=0, local_rank=r, hostname="n0", kind="cuda", name="A100-80GB",
                          memory_bytes=8 * 2 ** 30, peak_flops=312e12) for r in range(3)]
    cluster = ClusterSpec(name="t", devices=devices, backend="nccl", source="preset", intra_node_bw=[300e9])
    path = tmp_path / "plan.yaml"
    _hetero_over_memory_plan().save(path)
    planner = {"name": "manual", "plan_file": str(path)}
    with pytest.raises(UserError, match=r"does not fit: out of memory on device 2 .*replica 1 of 2"):
        make_plan(meta, cluster, planner, {"dtype": "bfloat16"})
    plan, info = make_plan(meta, cluster, dict(planner, allow_over_memory=True), {"dtype": "bfloat16"})
    assert 0 < info["chosen"]["step_time_s"] < float("inf")   # time-only, was inf s
    assert info["planner"]["simulator"].startswith("allowed over memory: out of memory on device 2 ")


# ---------------------------------------------------------------- kernel constants with sources
def test_fused_attention_runs_at_flashattention2s_published_rate():
    """FLASH2_FWD_BWD: FlashAttention-2's own forward + backward benchmark (causal, head dim 128). At a
    listed length the cost model's fused core takes the time that benchmark's rate gives for the
    FLOPs it counts (half of 4 s d per query under the causal mask, forward + backward as 3.5
    forwards); between lengths it interpolates, beyond them it is clamped."""
    from hrlplan.cost import kernels

    for name, seq in (("NVIDIA A100-SXM4-80GB", 2048), ("NVIDIA H100 80GB HBM3", 4096)):
        peak, points = kernels.FLASH2_FWD_BWD[kernels._table_entry(name)[0]]
        measured = dict(points)[seq] * 1e12
        frac = kernels.flash_attention_fraction(name, seq)
        full_fwd_flops = 4.0 * seq * 128                       # per query and head, the cost model's count
        model_s = 3 * full_fwd_flops / (peak * frac)           # forward + 2x backward at that fraction
        bench_s = 3.5 * (full_fwd_flops / 2) / measured        # what the benchmark's rate means
        assert model_s == pytest.approx(bench_s, rel=1e-9)
    a100 = [kernels.flash_attention_fraction("A100-80GB", s) for s in (256, 512, 1448, 2048, 32768)]
    assert a100[0] == a100[1] and a100[1] < a100[2] < a100[3] < a100[4]
    # the H100 reaches a smaller share of its peak with this kernel than the A100
    assert kernels.flash_attention_fraction("H100-80GB", 4096) < 0.6 * kernels.flash_attention_fraction("A100", 4096)
    # no published curve: the unsourced fallback, used for unfused attention too
    assert kernels.flash_attention_fraction("Tesla V100-SXM2-32GB", 2048) is None


def test_the_flash_curve_prices_fused_attention_only():
    """The Megatron runtime's unfused attention keeps ATTENTION_FRACTION; SDPA's fused core on an A100
    at 2k is faster than that constant would price it."""
    from hrlplan.cost import kernels

    meta = llama7b_meta()
    k = kernels.GpuKernels(peak=312e12, hbm=2.04e12, sms=108, name="A100-80GB")
    fused = kernels.block_times(k, meta, 12 * 4096 ** 2, 4096, 1, 2, 4.0 * meta.seq_len * 4096, True)[2]
    unfused = kernels.block_times(k, meta, 12 * 4096 ** 2, 4096, 1, 2, 4.0 * meta.seq_len * 4096, False)[2]
    flat = 4096 * 4.0 * meta.seq_len * 4096 / (312e12 * kernels.ATTENTION_FRACTION)
    assert fused < flat < unfused


def test_gpu_facts_match_whole_tokens_and_the_grand_teton_h100():
    """A row's key is whole name tokens, the first row whose tokens the name has: Grand Teton's 96 GB
    HBM2e H100 (torchtitan's published H100 runs) is 2.4 TB/s, the 80 GB SXM5 part 3.35; its fused
    attention keeps the H100's FlashAttention-2 curve; an A10G is not an A10."""
    from hrlplan.cost import kernels

    assert kernels.gpu_facts("H100-96GB", 989e12) == (2.4e12, 132)
    assert kernels.gpu_facts("NVIDIA H100 80GB HBM3", 989e12) == (3.35e12, 132)
    assert kernels.flash_attention_fraction("H100-96GB", 4096) == kernels.flash_attention_fraction("H100", 4096)
    assert not kernels.in_kernel_table("NVIDIA A10G")
    cluster = preset("h100-gt-96gb", count=1)
    assert {d.name for d in cluster.devices} == {"H100-96GB"}
    hbm = {kernels.kernels_for(d, 989e12, measured=False).hbm for d in cluster.devices}
    assert hbm == {2.4e12}


def test_tp_comm_overlap_is_a_megatron_key():
    train = {"dtype": "bfloat16", "dp_mode": "fsdp"}
    assert options_for_train(train, {"cost": {"runtime": "megatron", "tp_comm_overlap": True}}).tp_comm_overlap
    assert options_for_train(train, {}).tp_comm_overlap is False
    with pytest.raises(UserError, match="tp_comm_overlap"):
        options_for_train(train, {"cost": {"tp_comm_overlap": True}})
