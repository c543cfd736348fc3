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
    # one block's full activations live while it is recomputed
    assert full.static_memory - none.static_memory == pytest.approx(none.activation / 8, rel=1e-6)


def test_full_recompute_also_reruns_the_tp_all_reduces():
    none, _ = _stage("none", tp=4)
    full, _ = _stage("full", tp=4)
    assert none.tp_comm_fwd > 0
    assert full.bwd - none.bwd == pytest.approx(none.fwd, rel=1e-6)


def test_selective_recomputes_the_attention_core_only():
    none, _ = _stage("none")
    sel, _ = _stage("selective")
    full, _ = _stage("full")
    assert none.bwd < sel.bwd < full.bwd
    # with SDPA (fused attention) the core stores no scores: selective saves no memory
    assert sel.activation == pytest.approx(none.activation)
    # an attention that stores the s x s scores (Korthikanti et al.'s 5as per token) loses them
    eager_none, _ = _stage("none", fused=False)
    eager_sel, _ = _stage("selective", fused=False)
    meta = llama7b_meta()
    scores = 5 * meta.num_heads * meta.seq_len
    assert eager_none.activation - eager_sel.activation == pytest.approx(8 * 2048 * scores)
    assert eager_sel.activation == pytest.approx(sel.activation)


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
