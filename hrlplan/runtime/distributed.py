"""The job's process groups: one init for every entry point (training job, probe, calibration,
`hrlplan doctor`).

On CUDA the default group is "cpu:gloo,cuda:nccl" bound to this rank's GPU (set_device first, then
init_process_group(device_id=...): NCCL then knows its device at init, and CPU tensors go to gloo).
Its timeout is the short *training* one, so a dead rank still ends the job quickly. Work that only
rank 0 does while the others wait (introspection, planning -- exact search at scale, HRL
fine-tuning --, calibration's fits) is waited for on a separate gloo group whose timeout is the long
*planning* one: object collectives go there (`broadcast_object`, `all_gather_object`), never on NCCL.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from hrlplan.config import timeout_minutes
from hrlplan.devices import DeviceChoice, activate, choose_device

CUDA_BACKEND = "cpu:gloo,cuda:nccl"

_CPU_GROUP = None


@dataclass(frozen=True)
class Timeouts:
    plan: timedelta
    train: timedelta


def timeouts(cfg: Any = None, env: Optional[Mapping[str, str]] = None) -> Timeouts:
    """train.plan_timeout_min / train.collective_timeout_min when the train config (a TrainConfig, or
    a plain mapping that may lack them) sets them, else HRLPLAN_PLAN_TIMEOUT_MIN /
    HRLPLAN_TRAIN_TIMEOUT_MIN, else 60 and 10 minutes (hrlplan.config.timeout_minutes). The planning
    one never drops below the training one."""
    minutes = timeout_minutes(cfg or {}, dict(os.environ if env is None else env))
    train = minutes["collective_timeout_min"]
    plan = max(minutes["plan_timeout_min"], train)
    return Timeouts(plan=timedelta(minutes=plan), train=timedelta(minutes=train))


def init_kwargs(choice: DeviceChoice, limits: Timeouts) -> Dict[str, Any]:
    """init_process_group's arguments for a device choice (pure: the CPU tests pin them)."""
    if choice.is_cuda:
        return {"backend": CUDA_BACKEND, "timeout": limits.train, "device_id": choice.device}
    return {"backend": "gloo", "timeout": limits.train}


def init_distributed(setting: str = "auto", cfg: Any = None) -> DeviceChoice:
    """Choose and activate this rank's device, then (unless a group exists) init the default group
    and the long-timeout gloo group for object collectives. Returns the device choice."""
    global _CPU_GROUP
    choice = activate(choose_device(setting))    # set_device before init_process_group
    limits = timeouts(cfg)
    if not dist.is_initialized():
        dist.init_process_group(**init_kwargs(choice, limits))
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=limits.plan)
    return choice


def cpu_group():
    """The long-timeout gloo group (None before init_distributed: the default group then)."""
    return _CPU_GROUP


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """rank src's object on every rank, over the gloo group (ranks may wait long for src here)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
    return box[0]


def all_gather_object(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_CPU_GROUP)
    return out


def cpu_barrier() -> None:
    dist.barrier(group=_CPU_GROUP)


def shutdown() -> None:
    """Destroy every group (the gloo one with them)."""
    global _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None


def is_nccl() -> bool:
    """The default group reaches CUDA tensors through NCCL."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend())


def local_device() -> torch.device:
    """The device this rank's collectives run on: its current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if is_nccl() else torch.device("cpu")
