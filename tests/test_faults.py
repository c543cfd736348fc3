"""Faults: a rank killed mid-step, Ctrl-C/SIGTERM to the main process, a checkpoint cut short on disk.

The end-to-end tests run `python pretrain.py` on a hand-written two-stage plan (both workers train)
and compare every step's loss with one uninterrupted run of the same plan and settings: a resume
must continue the same curve to 1e-6 (the same layout replays the same arithmetic). The runs have
the LR schedule of a long run (train.steps=200) but stop early (train.stop_after) once the compared
steps are done. A fault lands at a chosen step: the job holds there (tests/_hold.py, the sync point
of hrlplan/runtime/preempt.py) until the test has sent its signal or killed its rank.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from _hold import StepHold
from _runs import ROOT, pretrain
from hrlplan.errors import UserError
from hrlplan.launch import local
from hrlplan.launch.local import Interrupted, launch_workers
from hrlplan.plan import homogeneous_plan
from hrlplan.runtime import checkpoint as ckpt
from hrlplan.runtime import preempt

STEPS = 200     # the configured run's LR schedule
CHECK = 8       # steps compared with the uninterrupted run
FAULT_AT = 3    # the step at which the job holds for the fault
TOL = 1e-6
EXIT_WITHIN_S = 60


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def common(tmp_path_factory):
    plan_file = tmp_path_factory.mktemp("plan") / "pp2.yaml"
    homogeneous_plan("gpt2-tiny", 6, [(0, 4), (4, 6)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                     schedule="1f1b").save(plan_file)
    return [f"train.steps={STEPS}", "logger.mode=disabled", "planner.calibrate=false", "planner=manual",
            f"planner.plan_file={plan_file}", "cluster.nproc_per_node=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, common):
    """The uninterrupted run: its run directory (checkpoints at 4, 6, 8) and its loss per step."""
    run = tmp_path_factory.mktemp("straight") / "run"
    pretrain(run, *common, "train.checkpoint_interval=2", f"train.stop_after={CHECK}")
    return run, _losses(run)


def _losses(run_dir: Path) -> dict:
    """Loss per step from metrics.jsonl; a step logged twice (before a failure and after the resume)
    counts with its last value."""
    out = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:   # a line being written
            continue
        if "train/lm_loss" in entry:
            out[entry["step"]] = entry["train/lm_loss"]
    return out


def _start(run_dir: Path, *overrides: str, env: dict) -> subprocess.Popen:
    """`python pretrain.py ...` in the background (env: more variables), its output in files beside
    the run directory."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WANDB_SILENT="true", HF_HUB_OFFLINE="1", **env)
    cmd = [sys.executable, str(ROOT / "pretrain.py"), f"hydra.run.dir={run_dir}", *overrides]
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    err = open(run_dir.parent / f"{run_dir.name}.err", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)


def _output(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.out").read_text() + (run_dir.parent / f"{run_dir.name}.err").read_text()


def _wait_held(hold: StepHold, run_dir: Path, proc: subprocess.Popen, step: int = FAULT_AT) -> dict:
    """Until both workers wait at the hold, which is the run's step `step` (trained and logged); {rank: pid}."""
    hold.wait_held(2, alive=lambda: proc.poll() is None, why=lambda: _output(run_dir)[-4000:])
    assert max(_losses(run_dir)) == step
    return hold.held_pids()


def _ends_within(proc: subprocess.Popen, seconds: float) -> float:
    t0 = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"pretrain.py still ran {seconds} s after the fault")
    return time.monotonic() - t0


def _assert_same_curve(resumed: dict, full: dict, first: int, last: int = CHECK) -> None:
    assert sorted(resumed) == list(range(1, last + 1))
    for step in range(first, last + 1):
        assert resumed[step] == pytest.approx(full[step], abs=TOL), (step, resumed[step], full[step])


