"""W&B offline: what a run folder holds, the stable run id across attempts, and a logger that
outlives its W&B service (SLURM signals every process of a job step on preemption)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from hrlplan.runtime.metrics import MetricsLogger, read_metrics


def _logger(run_dir, **cfg):
    config = {"arch": {"name": "gpt2-tiny"}, "train": {"steps": 3}}
    return MetricsLogger(run_dir, config, {"mode": "offline", "project": "hrlplan-test", **cfg},
                         job_type="train", name="t")


def _wandb_services() -> list:
    """This process's W&B service children (wandb-core)."""
    me = str(os.getpid())
    kids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                cmd = open(f"/proc/{pid}/cmdline").read()
            except OSError:
                continue
            if fields[1] == me and "wandb" in cmd:
                kids.append(int(pid))
    return kids


def test_offline_folder_holds_config_plan_metrics_and_image(tmp_path):
    (tmp_path / "plan.yaml").write_text("model: gpt2-tiny\npp: 2\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    plt.plot([0, 1], [1, 0])
    fig.savefig(tmp_path / "timeline.png")
    log = _logger(tmp_path, group="sweep-x")
    log.constant_metrics["train/predicted_step_time_s"] = 0.01
    log.log_artifact(tmp_path / "plan.yaml", "parallel-plan", name="plan")
    log.save_file(tmp_path / "plan.yaml")
    for step in (1, 2):
        log.log({"train/lm_loss": 5.0 - step, "train/lr": 1e-3}, step=step)
    log.log_image("pipeline/timeline", str(tmp_path / "timeline.png"))
    log.summary({"final_loss": 3.0})
    log.finish()
    folder = next((tmp_path / "wandb").glob("offline-run-*"))
    files = folder / "files"
    assert yaml.safe_load((files / "hrlplan_config.yaml").read_text())["arch"]["name"] == "gpt2-tiny"
    assert (files / "plan.yaml").exists()
    assert list((files / "media" / "images").rglob("*.png"))
    blob = next(folder.glob("run-*.wandb")).read_bytes()
    for key in [b"train/lm_loss", b"train/predicted_step_time_s", b"parallel-plan", b"sweep-x", b"final_loss"]:
        assert key in blob, key
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path)[0]["train/predicted_step_time_s"] == 0.01


def test_same_run_id_across_attempts(tmp_path):
    for step in (1, 2):
        log = _logger(tmp_path)
        log.log({"train/lm_loss": 1.0}, step=step)
        log.finish()
        time.sleep(1.1)  # offline folders are named to the second
    run_id = (tmp_path / "wandb_run_id.txt").read_text().strip()
    folders = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(run_id) for f in folders)


def test_logger_outlives_a_killed_wandb_service(tmp_path):
    log = _logger(tmp_path)
    log.log({"train/lm_loss": 2.0}, step=1)
    service = _wandb_services()
    if not service:
        pytest.skip("this W&B version runs no service process")
    for pid in service:
        os.kill(pid, signal.SIGTERM)  # what SLURM does to every process of a preempted step
    time.sleep(1.1)
    log.log({"train/lm_loss": 1.0}, step=2)  # must not raise: a new service continues the run
    log.finish()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    run_id = (tmp_path / "wandb_run_id.txt").read_text().strip()
    folders = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(run_id) for f in folders)  # reconnected, same run
