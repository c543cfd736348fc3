"""A resume continues the same run: the run directory's recorded config is restored, a change of
what was trained is refused in one line, the run directory is one a run can be written to, and one
job at a time uses it (the lock). In-process tests of hrlplan/launch/resume_run.py and rundir.py,
then a few end-to-end runs through pretrain.py."""
import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from _runs import pretrain
from hrlplan.compose import compose
from hrlplan.errors import ConfigError, UserError
from hrlplan.launch.resume_run import (PER_INVOCATION, RECORD, RESUME_KEYS, SAFE, TRAINED, resumed_overrides,
                                       treatment, write_record)
from hrlplan.launch.rundir import LOCK_FILE, RunDirLock, check_output_dir, this_job


# ---------------------------------------------------------------- the table
@pytest.mark.parametrize("key, kind", [
    ("train.steps", TRAINED), ("train.lr", TRAINED), ("train.warmup_steps", TRAINED), ("train.seed", TRAINED),
    ("train.global_batch_size", TRAINED), ("train.microbatches", TRAINED), ("train.schedule", TRAINED),
    ("arch.n_layer", TRAINED), ("data.seq_len", TRAINED), ("planner.plan_file", TRAINED), ("planner.name", TRAINED),
    ("train.some_key_added_later", TRAINED),
    ("train.resume", PER_INVOCATION), ("train.stop_after", PER_INVOCATION),
    ("cluster.nproc_per_node", SAFE), ("logger.mode", SAFE), ("train.checkpoint_interval", SAFE),
    ("train.eval_interval", SAFE), ("planner.calibrate", SAFE), ("train.plan_timeout_min", SAFE),
    ("train.measure_memory", SAFE), ("train.profile", SAFE),
])
def test_one_table_says_how_each_key_is_treated(key, kind):
    assert treatment(key) == kind
    assert all(k in (PER_INVOCATION, SAFE, TRAINED) and why for _, k, why in RESUME_KEYS)


def test_docs_list_every_key_of_the_table():
    from _runs import ROOT

    docs = (ROOT / "docs" / "resume.md").read_text()
    assert all(f"`{pattern}`" in docs for pattern, _, _ in RESUME_KEYS)


# ---------------------------------------------------------------- restoring a recorded run
def _recorded_run(tmp_path, overrides, step=4):
    run = tmp_path / "run"
    run.mkdir()
    write_record(run, overrides, compose(overrides))
    if step is not None:
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    return run


def _resume(run, *cmdline):
    said = []
    merged = resumed_overrides(list(cmdline), [f"hydra.run.dir={run}"], compose, said.append)
    return merged, said


def test_resume_restores_the_recorded_config(tmp_path):
    run = _recorded_run(tmp_path, ["train.steps=300", "train.lr=0.01", "logger.mode=disabled", "train.stop_after=4"])
    assert "train.stop_after=4" not in yaml.safe_load((run / RECORD).read_text())["overrides"]
    merged, said = _resume(run, "train.resume=auto")
    config = compose(merged)
    assert config["train"]["steps"] == 300 and config["train"]["lr"] == 0.01
    assert config["train"]["stop_after"] is None and config["logger"]["mode"] == "disabled"
    assert len(said) == 1 and said[0].startswith(f"[hrlplan] resuming {run} at step 4: restored its config (")
    assert "train.steps=300" in said[0] and "steps=300 lr=0.01" in said[0]


def test_a_change_of_what_was_trained_is_one_line_naming_it(tmp_path):
    run = _recorded_run(tmp_path, ["train.steps=300"])
    with pytest.raises(ConfigError) as refused:
        _resume(run, "train.resume=auto", "train.steps=50")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("train.steps=50 on resume:")
    assert "train.steps=300" in message and "here train.steps=50" in message and "another hydra.run.dir" in message
    for cmdline, named in [("lr=1e-4", "lr=1e-4"), ("arch=gpt2", "arch=gpt2"), ("data.seq_len=32", "data.seq_len=32"),
                           ("train.seed=7", "train.seed=7"), ("planner=hrl", "planner=hrl")]:
        with pytest.raises(ConfigError, match=f"^{named} on resume: "):
            _resume(run, "train.resume=auto", cmdline)


def test_safe_keys_may_change_and_equal_values_are_fine(tmp_path):
    run = _recorded_run(tmp_path, ["train.steps=300", "logger.mode=disabled"])
    merged, _ = _resume(run, "train.resume=auto", "train.steps=300", "logger.mode=offline", "cluster.nproc_per_node=1",
                        "train.checkpoint_interval=5", "planner.calibrate=false", "train.stop_after=10")
    config = compose(merged)
    assert config["logger"]["mode"] == "offline" and config["cluster"]["nproc_per_node"] == 1
    assert config["train"]["stop_after"] == 10 and config["train"]["steps"] == 300


def test_a_run_without_a_checkpoint_starts_afresh_and_says_so(tmp_path):
    run = _recorded_run(tmp_path, ["train.steps=300"], step=None)
    merged, said = _resume(run, "train.resume=auto", "train.steps=20")
    assert merged == ["train.resume=auto", "train.steps=20"]
    assert "has no checkpoint yet" in said[0]


def test_a_run_that_recorded_nothing_says_so(tmp_path):
    run = tmp_path / "bare"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    merged, said = _resume(run, "train.resume=auto", "train.steps=9")
    assert merged == ["train.resume=auto", "train.steps=9"] and "recorded no config" in said[0]
    merged, said = resumed_overrides(["train.resume=auto"], [], compose, said.append), said
    assert "without hydra.run.dir" in said[-1]


