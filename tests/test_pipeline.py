"""Pipeline plans train exactly the model one process trains (same data, seed, optimizer)."""
import pytest

from _runs import reference_losses, run_plan
from hrlplan.schedules import DEFAULT

pytestmark = pytest.mark.slow


# Micro-batching sums gradients in another order than one big batch; fp32 noise of ~1e-7 grows
# with Adam's step size, so these comparisons pin a moderate lr (the default's, whatever it becomes).
LR = ["train.lr=3e-3"]


@pytest.fixture(scope="module")
def reference():
    return reference_losses(steps=5, extra=LR)


# an uneven split through the job path (planner=manual); that every registry schedule, GPipe included,
# trains like one process: tests/test_schedule_training.py
def test_pp2_uneven_matches_one_process(tmp_path, reference):
    losses = run_plan(tmp_path, [(0, 4), (4, 6)], dp=1, schedule=DEFAULT, extra=LR)
    assert losses == pytest.approx(reference, abs=1e-5)


def test_pp2_dp2_matches_one_process(tmp_path, reference):
    losses = run_plan(tmp_path, [(0, 2), (2, 6)], dp=2, schedule=DEFAULT, microbatches=2, extra=LR)
    assert losses == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("dp", [1, 2], ids=["autocast", "fsdp-mixed-precision"])
def test_bfloat16_computes_in_bf16_with_or_without_data_parallel(tmp_path, reference, dp):
    """train.dtype=bfloat16: FSDP's MixedPrecisionPolicy where stages are sharded, bf16 autocast
    where nothing shards them (a pure pipeline); either way close to fp32, never the fp32 numbers."""
    losses = run_plan(tmp_path, [(0, 2), (2, 6)], dp=dp, schedule=DEFAULT, microbatches=2,
                      extra=[*LR, "train.dtype=bfloat16"])
    assert losses == pytest.approx(reference, rel=2e-2)
    assert max(abs(a - b) for a, b in zip(losses, reference)) > 1e-5
