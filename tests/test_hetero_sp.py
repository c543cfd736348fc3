"""Sequence parallelism inside a heterogeneous replica (runtime/hetero.py, issue 35): a replica whose
stages all run it at one tp passes the sequence shard between them; beside a plain replica (tp 1) the
gradients still synchronise across replicas, so the losses equal one process."""
import pytest

from hrlplan.plan import Plan
from hrlplan.plan.checks import PlanError, validate
from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules

GPT2 = ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"]
LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"]


def _model(arch):
    from hrlplan.compose import compose
    from hrlplan.runtime.trainer import build_full_model

    return build_full_model(compose(arch)["arch"], 0, materialized=False)   # on the meta device


def sp_replica_plan(arch, model_name: str, batch_sizes=(4, 4)) -> Plan:
    """Replica A: every layer on rank 0 (tp 1); replica B: two stages at tp 2 with sequence
    parallelism on ranks 1-2 and 3-4."""
    model = _model(arch)
    modules = get_modules(model)
    whole = PipelineTemplate(model, [modules])
    split = PipelineTemplate(model, [modules[:3], modules[3:]], tp=[2, 2])
    plan = build_plan([whole, split], {whole: 2, split: 2}, world_size=5, global_batch_size=8,
                      batch_sizes=list(batch_sizes), model=model_name)
    for stage in plan.pipelines[1].stages:
        stage.sequence_parallel = True
    validate(plan)
    return Plan.from_yaml(plan.to_yaml())


@pytest.mark.slow
def test_llama_sp_replica_beside_a_plain_one_resumes_sharded_on_the_one_process_curve(tmp_path):
    """Steps 1-2 with each replica stepping its whole model, steps 3-4 resumed from that checkpoint with
    the optimizer sharded across the replicas: one process's curve (the norms' gradients are Partial
    under sequence parallelism until replicate_partial_grads sums them; without it step 2 is off)."""
    from hrlplan.compose import compose
    from hrlplan.launch.local_run import train_plan
    from hrlplan.runtime.reference import train_single_process
    from tests._sharded_optimizer_runs import train_sharded

    plan = sp_replica_plan(LLAMA, "llama-tiny", (2, 6))
    config = compose([*LLAMA, "train.steps=4", "train.checkpoint_interval=1", "logger.mode=disabled"])
    first = train_plan(plan, dict(config, train=dict(config["train"], stop_after=2)), tmp_path)
    second = train_sharded(plan, dict(config, train=dict(config["train"], resume="auto")), tmp_path)
    assert second["sharded"] == [True] * 5
    losses = {h["step"]: h["train/lm_loss"] for h in first["history"] + second["history"]}
    assert sorted(losses) == [1, 2, 3, 4]
    reference = [h["loss"] for h in train_single_process(config, 4)]
    assert [losses[s] for s in (1, 2, 3, 4)] == pytest.approx(reference, abs=1e-5)


@pytest.mark.slow
def test_gpt2_sp_replica_beside_a_plain_one_sharded_matches_one_process(tmp_path, monkeypatch):
    """GPT-2's blocks at tp 2 (nn.Linear, q/k/v regrouped) and at tp 1 (Conv1D) reduce whole across the
    replicas, sliced over each bucket's ranks by the sharded optimizer; the SP replica's layer norms'
    weights and biases are Replicate DTensors."""
    from tests._sharded_optimizer_runs import compare_sharded_with_one_process

    monkeypatch.setenv("HRLPLAN_GRAD_BUCKET_MB", "0.05")   # several buckets, each sliced over its set
    losses, reference, summary = compare_sharded_with_one_process(sp_replica_plan(GPT2, "gpt2-tiny"), GPT2,
                                                                  tmp_path, steps=3)
    assert summary["sharded"] == [True] * 5
    assert losses == pytest.approx(reference, abs=1e-5)

