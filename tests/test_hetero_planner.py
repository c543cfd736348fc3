"""The heterogeneous-replica planner (hrlplan.search.hetero, hetero_exact): its sub-space proof
against brute force, the plans it emits, and make_plan's planner.heterogeneous switch."""
import itertools
from dataclasses import asdict

import pytest

from hrlplan.config import TrainConfig, section
from hrlplan.cluster import spec_from_preset
from hrlplan.cost.plans import predict_any_plan
from hrlplan.cost.replica_sync import REPLICATED
from hrlplan.cost.simulator import Simulator
from hrlplan.errors import UserError
from hrlplan.plan import Plan, validate
from hrlplan.search import make_plan
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.cost.model import Layout
from hrlplan.search.common import Scored
from hrlplan.search.hetero import BOTH_OPTIMIZERS, HeteroSpace, Replica, Shape, hetero_plan, place, wants_hetero
from hrlplan.search.hetero_anchor import AnchorTemplates, anchor_rows, idle_nodes
from hrlplan.search.hetero_exact import TemplateTable, TP_ANY, enumerate_options, row_grid
from hrlplan.search.hetero_search import search_hetero
from hrlplan.search.hetero_single import exact_proved, single_template_search, single_time_cap
from hrlplan.search.exact import search_exact
from hrlplan.search.space import SearchSpace
from tests.test_cost import toy_meta

TRAIN = dict(global_batch_size=8, schedule="1f1b", stages_per_rank=1, microbatches="auto", dtype="float32",
             dp_mode="fsdp")


def preset(groups, inter=10):
    return spec_from_preset(dict(name="mix", node_groups=groups, inter_node_GBps=inter, intra_node_latency_us=2,
                                 inter_node_latency_us=5))


def fast_slow(fast_nodes=1, slow_nodes=1, per_node=2, fast_memory=8, fast_per_node=None):
    return preset([dict(count=fast_nodes, device="fast", devices_per_node=fast_per_node or per_node,
                        memory_gb=fast_memory, tflops=4, intra_node_GBps=100),
                   dict(count=slow_nodes, device="slow", devices_per_node=per_node, memory_gb=8, tflops=1,
                        intra_node_GBps=50)])


def brute_force(meta, cluster, cfg, train, steps):
    """Every selection of the sub-space: per type none or (shape, count, rows on the grid) with the
    exact template for (type, shape, rows); rows summing to B; each plan at the faster of its two
    optimizers, as the search assesses plans. Returns (best step, [(the program's bound, step)])."""
    train = section(TrainConfig, train)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = HeteroSpace(cluster, max(cluster.node_sizes()))
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind({space.nproc: space})
    grid = row_grid(train.global_batch_size, steps)
    per_type = []
    for t in space.types:
        choices = [None]
        for shape in space.replica_shapes(t):
            for k in space.shape_counts(t, shape):
                for rows in grid:
                    key = (space.nproc, t, shape, rows, TP_ANY)
                    if k * rows <= train.global_batch_size and table.exact(key)[1] is not None:
                        choices.append((t, shape, k, rows, key))
        per_type.append(choices)
    best, pairs = float("inf"), []
    for combo in itertools.product(*per_type):
        chosen = [c for c in combo if c is not None]
        if not chosen or sum(k * rows for _, _, k, rows, _ in chosen) != train.global_batch_size:
            continue
        replicas = [Replica(t, place(table.exact(key)[1], space.shape_devices(t, shape, i)))
                    for t, shape, k, rows, key in chosen for i in range(k)]
        _, predicted = hetero_plan(meta, cluster, replicas, train.schedule, {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
        if predicted["feasible"]:
            best = min(best, predicted["step_time_s"])
            pairs.append((max(table.lower_bound_s(key) for *_, key in chosen), predicted["step_time_s"]))
    # the program's coefficients before refinement are lower bounds on the exact templates' times
    for key, (exact_s, _) in table.table.items():
        assert table.bound(key) <= exact_s * (1 + 1e-9)
    return best, pairs


@pytest.mark.parametrize("cluster_fn,gbs", [(lambda: fast_slow(), 8), (lambda: fast_slow(1, 2), 12)])
def test_sub_space_optimum_matches_brute_force(cluster_fn, gbs):
    meta = toy_meta(n_layer=6)
    meta.model_type = "llama"   # no one-tp rule: the plain sub-space
    cluster, train = cluster_fn(), dict(TRAIN, global_batch_size=gbs)
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2, 4], hetero_share_steps=4)
    sim = Simulator(meta, cluster, cost_options(cfg, section(TrainConfig, train)))
    out = search_hetero(sim, meta, cluster, cfg, section(TrainConfig, train), float("inf"))
    best, pairs = brute_force(meta, cluster, cfg, train, steps=4)
    assert out["proven"] and "optimal under the simulator over the sub-space" in out["note"]
    assert out["predicted"]["step_time_s"] == pytest.approx(best, rel=1e-9)
    # the program's bound: a plan's step is never below its slowest replica's own step time less
    # what the sharded optimizer can save on it
    assert all(step >= slowest * (1 - 1e-9) for slowest, step in pairs)


