"""Planning on the 3-node box's probed cluster (no SLURM needed): node2<->node3 shaped to 1 Gbit/s.

The figures are those the in-job probe measured on launch/local_slurm/start-multinode.sh's box
(tests/test_multinode.py checks the probe itself): node1<->node2 12.3, node1<->node3 14.7,
node2<->node3 0.99 Gbit/s, one CPU worker per node.
"""
from __future__ import annotations

import dataclasses

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo, node_bandwidth, node_orders
from hrlplan.compose import compose

GBIT = 1e9 / 8
PROBED = [[0.0, 12.27, 14.65], [12.27, 0.0, 0.99], [14.65, 0.99, 0.0]]   # Gbit/s


def probed_box(peak_flops: float = 60e9, memory_gib: float = 6.0) -> ClusterSpec:
    devices = [DeviceInfo(rank=k, node=k, local_rank=0, hostname=f"node{k + 1}", kind="cpu", name="cpu",
                          memory_bytes=int(memory_gib * 2**30), peak_flops=peak_flops, peak_dtype="fp32")
               for k in range(3)]
    bw = [[x * GBIT for x in row] for row in PROBED]
    lat = [[0.0 if a == b else 60e-6 for b in range(3)] for a in range(3)]
    return ClusterSpec(name="mn-box", devices=devices, backend="gloo", source="probe", bandwidth=bw, latency=lat,
                       intra_node_bw=[0.0, 0.0, 0.0], inter_node_bw=0.99 * GBIT)


def test_node_orders_route_the_pipeline_around_the_shaped_link():
    spec = probed_box()
    assert node_bandwidth(spec)[1][2] == pytest.approx(0.99 * GBIT)
    best = node_orders(spec)[0]
    assert best == [1, 0, 2]          # node2 > node1 > node3: both hops on fast links
    uniform = dataclasses.replace(spec, bandwidth=[[10 * GBIT] * 3 for _ in range(3)])
    assert node_orders(uniform)[0] == [0, 1, 2]   # nothing to avoid: node order


def _pipeline_hops(plan, spec):
    hops = []
    for g in range(len(plan.device_groups) - 1):
        for a, b in zip(plan.device_groups[g], plan.device_groups[g + 1]):
            hops.append(spec.bw(a, b))
    return hops


def _gpt2_on_the_box():
    """GPT-2 124M on fast devices (so the hops matter) of 1.2 GiB each (so it needs 3 stages), its head
    untied: a tied head's gradient is all-reduced between the first and the last stage, so on three
    nodes every order of the stages would put one of the three pairs on the shaped link."""
    from hrlplan.model_meta import introspect

    cfg = compose(["arch=gpt2", "arch.tie_word_embeddings=false", "train.global_batch_size=8"])
    return cfg, introspect(cfg["arch"], seq_len=cfg["data"]["seq_len"]), probed_box(peak_flops=20e12, memory_gib=1.2)


def test_cost_model_prices_the_shaped_link():
    """The same 3 stages in node order (a hop over the 1 Gbit/s link) and with node1 in the middle."""
    from hrlplan.cost.model import Layout
    from hrlplan.cost.simulator import simulate

    _, meta, spec = _gpt2_on_the_box()
    spans = ((0, 3), (3, 10), (10, 12))

    def step(order):
        layout = Layout(spans=spans, groups=tuple((r,) for r in order), tp=1, dp=1, microbatch_size=1,
                        num_microbatches=8, schedule="1f1b")
        result = simulate(meta, spec, layout)
        assert result.feasible, result.reason
        return result

    across, around = step([0, 1, 2]), step([1, 0, 2])
    assert around.breakdown["p2p_comm_s"] < across.breakdown["p2p_comm_s"] / 3
    assert around.step_time_s < across.step_time_s


def test_search_space_adds_link_aware_node_orders():
    """Beside the type orders, the node chains along fast links (pool-limited, no duplicates); a
    cluster with uniform links adds none."""
    from hrlplan.search.space import SearchSpace

    cfg, meta, spec = _gpt2_on_the_box()
    space = SearchSpace(meta, spec, dict(cfg["planner"]), dict(cfg["train"]))
    full = space.pools[0]
    assert space.orders(full) == [(("cpu",), ()), (("cpu",), (1, 0, 2)), (("cpu",), (0, 2, 1))]
    assert all(len(space.orders(p)) == 1 for p in space.pools if len(p.nodes) < 3)
    c = next(c for c in space.configs() if c.node_order == (1, 0, 2) and c.pp == 3)
    assert space.groups(c) == ((1,), (0,), (2,)) and hash(c)
    uniform = dataclasses.replace(spec, bandwidth=[[10 * GBIT] * 3 for _ in range(3)])
    assert SearchSpace(meta, uniform, dict(cfg["planner"]), dict(cfg["train"])).orders(full) == [(("cpu",), ())]


def test_planner_keeps_pipeline_boundaries_off_the_shaped_link():
    """The planner's pipeline must not hop over the 1 Gbit/s link when an order of the same stages
    avoids it (here node2 > node1 > node3), nor a data-parallel group span it."""
    from hrlplan.search import make_plan

    cfg, meta, spec = _gpt2_on_the_box()
    plan, _ = make_plan(meta, spec, dict(cfg["planner"]), dict(cfg["train"]))
    slow = 0.99 * GBIT
    assert plan.pp == 3, plan.layout()   # 1.2 GiB per device: no fewer stages fit
    assert min(_pipeline_hops(plan, spec)) > 2 * slow, (plan.layout(), plan.device_groups)
    for group in plan.device_groups:
        if len(group) > 1:
            assert spec.group_bw(group) > 2 * slow, (plan.layout(), plan.device_groups)


def test_one_task_per_node_is_not_refused_as_cyclic():
    """SLURM reports `cyclic` for one task per node (a 3-node submitit job): the same placement as block."""
    from hrlplan.errors import UserError
    from hrlplan.launch.slurm import check_distribution

    check_distribution({"SLURM_DISTRIBUTION": "cyclic", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "3"})
    with pytest.raises(UserError, match="--distribution=block"):
        check_distribution({"SLURM_DISTRIBUTION": "cyclic", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_NUM_NODES": "3"})
