"""The replica searches assess plans with the optimizer sharded across replicas too (search/hetero_exact.py,
hetero_anchor.py): the plan each finds, the proof over its sub-space against brute force, and the
lower bound the integer program prunes by under either optimizer."""
from dataclasses import asdict

import pytest

from hrlplan.config import TrainConfig, section
from hrlplan.cost.replica_sync import REPLICATED, SHARDED
from hrlplan.cost.simulator import Simulator
from hrlplan.search import hetero_exact
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.search.hetero import BOTH_OPTIMIZERS, hetero_plan
from hrlplan.search.hetero_search import search_hetero
from tests.test_cost import toy_meta
from tests.test_hetero_planner import TRAIN, brute_force, fast_slow


def _optimizer_bound_case():
    """A 4-layer model whose optimizer step is a large part of a replica's step: two 1-device replicas
    win sharded, one 2-device replica replicated."""
    meta = toy_meta(n_layer=4, hidden=512, seq=32)
    meta.model_type = "llama"   # no one-tp rule: the plain sub-space
    cluster = fast_slow(1, 1)
    train = dict(TRAIN, global_batch_size=4)
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2, 4], hetero_share_steps=4)
    return meta, cluster, train, cfg


def _search(meta, cluster, train, cfg):
    typed = section(TrainConfig, train)
    sim = Simulator(meta, cluster, cost_options(cfg, typed))
    return search_hetero(sim, meta, cluster, cfg, typed, float("inf")), sim


