"""Measured memory (runtime/memory.py) against torch's own accounting, and each term of the cost
model's memory against the measurement on the CPU (issue 19.3, 25.4)."""
import dataclasses
import json

import pytest
import torch

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.cost import memory as cm
from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.plans import plan_memory
from hrlplan.cost.simulator import Simulator
from hrlplan.plan import homogeneous_plan
from hrlplan.runtime.memory import LiveStorageTracker, MemoryMeter, memory_metrics, saved_activation_bytes

MiB = 2 ** 20


def cpu_cluster(n=1) -> ClusterSpec:
    devs = [DeviceInfo(rank=i, node=0, local_rank=i, hostname="n0", kind="cpu", name="cpu", memory_bytes=64 * 2 ** 30,
                       peak_flops=1e11, peak_dtype="fp32") for i in range(n)]
    return ClusterSpec(name="cpu", devices=devs, backend="gloo", source="preset", intra_node_bw=[1e10])


def _mlp_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(64, 256)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()   # moments exist from here on
    return model, opt, step


def test_tracker_equals_torch_mem_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt, step = _mlp_step()
    meter = MemoryMeter(torch.device("cpu"), lambda: ([model], [opt]))
    for _ in range(3):   # only the first MEASURED_STEPS are tracked
        with meter.step():
            step()
    mine = meter.result()
    theirs = MemTracker()
    theirs.track_external(model, opt)
    with theirs:
        step()
    snap = {str(k).split(".")[-1]: v for k, v in theirs.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    params = sum(p.numel() * 4 for p in model.parameters())
    assert mine["peak"] == snap["Total"]
    assert mine["weights"] == snap["PARAM"] == params
    assert mine["gradients"] == snap["GRAD"] == params
    assert mine["optimizer"] == 2 * params + 4 * len(opt.state)   # two moments and a float32 step each
    assert sum(mine[k] for k in ("weights", "gradients", "optimizer", "activations", "other")) == mine["peak"]


def test_tracker_follows_storage_resizes_and_frees():
    tracker = LiveStorageTracker("cpu", lambda: ([], []))
    with tracker:
        a = torch.empty(1024)   # 4 KiB
        a.untyped_storage().resize_(0)    # how FSDP2 frees an unsharded parameter
        a.untyped_storage().resize_(8192)
        b = torch.empty(256)
        del a, b
    assert tracker.peak == 8192 + 1024 and tracker.current == 0


def test_memory_metrics_names():
    out = memory_metrics([{"peak": 2 * 2 ** 30, "weights": 2 ** 30}, {"peak": 2 ** 30}], predicted=[2 ** 31, 2 ** 30])
    assert out["memory/peak_gib"] == 2.0 and out["memory/rank0/weights_gib"] == 1.0
    assert out["memory/rank1/predicted_gib"] == 1.0


def _measure_lm(arch="gpt2-tiny", batch=8, recompute="none"):
    """One stage, one micro-batch of `batch` rows: the measured peak split, and the model's meta with
    its block activations as autograd's saved-tensor hooks count them on this model."""
    from hrlplan.compose import compose
    from hrlplan.model_meta import introspect
    from hrlplan.models.hf import build_stage_modules, causal_lm_loss, hf_layout
    from hrlplan.runtime.recompute import apply_recompute
    from hrlplan.runtime.trainer import build_full_model, make_optimizer

    cfg = compose([f"arch={arch}"])
    seq = int(cfg["data"]["seq_len"])
    model = build_full_model(cfg["arch"], 0)
    block = getattr(hf_layout(model).base, hf_layout(model).blocks_attr)[0]
    # trained as the runtime trains it: the whole model as one stage module (HFStage). The bare HF
    # model differs under full recomputation: it keeps every block's input to the end of backward
    # and more beside its rebuilt blocks (gpt2-tiny, 4 blocks, batch 4: 7.18 MB vs the stage's 5.73)
    [part] = build_stage_modules(model, [(0, model.config.num_hidden_layers)])
    apply_recompute(part, recompute)
    opt = make_optimizer(part, cfg["train"])
    x = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step():
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(part(x), x).backward()
        opt.step()
    step()
    meter = MemoryMeter(torch.device("cpu"), lambda: ([part], [opt]))
    with meter.step():
        step()
    box = {}
    hook = block.register_forward_pre_hook(lambda m, a, kw: box.update(args=a, kw=kw), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
    hook.remove()
    # the block alone, without the KV cache a no-grad forward hands it (training keeps none)
    args = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor)
            else None if type(a).__name__.endswith("Cache") else a for a in box["args"]]
    kw = {k: v for k, v in box["kw"].items() if k not in ("past_key_values", "layer_past", "past_key_value")
          and not type(v).__name__.endswith("Cache")}   # Llama's block takes it as `cache`
    shared = [t for v in kw.values() for t in (v if isinstance(v, (tuple, list)) else (v,))
              if isinstance(t, torch.Tensor)]   # masks, rotary tables: one for all blocks
    kept = saved_activation_bytes(lambda: block(*args, **kw), exclude=[*block.parameters(), *shared])
    kept /= batch * seq
    meta = introspect(cfg["arch"], seq_len=seq)
    scores = 5.0 * meta.num_heads * meta.seq_len   # the memory model drops them for SDPA
    measured_meta = dataclasses.replace(meta, block_activation_bytes_per_token=[kept / 2 + scores] * meta.n_layer)
    return meter.result(), meta, measured_meta, batch


