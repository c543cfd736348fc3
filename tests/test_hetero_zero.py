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
