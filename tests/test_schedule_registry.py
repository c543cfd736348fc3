"""The schedule registry (hrlplan.schedules): its facts agree with torch 2.13's classes, the alias and
refusals, each order generator (hrlplan.cost.schedule_orders) places operations where the spec's
stage_ranks says and runs what torch's own action lists run, and the analytic bubble equals the
simulated idle on a uniform plan."""
import re
from pathlib import Path

import pytest
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti, PipelineScheduleSingle, ScheduleDualPipeV, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, _ComputationType)

import hrlplan
from hrlplan import schedules
from hrlplan.cost.schedule_orders import B, BW, F, ORDER_GENERATORS, W, structure
from hrlplan.cost.timeline import simulate_timeline
from hrlplan.errors import ConfigError
from hrlplan.schedules import SCHEDULES, Order, resolve_schedule

# (pp, m) pairs every schedule is checked on (at the stages per rank a search gives it)
SHAPES = [(2, 4), (2, 5), (3, 6), (4, 8), (4, 12)]


def cases():
    for name, spec in SCHEDULES.items():
        for v in sorted({spec.stages_per_rank_for(1), spec.stages_per_rank_for(2), spec.stages_per_rank_for(3)}):
            for pp, m in SHAPES:
                if spec.microbatch_refusal(pp, m, v) is None:
                    yield name, pp, v, m


def test_registry_facts_agree_with_torch():
    assert {"gpipe", "1f1b", "interleaved_1f1b", "zbv", "interleaved_zero_bubble", "dualpipev"} <= set(SCHEDULES)
    for name, spec in SCHEDULES.items():
        assert spec.name == name and spec.summary
        taken = [v for v in (1, 2, 3, 4) if spec.takes(v)]
        assert taken and spec.multi_stage == any(v > 1 for v in taken)
        if spec.v_shape:
            assert taken == [2] and spec.multi_stage
        if spec.heterogeneous:   # hrlplan's own executor runs one stage per rank, a full backward
            assert taken == [1] and not spec.split_backward
        for v in taken:
            cls = spec.torch_class(v)
            multi = issubclass(cls, PipelineScheduleMulti)
            assert multi == spec.uses_multi_stage_class(v), (name, v)
            assert multi or issubclass(cls, PipelineScheduleSingle)
        # torch's V classes place their stages in a V; the others looped
        for v in taken:
            ranks = spec.stage_ranks(3, v)
            assert len(ranks) == 3 * v and sorted(set(ranks)) == [0, 1, 2]
            if spec.v_shape:
                assert ranks == [0, 1, 2, 2, 1, 0]
            elif v > 1:
                assert ranks == [0, 1, 2] * v
    assert SCHEDULES["zbv"].torch_class(2) is ScheduleZBVZeroBubble
    assert SCHEDULES["dualpipev"].torch_class(2) is ScheduleDualPipeV
    assert SCHEDULES["interleaved_zero_bubble"].torch_class(1) is ScheduleInterleavedZeroBubble
    assert SCHEDULES["interleaved_1f1b"].torch_class(2) is ScheduleInterleaved1F1B
    # DualPipeV wants at least as many micro-batches as its 2 pp stages; 1F1B one per stage
    assert SCHEDULES["dualpipev"].microbatch_refusal(2, 3, 2) and not SCHEDULES["dualpipev"].microbatch_refusal(2, 4, 2)
    assert SCHEDULES["1f1b"].microbatch_refusal(4, 3, 1) and not SCHEDULES["1f1b"].microbatch_refusal(4, 4, 1)
    assert SCHEDULES["interleaved_1f1b"].microbatch_refusal(4, 10, 2) is None     # 2 rounds of 5
    assert SCHEDULES["interleaved_1f1b"].microbatch_refusal(4, 9, 2)              # 2 rounds do not divide 9


def test_alias_and_refusals():
    assert resolve_schedule("zero_bubble", 2).name == "zbv"
    assert resolve_schedule("zero_bubble", 1).name == "interleaved_zero_bubble"
    assert resolve_schedule("zero_bubble", 3).name == "interleaved_zero_bubble"
    assert "zero_bubble" in schedules.ALIASES and "zero_bubble" in schedules.names()
    for name, v, words in [("2f2b", 1, ["train.schedule", "2f2b", "gpipe"]),
                           ("zbv", 1, ["train.stages_per_rank", "zbv", "2"]),
                           ("dualpipev", 3, ["train.stages_per_rank", "dualpipev"]),
                           ("gpipe", 2, ["train.stages_per_rank", "gpipe", "1"])]:
        with pytest.raises(ConfigError) as e:
            resolve_schedule(name, v)
        text = str(e.value)
        assert "\n" not in text and all(w in text for w in words), text
    with pytest.raises(ConfigError):
        SCHEDULES["zbv"].torch_class(1)


