"""train.compile=true: each block compiled on its own (runtime/compile.py), refused in one line where
inductor cannot build, and training the same losses as eager on one process and over pp 2 (gloo).

Tolerance: inductor fuses and reorders fp32 reductions (matmul epilogues, layer norm, softmax), so
each op may differ from eager in its last bits (~1e-7 relative); over 3 Adam steps at lr 3e-3 that
stays below 1e-5 on a loss of ~4.9 (measured: <= 2e-6). A wrong graph -- a lost causal mask, a
skipped recomputation, a block run twice -- moves the loss by 1e-2 or more."""
import pytest

from _plan_options import reference_losses, train_with_options

STEPS = 3
TOLERANCE = 1e-5
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=2", "train.lr=3e-3", "train.global_batch_size=4", "data.seq_len=32"]


def _stage(arch_overrides):
    from hrlplan.compose import compose
    from hrlplan.models.hf import build_stage_modules
    from hrlplan.runtime.trainer import build_full_model

    cfg = compose(arch_overrides)
    [part] = build_stage_modules(build_full_model(cfg["arch"], 0), [(0, 2)])
    return part


def test_apply_compile_compiles_each_block_and_keeps_the_names():
    from hrlplan.runtime.compile import apply_compile

    part = _stage(GPT2)
    keys = list(part.state_dict())
    apply_compile(part)
    blocks = list(getattr(part.base, part.blocks_attr).values())
    assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    assert part._compiled_call_impl is None   # the stage itself (embedding, head, p2p) stays eager
    assert list(part.state_dict()) == keys    # checkpoints and FSDP see the same names


def test_compile_refusal_names_the_key_and_the_missing_compiler():
    from hrlplan.validate.train_options import compile_refusal, train_options_refusal

    assert compile_refusal("cpu", which=lambda name: "/usr/bin/g++" if name == "g++" else None) is None
    why = compile_refusal("cpu", which=lambda name: None)
    assert why.startswith("train.compile=true needs a C++ compiler") and "\n" not in why
    assert "Triton" in compile_refusal("cuda", has_triton=False)
    assert compile_refusal("cuda", has_triton=True) is None
    assert train_options_refusal({"compile": False}, "cpu") is None


def test_this_host_can_compile():
    """The tests below need it: a C++ compiler on PATH (g++ here)."""
    from hrlplan.validate.train_options import compile_refusal

    assert compile_refusal("cpu") is None


def _plan(spans, microbatches, recompute="none"):
    from hrlplan.plan import homogeneous_plan

    return homogeneous_plan("gpt2-tiny", 2, spans, dp=1, tp=1, microbatch_size=4 // microbatches,
                            num_microbatches=microbatches, schedule="1f1b", recompute=recompute)


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_on_one_process(tmp_path):
    """Without the memory meter every step runs compiled (the meter's first steps run eager:
    runtime/compile.eager_while)."""
    plan = _plan([(0, 2)], 1)
    unmetered = GPT2 + ["train.measure_memory=false"]
    eager = train_with_options(plan, unmetered, tmp_path / "eager", STEPS)["losses"]
    compiled = train_with_options(plan, unmetered + ["train.compile=true"], tmp_path / "compiled", STEPS)["losses"]
    print("compiled - eager:", [c - e for c, e in zip(compiled, eager)])
    assert eager == pytest.approx(reference_losses(GPT2, STEPS), abs=TOLERANCE)
    assert compiled == pytest.approx(eager, abs=TOLERANCE)


@pytest.mark.slow
def test_compiled_blocks_with_recompute_train_as_eager_over_two_stages(tmp_path):
    """With the memory meter on (its first 2 steps eager, the third compiled) and op-level SAC."""
    plan = _plan([(0, 1), (1, 2)], 2, recompute="selective")
    compiled = train_with_options(plan, GPT2 + ["train.compile=true"], tmp_path / "compiled", STEPS)["losses"]
    assert compiled == pytest.approx(reference_losses(GPT2, STEPS), abs=TOLERANCE)


def test_the_launcher_refuses_compile_for_hrm_whose_trainer_does_not_compile():
    from hrlplan.compose import compose
    from hrlplan.errors import ConfigError
    from hrlplan.validate.host import check_environment

    with pytest.raises(ConfigError, match=r"^train\.compile=true is for the language models' pipeline runtime"):
        check_environment(compose(["arch=hrm", "train.compile=true", "train.device=cpu"]), launching=False)
    check_environment(compose(["train.compile=true", "train.device=cpu"]), launching=False)   # g++ is here


