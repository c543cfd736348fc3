"""Context parallelism's sharding (runtime/context_parallel.py): torch's head-tail load balancing
-- 2*cp chunks, rank r holding chunks r and 2*cp-1-r --, each rank's position ids, the round trip,
equal causal work per rank; and cp > 1 refused in one line where torch cannot run it (CPU: SDPA's
CPU kernel has no context-parallel sharding rule in torch 2.13). The engine's training under cp:
test_context_parallel_engine.py."""
import pytest
import torch

from hrlplan.errors import ConfigError
from hrlplan.runtime.context_parallel import (attention_work, chunks_of_rank, load_balanced_order,
                                              positions_of_rank, shard_sequence, unshard_sequence)
from hrlplan.validate.train_options import context_parallel_refusal


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert [chunks_of_rank(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert positions_of_rank(8, 2, 0).tolist() == [0, 1, 6, 7]   # rotary positions of the whole sequence
    assert positions_of_rank(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_order(8, 4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]   # torch's docstring example


@pytest.mark.parametrize("seq_len, cp", [(8, 1), (8, 2), (16, 4), (96, 3), (64, 8)])
def test_the_order_is_torchs_own(seq_len, cp):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    theirs = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0]
    assert load_balanced_order(seq_len, cp).tolist() == theirs.tolist()


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_cover_the_sequence_once_and_unshard_back(cp):
    batch = torch.arange(2 * 24 * 5).reshape(2, 24, 5)
    shards = [shard_sequence(batch, cp, r, dim=1) for r in range(cp)]
    assert all(s.shape == (2, 24 // cp, 5) for s in shards)
    assert torch.equal(unshard_sequence(shards, dim=1), batch)
    held = sorted(p for r in range(cp) for p in positions_of_rank(24, cp, r).tolist())
    assert held == list(range(24))


def test_causal_work_is_equal_across_ranks():
    work = attention_work(64, 4)
    assert len(set(work)) == 1 and sum(work) == 64 * 65 // 2
    contiguous = [sum(range(r * 16 + 1, (r + 1) * 16 + 1)) for r in range(4)]   # what cutting in 4 would give
    assert max(contiguous) / min(contiguous) > 5


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"train\.context_parallel=3 .*data\.seq_len \(20\) must be a multiple of 6"):
        positions_of_rank(20, 3, 0)


def test_cp_above_one_is_refused_on_cpu_in_one_line():
    assert context_parallel_refusal(1, "cpu") is None
    why = context_parallel_refusal(2, "cpu")
    assert why.startswith("train.context_parallel=2: cp > 1 needs CUDA: torch's context-parallel attention")
    assert "\n" not in why
    for stages in (1, 2):   # on CUDA the engine enters torch's context_parallel (test_context_parallel_engine.py)
        assert context_parallel_refusal(2, "cuda", num_stages=stages) is None


def test_the_launcher_refuses_cp_on_this_cpu_host_before_workers_start():
    from hrlplan.compose import compose
    from hrlplan.validate.host import check_environment

    with pytest.raises(ConfigError, match=r"^train\.context_parallel=2: cp > 1 needs CUDA") as err:
        check_environment(compose(["train.context_parallel=2", "train.device=cpu"]), launching=False)
    assert err.value.key == "train.context_parallel"
    with pytest.raises(ConfigError, match="train.context_parallel"):
        compose(["train.context_parallel=0"])


def test_torch_cannot_shard_cpu_attention():
    """Why cp is refused on CPU: torch's own context_parallel over a gloo mesh of one rank fails on
    SDPA's CPU kernel. Should a torch release add the rule, this fails and the refusal can go."""
    import socket

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    if dist.is_initialized():
        pytest.skip("a process group of another test is still up")
    with socket.socket() as s:   # a free port: several test sessions share this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
        with pytest.raises(NotImplementedError, match="sharding strategy"):
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # nor does SDPA's math backend, which decomposes into ops mixing DTensors and tensors
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            with sdpa_kernel(SDPBackend.MATH), context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the plan's cp and its cost (no run)
def _checks_know_cp() -> bool:
    """plan/checks.py counts a stage's ranks as tp*dp*cp (the lead applies H3's diff to it)."""
    from hrlplan.plan import homogeneous_plan

    try:
        homogeneous_plan("llama-tiny", 4, [(0, 4)], dp=1, tp=1, cp=2, microbatch_size=1, num_microbatches=1,
                         schedule="1f1b")
    except ValueError:
        return False
    return True


needs_cp_checks = pytest.mark.skipif(not _checks_know_cp(), reason="plan/checks.py without the cp rank count yet")


@needs_cp_checks
def test_a_cp_plan_round_trips_and_orders_ranks_dp_cp_tp():
    from hrlplan.plan import Plan, PlanError, homogeneous_plan

    plan = homogeneous_plan("llama-tiny", 4, [(0, 2), (2, 4)], dp=2, tp=2, cp=2, microbatch_size=1,
                            num_microbatches=4, schedule="1f1b")
    assert plan.world_size == 16 and plan.cp == 2 and plan.global_batch_size == 8   # cp splits sequences, not rows
    assert Plan.from_yaml(plan.to_yaml()) == plan and "cp: 2" in plan.to_yaml()
    assert "cp:" not in homogeneous_plan("llama-tiny", 4, [(0, 4)], dp=2, tp=1, microbatch_size=1,
                                         num_microbatches=1, schedule="1f1b").to_yaml()
    assert [s.ranks for s in plan.as_pipelines()[1].stages] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    with pytest.raises(PlanError, match=r"stages\[0\]\.ranks: 8 ranks listed but tp\*dp\*cp = 2\*2\*3"):
        Plan.from_yaml(plan.to_yaml().replace("cp: 2", "cp: 3", 1))
    with pytest.raises(PlanError, match=r"stages\[0\]\.cp: must be an integer"):
        Plan.from_yaml(plan.to_yaml().replace("cp: 2", "cp: two", 1))


def _h100_node():
    from pathlib import Path

    import yaml

    from hrlplan.cluster import spec_from_preset

    conf = Path(__file__).resolve().parents[1] / "conf" / "cluster" / "h100x8-4n.yaml"
    return spec_from_preset(yaml.safe_load(conf.read_text()))


def _stage_cost(cp=1, dp=1, tp=1, seq=8192, recompute="none"):
    from hrlplan.cost.model import CostOptions, StageCostModel
    from test_cost import llama7b_meta

    costs = StageCostModel(llama7b_meta(seq), _h100_node(), CostOptions(bytes_per_value=2))
    group = list(range(tp * dp * cp))
    return costs.stage(0, 8, False, False, group, tp, dp, 1, 2, recompute=recompute, microbatches=4)


def test_cp_divides_activations_and_compute_and_charges_the_ring():
    from hrlplan.cost import context_parallel as cpc
    from test_cost import llama7b_meta

    one, two = _stage_cost(cp=1), _stage_cost(cp=2)
    assert two.activation == pytest.approx(one.activation / 2)
    assert two.compute_fwd == pytest.approx(one.compute_fwd / 2, rel=0.02)   # saturation: a hair either way
    # the ring: cp - 1 passes of a shard's K and V per block, twice that in backward; an H100 node's
    # NVLink hides it behind the attention core at 8k tokens, so the step does not pay it
    fwd, bwd = cpc.ring_exchange_s(llama7b_meta(8192), 4096, 1, 2, 2, 450e9, 0.0)
    assert fwd == pytest.approx(4096 * 2 * 4096 * 2 / 450e9) and bwd == pytest.approx(2 * fwd)
    assert two.fwd < one.fwd
    # weights are sharded over dp * cp: cp 2 at dp 1 shards as dp 2 at cp 1
    assert two.memory["optimizer"] == pytest.approx(_stage_cost(dp=2).memory["optimizer"])
    assert two.dp_sync > 0 and one.dp_sync == 0


def test_the_ring_is_charged_beyond_the_attention_it_overlaps():
    from hrlplan.cost import context_parallel as cpc
    from hrlplan.cost.model import CostOptions, StageCostModel
    from test_cost import llama7b_meta

    assert cpc.exposed(3.0, 1.0) == 2.0 and cpc.exposed(1.0, 3.0) == 0.0
    costs = StageCostModel(llama7b_meta(8192), _h100_node(), CostOptions(bytes_per_value=2))
    across = list(range(0, 16))            # cp 16 over two nodes: the ring crosses InfiniBand
    bare_f, bare_b = costs._ring(across, 1, 16, 512, 8, 0.0, 0.0)   # nothing to hide behind
    assert bare_f > 0 and bare_b == pytest.approx(2 * bare_f)
    assert costs._ring(across, 1, 16, 512, 8, 1.0, 2.0) == (0.0, 0.0)   # a long attention hides it
    assert costs._ring(across, 1, 1, 512, 8, 0.0, 0.0) == (0.0, 0.0)


def test_the_planners_cp_degrees():
    from hrlplan.cost.context_parallel import context_parallel_degrees

    assert context_parallel_degrees(8192, 8, 2, ["cuda"] * 8, search=True) == [1, 2, 4]
    assert context_parallel_degrees(8192, 8, 1, ["cpu"] * 8, search=True) == [1]   # torch's ring needs CUDA
    assert context_parallel_degrees(96, 8, 1, ["cuda"] * 8, search=True) == [1, 2, 4, 8]
    assert context_parallel_degrees(20, 8, 1, ["cuda"] * 8, search=True) == [1, 2]   # 2*cp chunks divide seq
    assert context_parallel_degrees(8192, 8, 1, ["cuda"] * 8, requested=4) == [4]
    assert context_parallel_degrees(8192, 8, 1, ["cuda"] * 8, requested=3) == []     # 8 devices: no cp 3


def test_a_worker_refuses_a_cp_plan_on_cpu_in_one_line_before_building_its_mesh():
    """Without torch's ring attention (CPU) the mesh is never built for cp > 1 (the launcher says it
    first where it reads the plan); on CUDA the engine runs it (test_context_parallel_engine.py)."""
    from hrlplan.errors import UserError
    from hrlplan.plan import Plan, StagePlan
    from hrlplan.runtime.parallel import build_mesh, rank_coords

    plan = Plan(model="llama-tiny", n_layer=2, world_size=4, pp=1, microbatch_size=1, num_microbatches=1,
                global_batch_size=2, schedule="1f1b", device_groups=[[0, 1, 2, 3]],
                stages=[StagePlan(layers=[0, 2], ranks=[0, 1, 2, 3], dp=2, cp=2, embedding=True, head=True)])
    assert [rank_coords(plan, r) for r in (1, 2)] == [{"pp": 0, "dp": 0, "cp": 1, "tp": 0},
                                                      {"pp": 0, "dp": 1, "cp": 0, "tp": 0}]
    with pytest.raises(UserError, match=r"^train\.context_parallel=2: cp > 1 needs CUDA") as err:
        build_mesh(plan, "cpu")
    assert "\n" not in str(err.value)


def test_the_search_gives_layouts_a_cp_degree_where_space_knows_it():
    """planner.max_cp > 1 on a CUDA cluster: the search enumerates cp (search/space.py with H3's diff)."""
    from hrlplan.config import TrainConfig
    from hrlplan.search.space import Config, SearchSpace
    from test_cost import llama7b_meta

    if "cp" not in Config.__dataclass_fields__:
        pytest.skip("search/space.py without cp yet")
    space = SearchSpace(llama7b_meta(8192), _h100_node(), {"max_cp": 4, "max_pp": 1}, TrainConfig(global_batch_size=8))
    configs = list(space.configs())
    assert {c.cp for c in configs} == {1, 2, 4}
    two = next(c for c in configs if c.cp == 2)
    lay = space.layout(two, [(0, 32)], recompute=["full"])
    assert lay.cp == 2 and len(lay.groups[0]) == two.tp * two.dp * 2
    plain = SearchSpace(llama7b_meta(8192), _h100_node(), {"max_pp": 1}, TrainConfig(global_batch_size=8))
    assert {c.cp for c in plain.configs()} == {1}