# ---------------------------------------------------------------- the sync point the fault tests use
@pytest.fixture
def fresh_preempt(monkeypatch):
    """preempt's flag and step-boundary count of a new process; cleared again afterwards."""
    monkeypatch.setattr(preempt, "_BOUNDARIES", [0])
    preempt.clear()
    yield
    preempt.clear()


def test_the_hold_waits_at_its_step_until_released_and_reports_a_stop(tmp_path, monkeypatch, fresh_preempt):
    hold = StepHold(tmp_path / "hold", 2)
    for key, value in hold.env.items():
        monkeypatch.setenv(key, value)
    assert preempt.stop_agreed() is False          # boundary 1 passes
    answer = []
    boundary_two = threading.Thread(target=lambda: answer.append(preempt.stop_agreed()), daemon=True)
    boundary_two.start()
    hold.wait_held(1, alive=boundary_two.is_alive, timeout_s=30)
    assert hold.held_pids() == {0: os.getpid()}
    time.sleep(0.2)
    assert boundary_two.is_alive() and answer == []    # still waiting: nothing but the file releases it
    preempt.request_stop("test")
    hold.wait_stopping(1, alive=boundary_two.is_alive, timeout_s=30)
    hold.release()
    boundary_two.join(30)
    assert answer == [True]                        # the stop sent during the hold is seen at that step
    assert preempt.stop_agreed() is True           # later boundaries pass


def test_a_released_hold_passes_and_a_bad_one_says_why(tmp_path, monkeypatch, fresh_preempt):
    hold = StepHold(tmp_path / "hold", 1)
    hold.release()   # a job resumed after the test released it: no wait
    for key, value in hold.env.items():
        monkeypatch.setenv(key, value)
    assert preempt.stop_agreed() is False and not list(tmp_path.glob("hold.held.*"))

    monkeypatch.setenv(preempt.HOLD_AT_STEP_ENV, "three")
    with pytest.raises(ValueError, match="HRLPLAN_TEST_HOLD_AT_STEP='three' is not a step number"):
        preempt.stop_agreed()
    monkeypatch.setenv(preempt.HOLD_AT_STEP_ENV, "3")
    monkeypatch.delenv(preempt.HOLD_FILE_ENV)
    with pytest.raises(ValueError, match="HRLPLAN_TEST_HOLD_FILE"):
        preempt.stop_agreed()

    monkeypatch.setattr(preempt, "_BOUNDARIES", [0])
    monkeypatch.setenv(preempt.HOLD_AT_STEP_ENV, "1")
    monkeypatch.setenv(preempt.HOLD_FILE_ENV, str(tmp_path / "never"))
    monkeypatch.setenv(preempt.HOLD_TIMEOUT_ENV, "0.1")
    with pytest.raises(TimeoutError, match="was not created in time"):
        preempt.stop_agreed()


# ---------------------------------------------------------------- kill -9 of one rank
@pytest.mark.slow
def test_a_rank_killed_mid_step_ends_the_job_and_auto_resume_continues_the_curve(tmp_path, common, straight):
    run = tmp_path / "killed"
    hold = StepHold(tmp_path / "hold", FAULT_AT)
    proc = _start(run, *common, "train.checkpoint_interval=2", env=hold.env)
    workers = _wait_held(hold, run, proc)
    os.kill(workers[1], signal.SIGKILL)
    hold.release()   # rank 0 goes on to the step's stop vote and finds its peer gone
    took = _ends_within(proc, EXIT_WITHIN_S)
    out = _output(run)
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("hrlplan: error:")]
    assert len(errors) == 1 and errors[0].startswith("hrlplan: error: worker rank 1 was killed by signal SIGKILL"), out
    print(f"every process ended {took:.1f} s after the kill")

    last = ckpt.latest_checkpoint(run / "checkpoints")
    assert last is not None and last.name == f"step_{FAULT_AT - 1:06d}"   # the last periodic one
    again = pretrain(run, *common, "train.checkpoint_interval=2", "train.resume=auto", f"train.stop_after={CHECK}")
    assert f"resumed from {last}" in again.stdout + again.stderr
    _assert_same_curve(_losses(run), straight[1], 1)


