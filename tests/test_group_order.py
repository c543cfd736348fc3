"""Pipelines whose device groups are not in rank order (stage 0 on rank 1), as a link-aware planner
lays them out on a cluster whose fast links do not follow node order, train what one process trains.

torch's pp process group numbers its ranks in ascending order while the plan may not: the engine
maps stages to group ranks itself (hrlplan/runtime/torch_engine.py stage_group_ranks)."""
import pytest

from hrlplan.plan import homogeneous_plan
from hrlplan.launch.local_run import compare_with_one_process

pytestmark = pytest.mark.slow

SPANS = {2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)]}


@pytest.mark.parametrize("order,schedule", [([1, 0], "1f1b"), ([2, 0, 1], "gpipe")], ids=["1f1b-10", "gpipe-201"])
def test_stages_out_of_rank_order_match_one_process(tmp_path, order, schedule):
    plan = homogeneous_plan("gpt2-tiny", 6, SPANS[len(order)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule=schedule, rank_order=order)
    assert plan.device_groups == [[r] for r in order]
    overrides = ["arch=gpt2-tiny", "arch.n_layer=6", f"train.schedule={schedule}", "train.global_batch_size=8"]
    losses, reference = compare_with_one_process(plan, overrides, tmp_path, steps=3)
    assert losses == pytest.approx(reference, abs=1e-6)
