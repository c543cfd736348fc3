"""HRL planner: reaches the exact optimum after short seeded training; deterministic; checkpoints."""
from dataclasses import asdict

import pytest

from hrlplan.search import make_plan
from hrlplan.search.config import ExactPlannerConfig, HRLPlannerConfig
from tests.test_cost import toy_meta
from tests.test_planner import TRAIN, two_type_preset


def hrl_cfg(**kw):
    cfg = dict(asdict(HRLPlannerConfig()), train_steps=15, batch_size=16, samples=32, progress=False,
               use_pretrained=False, refine=False, greedy_configs=1, seed=3)
    cfg.update(kw)
    return cfg


def test_hrl_reaches_exact_optimum_after_short_training():
    meta, cluster = toy_meta(n_layer=10), two_type_preset(nodes=(1, 1))
    train = dict(TRAIN, global_batch_size=16)
    # single templates on both sides (exact's replica plans may beat every single template here)
    exact, _ = make_plan(meta, cluster, dict(asdict(ExactPlannerConfig()), heterogeneous=False), train)
    hrl, info = make_plan(meta, cluster, hrl_cfg(heterogeneous=False), train)
    assert hrl.meta["predicted"]["step_time_s"] == pytest.approx(exact.meta["predicted"]["step_time_s"], rel=1e-9)
    assert hrl.meta["planner"]["name"] == "hrl" and hrl.meta["planner"]["evaluations"] > 0


def test_hrl_is_deterministic_for_a_seed():
    meta, cluster = toy_meta(n_layer=10), two_type_preset(nodes=(2, 1))
    a, _ = make_plan(meta, cluster, hrl_cfg(train_steps=3, samples=8), TRAIN)
    b, _ = make_plan(meta, cluster, hrl_cfg(train_steps=3, samples=8), TRAIN)
    assert a.to_yaml().split("planner:")[0] == b.to_yaml().split("planner:")[0]


def test_policy_checkpoint_round_trip(tmp_path):
    from hrlplan.search.hrl.policy import HierarchicalPolicy, load_policy, save_policy

    pol = HierarchicalPolicy(16)
    path = save_policy(pol, tmp_path)
    assert path.stat().st_size < 1_000_000
    again = load_policy(tmp_path)
    for (k, v), (_, w) in zip(pol.state_dict().items(), again.state_dict().items()):
        assert (v.half().float() == w).all(), k


def _zero_shot_cfg(**kw):
    cfg = dict(asdict(HRLPlannerConfig()), train_steps=0, samples=32, progress=False, seed=0)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("seed", [900002, 900012])
def test_shipped_generalist_plans_held_out_instances_near_exact(seed):
    from hrlplan.search.hrl.generate import HELD_OUT_SEEDS, is_benchmark_like, random_instance
    from hrlplan.search.hrl.policy import checkpoint_extra, generalist_path

    path = generalist_path()
    assert path.exists() and path.stat().st_size < 1_000_000
    extra = checkpoint_extra(path)
    assert extra["kind"] == "generalist" and extra["updates"] > 0
    assert seed in HELD_OUT_SEEDS and not (extra["train_seeds"][0] <= seed <= extra["train_seeds"][1])
    inst = random_instance(seed)
    assert not is_benchmark_like(inst.meta, inst.cluster)
    # the space HRL plans in: one template (the replica search would only add its own budget here)
    exact, _ = make_plan(inst.meta, inst.cluster, dict(asdict(ExactPlannerConfig()), heterogeneous=False), inst.train)
    hrl, _ = make_plan(inst.meta, inst.cluster, _zero_shot_cfg(), inst.train)
    assert hrl.meta["planner"]["policy"] == "shipped generalist"
    assert exact.meta["predicted"]["step_time_s"] / hrl.meta["predicted"]["step_time_s"] >= 0.97


def test_generalist_zero_shot_is_deterministic():
    from hrlplan.search.hrl.generate import random_instance

    inst = random_instance(900002)
    a, _ = make_plan(inst.meta, inst.cluster, _zero_shot_cfg(samples=16), inst.train)
    b, _ = make_plan(inst.meta, inst.cluster, _zero_shot_cfg(samples=16), inst.train)
    assert a.to_yaml().split("planner:")[0] == b.to_yaml().split("planner:")[0]


def test_generated_instances_are_disjoint_from_the_benchmark():
    from hrlplan.search.hrl.generate import HELD_OUT_SEEDS, TRAIN_SEEDS, is_benchmark_like, random_instance

    assert not set(TRAIN_SEEDS) & set(HELD_OUT_SEEDS)
    for seed in list(TRAIN_SEEDS)[:5] + list(HELD_OUT_SEEDS)[:5]:
        inst = random_instance(seed)
        assert not is_benchmark_like(inst.meta, inst.cluster)


def test_estimate_sees_mixed_groups_run_at_the_slowest_pace():
    """pp=1 configs have no split to choose: the estimate should track the simulator, including on
    groups mixing fast and slow devices (where the summed-throughput lower bound is far off)."""
    from hrlplan.cost.simulator import Simulator
    from hrlplan.search.common import cost_options
    from hrlplan.search.estimate import ConfigEstimator
    from hrlplan.search.exact import lower_bound
    from hrlplan.search.space import SearchSpace

    meta, cluster = toy_meta(n_layer=8), two_type_preset(nodes=(1, 1))
    cfg = asdict(HRLPlannerConfig())
    sim = Simulator(meta, cluster, cost_options(cfg, TRAIN))
    space = SearchSpace(meta, cluster, cfg, TRAIN)
    est = ConfigEstimator(sim, space)
    mixed = 0
    for c in space.configs():
        if c.pp != 1:
            continue
        res = sim.evaluate(space.layout(c, [(0, meta.n_layer)]))
        e = est.estimate(c)
        if res.feasible:
            assert e.step_s == pytest.approx(res.step_time_s, rel=0.1)
            if c.pool.label == "all":
                mixed += 1
                assert lower_bound(sim, space, c) < 0.5 * res.step_time_s
    assert mixed
