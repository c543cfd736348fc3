"""Mixed-length steps in the simulator (micro_batch_work) and a dispatch that minimises the pipeline's step."""
import random

import pytest

from hrlplan.cost.lengths import (LengthDistribution, RowShares, dispatch_model, micro_batch_multipliers,
                                  packed_step_times, simulator_step_of)
from hrlplan.cost.simulator import Simulator
from hrlplan.cost.timeline import simulate_shared_timeline, simulate_timeline
from hrlplan.data import dispatch as D
from hrlplan.model_meta import introspect
from tests.test_cost import pipeline, toy_cluster, toy_meta

P, M = 2, 4
ZERO = [0.0] * P


def _timeline(work=None, schedule="1f1b", sends=ZERO):
    return simulate_timeline(schedule, P, 1, M, [1.0, 1.2], [2.0, 2.3], ZERO, sends, sends, [1.0] * P,
                             micro_batch_work=work)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_micro_batch_work_of_ones_changes_nothing_and_scales_the_step(schedule):
    ones = [[1.0] * M for _ in range(P)]
    assert _timeline(ones, schedule).makespan == _timeline(None, schedule).makespan
    doubled = [[2.0] * M for _ in range(P)]
    assert _timeline(doubled, schedule).makespan == pytest.approx(2 * _timeline(None, schedule).makespan)


def test_the_order_of_unequal_micro_batches_moves_the_1f1b_step():
    """Fill waits on the first micro-batch's forward, drain on the last's backward: the heavy one
    costs least inside the pipeline's steady state (same total work: 27 against 25)."""
    heavy_last = [[1.0, 1.0, 1.0, 3.0]] * P
    heavy_inside = [[1.0, 3.0, 1.0, 1.0]] * P
    light_last = [[3.0, 1.0, 1.0, 1.0]] * P

    def equal_stages(work):
        return simulate_timeline("1f1b", P, 1, M, [1.0] * P, [2.0] * P, ZERO, ZERO, ZERO, [1.0] * P,
                                 micro_batch_work=work).makespan

    assert equal_stages(heavy_inside) == pytest.approx(25.0) and equal_stages(heavy_last) == pytest.approx(27.0)
    trace = []
    simulate_timeline("1f1b", P, 1, M, [1.0] * P, [2.0] * P, ZERO, ZERO, ZERO, [1.0] * P, trace=trace,
                      micro_batch_work=light_last)
    assert {(k, j): round(end - start, 9) for _, kind, k, j, start, end in trace if kind == 0}[(0, 0)] == 3.0


def test_shared_timeline_takes_the_same_work_and_equals_the_plain_one_unslowed():
    work = [[1.0, 0.5, 2.0, 1.5], [0.7, 1.0, 1.3, 0.9]]
    plain = _timeline(work, sends=[0.1, 0.0])
    shared = simulate_shared_timeline("1f1b", P, 1, M, [1.0, 1.2], [2.0, 2.3], ZERO, [0.1, 0.0], [0.1, 0.0],
                                      [1.0] * P, contention=1.0, micro_batch_work=work)
    assert shared.makespan == pytest.approx(plain.makespan)


def test_backward_work_scales_the_backward_alone_in_both_timelines():
    work = [[1.0, 0.5, 2.0, 1.5], [0.7, 1.0, 1.3, 0.9]]
    back = [[2.0, 1.0, 1.0, 0.5], [1.0, 1.5, 0.5, 1.0]]
    trace = []
    plain = simulate_timeline("1f1b", P, 1, M, [1.0, 1.2], [2.0, 2.3], ZERO, ZERO, ZERO, [1.0] * P, trace=trace,
                              micro_batch_work=work, backward_work=back)
    durations = {(kind, k, j): end - start for _, kind, k, j, start, end in trace}
    assert durations[(0, 1, 2)] == pytest.approx(1.2 * 1.3) and durations[(1, 0, 0)] == pytest.approx(2.0 * 2.0)
    shared = simulate_shared_timeline("1f1b", P, 1, M, [1.0, 1.2], [2.0, 2.3], ZERO, ZERO, ZERO, [1.0] * P,
                                      contention=1.0, micro_batch_work=work, backward_work=back)
    assert shared.makespan == pytest.approx(plain.makespan)
    sim, lay = Simulator(toy_meta(), toy_cluster()), pipeline([(0, 4), (4, 8)], m=M)
    ones = [[1.0] * M for _ in range(P)]
    assert sim.evaluate(lay, micro_batch_work=ones, backward_work=back).step_time_s > sim.evaluate(lay).step_time_s


def test_a_micro_batch_work_table_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[stage\]\[micro-batch\], 2 x 4"):
        _timeline([[1.0] * 3, [1.0] * 3])
    with pytest.raises(ValueError, match="negative"):
        _timeline([[1.0, 1.0, 1.0, -1.0], [1.0] * M])