def test_config_enum_names_every_registry_schedule():
    from hrlplan.config import Schedule

    assert set(schedules.names()) <= {s.value for s in Schedule}


def test_every_order_family_has_one_generator():
    assert set(ORDER_GENERATORS) == set(Order)
    assert {spec.order for spec in SCHEDULES.values()} <= set(ORDER_GENERATORS)


@pytest.mark.parametrize("name,pp,v,m", list(cases()))
def test_order_runs_every_operation_once_where_stage_ranks_places_it(name, pp, v, m):
    spec = SCHEDULES[name]
    st = structure(name, pp, v, m)
    ranks = spec.stage_ranks(pp, v)
    seen = {}
    for pos, ops in enumerate(st.position_ops):
        for kind, k, j in ops:
            assert ranks[k] == pos, (name, pos, kind, k, j)
            seen[(kind, k, j)] = seen.get((kind, k, j), 0) + 1
    assert all(c == 1 for c in seen.values())
    for k in range(pp * v):
        for j in range(m):
            assert seen.get((F, k, j)) == 1
            if spec.split_backward:   # B then W, or a whole backward at once
                assert seen.get((BW, k, j)) == 1 or (seen.get((B, k, j)) == 1 and seen.get((W, k, j)) == 1)
            else:
                assert seen.get((B, k, j)) == 1 and (W, k, j) not in seen and (BW, k, j) not in seen
    assert len(st.order) == sum(len(ops) for ops in st.position_ops)


def _torch_orders(cls, pp: int, v: int, m: int):
    """torch's own per-rank action lists (its _calculate_single_rank_operations), without process
    groups: an OVERLAP_F_B action runs its forward then its whole backward."""
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, m
    sched.num_stages = sched._num_stages = pp * v
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    kinds = {_ComputationType.FORWARD: F, _ComputationType.BACKWARD_INPUT: B, _ComputationType.BACKWARD_WEIGHT: W,
             _ComputationType.FULL_BACKWARD: BW}
    out = []
    for rank in range(pp):
        ops = []
        for a in sched._calculate_single_rank_operations(rank):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                ops.append((kinds[sub.computation_type], sub.stage_index, sub.microbatch_index))
        out.append(ops)
    return out


@pytest.mark.parametrize("name,cls", [("zbv", ScheduleZBVZeroBubble), ("dualpipev", ScheduleDualPipeV),
                                      ("interleaved_zero_bubble", ScheduleInterleavedZeroBubble),
                                      ("interleaved_1f1b", ScheduleInterleaved1F1B)])
def test_order_is_what_torch_runs(name, cls):
    spec = SCHEDULES[name]
    for pp, m in SHAPES:
        for v in (1, 2, 3):
            if not spec.takes(v) or spec.microbatch_refusal(pp, m, v) or not spec.uses_multi_stage_class(v):
                continue
            expected = _torch_orders(cls, pp, v, m)
            if not spec.split_backward:   # a full backward is the timeline's B there
                expected = [[(B if kind == BW else kind, k, j) for kind, k, j in ops] for ops in expected]
            got = [list(ops) for ops in structure(name, pp, v, m).position_ops]
            assert got == expected, (name, pp, v, m)


@pytest.mark.parametrize("name,pp,v,m", list(cases()))
def test_analytic_bubble_is_the_simulated_idle_of_a_uniform_plan(name, pp, v, m):
    spec = SCHEDULES[name]
    n, split = pp * v, spec.split_backward
    r = simulate_timeline(name, pp, v, m, [1.0] * n, [1.0 if split else 2.0] * n, [1.0 if split else 0.0] * n,
                          [0.0] * n, [0.0] * n, [0.0] * n)
    idle = 1.0 - sum(r.busy) / (pp * r.makespan)
    assert idle == pytest.approx(spec.bubble(pp, m, v), abs=1e-9)


def test_no_schedule_name_is_spelled_outside_the_registry():
    root = Path(hrlplan.__file__).resolve().parent
    quoted = re.compile(r"""["'](%s)["']""" % "|".join(re.escape(n) for n in schedules.names()))
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "schedules.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if quoted.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
