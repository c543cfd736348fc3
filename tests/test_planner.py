"""Planners: exact vs brute force, exported plans validate and launch uniformly, make_plan contract."""
import itertools
from dataclasses import asdict

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo, spec_from_preset
from hrlplan.cost.simulator import Simulator
from hrlplan.plan import Plan, validate
from hrlplan.search import make_plan
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig, ManualPlannerConfig, RandomPlannerConfig
from hrlplan.search.space import SearchSpace
from tests.test_cost import toy_meta

GiB = 2 ** 30
TRAIN = dict(global_batch_size=8, schedule="1f1b", stages_per_rank=1, microbatches="auto", dtype="float32",
             dp_mode="fsdp")


def two_type_preset(nodes=(1, 1), per_node=2):
    groups = [dict(count=nodes[0], device="fast", devices_per_node=per_node, memory_gb=8, tflops=4, intra_node_GBps=100),
              dict(count=nodes[1], device="slow", devices_per_node=per_node, memory_gb=8, tflops=1, intra_node_GBps=50)]
    return spec_from_preset(dict(name="mix", node_groups=groups, inter_node_GBps=10, intra_node_latency_us=2,
                                 inter_node_latency_us=5))


def cpu_probe(n=2):
    devs = [DeviceInfo(rank=i, node=0, local_rank=i, hostname="h", kind="cpu", name="cpu", memory_bytes=8 * GiB,
                       peak_flops=5e10) for i in range(n)]
    bw = [[0 if i == j else 2e9 for j in range(n)] for i in range(n)]
    lat = [[0 if i == j else 2e-5 for j in range(n)] for i in range(n)]
    return ClusterSpec(name="local", devices=devs, source="probe", bandwidth=bw, latency=lat, intra_node_bw=[2e9])


def brute_force(meta, cluster, cfg, train):
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = SearchSpace(meta, cluster, cfg, train)
    space.sim = sim   # layouts pick each stage's recomputation as the planners' do
    best = float("inf")
    L = meta.n_layer
    for c in space.configs():
        for cuts in itertools.combinations(range(1, L), c.n_stages - 1):
            b = (0,) + cuts + (L,)
            res = sim.evaluate(space.layout(c, [(b[i], b[i + 1]) for i in range(c.n_stages)]))
            if res.feasible:
                best = min(best, res.step_time_s)
    return best


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_zero_bubble", 1), ("zbv", 2),
                                        ("dualpipev", 2)])
@pytest.mark.parametrize("cluster_fn", [lambda: two_type_preset(), lambda: cpu_probe(4)])
def test_exact_matches_brute_force(schedule, v, cluster_fn):
    meta, cluster = toy_meta(n_layer=7), cluster_fn()
    # single templates only: brute force enumerates those (a replica plan may beat them on the mixed preset;
    # tests/test_hetero_planner.py checks replica plans against their own brute force)
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2, 4], heterogeneous=False)
    train = dict(TRAIN, schedule=schedule, stages_per_rank=v)
    plan, info = make_plan(meta, cluster, cfg, train)
    assert plan.meta["planner"]["proven_optimal"]
    assert plan.meta["predicted"]["step_time_s"] == pytest.approx(brute_force(meta, cluster, cfg, train), rel=1e-9)


def test_exact_gives_up_beyond_max_evaluations():
    meta, cluster = toy_meta(n_layer=8), two_type_preset(nodes=(2, 2))
    # the single-template search alone (replicas would spend planner.hetero_time_s on what it left)
    plan, _ = make_plan(meta, cluster, dict(asdict(ExactPlannerConfig()), max_evaluations=10, heterogeneous=False),
                        TRAIN)
    assert not plan.meta["planner"]["proven_optimal"]
    assert "gave up" in plan.meta["planner"]["note"]


def test_local_cpu_plan_is_cheap_uses_every_worker_and_validates(monkeypatch):
    # cheap = few simulator calls, not a wall-clock bound (speed targets live in bench/): brute force scores
    # 29 layouts here; branch and bound needs 6 evaluate calls (chosen plan and its detail included)
    evaluate_calls = []
    evaluate = Simulator.evaluate
    monkeypatch.setattr(Simulator, "evaluate", lambda self, *a, **k: evaluate_calls.append(1) or evaluate(self, *a, **k))
    meta, cluster = toy_meta(n_layer=6), cpu_probe(2)
    plan, info = make_plan(meta, cluster, asdict(ExactPlannerConfig()), TRAIN)
    assert len(evaluate_calls) <= 10, f"{len(evaluate_calls)} simulator evaluations for a 2-CPU plan"
    planner = plan.meta["planner"]
    assert planner["configs_pruned_by_bound"] >= planner["configs"] // 2, planner
    assert plan.world_size == 2
    validate(plan)
    for key in ("launch", "predicted", "planner"):
        assert key in plan.meta
    assert len(plan.meta["predicted"]["memory_bytes_per_rank"]) == 2
    assert {"name", "evaluations", "time_s"} <= set(plan.meta["planner"])
    assert "compute_s" in info["chosen"]["breakdown"] and info["why"]["text"]
    # round trip through YAML
    assert Plan.from_yaml(plan.to_yaml()).layout() == plan.layout()


