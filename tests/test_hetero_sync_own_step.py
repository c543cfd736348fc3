"""A replica's own step as the heterogeneous executor runs it (issue 35): its homogeneous simulation
less the homogeneous runtime's small all-reduces after the pipeline, above all TiedEmbeddingSync's
whole tied-embedding gradient in fp32 between the first and the last stage, which the executor
never runs (it reduces the tied unit in its cross-replica buckets, costed apart)."""
import dataclasses

import pytest

from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.replica_sync import embedding_unit_params
from hrlplan.cost.replica_sync_cost import replica_own_step_s
from hrlplan.cost.simulator import Simulator
from tests.test_cost import toy_meta
from tests.test_cross_replica_sync import two_node_cluster


def test_a_replicas_own_step_leaves_out_the_tied_all_reduce_the_executor_does_not_run():
    cluster = two_node_cluster(inter=1e9)
    tied = dataclasses.replace(toy_meta(vocab=20000), tied_embeddings=True)
    across = Layout(spans=((0, 4), (4, 8)), groups=((0,), (2,)), tp=1, dp=1, microbatch_size=1, num_microbatches=2,
                    schedule="1f1b")
    r = Simulator(tied, cluster, CostOptions()).evaluate(across, detail=True)
    collectives = r.breakdown["step_collectives_s"]
    untied = Simulator(toy_meta(vocab=20000), cluster, CostOptions()).evaluate(across, detail=True)
    tied_bytes = tied.head_matmul_params * 4.0   # fp32, the whole matrix at dp 1, over the 1 GB/s link
    assert collectives - untied.breakdown["step_collectives_s"] > tied_bytes / 1e9
    assert replica_own_step_s(r) == pytest.approx(r.step_time_s - collectives)
    inside = dataclasses.replace(across, groups=((0,), (1,)))   # the same replica within one node
    r_inside = Simulator(tied, cluster, CostOptions()).evaluate(inside, detail=True)
    assert replica_own_step_s(r_inside) == pytest.approx(r_inside.step_time_s - r_inside.breakdown["step_collectives_s"])


def test_a_tied_models_embedding_is_its_tied_unit_and_the_rest():
    meta = toy_meta()
    assert embedding_unit_params(meta) == {"embed": float(meta.embedding_params)}
    tied = dataclasses.replace(meta, tied_embeddings=True)
    units = embedding_unit_params(tied)
    assert units["embed"] == float(tied.head_matmul_params)
    assert sum(units.values()) == pytest.approx(float(tied.embedding_params))


def test_nodes_of_one_member_per_rail_reduce_scatter_and_all_gather_in_node():
    from hrlplan.cost.replica_sync import node_hierarchy, scatter_in_node

    assert scatter_in_node(node_hierarchy((0, 1, 2, 3), [0, 0, 1, 1]))      # two rails, each node one of each
    assert not scatter_in_node(node_hierarchy((0, 1, 2, 3), [0, 0, 0, 1]))  # one rail, two members off it
    assert not scatter_in_node(node_hierarchy((0, 1), [0, 1]))              # flat: one member per node
