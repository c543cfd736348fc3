"""Tensor parallel inside pipeline stages (DTensor), the embedding and head vocabulary-parallel by
default, trains exactly what one process trains (pp 2 x tp 2 on 4 gloo ranks; the runs are shared
with tests/test_sequence_parallel.py through tests/_tp_runs.py)."""
import pytest

from _tp_runs import one_process_losses, pp2_tp2_run

pytestmark = pytest.mark.slow


def test_pp2_tp2_llama_matches_one_process():
    assert pp2_tp2_run("llama", False)["losses"] == pytest.approx(one_process_losses("llama"), abs=1e-5)


def test_gpt2_pp2_tp2_tied_vocabulary_parallel_matches_one_process():
    """GPT-2's Conv1D layers are converted to nn.Linear (q/k/v rows regrouped per rank) to be sharded;
    its tied embedding and head are vocabulary-parallel on the first and last stage, each a copy
    whose gradient shards are summed across the two stages (TiedEmbeddingSync, per tp rank)."""
    assert pp2_tp2_run("gpt2", False)["losses"] == pytest.approx(one_process_losses("gpt2"), abs=1e-5)
