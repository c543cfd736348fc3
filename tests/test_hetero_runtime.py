"""The heterogeneous executor's runtime: idle ranks leave the job, GPT-2 replicas at different tp,
and the bucketed cross-replica gradient sync started during the last backward (hetero_sync.py)."""
import pytest
import torch

from hrlplan.compose import compose
from hrlplan.launch.local_run import compare_with_one_process
from hrlplan.search.placement import compact, place_on_ranks
from hrlplan.plan import launch_meta
from hrlplan.runtime.hetero_sync import Item, cut_buckets, from_hf, gpt2_layout, to_hf
from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules
from hrlplan.runtime.trainer import build_full_model

GPT2 = ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"]


def _model(arch):
    return build_full_model(compose(arch)["arch"], 0, materialized=False)   # on the meta device


def _idle_rank_plan():
    """One pipeline (every layer) on rank 0, rank 1 idle: the issue's layout in the heterogeneous form."""
    model = _model(GPT2)
    whole = PipelineTemplate(model, [get_modules(model)])
    return build_plan([whole], {whole: 4}, world_size=2, global_batch_size=8, unused_ranks=[1], model="gpt2-tiny")


# ---------------------------------------------------------------- pure parts (fast)
def test_a_heterogeneous_plan_with_idle_ranks_compacts_onto_its_used_ranks():
    plan = _idle_rank_plan()
    plan.unused_ranks, plan.world_size = [0, 2], 4   # the pipeline on rank 1 of 4 (a placement)
    plan.pipelines[0].stages[0].ranks = [1]
    plan.meta["launch"] = dict(launch_meta(4), rank_to_device=[3, 2, 1, 0])
    trained, used = compact(plan)
    assert used == [1]
    assert trained.heterogeneous and trained.world_size == 1 and not trained.unused_ranks
    assert [s.ranks for s in trained.pipelines[0].stages] == [[0]] and trained.stages[0].ranks == [0]
    assert trained.meta["launch"]["rank_to_device"] == [2] and trained.meta["launch"]["nproc_per_node"] == 1
    assert plan.pipelines[0].stages[0].ranks == [1]   # the job's plan is left as it was


def test_a_heterogeneous_plan_placed_on_job_ranks_and_compacted_back():
    """place_on_ranks maps each pipeline once (a heterogeneous plan's `stages` is its first pipeline's
    list: renumbering both moved those ranks twice) and compact undoes it."""
    model = _model(GPT2)
    whole = PipelineTemplate(model, [get_modules(model)])
    split = PipelineTemplate(model, [get_modules(model)[:3], get_modules(model)[3:]])
    plan = build_plan([whole, split], {whole: 2, split: 2}, world_size=3, global_batch_size=8, model="gpt2-tiny")
    placed = place_on_ranks(plan, [1, 2, 3], 4, launch_meta(4))
    assert [[s.ranks for s in p.stages] for p in placed.pipelines] == [[[1]], [[2], [3]]]
    assert placed.unused_ranks == [0] and placed.world_size == 4
    back, used = compact(placed)
    assert used == [1, 2, 3]
    assert [[s.ranks for s in p.stages] for p in back.pipelines] == [[[0]], [[1], [2]]]


def test_gpt2_tp_layout_maps_to_hugging_face_and_back():
    hidden, tp = 8, 2
    conv = torch.arange(hidden * 3 * hidden, dtype=torch.float32).reshape(hidden, 3 * hidden)
    layout = gpt2_layout("transformer.h.0.attn.c_attn.weight", tp, hidden)
    linear = from_hf(conv, layout)
    assert linear.shape == (3 * hidden, hidden)
    width = hidden // tp   # rank 0's rows: q, k and v of the first heads
    assert torch.equal(linear[:width], conv[:, :width].t())
    assert torch.equal(linear[width:2 * width], conv[:, hidden:hidden + width].t())
    assert torch.equal(to_hf(linear, layout), conv)
    bias = torch.arange(3 * hidden, dtype=torch.float32)
    assert torch.equal(to_hf(from_hf(bias, gpt2_layout("transformer.h.0.attn.c_attn.bias", tp, hidden)),
                             gpt2_layout("transformer.h.0.attn.c_attn.bias", tp, hidden)), bias)
    assert gpt2_layout("transformer.h.0.mlp.c_proj.weight", tp, hidden) == (True, None)
    assert gpt2_layout("transformer.h.0.mlp.c_proj.bias", tp, hidden) is None
    assert gpt2_layout("transformer.h.0.ln_1.weight", tp, hidden) is None
    assert gpt2_layout("transformer.h.0.attn.c_attn.weight", 1, hidden) is None


def test_buckets_hold_whole_units_and_close_at_the_cap():
    def item(unit, numel):
        return Item(unit, f"{unit}.w", None, False, numel)
    items = [item("final", 10), item("block1", 30), item("block1", 30), item("block0", 5), item("embed", 100)]
    cut = cut_buckets(items, cap_bytes=4 * 40, value_bytes=4)
    assert [[i.unit for i in b] for b in cut] == [["final", "block1", "block1"], ["block0", "embed"]]
    assert len(cut_buckets(items, cap_bytes=1, value_bytes=4)) == 4   # one unit per bucket at the least


