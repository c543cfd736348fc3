"""Every schedule of the registry (hrlplan.schedules) trains on 2 gloo ranks exactly what one process
trains, and runs the order the simulator times (hrlplan.cost.schedule_orders): one run per schedule
checks both.

The order is compared action by action -- each rank's recorded forwards, backwards and weight passes
(kind, model stage, micro-batch) in the order they ran, against the simulator's order for that
rank -- so the bubble the simulator computes (hrlplan.cost.timeline replays that order with
durations) is the bubble of the order the runtime runs. That holds whatever the machine's load:
nothing here is timed. How far the measured idle time follows the simulated one (the order's waits
plus gloo's per-message delay, on real or padded compute) is bench/schedules.py's, medians with spread.
"""
import pytest

from _runs import reference_losses
from hrlplan.compose import compose
from hrlplan.cost.schedule_orders import structure
from hrlplan.launch.local_run import train_plan
from hrlplan.plan import homogeneous_plan
from hrlplan.cost.timeline import simulate_timeline
from hrlplan.runtime.timing import action_medians, measured_bubble, replayed_bubble, stage_durations
from hrlplan.schedules import ALIASES, SCHEDULES, resolve_schedule

pytestmark = pytest.mark.slow

LAYERS, MICROBATCHES, BATCH, STEPS = 4, 4, 4, 3
ARCH = ["arch=gpt2-tiny", f"arch.n_layer={LAYERS}", "train.lr=3e-3", f"train.global_batch_size={BATCH}"]
ALIAS = next(iter(ALIASES))   # zero_bubble: with one stage per rank, the default interleaved zero-bubble
# every registry schedule on 2 ranks, with two stages per rank where it takes them
CASES = [(name, spec.stages_per_rank_for(2)) for name, spec in SCHEDULES.items()]
KINDS = ("F", "B", "W", "BW")   # hrlplan.cost.schedule_orders' operation kinds 0..3, as the runtime records them


def two_rank_plan(schedule: str, stages_per_rank: int):
    n = 2 * stages_per_rank
    per = LAYERS // n
    return homogeneous_plan("gpt2-tiny", LAYERS, [(i * per, (i + 1) * per) for i in range(n)], dp=1, tp=1,
                            microbatch_size=BATCH // MICROBATCHES, num_microbatches=MICROBATCHES, schedule=schedule,
                            stages_per_rank=stages_per_rank)


def schedule_overrides(schedule: str, stages_per_rank: int):
    return [f"train.schedule={schedule}", f"train.stages_per_rank={stages_per_rank}"]


@pytest.fixture(scope="module")
def reference():
    return reference_losses(steps=STEPS, extra=ARCH[1:])


def _assert_actions_of_the_schedule(summary, schedule: str, stages_per_rank: int) -> None:
    kinds = {e["kind"] for e in summary["measured"]["events"]}
    split = resolve_schedule(schedule, stages_per_rank).split_backward
    assert ("W" in kinds) == split and kinds >= {"F"}


def _train(tmp_path, schedule: str, stages_per_rank: int):
    """Rank 0's summary of the two-rank plan trained STEPS steps through the plain local launch
    (launch/local_run.train_plan); the last step's actions are in summary["measured"]["events"]."""
    config = compose([*ARCH, *schedule_overrides(schedule, stages_per_rank), f"train.steps={STEPS}",
                      "train.checkpoint_interval=0", "logger.mode=disabled"])
    return train_plan(two_rank_plan(schedule, stages_per_rank), config, tmp_path, metrics_file=False)


def executed_orders(events, ranks: int):
    """Each rank's actions as (kind, model stage, micro-batch), in the order it ran them: one thread
    per rank runs them one after another, so their start times order them whatever the load."""
    return [[(e["kind"], e["stage"], e["microbatch"]) for e in sorted((e for e in events if e["rank"] == r),
                                                                      key=lambda e: e["start_s"])]
            for r in range(ranks)]


def simulated_orders(schedule: str, stages_per_rank: int):
    st = structure(schedule, 2, stages_per_rank, MICROBATCHES)
    return [[(KINDS[kind], stage, mb) for kind, stage, mb in ops] for ops in st.position_ops]


def simulated_events(schedule: str, stages_per_rank: int, events):
    """The simulator's timeline of this order, run with the recorded actions' median durations and
    free communication, as events the runtime would have recorded."""
    n = 2 * stages_per_rank
    split = resolve_schedule(schedule, stages_per_rank).split_backward
    fwd, bwd, wgt = stage_durations(action_medians(events), n, split)
    trace, zeros = [], [0.0] * n
    simulate_timeline(schedule, 2, stages_per_rank, MICROBATCHES, fwd, bwd, wgt, zeros, zeros, zeros, trace=trace)
    return [{"rank": pos, "kind": KINDS[kind], "stage": stage, "microbatch": mb, "start_s": start, "end_s": end}
            for pos, kind, stage, mb, start, end in trace]


def per_rank(events):
    return [{"events": [e for e in events if e["rank"] == r]} for r in range(2)]


@pytest.mark.parametrize("schedule,stages_per_rank", CASES, ids=[f"{n}-v{v}" for n, v in CASES])
def test_schedule_trains_like_one_process_in_the_simulated_order(tmp_path, reference, schedule, stages_per_rank):
    summary = _train(tmp_path, schedule, stages_per_rank)
    assert [h["train/lm_loss"] for h in summary["history"]] == pytest.approx(reference, abs=1e-5)
    _assert_actions_of_the_schedule(summary, schedule, stages_per_rank)
    events = summary["measured"]["events"]
    ran, simulated = executed_orders(events, 2), simulated_orders(schedule, stages_per_rank)
    for rank in range(2):
        assert ran[rank] == simulated[rank], (schedule, rank, ran[rank], simulated[rank])
    # had every action taken its kind's median time and messages none, the run would measure the simulated
    # bubble: measured_bubble of the simulator's timeline is replayed_bubble (bench/schedules.py times the rest)
    replay = simulated_events(schedule, stages_per_rank, events)
    assert executed_orders(replay, 2) == ran
    assert measured_bubble(per_rank(replay)) == pytest.approx(
        replayed_bubble(schedule, 2, MICROBATCHES, stages_per_rank, events), abs=1e-9)


def test_the_alias_at_its_default_trains_like_one_process(tmp_path, reference):
    summary = _train(tmp_path, ALIAS, 1)
    assert [h["train/lm_loss"] for h in summary["history"]] == pytest.approx(reference, abs=1e-5)
    _assert_actions_of_the_schedule(summary, ALIAS, 1)
    assert executed_orders(summary["measured"]["events"], 2) == simulated_orders(ALIAS, 1)
