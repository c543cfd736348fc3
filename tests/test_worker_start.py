"""Local workers start from a fork server (hrlplan/launch/local.py, WorkerStart) and still see what a
spawned worker would: this process's environment as it is at each launch (not the server's, which
is that of the first launch), torch's per-worker variables, the launch's thread count, a fresh
interpreter's signal handlers, rank 0 on the launcher's current standard output, no CUDA and no
OpenMP threads inherited -- even when this process
ran OpenMP regions before the launch, which makes a plain fork unsafe."""
from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from hrlplan.errors import UserError
from hrlplan.launch.local import WorkerStart, describe_failure, launch_workers


def _report(names):
    """What a worker sees."""
    return {
        "env": {name: os.environ.get(name) for name in names},
        "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
        "threads": torch.get_num_threads(),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "cuda_initialized": torch.cuda.is_initialized(),
        "os_threads": threading.active_count(),
        "parent": os.getppid(),
        "sum": float(torch.ones(1 << 20).sum()),   # an OpenMP region in the worker itself
    }


def test_workers_fork_from_a_server_and_see_each_launchs_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(WorkerStart.ENV, raising=False)
    torch.ones(1 << 22).mul(2).sum()   # this process has run OpenMP regions: a plain fork could hang
    names = ["HRLPLAN_WS_KEPT", "HRLPLAN_WS_CHANGED", "HRLPLAN_WS_DROPPED", "HRLPLAN_WS_NEW"]
    monkeypatch.setenv("HRLPLAN_WS_KEPT", "kept")
    monkeypatch.setenv("HRLPLAN_WS_CHANGED", "first")
    monkeypatch.setenv("HRLPLAN_WS_DROPPED", "there")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    first = launch_workers(_report, (names,), 2, log_dir=str(tmp_path / "first"))
    assert WorkerStart.method(_report) == "forkserver"

    monkeypatch.setenv("HRLPLAN_WS_CHANGED", "second")
    monkeypatch.delenv("HRLPLAN_WS_DROPPED")
    monkeypatch.setenv("HRLPLAN_WS_NEW", "new")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    second = launch_workers(_report, (names,), 2, log_dir=str(tmp_path / "second"))

    for results, changed, dropped, new, threads in [(first, "first", "there", None, 2), (second, "second", None, "new", 1)]:
        assert sorted(results) == [0, 1] and [results[r]["rank"] for r in (0, 1)] == [0, 1]
        for report in results.values():
            assert report["env"] == {"HRLPLAN_WS_KEPT": "kept", "HRLPLAN_WS_CHANGED": changed,
                                     "HRLPLAN_WS_DROPPED": dropped, "HRLPLAN_WS_NEW": new}
            assert report["world"] == 2 and report["threads"] == threads
            assert report["sigint"] and report["sigterm"]   # not this process's StopForwarder
            assert not report["cuda_initialized"] and report["sum"] == float(1 << 20)
            assert report["parent"] != os.getpid()           # forked by the server
    # both launches forked from the same server, a fresh interpreter: one OS thread after it
    # imported torch and hrlplan (no OpenMP pool a fork could copy half of)
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    assert {r["parent"] for r in [*first.values(), *second.values()]} == {server}
    status = open(f"/proc/{server}/status").read()
    assert next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")) == "1", status


def test_spawn_stays_available_and_a_bad_choice_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(WorkerStart.ENV, "spawn")
    monkeypatch.setenv("HRLPLAN_WS_KEPT", "spawned")
    results = launch_workers(_report, (["HRLPLAN_WS_KEPT"],), 1, log_dir=str(tmp_path))
    assert results[0]["env"] == {"HRLPLAN_WS_KEPT": "spawned"} and results[0]["parent"] == os.getpid()
    monkeypatch.setenv(WorkerStart.ENV, "fork")
    with pytest.raises(UserError, match=r"^HRLPLAN_WORKER_START='fork' is not one of forkserver, spawn; unset it"):
        launch_workers(_report, ([],), 1, log_dir=str(tmp_path))


def _say_hello(path):
    os.write(1, f"hello from rank {os.environ['RANK']}\n".encode())
    return 0


def test_rank_0_writes_to_the_launchers_current_stdout(tmp_path, monkeypatch):
    """The server keeps the stdout of the launch that started it; a later launch's rank 0 writes to
    the launcher's stdout of that moment, as a spawned worker would."""
    monkeypatch.delenv(WorkerStart.ENV, raising=False)
    launch_workers(_say_hello, (None,), 1, log_dir=str(tmp_path / "first"))   # the server exists now
    out = tmp_path / "stdout.txt"
    saved = os.dup(1)
    try:
        with open(out, "w") as f:
            os.dup2(f.fileno(), 1)
        launch_workers(_say_hello, (None,), 2, log_dir=str(tmp_path / "second"))
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert out.read_text() == "hello from rank 0\n"    # rank 1's output goes to its log


def test_a_survivor_the_launcher_stopped_is_not_named_as_the_cause():
    """A rank killed at step 3 (SIGKILL, no error file: dated when the launch noticed it) and a
    survivor that lost its peer and was then ended by the launcher's SIGTERM (its error file dated
    earlier): the killed rank is the cause, whatever the order the exits were noticed in."""
    def failure(exitcode, message, timestamp, name):
        return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp, error_file="<N/A>",
                               signal_name=lambda: name)

    failures = {0: failure(-15, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:2704", 10, "SIGTERM"),
                1: failure(-9, "Signal 9 (SIGKILL) received by PID 7", 11, "SIGKILL")}
    assert describe_failure(failures)[:2] == (1, "was killed by signal SIGKILL")
    failures[0] = failure(-15, "", 10, "SIGTERM")    # stopped by the launcher before it said anything
    assert describe_failure(failures)[:2] == (1, "was killed by signal SIGKILL")
