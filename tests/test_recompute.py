"""Activation recomputation: its cost in time and memory per mode, and real training on CPU with it."""
import pytest

from hrlplan.cost.memory import held_per_token
from hrlplan.cost.model import CostOptions, Layout, StageCostModel
from hrlplan.cost.simulator import Simulator
from test_cost import a100_node, llama7b_meta


def _stage(recompute, tp=1, fused=True, mb=1):
    meta, cluster = llama7b_meta(), a100_node()
    costs = StageCostModel(meta, cluster, CostOptions(bytes_per_value=2, fused_attention=fused))
    group = list(range(tp))
    return costs.stage(0, 8, False, False, group, tp, 1, mb, 2, recompute=recompute, microbatches=4), costs


def test_full_recompute_reruns_the_forward_and_keeps_each_blocks_input():
    none, _ = _stage("none")
    full, _ = _stage("full")
    assert full.fwd == pytest.approx(none.fwd)
    # backward = its own work + the blocks' forward again
    assert full.bwd - none.bwd == pytest.approx(none.fwd, rel=1e-6)
    # the block's input only: 2h bytes per token per block, 8 blocks, 2048 tokens
    assert full.activation == pytest.approx(8 * 2 * 4096 * 2048)
    assert full.activation < none.activation / 10
    # a backward's working set: a rebuilt block beside a plain backward's work, less what the
    # micro-batch has freed by then (all but its first block's input: cost.memory.rebuilt_beyond_held)
    rebuilt = none.activation / 8 + none.memory["transient"]
    assert full.memory["transient"] == pytest.approx(rebuilt - full.activation * 7 / 8, rel=1e-6)
    assert full.static_memory - full.memory["transient"] == pytest.approx(none.static_memory - none.memory["transient"])


def test_full_recompute_also_reruns_the_tp_all_reduces():
    none, _ = _stage("none", tp=4)
    full, _ = _stage("full", tp=4)
    assert none.tp_comm_fwd > 0
    assert full.bwd - none.bwd == pytest.approx(none.fwd, rel=1e-6)


def test_selective_is_op_level_checkpointing_between_none_and_full():
    """selective = op-level SAC (every other matmul's output and the attention's kept, the cheap ops
    recomputed): it holds less than none and more than full, and recomputes less than full."""
    none, _ = _stage("none")
    sel, _ = _stage("selective")
    full, _ = _stage("full")
    assert none.bwd < sel.bwd < full.bwd
    assert full.activation < sel.activation < none.activation


def test_activations_split_replicated_and_sharded_over_tp():
    meta = llama7b_meta()
    h = meta.hidden_size
    one, four = held_per_token(meta, 1, "none"), held_per_token(meta, 4, "none")
    assert four - 10 * h == pytest.approx((one - 10 * h) / 4)    # Korthikanti: 10sbh + 24sbh/t (no SP)
    assert held_per_token(meta, 4, "full") == held_per_token(meta, 1, "full") == 2 * h


def test_recompute_lets_a_plan_fit_that_did_not():
    meta, cluster = llama7b_meta(), a100_node()
    sim = Simulator(meta, cluster, CostOptions(bytes_per_value=2))
    base = dict(spans=((0, 16), (16, 32)), groups=((0, 1), (2, 3)), tp=2, dp=1, microbatch_size=16,
                num_microbatches=8, schedule="1f1b")
    plain = sim.evaluate(Layout(**base))
    full = sim.evaluate(Layout(**base, recompute=("full", "full")))
    assert not plain.feasible and "out of memory" in plain.reason
    assert full.feasible
    assert max(full.memory_bytes.values()) < max(plain.memory_bytes.values())


def test_unknown_recompute_mode_is_refused():
    with pytest.raises(ValueError, match="recompute='some'"):
        _stage("some")