def test_a_default_changed_in_conf_is_pinned_to_the_recorded_value(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    trained = compose([])
    trained["train"]["warmup_steps"] = 7   # as if conf/ had said 7 when the run started
    write_record(run, [], trained)
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    merged, said = _resume(run, "train.resume=auto")
    assert "train.warmup_steps=7" in merged and compose(merged)["train"]["warmup_steps"] == 7
    assert "train.warmup_steps=7" in said[0]


def test_a_checkpoint_path_restores_the_config_of_its_run(tmp_path):
    run = _recorded_run(tmp_path, ["train.steps=30"], step=6)
    said = []
    merged = resumed_overrides([f"train.resume={run / 'checkpoints' / 'step_000006'}"],
                               [f"hydra.run.dir={tmp_path / 'elsewhere'}"], compose, said.append)
    assert compose(merged)["train"]["steps"] == 30 and "at step 6" in said[0]


def test_a_hand_written_plan_replans_on_another_allocation(tmp_path):
    run = _recorded_run(tmp_path, ["planner=manual", f"planner.plan_file={tmp_path / 'pp2.yaml'}",
                                   "cluster.nproc_per_node=2"])
    merged, said = _resume(run, "train.resume=auto", "cluster.nproc_per_node=1")
    assert compose(merged)["planner"]["name"] != "manual"
    assert "hand-written plan" in said[0] and "cluster.nproc_per_node 2 -> 1" in said[0]
    merged, _ = _resume(run, "train.resume=auto")                     # same allocation: the same plan
    assert compose(merged)["planner"]["plan_file"] == str(tmp_path / "pp2.yaml")


def test_a_run_recorded_only_by_hydra_is_restored_too(tmp_path):
    from omegaconf import OmegaConf

    run = tmp_path / "old"
    (run / ".hydra").mkdir(parents=True)
    overrides = ["train.steps=40", "arch=hrm", "data=sudoku"]
    OmegaConf.save(compose(overrides, resolve=False), run / ".hydra" / "config.yaml")
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    merged, said = _resume(run, "train.resume=auto")
    config = compose(merged)
    assert config["train"]["steps"] == 40 and config["arch"]["name"] == "hrm" and "at step 10" in said[0]
    with pytest.raises(ConfigError, match="^train.warmup_steps=3 on resume"):   # HRM's recipe: 2000
        _resume(run, "train.resume=auto", "train.warmup_steps=3")


# ---------------------------------------------------------------- the run directory
def test_run_directories_that_cannot_hold_a_run(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for value, says in [("", "is empty: the run (checkpoints, logs, plan) would be written into the current directory"),
                        ("/proc/hrlplan-run", "is under /proc, a kernel file system"),
                        (str(a_file), "is an existing file, not a directory"),
                        (str(a_file / "run"), f"cannot be created: {a_file} is a file")]:
        with pytest.raises(ConfigError) as refused:
            check_output_dir("hydra.run.dir", value)
        assert says in str(refused.value) and str(refused.value).startswith("hydra.run.dir=")
    check_output_dir("hydra.run.dir", str(tmp_path / "new" / "run"))
    check_output_dir("hydra.run.dir", "runs/${now:%H-%M}")


@pytest.fixture
def live_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _lock_held_by(run, **holder):
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_FILE).write_text(json.dumps({**this_job(), "started": None, **holder}))


def test_a_live_job_holds_its_run_directory(tmp_path, live_process):
    run = tmp_path / "run"
    _lock_held_by(run, pid=live_process.pid, slurm_job=None, torchrun_id=None)
    with pytest.raises(UserError) as refused:
        RunDirLock(run).acquire()
    message = str(refused.value)
    assert f"pid {live_process.pid} on {socket.gethostname()}" in message and "is in use by another job" in message
    assert "\n" not in message and str(run / LOCK_FILE) in message


def test_a_stale_lock_is_taken_over_and_released_at_the_end(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    _lock_held_by(run, pid=dead.pid, slurm_job=None, torchrun_id=None)
    lock = RunDirLock(run)
    note = lock.acquire()
    assert note and "took over the lock" in note and "is no longer running" in note
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_FILE).exists()


def test_the_same_slurm_job_takes_its_own_lock_again(tmp_path, live_process, monkeypatch):
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"
    _lock_held_by(run, pid=live_process.pid, host="another-node", slurm_job="4242", slurm_restart="0")
    lock = RunDirLock(run)
    assert lock.acquire() is None   # a requeue of the same job: silent
    lock.release()
    # another step of the same allocation, running: another job
    _lock_held_by(run, pid=live_process.pid, host=socket.gethostname(), slurm_job="4242", slurm_step="1")
    with pytest.raises(UserError, match="is in use by another job"):
        RunDirLock(run).acquire()
    _lock_held_by(run, pid=live_process.pid, host="another-node", slurm_job="77")
    monkeypatch.setenv("PATH", str(tmp_path))   # no scontrol: whether job 77 runs is unknown
    with pytest.raises(UserError, match="SLURM job 77"):
        RunDirLock(run).acquire()


# ---------------------------------------------------------------- end to end
FAST = ["logger.mode=disabled", "planner.calibrate=false", "train.checkpoint_interval=0"]


# The case end to end (a run started with its own steps and lr, resumed with train.resume=auto
# alone, then refused a change of steps): tests/test_pretrain.py's requeued run checks it on its resume.


@pytest.mark.slow
def test_refused_run_directories_and_a_busy_one_end_to_end(tmp_path, live_process):
    for value, says in [("", "hydra.run.dir= is empty"), ("/proc/hrlplan-run", "is under /proc")]:
        proc = pretrain(value, *FAST, check=False)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    run = tmp_path / "busy"
    _lock_held_by(run, pid=live_process.pid, slurm_job=None, torchrun_id=None)
    proc = pretrain(run, *FAST, check=False)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hrlplan: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and f"pid {live_process.pid}" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (run / "checkpoints").exists()
