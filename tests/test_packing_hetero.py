"""data.packing=document|balanced on a heterogeneous plan (hrlplan's own executor): each replica trains
its share of the step's documents, the stages send activations while every rank reads its rows'
positions and document ids, and the packed loss is token-weighted across replicas. Two replicas of
different layer splits train the losses one process trains on the same documents -- balanced too,
which only moves documents between rows and replicas."""
import pytest
import torch

from _plan_options import train_with_options

STEPS = 3
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=2", "arch.vocab_size=4096", "data=code", "data.seq_len=64",
        "train.global_batch_size=4", "train.lr=3e-3", "train.grad_clip=0", "train.measure_memory=false"]


def _hetero_plan(tp_whole: int = 1):
    """Replica A [E+h0 | h1+H] on two ranks, two micro-batches of one row; replica B every layer on one
    rank (tp_whole ranks), one micro-batch of two rows."""
    from hrlplan.compose import compose
    from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules
    from hrlplan.runtime.trainer import build_full_model

    model = build_full_model(compose(GPT2)["arch"], 0, materialized=False)
    modules = get_modules(model)
    split = PipelineTemplate(model, [modules[:3], modules[3:]])   # wte, wpe, h0 | h1, ln_f, head
    whole = PipelineTemplate(model, [modules], tp=[tp_whole])
    return build_plan([split, whole], {split: 2, whole: 1}, world_size=2 + tp_whole, global_batch_size=4,
                      batch_sizes=[2, 2], model="gpt2-tiny")


def test_a_heterogeneous_plans_layout_gives_each_replica_its_rows_at_its_speed():
    from hrlplan.data.packed_stream import ReplicaShape, StepLayout

    layout = StepLayout.of_plan(_hetero_plan())
    assert layout.shapes == (ReplicaShape(2, 1, 2, 1.0), ReplicaShape(1, 2, 1, 0.5))
    assert layout.rows == 4 and layout.depth is None   # unequal depths: balanced by the slowest micro-batch
    assert [(b.replica, b.speed) for b in layout.bins(64)] == [(0, 1.0), (0, 1.0), (1, 0.5), (1, 0.5)]


def test_a_balanced_heterogeneous_step_holds_the_document_steps_documents():
    from hrlplan.data.lm import build_lm_data
    from hrlplan.data.packing import IGNORE_INDEX

    data = {"name": "code", "path": "data/code", "seq_len": 64}
    plan = _hetero_plan()
    streams = {p: build_lm_data({**data, "packing": p}, 4096, 0, plan=plan) for p in ("document", "balanced")}
    moved = False
    for step in range(2):
        (di, dt), (bi, bt) = (streams[p].batch(step, 4) for p in ("document", "balanced"))
        moved = moved or not torch.equal(di, bi)
        tokens = [sorted(zip(i[:, 0][t[:, :64] != IGNORE_INDEX].tolist(), i[:, 1][t[:, :64] != IGNORE_INDEX].tolist()))
                  for i, t in ((di, dt), (bi, bt))]
        assert tokens[0] == tokens[1]
        assert dt[0, 64] == bt[0, 64] and (bt[:, 65] == 4).all()   # the step's useful tokens and rows, all replicas
    assert moved   # the dispatch placed some document elsewhere than arrival order did
    streams["balanced"].close()


_ONE_PROCESS = {}


def _one_process(tmp_path) -> list:
    from hrlplan.plan import homogeneous_plan

    if "losses" not in _ONE_PROCESS:
        plan = homogeneous_plan("gpt2-tiny", 2, [(0, 2)], dp=1, tp=1, microbatch_size=4, num_microbatches=1,
                                schedule="1f1b")
        _ONE_PROCESS["losses"] = train_with_options(plan, [*GPT2, "data.packing=document"], tmp_path / "one",
                                                    STEPS)["losses"]
    return _ONE_PROCESS["losses"]


@pytest.mark.slow
def test_balanced_heterogeneous_replicas_train_as_one_process(tmp_path):
    """balanced moves documents between rows and replicas (document packing: the tp test below)."""
    run = train_with_options(_hetero_plan(), [*GPT2, "data.packing=balanced"], tmp_path / "balanced", STEPS)
    assert run["losses"] == pytest.approx(_one_process(tmp_path), abs=1e-5)


@pytest.mark.slow
def test_packed_replicas_at_tp_1_and_2_train_as_one_process(tmp_path):
    """Replica B's stage tensor-parallel over two ranks: per-document attention on its heads, the packed
    loss over its vocabulary-parallel head."""
    run = train_with_options(_hetero_plan(tp_whole=2), [*GPT2, "data.packing=document"], tmp_path / "tp", STEPS)
    assert run["losses"] == pytest.approx(_one_process(tmp_path), abs=1e-5)


