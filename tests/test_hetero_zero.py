"""The sharded optimizer across heterogeneous replicas (runtime/hetero_zero.py, issue 35): each rank
of a bucket's set steps its slice, losses equal one process, resume continues the curve; the
simulator divides the optimizer's time and state by the set and charges the gather."""
import pytest

from hrlplan.compose import compose
from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules
from hrlplan.runtime.trainer import build_full_model

GPT2 = ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"]
LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"]


def _model(arch):
    return build_full_model(compose(arch)["arch"], 0, materialized=False)   # on the meta device


def _split_plan():
    """Replica A every layer on rank 0, replica B two stages on ranks 1 and 2: sets of two (A with
    each of B's stages) and of three (the tied embedding)."""
    model = _model(GPT2)
    m = get_modules(model)
    whole, split = PipelineTemplate(model, [m]), PipelineTemplate(model, [m[:3], m[3:]])
    return build_plan([whole, split], {whole: 2, split: 2}, world_size=3, global_batch_size=8, batch_sizes=[2, 6],
                      model="gpt2-tiny")


@pytest.mark.slow
def test_sharded_replicas_with_split_stages_match_one_process(tmp_path, monkeypatch):
    from tests._sharded_optimizer_runs import compare_sharded_with_one_process

    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.05")   # several buckets, each sliced over its set
    losses, reference, summary = compare_sharded_with_one_process(_split_plan(), GPT2, tmp_path, steps=4)
    assert summary["sharded"] == [True] * 3
    assert losses == pytest.approx(reference, abs=1e-5)
    # every value's two moments held once over the job (a replicated optimizer: once per replica)
    params = sum(p.numel() for p in _model(GPT2).parameters())
    assert sum(summary["moments"]) == 2 * params


@pytest.mark.slow
def test_sharded_replicas_at_tp_1_and_2_resume_the_one_process_curve(tmp_path):
    """Llama whole on rank 0 and at tp 2 on ranks 1-2: every unit is reduced whole over three ranks
    (a DTensor shard on two of them), so slices cut across tp shards. A checkpoint holds the whole
    optimizer state either way: step 1 replicated, step 2 sharded resumed from it (its slices taken
    from the whole state), step 3 replicated resumed from the sharded checkpoint (gathered): one
    process's curve."""
    from hrlplan.launch.local_run import train_plan
    from hrlplan.runtime.reference import train_single_process
    from tests._sharded_optimizer_runs import train_sharded

    model = _model(LLAMA)
    modules = get_modules(model)
    whole, sharded = PipelineTemplate(model, [modules]), PipelineTemplate(model, [modules], tp=[2])
    plan = build_plan([whole, sharded], {whole: 2, sharded: 2}, world_size=3, global_batch_size=8,
                      model="llama-tiny")
    config = compose([*LLAMA, "train.steps=3", "train.checkpoint_interval=1", "logger.mode=disabled"])

    def until(step, **extra):
        return dict(config, train=dict(config["train"], stop_after=step, resume="auto", **extra))

    replicated = dict(plan.meta, replica_optimizer="replicated")
    plan.meta = replicated
    first = train_plan(plan, until(1), tmp_path)
    plan.meta = dict(replicated, replica_optimizer="sharded")
    second = train_sharded(plan, until(2), tmp_path)
    assert second["sharded"] == [True] * 3
    plan.meta = replicated
    third = train_plan(plan, until(3), tmp_path)
    losses = {h["step"]: h["train/lm_loss"] for h in first["history"] + second["history"] + third["history"]}
    assert sorted(losses) == [1, 2, 3]
    reference = [h["loss"] for h in train_single_process(config, 3)]
    assert [losses[s] for s in (1, 2, 3)] == pytest.approx(reference, abs=1e-5)


@pytest.mark.slow
def test_sharded_replicas_on_emulated_nodes_reduce_in_node_first_and_match_one_process(tmp_path, monkeypatch):
    """Four one-rank replicas on two emulated nodes of two: each bucket is all-reduced in node, then
    across nodes on two rails of half a bucket; rail member i steps half i (on both nodes alike) and
    broadcasts it in its node after the step."""
    from tests._sharded_optimizer_runs import compare_sharded_with_one_process

    monkeypatch.setenv("HRLPLAN_SYNC_NODE_SIZE", "2")
    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.05")
    model = _model(GPT2)
    whole = PipelineTemplate(model, [get_modules(model)])
    plan = build_plan([whole] * 4, {whole: 1}, world_size=4, global_batch_size=8, model="gpt2-tiny")
    losses, reference, summary = compare_sharded_with_one_process(plan, GPT2, tmp_path, steps=3)
    assert summary["sharded"] == [True] * 4
    assert losses == pytest.approx(reference, abs=1e-5)
    assert summary["moments"] == [sum(p.numel() for p in model.parameters())] * 4   # two moments of half each


