"""Context parallelism's sharding (runtime/context_parallel.py): torch's head-tail load balancing
-- 2*cp chunks, rank r holding chunks r and 2*cp-1-r --, each rank's position ids, the round trip,
equal causal work per rank; and cp > 1 refused in one line where torch cannot run it (CPU: SDPA's
CPU kernel has no context-parallel sharding rule in torch 2.13)."""
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
    assert "one-stage" in context_parallel_refusal(2, "cuda", num_stages=2)
    assert "plan.yaml carries a cp degree" in context_parallel_refusal(2, "cuda")


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
    finally:
        dist.destroy_process_group()