# ---------------------------------------------------------------- runtime (torch.utils.checkpoint)
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_give_the_same_loss_and_gradients(mode):
    """In one process: a stage whose blocks are checkpointed computes what the plain one does."""
    import copy

    import torch

    from hrlplan.models.hf import build_stage_modules, causal_lm_loss
    from hrlplan.runtime.recompute import apply_recompute

    model = _tiny_llama()
    plain = build_stage_modules(model, [(0, 2)])[0]
    wrapped = apply_recompute(copy.deepcopy(plain), mode)
    assert "checkpoint" in type(next(iter(wrapped.base.layers.values()))).__name__.lower()
    x = torch.randint(0, 64, (2, 16))
    grads = []
    for part in (plain, wrapped):
        loss = causal_lm_loss(part(x), x)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in part.parameters()]))
    assert grads[1][0] == pytest.approx(grads[0][0], abs=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the wrapped stage's state dict keeps the plain names (checkpoints stay loadable)
    assert set(wrapped.state_dict()) == set(plain.state_dict())


def test_op_level_policy_saves_every_other_matmul_and_attention_and_recomputes_the_rest():
    """torchtitan's op SAC: a block's 1st, 3rd, ... matmul kept, the 2nd, 4th, ... recomputed, counted
    apart in forward and in the recomputation; attention kernels kept; cheap ops recomputed."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from hrlplan.runtime.recompute import ALWAYS_SAVED, _op_policy

    class Ctx:
        def __init__(self, is_recompute):
            self.is_recompute = is_recompute
    counts = {"forward": 0, "recompute": 0}
    policy = _op_policy(counts)
    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [policy(Ctx(False), f) for f in (mm, mm, addmm, mm)] == [save, again, save, again]
    assert [policy(Ctx(True), f) for f in (mm, mm)] == [save, again]   # the recomputation picks the same
    assert policy(Ctx(False), torch.ops.aten.mul.Tensor) == again
    assert policy(Ctx(False), torch.ops.aten.silu.default) == again
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert sdpa in ALWAYS_SAVED and policy(Ctx(False), sdpa) == save


@pytest.mark.parametrize("arch", ["llama-tiny", "gpt2-tiny"])
def test_selective_holds_between_none_and_full(arch):
    """Measured on one stage in one process (runtime.memory's live-storage tracker): op-level SAC
    keeps less than none and more than full, and trains the same."""
    import copy

    import torch

    from hrlplan.compose import compose
    from hrlplan.models.hf import HFStage, causal_lm_loss
    from hrlplan.runtime.memory import LiveStorageTracker
    from hrlplan.runtime.recompute import apply_recompute
    from hrlplan.runtime.trainer import build_full_model

    layers = "arch.num_hidden_layers=2" if arch.startswith("llama") else "arch.n_layer=2"
    model = build_full_model(compose([f"arch={arch}", layers])["arch"], 0)
    plain = HFStage(model, 0, 2, True, True)
    x = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    held, losses = {}, {}
    for mode in ("none", "selective", "full"):
        part = apply_recompute(copy.deepcopy(plain), mode)
        tracker = LiveStorageTracker("cpu", lambda: ([part], []))
        tracker.track_tensors(part.parameters())
        with tracker:
            loss = causal_lm_loss(part(x), x)
            loss.backward()
        held[mode], losses[mode] = tracker.result()["activations"], loss.item()
    print(arch, "activations held (bytes):", held)
    assert held["full"] < held["selective"] < held["none"]
    assert losses["selective"] == losses["full"] == pytest.approx(losses["none"], abs=1e-6)


@pytest.mark.slow
def test_two_stage_plan_with_recompute_trains_as_without(tmp_path):
    """pp 2 through the pipeline engine: selective and full train what none trains, and the measured
    peak memory per rank (train.measure_memory) orders none > selective > full."""
    from hrlplan.plan import homogeneous_plan
    from hrlplan.launch.local_run import train_plan
    from hrlplan.compose import compose

    config = compose(["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3", "train.steps=3",
                      "train.checkpoint_interval=0", "logger.mode=disabled", "train.global_batch_size=8"])
    losses, memory = {}, {}
    for mode in ("none", "selective", "full"):
        plan = homogeneous_plan("gpt2-tiny", 4, [(0, 2), (2, 4)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                                schedule="1f1b", recompute=mode)
        summary = train_plan(plan, config, tmp_path / mode, metrics_file=False)
        losses[mode] = [h["train/lm_loss"] for h in summary["history"]]
        memory[mode] = summary["measured"]["memory_split_per_rank"]
    assert losses["full"] == pytest.approx(losses["none"], abs=1e-6)
    assert losses["selective"] == pytest.approx(losses["none"], abs=1e-6)
    for rank in (0, 1):
        row = {mode: memory[mode][rank] for mode in memory}
        print(f"rank {rank}:", {mode: (m["activations"], m["peak"]) for mode, m in row.items()})
        assert row["full"]["activations"] < row["selective"]["activations"] < row["none"]["activations"]
        assert row["full"]["peak"] < row["selective"]["peak"] < row["none"]["peak"]
