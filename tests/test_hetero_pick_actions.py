"""What bench/hetero_pick.py diagnoses capped workers with: each action's CPU time beside its wall
time (runtime/timing.StepRecorder), a capped group's throttling counts (launch/cpu_quota), the mean
step, and the per-rank table of predicted vs measured forwards and backwards."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hrlplan.errors import UserError
from hrlplan.launch import cpu_quota
from hrlplan.runtime.timing import StepRecorder, action_medians, mean_step_time, median_step_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_a_cpu_action_records_its_thread_cpu_time_beside_its_wall_time():
    rec = StepRecorder(torch.device("cpu"))
    rec.begin()
    with rec.op(0, 0, "F"):
        time.sleep(0.05)   # waits: wall time, no CPU time
    with rec.op(0, 1, "F"):
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:   # computes: CPU time on this thread
            pass
    waited, computed = rec.events
    assert waited["end_s"] - waited["start_s"] >= 0.05 and waited["cpu_s"] < 0.025
    assert computed["cpu_s"] >= 0.02
    cpu = action_medians(rec.events + [{"stage": 1, "microbatch": 0, "kind": "B", "start_s": 0.0, "end_s": 1.0}],
                         cpu=True)
    assert set(cpu) == {0} and cpu[0]["F"] == pytest.approx((waited["cpu_s"] + computed["cpu_s"]) / 2)
    assert action_medians(rec.events)[0]["F"] >= 0.035   # wall medians as before


def test_the_mean_step_counts_the_stalls_the_median_leaves_out():
    steps = [0.5, 0.3] + [0.03, 0.03, 0.03, 0.097]   # warm-up, then a quota's stall every fourth step
    assert median_step_time(steps) == pytest.approx(0.03)
    assert mean_step_time(steps) == pytest.approx((3 * 0.03 + 0.097) / 4)
    assert mean_step_time([]) is None


def _writable() -> bool:
    try:
        cpu_quota.check_cpu_controller(cpu_quota.CPU_ROOT)
        return True
    except UserError:
        return False


@pytest.mark.skipif(not _writable(), reason="the cgroup v1 cpu controller is not writable here")
def test_a_capped_group_that_spent_its_quota_reports_its_throttling():
    """A process that computes 40 ms of CPU time under a fiftieth of a core (2 ms per 100 ms period)
    spends its quota in every period it runs and is throttled for the rest: a hard ceiling, whatever
    else runs on the machine (counted in CPU time, not wall time: on a loaded host a wall-clock busy
    loop may never get the share it is capped at)."""
    busy = "import time\nc0 = time.process_time()\nwhile time.process_time() - c0 < 0.04: pass\n"
    with cpu_quota.cpu_quota_groups([None, 0.02], tag="test-throttle") as paths:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()\n" + busy],
                                stdin=subprocess.PIPE, text=True)
        cpu_quota.join_cpu_quota(paths[1], proc.pid)
        proc.communicate("go\n", timeout=120)
    assert cpu_quota.last_job_throttling[0] is None
    stat = cpu_quota.last_job_throttling[1]
    assert stat["nr_throttled"] >= 1 and stat["throttled_time"] > 0 and not os.path.exists(paths[1])


def test_the_bench_sets_each_ranks_measured_actions_beside_its_stages_prediction():
    import hetero_pick

    stages = [{"devices": [0], "device_type": "cpu", "layers": [0, 4], "fwd_s": 0.003, "bwd_s": 0.004,
               "send_s": 0.0005, "busy_s": 0.03},
              {"devices": [2], "device_type": "cpu@0.33", "layers": [4, 6], "fwd_s": 0.004, "bwd_s": 0.005,
               "send_s": 0.0, "busy_s": 0.04}]
    ev = lambda rank, kind, wall, cpu: {"rank": rank, "stage": rank, "microbatch": 0, "kind": kind,  # noqa: E731
                                        "start_s": 0.0, "end_s": wall, "cpu_s": cpu}
    # trained ranks 0 and 1 are job ranks 0 and 2 (job rank 1 idle, compacted away)
    summary = {"used": [0, 2], "throttling": {2: {"nr_periods": 10, "nr_throttled": 4, "throttled_time": 9}},
               "measured": {"events": [ev(0, "F", 0.003, 0.003), ev(1, "F", 0.0045, 0.0015),
                                       ev(1, "B", 0.002, 0.002)]}}
    rows = hetero_pick.per_rank_actions(stages, summary)
    assert rows[2]["device"] == "cpu@0.33" and rows[2]["predicted_fwd_ms"] == pytest.approx(4.0)
    assert rows[2]["measured_F_wall_ms"] == pytest.approx(4.5) and rows[2]["measured_F_cpu_ms"] == pytest.approx(1.5)
    assert rows[2]["throttled"]["nr_throttled"] == 4 and "throttled" not in rows[0]
    assert "measured_B_wall_ms" not in rows[0] and rows[0]["measured_F_cpu_ms"] == pytest.approx(3.0)
    lines = hetero_pick.action_lines("pp", rows)
    assert len(lines) == 2 and "throttled 4/10 periods" in lines[1]


class _Sleeps(torch.nn.Module):
    """A block that waits 30 ms in its forward (no CPU time) and computes a little."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.03)
        return self.lin(x)


