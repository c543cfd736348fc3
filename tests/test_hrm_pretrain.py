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
