"""StepRecorder on CUDA records events instead of a synchronize per op (a faked torch.cuda), and the
memory figures a CUDA rank reports."""
import itertools

import pytest
import torch

from hrlplan.runtime import timing


class FakeEvent:
    clock = itertools.count()

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = next(FakeEvent.clock) * 1.0   # ms on the GPU's clock

    def synchronize(self):
        assert self.t is not None

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.fixture
def fake_cuda(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a))
    return syncs


def test_cuda_ops_record_events_without_synchronizing(fake_cuda):
    rec = timing.StepRecorder(torch.device("cuda", 0))
    rec.begin()
    for j in range(3):
        with rec.op(0, j, "F"):
            pass
    with rec.op(0, 0, "B"):
        pass
    assert fake_cuda == []            # no synchronize inside the step
    events = rec.events               # read after the step: resolved from the events
    assert [(e["microbatch"], e["kind"]) for e in events] == [(0, "F"), (1, "F"), (2, "F"), (0, "B")]
    assert all(e["end_s"] > e["start_s"] >= 0 for e in events)
    assert events[0]["end_s"] - events[0]["start_s"] == pytest.approx(1e-3)
    starts = [e["start_s"] for e in events]
    assert starts == sorted(starts)
    assert rec.compute_by_stage() == {0: pytest.approx(4e-3)}
    kept = list(rec.events)
    rec.begin()
    assert rec.events == []
    rec.events = kept
    assert rec.events == kept


def test_cpu_recorder_unchanged():
    rec = timing.StepRecorder(torch.device("cpu"))
    rec.begin()
    with rec.op(1, 0, "F"):
        sum(range(1000))
    (e,) = rec.events
    assert e["stage"] == 1 and e["end_s"] >= e["start_s"] >= 0


def test_memory_stats_and_reset(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 << 30)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    dev = torch.device("cuda", 0)
    assert timing.memory_stats(dev) == {"max_memory_allocated": 3 << 30, "max_memory_reserved": 4 << 30}
    timing.reset_peak_memory(dev)
    assert calls == ["sync", "empty", "reset"]
    assert set(timing.memory_stats(torch.device("cpu"))) == {"peak_rss"}
