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
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

_STOP = threading.Event()
_REASON: list = [None]


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
    if not (dist.is_available() and dist.is_initialized()):
        return stop_requested()
    flag = torch.tensor([1.0 if stop_requested() else 0.0], device=device or "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() > 0:
        request_stop(_REASON[0] or "another rank was signalled")
        return True
    return False
