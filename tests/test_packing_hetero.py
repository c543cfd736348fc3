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
@pytest.mark.parametrize("packing", ["document", "balanced"])
def test_packed_heterogeneous_replicas_train_as_one_process(tmp_path, packing):
    run = train_with_options(_hetero_plan(), [*GPT2, f"data.packing={packing}"], tmp_path / packing, STEPS)
    assert run["losses"] == pytest.approx(_one_process(tmp_path), abs=1e-5)


@pytest.mark.slow
def test_packed_replicas_at_tp_1_and_2_train_as_one_process(tmp_path):
    """Replica B's stage tensor-parallel over two ranks: per-document attention on its heads, the packed
    loss over its vocabulary-parallel head."""
    run = train_with_options(_hetero_plan(tp_whole=2), [*GPT2, "data.packing=document"], tmp_path / "tp", STEPS)
    assert run["losses"] == pytest.approx(_one_process(tmp_path), abs=1e-5)
