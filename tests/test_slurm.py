"""hrlplan on a real SLURM (launch/local_slurm/start.sh starts one on localhost; skipped with the
reason where it cannot start): a 2-task job trains a pp=2 plan through submitit; a plan for
another number of ranks fails before training; an interrupted job (job._interrupt()) requeues,
resumes and ends with the uninterrupted run's loss under the same W&B run id; a job killed
without warning resumes from its last periodic checkpoint; a 2-point Hydra multirun through
hydra-submitit-launcher writes both sweep directories and W&B runs; the offline W&B folder holds
the config, the plan artifact, the metrics and the timeline image; the plain sbatch example runs.
The kill and the interruption are two faults of one job (a job start is most of each test's time);
it holds at a step (tests/_hold.py) until the test's requeue or signal has landed: nothing depends
on how fast the job trains."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List

import pytest
import yaml

from _hold import StepHold
from hrlplan.compose import compose
from hrlplan.plan import homogeneous_plan
from hrlplan.runtime.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parent.parent
START = ROOT / "launch" / "local_slurm" / "start.sh"
STOP = ROOT / "launch" / "local_slurm" / "stop.sh"
# Jobs on the 2-CPU test node: at most 2 tasks of 1 CPU each, modest memory.
JOB = dict(tasks_per_node=2, cpus_per_task=1, mem_gb=2, timeout_min=60)


def start_local_slurm() -> tuple[str, bool]:
    """(SLURM_CONF, started_here); pytest.skip with the reason when SLURM cannot start here."""
    if os.environ.get("HRLPLAN_SKIP_SLURM"):
        pytest.skip("HRLPLAN_SKIP_SLURM is set")
    if os.geteuid() != 0:
        pytest.skip("SLURM tests start a local slurmctld/slurmd/munge, which needs root")
    try:
        proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("launch/local_slurm/start.sh did not finish in 10 min (apt or daemons hang)")
    if proc.returncode != 0:
        pytest.skip(f"local SLURM could not start: {proc.stderr.strip()[-800:]}")
    lines = proc.stdout.strip().splitlines()
    conf = lines[-1].split("=", 1)[1]
    # submitit warns on every poll that sacct (accounting) is off: expected on this cluster.
    logging.getLogger("submitit").setLevel(logging.ERROR)
    return conf, "started" in lines


def stop_local_slurm() -> None:
    subprocess.run(["bash", str(STOP)], capture_output=True, text=True, timeout=120)


def wait_results(job, timeout_s: float = 240) -> List[Any]:
    """job.results() with a deadline: a job that dies without a result file never shows done."""
    deadline = time.time() + timeout_s
    while not job.done():
        if time.time() > deadline:
            tails = []
            for task in range(job.num_tasks):
                try:
                    tails.append(f"--- task {task} stderr ---\n{job.task(task).stderr()[-3000:]}")
                except Exception as e:  # the log may not exist yet
                    tails.append(f"--- task {task}: no log ({e})")
            subprocess.run(["scancel", str(job.job_id)], capture_output=True)
            raise AssertionError(f"SLURM job {job.job_id} not done after {timeout_s:.0f} s\n" + "\n".join(tails))
        time.sleep(0.5)
    return job.results()


def submit_held(config: dict, folder: Path, hold: StepHold, monkeypatch):
    """submit() with the hold's variables in the job's environment (sbatch exports the submitter's,
    and a requeued job keeps them); {rank: pid} once both tasks wait at the hold's step."""
    with monkeypatch.context() as env:
        for key, value in hold.env.items():
            env.setenv(key, value)
        job = submit(config, folder)
    hold.wait_held(2, alive=lambda: not job.done(), timeout_s=240, why=lambda: f"job {job.job_id}")
    return job, hold.held_pids()


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def slurm():
    conf, started = start_local_slurm()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # sbatch/squeue/scontrol here and in the jobs (sbatch exports it)
    yield conf
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if started:  # leave a cluster someone else started alone
        stop_local_slurm()


STEPS = 16     # the killed-then-preempted job holds at step HOLD_AT until the test's signal has landed
HOLD_AT = 6
INTERVAL = HOLD_AT - 2                 # its periodic checkpoints: the kill lands 2 steps after one
RESUMED_HOLD = INTERVAL + HOLD_AT      # where the restarted job holds (its own HOLD_AT-th step) for the preemption


