"""cost/lengths.expected_step: the mean step when rows stray from their predicted times as measured rows do."""
import pytest

from hrlplan.cost.lengths import expected_step, pipeline_step, relative_deviations


def _step(pp=2):
    return lambda fwd, bwd: pipeline_step("1f1b", pp, fwd, bwd)


def test_without_deviations_it_is_the_deterministic_step():
    fwd, bwd = [[1.0, 2.0, 1.5], [1.2, 2.2, 1.0]], [[2.0, 4.0, 3.0], [2.4, 4.4, 2.0]]
    assert expected_step(_step(), fwd, bwd, {}) == pipeline_step("1f1b", 2, fwd, bwd)
    nothing = {"F": [[0.0], [0.0]], "B": [[0.0], [0.0]]}
    assert expected_step(_step(), fwd, bwd, nothing, draws=5) == pytest.approx(pipeline_step("1f1b", 2, fwd, bwd))


def test_zero_mean_deviations_lengthen_a_balanced_step_more_than_a_lopsided_one():
    # a step is a maximum over paths: with every micro-batch alike many paths are near-critical, so
    # symmetric straying lengthens it; with one micro-batch far heavier its path stays the critical one
    pools = {"F": [[-0.05, 0.05]] * 2, "B": [[-0.05, 0.05]] * 2}
    even = [[1.0] * 6] * 2
    lopsided = [[0.6, 0.6, 3.0, 0.6, 0.6, 0.6]] * 2
    lift = {}
    for name, fwd in (("even", even), ("lopsided", lopsided)):
        bwd = [[2 * x for x in row] for row in fwd]
        base = pipeline_step("1f1b", 2, fwd, bwd)
        mean = expected_step(_step(), fwd, bwd, pools, draws=400, seed=1)
        assert mean >= base
        lift[name] = mean / base - 1
    assert lift["even"] > 2 * lift["lopsided"]


def test_each_stage_needs_its_pool():
    fwd = bwd = [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match=r"deviations\['B'\]"):
        expected_step(_step(), fwd, bwd, {"F": [[0.1], [0.1]], "B": [[0.1]]})


def test_relative_deviations_skip_rows_predicted_at_no_time():
    assert relative_deviations([1.1, 0.5, 2.0], [1.0, 0.0, 2.5]) == pytest.approx([0.1, -0.2])
