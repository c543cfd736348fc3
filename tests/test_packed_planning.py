"""A data.packing=document|balanced run is planned with the packed block's memory (cost/memory.packed_meta)
and cached apart from a concat run's plan; the saved model_meta.json stays plain."""
import json

from hrlplan.cluster import spec_from_preset
from hrlplan.compose import compose
from hrlplan.config import as_config
from hrlplan.launch import planning, plan_cache
from hrlplan.launch.plan_cache import packs_documents
from hrlplan.launch.planning import introspect_and_plan


def _config(tmp_path, *extra):
    return as_config(compose(["arch=gpt2-tiny", "data=code", f"run_dir={tmp_path}", "train.global_batch_size=4"]
                             + list(extra)))


def _spec():
    return spec_from_preset(dict(name="two", node_groups=[dict(count=1, device="cpu", devices_per_node=2,
                                                                memory_gb=4, tflops=0.1, intra_node_GBps=10)],
                                 inter_node_GBps=10, intra_node_latency_us=2, inter_node_latency_us=5))


def test_packed_runs_plan_with_the_packed_memory_and_cache_apart(tmp_path, monkeypatch):
    seen = []
    real = planning.make_plan
    monkeypatch.setattr(planning, "make_plan", lambda meta, *a: seen.append(meta) or real(meta, *a))
    monkeypatch.setattr(planning, "packed_step_prediction", lambda *a: None)   # no corpus here
    concat, packed = _config(tmp_path), _config(tmp_path, "data.packing=balanced")
    assert not packs_documents(concat) and packs_documents(packed)
    assert plan_cache.cache_key(concat, _spec()) != plan_cache.cache_key(packed, _spec())
    assert plan_cache.cache_key(concat, _spec()) == plan_cache.cache_key(_config(tmp_path, "data.packing=concat"),
                                                                         _spec())
    introspect_and_plan(concat, _spec())
    introspect_and_plan(packed, _spec())
    plain, held = (m.block_activation_bytes_per_token for m in seen)
    assert all(b > a for a, b in zip(plain, held))
    saved = json.loads((tmp_path / "model_meta.json").read_text())
    assert saved["block_activation_bytes_per_token"] == plain


def _lengths(budget):
    import random

    rng = random.Random(0)
    return [rng.choice([3, 5, 9, 17, 40, budget // 2, budget]) for _ in range(300)]


def test_exact_re_ranks_its_fastest_candidates_by_the_packed_step():
    """planner_cfg["packed_lengths"] makes exact keep its fastest candidates and choose among them by the
    mean packed step (cost/lengths.rank_by_packed_step), recorded in the plan's planner info. Packed as
    `document` (arrival order): `balanced` dispatches within a time budget, which a busy host may cut."""
    from hrlplan.cost.lengths import LengthDistribution, rank_by_packed_step
    from hrlplan.cost.simulator import Simulator
    from hrlplan.model_meta import introspect
    from hrlplan.search import make_plan
    from hrlplan.search.common import cost_options
    from hrlplan.search.exact import search_exact
    from hrlplan.search.space import SearchSpace

    cfg = as_config(compose(["arch=gpt2-tiny", "data=code", "data.seq_len=64", "train.global_batch_size=4",
                             "planner.microbatch_sizes=[1]"]))
    meta = introspect(cfg.arch, seq_len=64)
    distribution = LengthDistribution(_lengths(64), 64)
    planner = dict(cfg.planner, packed_lengths=dict(distribution.to_dict(), packing="document"), packed_top_k=3)
    sim = Simulator(meta, _spec(), cost_options(planner, cfg.train))
    space = SearchSpace(meta, _spec(), planner, cfg.train)
    space.sim = sim
    out = search_exact(sim, space, planner)
    top = out["tracker"].top
    assert 1 < len(top) <= 3 and [s.time for s in top] == sorted(s.time for s in top)
    rerank = out["packed_rerank"]
    packed = [r["packed_step_s"] for r in rerank["ranked"]]
    assert packed == sorted(packed) and len(packed) == len(top)
    again = rank_by_packed_step(sim, [s.layout for s in top], distribution, "document", steps=12)
    assert out["tracker"].best.layout == top[again[0][1]].layout
    assert rerank["chosen_changed"] == (again[0][1] != 0)
    assert [(r["packed_step_s"], r["rank_by_fixed_step"]) for r in rerank["ranked"]] == again
    # through make_plan, the record lands in the planner's info; without the lengths nothing is kept
    _, info = make_plan(meta, _spec(), planner, cfg.train)
    assert info["planner"]["packed_rerank"]["ranked"] == rerank["ranked"]
    plain = search_exact(sim, space, dict(cfg.planner))
    assert "packed_rerank" not in plain and plain["tracker"].top == []


def test_a_packed_re_rank_that_changes_the_plan_says_so(monkeypatch):
    from hrlplan.cost.lengths import LengthDistribution
    from hrlplan.cost.simulator import Simulator
    from hrlplan.model_meta import introspect
    from hrlplan.search import exact
    from hrlplan.search.common import cost_options
    from hrlplan.search.space import SearchSpace

    cfg = as_config(compose(["arch=gpt2-tiny", "data=code", "data.seq_len=64", "train.global_batch_size=4",
                             "planner.microbatch_sizes=[1]"]))
    meta = introspect(cfg.arch, seq_len=64)
    planner = dict(cfg.planner, packed_lengths=dict(LengthDistribution(_lengths(64), 64).to_dict(), packing="balanced"))
    monkeypatch.setattr(exact, "rank_by_packed_step",   # the slowest fixed-length candidate packs fastest
                        lambda sim, layouts, *a, **k: [(1.0 + i, len(layouts) - 1 - i) for i in range(len(layouts))])
    sim = Simulator(meta, _spec(), cost_options(planner, cfg.train))
    space = SearchSpace(meta, _spec(), planner, cfg.train)
    space.sim = sim
    out = exact.search_exact(sim, space, planner)
    top = out["tracker"].top
    assert len(top) > 1 and out["packed_rerank"]["chosen_changed"]
    assert out["tracker"].best is top[-1] and out["tracker"].runner_up is top[0]
    assert "re-ranked by the packed step" in out["note"]


def test_a_packed_code_run_plans_with_the_corpus_lengths(tmp_path, monkeypatch):
    """The job hands exact the built corpus's lengths (planner packed_lengths) for a packed data=code
    run on a homogeneous cluster; a concat run plans without them."""
    from hrlplan.cost.lengths import LengthDistribution

    settings = []
    monkeypatch.setattr(planning, "make_plan", lambda meta, spec, cfg, train: settings.append(cfg) or
                        (_ for _ in ()).throw(SystemExit("stop after the settings")))
    monkeypatch.setattr(planning.LengthDistribution, "of_corpus",
                        classmethod(lambda cls, path, budget: LengthDistribution(_lengths(budget), budget)))
    for packing in ("balanced", "concat"):
        try:
            introspect_and_plan(_config(tmp_path, f"data.packing={packing}", "data.seq_len=64"), _spec())
        except SystemExit:
            pass
    balanced, concat = settings
    assert balanced["packed_lengths"]["packing"] == "balanced" and balanced["packed_lengths"]["budget"] == 64
    assert "packed_lengths" not in concat
