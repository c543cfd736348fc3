"""SimResult.over_memory: the simulator flags a refusal for memory on the result, and the replica
predictions (cost/plans.py) read the flag, not the reason's wording."""
from dataclasses import asdict

from hrlplan.config import TrainConfig, section
from hrlplan.cost.plans import worst_memory_reason
from hrlplan.cost.simulator import SimResult, Simulator
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.search.space import SearchSpace
from tests.test_cost import toy_meta
from tests.test_hetero_planner import TRAIN, fast_slow


def _first_layout(fast_memory):
    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1, fast_memory=fast_memory)
    cfg, train = asdict(ExactPlannerConfig()), section(TrainConfig, TRAIN)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = SearchSpace(meta, cluster, cfg, train)
    c = next(iter(space.configs()))
    bounds = [round(i * 6 / c.n_stages) for i in range(c.n_stages + 1)]
    return sim, space.layout(c, list(zip(bounds[:-1], bounds[1:])))


def test_the_simulator_flags_a_refusal_for_memory():
    sim, layout = _first_layout(fast_memory=8)
    assert sim.evaluate(layout).feasible and not sim.evaluate(layout).over_memory
    sim, layout = _first_layout(fast_memory=1e-6)
    result = sim.evaluate(layout)
    assert not result.feasible and result.over_memory and result.reason.startswith("out of memory")


def test_replica_predictions_read_the_flag_not_the_wording():
    over = SimResult(False, float("inf"), reason="needs more than device 0 holds", memory_bytes={0: 2.0},
                     over_memory=True)
    sim, _ = _first_layout(fast_memory=8)
    assert worst_memory_reason(sim, [over]) == "needs more than device 0 holds"
    worded = SimResult(False, float("inf"), reason="out of memory, but not a memory refusal", memory_bytes={0: 2.0})
    assert worst_memory_reason(sim, [over, worded]) is None
