"""Sequence parallelism, op-level selective recomputation and FSDP2 resharding: what the cost model
charges (hrlplan/cost/memory.py) against what the runtime holds (train.measure_memory's live
tensor storages, per rank), and the plan fields that carry them.

Each measured case trains 2 steps of a 4-block tiny model on gloo through the pipeline engine (the
cases of one world size in one launch: tests/_memory_runs.py) and compares every rank's measured peak
with plan_memory's `tensors` (the prediction less the workspace reserve): within 10%, never
under-predicted by more than 5%.
"""
from __future__ import annotations

import pytest

from hrlplan.cost import memory as cm
from hrlplan.cost.model import CostOptions, Layout, StageCostModel
from hrlplan.plan import Plan, PlanError, homogeneous_plan
from _memory_runs import assert_peak_within_10pct, measure_and_predict
from test_cost import a100_node, llama7b_meta

CASES = {   # name: (arch, spans, dp, tp, microbatch_size, micro-batches, recompute, sequence_parallel, reshard)
    "tp2": ("llama-tiny", [(0, 4)], 1, 2, 4, 1, "none", False, None),
    "tp2-sp": ("llama-tiny", [(0, 4)], 1, 2, 4, 1, "none", True, None),
    "gpt2-tp2-sp": ("gpt2-tiny", [(0, 4)], 1, 2, 4, 1, "none", True, None),
    "pp2-tp2-sp": ("llama-tiny", [(0, 2), (2, 4)], 1, 2, 2, 2, "none", True, None),
    "none": ("llama-tiny", [(0, 4)], 1, 1, 4, 1, "none", False, None),
    "selective": ("llama-tiny", [(0, 4)], 1, 1, 4, 1, "selective", False, None),
    "gpt2-selective": ("gpt2-tiny", [(0, 4)], 1, 1, 4, 1, "selective", False, None),
    "tp2-sp-selective": ("llama-tiny", [(0, 4)], 1, 2, 4, 1, "selective", True, None),
    "fsdp2-reshard": ("llama-tiny", [(0, 4)], 2, 1, 4, 1, "none", False, True),
    "fsdp2-gathered": ("llama-tiny", [(0, 4)], 2, 1, 4, 1, "none", False, False),
    "full": ("llama-tiny", [(0, 4)], 1, 1, 4, 1, "full", False, None),
    "gpt2-full": ("gpt2-tiny", [(0, 4)], 1, 1, 4, 1, "full", False, None),
    "pp2-full": ("llama-tiny", [(0, 2), (2, 4)], 1, 1, 2, 2, "full", False, None),
    "fsdp2-reshard-selective": ("llama-tiny", [(0, 4)], 2, 1, 4, 1, "selective", False, True),
    "fsdp2-gathered-full": ("llama-tiny", [(0, 4)], 2, 1, 4, 2, "full", False, False),
    "pp2-tp2-sp-full": ("llama-tiny", [(0, 2), (2, 4)], 1, 2, 2, 2, "full", True, None),
}


def _case_plan(name):
    arch, spans, dp, tp, mbs, m, recompute, sp, reshard = CASES[name]
    plan = homogeneous_plan(arch, 4, spans, dp=dp, tp=tp, microbatch_size=mbs, num_microbatches=m, schedule="1f1b",
                            recompute=recompute, sequence_parallel=sp, reshard_after_forward=reshard)
    layers = "arch.num_hidden_layers=4" if arch.startswith("llama") else "arch.n_layer=4"
    overrides = [f"arch={arch}", layers, f"train.global_batch_size={mbs * m * dp}", "train.dp_mode=fsdp"]
    return plan, overrides