# ---------------------------------------------------------------- Ctrl-C / SIGTERM to the main process
SIGTERM_AT = 2 * FAULT_AT   # the resumed run holds at its own FAULT_AT-th step: FAULT_AT steps after the resume


def _stop_by(sig: signal.Signals, run: Path, hold: StepHold, proc: subprocess.Popen, step: int) -> dict:
    """`sig` to the main process while both workers hold at the run's step `step`; what the stop left,
    read at once (the next run of the directory moves `latest` on)."""
    _wait_held(hold, run, proc, step)
    os.kill(proc.pid, sig)
    hold.wait_stopping(2, alive=lambda: proc.poll() is None, why=lambda: _output(run)[-4000:])
    hold.release()
    took = _ends_within(proc, EXIT_WITHIN_S)
    path = run / "checkpoints" / f"step_{step:06d}"
    saved = [torch.load(path / f"extra_rank{rank}.pt", weights_only=True)["step"] if path.exists() else None
             for rank in (0, 1)]
    return dict(returncode=proc.returncode, out=_output(run), took=took, last_logged=max(_losses(run)),
                problem=ckpt.checkpoint_problem(path) if path.exists() else "missing",
                latest=ckpt.latest_checkpoint(run / "checkpoints"), saved_steps=saved)


@pytest.fixture(scope="module")
def signalled(tmp_path_factory, common):
    """One run stopped by both signals (a start is most of each test's time): SIGINT while it holds at
    FAULT_AT, then, resumed (train.resume=auto), SIGTERM while it holds at SIGTERM_AT. {signal: what
    that stop left}, "run" and "losses" (per step, after both)."""
    root = tmp_path_factory.mktemp("signalled")
    run = root / "signalled"
    stops = {}
    hold = StepHold(root / "hold-int", FAULT_AT)
    proc = _start(run, *common, "train.checkpoint_interval=0", env=hold.env)
    stops[signal.SIGINT] = _stop_by(signal.SIGINT, run, hold, proc, FAULT_AT)
    hold = StepHold(root / "hold-term", FAULT_AT)   # the resumed process's FAULT_AT-th step boundary
    proc = _start(run, *common, "train.checkpoint_interval=0", "train.resume=auto", f"train.stop_after={CHECK}",
                  env=hold.env)
    stops[signal.SIGTERM] = _stop_by(signal.SIGTERM, run, hold, proc, SIGTERM_AT)
    return dict(stops, run=run, losses=_losses(run))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_main_process_stops_cleanly_with_a_checkpoint(sig, signalled, straight):
    stop, run = signalled[sig], signalled["run"]
    out = stop["out"]
    assert stop["returncode"] == 128 + sig, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stops = [line for line in out.splitlines() if re.match(rf"\[hrlplan\] stopped by {sig.name} at step \d+", line)]
    assert len(stops) == 1, out[-3000:]
    step = int(re.search(r"at step (\d+)", stops[0]).group(1))
    path = run / "checkpoints" / f"step_{step:06d}"
    assert f"checkpoint {path};" in stops[0] and "train.resume=auto" in stops[0] and f"train.resume={path}" in stops[0]
    print(f"stopped at step {step}, {stop['took']:.1f} s after {sig.name}")

    # a complete checkpoint of the step the run stopped at, named by `latest`
    assert step == (FAULT_AT if sig == signal.SIGINT else SIGTERM_AT) and stop["last_logged"] == step
    assert stop["problem"] is None and stop["latest"] == path
    assert stop["saved_steps"] == [step, step]   # extra_rank0.pt and extra_rank1.pt

    if sig == signal.SIGINT:   # the run resumed after it continues the uninterrupted curve (to SIGTERM_AT)
        _assert_same_curve(signalled["losses"], straight[1], step + 1, last=SIGTERM_AT)


