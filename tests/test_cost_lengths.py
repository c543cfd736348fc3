"""cost/lengths.py: what packed documents of mixed length cost a step."""
import pytest
import torch

from hrlplan.cost.lengths import (LengthDistribution, document_coefficients, micro_batch_multipliers,
                                  packed_step_times, pipeline_step, sample_steps, scaled)
from hrlplan.cost.timeline import simulate_timeline
from hrlplan.model_meta import introspect

EOT = 1


def _distribution(budget=64):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 90, (200,), generator=g).tolist()
    stream = torch.cat([torch.cat([torch.full((n - 1,), 5), torch.tensor([EOT])]) for n in lengths])
    return LengthDistribution.from_tokens(stream, EOT, budget)


def _meta(budget=64):
    arch = dict(name="t", model_type="gpt2", n_embd=32, n_layer=4, n_head=4, n_positions=budget, vocab_size=64)
    return introspect(arch, budget)


def test_distribution_cuts_at_the_budget_and_round_trips():
    d = _distribution()
    assert max(d.lengths) <= 64 and min(d.lengths) >= 1
    assert LengthDistribution.from_dict(d.to_dict()).lengths == d.lengths
    assert d.summary()["token_weighted_mean"] >= d.summary()["mean"]


def test_both_packings_of_a_sampled_step_hold_the_same_tokens_and_balanced_is_no_slower():
    d = _distribution()
    document, balanced = (sample_steps(d, 4, p, 10, seed=1, stages=2) for p in ("document", "balanced"))
    for a, b in zip(document, balanced):
        assert sorted(n for r in a.rows for n in r) == sorted(n for r in b.rows for n in r)
        assert all(sum(r) <= 64 for r in b.rows)
        assert max(b.square_sums) <= max(a.square_sums)


def test_multipliers_are_one_for_a_full_document_and_follow_the_squares():
    meta = _meta()
    spans = [(0, 2), (2, 4)]
    m = micro_batch_multipliers(meta, spans, 64, [64 * 64, 0, 32 * 32 * 2])
    for row in m:
        assert row[0] == pytest.approx(1.0)
        assert row[1] < row[2] < 1.0
    linear, quadratic = document_coefficients(meta)
    assert linear > 0 and quadratic == pytest.approx(3 * 4 * 32 * 4)


def test_pipeline_step_equals_the_simulators_timeline_for_equal_micro_batches():
    fwd, bwd = [1.0, 1.5], [2.0, 2.5]
    ones = [[1.0] * 4, [1.0] * 4]
    walked = pipeline_step("1f1b", 2, scaled(fwd, ones), scaled(bwd, ones), send=[0.1, 0.0])
    timeline = simulate_timeline("1f1b", 2, 1, 4, fwd, bwd, [0.0, 0.0], [0.1, 0.0], [0.1, 0.0], [0.0, 0.0])
    assert walked == pytest.approx(timeline.makespan)


def test_packed_step_times_rank_balanced_no_slower_than_document():
    d, meta = _distribution(), _meta()
    spans = [(0, 2), (2, 4)]

    def step_of(work):
        return pipeline_step("1f1b", 2, scaled([1.0, 1.0], work), scaled([2.0, 2.0], work))

    times = {p: packed_step_times(step_of, meta, spans, d, 4, p, steps=8) for p in ("document", "balanced")}
    assert sum(times["balanced"]) <= sum(times["document"])


def test_layouts_rank_by_their_mean_packed_step_and_multi_row_micro_batches_are_refused():
    import statistics

    from hrlplan.cost.lengths import rank_by_packed_step, simulator_attention_shares, simulator_step_of
    from hrlplan.cost.model import CostOptions, Layout
    from hrlplan.cost.simulator import Simulator
    from test_memory import cpu_cluster

    meta, d = _meta(), _distribution()
    sim = Simulator(meta, cpu_cluster(2), CostOptions())
    layouts = [Layout(spans=((0, 2), (2, 4)), groups=((0,), (1,)), tp=1, dp=1, microbatch_size=1, num_microbatches=m,
                      schedule="1f1b") for m in (6, 2)]
    ranked = rank_by_packed_step(sim, layouts, d, "balanced", steps=3, seed=1)
    assert [i for _, i in ranked] == [1, 0] and ranked[0][0] < ranked[1][0]   # 2 micro-batches hold fewer rows
    for mean, i in ranked:
        layout = layouts[i]
        times = packed_step_times(simulator_step_of(sim, layout), meta, layout.spans, d, layout.num_microbatches,
                                  "balanced", 3, seed=1, shares=simulator_attention_shares(sim, layout))
        assert mean == pytest.approx(statistics.fmean(times), rel=0.05)   # the dispatch runs against a clock
    two_rows = Layout(spans=((0, 4),), groups=((0,),), tp=1, dp=1, microbatch_size=2, num_microbatches=2,
                      schedule="1f1b")
    with pytest.raises(ValueError, match="one-row micro-batches"):
        rank_by_packed_step(sim, [two_rows], d, "document")


def test_a_corpus_not_built_yet_has_no_lengths(tmp_path):
    assert LengthDistribution.of_corpus(str(tmp_path / "absent"), 64) is None