def _fast_slow_search():
    """search_hetero on one fast and one slow node, 6 layers, a batch of 8: (its result, simulator, meta,
    cluster)."""
    meta = toy_meta(n_layer=6)
    cluster = fast_slow(1, 1)
    train = section(TrainConfig, dict(TRAIN, global_batch_size=8))
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    return search_hetero(sim, meta, cluster, cfg, train, float("inf")), sim, meta, cluster


def test_emitted_plan_validates_round_trips_and_predicts_the_same():
    out, sim, meta, cluster = _fast_slow_search()
    plan = out["plan"]
    validate(plan)
    again = Plan.from_yaml(plan.to_yaml())
    assert again.layout() == plan.layout() and again.heterogeneous
    assert sum(p.batch_size for p in again.pipelines) == 8
    # at the cost options the search priced it with (a fresh simulator: nothing cached)
    again_s = predict_any_plan(again, meta, cluster, opts=sim.opts)["step_time_s"]
    assert again_s == pytest.approx(out["predicted"]["step_time_s"])
    # GPT-2 replicas hold every block at one tp degree (the runtime refuses anything else)
    assert len({s.tp for p in plan.pipelines for s in p.stages}) == 1


def test_make_plan_is_never_worse_than_the_single_template_and_says_what_it_proved():
    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1)
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4)
    single, _ = make_plan(meta, cluster, dict(cfg, heterogeneous="false"), TRAIN)
    plan, info = make_plan(meta, cluster, dict(cfg, heterogeneous="true"), TRAIN)
    assert plan.meta["predicted"]["step_time_s"] <= single.meta["predicted"]["step_time_s"] * (1 + 1e-12)
    hetero = info["planner"]["heterogeneous"]
    assert hetero["ran"] and "sub-space" in hetero["note"] and hetero["sub_space"]
    assert "heterogeneous" not in single.meta["planner"]


def test_replicas_use_nodes_a_single_template_cannot():
    """Uneven node sizes (HSPMD's 8,8,8,8,7): one template launches 7 per node or leaves the short
    node out; replicas per type may take whole nodes at another nproc-per-node."""
    meta = toy_meta(n_layer=6)
    cluster = preset([dict(count=1, device="fast", devices_per_node=3, memory_gb=8, tflops=4, intra_node_GBps=100),
                      dict(count=1, device="slow", devices_per_node=2, memory_gb=8, tflops=1, intra_node_GBps=50)])
    assert wants_hetero({}, cluster)
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=6)
    plan, info = make_plan(meta, cluster, dict(cfg, heterogeneous="true"), dict(TRAIN, global_batch_size=12))
    validate(plan)
    launch = plan.meta["launch"]
    assert {len(v.split(",")) for v in launch["per_node_visible_devices"]} == {launch["nproc_per_node"]}
    assert info["planner"]["heterogeneous"]["nproc_per_node"] == [2, 3]
    # one template runs 2 per node (4 devices); three replicas on the 3-device node are faster
    assert plan.heterogeneous and launch["nproc_per_node"] == 3 and plan.world_size == 3
    assert info["chosen"]["step_time_s"] < info["runner_up"]["step_time_s"]
    assert "best single template" in info["why"]["text"]
    assert plan.meta["planner"]["heterogeneous"]["chosen"] == "heterogeneous replicas"