def _stubborn(marker: str) -> None:
    """A worker that ignores every stop request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(f"{marker}{os.environ['RANK']}").touch()
    while True:
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["second", "timeout"])
def test_workers_that_do_not_stop_are_killed_by_a_second_signal_or_the_deadline(how, tmp_path, monkeypatch):
    monkeypatch.setattr(local, "STOP_TIMEOUT_S", 60 if how == "second" else 2)
    marker = str(tmp_path / "started")

    def interrupt_me():
        end = time.monotonic() + 120
        while not all(Path(f"{marker}{r}").exists() for r in (0, 1)) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
        if how == "second":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_me, daemon=True).start()
    with pytest.raises(Interrupted) as err:
        launch_workers(_stubborn, (marker,), 2, log_dir=str(tmp_path / "logs"))
    assert err.value.exit_code == 130 and err.value.results is None
    expected = "a second SIGINT killed the workers" if how == "second" else "had not stopped 2 s later"
    assert expected in str(err.value)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # this process's handler is back


# ---------------------------------------------------------------- a checkpoint cut short on disk
@pytest.mark.slow
def test_auto_resume_skips_a_truncated_checkpoint_for_the_previous_one(tmp_path, common, straight):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(straight[0], run)   # checkpoints 8, 10, 12 of the uninterrupted run
    shard = run / "checkpoints" / f"step_{CHECK:06d}" / "__1_0.distcp"
    _truncate(shard)
    again = pretrain(run, *common, "train.checkpoint_interval=2", "train.resume=auto", f"train.stop_after={CHECK}")
    out = again.stdout + again.stderr
    notes = [line for line in out.splitlines() if f"checkpoint step_{CHECK:06d} is incomplete" in line]
    assert len(notes) == 1 and str(shard) in notes[0] and f"resuming from step_{CHECK - 2:06d}" in notes[0], out[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{CHECK - 2:06d}'}" in out
    resumed = _losses(run)
    for step in (CHECK - 1, CHECK):
        assert resumed[step] == pytest.approx(straight[1][step], abs=TOL)


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _write_checkpoints(root: Path, steps) -> None:
    """Checkpoints of a small model and its Adam state in this process (no process group)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    for step in steps:
        ckpt.save_checkpoint(root, step, {0: model}, {0: opt}, {"position": {"step": step}})


DAMAGE = {
    "a shard cut short": ("__0_0.distcp", _truncate),
    "the metadata missing": (".metadata", Path.unlink),
    "the metadata cut short": (".metadata", _truncate),
    "extra_rank0.pt cut short": ("extra_rank0.pt", _truncate),
}


SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@SINGLE_PROCESS
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_or_skipped(damage, tmp_path):
    root = tmp_path / "checkpoints"
    _write_checkpoints(root, [2, 4, 6])
    name, spoil = DAMAGE[damage]
    spoil(root / "step_000006" / name)
    file = str(root / "step_000006" / name)

    # named explicitly: one line naming the file
    with pytest.raises(UserError) as err:
        ckpt.find_resume(str(root / "step_000006"), root)
    message = str(err.value)
    assert "\n" not in message and file in message and message.startswith(f"train.resume={root / 'step_000006'}")

    # auto: the newest complete one, with one line saying so
    found, notes = ckpt.find_resume("auto", root)
    assert found == root / "step_000004"
    assert len(notes) == 1 and "step_000006 is incomplete" in notes[0] and file in notes[0]
    assert "resuming from step_000004" in notes[0] and "\n" not in notes[0]
    assert ckpt.checkpoint_problem(root / "step_000004") is None


@SINGLE_PROCESS
def test_auto_resume_with_every_checkpoint_damaged_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    _write_checkpoints(root, [2, 4])
    for step in (2, 4):
        _truncate(root / f"step_{step:06d}" / "__0_0.distcp")
    with pytest.raises(UserError, match=r"no complete checkpoint in .*step_000004: .*truncated.*train.resume=none"):
        ckpt.find_resume("auto", root)
    assert ckpt.find_resume("auto", tmp_path / "none-yet") == (None, [])
