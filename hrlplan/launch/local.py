"""Start N worker processes on this machine with torch's elastic launcher (what `torchrun --standalone` uses).

Used when pretrain.py (or `hrlplan probe-cluster`) runs as a plain process: it becomes the elastic
agent, and each worker gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as under torchrun.

Failures end the whole job quickly and are told once: the agent watches the workers every 0.1 s,
and the moment one dies (an exception, kill -9, out of memory) it stops the others (SIGTERM, then
SIGKILL after SHUTDOWN_TIMEOUT_S; a job's workers take SIGTERM as a stop request, but the survivors
of a dead peer end on their first collective with it, "connection closed"). Rank 0 keeps the console (its progress bar needs the terminal);
the other ranks write to <run_dir>/logs/, so one rank's failure is not followed by every other
rank's "connection closed" traceback. The launcher names the rank that failed first and its first
error line, preferring a root cause over the communication errors it caused on other ranks.

Workers start from a fork server (`WorkerStart`): a clean process, started by exec like a spawned
worker before anything here ran an OpenMP region or touched CUDA, that imports torch and hrlplan once
and forks each worker from there; a spawned worker would import them itself (about 5 s each here).
A forked worker would inherit the server's environment, so each one first takes this process's
environment as it is at the launch (with torch's per-worker variables on top); its signal handlers
are a fresh interpreter's, as under spawn. HRLPLAN_WORKER_START=spawn goes back to plain spawn.

Ctrl-C (SIGINT) or SIGTERM to this process is a request to stop, not a failure (`StopForwarder`):
the first one is passed on to the workers, whose handler (hrlplan/launch/job.py) only raises
hrlplan.runtime.preempt's stop flag, so they checkpoint together at the next step boundary and
return; the launch then raises `Interrupted` (exit status 128 + the signal's number, as a shell
reports a process killed by it: 130 for Ctrl-C, 143 for SIGTERM). Workers that have not stopped
STOP_TIMEOUT_S later are killed, and a second Ctrl-C (or SIGTERM) kills them at once.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hrlplan.errors import UserError, one_line
from hrlplan.launch.cpu_quota import capped_workers, join_from_environment

# This process's variables when the module was imported: in a fork server's worker, those of the server
# (it imports this module first); whatever differs in the worker, torch's launcher set for that worker.
_ENV_AT_IMPORT = dict(os.environ)


def _file_identity(fd: int) -> Optional[Tuple[int, int]]:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# Likewise the standard output and error a worker inherited (from the server, in a fork server's worker).
_STD_AT_IMPORT = {fd: _file_identity(fd) for fd in (1, 2)}

SHUTDOWN_TIMEOUT_S = 15   # SIGTERM -> SIGKILL for the surviving workers: well inside a minute
RDZV_TIMEOUT_S = 60       # local workers rendezvous in seconds; a minute means something is wrong
STOP_TIMEOUT_S = 60       # Ctrl-C/SIGTERM: how long the workers get to checkpoint and exit before SIGKILL
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TORCH_SIGNALS = "SIGHUP,SIGQUIT"   # torch's agent stops the workers on these; the STOP_SIGNALS are ours
# A rank whose message is one of these lost its peer: the consequence, not the cause.
_CASCADE = re.compile(r"connection (closed|reset)|broken pipe|peer|DistBackendError|NCCL communicator was aborted|"
                      r"gloo.*(read|write|recv|send)|timed? ?out|ProcessGroup.*(abort|destroy)", re.I)
_ERROR_LINE = re.compile(r"^(hrlplan: error: .*|[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:.*)$")


class Interrupted(UserError):
    """The launch stopped on a signal to this process (Ctrl-C, SIGTERM). `results`: the workers' return
    values when they stopped by themselves (after their checkpoint), else None (they were killed)."""

    def __init__(self, signum: int, results: Optional[Dict[int, Any]], how: str, message: Optional[str] = None):
        self.signum, self.results, self.how = int(signum), results, how
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)
        super().__init__(message or f"stopped by {self.signal_name}: {how}")


class StopForwarder:
    """While workers run: this process's SIGINT/SIGTERM handler. The first signal is passed on to the
    workers (again to any started later), a timer kills them STOP_TIMEOUT_S later; a second signal
    kills them now. torch's elastic agent would otherwise stop them itself (the same signal, then
    SIGKILL after its shutdown timeout, meant for a failure) and lose their return values."""

    def __init__(self, timeout_s: Optional[float] = None):
        self.timeout_s = STOP_TIMEOUT_S if timeout_s is None else timeout_s
        self.signum: Optional[int] = None
        self.killed: Optional[str] = None   # why the workers were killed, when they were
        self._signalled: set = set()
        self._done = threading.Event()
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "StopForwarder":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _send(self, sig: int) -> None:
        for proc in _started_workers():
            if sig == signal.SIGKILL or proc.pid not in self._signalled:
                self._signalled.add(proc.pid)
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self.killed = f"a second {name} killed the workers before they could checkpoint"
            _say(f"[hrlplan] {name} again: killing the workers now")
            self._send(signal.SIGKILL)
            return
        self.signum = signum
        _say(f"[hrlplan] {name}: the workers checkpoint at the end of this step and stop (at most "
             f"{self.timeout_s:.0f} s; {name} again to kill them now)")
        self._send(signum)
        threading.Thread(target=self._watch, args=(signum,), name="hrlplan-stop", daemon=True).start()

    def _watch(self, signum: int) -> None:
        """Pass the signal on to workers started after it; SIGKILL them all at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        while not self._done.wait(0.5):
            if time.monotonic() >= deadline:
                if _started_workers():
                    self.killed = f"the workers had not stopped {self.timeout_s:.0f} s later and were killed"
                    self._send(signal.SIGKILL)
                return
            self._send(signum)


