"""planner=hrl on a heterogeneous cluster plans replicas with the learned replica policy alone
(search/hrl_replicas.py), never worse than its own single template, and says it proved nothing."""
from dataclasses import asdict

import pytest

from hrlplan.config import HRLPlannerConfig
from hrlplan.errors import UserError
from hrlplan.plan import validate
from hrlplan.search import make_plan
from tests.test_cost import toy_meta
from tests.test_hetero_planner import TRAIN, preset


def _uneven():
    return preset([dict(count=1, device="fast", devices_per_node=3, memory_gb=8, tflops=4, intra_node_GBps=100),
                   dict(count=1, device="slow", devices_per_node=2, memory_gb=8, tflops=1, intra_node_GBps=50)])


def _hrl_cfg(**over):
    return dict(asdict(HRLPlannerConfig()), train_steps=0, samples=32, progress=False, hetero_time_s=8.0, **over)


def test_hrl_plans_replicas_on_uneven_nodes_and_claims_no_proof():
    meta, cluster = toy_meta(n_layer=6), _uneven()
    train = dict(TRAIN, global_batch_size=12)
    single, _ = make_plan(meta, cluster, _hrl_cfg(heterogeneous="false"), train)
    plan, info = make_plan(meta, cluster, _hrl_cfg(heterogeneous="true"), train)
    validate(plan)
    assert plan.heterogeneous   # three replicas on the 3-device node beat any one template
    hetero = info["planner"]["heterogeneous"]
    assert hetero["ran"] and not hetero["proven"] and "learned replica policy" in hetero["note"]
    assert hetero["learned_replicas"]["calls"] > 0
    assert plan.meta["predicted"]["step_time_s"] <= single.meta["predicted"]["step_time_s"] * (1 + 1e-12)


def test_random_planner_refuses_heterogeneous_true():
    meta, cluster = toy_meta(n_layer=6), _uneven()
    with pytest.raises(UserError, match="planner.name=exact or hrl"):
        make_plan(meta, cluster, dict(name="random", samples=8, heterogeneous="true"), TRAIN)
