"""The command HRM's users type runs through pretrain.py (a few steps, on a small generated set)."""
import json

import pytest

from _runs import pretrain
from hrlplan.runtime.metrics import read_metrics

pytestmark = pytest.mark.slow

HRM_GUIDE = ["epochs=500", "eval_interval=100", "global_batch_size=4", "lr=1e-4", "puzzle_emb_lr=1e-4",
             "weight_decay=1.0", "puzzle_emb_weight_decay=1.0", "arch.hidden_size=32", "arch.H_layers=1",
             "arch.L_layers=1", "arch.num_heads=1", "arch.expansion=2"]


def test_hrm_guide_command_runs_a_few_steps(tmp_path):
    data = tmp_path / "sudoku-extreme-small"   # the README command's data, built on first use
    run_dir = tmp_path / "run"
    pretrain(run_dir, "arch=hrm", f"data_path={data}", *HRM_GUIDE, "train.stop_after=3")
    losses = [m["train/lm_loss"] for m in read_metrics(run_dir) if "train/lm_loss" in m]
    assert len(losses) >= 3 and all(0 < x < 10 for x in losses)
    assert any("eval/exact_accuracy" in m for m in read_metrics(run_dir))
    plan = (run_dir / "plan.yaml").read_text()
    assert "pp: 1" in plan                       # HRM's recurrent core: data parallel only
    assert (run_dir / "checkpoints" / "all_config.yaml").exists()
    assert json.loads((data / "train" / "dataset.json").read_text())["seq_len"] == 81


def test_torchrun_launch_uses_the_ranks_it_is_given(tmp_path):
    """HRM's README launches `torchrun --nproc-per-node 8 pretrain.py ...`: the job joins those
    ranks (here 2 CPU ranks) instead of spawning workers of its own (nproc_per_node=1 would)."""
    import os
    import subprocess
    import sys

    from _runs import ROOT
    from hrlplan.data.sudoku import SudokuPreset, build_sudoku_dataset

    data = build_sudoku_dataset(str(tmp_path / "tiny"), SudokuPreset(num_train=8, num_test=4, num_aug=1), seed=0,
                                workers=1, progress=False, log=lambda _: None)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "pretrain.py"),
           f"data_path={data}", "arch=hrm", "epochs=2", "eval_interval=1", "global_batch_size=4",
           "arch.hidden_size=16", "arch.H_layers=1", "arch.L_layers=1", "arch.num_heads=1", "arch.expansion=2",
           "arch.halt_max_steps=2", "cluster.nproc_per_node=1", "logger.mode=disabled", f"run_dir={run_dir}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "2 rank(s)" in log and "AdamATan2" in log
    assert sum("train/lm_loss" in m for m in read_metrics(run_dir)) == 4   # one job's 4 steps, logged once
    assert (run_dir / "checkpoints" / "step_000004" / ".metadata").exists()   # 2 epochs x 8 puzzles / batch 4
