"""bench/published.py: the simulator reproduces Megatron-LM's measured SC'21 Table 1 within its targets."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_megatron_table_1_rows_fit_and_match_the_measurements():
    import published

    s = published.run()
    assert s["feasible"] == len(published.ROWS) == 10
    assert s["median_abs_error"] <= 0.08
    assert s["max_abs_error"] <= 0.15
    assert s["spearman"] >= 0.6


def test_paper_flop_formula():
    import pytest

    import published

    h, s, v = 25600, 2048, 51200
    expected = 96 * 3072 * s * 128 * h * h * (1 + s / (6 * h) + v / (16 * 128 * h))
    assert published.paper_flops(3072, 128, h) == pytest.approx(expected)
    # the 1T row at its measured 163 TFLOP/s per GPU: ~102 s per iteration
    assert 95 < expected / (3072 * 163e12) < 110
