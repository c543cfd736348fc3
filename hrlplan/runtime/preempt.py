"""A stop flag for preemption and timeouts, checked by the trainers at step boundaries.

The contract (every trainer loop follows it):
- A signal handler (hrlplan/launch/slurm.py installs one for SLURM's USR2 inside a submitit task) or a
  submitit `checkpoint()` hook only calls `request_stop()`: a handler runs in the middle of
  whatever the main thread was doing (a collective, a backward pass), where nothing can be saved.
- At each step boundary every rank calls `stop_agreed()`. It is a collective (one all_reduce of
  one number), so all ranks see the same answer even if the signal reached only some of them.
- When it says True, all ranks write a checkpoint together (an atomic one: see checkpoint.py)
  and the loop ends; the trainer returns its summary with `preempted: True` (or raises
  `Preempted`), and the launcher requeues the job, which resumes from that checkpoint.

hrlplan's library code imports this module, never launch/: the flag lives here.

A test sync point lives here too, because every trainer calls `stop_agreed()` at every step boundary:
with HRLPLAN_TEST_HOLD_AT_STEP=N and HRLPLAN_TEST_HOLD_FILE=<path> set, every rank waits at the N-th
step boundary of its process (after that step's metrics line and periodic checkpoint, before the stop
vote) until <path> exists. A test waits for the job to get there, sends its signal or kills a rank,
and releases it, so nothing depends on which process is faster (see `hold_at_boundary`).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

_STOP = threading.Event()
_REASON: list = [None]
HOLD_AT_STEP_ENV = "HRLPLAN_TEST_HOLD_AT_STEP"
HOLD_FILE_ENV = "HRLPLAN_TEST_HOLD_FILE"
HOLD_TIMEOUT_ENV = "HRLPLAN_TEST_HOLD_TIMEOUT_S"
HOLD_POLL_S = 0.02
_BOUNDARIES = [0]   # step boundaries this process has passed (stop_agreed calls)


class Preempted(Exception):
    """Raised (instead of returning) by a trainer that stopped for a preemption, after its checkpoint."""

    def __init__(self, step: int, checkpoint: Optional[str] = None):
        super().__init__(f"stopped at step {step} for preemption/timeout; checkpoint {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint


def request_stop(reason: str = "preempted") -> None:
    """Ask the training loop to checkpoint and stop at the next step boundary (signal-safe)."""
    _REASON[0] = _REASON[0] or reason
    _STOP.set()


def stop_requested() -> bool:
    """This process's own flag (no communication)."""
    return _STOP.is_set()


def stop_reason() -> Optional[str]:
    return _REASON[0]


def clear() -> None:
    _STOP.clear()
    _REASON[0] = None


def stop_agreed(device=None, group=None) -> bool:
    """Collective: True on every rank when any rank's flag is set. Call on all ranks at the same
    step boundary. Without an initialised process group it is the local flag."""
    _BOUNDARIES[0] += 1
    if os.environ.get(HOLD_AT_STEP_ENV):   # tests only; one dict lookup per step otherwise
        hold_at_boundary(_BOUNDARIES[0])
    if not (dist.is_available() and dist.is_initialized()):
        return stop_requested()
    flag = torch.tensor([1.0 if stop_requested() else 0.0], device=device or "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() > 0:
        request_stop(_REASON[0] or "another rank was signalled")
        return True
    return False


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def hold_at_boundary(boundary: int) -> None:
    """The test sync point (module docstring): at boundary HRLPLAN_TEST_HOLD_AT_STEP of this process,
    write <file>.held.<rank> (host and pid inside) and wait until <file> exists; a stop request seen
    while waiting writes <file>.stopping.<rank>, so the test knows its signal arrived before it
    releases. Every rank counts the same boundaries (stop_agreed is collective), so all wait at the
    same step and the stop vote that follows sees every signal sent during the hold. The release is
    the file's existence: a job resumed with the same environment passes the hold at once. Raises
    after HRLPLAN_TEST_HOLD_TIMEOUT_S (600) without a release: a test that died must not leave a job
    waiting for ever."""
    try:
        at = int(os.environ[HOLD_AT_STEP_ENV])
    except ValueError:
        raise ValueError(f"{HOLD_AT_STEP_ENV}={os.environ[HOLD_AT_STEP_ENV]!r} is not a step number") from None
    release = os.environ.get(HOLD_FILE_ENV)
    if not release:
        raise ValueError(f"{HOLD_AT_STEP_ENV} is set but {HOLD_FILE_ENV} (the file that releases the hold) is not")
    if boundary != at:
        return
    release_path = Path(release)
    if release_path.exists():
        return
    rank = _rank()
    _write_marker(release_path, "held", rank, f"{socket.gethostname()} {os.getpid()}")
    stopping_told = False
    deadline = time.monotonic() + float(os.environ.get(HOLD_TIMEOUT_ENV, "600"))
    while not release_path.exists():
        if stop_requested() and not stopping_told:
            _write_marker(release_path, "stopping", rank, str(stop_reason()))
            stopping_told = True
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} held at step boundary {at}: {release} was not created in time")
        time.sleep(HOLD_POLL_S)


def _write_marker(release: Path, kind: str, rank: int, text: str) -> None:
    """<release>.<kind>.<rank>, whole when it appears (the test reads it as soon as it exists)."""
    partial = release.with_name(f".{release.name}.{kind}.{rank}.partial")
    partial.write_text(text + "\n")
    os.replace(partial, release.with_name(f"{release.name}.{kind}.{rank}"))
