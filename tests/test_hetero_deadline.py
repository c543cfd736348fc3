"""The replica search's deadline reaches every long step: a replica template's branch and bound stops
at it even inside a split enumeration that simulates nothing (llama-70b on 9 L40S nodes enumerated
for 76 s past it), returning its best so far and saying it ran out of time."""
import types
from dataclasses import asdict

import hrlplan.search.exact as exact_module
import hrlplan.search.hetero as hetero_module
from hrlplan.config import TrainConfig, section
from hrlplan.cost.simulator import Simulator
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.search.hetero import HeteroSpace, ReplicaSpace, Shape, search_exact_until
from hrlplan.search.splits import SplitTables
from tests.test_cost import toy_meta
from tests.test_hetero_planner import TRAIN, fast_slow


class FakeClock:
    """perf_counter for the search modules: frozen until a test moves it."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _replica_space(cfg):
    meta = toy_meta(n_layer=6)
    meta.model_type = "llama"
    cluster, train = fast_slow(1, 1), section(TrainConfig, TRAIN)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = HeteroSpace(cluster, 2)
    rs = ReplicaSpace(meta, cluster, cfg, dict(asdict(train), global_batch_size=4),
                      space.shape_pool("fast", Shape(2, 1)))
    rs.sim = sim
    return sim, rs


def test_a_split_enumeration_that_simulates_nothing_stops_at_the_deadline(monkeypatch):
    clock = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(exact_module, "time", fake_time)
    monkeypatch.setattr(hetero_module, "time", fake_time)
    seen = []

    def long_enumeration(self, threshold):
        """What ran long: node after node below the incumbent, no split complete, no simulation --
        the clock passes the deadline in there; only the threshold can end it."""
        clock.now = 100.0
        for node in range(10_000):
            if threshold() == float("-inf"):
                seen.append(node)
                return
            yield from ()
        seen.append(None)

    monkeypatch.setattr(SplitTables, "splits_below", long_enumeration)
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1])
    sim, rs = _replica_space(cfg)
    out = search_exact_until(sim, rs, cfg, deadline=10.0, budget_key="the test's deadline")
    assert seen == [0], "the enumeration went on past the deadline"
    assert out["out_of_time"] and not out["proven_optimal"]
    assert out["tracker"].best is not None   # the DP split simulated before the deadline: the best so far
    assert "gave up at the test's deadline" in out["note"]


def test_a_deadline_already_past_returns_at_once_unproven():
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1])
    sim, rs = _replica_space(cfg)
    before = sim.evaluations
    out = search_exact_until(sim, rs, cfg, deadline=0.0, budget_key="a past deadline")
    assert out["out_of_time"] and not out["proven_optimal"] and sim.evaluations == before
    assert "gave up at a past deadline" in out["note"]


def test_a_template_search_within_its_deadline_is_unchanged():
    """The deadline passed down changes nothing where the search ends in time: the same template,
    the same proof as search_exact alone."""
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2])
    sim, rs = _replica_space(cfg)
    timed = search_exact_until(sim, rs, cfg, deadline=float("inf"), budget_key="none")
    plain = exact_module.search_exact(sim, rs, cfg)
    assert timed["tracker"].best.layout == plain["tracker"].best.layout
    assert timed["proven_optimal"] == plain["proven_optimal"] and not timed.get("out_of_time")
