"""Cross-replica and tied-embedding gradient sync: the simulator charges what the runtime sends,
over the links it sends it on, alike for a single template and a replica plan (issue 35)."""
import dataclasses

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.simulator import Simulator
from tests.test_cost import toy_meta

GiB = 2 ** 30


def two_node_cluster(per_node=2, intra=100e9, inter=10e9, inter_lat=5e-6) -> ClusterSpec:
    devs = [DeviceInfo(rank=i, node=i // per_node, local_rank=i % per_node, hostname=f"n{i // per_node}",
                       kind="cuda", name="g", memory_bytes=16 * GiB, peak_flops=1e12) for i in range(2 * per_node)]
    return ClusterSpec(name="two", devices=devs, backend="nccl", source="preset", intra_node_bw=[intra, intra],
                       inter_node_bw=inter, intra_node_latency=1e-6, inter_node_latency=inter_lat)


def tied(meta):
    return dataclasses.replace(meta, tied_embeddings=True)


def two_stage(groups, tp=1, dp=1):
    return Layout(spans=((0, 4), (4, 8)), groups=groups, tp=tp, dp=dp, microbatch_size=1, num_microbatches=2,
                  schedule="1f1b")


def test_uncalibrated_tied_embedding_is_charged_its_bytes_over_the_link():
    cluster = two_node_cluster()
    untied_sim = Simulator(toy_meta(), cluster, CostOptions())
    sim = Simulator(tied(toy_meta()), cluster, CostOptions())
    head_bytes = toy_meta().head_matmul_params * 4.0
    across = two_stage(((0,), (2,)))    # first and last stage on different nodes
    inside = two_stage(((0,), (1,)))    # on one node
    bw_eff = sim.devices.bw_eff
    extra_across = sim.step_collectives(across) - untied_sim.step_collectives(across)
    extra_inside = sim.step_collectives(inside) - untied_sim.step_collectives(inside)
    assert extra_across == pytest.approx(head_bytes / (10e9 * bw_eff) + 2 * 5e-6)
    assert extra_inside == pytest.approx(head_bytes / (100e9 * bw_eff) + 2 * 1e-6)
    # tp shards the head: each pair of tp ranks sums 1/tp of it, all pairs at once
    tp2 = two_stage(((0, 1), (2, 3)), tp=2)
    extra_tp = sim.step_collectives(tp2) - untied_sim.step_collectives(tp2)
    assert extra_tp == pytest.approx(head_bytes / 2 / (10e9 * bw_eff) + 2 * 5e-6)


def test_a_calibrated_tied_all_reduce_is_used_as_measured():
    cluster = two_node_cluster()
    cluster.calibration = {"tied_allreduce_s": 3e-3}
    sim = Simulator(tied(toy_meta()), cluster, CostOptions())
    untied_sim = Simulator(toy_meta(), cluster, CostOptions())
    lay = two_stage(((0,), (2,)))
    assert sim.step_collectives(lay) - untied_sim.step_collectives(lay) == pytest.approx(3e-3)