def test_heterogeneous_switch_and_its_refusals():
    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1)
    cfg = asdict(ExactPlannerConfig())
    assert wants_hetero({}, cluster) and not wants_hetero({"heterogeneous": "false"}, cluster)
    assert not wants_hetero({}, fast_slow(1, 0) if False else preset([dict(count=2, device="g", devices_per_node=2,
                                                                           memory_gb=8, tflops=1)]))
    with pytest.raises(UserError, match="planner.heterogeneous"):
        make_plan(meta, cluster, dict(cfg, heterogeneous="maybe"), TRAIN)
    with pytest.raises(UserError, match="schedule"):
        make_plan(meta, cluster, dict(cfg, heterogeneous="true"), dict(TRAIN, schedule="zero_bubble"))
    # auto with a schedule the executor lacks: the single template, and plan_info says why
    plan, info = make_plan(meta, cluster, cfg, dict(TRAIN, schedule="zero_bubble"))
    assert not plan.heterogeneous and not info["planner"]["heterogeneous"]["ran"]


def test_row_grid():
    assert row_grid(128, 16) == list(range(8, 129, 8))
    assert row_grid(12, 16) == list(range(1, 13))
    assert row_grid(7, 4) == list(range(1, 8))


def test_baselines_sample_the_same_space_at_the_given_simulator_calls():
    from hrlplan.search.hetero_baselines import Sampler, annealing, random_search, successive_halving

    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1)
    train = section(TrainConfig, dict(TRAIN, global_batch_size=8))
    cfg = asdict(ExactPlannerConfig())
    for search in (random_search, annealing, successive_halving):
        sim = Simulator(meta, cluster, cost_options(cfg, train))
        best, plan = search(Sampler(sim, meta, cluster, cfg, train, seed=1), 60)
        assert 60 <= sim.evaluations < 60 + 8   # one plan's replicas past the budget at most
        validate(plan)
        assert best == pytest.approx(predict_any_plan(plan, meta, cluster, opts=sim.opts)["step_time_s"])


def test_cross_replica_reduce_overlaps_the_last_backward():
    from hrlplan.cost.plans import cross_replica_finish
    # one bucket over ranks 0 (replica A) and 1 (replica B): each may start its reduce min(t, last
    # backward) before its end; the bucket waits for the later member
    got = cross_replica_finish({(0, 1): 2.0}, end={0: 10.0, 1: 7.0}, last_backward={0: 1.0, 1: 5.0})
    assert got == {0: pytest.approx(11.0), 1: pytest.approx(11.0)}   # S = max(10 - 1, 7 - 2) = 9
    # fully hidden where the window covers it; a rank outside every bucket ends with its pipeline
    got = cross_replica_finish({(0, 1): 2.0}, end={0: 10.0, 1: 10.0, 2: 4.0}, last_backward={0: 3.0, 1: 3.0, 2: 1.0})
    assert got == {0: 10.0, 1: 10.0, 2: 4.0}
    # a rank's buckets run in sequence, hidden together by its one window (rank 0 may start at 8,
    # its partners, 1 s of reduce each, at 9: both buckets from 9)
    got = cross_replica_finish({(0, 1): 1.0, (0, 2): 1.0}, end={0: 10.0, 1: 10.0, 2: 10.0},
                               last_backward={0: 2.0, 1: 5.0, 2: 5.0})
    assert got == {0: pytest.approx(11.0), 1: pytest.approx(10.0), 2: pytest.approx(11.0)}


def _fast_slow_templates():
    """gpt2-like toy of 6 blocks on one fast and one slow node, a batch of 8 on a share grid of 4:
    (meta, cluster, simulator, the 2-device space, its template table)."""
    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1)
    train = section(TrainConfig, dict(TRAIN, global_batch_size=8))
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = HeteroSpace(cluster, 2)
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind({2: space})
    return meta, cluster, sim, space, table


