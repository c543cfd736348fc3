"""planner.calibrate=true in a sweep measures once per cluster/model key: the points that follow (one
after another with Hydra's basic launcher, or started together by submitit/SLURM) plan from the
first point's measurements, and the console says "calibrating" on its own line, apart from the probe,
then each group of micro-benchmarks as it starts. A point whose calibration was unsteady (a busy
machine) caches nothing: the next point measures again."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _runs import run_to_files

ROOT = Path(__file__).resolve().parent.parent

# One job of a sweep, reduced to the cache calls rank 0 makes (hrlplan/launch/planning.py calibrated()):
# look the key up; on a miss "measure" -- until the test creates the release file, or for a time -- and store.
JOB = textwrap.dedent("""
    import json, os, sys, time
    from hrlplan.launch import plan_cache
    name, measure, release = sys.argv[1], float(sys.argv[2]), sys.argv[4]
    cal = plan_cache.load_calibration({}, "calibration-k", wait_s=60)
    if cal is None:
        print("measuring", flush=True)
        open(sys.argv[3], "w").close()   # tells the test this job holds the key
        deadline = time.time() + measure
        while time.time() < deadline and not (release and os.path.exists(release)):
            time.sleep(0.05)
        plan_cache.store_calibration({}, "calibration-k", {"by": name})
        cal = {"by": name}
    print("result", json.dumps(cal), flush=True)
""")


def _job(name, measure_s, flag, env, release=""):
    return subprocess.Popen([sys.executable, "-c", JOB, name, str(measure_s), str(flag), str(release)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(job, text, lines):
    """Collect the job's output lines until one holds `text` (an explicit sync point, not a sleep)."""
    for line in job.stdout:
        lines.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} never printed: {''.join(lines)}")


def _wait_until_measuring(job, flag):
    deadline = time.time() + 120
    while not flag.exists():
        assert job.poll() is None and time.time() < deadline, job.communicate()
        time.sleep(0.1)


def test_sweep_points_started_together_measure_once(tmp_path):
    env = dict(os.environ, HRLPLAN_CALIBRATION_CACHE=str(tmp_path / "cache"))
    release = tmp_path / "release"
    first = _job("first", 300, tmp_path / "first-measures", env, release)
    _wait_until_measuring(first, tmp_path / "first-measures")
    second = _job("second", 0, tmp_path / "second-measures", env)
    seen = []
    _read_until(second, "another job is calibrating", seen)   # the second waits on the first's key...
    release.touch()                                           # ...and only then does the first finish
    outs = [p.communicate(timeout=180) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    out1, out2 = outs[0][0], "".join(seen) + outs[1][0]
    assert "measuring" in out1 and "measuring" not in out2, outs
    assert "another job is calibrating" in out2 and 'result {"by": "first"}' in out2, outs
    assert json.loads((tmp_path / "cache" / "calibration-k" / "calibration.json").read_text()) == {"by": "first"}


def test_a_job_that_dies_while_measuring_does_not_block_the_next(tmp_path):
    env = dict(os.environ, HRLPLAN_CALIBRATION_CACHE=str(tmp_path / "cache"))
    first = _job("first", 600, tmp_path / "first-measures", env)
    _wait_until_measuring(first, tmp_path / "first-measures")
    first.kill()   # the kernel drops its lock with it
    first.communicate()
    second = _job("second", 0, tmp_path / "second-measures", env)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0 and "measuring" in out and 'result {"by": "second"}' in out, (out, err)


@pytest.mark.slow
def test_a_two_point_sweep_calibrates_once(tmp_path):
    env = dict(os.environ, HRLPLAN_CALIBRATION_CACHE=str(tmp_path / "cache"))
    env.pop("HRLPLAN_PLAN_CACHE", None)
    out = run_to_files([sys.executable, str(ROOT / "pretrain.py"), "-m", "train.lr=1e-3,2e-3", "mode=plan",
                        "planner.calibrate=true", "logger.mode=disabled", "arch.n_layer=2", "data.seq_len=32",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=env, timeout=600)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-4000:]
    assert all((tmp_path / "sweep" / str(i) / "plan.yaml").is_file() for i in (0, 1)), console[-4000:]
    calibrating = [ln for ln in console.splitlines() if ln.startswith("[hrlplan] calibrating:")]
    # the promise it keeps (the budget), not a guess; then each group of micro-benchmarks, k of n
    assert calibrating and all("at most 300 s (planner.calibrate_budget_s)" in ln and "probe" not in ln
                               for ln in calibrating), console[-4000:]
    progress = [ln for ln in console.splitlines() if ln.startswith("[hrlplan] calibration ")]
    assert [ln.split(":")[0][-3:] for ln in progress] == [f"{k}/5" for k in range(1, 6)] * len(calibrating)
    assert all(ln.endswith(" s so far)") for ln in progress), progress
    if "but unsteady" in console.split("[hrlplan] calibrating:")[1]:
        # a busy machine: the first point's calibration was not cached, the second measured again
        assert len(calibrating) == 2 and "planning from the cached calibration" not in console, console[-4000:]
        return
    assert len(calibrating) == 1, console[-4000:]
    assert console.count("[hrlplan] planning from the cached calibration") == 1, console[-4000:]
    entries = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("calibration-")]
    assert len(entries) == 1, entries
