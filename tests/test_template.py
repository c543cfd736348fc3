"""Pipeline templates and heterogeneous plans: module lists, every error message, the plan format."""
import copy

import pytest
import yaml

from hrlplan.plan import Plan, PlanError, homogeneous_plan
from hrlplan.runtime.hetero import schedule_ops
from hrlplan.runtime.template import (
    MICROBATCHES_MISSING, MODULES_MISMATCH, RANKS_MISMATCH, HeterogeneousParallelPlugin, PipelineTemplate, build_plan,
    get_modules)


@pytest.fixture(scope="module")
def modules():
    return get_modules("gpt2-tiny")


def test_get_modules_lists_embeddings_blocks_and_head_in_order(modules):
    assert modules == ["transformer.wte", "transformer.wpe"] + [f"transformer.h.{i}" for i in range(6)] + \
        ["transformer.ln_f", "lm_head"]
    assert get_modules("llama-tiny")[:2] == ["model.embed_tokens", "model.layers.0"]
    assert get_modules("llama-tiny")[-2:] == ["model.norm", "lm_head"]


def test_unsupported_model_says_no_auto_policy():
    import torch.nn as nn

    with pytest.raises(NotImplementedError, match="Auto policy for Sequential is not implemented"):
        get_modules(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("stages", [
    lambda m: [m[:-1]],                       # head not covered
    lambda m: [m[:5], m[4:]],                 # transformer.h.2 twice
    lambda m: [m + ["transformer.h.9"]],      # a module the model does not have
], ids=["missing", "repeated", "unknown"])
def test_modules_not_matching_the_model(modules, stages):
    with pytest.raises(ValueError, match=MODULES_MISMATCH):
        PipelineTemplate("gpt2-tiny", stages(modules))


def test_embeddings_must_be_first_and_head_last(modules):
    with pytest.raises(ValueError, match="The first stage must contain transformer.wpe module"):
        PipelineTemplate("gpt2-tiny", [modules[:1], modules[1:]])
    with pytest.raises(ValueError, match="The last stage must contain transformer.ln_f module"):
        PipelineTemplate("gpt2-tiny", [modules[:-1], modules[-1:]])


def test_ranks_must_match_world_size_and_microbatches_every_template(modules):
    one, two = PipelineTemplate("gpt2-tiny", [modules]), PipelineTemplate("gpt2-tiny", [modules[:5], modules[5:]])
    with pytest.raises(AssertionError, match=RANKS_MISMATCH):
        build_plan([one, two], {one: 2, two: 2}, world_size=4, global_batch_size=8)
    with pytest.raises(AssertionError, match=RANKS_MISMATCH):   # tp 2 doubles every stage's ranks
        HeterogeneousParallelPlugin(tp_size=2, world_size=3).set_pipelines([one, two], {one: 2, two: 2})
    with pytest.raises(AssertionError, match=MICROBATCHES_MISSING):
        build_plan([one, two], {one: 2}, world_size=3, global_batch_size=8)


def test_heterogeneous_plan_round_trips_and_assigns_ranks(modules):
    one, two = PipelineTemplate("gpt2-tiny", [modules]), PipelineTemplate("gpt2-tiny", [modules[:5], modules[5:]])
    plugin = HeterogeneousParallelPlugin(tp_size=1, world_size=4, global_batch_size=12, unused_ranks=[3])
    plan = plugin.set_pipelines([one, two], {one: 1, two: 2})
    assert [p.batch_size for p in plan.pipelines] == [4, 8]       # shares follow micro-batch counts
    assert [s.ranks for s in plan.pipelines[1].stages] == [[1], [2]] and plan.unused_ranks == [3]
    text = plan.to_yaml()
    assert "device_groups" not in text and "num_microbatches: 2" in text
    again = Plan.from_yaml(text)
    assert again == plan and again.dp == 2
    assert again.layout() == "[E+h0-h5+H] (1 micro-batch of 4) || [E+h0-h2 | h3-h5+H] (2 micro-batches of 4)"


def test_homogeneous_yaml_is_unchanged():
    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 4), (4, 6)], dp=2, tp=1, microbatch_size=1, num_microbatches=4,
                            schedule="1f1b")
    d = yaml.safe_load(plan.to_yaml())
    assert "pipelines" not in d and "unused_ranks" not in d
    assert [p.batch_size for p in plan.as_pipelines()] == [4, 4]