def pp2_config(root: Path, steps: int = STEPS, world: int = 2) -> dict:
    """A hand-written pp=2 plan (planner=manual), so every job trains exactly the same thing."""
    spans = [(0, 4), (4, 6)] if world == 2 else [(0, 2), (2, 3), (3, 4), (4, 6)]
    plan = homogeneous_plan("gpt2-tiny", 6, spans, dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    root.mkdir(parents=True, exist_ok=True)
    plan.save(root / "plan_in.yaml")
    return compose(["planner=manual", f"planner.plan_file={root / 'plan_in.yaml'}", f"train.steps={steps}",
                    "train.checkpoint_interval=50", "train.log_interval=1", "logger.mode=offline"])


def submit(config: dict, folder: Path):
    from hrlplan.launch.submitit_job import submit as slurm_submit

    return slurm_submit(config, folder, slurm_partition="debug", **JOB)


@pytest.fixture(scope="module")
def straight(slurm, tmp_path_factory):
    """The uninterrupted reference: 2 tasks, pp=2."""
    root = tmp_path_factory.mktemp("straight")
    job = submit(pp2_config(root), root / "job")
    results = wait_results(job)
    return root / "job" / "run", results


# ---------------------------------------------------------------- tests
def test_two_task_job_trains_a_pp2_plan(straight):
    run_dir, results = straight
    assert len(results) == 2 and results[1] is None  # one result per task; rank 0 carries the summary
    summary = results[0]
    assert summary["final_step"] == STEPS
    loss = summary["history"][-1]["train/lm_loss"]
    assert 0 < loss < summary["history"][0]["train/lm_loss"]
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert plan["pp"] == 2 and plan["world_size"] == 2
    cluster = json.loads((run_dir / "cluster.json").read_text())
    assert len(cluster["devices"]) == 2  # both tasks took part in the probe
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, STEPS + 1))


def test_plan_for_other_rank_count_fails_before_training(slurm, tmp_path):
    job = submit(pp2_config(tmp_path, world=4), tmp_path / "job")
    with pytest.raises(Exception) as err:
        wait_results(job, timeout_s=120)
    text = str(err.value)
    assert "needs 4 ranks" in text and "has 2" in text, text
    assert not (tmp_path / "job" / "run" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def killed_then_preempted(slurm, tmp_path_factory):
    """One job through both faults (a job start is most of each test's time): killed without warning
    at step HOLD_AT, then, back from its periodic checkpoint at INTERVAL, preempted while it holds at its
    own HOLD_AT-th step (RESUMED_HOLD); it ends at STEPS. Each fault lands while both tasks wait at the
    hold: nothing depends on how fast the job trains or restarts."""
    from _pytest.monkeypatch import MonkeyPatch

    root = tmp_path_factory.mktemp("faults")
    config = pp2_config(root)
    config["train"]["checkpoint_interval"] = INTERVAL
    hold = StepHold(root / "hold", HOLD_AT)
    with MonkeyPatch.context() as monkeypatch:
        job, pids = submit_held(config, root / "job", hold, monkeypatch)
    # The held tasks wrote their markers and wait for the release: clear the markers now, so the
    # restarted job's own (at RESUMED_HOLD) are the only ones the second wait can see.
    for marker in root.glob("hold.held.*"):
        marker.unlink()
    # `scontrol requeue` as a node failure would: SIGTERM (no checkpoint), SIGKILL 5 s later, restart.
    subprocess.run(["scontrol", "requeue", str(job.job_id)], check=True, capture_output=True, timeout=60)
    deadline = time.time() + 120
    while not all(gone(pid) for pid in pids.values()):
        assert time.time() < deadline, f"tasks {pids} still alive 120 s after scontrol requeue"
        time.sleep(0.2)
    # A stop marker the killed tasks may have left (the requeue's SIGTERM): the preemption's wait below
    # must see the restarted job's own.
    for marker in root.glob("hold.stopping.*"):
        marker.unlink()
    hold.wait_held(2, alive=lambda: not job.done(), timeout_s=240, why=lambda: f"job {job.job_id}")
    job._interrupt()  # what a preemption sends: SIGTERM, then USR2
    hold.wait_stopping(1, alive=lambda: not job.done(), why=lambda: f"job {job.job_id}")
    hold.release()    # the stop vote of step RESUMED_HOLD sees the signal
    results = wait_results(job, timeout_s=300)
    return job, root / "job" / "run", results


def test_interrupted_job_requeues_resumes_and_matches(straight, killed_then_preempted):
    _, results_ref = straight
    _, run_dir, results = killed_then_preempted
    summary = results[0]
    assert summary["final_step"] == STEPS
    # The requeued job resumed from the preemption's checkpoint (it did not start over).
    assert summary["history"][0]["step"] == RESUMED_HOLD + 1
    assert summary["history"][-1]["train/lm_loss"] == pytest.approx(
        results_ref[0]["history"][-1]["train/lm_loss"], abs=1e-6)
    log = (run_dir / "train.log").read_text()
    assert "for preemption/timeout" in log
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    # One W&B run id across the attempts (each attempt opens an offline folder for it).
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) >= 2 and all(f.name.endswith(run_id) for f in folders)