@pytest.mark.parametrize("arch,recompute", [("gpt2-tiny", "none"), ("gpt2-tiny", "full"), ("llama-tiny", "none")])
def test_each_memory_term_against_the_measured_peak(arch, recompute):
    measured, meta, measured_meta, batch = _measure_lm(arch, recompute=recompute)
    # introspection measures the block itself (hrlplan.activations): the figure the cost model gets
    # is what the block keeps in this model, with the arguments the model gives it
    assert meta.block_activation_bytes_per_token == pytest.approx(measured_meta.block_activation_bytes_per_token,
                                                                  rel=1e-6)
    plan = homogeneous_plan(arch, meta.n_layer, [(0, meta.n_layer)], dp=1, tp=1, microbatch_size=batch,
                            num_microbatches=1, schedule="1f1b")
    plan.stages[0].recompute = recompute
    opts = CostOptions(bytes_per_value=4)
    row = plan_memory(plan, meta, cpu_cluster(), opts)[0]
    # weights and AdamW's moments: exact; gradients: none at the peak without recomputation (it comes
    # before the first backward), most of them with it (the peak is in backward, rebuilding a block)
    assert row["weights"] == pytest.approx(measured["weights"], rel=0.02)
    assert row["optimizer"] == pytest.approx(measured["optimizer"], rel=0.02)
    if recompute == "none":
        assert row["gradients"] == 0.0 and measured["gradients"] < 0.1 * measured["weights"]
    else:
        assert row["gradients"] == pytest.approx(measured["gradients"], rel=0.25)
    assert row["tensors"] == pytest.approx(sum(row[k] for k in cm.MEMORY_KEYS if k != "workspace"), rel=1e-6)
    # activations with the block's real saved tensors, the head's logits and the schedule's in-flight
    # count; full recomputation keeps each block's input, and rebuilds one block at a time in backward
    if recompute == "none":
        assert row["activations"] == pytest.approx(measured["activations"], rel=0.10)
    else:
        assert row["activations"] < 0.2 * tokens_held(meta, batch)
    assert row["tensors"] == pytest.approx(measured["peak"], rel=0.10)


def tokens_held(meta, batch) -> float:
    """fp32 bytes every block of the model would keep without recomputation."""
    scores = 5.0 * meta.num_heads * meta.seq_len
    return 2.0 * (meta.block_activation_bytes_per_token[0] - scores) * batch * meta.seq_len * meta.n_layer


def test_gradients_count_only_after_the_first_backward():
    """GPipe (and 1F1B warm-up) reach their activation peak before any gradient exists."""
    meta = dataclasses.replace(_toy_meta(), block_activation_bytes_per_token=[1.0] * 4)   # weights dominate
    sim = Simulator(meta, cpu_cluster(2), CostOptions())
    spans = ((0, 2), (2, 4))

    def need(schedule, m):
        layout = Layout(spans=spans, groups=((0,), (1,)), tp=1, dp=1, microbatch_size=1, num_microbatches=m,
                        schedule=schedule)
        return sim.evaluate(layout, detail=True)
    gpipe, one_f = need("gpipe", 4), need("1f1b", 4)
    for res in (gpipe, one_f):
        static = [s["static_bytes"] for s in res.stages]
        # with negligible activations, each rank's peak is its whole static state (gradients at the step's end)
        assert [res.memory_bytes[d] for d in (0, 1)] == pytest.approx(static, rel=1e-3)


def test_fsdp_holds_unsharded_gradients_only_with_micro_batches():
    one = cm.state_split(1000, 4, "fsdp", 4, microbatches=1)
    many = cm.state_split(1000, 4, "fsdp", 4, microbatches=4)
    assert one["gradients"] == 1000.0 and many["gradients"] == 4000.0
    assert one["weights"] == many["weights"] == 1000 * (4 / 4 + 4)   # shard + unsharded compute copy
    assert cm.state_split(1000, 4, "replicate", 4, 4) == {"weights": 4000.0, "gradients": 4000.0, "optimizer": 8000.0}
    assert cm.static_state_bytes(1000, 1, "fsdp", 4, 1) == 1000 * cm.STATE_BYTES_PER_PARAM


