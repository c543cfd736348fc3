"""The README's main command on this machine: plans from measurements (cached), may leave a
worker idle, and mode=plan stops after plan.yaml."""
import json

import pytest
import yaml

from hrlplan.plan import Plan, homogeneous_plan, launch_meta
from tests._runs import pretrain


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
    assert "cached calibration" in out and "calibrating:" not in out
    assert Plan.load(tmp_path / "b" / "plan.yaml").layout() == plan.layout()


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