@pytest.mark.slow
@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_compiled_blocks_under_fsdp_or_tensor_parallel_train_as_one_process(tmp_path, dp, tp):
    """FSDP2's hooks around each compiled block (dp 2), or the blocks' DTensor linears and sequence
    parallelism's sharded norms traced by dynamo (tp 2); measure_memory off: every step compiled."""
    from hrlplan.plan import homogeneous_plan

    plan = homogeneous_plan("gpt2-tiny", 2, [(0, 2)], dp=dp, tp=tp, microbatch_size=4 // dp, num_microbatches=1,
                            schedule="1f1b", sequence_parallel=tp > 1)
    overrides = GPT2 + ["train.measure_memory=false", "train.compile=true", "train.dp_mode=fsdp"]
    compiled = train_with_options(plan, overrides, tmp_path / "compiled", STEPS,
                                  stage_options={"sequence_parallel": tp > 1})["losses"]
    assert compiled == pytest.approx(reference_losses(GPT2, STEPS), abs=TOLERANCE)


def test_calibration_measures_the_compile_speedup_of_a_block():
    """The measuring function calibration calls (runtime/compile.measure_compile_speedup), on a tiny
    Llama block compiled with dynamo's eager backend (the logic without inductor's build time)."""
    import torch

    from hrlplan.runtime.compile import SPEEDUP_KEY, measure_compile_speedup

    part = _stage(["arch=llama-tiny", "arch.num_hidden_layers=2"])
    block = next(iter(getattr(part.base, part.blocks_attr).values()))

    class Alone(torch.nn.Module):   # the block with its rotary embeddings, as the stage calls it
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            positions = torch.arange(x.shape[1]).unsqueeze(0)
            return self.block(x, position_embeddings=part.base.rotary_emb(x, positions))

    out = measure_compile_speedup(Alone(), lambda: torch.randn(2, 16, block.hidden_size), rounds=2, steps=2,
                                  backend="eager")
    assert set(out) == {SPEEDUP_KEY, "min", "max", "compile_s"}
    assert out["min"] <= out[SPEEDUP_KEY] <= out["max"] and out[SPEEDUP_KEY] > 0 and out["compile_s"] > 0
    assert all(p.grad is None for p in block.parameters())   # the block leaves as it came


def test_the_cost_model_divides_the_blocks_compute_by_the_speedup():
    from hrlplan.cost.model import CostOptions, StageCostModel
    from test_cost import a100_node, llama7b_meta

    def stage(**opts):
        costs = StageCostModel(llama7b_meta(), a100_node(), CostOptions(bytes_per_value=2, **opts))
        return costs.stage(0, 8, False, False, [0], 1, 1, 1, 1)

    eager, compiled = stage(), stage(compile=True, compile_speedup=1.25)
    assert compiled.compute_fwd == pytest.approx(eager.compute_fwd / 1.25)
    assert stage(compile_speedup=1.25).compute_fwd == eager.compute_fwd           # only when the run compiles
    assert stage(compile=True).compute_fwd == eager.compute_fwd                   # uncalibrated: 1.0
    cal = a100_node()
    cal.calibration = dict(cal.calibration or {}, compile_speedup=1.5)
    measured = StageCostModel(llama7b_meta(), cal, CostOptions(bytes_per_value=2, compile=True))
    assert measured.dev.overheads.compile_speedup == 1.5


def test_a_compiling_run_calibrates_its_own_speedup(monkeypatch):
    """A run with train.compile has its own calibration (the cache key holds compile) and its record
    gains compile_speedup from one block (calibrate/compute.measure_compile), which cost/ reads."""
    import torch

    from hrlplan.compose import compose
    from hrlplan.launch.plan_cache import CALIBRATION_TRAIN_KEYS, PLAN_TRAIN_KEYS
    from hrlplan.runtime import compile as compile_module
    from hrlplan.runtime.calibrate import compute

    assert "compile" in CALIBRATION_TRAIN_KEYS and {"compile", "float8", "context_parallel"} <= set(PLAN_TRAIN_KEYS)
    seen = {}

    def fake(block, make_input, **kw):
        seen["shape"] = tuple(make_input().shape)
        return {compile_module.SPEEDUP_KEY: 1.25}

    monkeypatch.setattr(compute, "measure_compile_speedup", fake)
    arch = compose(["arch=gpt2-tiny", "arch.n_layer=2"])["arch"]
    out = compute.measure_compile(arch, 16, 2, torch.device("cpu"))
    assert out["compile_speedup"] == 1.25 and seen["shape"][:2] == (2, 16)
