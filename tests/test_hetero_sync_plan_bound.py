"""A replica plan's step is bound by its replicas' own steps as the heterogeneous executor runs them,
not by the homogeneous runtime's tied-embedding all-reduce, which the executor never runs (issue 35:
gen3's single template as four replicas cost 219.8 ms for 211.2 by that bound alone)."""
import dataclasses

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.plans import predict_any_plan
from hrlplan.cost.simulator import Simulator
from tests.test_cross_replica_sync import _gpt2_tiny_plan, _tiny_meta

GiB = 2 ** 30


def _alternating_nodes(inter=1e9) -> ClusterSpec:
    """Devices 0 and 2 on node 0, 1 and 3 on node 1: each replica's first and last stage a node apart."""
    devs = [DeviceInfo(rank=i, node=i % 2, local_rank=i // 2, hostname=f"n{i % 2}", kind="cuda", name="g",
                       memory_bytes=16 * GiB, peak_flops=1e14) for i in range(4)]
    return ClusterSpec(name="alternating", devices=devs, backend="nccl", source="preset", intra_node_bw=[100e9] * 2,
                       inter_node_bw=inter, intra_node_latency=1e-6, inter_node_latency=5e-6)


def test_a_tied_replica_plan_is_not_bound_by_the_homogeneous_tied_all_reduce():
    small = _tiny_meta()
    assert small.tied_embeddings
    grow = 50_000_000 - small.head_matmul_params   # a large tied vocabulary: its gradient's bytes dominate
    meta = dataclasses.replace(small, head_matmul_params=small.head_matmul_params + grow,
                               embedding_params=small.embedding_params + grow)
    cluster = _alternating_nodes()
    plan = _gpt2_tiny_plan(lambda n: [[(0, 3), (3, n)]] * 2, 4)   # two replicas of two stages
    predicted = predict_any_plan(plan, meta, cluster, CostOptions())
    sim = Simulator(meta, cluster, CostOptions())
    own = []
    for pipe in plan.as_pipelines():
        lay = Layout(spans=tuple(tuple(s.layers) for s in pipe.stages), groups=tuple(tuple(s.ranks) for s in pipe.stages),
                     tp=1, dp=1, microbatch_size=pipe.microbatch_size, num_microbatches=pipe.num_microbatches,
                     schedule=plan.schedule)
        own.append(sim.evaluate(lay, detail=True))
    tied_homogeneous = min(r.breakdown["step_collectives_s"] for r in own)
    assert tied_homogeneous > meta.head_matmul_params * 4.0 / 1e9 * 0.9   # fp32, whole, over 1 GB/s
    assert [[s.ranks for s in p.stages] for p in plan.as_pipelines()] == [[[0], [1]], [[2], [3]]]
    # the executor reduces the tied unit in its buckets instead: bf16, over the four holders, in node
    # first (two rails across nodes of half the unit each)
    assert predicted["step_time_s"] < max(r.step_time_s for r in own)
    assert predicted["breakdown"]["cross_replica_reduce_s"] > 0
