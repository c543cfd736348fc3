"""The single-template search's proof pass (search/hetero_single.py): where the work-bounded screen
gives up, exact's whole search runs on while PROOF_TIME_SHARE of planner.hetero_time_s allows, and
its result counts only as a proof -- a pass cut short is dropped whole and the work-bounded refine
pass decides (the same at any load)."""
from dataclasses import asdict

import pytest

from hrlplan.config import TrainConfig, section
from hrlplan.cost.simulator import SimResult, Simulator
from hrlplan.search import hetero_single
from hrlplan.search.common import Scored, Tracker, cost_options
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.search.exact import search_exact
from hrlplan.search.hetero_single import PROOF_MULTIPLE, _ResultLog, exact_proved, single_template_search
from hrlplan.search.space import SearchSpace
from tests.test_cost import toy_meta
from tests.test_hetero_planner import TRAIN, fast_slow

# 4 simulator calls: the screen and the refine pass both give up on the toy mixed cluster
CFG = dict(asdict(ExactPlannerConfig()), hetero_share_steps=4, hetero_single_simulations=4)


def _search(cfg=CFG):
    meta, cluster = toy_meta(n_layer=6), fast_slow(1, 1)
    train = section(TrainConfig, TRAIN)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    space = SearchSpace(meta, cluster, cfg, train)
    space.sim = sim
    return sim, space


def test_the_proof_pass_proves_what_the_work_bound_could_not():
    sim, space = _search()
    out = single_template_search(sim, space, CFG)
    assert out["single_template_search"] == "screen and proof"
    assert out["proven_optimal"] and exact_proved(out, CFG)
    plain_sim, plain_space = _search()
    plain = search_exact(plain_sim, plain_space, CFG)
    assert plain["proven_optimal"]
    assert out["tracker"].best.time == plain["tracker"].best.time
    assert hetero_single.SINGLE_TEMPLATE[sim] is out["tracker"]


def test_without_time_for_it_the_candidate_is_the_work_bounded_one(monkeypatch):
    monkeypatch.setattr(hetero_single, "PROOF_TIME_SHARE", 0.0)
    sim, space = _search()
    out = single_template_search(sim, space, CFG)
    assert out["single_template_search"] == "screen and refine" and not out["proven_optimal"]
    assert "no proof pass" in out["note"]


def test_the_proof_pass_is_bounded_by_work_too():
    """The toy's whole search needs 19 calls: with 2 (PROOF_MULTIPLE x 2 = 16 for the proof pass) it
    gives up whatever the clock, and the refine pass decides."""
    cfg = dict(CFG, hetero_single_simulations=2)
    sim, space = _search(cfg)
    out = single_template_search(sim, space, cfg)
    assert out["single_template_search"] == "screen and refine" and not out["proven_optimal"]
    assert f"{PROOF_MULTIPLE * 2:,} simulator calls" in out["note"] and "gave up" in out["note"]


def test_a_proof_pass_cut_short_is_dropped_whole_even_where_it_found_faster(monkeypatch):
    """Only a proof is the same at any load: a cut pass's faster layout would make the planner's
    candidate differ from a reference search's at another load (bench/hetero.py)."""
    monkeypatch.setattr(hetero_single, "PROOF_TIME_SHARE", 0.0)
    sim, space = _search()
    bounded = single_template_search(sim, space, CFG)["tracker"].best
    monkeypatch.setattr(hetero_single, "PROOF_TIME_SHARE", 0.25)
    calls = []

    def cut_proof_pass(sim_, space_, cfg):
        out = search_exact(sim_, space_, cfg)
        calls.append(cfg)
        if cfg["max_simulations"] == PROOF_MULTIPLE * 4:   # the proof pass: as if it gave up after finding faster
            faster = Tracker()
            best = out["tracker"].best
            faster.offer(Scored(best.layout, SimResult(True, best.time / 2)))
            out = dict(out, tracker=faster, proven_optimal=False, note="gave up after max_search_s=0.1 s")
        return out

    monkeypatch.setattr(hetero_single, "search_exact", cut_proof_pass)
    sim, space = _search()
    out = single_template_search(sim, space, CFG)
    assert [c["max_simulations"] for c in calls] == [1, PROOF_MULTIPLE * 4, 3]   # screen, proof, refine
    assert not out["proven_optimal"] and out["single_template_search"] == "screen and refine"
    assert out["tracker"].best.time == bounded.time
    assert "proof pass" in out["note"] and "dropped" in out["note"]


def test_the_memo_simulates_a_layout_once_and_leaves_detailed_calls_alone():
    sim, space = _search()
    c = next(iter(space.configs()))
    layout = space.layout(c, [(0, 6)] if c.n_stages == 1 else
                          [(round(i * 6 / c.n_stages), round((i + 1) * 6 / c.n_stages)) for i in range(c.n_stages)])
    memo = {}
    first = _ResultLog(sim, memo).evaluate(layout)
    again = _ResultLog(sim, memo).evaluate(layout)
    assert again is first and sim.evaluations == 1
    detailed = _ResultLog(sim, memo).evaluate(layout, detail=True)
    assert sim.evaluations == 2 and detailed.step_time_s == pytest.approx(first.step_time_s)