def test_buckets_start_during_the_last_backward(tmp_path, monkeypatch):
    """One process, one pipeline: with small buckets every one starts from the backward hooks, and
    the gradients after finish() are the pipeline's own (a group of one adds nothing)."""
    import torch.distributed as dist

    from hrlplan.runtime.hetero import HeteroPipelineEngine
    from hrlplan.runtime.timing import StepRecorder

    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.01")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _model(GPT2)
        template = PipelineTemplate(model, [get_modules(model)])
        plan = build_plan([template], {template: 2}, world_size=1, global_batch_size=4, model="gpt2-tiny")
        cfg = compose(GPT2)
        engine = HeteroPipelineEngine(plan, cfg["train"], torch.device("cpu"), _model(GPT2), StepRecorder(torch.device("cpu")))
        assert len(engine.reducer.buckets) > 3
        inputs = torch.randint(0, 100, (4, 16))
        engine.forward_backward(inputs, inputs)
        assert engine.reducer.started_in_backward == len(engine.reducer.buckets)
        before = {n: p.grad.clone() for n, p in engine.parts[0].named_parameters()}
        engine.sync_and_clip(0.0)
        for n, p in engine.parts[0].named_parameters():
            assert torch.equal(p.grad, before[n]), n
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- runs (gloo workers)
@pytest.mark.slow
def test_an_idle_rank_of_a_heterogeneous_plan_leaves_and_the_losses_match_one_process(tmp_path):
    """The issue's crash: the idle rank entered the training step. Through the job (planner=manual)."""
    from hrlplan.launch.job import run
    from tests._runs import reference_losses

    plan_file = tmp_path / "plan.yaml"
    _idle_rank_plan().save(plan_file)
    steps = 3
    config = compose([*GPT2, "planner=manual", f"planner.plan_file={plan_file}", "cluster.nproc_per_node=2",
                      "logger.mode=disabled", f"train.steps={steps}", "train.global_batch_size=8",
                      "train.checkpoint_interval=0", "cluster.oversubscribe=true"])
    config["run_dir"] = str(tmp_path / "run")
    summary = run(config)
    losses = [h["train/lm_loss"] for h in summary["history"]]
    assert losses == pytest.approx(reference_losses(steps, [*GPT2, "train.global_batch_size=8"]), abs=1e-5)


@pytest.mark.slow
def test_gpt2_replicas_at_tp_1_and_2_match_one_process(tmp_path, monkeypatch):
    """Replica A holds every block whole on one rank, replica B tensor-parallel over two: GPT-2's
    fused q/k/v is regrouped per tp degree, so the whole-unit reduce maps each to Hugging Face's
    layout. Small buckets: several start during the last backward."""
    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.05")
    model = _model(GPT2)
    modules = get_modules(model)
    whole, sharded = PipelineTemplate(model, [modules]), PipelineTemplate(model, [modules], tp=[2])
    plan = build_plan([whole, sharded], {whole: 2, sharded: 2}, world_size=3, global_batch_size=8,
                      batch_sizes=[2, 6], model="gpt2-tiny")
    assert [[s.tp for s in p.stages] for p in plan.pipelines] == [[1], [2]]
    losses, reference = compare_with_one_process(plan, GPT2, tmp_path, steps=4)
    assert losses == pytest.approx(reference, abs=1e-5)
    # its checkpoint holds each block in one replica's tp layout: resuming it is refused, not misloaded
    from hrlplan.errors import UserError
    from hrlplan.launch.local_run import train_plan

    config = compose([*GPT2, "train.steps=5", "train.resume=auto", "logger.mode=disabled"])
    with pytest.raises(UserError, match="hold a block at different tp degrees"):
        train_plan(plan, config, tmp_path)


@pytest.mark.slow
def test_four_workers_mixed_splits_and_tp_with_small_buckets_match_one_process(tmp_path, monkeypatch):
    """Llama: replica A [E, h0-h1 | h2-h3, H] on two ranks, replica B every layer at tp 2: units held
    at one tp (shard by shard) and at two (whole), buckets crossing stage boundaries of A."""
    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.02")
    llama = ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"]
    model = _model(llama)
    modules = get_modules(model)
    two = PipelineTemplate(model, [modules[:3], modules[3:]])
    sharded = PipelineTemplate(model, [modules], tp=[2])
    plan = build_plan([two, sharded], {two: 4, sharded: 4}, world_size=4, global_batch_size=8, model="llama-tiny")
    losses, reference = compare_with_one_process(plan, llama, tmp_path, steps=4)
    assert losses == pytest.approx(reference, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("node_size", [2, 3])
def test_replicas_on_emulated_nodes_reduce_in_node_first_and_match_one_process(tmp_path, monkeypatch, node_size):
    """Four one-rank replicas on emulated nodes (HRLPLAN_SYNC_NODE_SIZE): nodes of 2 reduce in node,
    then across nodes on two rails of half a bucket each; nodes of 3 and 1 on one rail, two ranks
    receiving their node's sum by broadcast. Small buckets: several in flight at once."""
    monkeypatch.setenv("HRLPLAN_SYNC_NODE_SIZE", str(node_size))
    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.05")
    model = _model(GPT2)
    whole = PipelineTemplate(model, [get_modules(model)])
    plan = build_plan([whole] * 4, {whole: 1}, world_size=4, global_batch_size=8, model="gpt2-tiny")
    losses, reference = compare_with_one_process(plan, GPT2, tmp_path, steps=3)
    assert losses == pytest.approx(reference, abs=1e-5)
