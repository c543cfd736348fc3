"""A worker under a CPU quota (cluster.cpu_shares, a device named cpu@<share>) in the cost model: it
computes at full speed in bursts, and a step lasts at least its CPU work over its share of a core
(simulator: cpu_quota_bounds)."""
import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo, cpu_device_name, cpu_quota_share
from hrlplan.cost.model import Layout
from hrlplan.cost.simulator import Simulator
from hrlplan.model_meta import introspect, resolve_arch


def _cluster(names):
    devs = [DeviceInfo(rank=i, node=0, local_rank=i, hostname="n0", kind="cpu", name=n, memory_bytes=64 * 2 ** 30,
                       peak_flops=1e11, peak_dtype="fp32") for i, n in enumerate(names)]
    # one speed for every name: calibration times a capped block in CPU time, its speed in a burst
    cal = {"compute_efficiency": {n: 0.5 for n in names}, "peak_flops": {n: 1e11 for n in names},
           "half_saturation_tokens": {n: 8.0 for n in names}}
    return ClusterSpec(name="t", devices=devs, backend="gloo", source="probe", intra_node_bw=[1e10], calibration=cal)


def _pp2(first_blocks, m=4):
    return Layout(spans=((0, first_blocks), (first_blocks, 6)), groups=((0,), (1,)), tp=1, dp=1,
                  microbatch_size=1, num_microbatches=m, schedule="1f1b")


def test_the_share_is_read_from_the_name_the_probe_gives():
    assert cpu_quota_share(cpu_device_name((0.1, 1 / 3))) == pytest.approx(0.33)
    assert cpu_quota_share(cpu_device_name(None)) is None
    assert cpu_quota_share("NVIDIA H100 80GB HBM3") is None


def test_a_capped_stage_that_computes_under_its_share_costs_what_an_uncapped_one_does():
    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    free, capped = Simulator(meta, _cluster(["cpu", "cpu"])), Simulator(meta, _cluster(["cpu", "cpu@0.9"]))
    light = _pp2(5)   # the capped rank holds one block of six: idle most of the step
    assert capped.evaluate(light).step_time_s == pytest.approx(free.evaluate(light).step_time_s)


def test_a_capped_stage_busier_than_its_share_bounds_the_step_by_its_work_over_the_share():
    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    free = Simulator(meta, _cluster(["cpu", "cpu"]))
    capped = Simulator(meta, _cluster(["cpu", "cpu@0.25"]))
    heavy = _pp2(1)   # the capped rank holds five blocks of six and the head
    base = free.evaluate(heavy, detail=True)
    bounded = capped.evaluate(heavy, detail=True)
    work = 4 * (base.stages[1]["fwd_s"] + base.stages[1]["bwd_s"])   # its forwards and backwards alone
    assert bounded.step_time_s > base.step_time_s
    assert bounded.step_time_s >= work / 0.25
