"""`python pretrain.py` end to end with the tiny defaults, and resume after an interruption (the
recorded config restored, a change of it refused)."""
import json

import pytest
import yaml

from _runs import pretrain
from hrlplan.launch.rundir import LOCK_FILE
from hrlplan.plan import Plan
from hrlplan.runtime.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("default") / "run"
    proc = pretrain(run_dir, "train.steps=50")
    return run_dir, proc


def test_writes_every_artifact(default_run):
    run_dir, _ = default_run
    for name in ["cluster.json", "model_meta.json", "plan.yaml", "plan_info.json", ".hydra/config.yaml",
                 "metrics.jsonl", "train.log"]:
        assert (run_dir / name).exists(), name
    plan = Plan.load(run_dir / "plan.yaml")
    cluster = json.loads((run_dir / "cluster.json").read_text())
    assert plan.world_size == len(cluster["devices"])
    assert "predicted" in plan.meta and "launch" in plan.meta
    assert (run_dir / "checkpoints" / "latest").exists()
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / ".metadata").exists()
    resolved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert resolved["arch"]["name"] == "gpt2-tiny"


def test_loss_falls(default_run):
    run_dir, _ = default_run
    losses = [m["train/lm_loss"] for m in read_metrics(run_dir)]
    assert len(losses) == 50
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_offline_wandb_run_holds_metrics(default_run):
    run_dir, _ = default_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    blob = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in [b"train/lm_loss", b"train/lr", b"train/tokens_per_s", b"parallel-plan"]:
        assert key in blob, key


@pytest.fixture(scope="module")
def requeued(tmp_path_factory):
    """A calibrated run (calibration on by default on this machine, cached per user: here a cache of
    its own, so the first run measures) stopped after 4 of 8 steps and resumed as a requeued job would
    be. The uninterrupted run uses the same cache, hence the same calibration and plan. Its steps and lr
    are not the defaults: the resume must restore them from the run directory. A 2-block model on
    32-token rows: the calibration's micro-benchmarks measure less, and none of these claims depends
    on the model's size."""
    root = tmp_path_factory.mktemp("requeued")
    env = {"HRLPLAN_CALIBRATION_CACHE": str(root / "cache")}
    common = ["train.steps=8", "train.lr=0.004", "train.checkpoint_interval=0", "logger.mode=disabled",
              "arch.n_layer=2", "data.seq_len=32"]
    interrupted = root / "interrupted"
    first = pretrain(interrupted, *common, "train.stop_after=4", env=env)
    stopped_after = len(read_metrics(interrupted))
    calibrated = json.loads((interrupted / "cluster.json").read_text())["calibration"]
    again = pretrain(interrupted, "train.resume=auto", env=env)   # as the README says: its config is restored
    return dict(root=root, env=env, common=common, run=interrupted, first=first, again=again,
                stopped_after=stopped_after, calibrated=calibrated)


def test_resume_continues_the_same_loss_curve(requeued):
    straight, interrupted = requeued["root"] / "straight", requeued["run"]
    assert f"[hrlplan] resuming {interrupted} at step 4: restored its config (" in requeued["again"].stderr
    pretrain(straight, *requeued["common"], env=requeued["env"])
    assert requeued["stopped_after"] == 4
    full = {m["step"]: m["train/lm_loss"] for m in read_metrics(straight)}
    resumed = {m["step"]: m["train/lm_loss"] for m in read_metrics(interrupted)}
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6)


def test_resume_auto_restores_the_recorded_config_and_refuses_a_change(requeued):
    """train.resume=auto alone continues the run it names (tests/test_resume_truth.py: the same in-process)."""
    run, again = requeued["run"], requeued["again"]
    line = next(ln for ln in again.stderr.splitlines() if ln.startswith("[hrlplan] resuming"))
    assert line.startswith(f"[hrlplan] resuming {run} at step 4: restored its config (") and "steps=8 lr=0.004" in line
    hydra_config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert hydra_config["train"]["steps"] == 8 and hydra_config["train"]["lr"] == 0.004
    assert not (run / LOCK_FILE).exists()   # the job released its run directory
    refused = pretrain(run, "train.resume=auto", "train.steps=50", check=False, env=requeued["env"])
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("hrlplan: error:")]
    assert refused.returncode == 2 and len(errors) == 1 and "Traceback" not in refused.stderr
    assert errors[0].startswith("hrlplan: error: train.steps=50 on resume:") and "train.steps=8" in errors[0]
    assert yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["train"]["steps"] == 8


def test_bad_override_gets_one_clear_message(tmp_path):
    proc = pretrain(tmp_path / "bad", "train.stepz=3", check=False)
    assert proc.returncode != 0
    assert "stepz" in proc.stderr and "Traceback" not in proc.stderr


def test_eval_loss_and_perplexity_at_the_end(default_run):
    run_dir, _ = default_run
    evals = [m for m in read_metrics(run_dir) if "eval/lm_loss" in m]
    assert evals and evals[-1]["step"] == 50
    assert evals[-1]["eval/perplexity"] == pytest.approx(__import__("math").exp(evals[-1]["eval/lm_loss"]), rel=1e-6)


def test_worker_side_error_is_one_line_without_traceback(tmp_path):
    proc = pretrain(tmp_path / "bad", "data.seq_len=256", "logger.mode=disabled", check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hrlplan: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("hrlplan: error: data.seq_len=256 is longer than the model's 128 positions")
    assert "set data.seq_len<=128 or arch.n_positions=256" in errors[0]
    assert "Traceback" not in proc.stderr


def test_a_requeued_calibrated_run_reuses_its_calibration(requeued):
    """Calibration is on by default on this machine, measured once and cached per user."""
    first, again, run = requeued["first"], requeued["again"], requeued["run"]
    assert "calibrating:" in first.stdout + first.stderr
    if "nothing is cached" in first.stdout + first.stderr:
        # a busy machine: an unsteady calibration is never cached (by design), so the requeued run measures
        assert "calibrating:" in again.stdout + again.stderr
        return
    calibrated = requeued["calibrated"]
    assert "planning from the cached calibration" in again.stdout + again.stderr
    assert json.loads((run / "cluster.json").read_text())["calibration"] == calibrated
