"""The per-document attention kernel's timed curve (cost/attention_curve.py) and its use as a row's attention."""
import pytest

from hrlplan.cost.attention_curve import AttentionCurve, grid_lengths
from hrlplan.cost.lengths import RowShares, micro_batch_multipliers
from hrlplan.model_meta import introspect
from hrlplan.runtime.calibrate.attention_curve import measure_attention_curve


def _curve():
    return AttentionCurve((1, 10, 20), (1.0, 2.0, 4.0), (3.0, 5.0, 9.0))


def test_the_curve_is_its_points_linear_between_and_the_square_past_the_last():
    c = _curve()
    assert c.seconds(10, "F") == 2.0 and c.seconds(10, "B") == 5.0
    assert c.seconds(15, "F") == pytest.approx(3.0) and c.seconds(15, "B") == pytest.approx(7.0)
    assert c.seconds(40, "F") == pytest.approx(16.0)   # (40 / 20)^2 x 4
    assert c.seconds(0, "F") == 0.0
    assert c.row_seconds([1, 10, 10], "B") == pytest.approx(13.0)
    assert c.rows([[1], [20, 10]]) == {"F": [1.0, 6.0], "B": [3.0, 14.0]}
    assert AttentionCurve.from_dict(c.to_dict()) == c


def test_a_curve_needs_increasing_lengths_and_a_time_for_each():
    with pytest.raises(ValueError, match="increasing"):
        AttentionCurve((10, 1), (1.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="one forward and one backward"):
        AttentionCurve((1, 10), (1.0,), (1.0, 1.0))


def test_the_grid_takes_both_ends_of_every_tooth_and_each_cpu_kernel_switch():
    grid = grid_lengths(2048)
    assert grid[:32] == tuple(range(1, 33)) and grid[-1] == 2048
    # the forward's sawtooth drops at each multiple of 16; the backward steps at each multiple of 512;
    # the query blocks switch at 192 and 768 (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)
    for switch in list(range(48, 2049, 16)) + [192, 512, 768, 1024, 1536]:
        assert switch - 1 in grid and switch in grid
    assert len(grid) == 32 + 2 * (2048 // 16 - 2)
    assert grid_lengths(600)[-3:] == (591, 592, 600) and grid_lengths(20) == tuple(range(1, 21))
    with pytest.raises(ValueError, match="budget"):
        grid_lengths(0)


def squares_curve(budget, seconds_per_square):
    lengths = tuple(range(1, budget + 1))
    values = tuple(seconds_per_square * n * n for n in lengths)
    return AttentionCurve(lengths, values, values)


def _meta(budget):
    from hrlplan.compose import compose
    from hrlplan.config import as_config

    cfg = as_config(compose(["arch=gpt2-tiny", "arch.n_layer=2", "arch.n_embd=32", "arch.n_head=4",
                             f"arch.n_positions={budget}", f"data.seq_len={budget}"]))
    return introspect(cfg.arch, budget)


def test_multipliers_in_a_timed_measure_equal_those_of_the_squares_when_the_curve_is_the_squares():
    budget, spans = 64, [(0, 1), (1, 2)]
    meta = _meta(budget)
    rows = [[64], [10, 20, 30], [5]]
    shares = [RowShares(attention=0.5, per_document=0.01, useful=0.2)] * 2
    docs, useful = [len(r) for r in rows], [sum(r) for r in rows]
    squares = [sum(n * n for n in r) for r in rows]
    plain = micro_batch_multipliers(meta, spans, budget, squares, docs, useful, shares)
    curve = squares_curve(budget, 3e-9)
    timed = micro_batch_multipliers(meta, spans, budget, [curve.row_seconds(r, "F") for r in rows], docs, useful,
                                    shares, attention_unit=curve.seconds(budget, "F"))
    for a, b in zip(plain, timed):
        assert a == pytest.approx(b)
    assert plain[0][0] == pytest.approx(1.0)   # the one-document row is the simulator's micro-batch


def test_a_kernel_whose_short_documents_cost_more_per_square_weighs_their_rows_more():
    budget, spans = 64, [(0, 1), (1, 2)]
    meta = _meta(budget)
    # short documents twice as dear per square as the full row's (a kernel's per-call and block costs)
    curve = AttentionCurve((1, 16, 64), (2e-9, 2 * 256e-9, 4096e-9), (2e-9, 2 * 256e-9, 4096e-9))
    shares = [RowShares(attention=0.8)] * 2
    many_short = [16] * 4
    timed = micro_batch_multipliers(meta, spans, budget, [curve.row_seconds(many_short, "F")], shares=shares,
                                    attention_unit=curve.seconds(budget, "F"))
    plain = micro_batch_multipliers(meta, spans, budget, [4 * 16 * 16], shares=shares)
    assert timed[0][0] == pytest.approx(0.2 + 0.8 * 2 * 1024 / 4096)
    assert timed[0][0] > plain[0][0]


def test_measuring_the_curve_times_each_length_on_one_thread_and_restores_the_threads():
    import torch

    threads = torch.get_num_threads()
    c = measure_attention_curve(heads=2, head_width=4, budget=32, repeats=1, lengths=(1, 8, 32))
    assert c.lengths == (1, 8, 32)
    assert all(t > 0 for t in c.forward_s + c.backward_s)
    assert torch.get_num_threads() == threads
