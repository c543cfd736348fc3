"""Ranks of a worker: its device and process groups, the ranks a plan trains on (idle ones leave
the job), and the object broadcast rank 0 plans through."""
from __future__ import annotations

import os
from typing import Any, List, Optional

import torch.distributed as dist

from hrlplan.config import TrainConfig
from hrlplan.devices import choose_device
from hrlplan.errors import UserError
from hrlplan.runtime import distributed
from hrlplan.runtime.host import prepare_worker
from hrlplan.search.placement import compact


def init_worker(train: TrainConfig):
    """This rank's device (the helper that reads LOCAL_RANK, CUDA_VISIBLE_DEVICES and the GPUs
    visible), set before the process group; object collectives go on a long-timeout gloo group."""
    device = distributed.init_distributed(str(train.device), train).device
    prepare_worker()
    return device


def train_ranks(plan) -> List[int]:
    """The job ranks that train the plan (all but its unused_ranks)."""
    idle = set(plan.unused_ranks)
    return [r for r in range(plan.world_size) if r not in idle]


def leave_idle_ranks(plan, setting: str = "auto", train: Optional[TrainConfig] = None):
    """Ranks a plan leaves idle drop out of the job: the used ones form a process group of their
    own over the job's store (rank 0 serves it and always trains) and train the plan renumbered
    0..k-1; an idle rank returns None. Both plan forms (search.placement.compact)."""
    trained, used = compact(plan)
    if len(used) == plan.world_size:
        return plan
    if 0 not in used:
        raise UserError(f"the plan leaves rank 0 idle (unused_ranks {plan.unused_ranks}); rank 0 hosts the job's "
                        "rendezvous, so list the highest ranks as unused instead")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()   # no public accessor; kept alive by this reference
    distributed.shutdown()
    if rank not in used:
        return None
    new_rank = used.index(rank)
    choice = choose_device(setting)
    dist.init_process_group(**distributed.init_kwargs(choice, distributed.timeouts(train)),
                            store=dist.PrefixStore("hrlplan-used-ranks", store), rank=new_rank, world_size=len(used))
    os.environ.update(RANK=str(new_rank), WORLD_SIZE=str(len(used)))
    distributed.init_distributed(setting, train)   # the object-collective group of the new world
    return trained


def broadcast(obj: Any) -> Any:
    return distributed.broadcast_object(obj)