# ---------------------------------------------------------------- a replica's own sequence length
def _short_replica_plan():
    """Replica B trains rows of 32 tokens (its plan's seq_len; data.seq_len is 64)."""
    plan = _hetero_plan()
    plan.pipelines[1].seq_len = 32   # read with getattr until the plan schema holds the field
    return plan


def test_a_replica_with_its_own_sequence_length_gets_rows_filled_only_that_far():
    from hrlplan.data.lm import build_lm_data
    from hrlplan.data.packing import PAD_DOCUMENT
    from hrlplan.data.packing_options import packing_refusal
    from hrlplan.models.documents import trim_packed

    plan = _short_replica_plan()
    data = {"name": "code", "path": "data/code", "seq_len": 64}
    for packing in ("document", "balanced"):
        stream = build_lm_data({**data, "packing": packing}, 4096, 0, plan=plan)
        assert stream.layout.capacities(64) == [64, 64, 32, 32]
        inputs, targets = stream.batch(0, 4)
        assert (inputs[2:, 2, 32:] == PAD_DOCUMENT).all() and (inputs[2:, 2, :8] != PAD_DOCUMENT).all()
        cut, cut_targets = trim_packed(inputs[2:], targets[2:], 32)
        assert cut.shape == (2, 3, 32) and torch.equal(cut_targets[:, 32:], targets[2:, 64:])
        stream.close()
    line = packing_refusal("concat", "code", plan=plan)
    assert line.startswith("plan: pipelines[1].seq_len") and "\n" not in line


def _worker(config, plan_yaml: str, seq_lens):
    import torch.distributed as dist

    from hrlplan.plan import Plan
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker
    from hrlplan.runtime.trainer import PipelineTrainer

    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    try:
        plan = Plan.from_yaml(plan_yaml)
        for pipe, seq_len in zip(plan.pipelines, seq_lens):
            pipe.seq_len = seq_len
        summary = PipelineTrainer(plan, config, config.run_dir, device=device).fit()
        return summary if dist.get_rank() == 0 else None
    finally:
        shutdown()


def _train_short(tmp_path, packing: str):
    import copy

    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    plan = _short_replica_plan()
    config = copy.deepcopy(as_config(compose([*GPT2, f"data.packing={packing}", f"train.steps={STEPS}",
                                              "train.checkpoint_interval=0", "logger.mode=disabled"])))
    config.run_dir = str(tmp_path / packing)
    summary = launch_workers(_worker, (config, plan.to_yaml(), [p.seq_len if hasattr(p, "seq_len") else None
                                                                 for p in plan.pipelines]),
                             plan.world_size, name="h8-seq-len", log_dir=str(tmp_path / packing / "logs"))[0]
    return summary["history"]


@pytest.mark.slow
def test_a_replica_with_its_own_sequence_length_trains_each_document_as_alone(tmp_path):
    """document and balanced hold the same documents per step (equal losses); the first step's loss and
    gradient norm, before any update, are each document alone through the whole model."""
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.data.lm import build_lm_data
    from hrlplan.data.packing import predictions
    from hrlplan.runtime.trainer import build_full_model

    runs = {p: _train_short(tmp_path, p) for p in ("document", "balanced")}
    losses = {p: [h["train/lm_loss"] for h in runs[p]] for p in runs}
    assert losses["balanced"] == pytest.approx(losses["document"], abs=1e-5)
    cfg = as_config(compose([*GPT2, "data.packing=document"]))
    stream = build_lm_data(cfg.data, 4096, int(cfg.train.seed), plan=_short_replica_plan())
    pieces, _ = stream.documents.step_pieces(0, 4, capacities=stream.layout.capacities(64))
    model = build_full_model(cfg.arch, int(cfg.train.seed))
    total = sum(predictions(p) for p in pieces)
    expected = sum(torch.nn.functional.cross_entropy(model(input_ids=p[None, :-1].long()).logits[0], p[1:].long(),
                                                     reduction="sum") for p in pieces) / total
    expected.backward()
    assert losses["document"][0] == pytest.approx(expected.item(), rel=1e-5)
    norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in model.parameters() if q.grad is not None]))
    assert runs["document"][0]["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)


def test_first_fit_puts_long_pieces_in_long_rows_and_passes_over_what_fits_none():
    from hrlplan.data.packing import first_fit

    assignment, taken = first_fit([6, 3, 7, 2, 5, 1], [8, 4])
    assert taken == [0, 1, 3, 5] and assignment == [[0, 2], [1, 3]]   # 7 and 5 fit no row once 6 and 3 are in