def test_overlapped_reduce_never_beats_a_replica_or_exceeds_the_serial_sum():
    # two one-device replicas of the fast node and one of the slow node's two devices: every unit
    # is held by three ranks, so there is a reduce to overlap
    meta, cluster, sim, space, table = _fast_slow_templates()
    fast, slow = table.exact((2, "fast", Shape(1, 1), 3, TP_ANY))[1], table.exact((2, "slow", Shape(2, 1), 2, 1))[1]
    replicas = [Replica("fast", place(fast, space.shape_devices("fast", Shape(1, 1), i))) for i in range(2)] + \
        [Replica("slow", place(slow, space.shape_devices("slow", Shape(2, 1), 0)))]
    _, predicted = hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=(REPLICATED,))
    out = {"replicas": replicas}
    b = predicted["breakdown"]
    assert b["cross_replica_reduce_s"] > 0
    assert 0.0 <= b["cross_replica_reduce_exposed_s"] <= b["cross_replica_reduce_s"] + 1e-12
    serial = (b["pipeline_end_s"] + b["cross_replica_reduce_s"] + b["step_collectives_s"] + b["optimizer_s"])
    assert predicted["step_time_s"] <= serial + sim.devices.overheads.step * sim.devices.time_scale + 1e-12
    for r in out["replicas"]:
        assert predicted["step_time_s"] >= sim.evaluate(r.layout).step_time_s * (1 - 1e-12)


def test_learned_replica_policy_plans_within_its_calls_and_its_rows_sum_to_the_batch():
    from hrlplan.search.hrl_replicas import ReplicaEnv, search_hrl_replicas

    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 2)
    train = section(TrainConfig, dict(TRAIN, global_batch_size=12))
    cfg = asdict(ExactPlannerConfig())
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    env = ReplicaEnv(sim, meta, cluster, cfg, train, share_steps=12)
    for chosen in ([("fast", 2, 1), ("slow", 2, 2)], [("fast", 1, 2), ("slow", 4, 1)]):
        rows = env.rows_for(chosen, {"fast": 4.0, "slow": 1.0})
        assert sum(r * k for r, (_, _, k) in zip(rows, chosen)) == 12 and min(rows) >= 1
    out = search_hrl_replicas(sim, meta, cluster, cfg, train, calls=40)
    assert 40 <= out["calls"] < 40 + 8
    validate(out["plan"])
    again_s = predict_any_plan(out["plan"], meta, cluster, opts=sim.opts)["step_time_s"]
    assert out["step_time_s"] == pytest.approx(again_s)


def test_sliced_shapes_place_replicas_side_by_side_on_their_nodes():
    """q devices on each of j nodes: the nproc/q replicas of a node group share its nodes, slice by
    slice, and the first one's devices are its pool's (what the template was searched on)."""
    cluster = fast_slow(1, 4, per_node=2)
    space = HeteroSpace(cluster, 2)
    shapes = space.replica_shapes("slow")
    assert Shape(1, 2) in shapes and Shape(2, 2) in shapes and Shape(1, 1) in shapes
    assert space.replica_sizes("slow") == [s.size for s in shapes if s.per_node == 2 or s.nodes == 1]
    assert space.shape_counts("slow", Shape(1, 2)) == [2, 4]
    nodes = space.type_nodes["slow"]
    per = [space.shape_devices("slow", Shape(1, 2), i) for i in range(4)]
    assert per[0] == (space.node_devices[nodes[0]][0], space.node_devices[nodes[1]][0])
    assert per[1] == (space.node_devices[nodes[0]][1], space.node_devices[nodes[1]][1])
    assert len({d for p in per for d in p}) == 8
    pool = space.shape_pool("slow", Shape(1, 2))
    assert pool.nodes == tuple(nodes[:2]) and pool.nproc == 1


def test_a_replica_that_cannot_hold_its_state_is_out_without_split_tables():
    meta = toy_meta(n_layer=6)
    cluster = fast_slow(1, 1, per_node=2)
    train = section(TrainConfig, TRAIN)
    cfg = dict(asdict(ExactPlannerConfig()))
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = HeteroSpace(cluster, 2)
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind({2: space})
    key = (2, "fast", Shape(1, 1), 4, TP_ANY)
    assert table.may_hold_state(key)
    meta.total_params = int(8 * 2 ** 30)   # 128 GiB of state against one 8 GB device
    assert not table.may_hold_state(key) and table.bound(key) == float("inf") and not table.bottlenecks