def test_reference_without_clipping():
    from hrlplan.compose import compose
    from hrlplan.runtime.reference import train_single_process

    for clip in ("null", "0"):
        out = train_single_process(compose(["arch=gpt2-tiny", f"train.grad_clip={clip}", "train.steps=2"]), 2)
        assert out[1]["loss"] < out[0]["loss"]   # 0 no longer zeroes every gradient


def _toy_meta():
    from hrlplan.model_meta import ModelMeta

    block = 12 * 64 * 64
    return ModelMeta(
        name="toy", family="hf", model_type="gpt2", n_layer=4, hidden_size=64, num_heads=4, seq_len=16,
        vocab_size=100, total_params=4 * block + 2 * 6400, embedding_params=6400, head_params=6400,
        block_params=[block] * 4, block_matmul_params=[block] * 4, head_matmul_params=6400,
        block_flops_fwd_per_token=[2.0 * block] * 4, head_flops_fwd_per_token=0.0,
        block_activation_bytes_per_token=[34.0 * 64] * 4, head_activation_bytes_per_token=0.0,
        tied_embeddings=False, first_stage_modules=["wte"], last_stage_modules=["lm_head"],
        block_modules=[f"h.{i}" for i in range(4)])


@pytest.mark.slow
def test_training_logs_measured_memory_per_rank(tmp_path):
    """dp2 FSDP and pp2 1F1B trained for real: memory/peak_gib per rank in metrics.jsonl, the
    measured split beside the predicted one in plan_info.json; weights and moments as predicted."""
    from tests._runs import run_plan
    from hrlplan.runtime.metrics import read_metrics

    for name, spans, dp in (("dp2", [(0, 6)], 2), ("pp2", [(0, 3), (3, 6)], 1)):
        d = tmp_path / name
        d.mkdir()
        run_plan(d, spans, dp=dp, schedule="1f1b", steps=3, microbatches=2)
        rows = read_metrics(d / "run")
        assert rows[-1]["memory/peak_gib"] > 0 and "memory/rank1/peak_gib" in rows[-1]
        info = json.loads((d / "run" / "plan_info.json").read_text())["memory"]
        for r in info["per_rank"]:
            got, want = r["measured_split"], r["predicted_split"]
            assert got["weights"] == pytest.approx(want["weights"], rel=0.03)
            assert got["optimizer"] == pytest.approx(want["optimizer"], rel=0.03)
            assert r["measured_bytes"] > 0 and r["predicted_bytes"] > 0
            # the whole peak within 10% (issue 19.3): the block's activations are measured at introspection
            assert r["relative_error"] == pytest.approx(0.0, abs=0.10), (name, r["rank"])


# ---------------------------------------------------------------- a backward's working set (issue 19.3)
def test_position_peak_puts_one_backward_on_the_most_held():
    assert cm.position_peak_bytes(100.0, 20.0, 50.0, 10.0) == 130.0     # before the first backward
    assert cm.position_peak_bytes(100.0, 20.0, 10.0, 10.0) == 110.0     # gradients beside what is held
    assert cm.position_peak_bytes(100.0, 20.0, 50.0, 10.0, transient=5.0) == 135.0
    # full recomputation: a rebuilt block beside the gradients and the inputs still held
    assert cm.position_peak_bytes(100.0, 20.0, 5.0, 0.0, transient=1.0, rebuilt=30.0) == 135.0
    meta = _toy_meta()
    block = cm.stage_transient(meta, 1, 1, 16.0, 1.0, "none", 2, last=False)
    assert block == 16 * 2 * cm.BACKWARD_FFN_TENSORS * 4 * 64 + 4 * 4 * 64 * 64
    assert cm.stage_transient(meta, 1, 1, 16.0, 1.0, "none", 0, last=False) == 0.0
    assert cm.stage_transient(meta, 1, 1, 16.0, 1.0, "none", 0, last=True) == 16 * 8 * meta.vocab_size
    assert cm.receive_buffer_bytes(10.0, 4, first=False, last=False) == 80.0
    assert cm.receive_buffer_bytes(10.0, 4, first=True, last=True) == 0.0