@pytest.fixture(scope="module")
def measured_cases(tmp_path_factory):
    """Every case, one launch per world size (tests/_memory_runs.py)."""
    return measure_and_predict({name: _case_plan(name) for name in CASES}, tmp_path_factory.mktemp("sp_memory"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_measured_peak_per_rank_within_10pct_of_the_prediction(measured_cases, name):
    assert_peak_within_10pct(name, *measured_cases[name])


# ---------------------------------------------------------------- the model's terms (no run)
def _stage(recompute="none", tp=1, sp=False, dp=1, reshard=False, microbatches=4, meta=None):
    meta, cluster = meta or llama7b_meta(), a100_node()
    costs = StageCostModel(meta, cluster, CostOptions(bytes_per_value=2))
    group = list(range(tp * dp))
    return costs.stage(0, 8, False, False, group, tp, dp, 1, 2, recompute=recompute, microbatches=microbatches,
                       sequence_parallel=sp, reshard_after_forward=reshard)


def test_sequence_parallel_shards_the_replicated_activations_at_the_same_traffic():
    meta = llama7b_meta()
    h = meta.hidden_size
    # Korthikanti et al.: 10sbh + 24sbh/t without SP, 34sbh/t with it
    assert cm.held_per_token(meta, 4, "none", sequence_parallel=True) == pytest.approx(cm.held_per_token(meta, 1, "none") / 4)
    assert cm.held_per_token(meta, 4, "full", sequence_parallel=True) == pytest.approx(2 * h / 4)
    assert cm.held_per_token(meta, 1, "none", sequence_parallel=True) == cm.held_per_token(meta, 1, "none")
    tp, sp = _stage(tp=4), _stage(tp=4, sp=True)
    assert sp.activation < tp.activation
    # the same tp traffic; the norms and residual adds, whole on every tp rank without SP
    # (kernels.ELEMENTWISE_H_REPLICATED), run on a tp-th of the tokens with it
    assert sp.tp_comm_fwd == pytest.approx(tp.tp_comm_fwd) and sp.tp_comm_bwd == pytest.approx(tp.tp_comm_bwd)
    assert sp.compute_fwd < tp.compute_fwd and sp.fwd < tp.fwd and sp.bwd < tp.bwd
    assert sp.memory["buffers"] == pytest.approx(tp.memory["buffers"] / 4)


def _llama7b_with_shapes():
    import dataclasses

    return dataclasses.replace(llama7b_meta(), extra={"query_width": 4096, "kv_width": 4096, "ffn_size": 11008,
                                                      "gated_mlp": True, "block_class": "LlamaDecoderLayer"})


def test_op_level_selective_keeps_every_other_matmul_and_reruns_its_flops():
    meta = _llama7b_with_shapes()
    # Llama: q, k, v, o, gate, up, down -- q, v, gate, down kept (down whole: a row-parallel partial sum)
    assert [o for _, o, _ in cm.block_matmuls(meta)] == [4096, 4096, 4096, 4096, 11008, 11008, 4096]
    kept = cm.op_sac_saved_per_token(meta, 1, False)
    h, ffn = 4096, 11008
    assert kept == pytest.approx(2 * h + 2 * (h + h + ffn + h) + 2 * h + 4 * meta.num_heads)
    none, sel, full = (_stage(mode, meta=meta) for mode in ("none", "selective", "full"))
    assert full.activation < sel.activation < none.activation
    assert none.bwd < sel.bwd < full.bwd
    rerun = 2 * (h * h + h * h + h * ffn)   # k, o and up again
    assert cm.op_sac_recomputed_fraction(meta) == pytest.approx(rerun / meta.block_flops_fwd_per_token[0])


def test_reshard_after_forward_holds_fewer_gathered_weights_and_gathers_again():
    kept, reshard = _stage(dp=8, microbatches=1), _stage(dp=8, reshard=True, microbatches=1)
    assert reshard.memory["weights"] < kept.memory["weights"]
    assert reshard.bwd > kept.bwd and reshard.fwd == pytest.approx(kept.fwd)   # one micro-batch: no forward re-gather
    many, many_kept = _stage(dp=8, reshard=True, microbatches=4), _stage(dp=8, microbatches=4)
    assert many.fwd > many_kept.fwd   # each later micro-batch's forward gathers again
    assert _stage(dp=1, reshard=True).memory == _stage(dp=1).memory   # no FSDP sharding: nothing to reshard


# ---------------------------------------------------------------- plan fields
def _plan(**kw):
    return homogeneous_plan("llama-tiny", 4, [(0, 2), (2, 4)], dp=2, tp=2, microbatch_size=1, num_microbatches=4,
                            schedule="1f1b", **kw)


def test_fields_round_trip_and_old_plans_read_as_before():
    plan = _plan(recompute="selective", sequence_parallel=True, reshard_after_forward=True)
    again = Plan.from_yaml(plan.to_yaml())
    assert again == plan and again.sequence_parallel and again.resolved_reshard_after_forward()
    plain = _plan()
    text = plain.to_yaml()
    assert "sequence_parallel" not in text and "reshard_after_forward" not in text and "recompute" not in text
    assert Plan.from_yaml(text).reshard_after_forward is None
    assert not _plan().resolved_reshard_after_forward()   # pipelined: torchtitan keeps the weights gathered
    alone = homogeneous_plan("llama-tiny", 4, [(0, 4)], dp=2, tp=1, microbatch_size=1, num_microbatches=4,
                             schedule="1f1b")
    assert alone.resolved_reshard_after_forward()


@pytest.mark.parametrize("edit,field", [
    (("sequence_parallel: true", "sequence_parallel: false", 1), "stages[0].sequence_parallel"),
    (("sequence_parallel: true", "sequence_parallel: maybe", 1), "stages[0].sequence_parallel"),
    (("reshard_after_forward: true", "reshard_after_forward: sometimes", 1), "reshard_after_forward"),
    (("tp: 2", "tp: 1", 2), "stages"),
])
def test_bad_fields_are_refused_in_one_line_naming_them(edit, field):
    text = _plan(sequence_parallel=True, reshard_after_forward=True).to_yaml()
    old, new, count = edit
    bad = text.replace(old, new, count)
    if old == "tp: 2":   # tp 1 everywhere (with dp 4) but sequence_parallel still on
        bad = bad.replace("dp: 2", "dp: 4")
    with pytest.raises(PlanError) as e:
        Plan.from_yaml(bad)
    assert "\n" not in str(e.value) and field in str(e.value), str(e.value)


def test_layout_of_a_plan_carries_the_fields():
    from hrlplan.cost.plans import layout_of_plan

    lay = layout_of_plan(_plan(sequence_parallel=True, reshard_after_forward=True))
    assert isinstance(lay, Layout) and lay.sequence_parallel and lay.reshard_after_forward
    assert not layout_of_plan(_plan()).sequence_parallel and not layout_of_plan(_plan()).reshard_after_forward


def test_plan_info_stages_name_the_options():
    from hrlplan.cost.simulator import Simulator

    sim = Simulator(llama7b_meta(), a100_node(), CostOptions(bytes_per_value=2))
    base = dict(spans=((0, 32),), groups=(tuple(range(8)),), tp=4, dp=2, microbatch_size=1, num_microbatches=1,
                schedule="1f1b", recompute=("selective",))
    on = sim.evaluate(Layout(**base, sequence_parallel=True, reshard_after_forward=True), detail=True)
    off = sim.evaluate(Layout(**base), detail=True)
    assert on.stages[0]["sequence_parallel"] and on.stages[0]["reshard_after_forward"]
    assert not off.stages[0]["sequence_parallel"] and not off.stages[0]["reshard_after_forward"]
    assert on.stages[0]["recompute"] == "selective"
    assert max(on.memory_bytes.values()) < max(off.memory_bytes.values())
