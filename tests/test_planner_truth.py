"""The planner's claims hold: exact is the simulator's optimum (splits, configurations, idle
ranks), a plan marked proven is never beaten, and plans that do not fit are refused by name."""
import itertools
from dataclasses import asdict

import pytest

from hrlplan import schedules
from hrlplan.cost.simulator import Simulator
from hrlplan.errors import UserError
from hrlplan.plan import homogeneous_plan
from hrlplan.search import make_plan
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig, HRLPlannerConfig, ManualPlannerConfig, RandomPlannerConfig
from hrlplan.search.placement import compact, place_on_ranks
from hrlplan.search.space import SearchSpace
from tests.test_cost import toy_meta
from tests.test_planner import TRAIN, cpu_probe, two_type_preset

# A 2-core host as calibration sees it: every rank busy slows compute 1.9x, a pipeline hop and an
# FSDP collective cost milliseconds -- where one worker alone can beat two.
SHARED_CORES = {"contention_factor": 2.0, "compute_efficiency": 1.0, "op_overhead_s": {"fwd": 2e-4, "bwd": 4e-4},
                "p2p_latency_s": 4e-3, "allreduce_latency_s": 1e-3, "dp_collective_s": {"allgather": 3e-3,
                                                                                           "reduce": 5e-3},
                "step_overhead_s": 1e-3}


def shared_core_host(n=2, cores=2):
    cluster = cpu_probe(n)
    cluster.calibration = dict(SHARED_CORES)
    return cluster


def every_split(meta, cluster, cfg, train):
    """(step time, layout) of the simulator's best plan by brute force over every split."""
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = SearchSpace(meta, cluster, cfg, train)
    space.sim = sim   # layouts pick each stage's recomputation as the planners' do
    best = (float("inf"), None)
    L = meta.n_layer
    for c in space.configs():
        for cuts in itertools.combinations(range(1, L), c.n_stages - 1):
            b = (0,) + cuts + (L,)
            lay = space.layout(c, [(b[i], b[i + 1]) for i in range(c.n_stages)])
            res = sim.evaluate(lay)
            if res.feasible and res.step_time_s < best[0]:
                best = (res.step_time_s, lay)
    return best


@pytest.mark.parametrize("variant", [dict(dp_overlap=False), dict(dp_mode="replicate"), dict(shared=True),
                                     dict(schedule="gpipe", shared=True)])
def test_exact_is_the_simulators_best_over_every_split(variant):
    variant = dict(variant)
    shared = variant.pop("shared", False)
    meta = toy_meta(n_layer=6)
    cluster = shared_core_host() if shared else two_type_preset()
    # the single-template space brute force walks (replica plans: tests/test_hetero_planner.py's proof;
    # with dp_overlap=false a replica plan's overlapped reduce can beat every template here)
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2, 4], heterogeneous=False,
               **{k: v for k, v in variant.items() if k == "dp_overlap"})
    train = dict(TRAIN, **{k: v for k, v in variant.items() if k != "dp_overlap"})
    plan, _ = make_plan(meta, cluster, cfg, train)
    best, layout = every_split(meta, cluster, cfg, train)
    assert plan.meta["planner"]["proven_optimal"]
    assert plan.meta["predicted"]["step_time_s"] == pytest.approx(best, rel=1e-9), layout


def test_one_worker_alone_is_a_plan_when_it_is_faster():
    meta = toy_meta(n_layer=6)
    plan, info = make_plan(meta, shared_core_host(), asdict(ExactPlannerConfig()), TRAIN)
    best, layout = every_split(meta, shared_core_host(), asdict(ExactPlannerConfig()), TRAIN)
    assert plan.meta["predicted"]["step_time_s"] == pytest.approx(best, rel=1e-9)
    assert plan.world_size == 2 and plan.unused_ranks == [1]     # the job launches both; rank 1 idles
    assert [s.ranks for s in plan.stages] == [[0]] * len(plan.stages)
    no_idle, _ = make_plan(meta, shared_core_host(), dict(asdict(ExactPlannerConfig()), allow_idle_ranks=False), TRAIN)
    assert not no_idle.unused_ranks and no_idle.meta["predicted"]["step_time_s"] > plan.meta["predicted"]["step_time_s"]


def test_idle_ranks_placement_round_trips():
    plan = homogeneous_plan("toy", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=1, num_microbatches=4,
                            schedule="1f1b")
    launch = {"nnodes": 2, "nproc_per_node": 2, "per_node_visible_devices": ["0,1", "0,1"]}
    placed = place_on_ranks(plan, [0, 2], 4, launch)
    assert placed.unused_ranks == [1, 3] and [s.ranks for s in placed.stages] == [[0], [2]]
    back, used = compact(placed)
    assert used == [0, 2] and back.world_size == 2 and [s.ranks for s in back.stages] == [[0], [1]]
    assert not back.unused_ranks


