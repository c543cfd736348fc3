"""Process-group init: set_device before init_process_group("cpu:gloo,cuda:nccl", device_id=...) on
CUDA (a faked torch.cuda records the order), a long gloo timeout for rank-0-only planning and a short
one for training collectives; a real one-process gloo group for the object collectives."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hrlplan.devices import DeviceChoice
from hrlplan.runtime import distributed as D


def test_init_kwargs_per_device():
    limits = D.Timeouts(plan=timedelta(minutes=60), train=timedelta(minutes=10))
    cuda = D.init_kwargs(DeviceChoice(torch.device("cuda", 0), "3"), limits)
    assert cuda == {"backend": "cpu:gloo,cuda:nccl", "timeout": timedelta(minutes=10),
                    "device_id": torch.device("cuda", 0)}
    assert D.init_kwargs(DeviceChoice(torch.device("cpu")), limits) == {"backend": "gloo",
                                                                         "timeout": timedelta(minutes=10)}


def test_timeouts():
    t = D.timeouts({}, {})
    assert t.plan >= timedelta(minutes=30) and t.train <= timedelta(minutes=10)
    assert D.timeouts({}, {"HRLPLAN_PLAN_TIMEOUT_MIN": "120"}).plan == timedelta(minutes=120)
    assert D.timeouts({"plan_timeout_min": 90, "collective_timeout_min": 5}, {}) == D.Timeouts(
        timedelta(minutes=90), timedelta(minutes=5))
    # planning never waits less than a training collective
    assert D.timeouts({"plan_timeout_min": 1, "collective_timeout_min": 5}, {}).plan == timedelta(minutes=5)
    with pytest.raises(ValueError, match="plan_timeout_min"):
        D.timeouts({"plan_timeout_min": 0}, {})


def test_cuda_init_sets_device_first_and_puts_objects_on_gloo(monkeypatch):
    """Under --gpus-per-task=1 (LOCAL_RANK 3, one visible GPU): cuda:0 is made current, then the
    default group is created bound to it, then the long-timeout gloo group."""
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("HRLPLAN_PLAN_TIMEOUT_MIN", raising=False)
    monkeypatch.delenv("HRLPLAN_TRAIN_TIMEOUT_MIN", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("new_group", kw)) or "gloo-group")
    monkeypatch.setattr(D, "_CPU_GROUP", None)
    choice = D.init_distributed("auto", {"plan_timeout_min": 45})
    assert choice == DeviceChoice(torch.device("cuda", 0), "3")
    assert calls == [("set_device", torch.device("cuda", 0)),
                     ("init", {"backend": "cpu:gloo,cuda:nccl", "timeout": timedelta(minutes=10),
                               "device_id": torch.device("cuda", 0)}),
                     ("new_group", {"backend": "gloo", "timeout": timedelta(minutes=45)})]
    assert D.cpu_group() == "gloo-group"
    seen = {}
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, group: seen.update(group=group))
    D.broadcast_object({"plan": 1})
    assert seen["group"] == "gloo-group"


def test_one_process_gloo_object_collectives(monkeypatch, free_port):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(D, "_CPU_GROUP", None)
    try:
        choice = D.init_distributed("cpu")
        assert choice.device.type == "cpu" and dist.get_backend() == "gloo"
        assert D.broadcast_object({"a": 1}) == {"a": 1}
        assert D.all_gather_object(7) == [7]
        assert D.local_device().type == "cpu" and not D.is_nccl()
    finally:
        D.shutdown()
