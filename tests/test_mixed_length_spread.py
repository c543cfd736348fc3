"""cost/lengths.expected_step: the mean step when rows stray from their predicted times as measured rows of
like size do (RowSpread)."""
import pytest

from hrlplan.cost.lengths import RowSpread, expected_step, pipeline_step


def _step(pp=2):
    return lambda fwd, bwd: pipeline_step("1f1b", pp, fwd, bwd)


def _spread(deviation, stages=2, neighbours=None):
    """Rows of 1 s and of 10 s per stage: the small ones stray by +-deviation, the large ones not at all."""
    timed = [[1 + deviation, 1 - deviation, 10.0, 10.0]] * stages
    predicted = [[1.0, 1.0, 10.0, 10.0]] * stages
    return RowSpread.from_timings({"F": timed, "B": timed}, {"F": predicted, "B": predicted}, neighbours)


def test_without_a_spread_or_with_none_it_is_the_deterministic_step():
    fwd, bwd = [[1.0, 2.0, 1.5], [1.2, 2.2, 1.0]], [[2.0, 4.0, 3.0], [2.4, 4.4, 2.0]]
    unit = {"F": [1.0, 1.0], "B": [1.0, 1.0]}
    assert expected_step(_step(), fwd, bwd, None, unit) == pipeline_step("1f1b", 2, fwd, bwd)
    still = expected_step(_step(), fwd, bwd, _spread(0.0, neighbours=2), unit, draws=5)
    assert still == pytest.approx(pipeline_step("1f1b", 2, fwd, bwd))


def test_a_row_draws_from_rows_of_its_size_centred():
    spread = _spread(0.1, neighbours=2)
    assert sorted(spread.pool("F", 0, 1.2)) == pytest.approx([-0.1, 0.1])
    assert spread.pool("B", 1, 9.0) == pytest.approx([0.0, 0.0])
    skewed = RowSpread.from_timings({"F": [[1.3, 1.1]], "B": [[1.0, 1.0]]}, {"F": [[1.0, 1.0]], "B": [[1.0, 1.0]]})
    assert sorted(skewed.pool("F", 0, 1.0)) == pytest.approx([-0.1, 0.1])   # the mean is the line's, not the spread's


def test_straying_lengthens_a_balanced_step_more_than_a_lopsided_one():
    # a step is a maximum over paths: with every micro-batch alike many paths are near-critical, so
    # symmetric straying lengthens it; with one micro-batch far heavier its path stays the critical one
    spread = _spread(0.05, neighbours=2)
    unit = {"F": [1.0, 1.0], "B": [0.5, 0.5]}   # rows of work 1 (forward) and 2 (backward) are "1 s" rows
    lift = {}
    for name, fwd in (("even", [[1.0] * 6] * 2), ("lopsided", [[1.0, 1.0, 5.0, 1.0, 1.0, 1.0]] * 2)):
        bwd = [[2 * x for x in row] for row in fwd]
        base = pipeline_step("1f1b", 2, fwd, bwd)
        mean = expected_step(_step(), fwd, bwd, spread, unit, draws=400, seed=1)
        assert mean >= base
        lift[name] = mean / base - 1
    assert lift["even"] > 2 * lift["lopsided"] > 0


def test_each_stage_needs_its_rows():
    spread = _spread(0.1, stages=1)
    with pytest.raises(ValueError, match="one entry for each of the 2 stages"):
        expected_step(_step(), [[1.0], [1.0]], [[1.0], [1.0]], spread, {"F": [1.0], "B": [1.0]})
    with pytest.raises(ValueError, match="at least one timed row"):
        RowSpread.from_timings({"F": [[1.0]], "B": [[1.0]]}, {"F": [[0.0]], "B": [[1.0]]})