def test_a_capped_workers_block_is_timed_in_cpu_time(monkeypatch):
    """Calibration times a block under a CPU quota (one intra-op thread) in its CPU time, the work the
    quota meters: what it waits (a throttled period, a core taken by another process) is not its cost."""
    from hrlplan.runtime.calibrate import compute

    cpu = torch.device("cpu")
    monkeypatch.setattr(compute, "cpu_quota", lambda: None)
    assert compute.quota_timer(cpu) is None                # uncapped: wall time, as before
    monkeypatch.setattr(compute, "cpu_quota", lambda: (0.1, 0.33))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        timer = compute.quota_timer(cpu)
        assert timer is compute.cpu_timed_forward_backward
        assert compute.quota_timer(torch.device("meta")) is None
        fwd, bwd = timer(_Sleeps(), torch.randn(4, 8, requires_grad=True))
        assert 0.0 <= fwd < 0.02 and bwd >= 0.0
        torch.set_num_threads(2)
        assert compute.quota_timer(cpu) is None            # one thread's CPU time would miss the others'
    finally:
        torch.set_num_threads(threads)


def test_the_bench_says_when_the_host_gave_the_uncapped_worker_too_little_of_a_core():
    import hetero_pick

    runs = {"fast-only": [{"measured_s": 0.10, "ranks": {0: {"measured_cpu_per_step_ms": 30.0}}},
                          {"measured_s": 0.04, "ranks": {0: {"measured_cpu_per_step_ms": 36.0}}},
                          {"measured_s": 0.20, "ranks": {0: {"measured_cpu_per_step_ms": 30.0}}}]}
    assert hetero_pick.uncapped_core_share(runs, [None, 0.33, 0.33]) == pytest.approx(0.3)
    assert hetero_pick.uncapped_core_share(runs, [0.5, 0.33]) is None          # no uncapped worker
    assert hetero_pick.uncapped_core_share({}, [None, 0.33]) is None          # fast-only not trained


def test_a_pick_is_the_hand_written_layout_only_with_its_micro_batching():
    import hetero_pick
    from hrlplan.plan import homogeneous_plan

    fast_only = hetero_pick.hand_written(3)["fast-only"]   # one micro-batch of 12 on the fast worker
    three_of_four = homogeneous_plan("gpt2-tiny", 6, [(0, 6)], dp=1, tp=1, microbatch_size=4, num_microbatches=3,
                                     schedule="1f1b")
    three_of_four.unused_ranks, three_of_four.world_size = [1, 2], 3
    assert three_of_four.layout() == fast_only.layout()
    assert not hetero_pick.same_layout(three_of_four, fast_only)
    assert hetero_pick.same_layout(hetero_pick.hand_written(3)["fast-only"], fast_only)
