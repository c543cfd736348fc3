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
    exact, _ = make_plan(meta, cluster, asdict(ExactPlannerConfig()), train)
    hrl, info = make_plan(meta, cluster, hrl_cfg(), train)
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
