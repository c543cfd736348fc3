"""Emulated heterogeneous workers: cgroup v1 CPU quotas (hrlplan/launch/cpu_quota.py)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hrlplan.errors import UserError
from hrlplan.launch.cpu_quota import (CPU_ROOT, ENV, capped_workers, check_cpu_controller, check_shares,
                                      cpu_quota_groups, create_group, join_from_environment)


def _writable() -> bool:
    try:
        check_cpu_controller(CPU_ROOT)
        return True
    except UserError:
        return False


needs_cgroups = pytest.mark.skipif(not _writable(), reason="the cgroup v1 cpu controller is not writable here")


def test_shares_are_checked_per_worker():
    assert check_shares([1.0, 0.33, None], 3) == [1.0, 0.33, None]
    with pytest.raises(UserError, match=r"cluster.cpu_shares has 2 entries for 3 local workers"):
        check_shares([1.0, 0.5], 3)
    with pytest.raises(UserError, match=r"cluster.cpu_shares\[1\]=0"):
        check_shares([1.0, 0], 2)
    with pytest.raises(UserError, match=r"cluster.cpu_shares\[0\]='fast'"):
        check_shares(["fast"], 1)


def test_a_missing_controller_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError) as missing:
        check_cpu_controller(tmp_path / "no-such-dir")
    assert "\n" not in str(missing.value) and "cgroup v1 cpu controller" in str(missing.value)
    with pytest.raises(UserError, match="is missing or is not one"):   # a directory, but no controller
        with cpu_quota_groups([0.5], root=tmp_path):
            pass
    with cpu_quota_groups([None, None], root=tmp_path / "absent") as paths:   # nothing capped: nothing needed
        assert paths == [None, None]


@needs_cgroups
def test_groups_are_removed_also_when_the_job_fails():
    made = []
    with pytest.raises(RuntimeError, match="a worker failed"):
        with cpu_quota_groups([None, 0.5], tag="test-fail") as paths:
            made = paths
            assert paths[0] is None and os.path.isdir(paths[1])
            quota = int(open(os.path.join(paths[1], "cpu.cfs_quota_us")).read())
            period = int(open(os.path.join(paths[1], "cpu.cfs_period_us")).read())
            assert quota == round(0.5 * period)
            raise RuntimeError("a worker failed")
    assert made and not os.path.exists(made[1])


_MEASURE = textwrap.dedent("""
    import json, sys, time
    import torch
    from hrlplan.launch.cpu_quota import join_cpu_quota
    torch.set_num_threads(1)
    fast, slow = sys.argv[1], sys.argv[2]
    a = torch.randn(256, 256)

    def rate(seconds):
        # (matmuls per second, CPU seconds per second) over `seconds` of wall time
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            a @ a
            n += 1
        wall = time.perf_counter() - t0
        return n / wall, (time.process_time() - c0) / wall

    rates = {"fast": [], "slow": []}
    for _ in range(3):   # interleaved: a change in the machine's load hits both alike
        for which, path in (("fast", fast), ("slow", slow)):
            join_cpu_quota(path)
            rate(0.2)   # past the period the move started in
            rates[which].append(rate(1.0))
    print(json.dumps(rates))
""")


@needs_cgroups
def test_a_worker_capped_at_a_third_runs_matmuls_at_about_a_third(tmp_path):
    """One process, measured in turn in the uncapped (1.0 core) and the capped (1/3) group: no race
    between two processes. The capped group's CPU time per wall second is a hard ceiling whatever
    else runs; the rates differ only where the machine gives the uncapped phase more than the cap
    (on a saturated machine a process gets less than a third of a core anyway), so that check
    needs the uncapped phase to have had 0.62 of a core or more; the tolerance is generous."""
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE)
    with cpu_quota_groups([1.0, 0.33], tag="test-rate") as (fast, slow):
        out = subprocess.run([sys.executable, str(script), fast, slow], capture_output=True, text=True,
                             timeout=120, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    rates = json.loads(out.stdout.strip().splitlines()[-1])
    assert not os.path.exists(fast) and not os.path.exists(slow)
    assert max(cpu for _, cpu in rates["slow"]) < 0.33 * 1.25, rates   # the quota: CPU s per wall s
    (fast_rate, fast_cpu), (slow_rate, _) = sorted(rates["fast"])[1], sorted(rates["slow"])[1]
    if fast_cpu < 0.62:
        pytest.skip(f"the machine gave the uncapped phase only {fast_cpu:.2f} of a core: too loaded to see a "
                    f"third-of-a-core cap in the rates ({rates})")
    assert slow_rate / fast_rate < 0.6, rates


@needs_cgroups
def test_a_group_left_with_a_live_process_is_still_removed(tmp_path):
    path = create_group(f"hrlplan-test-live-{os.getpid()}", 0.5)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (path / "cgroup.procs").write_text(str(sleeper.pid))
        from hrlplan.launch.cpu_quota import remove_group
        remove_group(path)
        assert not path.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@needs_cgroups
def test_workers_join_the_cgroup_the_launcher_lists_for_their_local_rank():
    """The wiring: capped_workers around the launch, join_from_environment first in each worker."""
    code = "from hrlplan.launch.cpu_quota import join_from_environment; print(join_from_environment())"
    with capped_workers(None, 2) as nothing:
        assert nothing == {}
    with capped_workers([None, 0.5], 2, tag="test-env") as env:
        seen = []
        for local_rank in (0, 1):
            out = subprocess.run([sys.executable, "-c", code + "; print(open('/proc/self/cgroup').read())"],
                                 capture_output=True, text=True, check=True, timeout=60,
                                 env=dict(os.environ, **env, LOCAL_RANK=str(local_rank)))
            seen.append(out.stdout)
        capped = env[ENV].split(",")[1]
        assert seen[0].startswith("None") and f"cpu:/{os.path.basename(capped)}" in seen[1]
    assert not os.path.exists(capped)
    with pytest.raises(UserError, match="2 entries for 3 local workers"):
        with capped_workers([1.0, 0.5], 3):
            pass
    assert join_from_environment({}) is None


def test_the_probe_reads_its_own_cpu_quota(tmp_path):
    """A capped worker's probe measures over several CFS periods (cluster._measure_device): it finds
    the quota of its own cgroup, and none where the group has no limit or cgroups are not there."""
    from hrlplan.cluster import cpu_device_name, cpu_quota, cpu_quota_period

    group = tmp_path / "cpu" / "hrlplan-x" / "w1"
    group.mkdir(parents=True)
    (group / "cpu.cfs_period_us").write_text("100000\n")
    (group / "cpu.cfs_quota_us").write_text("33000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:memory:/\n4:cpu,cpuacct:/hrlplan-x/w1\n")
    assert cpu_quota_period(str(proc), str(tmp_path / "cpu")) == 0.1
    # calibration fits compute per device name: a capped worker is not an uncapped one's equal
    assert cpu_device_name(cpu_quota(str(proc), str(tmp_path / "cpu"))) == "cpu@0.33"
    assert cpu_device_name(None) == "cpu"
    (group / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota_period(str(proc), str(tmp_path / "cpu")) is None
    assert cpu_quota_period(str(tmp_path / "missing"), str(tmp_path / "cpu")) is None
