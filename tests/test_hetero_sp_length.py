"""Sequence parallelism only where it shards the sequence evenly (issue 35's leftovers): the planners'
spaces plan a tp > 1 layout without it where tp (x cp) does not divide data.seq_len, so a planned plan
always passes sequence_parallel_length_refusal; and the cross-replica reducer (runtime/hetero_sync.py)
refuses a Partial gradient instead of packing it as if Replicate."""
from dataclasses import asdict

import pytest
import torch

from hrlplan.config import TrainConfig, section
from hrlplan.cost.plans import predict_any_plan
from hrlplan.cost.simulator import Simulator
from hrlplan.plan import Plan, validate
from hrlplan.plan.checks import sequence_parallel_divides, sequence_parallel_length_refusal
from hrlplan.search.common import cost_options
from hrlplan.search.config import ExactPlannerConfig
from hrlplan.search.hetero_search import search_hetero
from hrlplan.search.space import SearchSpace
from tests.test_cost import toy_cluster, toy_meta
from tests.test_hetero_planner import TRAIN, preset


def test_sequence_parallel_divides_the_cp_local_sequence_by_tp():
    assert sequence_parallel_divides(32, 2) and sequence_parallel_divides(33, 1)
    assert not sequence_parallel_divides(33, 2)
    assert sequence_parallel_divides(24, 4, cp=2) and not sequence_parallel_divides(12, 4, cp=2)


def _two_types(memory_gb: float):
    return preset([dict(count=1, device="fast", devices_per_node=2, memory_gb=memory_gb, tflops=4, intra_node_GBps=100),
                   dict(count=1, device="slow", devices_per_node=2, memory_gb=memory_gb, tflops=1, intra_node_GBps=50)])


def _planned(seq: int):
    """The replica search on two types whose devices hold the 4-layer model only at tp 2 (pp 1 at most:
    the two fast devices then form one tp-2 replica)."""
    meta = toy_meta(n_layer=4, hidden=512, seq=seq)
    meta.model_type = "llama"   # no one-tp rule
    cluster = _two_types(1.35)
    train = section(TrainConfig, dict(TRAIN, global_batch_size=4))
    cfg = dict(asdict(ExactPlannerConfig()), microbatch_sizes=[1, 2, 4], hetero_share_steps=4, max_pp=1)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    found = search_hetero(sim, meta, cluster, cfg, train, float("inf"))
    return meta, cluster, sim, found


@pytest.mark.parametrize("seq, sp", [(33, False), (32, True)])
def test_a_planned_replica_runs_sequence_parallelism_only_where_its_tp_divides_seq_len(seq, sp):
    meta, cluster, sim, found = _planned(seq)
    plan = found["plan"]
    tp2 = [p for p in plan.as_pipelines() if p.stages[0].tp == 2]
    assert tp2, "the search must plan a tp-2 replica for this test to mean anything"
    assert all(s.sequence_parallel == sp for p in tp2 for s in p.stages)
    assert all(r.layout.sequence_parallel == sp for r in found["replicas"] if r.layout.tp == 2)
    validate(plan)
    assert sequence_parallel_length_refusal(plan, seq) == ""
    if sp:
        return
    # priced without it: every tp rank runs the norms and elementwise work on the whole sequence; the
    # same plan with sequence parallelism forced on (what the runtime would refuse) is priced faster
    assert found["predicted"]["step_time_s"] == predict_any_plan(plan, meta, cluster, sim=sim)["step_time_s"]
    data = plan.to_dict()
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            if stage["tp"] > 1:
                stage["sequence_parallel"] = True
    forced = Plan.from_dict(data, source="test")
    assert sequence_parallel_length_refusal(forced, seq) != ""
    assert predict_any_plan(forced, meta, cluster, sim=sim)["step_time_s"] < found["predicted"]["step_time_s"]