def test_simulator_evaluate_passes_the_work_to_its_timeline():
    sim = Simulator(toy_meta(), toy_cluster())
    lay = pipeline([(0, 4), (4, 8)], m=M)
    base = sim.evaluate(lay, detail=True)
    same = sim.evaluate(lay, detail=True, micro_batch_work=[[1.0] * M for _ in range(P)])
    assert same.step_time_s == base.step_time_s
    heavier = sim.evaluate(lay, micro_batch_work=[[1.0, 1.0, 1.0, 2.0] for _ in range(P)])
    assert heavier.step_time_s > base.step_time_s


def test_the_dispatch_pipeline_step_is_the_simulators_1f1b_timeline():
    rng = random.Random(0)
    for m in (1, 2, 3, 5):
        for p in (1, 2, 3):
            times = [rng.random() for _ in range(m)]
            ours = D.one_f_one_b(p)(times, D.micro_batch_bins(m, 10))
            theirs = simulate_timeline("1f1b", p, 1, m, [1 / 3 / p] * p, [2 / 3 / p] * p, [0.0] * p, [0.0] * p,
                                       [0.0] * p, [0.0] * p, micro_batch_work=[times] * p).makespan
            assert ours == pytest.approx(theirs, rel=1e-12)


def _pieces(seed, n=40, budget=512):
    rng = random.Random(seed)
    return [min(budget, int(rng.lognormvariate(4.0, 1.1)) + 1) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_pipeline_aware_dispatch_keeps_every_piece_and_beats_min_max_on_the_step(seed):
    budget, m = 512, 4
    lengths = _pieces(seed, budget=budget)
    taken, arrival, row, used = 0, [[] for _ in range(m)], 0, 0
    for i, n in enumerate(lengths):   # next fit, as PackedDocuments draws a step
        if used + n > budget:
            row, used = row + 1, 0
        if row == m:
            break
        arrival[row].append(i)
        used += n
        taken = i + 1
    lengths = lengths[:taken]
    step_of = D.one_f_one_b(2)
    bins = D.micro_batch_bins(m, budget)
    common = dict(time_budget_s=0.5, fallback=arrival, fixed_shapes=True, ilp_min_gain=0.01)
    min_max = D.dispatch_bins(lengths, bins, 1.0 / budget, 1.0 / budget ** 2, **common)
    ordered = D.dispatch_bins(lengths, bins, 1.0 / budget, 1.0 / budget ** 2, step_of=step_of, **common)
    D.check_assignment(ordered.assignment, lengths, bins)   # each piece once, every row within its budget
    costed = [D.Bin(budget, base_work=1.0) for _ in range(m)]
    works = [n * n / budget ** 2 for n in lengths]
    assert ordered.step_time == pytest.approx(step_of(D.bin_times(ordered.assignment, works, costed), costed))
    assert ordered.step_time <= step_of(min_max.times, costed) + 1e-12
    assert ordered.step_time <= step_of(D.bin_times(arrival, works, costed), costed) + 1e-12
    # the budget itself is pinned on a fake clock (test_packing); here only a bound a busy host cannot break
    assert ordered.seconds < 0.5 + 10.0


def test_pipeline_aware_dispatch_orders_the_micro_batches_for_the_step():
    """Two rows of the same tokens, one heavy document against twenty light ones: min-max has nothing
    to choose, the pipeline's step picks the order (here the heavy row last: 1F1B's fill is the first's
    forward, its drain the last's backward, and the last stage runs the heavy row alone)."""
    lengths = [400] + [20] * 20
    step_of, bins = D.one_f_one_b(2), D.micro_batch_bins(2, 512)
    orders = {"heavy first": [[0], list(range(1, 21))], "heavy last": [list(range(1, 21)), [0]]}
    steps = {name: step_of(D.bin_times(a, [n * n for n in lengths], bins), bins) for name, a in orders.items()}
    for name, fallback in orders.items():
        result = D.dispatch_bins(lengths, bins, 0.0, 1.0, time_budget_s=0.5, fallback=fallback, step_of=step_of)
        assert result.step_time == pytest.approx(min(steps.values()))
        assert result.assignment == orders["heavy last"]


def test_the_dispatch_model_gives_the_simulated_step_of_the_bins_work():
    budget = 64
    arch = dict(name="t", model_type="gpt2", n_embd=32, n_layer=4, n_head=4, n_positions=budget, vocab_size=64)
    meta = introspect(arch, budget)
    spans = [(0, 2), (2, 4)]
    seen = []

    def step_of_work(work):
        seen.append(work)
        return 1.0

    # attention alone varies: the bins' times give each stage's multipliers exactly
    model = dispatch_model(step_of_work, meta, spans, budget)
    bins = model.bins(2, budget)
    lengths = [[10, 10, 30], [60]]
    model.step_of(D.bin_times([[0, 1, 2], [3]], [model.quadratic * n * n for row in lengths for n in row], bins), bins)
    expected = micro_batch_multipliers(meta, spans, budget, [10 * 10 * 2 + 30 * 30, 60 * 60])
    assert [x for row in seen[0] for x in row] == pytest.approx([x for row in expected for x in row])
    # with a useful-token share: padding is cheaper, a full row is still one, a row of padding the fixed work
    shares = [RowShares(attention=0.6, useful=0.2), RowShares(attention=0.4, useful=0.2)]
    model = dispatch_model(step_of_work, meta, spans, budget, shares)
    full = model.base + model.linear * budget + model.quadratic * budget ** 2
    assert full == pytest.approx(1.0)
    model.step_of([full, model.base], model.bins(2, budget))
    assert [x for row in seen[-1] for x in row] == pytest.approx([1.0, 0.2, 1.0, 0.4])


def test_packed_steps_through_the_simulator_rank_balanced_no_slower_than_document():
    budget = 64
    lengths = [n for n in range(3, 60, 3)] * 8
    distribution = LengthDistribution(lengths, budget)
    meta = introspect(dict(name="t", model_type="gpt2", n_embd=32, n_layer=4, n_head=4, n_positions=budget,
                           vocab_size=64), budget)
    sim = Simulator(meta, toy_cluster(n=2))
    lay = pipeline([(0, 2), (2, 4)], m=4)
    step_of = simulator_step_of(sim, lay)
    times = {p: packed_step_times(step_of, meta, lay.spans, distribution, 4, p, steps=4) for p in ("document", "balanced")}
    assert sum(times["balanced"]) <= sum(times["document"]) * (1 + 1e-9)


def test_row_shares_count_documents_and_useful_tokens_and_a_full_row_is_one():
    from hrlplan.cost.lengths import RowShares

    budget = 64
    meta = introspect(dict(name="t", model_type="gpt2", n_embd=32, n_layer=4, n_head=4, n_positions=budget,
                           vocab_size=64), budget)
    shares = [RowShares(attention=0.5, per_document=0.01, useful=0.2)] * 2
    work = micro_batch_multipliers(meta, [(0, 2), (2, 4)], budget, [budget ** 2, 0, 8 * 8 ** 2], [1, 0, 8],
                                   [budget, 0, budget], shares)
    assert work[0][0] == pytest.approx(1.0)
    assert work[0][1] == pytest.approx(1.0 - 0.5 - 0.01 - 0.2)            # padding only: the fixed work
    assert work[0][2] == pytest.approx(0.29 + 0.5 / 8 + 0.08 + 0.2)       # eight documents of 8 tokens
    with pytest.raises(ValueError, match="document count"):
        micro_batch_multipliers(meta, [(0, 2), (2, 4)], budget, [0.0], shares=shares)


def test_the_plan_info_costs_the_chosen_plan_from_the_corpus_lengths(tmp_path):
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.data.code_corpus import prepare_code_corpus
    from hrlplan.launch.packing_prediction import packed_step_prediction
    from hrlplan.plan import homogeneous_plan
    from tests.test_code_corpus import _write_sources

    corpus = prepare_code_corpus(str(tmp_path / "code"), vocab_size=300, max_files=5, seed=0,
                                 source=str(_write_sources(tmp_path / "src")), log=lambda _: None)
    overrides = ["arch=gpt2-tiny", "arch.n_layer=4", "arch.n_embd=32", "arch.n_head=2", "arch.vocab_size=300",
                 "arch.n_positions=64", "data=code", f"data.path={corpus}", "data.vocab_size=300", "data.seq_len=64",
                 "train.global_batch_size=4"]
    config = as_config(compose(overrides + ["data.packing=balanced"]))
    meta = introspect(config.arch, 64)
    plan = homogeneous_plan("gpt2-tiny", 4, [(0, 2), (2, 4)], dp=1, tp=1, microbatch_size=1, num_microbatches=4,
                            schedule="1f1b")
    out = packed_step_prediction(config, meta, toy_cluster(n=2), plan, {}, steps=3)
    assert out["packing"] == "balanced" and out["lengths"]["max"] <= 64
    assert 0 < out["balanced"]["step_s_mean"] <= out["document"]["step_s_mean"] * (1 + 1e-9)
    assert out["document"]["step_s_max"] <= out["fixed_length_step_s"] * (1 + 1e-9)   # no row costs more than full
    replicas = homogeneous_plan("gpt2-tiny", 4, [(0, 2), (2, 4)], dp=2, tp=1, microbatch_size=1, num_microbatches=2,
                                schedule="1f1b")
    two = packed_step_prediction(config, meta, toy_cluster(n=4), replicas, {}, steps=3)
    assert 0 < two["balanced"]["step_s_mean"] <= two["document"]["step_s_mean"] * (1 + 1e-9)
    assert packed_step_prediction(as_config(compose(overrides)), meta, toy_cluster(n=2), plan, {}) is None
    missing = as_config(compose(overrides + ["data.packing=document", f"data.path={tmp_path / 'none'}"]))
    assert "not built yet" in packed_step_prediction(missing, meta, toy_cluster(n=2), plan, {})["skipped"]