def test_no_replica_fits_is_proven_fast_and_says_what_did_not_fit():
    meta = toy_meta(n_layer=6)
    meta.total_params = int(8 * 2 ** 30)   # 128 GiB of state: no shape of 2 x 8 GB + 2 x 8 GB holds it
    meta.model_type = "llama"
    cluster = fast_slow(1, 1)
    train = section(TrainConfig, TRAIN)
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    out = search_hetero(sim, meta, cluster, cfg, train, float("inf"))
    assert out["plan"] is None and out["proven"] and out["options"] == 0
    assert "no replica of the sub-space fits: fast at nproc 2: its 2 devices hold" in out["note"]
    assert "the state needs 128 GiB" in out["note"]


def test_out_of_time_bounding_keeps_options_by_estimate_and_claims_no_proof():
    """A bounding deadline already past: every option is kept by its estimate (not dropped), plans are
    still assembled from exact templates, and the result says it is not proven."""
    meta = toy_meta(n_layer=6)
    meta.model_type = "llama"
    cluster, train = fast_slow(1, 1), section(TrainConfig, TRAIN)
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=0.0)
    space = HeteroSpace(cluster, 2)
    table.bind({2: space})
    options = enumerate_options(table, space, 8, 4, [TP_ANY])
    assert options and table.out_of_time and not table.bounds
    key = options[0].key
    assert options[0].time_s == table.estimate(key) > 0 and table.peaks
    out = search_hetero(sim, meta, cluster, dict(cfg, hetero_time_s=0.001), train, float("inf"))
    assert not out["proven"] and "not proven" in out["note"]


def _anchored_case():
    """A fast node of 2 and two slow nodes of 2, 6 layers, a batch of 12, and a single template on the
    fast node alone (dp 2): the slow nodes idle."""
    meta = toy_meta(n_layer=6)
    meta.model_type = "llama"   # no one-tp rule
    cluster = preset([dict(count=1, device="fast", devices_per_node=2, memory_gb=8, tflops=4, intra_node_GBps=100),
                      dict(count=2, device="slow", devices_per_node=2, memory_gb=8, tflops=2, intra_node_GBps=50)])
    train = section(TrainConfig, dict(TRAIN, global_batch_size=12))
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2], hetero_share_steps=6)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    fast = tuple(d.rank for d in cluster.devices if d.name == "fast")
    layout = Layout(spans=((0, 6),), groups=(fast,), tp=1, dp=2, microbatch_size=2, num_microbatches=3,
                    schedule="1f1b")
    return meta, cluster, train, cfg, sim, Scored(layout, sim.evaluate(layout))


def test_anchored_sub_space_matches_brute_force():
    """The single template's replicas plus replicas on the nodes it leaves idle: search_hetero's result
    is the best of the by-type sub-space and this one, each checked by enumerating every selection."""
    meta, cluster, train, cfg, sim, single = _anchored_case()
    out = search_hetero(sim, meta, cluster, cfg, train, float("inf"), single=single)
    assert out["proven"] and out["anchored"]["ran"] and out["anchored"]["idle_nodes"] == 2
    assert "single-template optimum's template" in out["sub_space"]
    by_type, _ = brute_force(meta, cluster, cfg, dict(TRAIN, global_batch_size=12), steps=6)
    # the anchored sub-space by enumeration
    anchors = AnchorTemplates(sim, single.layout)
    idle = HeteroSpace(cluster, 2, nodes=idle_nodes(cluster, single.layout, 2))
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind({2: HeteroSpace(cluster, 2)})
    grid = row_grid(12, 6)
    extra = [[None]]
    for t in idle.types:
        extra.append([None] + [(t, shape, k, rows) for shape in idle.replica_shapes(t)
                               for k in idle.shape_counts(t, shape) for rows in grid
                               if table.exact((2, t, shape, rows, TP_ANY))[1] is not None])
    anchored = float("inf")
    for rows in anchor_rows(12, grid[0], 2):
        found = anchors.best(rows, float("inf"))
        if found is None:
            continue
        _, b, rc, _ = found
        mine = [Replica("anchor", anchors.layout(g, rows, b, rc)) for g in anchors.slices]
        for combo in itertools.product(*extra[1:]):
            chosen = [c for c in combo if c is not None]
            if 2 * rows + sum(k * r for _, _, k, r in chosen) != 12:
                continue
            replicas = mine + [Replica(t, place(table.exact((2, t, shape, r, TP_ANY))[1],
                                                idle.shape_devices(t, shape, i)))
                               for t, shape, k, r in chosen for i in range(k)]
            _, predicted = hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
            if predicted["feasible"]:
                anchored = min(anchored, predicted["step_time_s"])
    assert anchored < float("inf")
    assert out["predicted"]["step_time_s"] == pytest.approx(min(by_type, anchored), rel=1e-9)
    # the anchored plan's replicas never share a device with each other
    devices = [d for r in out["replicas"] for d in r.devices]
    assert len(devices) == len(set(devices))


