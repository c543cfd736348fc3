"""Helpers for tests that run real jobs (several gloo processes on this machine)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

from hrlplan.compose import compose
from hrlplan.plan import homogeneous_plan

ROOT = Path(__file__).resolve().parent.parent


def run_plan(tmp_path: Path, spans, dp: int, schedule: str, steps: int = 5, microbatches: int = 4,
             extra: List[str] = (), arch: str = "gpt2-tiny", n_layer: int = 6, global_batch: int = 8) -> List[float]:
    """Train a hand-written plan through the real job path (planner=manual); losses per step."""
    from hrlplan.launch.job import run

    plan = homogeneous_plan(arch, n_layer, spans, dp=dp, tp=1, microbatch_size=global_batch // (microbatches * dp),
                            num_microbatches=microbatches, schedule=schedule)
    plan_file = tmp_path / "manual_plan.yaml"
    plan.save(plan_file)
    config = compose([f"arch={arch}", "planner=manual", f"planner.plan_file={plan_file}",
                      f"cluster.nproc_per_node={plan.world_size}", "logger.mode=disabled", f"train.steps={steps}",
                      f"train.schedule={schedule}", f"train.global_batch_size={global_batch}",
                      "train.checkpoint_interval=0", "cluster.oversubscribe=true", *extra])
    config["run_dir"] = str(tmp_path / "run")
    summary = run(config)
    return [h["train/lm_loss"] for h in summary["history"]]


def reference_losses(steps: int = 5, extra: List[str] = (), arch: str = "gpt2-tiny") -> List[float]:
    from hrlplan.runtime.reference import train_single_process

    cfg = compose([f"arch={arch}", f"train.steps={steps}", *extra])
    return [h["loss"] for h in train_single_process(cfg, steps)]


def pretrain(run_dir: Path, *overrides: str, check: bool = True, env: dict = None) -> subprocess.CompletedProcess:
    """`python pretrain.py ...` exactly as a user types it, with the run directory pinned (env: more
    environment variables)."""
    env = dict(os.environ, WANDB_SILENT="true", HF_HUB_OFFLINE="1", **(env or {}))
    cmd = [sys.executable, str(ROOT / "pretrain.py"), f"hydra.run.dir={run_dir}", *overrides]
    proc = run_to_files(cmd, cwd=ROOT, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_to_files(cmd: List[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) that returns when the command exits: its
    output goes through files, not pipes, so the local launcher's fork server (which outlives the
    command by a fraction of a second, holding the pipes' write ends) is not waited for."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, text=True, timeout=timeout, **popen)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