def _started_workers() -> list:
    """This process's started multiprocessing children not known to have ended, read without polling
    them: multiprocessing.active_children() reaps, racing torch's own join of the same processes (and
    from a fork server, two readers of one exit status leave one of them without it)."""
    while True:
        try:
            children = list(multiprocessing.process._children)
            break
        except RuntimeError:   # the set changed while copied
            continue
    return [p for p in children if p.pid and p._popen is not None and p._popen.returncode is None]


class WorkerExits:
    """Every worker's exit status, for naming the rank that failed first. torch's launcher reports
    only the first failed worker it notices; when two end close together (a fork server reaps exits
    in batches; a busy machine delays the agent's poll), that may be a rank that only lost its peer.
    A thread keeps each started worker process; each worker writes its pid to <folder>/rank<N>."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.seen: Dict[int, Any] = {}
        self._done = threading.Event()

    def __enter__(self) -> "WorkerExits":
        self.folder.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._watch, name="hrlplan-workers", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()

    def _watch(self) -> None:
        while True:
            for proc in _started_workers():
                self.seen[proc.pid] = proc
            if self._done.wait(0.05):
                return

    def failures(self, error_file_of: Callable[[int], Optional[Path]], after: float) -> Dict[int, ProcessFailure]:
        """{rank: ProcessFailure} of the workers that ended badly; those with no error file of their
        own (killed by a signal) are dated `after` (torch's first failure wins a tie)."""
        found = {}
        for marker in self.folder.glob("rank*"):
            rank, pid = int(marker.name[4:]), int(marker.read_text())
            try:
                code = self.seen[pid].exitcode if pid in self.seen else None
            except ValueError:   # a closed process object
                code = None
            if code:
                error_file = error_file_of(rank)
                failure = ProcessFailure(local_rank=rank, pid=pid, exitcode=code,
                                         error_file=str(error_file) if error_file else str(marker) + ".none")
                if error_file is None:
                    failure.timestamp = int(after)
                found[rank] = failure
        return found


def _say(line: str) -> None:
    """A line on stderr from a signal handler (print could re-enter a buffered stream mid-write)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError):
        pass


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


def _recorded(launch_env: Dict[str, str], launcher: Tuple[int, Dict[int, Any]], pids: str,
              entrypoint: Callable[..., Any], *args: Any) -> Any:
    """In a worker: take the launching process's environment and console, name its pid
    (WorkerExits), then run entrypoint with torch's error recording, so an exception's text reaches
    the agent (a module-level function: it is pickled)."""
    _adopt_environment(launch_env)
    join_from_environment()   # cluster.cpu_shares: before this worker computes anything
    _adopt_console(*launcher)
    (Path(pids) / f"rank{os.environ['LOCAL_RANK']}").write_text(str(os.getpid()))
    return record(entrypoint)(*args)


def _adopt_environment(launch_env: Dict[str, str]) -> None:
    """Make this worker's os.environ the launcher's at launch time plus the variables torch's
    launcher set for this worker (RANK, MASTER_PORT, ...: those that differ from the environment
    this module was imported under). Under spawn it changes nothing; forked from the server it
    replaces the server's (older) environment."""
    per_worker = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    for key in set(os.environ) - set(launch_env) - set(per_worker):
        del os.environ[key]
    os.environ.update(launch_env)
    os.environ.update(per_worker)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:   # OpenMP read the server's value when torch loaded
        torch.set_num_threads(int(threads))


def _adopt_console(launcher_pid: int, launcher_std: Dict[int, Any]) -> None:
    """A stdout/stderr torch did not redirect (rank 0's) that is still the one this worker inherited
    but no longer the launcher's (the server kept those of the first launch) is reopened from the
    launcher's (/proc/<pid>/fd/N; left as it is where that cannot be opened, e.g. a socket)."""
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        current = _file_identity(fd)
        if current != _STD_AT_IMPORT[fd] or launcher_std[fd] in (None, current):
            continue
        try:
            replacement = os.open(f"/proc/{launcher_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        stream.flush()
        os.dup2(replacement, fd)
        os.close(replacement)


class WorkerStart:
    """How workers start: "forkserver" (the default: see the module docstring) or "spawn"
    (HRLPLAN_WORKER_START=spawn, or where there is no fork server). The server lives as long as
    this process and serves every later launch of it; it preloads this module, the entrypoint's
    and the __main__ script (what a spawned worker would import), and never runs any of them."""

    ENV = "HRLPLAN_WORKER_START"
    CHOICES = ("forkserver", "spawn")

    @classmethod
    def method(cls, entrypoint: Callable[..., Any]) -> str:
        choice = os.environ.get(cls.ENV, "forkserver")
        if choice not in cls.CHOICES:
            raise UserError(f"{cls.ENV}={choice!r} is not one of {', '.join(cls.CHOICES)}; unset it for the default")
        if choice == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
            return "spawn"
        from multiprocessing import forkserver

        server = forkserver._forkserver
        if server._forkserver_pid is None:   # not started yet: choose what it preloads
            server.set_forkserver_preload(["__main__", __name__, entrypoint.__module__])
        return "forkserver"


def _log_dir(args: tuple, log_dir: Optional[str]) -> str:
    if log_dir:
        return str(log_dir)
    first = args[0] if args else None
    run_dir = first.get("run_dir") if isinstance(first, dict) else getattr(first, "run_dir", None)
    if run_dir:
        return str(Path(run_dir) / "logs")   # a job's config: keep its workers' logs with the run
    return tempfile.mkdtemp(prefix="hrlplan-workers-")


def _launch_config(**options) -> LaunchConfig:
    """torch's LaunchConfig with the options this torch knows. CUDA builds often lag the CPU one
    (torch 2.11 has no shutdown_timeout: its agent then waits its own 30 s before SIGKILL), and a
    GPU node must not fail on a refinement of the stop path."""
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(**{k: v for k, v in options.items() if k in known})


def launch_workers(entrypoint: Callable[..., Any], args: tuple, nproc: int, name: str = "hrlplan",
                   log_dir: Optional[str] = None, cpu_shares: Optional[Sequence[Optional[float]]] = None
                   ) -> Dict[int, Any]:
    """Run entrypoint(*args) in nproc local workers; returns {rank: return value}. cpu_shares caps
    each worker to a share of one core (cluster.cpu_shares; hrlplan/launch/cpu_quota.py).

    A worker that dies (or raises) stops the others; the failure is reported as one UserError that
    names the rank, how it ended and its first error line, with where its full output is. Ctrl-C or
    SIGTERM to this process stops the workers (see StopForwarder) and raises Interrupted."""
    cores = len(os.sched_getaffinity(0))
    # As torchrun does: without this, N workers x all-core thread pools oversubscribe the CPU.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // max(nproc, 1)))
    logs = _log_dir(args, log_dir)
    Path(logs).mkdir(parents=True, exist_ok=True)
    quiet = {r: Std.ALL for r in range(1, nproc)}   # rank 0 keeps the terminal
    run_id = f"{name}-{uuid.uuid4().hex[:8]}"
    config = _launch_config(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": RDZV_TIMEOUT_S},
        max_restarts=0, monitor_interval=0.1, start_method=WorkerStart.method(entrypoint),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        signals_to_handle=TORCH_SIGNALS,   # SIGINT and SIGTERM are ours (StopForwarder)
        logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=quiet, tee={}))
    # Workers report their own failures; the agent's copies of the same traceback would bury them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    # (torch's launch exports TORCHELASTIC_SIGNALS_TO_HANDLE: given back afterwards with the others)
    env = dict(OMP_NUM_THREADS=threads, HRLPLAN_LOCAL_AGENT="1", TORCHELASTIC_SIGNALS_TO_HANDLE=TORCH_SIGNALS)
    stop = StopForwarder()
    exits = WorkerExits(Path(logs) / f".{run_id}-pids")
    try:
        # the workers inherit these variables; capped ones join their cgroup first thing (_recorded)
        with capped_workers(cpu_shares, nproc, run_id) as quota_env, _environment(**env, **quota_env), stop, exits:
            launcher = (os.getpid(), {fd: _file_identity(fd) for fd in (1, 2)})
            results = elastic_launch(config, _recorded)(dict(os.environ), launcher, str(exits.folder), entrypoint, *args)
    except ChildFailedError as e:
        if stop.signum is not None:
            raise Interrupted(stop.signum, None, stop.killed or "a worker ended before it could checkpoint") from None
        first = max([f.timestamp for f in e.failures.values()], default=0) + 1
        failures = {**exits.failures(lambda r: _worker_file(logs, run_id, r, "error.json"), first), **e.failures}
        rank, how, line, where = describe_failure(failures, lambda r: _worker_file(logs, run_id, r, "stderr.log"))
        raise UserError(f"worker rank {rank} {how}" + (f": {line}" if line else "") +
                        f"; the other workers were stopped{where}. Fix the cause and re-run "
                        "(train.resume=auto continues from the last checkpoint)") from None
    finally:
        shutil.rmtree(exits.folder, ignore_errors=True)
    if stop.signum is not None:
        raise Interrupted(stop.signum, results, "the workers stopped")
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


def _worker_file(logs: str, run_id: str, rank: int, name: str) -> Optional[Path]:
    """A worker's file from torch's launcher (stderr.log when redirected, error.json after an
    exception): <logs>/<run_id>_<random>/attempt_0/<rank>/<name>."""
    found = sorted(Path(logs).glob(f"{run_id}_*/attempt_*/{rank}/{name}"))
    return found[-1] if found else None


def describe_failure(failures: Dict[int, Any], stderr_of: Callable[[int], Optional[Path]] = lambda r: None
                     ) -> Tuple[int, str, str, str]:
    """(rank, how it ended, its first error line, where its output is) of the root-cause failure:
    a rank that died on its own comes before ranks that lost their connection to it (their error
    says so, even when the launcher's SIGTERM then ended them) and before ranks the launcher
    stopped (SIGTERM), then the earliest, then the lowest rank."""
    lines = {rank: _first_error_line(f, stderr_of(rank)) for rank, f in failures.items()}

    def key(item):
        rank, f = item
        line = lines[rank]
        cascade = bool(line and _CASCADE.search(line)) or (f.exitcode >= 0 and not line)
        return (cascade, f.exitcode == -signal.SIGTERM, f.timestamp, rank)

    rank, failure = min(failures.items(), key=key)
    if failure.exitcode < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    stderr = stderr_of(rank)
    where = f" (its output: {stderr})" if stderr is not None else " (its output is above)"
    return rank, how, lines[rank], where
