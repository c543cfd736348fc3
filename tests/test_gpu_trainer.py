"""The trainer's CUDA paths on CPU: the device under per-task GPU binding, AdamW's implementation,
per-rank memory figures."""
import torch

from hrlplan.runtime import trainer
from hrlplan.runtime.train_core import pick_device


def test_pick_device_under_per_task_binding(monkeypatch):
    """LOCAL_RANK 3 with one visible GPU: cuda:0 (LOCAL_RANK as the ordinal was 'invalid device ordinal')."""
    current = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    assert pick_device("auto") == torch.device("cuda", 0)
    assert pick_device("cuda", 3) == torch.device("cuda", 0)
    assert current == [torch.device("cuda", 0)] * 2
    assert pick_device("cpu", 3) == torch.device("cpu")


def test_make_optimizer_flags(monkeypatch):
    seen = {}

    class Spy(torch.optim.AdamW):
        def __init__(self, params, **kw):
            seen.update(kw)
            super().__init__(params, **{k: v for k, v in kw.items() if k not in ("fused", "foreach")})

    monkeypatch.setattr(torch.optim, "AdamW", Spy)
    train = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1}
    trainer.make_optimizer(torch.nn.Linear(2, 2), train)
    assert seen["foreach"] is False and "fused" not in seen
    monkeypatch.setattr(trainer.devices, "optimizer_impl",
                        lambda device, dtensor=False: {"fused": True} if device.type == "meta" else {})
    seen.clear()
    trainer.make_optimizer(torch.nn.Linear(2, 2, device="meta"), train)
    assert seen["fused"] is True   # the parameters' device decides


def test_memory_metrics_per_rank():
    gib = 2**30
    m = trainer.memory_metrics([{"max_memory_allocated": 2 * gib, "max_memory_reserved": 3 * gib},
                                {"max_memory_allocated": gib, "max_memory_reserved": gib}])
    assert m == {"memory/rank0/max_memory_allocated_gib": 2.0, "memory/rank0/max_memory_reserved_gib": 3.0,
                 "memory/rank1/max_memory_allocated_gib": 1.0, "memory/rank1/max_memory_reserved_gib": 1.0}
    assert trainer.memory_metrics([{"peak_rss": 5}]) == {}