def test_one_replica_steps_every_parameter_in_place_as_adamw(tmp_path):
    """A set of one member shards nothing: the sharded optimizer steps the stage's own parameters,
    exactly as the trainer's AdamW does, and keeps no master copy."""
    import torch
    import torch.distributed as dist

    from hrlplan.runtime.hetero import HeteroPipelineEngine
    from hrlplan.runtime.timing import StepRecorder
    from hrlplan.runtime.trainer import make_optimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        cfg = compose(GPT2)
        model = _model(GPT2)
        template = PipelineTemplate(model, [get_modules(model)])
        plan = build_plan([template], {template: 2}, world_size=1, global_batch_size=4,
                          model="gpt2-tiny")
        plan.meta["replica_optimizer"] = "sharded"
        engines = [HeteroPipelineEngine(plan, cfg["train"], torch.device("cpu"), _model(GPT2),
                                        StepRecorder(torch.device("cpu"))) for _ in range(2)]
        sharded = engines[0].make_optimizer(cfg["train"])
        plain = make_optimizer(engines[1].parts[0], cfg["train"])
        assert engines[1].make_optimizer is not None and not sharded.sharded
        inputs = torch.randint(0, 100, (4, 16))
        for engine, opt in zip(engines, (sharded, plain)):
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                engine.forward_backward(inputs, inputs)
                engine.sync_and_clip(1.0)
                opt.step()
        for (name, a), b in zip(engines[0].parts[0].named_parameters(), engines[1].parts[0].parameters()):
            assert torch.equal(a, b), name
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the simulator
def test_the_simulator_divides_optimizer_time_and_state_by_the_set_and_charges_the_gather():
    """Four one-rank replicas of every layer on one node: every unit over a set of four. Sharded, each
    rank steps a quarter (time beyond the per-call cost, moments) and keeps fp32 masters of it; the
    reduce is a reduce-scatter (half the all-reduce) and the all-gather after the step is exposed."""
    from hrlplan.cost.model import CostOptions
    from hrlplan.cost.plans import predict_any_plan
    from hrlplan.cost.replica_optimizer import unit_params
    from hrlplan.cost.replica_sync_cost import sync_buckets
    from hrlplan.cost.simulator import Simulator
    from hrlplan.model_meta import introspect, resolve_arch
    from tests.test_cross_replica_sync import two_node_cluster

    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    cluster = two_node_cluster(per_node=4)
    model = _model(["arch=gpt2-tiny"])   # its six layers, as meta
    whole = PipelineTemplate(model, [get_modules(model)])
    plan = build_plan([whole] * 4, {whole: 1}, world_size=4, global_batch_size=8, model="gpt2-tiny")
    got = {}
    for mode in ("replicated", "sharded"):
        plan.meta["replica_optimizer"] = mode
        got[mode] = predict_any_plan(plan, meta, cluster, CostOptions())
    rep, sh = got["replicated"]["breakdown"], got["sharded"]["breakdown"]
    fixed = Simulator(meta, cluster, CostOptions()).devices.overheads.optimizer_fixed(1, 1)
    assert sh["optimizer_s"] - fixed == pytest.approx((rep["optimizer_s"] - fixed) / 4)
    assert sh["replica_optimizer"] == "sharded" and rep["optimizer_gather_exposed_s"] == 0.0
    assert sh["optimizer_gather_exposed_s"] > 0.0
    assert sh["cross_replica_reduce_s"] == pytest.approx(rep["cross_replica_reduce_s"] / 2)
    params = sum(unit_params(meta).values())
    for before, after in zip(got["replicated"]["memory_bytes_per_rank"], got["sharded"]["memory_bytes_per_rank"]):
        assert before - after == pytest.approx(8 * params - (8 + 4) * params / 4, rel=1e-6, abs=8)
    sim = Simulator(meta, cluster, CostOptions())
    gathers = [b.gather_s for b in sync_buckets(plan, meta, sim, list(range(4)), sharded=True)]
    reduces = [b.seconds for b in sync_buckets(plan, meta, sim, list(range(4)))]
    assert gathers == pytest.approx([s / 2 for s in reduces])


