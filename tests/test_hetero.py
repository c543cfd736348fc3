"""Heterogeneous replicas and stages of unequal tp train exactly what one process trains."""
import pytest

from hrlplan.runtime.local_run import compare_with_one_process
from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules

pytestmark = pytest.mark.slow

# See tests/test_pipeline.py: fp32 reassociation noise grows with Adam's step size.
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"]
LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"]


def _model(arch):
    import torch

    from hrlplan.config import compose
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch

    with torch.device("meta"):
        return build_hf_model(hf_config_from_arch(compose(arch)["arch"]))


@pytest.mark.parametrize("batch_sizes", [[4, 4], [2, 6]], ids=["even", "uneven-shares"])
def test_replicas_all_layers_and_3_1_match_one_process(tmp_path, batch_sizes):
    """Replica A: one stage with every layer; replica B: stages of 3 and 1 layers (tied GPT-2)."""
    model = _model(GPT2)
    modules = get_modules(model)
    one = PipelineTemplate(model, [modules])
    two = PipelineTemplate(model, [modules[:-3], modules[-3:]])   # [E, h0-h2] | [h3, ln_f, head]
    assert two.spans == ((0, 3), (3, 4))
    plan = build_plan([one, two], {one: 2, two: 2}, world_size=3, global_batch_size=8, batch_sizes=batch_sizes,
                      model="gpt2-tiny")
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