def test_anchored_plan_keeps_the_single_templates_stages_and_validates():
    meta, cluster, train, cfg, sim, single = _anchored_case()
    # only the anchored sub-space: the by-type one cannot beat an incumbent of 0
    from hrlplan.search.hetero_anchor import search_anchored
    from hrlplan.search.hetero_exact import ShareSearch
    spaces = {2: HeteroSpace(cluster, 2)}
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind(spaces)
    search = ShareSearch(sim, meta, cluster, "1f1b", 12, spaces, table, float("inf"), 100, "t", float("inf"))
    info = search_anchored(search, single, 6, [TP_ANY])
    assert info["info"]["ran"] and info["sub_space"] and search.best is not None
    plan, predicted, replicas = search.best
    validate(plan)
    fast = {d.rank for d in cluster.devices if d.name == "fast"}
    anchor = [r for r in replicas if r.device_type.startswith("single-template")]
    assert len(anchor) == 2 and {d for r in anchor for d in r.devices} == fast
    assert all(r.layout.spans == single.layout.spans for r in anchor)
    assert any(set(r.devices) - fast for r in replicas)   # the idle nodes train too
    assert sum(p.batch_size for p in plan.pipelines) == 12


def test_anchor_refused_where_no_node_is_idle_or_blocks_differ_in_tp():
    from hrlplan.search.hetero_anchor import search_anchored, why_no_anchor
    meta, cluster, train, cfg, sim, _ = _anchored_case()
    every = tuple(d.rank for d in cluster.devices)
    layout = Layout(spans=((0, 6),), groups=(every,), tp=1, dp=6, microbatch_size=2, num_microbatches=1,
                    schedule="1f1b")
    from hrlplan.search.hetero_exact import ShareSearch
    spaces = {2: HeteroSpace(cluster, 2)}
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind(spaces)
    search = ShareSearch(sim, meta, cluster, "1f1b", 12, spaces, table, float("inf"), 100, "t", float("inf"))
    out = search_anchored(search, Scored(layout, sim.evaluate(layout)), 4, [TP_ANY])
    assert not out["info"]["ran"] and "no whole node idle" in out["info"]["why"] and out["sub_space"] == ""
    mixed = Layout(spans=((0, 3), (3, 6)), groups=((0, 1), (2,)), tp=2, dp=1, microbatch_size=1,
                   num_microbatches=2, schedule="1f1b", stage_tp=(2, 1))
    assert "different tp" in why_no_anchor(meta, mixed, one_tp=True)
    assert why_no_anchor(meta, mixed, one_tp=False) == ""


def test_receive_buffers_cut_is_rigorous():
    """A pp > 1 replica whose rows' receive buffers exceed its devices' memory is out of the bound
    (no split tables), and the simulator agrees that such a split is over memory."""
    meta, cluster, train, cfg, sim, _ = _anchored_case()
    meta.seq_len, meta.hidden_size = 4096, 8192   # 128 MiB per row at fp32: 64 rows exceed 0.9 x 8 GB
    table = TemplateTable(sim, meta, cluster, cfg, train, deadline=float("inf"))
    table.bind({2: HeteroSpace(cluster, 2)})
    key = (2, "slow", Shape(2, 1), 64, TP_ANY)
    rs = table._space(key)
    configs = [c for c in rs.configs() if c.pp > 1]
    assert configs and not any(table.buffers_may_fit(key, c) for c in configs)
    for c in configs:
        assert not sim.evaluate(rs.layout(c, [(0, 3), (3, 6)])).feasible
    small = (2, "slow", Shape(2, 1), 2, TP_ANY)
    assert all(table.buffers_may_fit(small, c) for c in table._space(small).configs())