def test_the_simulator_shards_an_in_node_first_set_over_its_rails():
    """The same four replicas on two nodes of two: the set reduces in node first on two rails; each
    rank steps half (its rail's part, alike on both nodes), the reduce loses its broadcasts in node
    and the step gains them after the optimizer."""
    from hrlplan.cost.model import CostOptions
    from hrlplan.cost.plans import predict_any_plan
    from hrlplan.cost.replica_sync_cost import sync_buckets
    from hrlplan.cost.simulator import Simulator
    from hrlplan.model_meta import introspect, resolve_arch
    from tests.test_cross_replica_sync import two_node_cluster

    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    cluster = two_node_cluster(per_node=2)
    model = _model(["arch=gpt2-tiny"])
    whole = PipelineTemplate(model, [get_modules(model)])
    plan = build_plan([whole] * 4, {whole: 1}, world_size=4, global_batch_size=8, model="gpt2-tiny")
    got = {}
    for mode in ("replicated", "sharded"):
        plan.meta["replica_optimizer"] = mode
        got[mode] = predict_any_plan(plan, meta, cluster, CostOptions())["breakdown"]
    fixed = Simulator(meta, cluster, CostOptions()).devices.overheads.optimizer_fixed(1, 1)
    assert got["sharded"]["optimizer_s"] - fixed == pytest.approx((got["replicated"]["optimizer_s"] - fixed) / 2)
    sim = Simulator(meta, cluster, CostOptions())
    sharded = sync_buckets(plan, meta, sim, list(range(4)), sharded=True)
    for b, r in zip(sharded, sync_buckets(plan, meta, sim, list(range(4)))):
        # the replicated reduce ends with an all-gather in node (nodes of two members, one per rail:
        # replica_sync.scatter_in_node), the sharded one leaves it out and broadcasts each rail's part
        # after the step (hetero_zero.py): each a ring of two over the intra-node link, the broadcasts
        # whole parts where the all-gather's ring is half its all-reduce
        in_node_gather = r.seconds - b.seconds
        assert in_node_gather > 0 and b.gather_s == pytest.approx(2 * in_node_gather)


def test_the_weight_gathers_hide_behind_the_next_forward_up_to_each_buckets_first_use():
    """Gathers in forward order from the step's end: with no forward to hide behind the whole chain
    shows; behind a long one only the first three buckets' (the embedding's two units and block 0's,
    used at once: an embedding lookup counts no FLOPs)."""
    from hrlplan.cost.model import CostOptions
    from hrlplan.cost.replica_sync_cost import exposed_gathers, sync_buckets
    from hrlplan.cost.simulator import Simulator
    from hrlplan.model_meta import introspect, resolve_arch
    from tests.test_cross_replica_sync import two_node_cluster

    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    model = _model(["arch=gpt2-tiny"])
    whole = PipelineTemplate(model, [get_modules(model)])
    plan = build_plan([whole] * 4, {whole: 1}, world_size=4, global_batch_size=8, model="gpt2-tiny")
    sim = Simulator(meta, two_node_cluster(per_node=4), CostOptions())
    buckets = sync_buckets(plan, meta, sim, list(range(4)), cap_bytes=1, sharded=True)   # a unit a bucket
    gathers = [b._replace(seconds=b.gather_s) for b in reversed(buckets)]
    # the embedding's units (GPT-2's positions, then the tied matrix: replica_sync.embedding_unit_params)
    # and block 0 are used at once
    assert [g.units for g in gathers[:3]] == [("embed_rest",), ("embed",), ("block0",)] and len(gathers) > 4
    issued = dict.fromkeys(range(4), 0.0)
    assert exposed_gathers(plan, meta, gathers, issued, 0.0, dict.fromkeys(range(4), (0.0, 0.0))) == \
        pytest.approx(sum(g.seconds for g in gathers))
    assert exposed_gathers(plan, meta, gathers, issued, 0.0, dict.fromkeys(range(4), (0.0, 1e9))) == \
        pytest.approx(gathers[0].seconds + gathers[1].seconds + gathers[2].seconds)
