"""data.packing's memory: a packed pp 2 run's measured peak per rank against the trainer's prediction
(runtime/trainer.predicted_memory with cost/memory.packed_meta), and packed_meta's term itself."""
from __future__ import annotations

import json

import pytest

from test_memory import cpu_cluster


def test_packed_meta_adds_one_hidden_tensor_per_block_and_leaves_other_families():
    from hrlplan.cost.memory import PACKED_EXTRA_HIDDEN_TENSORS, packed_meta
    from hrlplan.model_meta import introspect

    from hrlplan.compose import compose

    cfg = compose(["arch=gpt2-tiny", "arch.n_layer=2", "arch.n_embd=32", "arch.n_head=2", "arch.n_positions=64"])
    meta = introspect(cfg["arch"], seq_len=64)
    packed = packed_meta(meta)
    assert [p - b for p, b in zip(packed.block_activation_bytes_per_token, meta.block_activation_bytes_per_token)] \
        == [2.0 * PACKED_EXTRA_HIDDEN_TENSORS * 32] * 2
    assert packed.hidden_size == meta.hidden_size and packed.block_flops_fwd_per_token == meta.block_flops_fwd_per_token


@pytest.mark.slow
def test_a_packed_pp2_runs_peak_matches_the_plans_prediction_on_every_rank(tmp_path):
    """The last stage used to hold every micro-batch's logits (torch's schedule keeps the outputs it
    returns; the engine now asks for none) and per-document attention keeps one more tensor a block."""
    from hrlplan.compose import compose
    from hrlplan.launch.local_run import train_plan
    from hrlplan.model_meta import introspect
    from hrlplan.plan import homogeneous_plan

    seq = 512
    plan = homogeneous_plan("gpt2-tiny", 4, [(0, 2), (2, 4)], dp=1, tp=1, microbatch_size=1, num_microbatches=4,
                            schedule="1f1b")
    cfg = compose(["arch=gpt2-tiny", "arch.n_layer=4", "arch.vocab_size=4096", f"arch.n_positions={seq}", "data=code", f"data.seq_len={seq}",
                   "data.packing=document", "train.steps=2", "train.global_batch_size=4", "train.schedule=1f1b",
                   "train.checkpoint_interval=0", "logger.mode=disabled"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    introspect(cfg["arch"], seq_len=seq).save(run_dir / "model_meta.json")   # what a job saves before training
    cpu_cluster(plan.world_size).save(run_dir / "cluster.json")
    train_plan(plan, cfg, run_dir, metrics_file=False)
    rows = json.loads((run_dir / "plan_info.json").read_text())["memory"]["per_rank"]
    errors = [(r["measured_bytes"] - r["predicted_bytes"]) / r["predicted_bytes"] for r in rows]
    print("measured", [r["measured_bytes"] for r in rows], "predicted", [r["predicted_bytes"] for r in rows], errors)
    assert len(errors) == 2 and all(abs(e) <= 0.10 for e in errors), errors
