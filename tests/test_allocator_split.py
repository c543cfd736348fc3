"""The memory split on CUDA is taken at the allocator's peak (runtime/memory.LiveStorageTracker with
allocator_peak), not the live tensors' own: the GPU run 2 peak lay 0.5 GiB above the tracker's, at
another moment. Here on the CPU, a stand-in allocator that also holds a hidden weights-sized buffer
during the optimizer step (as a foreach AdamW's temporaries would) moves the split there."""
from __future__ import annotations

import torch

from hrlplan.runtime.memory import LiveStorageTracker


def _run(allocator_hidden: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    hidden = {"now": 0}
    opt.register_step_pre_hook(lambda *a: hidden.update(now=4 * weights))
    opt.register_step_post_hook(lambda *a: hidden.update(now=0))
    top = {"max": 0}
    tracker = None

    def allocator_peak():
        top["max"] = max(top["max"], tracker.current + hidden["now"])
        return top["max"]
    tracker = LiveStorageTracker("cpu", lambda: ([model], [opt]), allocator_peak if allocator_hidden else None)
    tracker.track_tensors(list(model.parameters()))
    with tracker:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(32, 64)).sum().backward()
            opt.step()
    return tracker.result(), weights


def test_the_split_follows_the_allocators_peak():
    own, weights = _run(allocator_hidden=False)
    real, _ = _run(allocator_hidden=True)
    # the live tensors' own peak: the second step's optimizer state beside the backward's gradients
    assert own["peak"] == sum(own[k] for k in ("weights", "gradients", "optimizer", "activations", "other"))
    # the allocator's: the optimizer step with its hidden temporaries, which land in other
    assert real["peak"] > own["peak"]
    assert real["optimizer"] > 0 and real["gradients"] > 0 and real["activations"] == 0
    assert real["other"] >= 4 * weights
    assert real["peak"] == sum(real[k] for k in ("weights", "gradients", "optimizer", "activations", "other"))


def test_a_foreach_optimizer_steps_beside_one_fp32_copy_of_its_parameters():
    """cost/memory: the foreach AdamW's sqrt(exp_avg_sq) is charged at the step, beside the gradients
    (activations gone), and raises the peak only where it exceeds the backward's."""
    import numpy as np

    from hrlplan.cost import memory as cm

    params = 1e6
    assert cm.optimizer_step_bytes(params, foreach=False) == 0.0
    assert cm.optimizer_step_bytes(params, foreach=True) == 4e6
    static, grads = 20e6, 4e6     # weights, both moments, gradients: 16 B/parameter + workspace
    assert cm.position_peak_bytes(static, grads, 10e6, 1e6) == cm.position_peak_bytes(static, grads, 10e6, 1e6, 0.0, 0.0, 4e6)
    assert cm.position_peak_bytes(static, grads, 1e6, 1e6, optimizer_step=4e6) == static + 4e6
    arr = cm.position_peak_bytes(np.array([static, static]), np.array([grads, grads]), np.array([10e6, 1e6]),
                                 np.array([1e6, 1e6]), optimizer_step=np.array([4e6, 4e6]))
    assert list(arr) == [static - grads + 10e6, static + 4e6]


def test_the_meter_names_what_it_measured():
    from hrlplan.runtime.memory import MemoryMeter

    model = torch.nn.Linear(8, 8)
    meter = MemoryMeter(torch.device("cpu"), lambda: ([model], []))
    assert meter.kind() == "process peak RSS"   # nothing measured yet
    with meter.step():
        model(torch.randn(2, 8)).sum().backward()
    assert meter.kind() == "live tensor storages"
    model.compile(backend="eager")
    compiled = MemoryMeter(torch.device("cpu"), lambda: ([model], []))
    with compiled.step():
        model(torch.randn(2, 8)).sum().backward()
    assert compiled.kind().startswith("CPU allocator") and compiled.result()["peak"] > 0
