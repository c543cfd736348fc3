"""Replicas holding one parameter at different tp degrees checkpoint and resume.

One replica holds every layer whole on one rank, the other tensor-parallel over two: the same
parameter is a full tensor on one rank and two shards on two others, and torch.distributed.checkpoint
refuses overlapping chunks of one key. Only each parameter's canonical holder writes it
(HeteroPipelineEngine.checkpoint_writes); every holder loads it back resharded to its own tp."""
import pytest

from hrlplan.compose import compose
from hrlplan.launch.local_run import train_plan
from hrlplan.runtime.reference import train_single_process
from hrlplan.runtime.template import PipelineTemplate, build_plan, get_modules
from hrlplan.runtime.trainer import build_full_model

LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"]

pytestmark = pytest.mark.slow


def _plan():
    model = build_full_model(compose(LLAMA)["arch"], 0, materialized=False)   # on the meta device
    modules = get_modules(model)
    whole, sharded = PipelineTemplate(model, [modules]), PipelineTemplate(model, [modules], tp=[2])
    return build_plan([whole, sharded], {whole: 2, sharded: 2}, world_size=3, global_batch_size=8,
                      model="llama-tiny")


def test_replicas_at_different_tp_resume_the_one_process_curve(tmp_path):
    plan = _plan()
    assert [[s.tp for s in p.stages] for p in plan.pipelines] == [[1], [2]]
    config = compose([*LLAMA, "train.steps=2", "train.checkpoint_interval=1", "logger.mode=disabled"])
    first = train_plan(plan, dict(config, train=dict(config["train"], stop_after=1)), tmp_path)
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()
    resumed = train_plan(plan, dict(config, train=dict(config["train"], resume="auto")), tmp_path)
    losses = {h["step"]: h["train/lm_loss"] for h in first["history"] + resumed["history"]}
    assert sorted(losses) == [1, 2]
    reference = [h["loss"] for h in train_single_process(config, 2)]
    assert [losses[1], losses[2]] == pytest.approx(reference, abs=1e-5)
