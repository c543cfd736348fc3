"""The README's main command on this machine: plans from measurements (cached), may leave a
worker idle, and mode=plan stops after plan.yaml."""
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.compose import compose
from hrlplan.config import typed
from hrlplan.families import family_of_meta
from hrlplan.launch import plan_cache
from hrlplan.launch.planning import planner_settings, reuse_calibration
from hrlplan.model_meta import introspect
from hrlplan.plan import Plan, homogeneous_plan, launch_meta
from hrlplan.search import make_plan
from hrlplan.search.plan_text import plan_summary
from tests._runs import pretrain

# A steady calibration of gpt2-tiny on this kind of host's two CPU workers (measurements left out):
# under it the README's command plans two stages, with a one-stage plan close behind.
CALIBRATION = json.loads((Path(__file__).parent / "local_pick_calibration.json").read_text())


@pytest.mark.slow
def test_mode_plan_probes_calibrates_and_stops(tmp_path):
    # the tests' shared calibration cache: another job may have measured this host already
    first = pretrain(tmp_path / "a", "mode=plan", "logger.mode=disabled")
    plan = Plan.load(tmp_path / "a" / "plan.yaml")
    assert plan.world_size == 2 and ("calibrat" in first.stdout + first.stderr)
    assert json.loads((tmp_path / "a" / "cluster.json").read_text())["calibration"]
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "a" / "metrics.jsonl").exists()
    second = pretrain(tmp_path / "b", "mode=plan", "logger.mode=disabled")
    out = second.stdout + second.stderr
    assert "cached calibration" in out and "and the links probed with it" in out and "calibrating:" not in out
    # the same machine, the same plan: the second run plans from the calibration's own probe, not its own
    # (test_a_reused_calibration_plans_with_the_links_it_was_fitted_against has the flip this prevented)
    clusters = [json.loads((tmp_path / run / "cluster.json").read_text()) for run in "ab"]
    assert clusters[1]["bandwidth"] == clusters[0]["bandwidth"] and clusters[1]["latency"] == clusters[0]["latency"]
    again = Plan.load(tmp_path / "b" / "plan.yaml")
    assert (again.layout(), plan_summary(again)) == (plan.layout(), plan_summary(plan))


@pytest.mark.slow
def test_a_plan_with_an_idle_worker_trains_and_both_exit_cleanly(tmp_path):
    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 6)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    plan.world_size, plan.unused_ranks, plan.meta["launch"] = 2, [1], launch_meta(2)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    proc = pretrain(tmp_path / "run", "planner=manual", f"planner.plan_file={path}", "logger.mode=disabled",
                    "train.steps=3", "train.checkpoint_interval=0")
    assert "trains on 1 of 2 workers" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/lm_loss" in r] == [1, 2, 3]
    assert yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["unused_ranks"] == [1]


def _probed(bandwidth: float, latency: float) -> ClusterSpec:
    """Two CPU workers of one node as the local probe reports them, with these link figures."""
    devices = [DeviceInfo(rank=r, node=0, local_rank=r, hostname="vm", kind="cpu", name="cpu", memory_bytes=12 << 30,
                          peak_flops=1e11, peak_dtype="fp32") for r in range(2)]
    return ClusterSpec(name="local", devices=devices, backend="gloo", source="probe",
                       bandwidth=[[0.0, bandwidth], [bandwidth, 0.0]], latency=[[0.0, latency], [latency, 0.0]],
                       intra_node_bw=[bandwidth])


def _plan(config, spec):
    meta = introspect(config.arch, seq_len=config.data.seq_len)
    plan, _ = make_plan(meta, spec, planner_settings(config, family_of_meta(meta)), config.train)
    return plan.layout(), plan_summary(plan)


def test_a_reused_calibration_plans_with_the_links_it_was_fitted_against(tmp_path, monkeypatch):
    # the CI failure, without processes: the second run reused the calibration but planned with its own
    # probe, timed on a busy host; the calibration's bandwidth_efficiency is a fraction of the FIRST
    # probe's bandwidth, so that product was noise, and a ping-pong 100x slow flipped the layout
    monkeypatch.setenv(plan_cache.CALIBRATION_CACHE_ENV, str(tmp_path))
    config = typed(compose(["mode=plan"]))
    first = _probed(3.7e9, 5e-4)
    key = plan_cache.calibration_key(config, first)
    plan_cache.store_calibration(config, key, CALIBRATION, links=plan_cache.probe_links(first))
    chosen = _plan(config, dataclasses.replace(first, calibration=CALIBRATION))
    busy = [_probed(3.7e9 * f, 5e-4 / f) for f in (1e-3, 1e-2, 1e2)]
    assert any(_plan(config, dataclasses.replace(s, calibration=CALIBRATION)) != chosen for s in busy), \
        "no noisy probe changes the plan: this test no longer shows what it guards against"
    for spec in busy:
        line = reuse_calibration(config, key, spec, plan_cache.load_calibration(config, key))
        assert "and the links probed with it" in line and "not used" in line, line
        assert (spec.bandwidth, spec.latency, spec.calibration) == (first.bandwidth, first.latency, CALIBRATION)
        assert _plan(config, spec) == chosen


def test_a_calibration_stored_without_links_plans_with_the_probe(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.CALIBRATION_CACHE_ENV, str(tmp_path))
    config = typed(compose(["mode=plan"]))
    spec = _probed(2e9, 1e-4)
    key = plan_cache.calibration_key(config, spec)
    plan_cache.store_calibration(config, key, CALIBRATION)   # an entry written before links were kept
    assert plan_cache.load_calibration_links(config, key) is None
    assert "with this run's probed links" in reuse_calibration(config, key, spec, CALIBRATION)
    assert spec.bandwidth[0][1] == 2e9
    # links measured between other hosts (another allocation of the nodes), or that do not describe this
    # cluster's ranks (a hand-edited entry), are not taken either
    other = plan_cache.probe_links(_probed(1e9, 1e-4))
    assert not plan_cache.adopt_links(spec, other | {"hosts": ["node7", "node7"]})
    assert not plan_cache.adopt_links(spec, other | {"bandwidth": [[0.0]]})
    assert spec.bandwidth[0][1] == 2e9
    assert plan_cache.adopt_links(spec, other) and spec.bandwidth[0][1] == 1e9
