"""Heterogeneous replicas and stages of unequal tp train exactly what one process trains."""
import pytest

from hrlplan.launch.local_run import compare_with_one_process
from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules

pytestmark = pytest.mark.slow

# See tests/test_pipeline.py: fp32 reassociation noise grows with Adam's step size.
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"]
LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"]


def _model(arch):
    import torch

    from hrlplan.compose import compose
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch

    with torch.device("meta"):
        return build_hf_model(hf_config_from_arch(compose(arch)["arch"]))


REPLICA_STEPS = 6


@pytest.fixture(scope="module")
def replicas_run(tmp_path_factory):
    """_replicas_plan() (the uneven shares 2 and 6) trained 6 steps, and one process's losses: the
    uneven-shares case below and the resume test's uninterrupted run."""
    return compare_with_one_process(_replicas_plan(), GPT2, tmp_path_factory.mktemp("replicas"), steps=REPLICA_STEPS)


@pytest.mark.parametrize("batch_sizes", [[4, 4], [2, 6]], ids=["even", "uneven-shares"])
def test_replicas_all_layers_and_3_1_match_one_process(tmp_path, batch_sizes, request):
    """Replica A: one stage with every layer; replica B: stages of 3 and 1 layers (tied GPT-2)."""
    model = _model(GPT2)
    modules = get_modules(model)
    one = PipelineTemplate(model, [modules])
    two = PipelineTemplate(model, [modules[:-3], modules[-3:]])   # [E, h0-h2] | [h3, ln_f, head]
    assert two.spans == ((0, 3), (3, 4))
    plan = build_plan([one, two], {one: 2, two: 2}, world_size=3, global_batch_size=8, batch_sizes=batch_sizes,
                      model="gpt2-tiny")
    if plan.to_yaml() == _replicas_plan().to_yaml():   # uneven shares: the run the resume test shares
        losses, reference = request.getfixturevalue("replicas_run")
    else:
        losses, reference = compare_with_one_process(plan, GPT2, tmp_path)
    assert losses == pytest.approx(reference, abs=1e-5)


def test_stages_with_tp_2_and_1_match_one_process(tmp_path):
    """Llama-shaped: stage 0 tensor-parallel over two ranks feeds stage 1 on one rank."""
    model = _model(LLAMA)
    modules = get_modules(model)
    template = PipelineTemplate(model, [modules[:4], modules[4:]], tp=[2, 1])
    plan = build_plan([template], {template: 4}, world_size=3, global_batch_size=8, model="llama-tiny")
    assert [s.tp for s in plan.pipelines[0].stages] == [2, 1]
    losses, reference = compare_with_one_process(plan, LLAMA, tmp_path)
    assert losses == pytest.approx(reference, abs=1e-5)


def _replicas_plan():
    model = _model(GPT2)
    modules = get_modules(model)
    one, two = PipelineTemplate(model, [modules]), PipelineTemplate(model, [modules[:-3], modules[-3:]])
    return build_plan([one, two], {one: 2, two: 2}, world_size=3, global_batch_size=8, batch_sizes=[2, 6],
                      model="gpt2-tiny")


def test_heterogeneous_replicas_resume_the_same_loss_curve(tmp_path, replicas_run):
    """Two replicas hold every layer: the checkpoint keeps one copy per parameter name, and each
    replica's stages load theirs back under their own split. The uninterrupted run is replicas_run
    (the same plan and config: compare_with_one_process's overrides)."""
    from hrlplan.compose import compose
    from hrlplan.launch.local_run import train_plan

    config = compose([*GPT2, f"train.steps={REPLICA_STEPS}", "train.checkpoint_interval=0", "logger.mode=disabled"])
    train_plan(_replicas_plan(), dict(config, train=dict(config["train"], stop_after=3)), tmp_path / "cut")
    resumed = train_plan(_replicas_plan(), dict(config, train=dict(config["train"], resume="auto")), tmp_path / "cut")
    full = dict(enumerate(replicas_run[0], start=1))
    again = {h["step"]: h["train/lm_loss"] for h in resumed["history"]}
    assert sorted(again) == [4, 5, 6]
    for step in again:
        assert again[step] == pytest.approx(full[step], abs=1e-6)


def test_heterogeneous_replicas_train_in_bfloat16(tmp_path):
    """train.dtype=bfloat16 runs the stages under bf16 autocast (fp32 weights, gradients and
    messages): the losses follow the fp32 run closely without being the fp32 numbers."""
    losses, reference = compare_with_one_process(_replicas_plan(), [*GPT2, "train.dtype=bfloat16"], tmp_path)
    assert losses == pytest.approx(reference, rel=2e-2)
    assert max(abs(a - b) for a, b in zip(losses, reference)) > 1e-5
