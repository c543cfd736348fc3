"""The cross-replica sync the simulator costs is the one the heterogeneous executor runs (issue 35):
the buckets each rank launches, in the order it launches them, and which start inside the last
backward, recorded from runtime/hetero_sync.py's reducer on gloo workers, against
cost/replica_sync_cost.py's buckets and launches for the same plan. Orders, no clocks."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hrlplan.compose import compose
from hrlplan.cost.model import CostOptions
from hrlplan.cost.replica_sync_cost import bucket_launches, sync_buckets
from hrlplan.cost.simulator import Simulator
from hrlplan.runtime.hetero import HeteroPipelineEngine
from hrlplan.runtime.timing import StepRecorder
from hrlplan.runtime.trainer import build_full_model
from tests.test_cross_replica_sync import _gpt2_tiny_plan, _tiny_meta, two_node_cluster

GPT2 = ["arch=gpt2-tiny", "train.lr=3e-3"]


def _plan():
    # replica A: every layer on rank 0; replica B: two stages on ranks 1 (embedding, first blocks) and
    # 2 (the rest, the tied head): units over {0, 1}, {0, 2}, and the tied embedding over all three
    return _gpt2_tiny_plan(lambda n: [[(0, n)], [(0, 3), (3, n)]], 3)


def _record(rank: int, world: int, store: str, cfg, out) -> None:
    """One worker (forked: the imports above are inherited): a step of the executor with a unit a
    bucket; its launches as cost-model units."""
    os.environ["HRLPLAN_GRAD_BUCKET_MB"] = "1e-6"   # every unit its own bucket
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        engine = HeteroPipelineEngine(_plan(), cfg["train"], cpu, build_full_model(cfg["arch"], 0, materialized=False),
                                      StepRecorder(cpu))
        batch = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
        engine.forward_backward(batch, batch)
        engine.sync_and_clip(0.0)
        reducer = engine.reducer

        def cost_unit(unit: str) -> str:   # the runtime's embedding parameters, as the cost model names them
            if unit == "final" or unit.startswith("block"):
                return unit
            return "embed" if unit == engine.tied_unit else "embed_rest"

        out[rank] = [(tuple(dict.fromkeys(cost_unit(i.unit) for i in reducer.buckets[k].items)),
                      reducer.buckets[k].ranks, hooked) for k, hooked in reducer.last_step_launches]
    finally:
        dist.destroy_process_group()


def test_the_executors_bucket_launches_are_the_cost_models(tmp_path):
    world = 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_record, args=(world, str(tmp_path / "store"), compose(GPT2), out), nprocs=world, join=True,
                           start_method="fork")
        recorded = dict(out)
    meta = _tiny_meta()
    plan = _plan()
    sim = Simulator(meta, two_node_cluster(per_node=4), CostOptions())
    buckets = sync_buckets(plan, meta, sim, [0, 1, 2], cap_bytes=1)
    end, window = {0: 10.0, 1: 10.0, 2: 9.0}, {0: 3.0, 1: 1.5, 2: 1.5}
    launch = bucket_launches(plan, meta, buckets, end, window)
    assert any(len(b.ranks) == 3 for b in buckets) and any(b.units == ("embed_rest",) for b in buckets)
    inside_somewhere = False
    for rank in range(world):
        model = [(b.units, b.ranks, launch[(k, rank)] < end[rank]) for k, b in enumerate(buckets) if rank in b.ranks]
        ran = [(units, ranks, hooked) for units, ranks, hooked in recorded[rank] if len(ranks) > 1]
        # the same buckets (units and rank sets) in the same order on every rank
        assert [m[:2] for m in model] == [r[:2] for r in ran], rank
        # a bucket the model starts inside the last backward, the executor starts from the hooks; one
        # the executor leaves to finish() the model starts at the pipeline's end
        for (units, _, inside), (_, _, hooked) in zip(model, ran):
            assert hooked or not inside, (rank, units)
        inside_somewhere = inside_somewhere or any(inside for *_, inside in model)
    assert inside_somewhere   # the overlap: some bucket starts inside a last backward