def _refusal(plan: Plan) -> str:
    with pytest.raises(PlanError) as info:
        validate(plan)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_replica_sets_sequence_parallel_on_all_its_stages_at_one_tp_or_on_none():
    plan = sp_replica_plan(LLAMA, "llama-tiny")
    plan.pipelines[1].stages[1].sequence_parallel = False
    assert _refusal(plan).startswith("plan.yaml: pipelines[1].stages[1].sequence_parallel: is false while another")
    plan = sp_replica_plan(LLAMA, "llama-tiny")
    plan.pipelines[0].stages[0].sequence_parallel = True   # tp 1
    assert "pipelines[0].stages[0].sequence_parallel: shards over the tp ranks but the stage has tp 1" in _refusal(plan)


def test_sequence_parallel_stages_of_unequal_tp_and_a_seq_len_off_the_tp_are_refused():
    model = _model(LLAMA)
    modules = get_modules(model)
    unequal = PipelineTemplate(model, [modules[:3], modules[3:]], tp=[2, 1])
    plan = build_plan([unequal], {unequal: 2}, world_size=3, global_batch_size=4, model="llama-tiny")
    plan.pipelines[0].stages[0].sequence_parallel = True
    plan.pipelines[0].stages[1].sequence_parallel = True
    assert "pipelines[0].stages[1].sequence_parallel" in _refusal(plan)   # tp 1 there
    unequal = PipelineTemplate(model, [modules[:3], modules[3:]], tp=[2, 4])
    plan = build_plan([unequal], {unequal: 2}, world_size=6, global_batch_size=4, model="llama-tiny")
    for stage in plan.pipelines[0].stages:
        stage.sequence_parallel = True
    assert "pipelines[0].stages[1].tp: is 4 but stage 0's is 2: sequence parallelism in a pipeline needs one tp" \
        in _refusal(plan)
    plan = sp_replica_plan(LLAMA, "llama-tiny")
    plan.pipelines[1].seq_len = 63
    assert "pipelines[1].seq_len: 63 is not divisible by the pipeline's tp 2" in _refusal(plan)


def test_data_seq_len_off_the_sp_replicas_tp_is_named():
    from hrlplan.plan.checks import sequence_parallel_length_refusal

    plan = sp_replica_plan(LLAMA, "llama-tiny")
    assert sequence_parallel_length_refusal(plan, 64) == ""
    assert sequence_parallel_length_refusal(plan, 63).startswith("data.seq_len=63 is not divisible by tp 2")
    plan.pipelines[1].seq_len = 32   # the replica's own length decides (checked by validate)
    assert sequence_parallel_length_refusal(plan, 63) == ""


@pytest.mark.slow
def test_packed_documents_through_an_sp_replica_train_as_one_process(tmp_path):
    """data.packing=document: the SP replica's stages send sequence shards while every rank reads its
    rows' whole positions and document ids; per-document attention on the gathered sequence."""
    from _plan_options import train_with_options
    from test_packing_hetero import GPT2 as PACKED, STEPS, _one_process

    from hrlplan.compose import compose

    model = _model(PACKED)
    modules = get_modules(model)
    split = PipelineTemplate(model, [modules[:3], modules[3:]], tp=[2, 2])   # wte, wpe, h0 | h1, ln_f, head
    whole = PipelineTemplate(model, [modules])
    plan = build_plan([split, whole], {split: 2, whole: 1}, world_size=5, global_batch_size=4, batch_sizes=[2, 2],
                      model="gpt2-tiny")
    for stage in plan.pipelines[0].stages:
        stage.sequence_parallel = True
    validate(plan)
    assert compose(PACKED)["arch"]["vocab_size"] % 2 == 0   # the vocabulary-parallel embedding reduce-scatters
    run = train_with_options(plan, [*PACKED, "data.packing=document"], tmp_path / "sp", STEPS)
    assert run["losses"] == pytest.approx(_one_process(tmp_path), abs=1e-5)