# Held-out seeds on which exact spends its whole simulation budget (max_simulations, a count, so the
# same on every machine) without proving the optimum: the loop below would skip them after the
# search, and 900011's search alone was half of this test's time. Drop a seed from here if exact
# ever proves it.
# instances exact takes over 5 s on (interleaved or gpipe on 46-64 layers): left out to keep the suite short
EXACT_GIVES_UP = {900011, 900013, 900018, 900019, 900020, 900023}


def test_a_plan_marked_proven_is_never_beaten_on_generated_instances():
    """Neither HRL (zero-shot) nor random search beats exact where exact claims the optimum; the
    variants that broke it before (no DP overlap, replicate) are among the instances."""
    from hrlplan.search.hrl.generate import HELD_OUT_SEEDS, random_instance

    checked = 0
    for seed in list(HELD_OUT_SEEDS)[:24]:
        if seed in EXACT_GIVES_UP:
            continue
        inst = random_instance(seed, max_gpus=16)
        # V-shaped schedules' weaker bounds keep exact enumerating for minutes on these 60-layer models
        # (it then stops at planner.max_search_s, unproven): left out by schedule, not by a clock
        if schedules.get(str(inst.train["schedule"]), int(inst.train.get("stages_per_rank", 1))).v_shape:
            continue
        extra = [dict(dp_overlap=True), dict(dp_overlap=False), {}][seed % 3]
        train = dict(inst.train, dp_mode="replicate") if seed % 3 == 2 else inst.train
        try:
            # proven_optimal is the single-template claim (the replica search proves its own sub-space:
            # tests/test_hetero_planner.py), so exact searches that space alone here
            exact, _ = make_plan(inst.meta, inst.cluster,
                                 dict(asdict(ExactPlannerConfig()), heterogeneous=False, **extra), train)
        except UserError:
            continue
        if not exact.meta["planner"]["proven_optimal"]:
            continue
        checked += 1
        best = exact.meta["predicted"]["step_time_s"]
        for cfg in (dict(asdict(HRLPlannerConfig()), train_steps=0, samples=24, greedy_configs=4,
                         refine_evaluations=24, progress=False),
                    dict(asdict(RandomPlannerConfig()), samples=48, seed=seed)):
            try:   # in the space the claim is about: a replica plan may beat it (tests/test_hetero_planner.py)
                other, _ = make_plan(inst.meta, inst.cluster, dict(cfg, heterogeneous=False, **extra), train)
            except UserError:
                continue
            assert other.meta["predicted"]["step_time_s"] >= best * (1 - 1e-9), (seed, inst.label, cfg["name"])
    assert checked >= 10


# ---------------------------------------------------------------- plans that do not fit
def _manual(tmp_path, plan, meta, cluster, **cfg):
    path = tmp_path / "plan.yaml"
    plan.save(path)
    return make_plan(meta, cluster, dict(asdict(ManualPlannerConfig()), plan_file=str(path), **cfg), TRAIN)


def _tight_cluster(memory_gb):
    cluster = cpu_probe(2)
    for d in cluster.devices:
        d.memory_bytes = int(memory_gb * 2**30)
    return cluster


def test_manual_plan_over_memory_is_refused_unless_allowed(tmp_path):
    meta = toy_meta(n_layer=6)
    plan = homogeneous_plan("toy", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=1, num_microbatches=8,
                            schedule="1f1b")
    with pytest.raises(UserError, match=r"does not fit: out of memory on device \d .*allow_over_memory=true"):
        _manual(tmp_path, plan, meta, _tight_cluster(0.001))
    allowed, info = _manual(tmp_path, plan, meta, _tight_cluster(0.001), allow_over_memory=True)
    assert allowed.meta["predicted"]["step_time_s"] > 0            # a time-only prediction
    assert "out of memory" in info["planner"]["simulator"]


def test_manual_plan_for_another_depth_is_refused(tmp_path):
    plan = homogeneous_plan("toy", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=1, num_microbatches=8,
                            schedule="1f1b")
    with pytest.raises(UserError, match="n_layer is 6 but the model .* has 8 blocks"):
        _manual(tmp_path, plan, toy_meta(n_layer=8), cpu_probe(2))


@pytest.mark.parametrize("name", ["exact", "random"])
def test_when_nothing_fits_the_planner_says_how_far_off(name):
    cfg = {"exact": asdict(ExactPlannerConfig()), "random": dict(asdict(RandomPlannerConfig()), samples=16)}[name]
    with pytest.raises(UserError, match=r"no plan fits .*smallest need [\d.]+ GiB on device \d \(cpu\), capacity"):
        make_plan(toy_meta(n_layer=6), _tight_cluster(0.0001), cfg, TRAIN)


def test_exact_past_its_time_budget_keeps_its_best_and_says_it_is_not_proven():
    meta = toy_meta(n_layer=6)
    cfg = dict(asdict(ExactPlannerConfig()), heterogeneous=False, max_search_s=1e-9)
    plan, _ = make_plan(meta, two_type_preset(), cfg, TRAIN)
    planner = plan.meta["planner"]
    assert not planner["proven_optimal"] and "max_search_s" in planner["note"]
