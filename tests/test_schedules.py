"""A multi-stage run leaves plan-vs-measured and a timeline in plan_info.json; ZB-V holds GPT-2's tied
embedding twice on one rank. (Every registry schedule against one process: test_schedule_training.py.)"""
import json

import pytest

from hrlplan.plan import homogeneous_plan
from hrlplan.launch.local_run import compare_with_one_process
from hrlplan.schedules import ALIASES, SCHEDULES, Order

pytestmark = pytest.mark.slow

GPT2 = ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"]
SPANS = [(0, 1), (1, 2), (2, 3), (3, 4)]
INTERLEAVED_1F1B = next(n for n, s in SCHEDULES.items() if s.multi_stage and s.order is Order.ONE_F_ONE_B)
ZERO_BUBBLE = next(iter(ALIASES))   # the old name: ZB-V with two stages per rank


def test_interleaved_1f1b_matches_one_process(tmp_path):
    plan = homogeneous_plan("gpt2-tiny", 4, SPANS, dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule=INTERLEAVED_1F1B, stages_per_rank=2)
    plan.meta["predicted"] = {"step_time_s": 0.05, "bubble_fraction": 0.2, "memory_bytes_per_rank": [2**28, 2**28]}
    losses, reference = compare_with_one_process(plan, GPT2, tmp_path)
    assert losses == pytest.approx(reference, abs=1e-5)
    info = json.loads((tmp_path / "plan_info.json").read_text())
    assert info["predicted"]["step_time_s"] == 0.05
    measured = info["measured"]
    assert measured["step_time_s"] > 0 and 0 <= measured["bubble_fraction"] < 1
    assert len(measured["memory_bytes_per_rank"]) == 2 and set(measured["stages"]) == {"0", "1", "2", "3"}
    assert info["relative_error"]["step_time_s"] == pytest.approx(measured["step_time_s"] / 0.05 - 1)
    kinds = {(e["stage"], e["microbatch"], e["kind"]) for e in info["measured_timeline"]}
    assert kinds == {(s, j, k) for s in range(4) for j in range(4) for k in "FB"}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(f"stage/{i}/compute_s" in r and f"stage/{i}/idle_s" in r for r in records for i in range(4))


def test_zero_bubble_v_schedule_matches_one_process(tmp_path):
    """ZBV puts the first and last stage on one rank: GPT-2's tied embedding is held twice there."""
    plan = homogeneous_plan("gpt2-tiny", 4, SPANS, dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule=ZERO_BUBBLE, stages_per_rank=2)
    losses, reference = compare_with_one_process(plan, GPT2, tmp_path)
    assert losses == pytest.approx(reference, abs=1e-5)
    info = json.loads((tmp_path / "plan_info.json").read_text())
    assert {e["kind"] for e in info["measured_timeline"]} == {"F", "B", "W"}