def test_anchor_rows_leave_the_other_replicas_whole_grid_units():
    # 16 slices on a grid of 4 rows (B = 64): the grid alone would give the anchor all 64 rows
    assert anchor_rows(64, 4, 16) == [1, 2, 3, 4]
    assert anchor_rows(2048, 128, 4) == list(range(32, 513, 32))
    thinned = anchor_rows(1024, 1, 2)
    assert len(thinned) <= 48 and 512 in thinned and all(0 < r <= 512 for r in thinned)


def test_single_template_candidate_is_bounded_by_work_so_a_reference_search_finds_it():
    """The planner's single-template candidate is hetero_single.single_template_search, bounded by
    simulator calls and never by planner.hetero_time_s: a reference search with the same settings
    (bench/hetero.py's) finds the same template -- so the planned plan is never slower than the
    reference by construction. With few calls the screen gives up and the refine pass searches its
    best configurations on (or the proof pass proves the optimum). The clock is only a safety: 3/4 of
    hetero_time_s."""
    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1)
    cfg = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4, hetero_single_simulations=4)
    assert single_time_cap(dict(cfg, hetero_time_s=40.0)) == 30.0
    assert single_time_cap(dict(cfg, hetero_time_s=400.0)) == cfg["max_search_s"]
    train = section(TrainConfig, TRAIN)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = SearchSpace(meta, cluster, cfg, train)
    space.sim = sim
    ref = single_template_search(sim, space, cfg)
    # the proof pass (hetero_single._proof_pass) may prove the screen's gap closed; else the refine pass decides
    assert ref["single_template_search"] in ("screen and refine", "screen and proof")
    if ref["single_template_search"] == "screen and refine":
        assert not ref["proven_optimal"] and "hetero_single_simulations=4" in ref["note"]
    screen_cfg = dict(cfg, max_simulations=1)   # the screen alone: the refine pass only improves on it
    screen = search_exact(Simulator(meta, cluster, cost_options(cfg, train)), space, screen_cfg)
    assert ref["tracker"].best.time <= screen["tracker"].best.time
    plan, info = make_plan(meta, cluster, dict(cfg, heterogeneous="true"), TRAIN)
    single = info["runner_up"] if plan.heterogeneous else info["chosen"]
    assert single["step_time_s"] == ref["tracker"].best.time
    assert plan.meta["predicted"]["step_time_s"] <= ref["tracker"].best.time


def test_a_spent_simulation_budget_is_no_proof():
    """exact skips a configuration's branch and bound once its DP splits spend max_simulations, without
    saying it gave up: neither the single template nor a replica template claims a proof then; a search
    cut by its deadline has no simulation count at all."""
    assert not exact_proved({"proven_optimal": True, "split_simulations": 4}, {"max_simulations": 4})
    assert exact_proved({"proven_optimal": True, "split_simulations": 3}, {"max_simulations": 4})
    assert not exact_proved({"proven_optimal": False, "out_of_time": True}, {"max_simulations": 4})


def test_both_replica_optimizers_keep_the_faster_and_say_which():
    """hetero_plan with BOTH_OPTIMIZERS predicts the plan with every replica stepping its whole model and
    with the step sharded across replicas (cost/replica_sync.py), keeps the faster and writes its mode
    into plan.meta (what the runtime runs)."""
    meta, cluster, sim, space, table = _fast_slow_templates()
    fast = table.exact((2, "fast", Shape(1, 1), 4, TP_ANY))[1]
    replicas = [Replica("fast", place(fast, space.shape_devices("fast", Shape(1, 1), i))) for i in range(2)]
    steps = {m: hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=(m,))[1]["step_time_s"]
             for m in BOTH_OPTIMIZERS}
    plan, predicted = hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
    assert predicted["step_time_s"] == min(steps.values())
    assert plan.meta["replica_optimizer"] == min(steps, key=steps.get)
    assert Plan.from_yaml(plan.to_yaml()).meta["replica_optimizer"] == plan.meta["replica_optimizer"]