def _hetero_dict():
    one, two = (PipelineTemplate("gpt2-tiny", s) for s in ([get_modules("gpt2-tiny")],
                                                          [get_modules("gpt2-tiny")[:5], get_modules("gpt2-tiny")[5:]]))
    return build_plan([one, two], {one: 2, two: 2}, world_size=3, global_batch_size=8).to_dict()


HETERO_CASES = {
    "shares not summing": (lambda d: d["pipelines"][0].update(batch_size=2), "pipelines", "sum to 6"),
    "rank twice": (lambda d: d["pipelines"][1]["stages"][1].update(ranks=[0]), "pipelines", "more than one group"),
    "rank missing": (lambda d: d.update(world_size=4), "world_size", "unused_ranks"),
    "interleaved": (lambda d: d.update(schedule="interleaved_1f1b"), "schedule", "gpipe and 1f1b"),
    "uncovered": (lambda d: d["pipelines"][1]["stages"][1].update(layers=[3, 5]), "pipelines[1].stages", "blocks 5"),
    "head": (lambda d: d["pipelines"][1]["stages"][1].update(head=False), "pipelines[1].stages[1].head", "last stage"),
    "micro-batches": (lambda d: d["pipelines"][0].update(num_microbatches=3), "pipelines[0].num_microbatches",
                      "do not divide"),
    "derived key": (lambda d: d.update(pp=2), "pp", "per pipeline"),
}


@pytest.mark.parametrize("case", sorted(HETERO_CASES))
def test_invalid_heterogeneous_plan_names_the_field(case):
    fn, field, words = HETERO_CASES[case]
    d = copy.deepcopy(_hetero_dict())
    fn(d)
    with pytest.raises(PlanError) as e:
        Plan.from_yaml(yaml.safe_dump(d))
    assert e.value.field == field, str(e.value)
    assert words in str(e.value)


def test_per_stage_tp_plan_validates():
    d = homogeneous_plan("llama-tiny", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                         schedule="1f1b").to_dict()
    d.update(world_size=3, device_groups=[[0, 1], [2]], meta={})
    d["stages"][0].update(ranks=[0, 1], tp=2)
    d["stages"][1].update(ranks=[2])
    plan = Plan.from_yaml(yaml.safe_dump(d))
    assert not plan.uniform_tp and [p.ranks for p in plan.as_pipelines()] == [[0, 1, 2]]
    d["schedule"] = "interleaved_1f1b"
    with pytest.raises(PlanError, match="unequal tp"):
        Plan.from_yaml(yaml.safe_dump(d))


def test_executor_orders():
    assert schedule_ops("gpipe", 2, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert schedule_ops("1f1b", 2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert schedule_ops("1f1b", 2, 1, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_heterogeneous_prediction_shares_contention_over_the_whole_world(modules):
    """More ranks than cores: every replica's compute is slowed by the calibrated factor times the
    busy share of all the world's ranks (a one-stage replica never idles, a two-stage one does)."""
    from hrlplan.cost.plans import predict_any_plan
    from hrlplan.model_meta import introspect, resolve_arch
    from tests.test_cost import toy_cluster

    one, two = PipelineTemplate("gpt2-tiny", [modules]), PipelineTemplate("gpt2-tiny", [modules[:5], modules[5:]])
    plan = build_plan([one, two], {one: 2, two: 2}, world_size=3, global_batch_size=8, model="gpt2-tiny")
    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    cl = toy_cluster(n=3, flops=[1e9] * 3)
    fast = predict_any_plan(plan, meta, cl)
    cl.calibration = {"contention_factor": {"compute": 2.0, "paired": 1.0}}
    slow = predict_any_plan(plan, meta, cl)
    ratio = slow["stages"][0]["fwd_s"] / fast["stages"][0]["fwd_s"]
    assert 1.0 < ratio < 2.0
    assert slow["stages"][1]["fwd_s"] / fast["stages"][1]["fwd_s"] == pytest.approx(ratio)
