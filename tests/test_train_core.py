"""The training core (runtime/train_core.py) on its own: the shared LR lambda, and a resume that
re-plans reaching the metrics logger (note, W&B summary keys replan/old, replan/new, replan/reason)."""
from __future__ import annotations

import json

import pytest
import torch

from hrlplan.runtime import checkpoint as ckpt
from hrlplan.runtime.metrics import MetricsLogger
from hrlplan.runtime.train_core import LRSchedule, TrainAdapter, TrainCore, warmup_cosine


class _Tiny(TrainAdapter):
    """A one-layer 'model' with AdamW: enough for the core to save and resume."""

    def __init__(self, root, resume="none"):
        torch.manual_seed(0)
        self.parts = {0: torch.nn.Linear(4, 4)}
        self.optimizers = {0: torch.optim.AdamW(self.parts[0].parameters(), lr=1e-2)}
        self.lr = LRSchedule({"stage0": self.optimizers[0]}, warmup_cosine(2, 10, 0.1))
        self.checkpoint_root, self.stop_at, self._resume = root, 10, resume

    def resume_setting(self):
        return self._resume


def test_one_lambda_for_both_counts():
    lm, hrm = warmup_cosine(3, 20, 0.1), warmup_cosine(3, 20, 0.1, hrm_counting=True)
    assert [lm(n) for n in range(3)] == [hrm(n) for n in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert lm(3) == 1.0 and hrm(3) < 1.0          # the cosine starts one update later for language models
    assert [lm(n + 1) for n in range(3, 19)] == [hrm(n) for n in range(3, 19)]
    assert lm(20) == hrm(19) == pytest.approx(0.1) and lm(50) == pytest.approx(0.1)   # then held at min_lr_ratio


def test_resume_under_another_layout_reaches_the_metrics_logger(tmp_path):
    root = tmp_path / "checkpoints"
    core = TrainCore(_Tiny(root))
    core.step = 4
    path = core.save()
    # as if two ranks on another host had written it
    (path / ckpt.LAYOUT_FILE).write_text(json.dumps([{"host": "node-a", "stages": {"0": []}},
                                                     {"host": "node-a", "stages": {"0": []}}]))
    logger = MetricsLogger(tmp_path, {}, {"mode": "disabled"}, enabled=True, echo=False)
    resumed = TrainCore(_Tiny(root, resume="auto"), logger)
    assert resumed.resume() == path and resumed.step == 4
    logger.finish()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replan/old"].startswith("2 rank(s) on 1 node(s) (node-a)")
    assert summary["replan/new"].startswith("1 rank(s)")
    assert "now runs on 1 node(s)" in summary["replan/reason"] and summary["replan/step"] == 4
    assert "re-plan on resume from step_000004: the job now runs on 1 node(s)" in (tmp_path / "train.log").read_text()
    assert json.loads((root / ckpt.REPLAN_LOG).read_text().splitlines()[-1])["step"] == 4


def test_resume_without_a_replan_logs_none(tmp_path):
    root = tmp_path / "checkpoints"
    first = TrainCore(_Tiny(root))
    first.step = 2
    first.save()
    calls = []

    class Recording:
        def note(self, text):
            calls.append(("note", text))

        def summary(self, values):
            calls.append(("summary", values))

    resumed = TrainCore(_Tiny(root, resume="auto"), Recording())
    resumed.resume()
    assert resumed.step == 2 and calls == []
    # the LR schedule continues where it stopped
    assert resumed.adapter.lr.state_dict()["stage0"]["last_epoch"] == first.adapter.lr.state_dict()["stage0"]["last_epoch"]
