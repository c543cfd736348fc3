"""Start N worker processes on this machine with torch's elastic launcher (what `torchrun --standalone` uses).

Used when pretrain.py (or `hrlplan probe-cluster`) runs as a plain process: it becomes the elastic
agent, and each worker gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as under torchrun.
"""
from __future__ import annotations

import logging
import os
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator

from hrlplan.errors import UserError


def in_distributed_job() -> bool:
    """True under torchrun (or any launcher that set the torch.distributed env variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set variables for the workers to inherit, and give this process its own back afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_workers(entrypoint: Callable[..., Any], args: tuple, nproc: int, name: str = "hrlplan") -> Dict[int, Any]:
    """Run entrypoint(*args) in nproc local workers; returns {rank: return value}.

    A worker that dies (or raises) stops the others; the failure is reported as one UserError that
    names the rank and its exit code, with the worker's own message when it left one.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cores = len(os.sched_getaffinity(0))
    # As torchrun does: without this, N workers x all-core thread pools oversubscribe the CPU.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // max(nproc, 1)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn")
    # Workers report their own failures (once, from the failing rank); the agent's copies of the
    # same traceback would only bury that message.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    try:
        with _environment(OMP_NUM_THREADS=threads, HRLPLAN_LOCAL_AGENT="1"):  # the workers inherit these
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        msg = failure.message if isinstance(failure.message, str) else str(failure.message)
        reason = "was killed by a signal" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        hint = ""
        if isinstance(failure.message, dict):
            hint = failure.message.get("message", "")
        elif msg and msg != "<N/A>":
            hint = msg.strip().splitlines()[-1] if msg.strip() else ""
        raise UserError(f"worker rank {rank} {reason}" + (f": {hint}" if hint else "") +
                        "; the other workers were stopped. Its output is above; fix the cause and re-run "
                        "(train.resume=auto continues from the last checkpoint)") from None
