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


# ---------------------------------------------------------------- the cross-replica buckets
def _gpt2_tiny_plan(templates_of, world):
    """A replica plan of gpt2-tiny from (module slices per stage) per replica, one micro-batch each."""
    from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules

    modules = get_modules("gpt2-tiny")
    templates = [PipelineTemplate("gpt2-tiny", [modules[a:b] for a, b in spans]) for spans in templates_of(len(modules))]
    return build_plan(templates, {t: 1 for t in templates}, world_size=world, global_batch_size=2 * len(templates),
                      model="gpt2-tiny")


def _tiny_meta():
    from hrlplan.model_meta import introspect, resolve_arch
    return introspect(resolve_arch("gpt2-tiny"), seq_len=64)


def test_buckets_are_the_runtimes_cut_and_cost_in_node_first_across_nodes():
    from hrlplan.cost.replica_sync import cut_buckets, embedding_unit_params
    from hrlplan.cost.replica_sync_cost import _unit_bytes, sync_buckets

    meta = _tiny_meta()
    plan = _gpt2_tiny_plan(lambda n: [[(0, n)]] * 4, 4)        # four one-rank replicas of every layer
    two_nodes = Simulator(meta, two_node_cluster(per_node=2), CostOptions())
    one_node = Simulator(meta, two_node_cluster(per_node=4), CostOptions())
    value = two_nodes.opts.bytes_per_value
    sizes = _unit_bytes(meta, value)
    cap = 3 * sizes["block0"]   # three blocks a bucket
    buckets = sync_buckets(plan, meta, two_nodes, list(range(4)), cap_bytes=cap)
    # the runtime's cut of the same units (backward order: final, blocks last to first, embeddings)
    units = ["final"] + [f"block{i}" for i in reversed(range(meta.n_layer))] + list(embedding_unit_params(meta))
    Unit = type("Unit", (), {})
    items = []
    for u in units:
        item = Unit()
        item.unit, item.numel = u, sizes[u] / value
        items.append(item)
    expected = [tuple(i.unit for i in cut) for cut in cut_buckets(items, cap, value)]
    assert [b.units for b in buckets] == expected and len(buckets) > 2
    assert all(b.ranks == (0, 1, 2, 3) for b in buckets)
    dev = two_nodes.devices
    intra, inter = 100e9 * dev.bw_eff, 10e9 * dev.bw_eff
    for b in buckets:
        # a reduce-scatter in each node of 2 (half its ring all-reduce), then two rails (one rank per
        # node) of half the bucket, then an all-gather in node (replica_sync.scatter_in_node)
        in_node = (b.nbytes / intra + 2 * 1e-6) / 2
        across = b.nbytes / 2 / inter + 2 * 5e-6
        assert b.seconds == pytest.approx(in_node + across + in_node)
    uneven = sync_buckets(plan, meta, Simulator(meta, two_node_cluster(per_node=3), CostOptions()), list(range(4)),
                          cap_bytes=cap)
    for b in uneven:
        # nodes of 3 and 1: one rail; the node of 3 all-reduces (a ring of 3), its two members off
        # the rail receive the sum by broadcast
        in_node = 2 * 2 / 3 * b.nbytes / intra + 2 * 2 * 1e-6
        across = b.nbytes / inter + 2 * 5e-6
        spread = b.nbytes / intra + 2 * 1e-6
        assert b.seconds == pytest.approx(in_node + across + spread)
    flat = sync_buckets(plan, meta, one_node, list(range(4)), cap_bytes=cap)
    for b in flat:   # one node: one ring over the four
        assert b.seconds == pytest.approx(2 * 3 / 4 * b.nbytes / intra + 2 * 3 * 1e-6)


def test_a_bucket_starts_when_its_units_are_final_and_the_buckets_ahead_have_started():
    from hrlplan.cost.replica_sync_cost import bucket_finish, bucket_launches, sync_buckets

    meta = _tiny_meta()
    # replica A every layer on rank 0; replica B two stages on ranks 1 (embedding, first blocks) and 2
    plan = _gpt2_tiny_plan(lambda n: [[(0, n)], [(0, 3), (3, n)]], 3)
    sim = Simulator(meta, two_node_cluster(per_node=4), CostOptions())
    buckets = sync_buckets(plan, meta, sim, [0, 1, 2], cap_bytes=1)   # a unit a bucket
    end, window = {0: 10.0, 1: 10.0, 2: 8.0}, {0: 4.0, 1: 2.0, 2: 2.0}
    launch = bucket_launches(plan, meta, buckets, end, window)
    first = next(k for k, b in enumerate(buckets) if b.units == ("final",))
    embed = next(k for k, b in enumerate(buckets) if b.units == ("embed",))
    assert buckets[embed].ranks == (0, 1, 2)           # tied: the last stage holds the head's copy
    assert launch[(embed, 0)] == 10.0 and launch[(embed, 1)] == 10.0
    assert 6.0 < launch[(first, 0)] < 10.0 and 6.0 < launch[(first, 2)] < 8.0   # during the last backward
    for r in (0, 1, 2):   # in order on every rank
        mine = [launch[(k, r)] for k, b in enumerate(buckets) if r in b.ranks]
        assert mine == sorted(mine)
    finish = bucket_finish(buckets, launch, end)
    assert finish[0] >= 10.0 + buckets[embed].seconds - 1e-12   # the embedding's bucket starts at the end
    assert finish[2] == pytest.approx(finish[0])


def test_a_single_templates_stage_root_sync_waits_for_its_whole_backward():
    """FSDP2 reduce-scatters a stage's root (embedding, final norm + head) after the stage's whole
    backward: its sync is exposed however long the last backward, as a replica plan's embedding
    bucket is."""
    from hrlplan.cost.device_model import all_reduce_time

    meta = toy_meta(vocab=20000)   # a large embedding, small blocks
    sim = Simulator(meta, two_node_cluster(per_node=2), CostOptions(dp_mode="fsdp"))
    lay = Layout(spans=((0, 8),), groups=((0, 2),), tp=1, dp=2, microbatch_size=1, num_microbatches=8,
                 schedule="1f1b")
    got = sim.evaluate(lay, detail=True).breakdown
    bw = 10e9 * sim.devices.bw_eff
    root = (meta.embedding_params + meta.head_params) * sim.opts.bytes_per_value
    assert got["dp_comm_exposed_s"] >= all_reduce_time(root, 2, bw, 5e-6) / 2 * (1 - 1e-9)
    assert got["dp_comm_exposed_s"] <= got["dp_comm_s"] + 1e-12
