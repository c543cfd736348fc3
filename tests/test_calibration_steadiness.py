"""Calibration on a busy node: repeated timings and their spread, the steadiness verdict (an unsteady
calibration plans once and is never cached), the time budget with its progress lines, and a cache
that cannot be written said as such. No test here times anything: samples and clocks are injected."""
import json

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.errors import ConfigError
from hrlplan.launch import plan_cache, planning
from hrlplan.measure import relative_spread, sample_summary
from hrlplan.runtime.calibrate import record as steadiness
from hrlplan.runtime.calibrate.compute import predict_one_process_step
from hrlplan.runtime.calibrate.record import fit_calibration, fit_reference_step, predict_reference_step
from hrlplan.runtime.calibrate.worker import (DEFAULT_BUDGET_S, REFERENCE_ROUNDS, CalibrationOverBudget, Progress,
                                              budget_seconds, calibration_stages)
from tests.test_cost import toy_meta


@pytest.fixture(autouse=True)
def _default_threshold(monkeypatch):
    """These tests judge with the named constant, whatever the suite's environment sets."""
    monkeypatch.delenv("HRLPLAN_CALIBRATION_MAX_SPREAD", raising=False)


# ---------------------------------------------------------------- the spread of repeated timings
def test_relative_spread_is_how_far_the_median_sits_above_the_quickest_repeat():
    assert relative_spread([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0            # one stray slow repeat: the median holds
    assert relative_spread([1.0, 1.1, 1.2, 1.3, 1.5]) == pytest.approx(0.2)
    assert relative_spread([1.0, 1.0, 5.0, 5.0, 5.0]) == pytest.approx(4.0)   # most repeats in a burst: shows
    assert relative_spread([2.0]) == 0.0 and relative_spread([]) == 0.0
    s = sample_summary([3.0, 1.0, 2.0])
    assert s == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "spread": pytest.approx(1.0), "n": 3}


# ---------------------------------------------------------------- one worker on a busy node (the x0.01 case)
FLOPS_PEAK, EFF, HALF = 1e10, 0.3, 50.0


def _one_cpu_spec():
    devices = [DeviceInfo(rank=0, node=0, local_rank=0, hostname="h", kind="cpu", name="cpu", memory_bytes=2**33,
                          peak_flops=FLOPS_PEAK)]
    return ClusterSpec(name="one", devices=devices, source="probe", intra_node_bw=[1e9])


def _blocks(meta, slow=1.0, sizes=(128, 256, 512)):
    """One block's fwd/bwd as the cost model has it, `slow` times over (a burst of foreign load)."""
    flops = meta.block_flops_fwd_per_token[0]
    out = []
    for n in sizes:
        f = slow * flops * (n + HALF) / (FLOPS_PEAK * EFF)
        out.append({"tokens": n, "fwd_s": f, "bwd_s": 2 * f, "samples_s": [3 * f] * 5})
    return out


def _one_worker_calibration(first_blocks_slow=1.0, round_slowdowns=(1.0,) * REFERENCE_ROUNDS):
    """fit_calibration + the reference rounds for one worker, from injected samples: the first block
    timing `first_blocks_slow` x over, each reference round (step and blocks alone) its own slowdown."""
    from hrlplan.config import TrainConfig

    meta, spec = toy_meta(), _one_cpu_spec()
    train = TrainConfig(global_batch_size=2)
    quiet_opt = {"block": 1e-4, "deep": 4e-4, "deep_blocks": 4, "ends": 5e-5,
                 "deep_samples_s": [4e-4] * 5}
    gathered = [{"block": _blocks(meta, first_blocks_slow), "optimizer": quiet_opt,
                 "pipeline_ops": {"fwd": 1e-5, "bwd": 2e-5}}]
    cal = fit_calibration(spec, meta, gathered, None, 0)
    truth = dict(cal, compute_efficiency={"cpu": EFF}, half_saturation_tokens={"cpu": HALF}, step_overhead_s=0.0)
    ref = ClusterSpec.from_dict(spec.to_dict())
    ref.calibration = truth
    true_step = predict_one_process_step(meta, ref, train)
    rounds = [({"step_s": slow * true_step["step_time_s"], "optimizer_s": slow * true_step["optimizer_s"]},
               _blocks(meta, slow, sizes=(128, 256, 512))) for slow in round_slowdowns]
    measured, _, _ = fit_reference_step(cal, spec, meta, train, rounds, gathered, meta.seq_len)
    predicted = predict_reference_step(cal, spec, meta, train)
    verdict = steadiness.assess(steadiness.calibration_samples(gathered, rounds),
                                steadiness.prediction_check(predicted, measured))
    return cal, verdict, predicted, measured, true_step["step_time_s"]


def test_one_worker_costs_compute_from_its_blocks_timed_alone_across_rounds_not_one_busy_burst():
    """A one-worker calibration whose first block timing fell in a burst 76x over once predicted a
    43 ms step at 3.28 s: one worker has no contention, so its compute comes from the blocks timed
    alone in every reference round, and the burst cannot reach the plan."""
    cal, verdict, predicted, measured, truth = _one_worker_calibration(first_blocks_slow=76.0)
    assert cal["compute_efficiency"]["cpu"] == pytest.approx(EFF, rel=1e-6)
    assert predicted == pytest.approx(truth, rel=0.05) and measured == pytest.approx(truth)
    assert verdict["steady"], verdict["worst"]


def test_busy_rounds_that_move_the_median_make_the_calibration_unsteady():
    _, verdict, predicted, _, truth = _one_worker_calibration(round_slowdowns=(1.0, 76.0, 76.0, 76.0, 1.0))
    assert predicted > 50 * truth   # the median round was busy: the figures are poisoned ...
    assert not verdict["steady"]    # ... and the verdict says so
    assert verdict["worst_spread"] > steadiness.UNSTEADY_SPREAD
    assert "x the quickest" in steadiness.unsteady_reason(verdict)


def test_a_stray_busy_round_leaves_the_calibration_steady():
    _, verdict, predicted, _, truth = _one_worker_calibration(round_slowdowns=(1.0, 1.0, 76.0, 1.0, 1.0))
    assert verdict["steady"] and predicted == pytest.approx(truth, rel=0.05)


def test_figures_that_predict_the_reference_step_far_slower_than_it_ran_are_unsteady():
    """The record's prediction of the step it timed is the end-to-end check: 3.28 s for 43 ms."""
    quiet = {steadiness.REFERENCE_STEP: [0.043] * 5, steadiness.block_alone_name(128): [1e-3] * 5}
    verdict = steadiness.assess(quiet, steadiness.prediction_check(3.28, 0.043))
    assert not verdict["steady"] and verdict["worst"] == steadiness.PREDICTION_CHECK
    reason = steadiness.unsteady_reason(verdict)
    assert "3.28e+03 ms" in reason and "43 ms" in reason
    # a prediction below the measured step is what step_overhead_s fills: no spread
    assert steadiness.prediction_check(0.030, 0.043)["spread"] == 0.0
    assert steadiness.assess(quiet, steadiness.prediction_check(0.044, 0.043))["steady"]


def test_judged_timings_need_repeats_and_without_a_reference_step_the_blocks_are_judged():
    few = steadiness.assess({steadiness.REFERENCE_STEP: [0.04, 0.04]})
    assert not few["steady"] and "fewer than 3" in steadiness.unsteady_reason(few)
    assert not steadiness.assess({})["steady"]
    blocks = {"one block at 512 tokens, rank 0": [1.0, 1.0, 1.1], "two-stage pipeline (1f1b), rank 0": [1, 5, 5]}
    verdict = steadiness.assess(blocks)   # pipeline hops are recorded, not judged (time slices spread them)
    assert verdict["steady"] and set(verdict["benchmarks"]) == set(blocks)
    assert not steadiness.assess({"one block at 512 tokens, rank 0": [1.0, 3.0, 3.0]})["steady"]


def test_records_without_a_verdict_are_taken_as_they_are():
    assert steadiness.is_steady({"compute_efficiency": {"cpu": 0.4}}) and steadiness.is_steady(None)
    assert not steadiness.is_steady({"steadiness": {"steady": False}})


# ---------------------------------------------------------------- budget and progress
def test_progress_says_which_group_k_of_n_and_the_time_so_far_then_stops_at_the_budget():
    said, now = [], [2.0]
    progress = Progress(["blocks", "pairs", "reference"], budget_s=10, rank=0, say=said.append,
                        clock=lambda: now[0], started=0.0)
    progress.start("blocks")
    now[0] = 4.5
    progress.start("pairs")
    now[0] = 12.0
    with pytest.raises(CalibrationOverBudget) as over:
        progress.start("reference")
    assert said == ["[hrlplan] calibration 1/3: blocks (2.0 s so far)",
                    "[hrlplan] calibration 2/3: pairs (4.5 s so far)"]
    text = str(over.value)
    assert "planner.calibrate_budget_s=10" in text and "at reference (2 of 3 groups done)" in text


def test_every_rank_stops_together_on_rank_0s_verdict():
    quiet_rank = Progress(["a", "b"], budget_s=10, rank=1, say=pytest.fail, clock=lambda: 0.0,
                          agree=lambda over: True)   # rank 0 said: over
    with pytest.raises(CalibrationOverBudget):
        quiet_rank.start("a")
    late_rank = Progress(["a"], budget_s=10, rank=1, clock=lambda: 99.0, agree=lambda over: False)
    late_rank.start("a")   # only rank 0's clock counts: its verdict is everyone's


def test_calibration_budget_setting():
    assert budget_seconds({}) == DEFAULT_BUDGET_S and budget_seconds(None) == DEFAULT_BUDGET_S
    assert budget_seconds({"calibrate_budget_s": 42}) == 42.0
    for bad in (0, -1, "soon", float("inf"), True):
        with pytest.raises(ConfigError, match=r"planner\.calibrate_budget_s=.* positive number of seconds"):
            budget_seconds({"calibrate_budget_s": bad})


def test_stages_of_a_calibration():
    assert len(calibration_stages(1, True)) == 4 and len(calibration_stages(2, True)) == 5
    assert len(calibration_stages(2, False)) == 4
    assert all(s in calibration_stages(4, True) for s in calibration_stages(1, False))


# ---------------------------------------------------------------- what is cached, and what the run says
STEADY = {"compute_efficiency": {"cpu": 0.4}, "steadiness": {"steady": True, "threshold": 0.5}}
UNSTEADY = {"compute_efficiency": {"cpu": 0.01},
            "steadiness": steadiness.assess({steadiness.REFERENCE_STEP: [0.04, 3.0, 3.0, 3.0, 0.04]},
                                            threshold=steadiness.UNSTEADY_SPREAD)}


def test_a_steady_calibration_is_cached_and_said_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(plan_cache.CALIBRATION_CACHE_ENV, str(tmp_path / "cache"))
    planning._keep_calibration({}, "calibration-k", STEADY, 12.3, refresh=False)
    out = capsys.readouterr().out
    assert out.strip() == f"[hrlplan] calibrated in 12.3 s; cached in {tmp_path / 'cache' / 'calibration-k'}"
    assert json.loads((tmp_path / "cache" / "calibration-k" / "calibration.json").read_text()) == STEADY


def test_an_unsteady_calibration_plans_once_and_is_not_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(plan_cache.CALIBRATION_CACHE_ENV, str(tmp_path / "cache"))
    assert plan_cache.load_calibration({}, "calibration-k", wait_s=0) is None   # this job holds the key's lock
    planning._keep_calibration({}, "calibration-k", UNSTEADY, 20.0, refresh=False)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "unsteady" in lines[0] and "the next run measures again" in lines[0], lines
    assert "cached in" not in lines[0]
    assert not (tmp_path / "cache" / "calibration-k").exists()
    assert not plan_cache._held   # the lock is released: a job waiting for the entry measures itself
    facts = planning.calibration_facts(ClusterSpec(name="t", devices=[], calibration=UNSTEADY))
    assert facts["steady"] is False and facts["note"].startswith("planned from an unsteady measurement")


def test_an_unsteady_refresh_removes_the_entry_it_was_to_replace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(plan_cache.CALIBRATION_CACHE_ENV, str(tmp_path / "cache"))
    plan_cache.store_calibration({}, "calibration-k", STEADY)
    planning._keep_calibration({}, "calibration-k", UNSTEADY, 20.0, refresh=True)
    assert "entry refresh was to replace is removed" in capsys.readouterr().out
    assert plan_cache.load_calibration({}, "calibration-k", wait_s=0) is None   # the next run measures again
    plan_cache.release_calibration({}, "calibration-k")


def test_a_cache_that_cannot_be_written_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(plan_cache.CALIBRATION_CACHE_ENV, str(blocker / "cache"))   # under a file: never writable
    assert plan_cache.load_calibration({}, "calibration-k", wait_s=0) is None
    planning._keep_calibration({}, "calibration-k", STEADY, 9.0, refresh=False)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    assert "cached in" not in lines[0] and "could not cache it in" in lines[0]
    assert f"(not a directory: {blocker / 'cache'})" in lines[0] and "HRLPLAN_CALIBRATION_CACHE" in lines[0]


def test_plan_info_says_what_the_plan_was_costed_from():
    def facts(cal):
        return planning.calibration_facts(ClusterSpec(name="t", devices=[], calibration=cal))

    assert facts({}) is None
    assert facts(STEADY)["steady"] is True and "note" not in facts(STEADY)
    over = facts({"steadiness": {"steady": False, "over_budget": "calibration stopped after 301 s, over "
                                 "planner.calibrate_budget_s=300, at x (3 of 5 groups done)"}})
    assert over["steady"] is False and over["note"].endswith("planned from peak FLOP/s and probed links")
    assert facts({"compute_efficiency": 0.3})["steady"] is None


def test_the_threshold_can_be_loosened_for_an_always_noisy_node(monkeypatch):
    busy = {steadiness.REFERENCE_STEP: [1.0, 3.0, 3.0]}
    assert not steadiness.assess(busy)["steady"]
    monkeypatch.setenv(steadiness.SPREAD_ENV, "inf")
    assert steadiness.assess(busy)["steady"]
    monkeypatch.setenv(steadiness.SPREAD_ENV, "2.5")
    assert steadiness.unsteady_threshold() == 2.5
    for bad in ("-1", "noisy", "nan"):
        monkeypatch.setenv(steadiness.SPREAD_ENV, bad)
        with pytest.raises(ConfigError, match=r"\$HRLPLAN_CALIBRATION_MAX_SPREAD=.* must be a number >= 0"):
            planning.check_calibration_settings(type("C", (), {"planner": {}})())


def test_the_parent_can_say_what_its_workers_do_before_they_can(capsys):
    config = type("C", (), {"planner": {"name": "exact"}, "arch": {"family": "hf"}})()
    line = planning.announce_workers(config, 2)
    assert capsys.readouterr().out.strip() == line
    assert line.startswith("[hrlplan] starting 2 workers: they probe this machine, then calibrate")


# ---------------------------------------------------------------- the budget in a real job
def _calibrate_over_budget(log_dir):
    """A worker: calibrate with a budget no set-up fits in (a gloo broadcast alone takes longer)."""
    from hrlplan.compose import compose
    from hrlplan.config import typed
    from hrlplan.runtime.calibrate import calibrate_in_job
    from hrlplan.runtime.distributed import init_distributed, shutdown

    cfg = typed(compose(["data.seq_len=16", "arch.n_layer=2"]))
    init_distributed("cpu", cfg.train)
    try:
        devices = [DeviceInfo(rank=r, node=0, local_rank=r, hostname="h", kind="cpu", name="cpu",
                              memory_bytes=2**33, peak_flops=1e10) for r in range(2)]
        spec = ClusterSpec(name="t", devices=devices, source="probe", intra_node_bw=[1e9])
        try:
            calibrate_in_job(spec, cfg.arch, cfg.train, cfg.data, planner={"calibrate_budget_s": 1e-9})
        except CalibrationOverBudget as over:
            return {"over": str(over), "groups_done": over.done}
        return {"over": None}
    finally:
        shutdown()


@pytest.mark.slow
def test_a_calibration_past_its_budget_stops_on_every_rank_before_measuring(tmp_path):
    from hrlplan.launch.local import launch_workers

    results = launch_workers(_calibrate_over_budget, (str(tmp_path),), 2, log_dir=str(tmp_path / "logs"))
    assert set(results) == {0, 1}
    for rank, result in results.items():
        assert result["over"] and result["groups_done"] == 0, (rank, result)
        assert "over planner.calibrate_budget_s=1e-09" in result["over"]