@pytest.mark.parametrize("seq, sp", [(33, False), (32, True)])
def test_the_homogeneous_space_follows_the_same_rule(seq, sp):
    """The homogeneous runtime needs it too: models/hf.HFStage refuses a sequence tp does not divide
    (its stages pass (b, s/tp, h) and recover s as tp times the shard)."""
    meta = toy_meta(n_layer=4, hidden=256, seq=seq)
    space = SearchSpace(meta, toy_cluster(4), asdict(ExactPlannerConfig()), dict(TRAIN, global_batch_size=4))
    configs = [c for c in space.configs() if c.tp == 2]
    assert configs and all(space.sequence_parallel(c) == sp for c in configs)
    c = configs[0]
    spans = [(k * meta.n_layer // c.pp, (k + 1) * meta.n_layer // c.pp) for k in range(c.pp)]
    assert space.layout(c, spans).sequence_parallel == sp


# ---------------------------------------------------------------- Partial gradients at the reducer
@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group of another test is still up")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _norm_weight_with_partial_grad(mesh):
    """A norm weight as SequenceParallel leaves it: a Replicate parameter whose gradient is Partial."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
    weight.grad = DTensor.from_local(torch.arange(4.0), mesh, [Partial()])
    return weight


def _bare_reducer(monkeypatch):
    """A GradientReducer with what _start reads, its collective recorded instead of issued."""
    from hrlplan.runtime import hetero_sync
    started = []
    monkeypatch.setattr(hetero_sync, "_Reduce", lambda bucket, buf, groups, scatter=False: started.append(buf) or buf)
    reducer = hetero_sync.GradientReducer.__new__(hetero_sync.GradientReducer)
    reducer.weights, reducer.me, reducer.dtype, reducer.sharded = [0.5], (0, 0), torch.float32, False
    reducer.tp, reducer.tp_index, reducer.layout_of, reducer.groups = 2, 0, lambda name: None, {(0,): None}
    reducer.buckets = []
    reducer._reset()
    return reducer, started


@pytest.mark.parametrize("whole", [False, True])
def test_a_partial_gradient_is_refused_by_the_packing_not_taken_for_replicate(one_rank_mesh, monkeypatch, whole):
    from hrlplan.runtime.hetero_sync import Bucket, Item
    reducer, started = _bare_reducer(monkeypatch)
    weight = _norm_weight_with_partial_grad(one_rank_mesh)
    bucket = Bucket((0,), (Item("block.0", "model.layers.0.input_layernorm.weight", weight, whole, 4),))
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.input_layernorm\.weight.*Partial"):
        reducer._start(bucket)
    assert started == []


def test_a_gradient_replicate_partial_grads_settled_packs_as_replicate(one_rank_mesh, monkeypatch):
    """The runtime's order: tensor_parallel.replicate_partial_grads' hook sums the Partial gradient over tp
    at the step's last accumulation; the packing then takes the whole value."""
    from torch.distributed.tensor import Replicate
    from hrlplan.runtime.hetero_sync import Bucket, Item
    from hrlplan.runtime.tensor_parallel import replicate_partial_grads
    reducer, started = _bare_reducer(monkeypatch)
    module = torch.nn.Module()
    module.weight = _norm_weight_with_partial_grad(one_rank_mesh)
    assert replicate_partial_grads(module, accumulations=1) == 1
    for hook in module.weight._post_accumulate_grad_hooks.values():
        hook(module.weight)
    assert module.weight.grad.placements == (Replicate(),)
    reducer._start(Bucket((0,), (Item("block.0", "w", module.weight, False, 4),)))
    assert torch.equal(started[0], torch.arange(4.0) * 0.5)


# ---------------------------------------------------------------- pricing the norms' all-reduces
def _one_stage_tp2(sp: bool):
    from hrlplan.cost.model import Layout
    return Layout(spans=((0, 4),), groups=((0, 1),), tp=2, dp=1, microbatch_size=1, num_microbatches=2,
                  schedule="1f1b", sequence_parallel=sp)


@pytest.mark.parametrize("model_type, per_norm", [("gpt2", 2), ("llama", 1)])
def test_sequence_parallel_charges_one_all_reduce_per_partial_norm_gradient(monkeypatch, model_type, per_norm):
    """A tp-2 stage of 4 blocks with the final norm: 9 norms, each a weight (RMSNorm) or a weight and a
    bias (LayerNorm) whose gradient is Partial, all-reduced over tp once a step (replicate_partial_grads)."""
    from hrlplan.cost import simulator
    from hrlplan.cost.device_model import all_reduce_time
    meta = toy_meta(n_layer=4, hidden=256, seq=32)
    meta.model_type = model_type
    cluster = _two_types(8)   # devices 0 and 1: one node's, 2 us apart
    sim = Simulator(meta, cluster)
    (bw, lat), _ = sim.links((0, 1), 2, 1)
    one = all_reduce_time(256 * 4.0, 2, bw, lat)   # a hidden-size float32 vector's ring all-reduce
    assert one > 2 * lat > 0
    with_sp, without = sim.evaluate(_one_stage_tp2(True), detail=True), sim.evaluate(_one_stage_tp2(False), detail=True)
    charged = with_sp.stages[0]["partial_grad_reduce_s"]
    assert charged == pytest.approx(9 * per_norm * one * sim.devices.time_scale)
    assert without.stages[0]["partial_grad_reduce_s"] == 0.0
    monkeypatch.setattr(simulator._StepRun, "partial_grad_reduces", lambda self, k: 0.0)
    uncharged = Simulator(meta, cluster)
    assert with_sp.step_time_s - uncharged.evaluate(_one_stage_tp2(True)).step_time_s == pytest.approx(charged)
    assert uncharged.evaluate(_one_stage_tp2(False)).step_time_s == without.step_time_s   # no SP: unchanged
