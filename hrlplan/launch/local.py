"""Start N worker processes on this machine with torch's elastic launcher (what `torchrun --standalone` uses).

Used when pretrain.py (or `hrlplan probe-cluster`) runs as a plain process: it becomes the elastic
agent, and each worker gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as under torchrun.

Failures end the whole job quickly and are told once: the agent watches the workers every 0.1 s,
and the moment one dies (an exception, kill -9, out of memory) it stops the others (SIGTERM, then
SIGKILL after SHUTDOWN_TIMEOUT_S). Rank 0 keeps the console (its progress bar needs the terminal);
the other ranks write to <run_dir>/logs/, so one rank's failure is not followed by every other
rank's "connection closed" traceback. The launcher names the rank that failed first and its first
error line, preferring a root cause over the communication errors it caused on other ranks.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from hrlplan.errors import UserError, one_line

SHUTDOWN_TIMEOUT_S = 15   # SIGTERM -> SIGKILL for the surviving workers: well inside a minute
RDZV_TIMEOUT_S = 60       # local workers rendezvous in seconds; a minute means something is wrong
# A rank whose message is one of these lost its peer: the consequence, not the cause.
_CASCADE = re.compile(r"connection (closed|reset)|broken pipe|peer|DistBackendError|NCCL communicator was aborted|"
                      r"gloo.*(read|write|recv|send)|timed? ?out|ProcessGroup.*(abort|destroy)", re.I)
_ERROR_LINE = re.compile(r"^(hrlplan: error: .*|[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:.*)$")


def is_peer_loss(error: BaseException | str) -> bool:
    """An error that only says another rank went away (gloo/NCCL "connection closed", a collective
    timeout): under the local launcher, which names the rank that failed first, a worker need not
    print its traceback for it."""
    return bool(_CASCADE.search(str(error).splitlines()[0] if str(error) else ""))


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


def _recorded(entrypoint: Callable[..., Any], *args: Any) -> Any:
    """Run entrypoint with torch's error recording: an exception's text reaches the agent (a
    module-level function, so the spawn start method can pickle it)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(entrypoint)(*args)


def _log_dir(args: tuple, log_dir: Optional[str]) -> str:
    if log_dir:
        return str(log_dir)
    first = args[0] if args else None
    if isinstance(first, dict) and first.get("run_dir"):
        return str(Path(first["run_dir"]) / "logs")   # a job's config: keep its workers' logs with the run
    return tempfile.mkdtemp(prefix="hrlplan-workers-")


def launch_workers(entrypoint: Callable[..., Any], args: tuple, nproc: int, name: str = "hrlplan",
                   log_dir: Optional[str] = None) -> Dict[int, Any]:
    """Run entrypoint(*args) in nproc local workers; returns {rank: return value}.

    A worker that dies (or raises) stops the others; the failure is reported as one UserError that
    names the rank, how it ended and its first error line, with where its full output is."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cores = len(os.sched_getaffinity(0))
    # As torchrun does: without this, N workers x all-core thread pools oversubscribe the CPU.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // max(nproc, 1)))
    logs = _log_dir(args, log_dir)
    Path(logs).mkdir(parents=True, exist_ok=True)
    quiet = {r: Std.ALL for r in range(1, nproc)}   # rank 0 keeps the terminal
    run_id = f"{name}-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": RDZV_TIMEOUT_S},
        max_restarts=0, monitor_interval=0.1, start_method="spawn", shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=quiet, tee={}))
    # Workers report their own failures; the agent's copies of the same traceback would bury them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    try:
        with _environment(OMP_NUM_THREADS=threads, HRLPLAN_LOCAL_AGENT="1"):  # the workers inherit these
            results = elastic_launch(config, _recorded)(entrypoint, *args)
    except ChildFailedError as e:
        rank, how, line, where = describe_failure(e.failures, lambda r: _stderr_file(logs, run_id, r))
        raise UserError(f"worker rank {rank} {how}" + (f": {line}" if line else "") +
                        f"; the other workers were stopped{where}. Fix the cause and re-run "
                        "(train.resume=auto continues from the last checkpoint)") from None
    return results


def _message(failure: Any) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    msg = str(msg or "")
    return "" if msg.startswith("To enable traceback") or "received by PID" in msg else msg


def _first_error_line(failure: Any, stderr: Optional[Path]) -> str:
    """The failure's own message, else the last error-looking line of its captured stderr."""
    msg = _message(failure)
    if msg.strip():
        return one_line(msg.strip().splitlines()[0], 300)
    if stderr is not None:
        lines = [ln.strip() for ln in stderr.read_text(errors="replace").splitlines() if _ERROR_LINE.match(ln.strip())]
        user = [ln for ln in lines if ln.startswith("hrlplan: error:")]
        if user or lines:
            return one_line((user or lines)[-1].removeprefix("hrlplan: error: "), 300)
    return ""


def _stderr_file(logs: str, run_id: str, rank: int) -> Optional[Path]:
    """A redirected worker's stderr: <logs>/<run_id>_<random>/attempt_0/<rank>/stderr.log."""
    found = sorted(Path(logs).glob(f"{run_id}_*/attempt_*/{rank}/stderr.log"))
    return found[-1] if found else None


def describe_failure(failures: Dict[int, Any], stderr_of: Callable[[int], Optional[Path]] = lambda r: None
                     ) -> Tuple[int, str, str, str]:
    """(rank, how it ended, its first error line, where its output is) of the root-cause failure:
    a rank that died on its own comes before ranks that lost their connection to it, then the
    earliest, then the lowest rank."""
    lines = {rank: _first_error_line(f, stderr_of(rank)) for rank, f in failures.items()}

    def key(item):
        rank, f = item
        cascade = f.exitcode >= 0 and (not lines[rank] or bool(_CASCADE.search(lines[rank])))
        return (cascade, f.timestamp, rank)

    rank, failure = min(failures.items(), key=key)
    if failure.exitcode < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    stderr = stderr_of(rank)
    where = f" (its output: {stderr})" if stderr is not None else " (its output is above)"
    return rank, how, lines[rank], where