@pytest.mark.parametrize("arch", ["gpt2-tiny", "llama-tiny"])
def test_block_backward_working_set_as_measured(arch):
    """One block's backward (a second micro-batch: its weight gradient is made before being added to
    the first's) adds what block_backward_per_token and weight_gradient_temporary say, over what the
    forward saved -- live tensor storages."""
    from hrlplan.compose import compose
    from hrlplan.model_meta import introspect
    from hrlplan.models.hf import hf_layout
    from hrlplan.runtime.trainer import build_full_model

    cfg = compose([f"arch={arch}"])
    model = build_full_model(cfg["arch"], 0)
    layout = hf_layout(model)
    block = getattr(layout.base, layout.blocks_attr)[0]
    seq = int(cfg["data"]["seq_len"])
    box = {}
    hook = block.register_forward_pre_hook(lambda m, a, kw: box.update(args=a, kw=kw), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (2, seq)), use_cache=False)
    hook.remove()
    args = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor)
            else None if type(a).__name__.endswith("Cache") else a for a in box["args"]]
    kw = {k: v for k, v in box["kw"].items() if k not in ("past_key_values", "layer_past", "past_key_value")
          and not type(v).__name__.endswith("Cache")}

    def forward():
        out = block(*args, **kw)
        return out[0] if isinstance(out, tuple) else out
    forward().sum().backward()     # gradients exist: the measured backward accumulates into them
    tracker = LiveStorageTracker("cpu", lambda: ([block], []))
    with tracker:
        y = forward()
        g = torch.ones_like(y)
        start = tracker.peak = tracker.current
        y.backward(g)
    meta = introspect(cfg["arch"], seq_len=seq)
    tokens = 2 * seq
    predicted = tokens * cm.block_backward_per_token(meta, 1) * 2.0 + cm.weight_gradient_temporary(meta, 1)  # fp32
    # GPT-2's composite GELU: the three tokens x ffn tensors exactly; Llama's SwiGLU frees one sooner (0.71x)
    assert 0.65 * predicted <= tracker.peak - start <= 1.05 * predicted


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp4", "pp2-interleaved", "pp2-zbv"])
def test_pipelined_ranks_within_10pct(tmp_path, name):
    """Ranks holding one block or a second virtual stage, where a backward's working set and zero
    bubble's kept gradients weigh most (+16..26% before they were modelled): 2 steps each."""
    from hrlplan.compose import compose
    from hrlplan.cost.plans import options_for_train
    from hrlplan.launch.local_run import train_plan
    from hrlplan.model_meta import introspect

    quarter = [(0, 2), (2, 3), (3, 5), (5, 6)]
    spans, schedule, v = {"pp4": ([(0, 3), (3, 4), (4, 5), (5, 6)], "1f1b", 1),
                          "pp2-interleaved": (quarter, "interleaved_1f1b", 2),
                          "pp2-zbv": (quarter, "zero_bubble", 2)}[name]
    plan = homogeneous_plan("gpt2-tiny", 6, spans, dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule=schedule, stages_per_rank=v)
    cfg = compose(["arch=gpt2-tiny", "train.global_batch_size=8", "logger.mode=disabled", "train.steps=2",
                   "train.checkpoint_interval=0"])
    summary = train_plan(plan, cfg, tmp_path / name)
    measured = [m["peak"] for m in summary["measured"]["memory_split_per_rank"]]
    meta = introspect(cfg["arch"], seq_len=int(cfg["data"]["seq_len"]))
    predicted = [row["tensors"] for row in plan_memory(plan, meta, cpu_cluster(plan.world_size),
                                                          options_for_train(cfg["train"]))]
    errors = [(m - p) / p for m, p in zip(measured, predicted)]
    assert len(errors) == plan.world_size and all(abs(e) <= 0.10 for e in errors), errors


def test_the_memory_split_names_each_ranks_options(tmp_path):
    """plan_info.json's memory split per rank carries what produced it (issue 32.7)."""
    import json

    from hrlplan.config import TrainConfig
    from hrlplan.plan import homogeneous_plan
    from hrlplan.runtime.memory import add_to_plan_info, compare, rank_options

    plan = homogeneous_plan("llama-tiny", 4, [(0, 2), (2, 4)], dp=1, tp=2, microbatch_size=1, num_microbatches=2,
                            schedule="1f1b", recompute=["full", "selective"], sequence_parallel=True)
    options = rank_options(plan, TrainConfig(compile=True))
    assert options[0] == {"recompute": ["full"], "sequence_parallel": True, "reshard_after_forward": False, "cp": 1,
                          "compile": True, "float8": False}
    assert options[3]["recompute"] == ["selective"]
    rows = compare([{"peak": 10, "weights": 4}] * 4, [9.0] * 4)
    add_to_plan_info(tmp_path, rows, [{"tensors": 9.0}] * 4, "live tensor storages", options)
    info = json.loads((tmp_path / "plan_info.json").read_text())["memory"]["per_rank"]
    assert info[2]["options"]["sequence_parallel"] and info[2]["options"]["compile"]

