"""Every schedule of the registry (hrlplan.schedules) trains on 2 gloo ranks exactly what one process
trains, and its measured bubble is the simulator's (hrlplan.cost.timeline) on the same plan: one run
per schedule checks both (the padding sleeps; it changes no number).

The bubble comparison runs every action padded to a fixed length (tests/_padded_schedules.py: a
sleeping rank leaves its core to the others, so the machine's load does not stretch the actions)
and compares idle fractions, not times: the last step's measured bubble against the simulator's
order replayed with that step's median action durations and free communication
(hrlplan.runtime.timing.replayed_bubble). What is left between them is the order's fidelity and
gloo's per-message delay; bench/schedules.py reports the same on real compute, medians with spread.
"""
import pytest

from _padded_schedules import train_padded
from _runs import reference_losses
from hrlplan.compose import compose
from hrlplan.launch.local_run import train_plan
from hrlplan.plan import homogeneous_plan
from hrlplan.runtime.timing import measured_bubble, replayed_bubble
from hrlplan.schedules import ALIASES, SCHEDULES, resolve_schedule

pytestmark = pytest.mark.slow

# one micro-batch row per micro-batch: the padding is each action's length
LAYERS, MICROBATCHES, BATCH, STEPS = 4, 4, 4, 3
ARCH = ["arch=gpt2-tiny", f"arch.n_layer={LAYERS}", "train.lr=3e-3", f"train.global_batch_size={BATCH}"]
ALIAS = next(iter(ALIASES))   # zero_bubble: with one stage per rank, the default interleaved zero-bubble
# every registry schedule on 2 ranks, with two stages per rank where it takes them
CASES = [(name, spec.stages_per_rank_for(2)) for name, spec in SCHEDULES.items()]
BUBBLE_TOLERANCE = 0.05
PAD_S = 0.03   # each F, B and W pass: 30 ms of sleep on top of a few ms of compute


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


@pytest.mark.parametrize("schedule,stages_per_rank", CASES, ids=[f"{n}-v{v}" for n, v in CASES])
def test_schedule_trains_like_one_process_with_the_simulated_bubble(tmp_path, reference, schedule, stages_per_rank):
    """The last step's events give the measured bubble."""
    summary = train_padded(two_rank_plan(schedule, stages_per_rank),
                           [*ARCH, *schedule_overrides(schedule, stages_per_rank)],
                           tmp_path, STEPS, {"F": PAD_S, "B": PAD_S, "W": PAD_S})
    assert [h["train/lm_loss"] for h in summary["history"]] == pytest.approx(reference, abs=1e-5)
    _assert_actions_of_the_schedule(summary, schedule, stages_per_rank)
    events = summary["measured"]["events"]
    measured = measured_bubble([{"events": [e for e in events if e["rank"] == r]} for r in range(2)])
    predicted = replayed_bubble(schedule, 2, MICROBATCHES, stages_per_rank, events)
    assert measured == pytest.approx(predicted, abs=BUBBLE_TOLERANCE), (schedule, measured, predicted)


def test_the_alias_at_its_default_trains_like_one_process(tmp_path, reference):
    """Through the plain local launch (launch/local_run.train_plan), no padding."""
    config = compose([*ARCH, *schedule_overrides(ALIAS, 1), f"train.steps={STEPS}",
                      "train.checkpoint_interval=0", "logger.mode=disabled"])
    summary = train_plan(two_rank_plan(ALIAS, 1), config, tmp_path, metrics_file=False)
    assert [h["train/lm_loss"] for h in summary["history"]] == pytest.approx(reference, abs=1e-5)
    _assert_actions_of_the_schedule(summary, ALIAS, 1)