def test_multirun_two_points_through_hydra_submitit(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    env = dict(os.environ, WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(ROOT / "pretrain.py"), "-m", "hydra/launcher=submitit_slurm",
           f"hydra.sweep.dir={sweep}", "hydra.launcher.partition=debug", "hydra.launcher.tasks_per_node=1",
           "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_per_cpu=null", "hydra.launcher.mem_gb=2",
           "hydra.launcher.timeout_min=60", "train.steps=5",
           "train.schedule=gpipe,1f1b"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for num, schedule in [(0, "gpipe"), (1, "1f1b")]:
        run_dir = sweep / str(num)
        assert f"train.schedule={schedule}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
        assert yaml.safe_load((run_dir / "plan.yaml").read_text())["schedule"] == schedule
        assert len(read_metrics(run_dir)) == 5
        folders = list((run_dir / "wandb").glob("offline-run-*"))
        assert len(folders) == 1
        check_offline_wandb_folder(folders[0])
    # One W&B group for the sweep, one run per point.
    ids = {(sweep / str(n) / "wandb_run_id.txt").read_text() for n in (0, 1)}
    assert len(ids) == 2
    for n in (0, 1):
        blob = next((sweep / str(n) / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
        assert sweep.parent.name.encode() in blob  # the group names the sweep directory


def check_offline_wandb_folder(folder: Path) -> None:
    """The offline run folder holds the config, the plan artifact, the metrics and the timeline image."""
    files = folder / "files"
    config = yaml.safe_load((files / "hrlplan_config.yaml").read_text())
    assert config["arch"]["name"] == "gpt2-tiny"
    assert yaml.safe_load((files / "plan.yaml").read_text())["model"] == "gpt2-tiny"
    assert (files / "timeline.png").stat().st_size > 1000
    assert list((files / "media" / "images").rglob("*.png"))
    blob = next(folder.glob("run-*.wandb")).read_bytes()
    for key in [b"train/lm_loss", b"train/lr", b"train/tokens_per_s", b"train/step_time_s",
                b"train/predicted_step_time_s", b"parallel-plan", b"probe/devices", b"pipeline/timeline"]:
        assert key in blob, key


def test_reference_job_wandb_folder(straight):
    run_dir, _ = straight
    folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 1
    check_offline_wandb_folder(folders[0])


def test_job_killed_without_warning_resumes_from_periodic_checkpoint(killed_then_preempted):
    """The kill (killed_then_preempted) lands while the job holds at step HOLD_AT, a periodic checkpoint
    at INTERVAL behind it, until both tasks are gone."""
    job, run_dir, results = killed_then_preempted
    assert results[0]["final_step"] == STEPS
    records = read_metrics(run_dir)
    resumed = [int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", job.task(0).stdout() or "")]
    assert resumed, "the requeued job did not resume from a checkpoint"
    assert resumed[0] == INTERVAL   # the periodic checkpoint before the kill
    assert sorted({r["step"] for r in records}) == list(range(1, STEPS + 1))   # no step lost
    # The steps trained between that checkpoint and the kill were trained again, to the same loss.
    assert [r["step"] for r in records] == [*range(1, HOLD_AT + 1), *range(INTERVAL + 1, STEPS + 1)]
    first = {r["step"]: r["train/lm_loss"] for r in records[:HOLD_AT]}
    again = {r["step"]: r["train/lm_loss"] for r in records[HOLD_AT:]}
    for s in range(INTERVAL + 1, HOLD_AT + 1):
        assert again[s] == pytest.approx(first[s], abs=1e-6)


def test_plain_sbatch_example_runs_one_rank_per_task(slurm, tmp_path):
    """launch/sbatch/pretrain.sbatch (srun, no Hydra launcher), shrunk to this node by sbatch options."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, HRLPLAN_RUN_DIR=str(run_dir), HRLPLAN_DIR=str(ROOT), WANDB_SILENT="true")
    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
           "--mem=2G", "--time=10", "--partition=debug", f"--output={tmp_path}/%j.out",
           str(ROOT / "launch" / "sbatch" / "pretrain.sbatch"), "train.steps=4", "logger.mode=disabled"]
    job_id = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]
    deadline = time.time() + 180
    state = ""
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(1)
    log = (tmp_path / f"{job_id}.out").read_text() if (tmp_path / f"{job_id}.out").exists() else ""
    assert state == "COMPLETED", f"job {job_id} {state}:\n{log[-3000:]}"
    assert len(json.loads((run_dir / "cluster.json").read_text())["devices"]) == 2
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]