@pytest.mark.parametrize("name", ["exact", "random", "hrl"])
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
                                        ("interleaved_zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)])
def test_every_exported_plan_validates_with_uniform_launch(name, schedule, v):
    meta, cluster = toy_meta(n_layer=8), two_type_preset(nodes=(2, 1))
    cfg = {"exact": asdict(ExactPlannerConfig()), "random": dict(asdict(RandomPlannerConfig()), samples=32),
           "hrl": {"name": "hrl", "samples": 16, "train_steps": 2, "batch_size": 4, "progress": False,
                   "use_pretrained": False, "max_pp": 64, "max_tp": 8, "microbatch_sizes": [1, 2, 4]}}[name]
    plan, _ = make_plan(meta, cluster, cfg, dict(TRAIN, schedule=schedule, stages_per_rank=v))
    validate(plan)
    launch = plan.meta["launch"]
    counts = {len(v.split(",")) for v in launch["per_node_visible_devices"]}
    assert counts == {launch["nproc_per_node"]}
    assert launch["nnodes"] * launch["nproc_per_node"] == plan.world_size


def test_limits_and_fixed_microbatches_are_respected():
    meta, cluster = toy_meta(n_layer=8), cpu_probe(4)
    cfg = dict(asdict(ExactPlannerConfig()), max_pp=1, max_tp=1)
    plan, _ = make_plan(meta, cluster, cfg, TRAIN)
    assert plan.pp == 1 and plan.stages[0].tp == 1 and plan.dp == 4
    plan, _ = make_plan(meta, cluster, dict(asdict(ExactPlannerConfig()), max_tp=1),
                        dict(TRAIN, microbatches=2, global_batch_size=16))
    assert plan.num_microbatches == 2
    assert plan.microbatch_size * plan.num_microbatches * plan.dp == 16


def test_manual_plan_is_checked_against_the_cluster(tmp_path):
    meta, cluster = toy_meta(n_layer=6), cpu_probe(2)
    plan, _ = make_plan(meta, cluster, asdict(ExactPlannerConfig()), TRAIN)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    again, info = make_plan(meta, cluster, dict(asdict(ManualPlannerConfig()), plan_file=str(path)), TRAIN)
    assert again.layout() == plan.layout()
    from hrlplan.plan import PlanError

    with pytest.raises(PlanError):
        make_plan(meta, cpu_probe(4), dict(asdict(ManualPlannerConfig()), plan_file=str(path)), TRAIN)


def test_heterogeneous_plan_gives_fast_devices_more_layers():
    meta, cluster = toy_meta(n_layer=12), two_type_preset(nodes=(1, 1), per_node=2)
    cfg = dict(asdict(ExactPlannerConfig()), max_tp=1)
    plan, _ = make_plan(meta, cluster, dict(cfg, max_pp=2), dict(TRAIN, global_batch_size=16))
    if plan.pp == 2:
        types = plan.meta["device_types_per_stage"]
        layers = {t: s.num_layers for t, s in zip(types, plan.stages)}
        assert layers["fast"] > layers["slow"]


def test_show_plan_renders_layout_table_and_why(tmp_path):
    import json

    from hrlplan.search.commands import render

    meta, cluster = toy_meta(n_layer=8), two_type_preset(nodes=(1, 1))
    plan, info = make_plan(meta, cluster, asdict(ExactPlannerConfig()), TRAIN)
    text = render(Plan.from_yaml(plan.to_yaml()), json.loads(json.dumps(info)))
    assert plan.layout() in text and "why:" in text and "stage" in text


# ---------------------------------------------------------------- issue 32: SP, op-level SAC, resharding
def test_layouts_run_sequence_parallel_on_tp_and_search_resharding_without_pipelining():
    from hrlplan.search.plan_text import layout_summary, plan_summary
    from hrlplan.search.space import to_plan

    meta, cluster = toy_meta(n_layer=4), cpu_probe(4)
    cfg = asdict(ExactPlannerConfig())
    space = SearchSpace(meta, cluster, cfg, TRAIN)
    space.sim = Simulator(meta, cluster, cost_options(cfg, TRAIN))
    configs = list(space.configs())
    # resharding both ways only for FSDP over dp > 1 without pipelining (torchtitan's domain)
    assert {c.reshard_after_forward for c in configs if c.pp == 1 and c.dp > 1} == {False, True}
    assert not any(c.reshard_after_forward for c in configs if c.pp > 1 or c.dp == 1)
    assert SearchSpace(meta, cluster, cfg, dict(TRAIN, dp_mode="replicate")).reshard_options(1, 4) == (False,)
    tp2 = next(c for c in configs if c.tp == 2 and c.pp == 1 and c.reshard_after_forward)
    layout = space.layout(tp2, [(0, 4)])
    assert layout.sequence_parallel and layout.reshard_after_forward
    result = space.sim.evaluate(layout, detail=True)
    plan = to_plan(meta, cluster, layout, result, {})
    again = Plan.from_yaml(plan.to_yaml())
    assert again.sequence_parallel and again.reshard_after_forward is None   # the default without pipelining: unwritten
    assert "sequence parallel" in layout_summary(layout) and "[sequence parallel]" in plan_summary(again)
    kept = next(c for c in configs if c.tp == 1 and c.pp == 1 and c.dp == 4 and not c.reshard_after_forward)
    plan = to_plan(meta, cluster, space.layout(kept, [(0, 4)]), result, {})
    assert plan.reshard_after_forward is False and "FSDP keeps weights gathered" in plan_summary(plan)
    pp2 = next(c for c in configs if c.pp == 2 and c.tp == 1)
    assert not space.layout(pp2, [(0, 2), (2, 4)]).sequence_parallel


def test_planner_recompute_selective_is_op_level_sac():
    from hrlplan.search.space import recompute_modes

    assert recompute_modes({"recompute": "auto"}) == ("none", "selective", "full")
    meta, cluster = toy_meta(n_layer=4), cpu_probe(2)
    plan, _ = make_plan(meta, cluster, dict(asdict(ExactPlannerConfig()), recompute="selective"), TRAIN)
    assert {s.recompute for s in plan.stages} == {"selective"}