def test_sharded_aware_search_finds_a_plan_a_replicated_assessment_misses(monkeypatch):
    meta, cluster, train, cfg = _optimizer_bound_case()
    found, _ = _search(meta, cluster, train, cfg)
    assert found["proven"] and found["plan"].meta["replica_optimizer"] == SHARDED
    assert "faster of the replicated and the sharded optimizer" in found["sub_space"]
    # round 5's search: plans assessed replicated, the bound unlowered; the chosen plan then re-predicted
    # both ways (make_plan) is still slower than the plan found sharded
    monkeypatch.setattr(hetero_exact, "BOTH_OPTIMIZERS", (REPLICATED,))
    monkeypatch.setattr(hetero_exact, "sharding_saves_at_most_s", lambda *a, **k: 0.0)
    replicated, sim = _search(meta, cluster, train, cfg)
    _, again = hetero_plan(meta, cluster, replicated["replicas"], "1f1b", {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
    assert found["predicted"]["step_time_s"] < again["step_time_s"] * (1 - 1e-3)


def test_proof_with_both_optimizers_matches_brute_force():
    """Every selection of the sub-space at the faster of its optimizers: the search's proven optimum is
    theirs, and no plan's step is under the program's lowered bound for it."""
    meta, cluster, train, cfg = _optimizer_bound_case()
    found, _ = _search(meta, cluster, train, cfg)
    best, pairs = brute_force(meta, cluster, cfg, train, steps=4)
    assert found["proven"] and found["predicted"]["step_time_s"] == pytest.approx(best, rel=1e-9)
    assert all(step >= bound * (1 - 1e-9) for bound, step in pairs)
    # the bound is lowered where sharding saves: strictly under some replicated-only bound
    assert any(step < bound_replicated for bound_replicated, step in _replicated_bounds(meta, cluster, cfg, train))


def _replicated_bounds(meta, cluster, cfg, train):
    """(the slowest replica's own step, the plan's step at the faster optimizer) per selection."""
    from hrlplan.search.hetero import HeteroSpace, Replica, place
    from hrlplan.search.hetero_exact import TP_ANY, TemplateTable
    typed = section(TrainConfig, train)
    sim = Simulator(meta, cluster, cost_options(cfg, typed))
    space = HeteroSpace(cluster, 2)
    table = TemplateTable(sim, meta, cluster, cfg, typed, deadline=float("inf"))
    table.bind({2: space})
    out = []
    for shape in space.replica_shapes("fast"):
        for k in space.shape_counts("fast", shape):
            if 4 % k:
                continue
            key = (2, "fast", shape, 4 // k, TP_ANY)
            own, layout = table.exact(key)
            if layout is None:
                continue
            replicas = [Replica("fast", place(layout, space.shape_devices("fast", shape, i))) for i in range(k)]
            _, predicted = hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
            if predicted["feasible"]:
                out.append((own, predicted["step_time_s"]))
    return out


def test_replica_space_follows_the_executors_sequence_parallelism(monkeypatch):
    """ReplicaSpace reads plan/checks.HETERO_SEQUENCE_PARALLEL: where the executor runs it, a tp > 1
    replica's layout has sequence parallelism, the receive-buffer cut counts 1/tp of a message, the
    emitted plan says so per stage, and the simulator prices the replica with it (its activations
    sharded: less memory than the same replica without)."""
    from hrlplan.cost.plans import predict_any_plan
    from hrlplan.search import hetero
    from hrlplan.search.hetero import HeteroSpace, Replica, Shape, place
    from hrlplan.search.hetero_exact import TP_ANY, TemplateTable
    meta, cluster, train, cfg = _optimizer_bound_case()
    typed = section(TrainConfig, dict(train, global_batch_size=8))
    sim = Simulator(meta, cluster, cost_options(cfg, typed))
    space = HeteroSpace(cluster, 2)
    key = (2, "fast", Shape(2, 1), 8, TP_ANY)
    predicted = {}
    for sp in (False, True):
        monkeypatch.setattr(hetero, "HETERO_SEQUENCE_PARALLEL", sp)
        table = TemplateTable(sim, meta, cluster, cfg, typed, deadline=float("inf"))
        table.bind({2: space})
        rs = table._space(key)
        c = next(c for c in rs.configs() if c.tp == 2 and c.pp == 1)
        assert rs.sequence_parallel(c) == sp
        layout = rs.layout(c, [(0, meta.n_layer)])
        assert layout.sequence_parallel == sp
        plan, predicted[sp] = hetero.hetero_plan(meta, cluster, [Replica("fast", place(layout, layout.groups[0]))],
                                                 "1f1b", {}, sim=sim, optimizers=(REPLICATED,))
        assert all(st.sequence_parallel == sp for p in plan.as_pipelines() for st in p.stages)
        assert predicted[sp]["feasible"]
        assert predict_any_plan(plan, meta, cluster, sim=sim)["step_time_s"] == predicted[sp]["step_time_s"]
    assert max(predicted[True]["memory_bytes_per_rank"]) < max(predicted[False]["memory_bytes_per_rank"])


def _tight_fast_case():
    """Two fast devices of 1.43 GB that cannot hold a replica's whole state (16 B/param) but can with the
    optimizer sharded over two replicas (14 B/param); two roomy slow devices."""
    meta = toy_meta(n_layer=6, hidden=512, seq=32)
    meta.model_type = "llama"
    cluster = fast_slow(1, 1, fast_memory=1.43)
    typed = section(TrainConfig, dict(TRAIN, global_batch_size=4))
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2, 4], hetero_share_steps=4)
    sim = Simulator(meta, cluster, cost_options(cfg, typed))
    return meta, cluster, typed, cfg, sim


def test_replicas_whose_whole_state_fits_nowhere_get_sharded_state_templates():
    from hrlplan.search.hetero import HeteroSpace, Replica, Shape, place
    from hrlplan.search.hetero_exact import TP_ANY, TemplateTable, enumerate_options
    meta, cluster, typed, cfg, sim = _tight_fast_case()
    space = HeteroSpace(cluster, 2)
    table = TemplateTable(sim, meta, cluster, cfg, typed, deadline=float("inf"))
    table.bind({2: space})
    whole = (2, "fast", Shape(1, 1), 2, TP_ANY)
    assert table.exact(whole)[1] is None
    sharded = [o for o in enumerate_options(table, space, 4, 4, [TP_ANY]) if o.device_type == "fast" and o.members]
    assert {(o.shape, o.count, o.members) for o in sharded if o.rows == 2} == {(Shape(1, 1), 2, 2)}
    # the option's bound (the relaxation) is below its template's step, and its template makes a plan
    # that fits with the sharded optimizer only
    option = next(o for o in sharded if o.rows == 2)
    step, layout = table.exact(option.key)
    assert layout is not None and option.time_s <= step
    replicas = [Replica("fast", place(layout, space.shape_devices("fast", Shape(1, 1), i))) for i in range(2)]
    plan, predicted = hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=BOTH_OPTIMIZERS)
    assert predicted["feasible"] and plan.meta["replica_optimizer"] == SHARDED
    _, replicated = hetero_plan(meta, cluster, replicas, "1f1b", {}, sim=sim, optimizers=(REPLICATED,))
    assert not replicated["feasible"]
    found = search_hetero(sim, meta, cluster, cfg, typed, float("inf"))
    assert found["plan"] is not None and found["predicted"]["step_time_s"] <= predicted["step_time_s"]


def test_memory_cuts_never_cut_a_replica_the_full_search_fits():
    """Brute force: for every key of the tight instance (shapes, rows, whole or sharded state), a key the
    cuts (may_hold_state, the bound's receive-buffer cut, split tables) call unfit has no feasible layout
    in search_exact's own uncut search with the same state."""
    from hrlplan.search.exact import search_exact
    from hrlplan.search.hetero import HeteroSpace
    from hrlplan.search.hetero_exact import TP_ANY, TemplateTable
    meta, cluster, typed, cfg, sim = _tight_fast_case()
    space = HeteroSpace(cluster, 2)
    table = TemplateTable(sim, meta, cluster, cfg, typed, deadline=float("inf"))
    table.bind({2: space})
    checked = 0
    for t in space.types:
        for shape in space.replica_shapes(t):
            for rows in (1, 2, 4):
                for members in (0, 2):
                    key = (2, t, shape, rows, TP_ANY) + ((members,) if members else ())
                    cut = not table.may_hold_state(key) or table.bound(key) == float("inf")
                    rs = table._space(key)
                    full = search_exact(rs.sim, rs, dict(cfg, max_simulations=10 ** 6))["tracker"].best
                    assert not (cut and full is not None), key
                    if full is not None:
                        assert table.bound(key) <= full.time * (1 + 1e-9), key
                    checked += cut
    assert checked > 0   # some keys are cut, and rightly
