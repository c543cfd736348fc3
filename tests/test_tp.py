"""Tensor parallel inside pipeline stages (DTensor), the embedding and head vocabulary-parallel by
default, trains exactly what one process trains."""
import pytest

from hrlplan.plan import homogeneous_plan
from hrlplan.launch.local_run import compare_with_one_process

pytestmark = pytest.mark.slow


def test_pp2_tp2_llama_matches_one_process(tmp_path):
    plan = homogeneous_plan("llama-tiny", 4, [(0, 2), (2, 4)], dp=1, tp=2, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    losses, reference = compare_with_one_process(
        plan, ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3"], tmp_path)
    assert losses == pytest.approx(reference, abs=1e-5)


def test_gpt2_pp2_tp2_tied_vocabulary_parallel_matches_one_process(tmp_path):
    """GPT-2's Conv1D layers are converted to nn.Linear (q/k/v rows regrouped per rank) to be sharded;
    its tied embedding and head are vocabulary-parallel on the first and last stage, each a copy
    whose gradient shards are summed across the two stages (TiedEmbeddingSync, per tp rank)."""
    plan = homogeneous_plan("gpt2-tiny", 4, [(0, 2), (2, 4)], dp=1, tp=2, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    losses, reference = compare_with_one_process(plan, ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3"], tmp_path,
                                                 steps=3)
    assert losses == pytest.approx(reference, abs=1e-5)
