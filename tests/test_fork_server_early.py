"""hrlplan/launch/fork_server.py: the fork server started before torch is imported, only where the
command will start local workers itself, and the launch then forks its workers from that server."""
import sys
import textwrap

import pytest

from _runs import run_to_files
from hrlplan.launch.fork_server import RANK_OR_TASK, starts_local_workers


@pytest.fixture
def plain_process(monkeypatch):
    for key in (*RANK_OR_TASK, "HRLPLAN_WORKER_START"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_only_a_command_that_starts_its_own_workers_starts_the_server_early(plain_process):
    assert starts_local_workers({"probe": True, "spec_file": None})
    assert not starts_local_workers({"probe": False})                               # a preset
    assert not starts_local_workers({"probe": True, "spec_file": "cluster.json"})   # a probed file
    for key, value in [("RANK", "0"), ("SUBMITIT_EXECUTOR", "slurm"), ("SLURM_STEP_ID", "0"),
                       ("HRLPLAN_WORKER_START", "spawn")]:
        with plain_process.context() as env:
            env.setenv(key, value)
            assert not starts_local_workers({"probe": True}), key


def test_the_early_server_imports_nothing_here_and_serves_the_launch(tmp_path, plain_process):
    code = textwrap.dedent(f"""
        import os, sys
        from multiprocessing import forkserver
        from hrlplan.launch.fork_server import start_early
        assert start_early({{"probe": True}})
        server = forkserver._forkserver._forkserver_pid
        assert server is not None and "torch" not in sys.modules
        from hrlplan.launch.local import launch_workers
        pids = launch_workers(os.getpid, (), 2, log_dir={str(tmp_path)!r})
        assert forkserver._forkserver._forkserver_pid == server
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values(), pids
        print("ok")
    """)
    done = run_to_files([sys.executable, "-c", code], timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
