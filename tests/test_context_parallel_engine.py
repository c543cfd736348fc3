"""Context parallelism in the engine (runtime/context_parallel.sharded_step, torch_engine.py,
HFStage.position_ids): each micro-batch's inputs and labels sharded along the sequence by torch's
own head-tail balancer, every stage computing its positions from the rank's position ids, the loss
the mean over all tokens, gradients reduced over dp x cp.

torch 2.13 has no ring attention on CPU (tests/test_context_parallel.py pins why), so these tests
replace only the ring -- context_parallel.ring_attention, the one seam -- by an exact all-gather of
K and V with a causal mask over the whole sequence's positions, and run everything else for real:
torch's context_parallel context and its buffer sharding, the pipeline schedules, FSDP over dp x cp.
The real ring runs on CUDA (bench/gpu_cp_check.py).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

from hrlplan.runtime.context_parallel import (_attention_for_ring, positions_of_rank, shard_sequence,
                                              take_positions, unshard_sequence)
from hrlplan.validate.train_options import (context_parallel_combination_refusal, context_parallel_length_refusal,
                                            context_parallel_refusal, context_parallel_runs_on,
                                            train_options_refusal)

LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=2", "train.lr=3e-3"]
STEPS = 3


# ---------------------------------------------------------------- pure: shards, positions, device decision
@pytest.mark.parametrize("cp", [2, 4])
def test_inputs_labels_and_positions_shard_alike_and_round_trip(cp):
    seq = 32
    inputs = torch.arange(3 * seq).reshape(3, seq)
    labels = inputs + 1   # the next token
    for rank in range(cp):
        positions = positions_of_rank(seq, cp, rank).unsqueeze(0)   # as sharded_step yields them: (1, s/cp)
        assert torch.equal(take_positions(inputs, positions), shard_sequence(inputs, cp, rank))
        assert torch.equal(take_positions(labels, positions) - 1, take_positions(inputs, positions))
        assert torch.equal(take_positions(inputs, positions)[0], positions[0])   # the tokens are their positions
    shards = [take_positions(labels, positions_of_rank(seq, cp, r).unsqueeze(0)) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards), labels)


def test_every_rank_has_one_place_and_its_stages_share_its_cp_index():
    """pp 2 x dp 2 x cp 2 x tp 2: a rank's (pp, dp, cp, tp) is its place in the plan's layout
    (d*cp + c)*tp + t, and the rank holding the next stage at its place has the same cp index, which
    is where the engine sends its sequence shard."""
    from hrlplan.plan import homogeneous_plan
    from hrlplan.runtime.parallel import rank_coords

    plan = homogeneous_plan("llama-tiny", 2, [(0, 1), (1, 2)], dp=2, tp=2, cp=2, microbatch_size=1,
                            num_microbatches=2, schedule="1f1b", rank_order=list(range(15, -1, -1)))
    coords = {r: rank_coords(plan, r) for r in range(16)}
    assert len({tuple(c.values()) for c in coords.values()}) == 16
    for rank, c in coords.items():
        group = plan.device_groups[c["pp"]]
        assert group[(c["dp"] * 2 + c["cp"]) * 2 + c["tp"]] == rank
        peer = plan.device_groups[1 - c["pp"]][group.index(rank)]
        assert {k: v for k, v in coords[peer].items() if k != "pp"} == {k: v for k, v in c.items() if k != "pp"}


def test_the_device_decision_is_pure_and_one_line():
    assert context_parallel_runs_on("cuda") and not context_parallel_runs_on("cpu")
    assert context_parallel_refusal(2, "cuda") is None and context_parallel_refusal(1, "cpu") is None
    why = context_parallel_refusal(4, "cpu")
    assert why.startswith("train.context_parallel=4: cp > 1 needs CUDA") and "SDPA" in why and "\n" not in why
    assert train_options_refusal({"context_parallel": 2}, "cpu")[0] == "train.context_parallel"
    assert train_options_refusal({"context_parallel": 2}, "cuda") is None
    assert context_parallel_length_refusal(2, 64) is None
    assert context_parallel_length_refusal(3, 20).endswith("data.seq_len (20) must be a multiple of 6")


def test_compile_beside_context_parallelism_is_refused_in_one_line(monkeypatch):
    from hrlplan.validate import train_options

    assert context_parallel_combination_refusal(1, compile=True) is None
    why = context_parallel_combination_refusal(2, compile=True)
    assert why.startswith("train.compile=true with context parallelism (train.context_parallel=2)") and "\n" not in why
    monkeypatch.setattr(train_options, "compile_refusal", lambda device_type: None)   # a GPU host with Triton
    assert train_options_refusal({"context_parallel": 2, "compile": True}, "cuda") == ("train.context_parallel", why)


def test_the_ring_gets_repeated_kv_heads_and_meta_tensors_get_plain_sdpa():
    from hrlplan.errors import UserError

    calls: List[Dict[str, Any]] = []

    def ring(q, k, v, dropout_p=0.0, is_causal=False, scale=None):
        calls.append({"k_heads": k.shape[1], "causal": is_causal})
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    attention = _attention_for_ring(ring, F.scaled_dot_product_attention)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    out = attention(q, k, k, is_causal=True, enable_gqa=True)
    assert calls == [{"k_heads": 4, "causal": True}]
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True), atol=1e-6)
    meta = attention(q.to("meta"), k.to("meta"), k.to("meta"), is_causal=True, enable_gqa=True)
    assert meta.shape == q.shape and len(calls) == 1   # shape inference on meta never reaches the ring
    with pytest.raises(UserError, match="causal attention without a mask"):
        attention(q, k, k, attn_mask=torch.ones(8, 8, dtype=torch.bool), enable_gqa=True)


def test_a_model_that_does_not_attend_through_sdpa_is_refused_under_cp():
    """Eager attention would never reach torch's ring: each rank would attend to its own keys only."""
    from types import SimpleNamespace

    from hrlplan.errors import UserError
    from hrlplan.runtime.context_parallel import check_sdpa_attention

    check_sdpa_attention(SimpleNamespace(_attn_implementation="eager"), 1)
    check_sdpa_attention(SimpleNamespace(_attn_implementation="sdpa"), 2)
    with pytest.raises(UserError, match=r"^train\.context_parallel=2: .* implementation is 'eager'"):
        check_sdpa_attention(SimpleNamespace(_attn_implementation="eager"), 2)


def test_a_step_whose_blocks_never_reach_the_ring_is_refused_and_everything_is_put_back():
    """torch's real context and buffer sharding on a one-rank gloo mesh: positions set on the parts
    for the step and cleared after it, SDPA given back; a step that ran blocks without calling SDPA
    is refused in one line instead of training each rank on its own tokens."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hrlplan.errors import UserError
    from hrlplan.runtime.context_parallel import sharded_step

    if dist.is_initialized():
        pytest.skip("a process group of another test is still up")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        part = torch.nn.Module()
        part.base, part.blocks_attr = torch.nn.Module(), "layers"
        part.base.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
        plain = F.scaled_dot_product_attention
        with pytest.raises(UserError, match=r"^train\.context_parallel=1: a step ran blocks whose attention never"):
            with sharded_step(mesh, 8, torch.device("cpu"), [part]) as positions:
                assert positions.tolist() == [list(range(8))] and part.position_ids is positions
                assert F.scaled_dot_product_attention is not plain
        assert F.scaled_dot_product_attention is plain and part.position_ids is None
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- one process: the ranks side by side
def _stacked_exact_ring(cp: int, seq: int):
    """The exact attention of cp ranks whose shards sit side by side on the batch dimension (rank r's
    rows r*B..(r+1)*B-1): every rank's queries see the whole sequence's keys, masked causally by position."""
    key_positions = torch.cat([positions_of_rank(seq, cp, r) for r in range(cp)])

    def ring(q, k, v, dropout_p=0.0, is_causal=True, scale=None):
        b = q.shape[0] // cp
        whole_k = torch.cat(list(k.reshape(cp, b, *k.shape[1:])), dim=2).repeat(cp, 1, 1, 1)
        whole_v = torch.cat(list(v.reshape(cp, b, *v.shape[1:])), dim=2).repeat(cp, 1, 1, 1)
        query_positions = torch.stack([positions_of_rank(seq, cp, r) for r in range(cp)]).repeat_interleave(b, 0)
        mask = (key_positions[None, None, :] <= query_positions[:, :, None]).unsqueeze(1)
        return torch._C._nn.scaled_dot_product_attention(q, whole_k, whole_v, attn_mask=mask, scale=scale)
    return ring


@pytest.mark.parametrize("arch", ["llama-tiny", "gpt2-tiny"])
def test_shards_with_their_positions_give_the_whole_sequences_logits_loss_and_gradients(arch, monkeypatch):
    """Rotary (Llama) and learned (GPT-2) positions: the cp ranks' shards, each with its own position
    ids, produce the whole sequence's logits; the mean of their losses is the whole loss and its
    gradients are the whole loss's."""
    from hrlplan.compose import compose
    from hrlplan.models.hf import HFStage, causal_lm_loss
    from hrlplan.runtime.trainer import build_full_model

    layers = "arch.num_hidden_layers=2" if arch.startswith("llama") else "arch.n_layer=2"
    model = build_full_model(compose([f"arch={arch}", layers])["arch"], 0)
    stage = HFStage(model, 0, 2, first=True, last=True)
    cp, seq, batch = 2, 16, 2
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 128, (batch, seq), generator=gen) for _ in range(2))

    whole_logits = stage(tokens)
    whole_loss = causal_lm_loss(whole_logits, labels)
    whole_loss.backward()
    whole_grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)

    stacked = torch.cat([shard_sequence(tokens, cp, r) for r in range(cp)])
    stage.position_ids = torch.stack([positions_of_rank(seq, cp, r) for r in range(cp)]).repeat_interleave(batch, 0)
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        _attention_for_ring(_stacked_exact_ring(cp, seq), F.scaled_dot_product_attention))
    logits = stage(stacked)
    per_rank = list(logits.reshape(cp, batch, seq // cp, -1))
    assert torch.allclose(unshard_sequence(per_rank), whole_logits, atol=1e-5)
    losses = [causal_lm_loss(per_rank[r], shard_sequence(labels, cp, r)) for r in range(cp)]
    mean = torch.stack(losses).mean()
    assert mean.item() == pytest.approx(whole_loss.item(), abs=1e-6)
    mean.backward()
    for name, param in stage.named_parameters():
        assert torch.allclose(param.grad, whole_grads[name], atol=1e-5), name


# ---------------------------------------------------------------- the real engine on gloo with an exact ring
class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the heads' sequence) over a group; backward sums every rank's
    gradient of the whole and keeps this rank's slice (what the ring's backward does)."""

    @staticmethod
    def forward(ctx, local, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None


def _exact_ring_over(cp_mesh, positions, seen: List[List[int]]):
    """The stand-in for torch's ring: this rank's queries against every rank's keys and values,
    masked by the positions torch's buffer sharding gave each rank."""
    import torch.distributed as dist

    group = cp_mesh.get_group()
    seen.append(positions[0].tolist())
    held = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(held, positions.contiguous(), group=group)
    mask = torch.cat(held, dim=1)[0][None, :] <= positions[0][:, None]

    def ring(q, k, v, dropout_p=0.0, is_causal=True, scale=None):
        k, v = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
        return torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return ring


def _worker(config, plan_yaml: str, stage_options: Dict[str, Any]):
    import torch.distributed as dist

    from _plan_options import fit_with_options
    from hrlplan.runtime import context_parallel
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker
    from hrlplan.runtime.parallel import rank_coords
    from hrlplan.validate import train_options

    train_options.CONTEXT_PARALLEL_DEVICES = ("cuda", "cpu")   # the stand-in ring runs on CPU
    seen: List[List[int]] = []
    context_parallel.ring_attention = lambda mesh, positions: _exact_ring_over(mesh, positions, seen)
    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    try:
        plan, summary = fit_with_options(config, plan_yaml, stage_options, {}, device)
        return {"losses": [h["train/lm_loss"] for h in summary["history"]] if dist.get_rank() == 0 else None,
                "eval": summary["history"][-1].get("eval/lm_loss") if dist.get_rank() == 0 else None,
                "cp_index": rank_coords(plan, dist.get_rank())["cp"], "positions": seen[0] if seen else None}
    finally:
        shutdown()


def _train_cp(plan, overrides: List[str], run_dir: Path, stage_options: Dict[str, Any] = None) -> Dict[int, Any]:
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    config = copy.deepcopy(as_config(compose([*overrides, f"train.steps={STEPS}", "train.checkpoint_interval=0",
                                              "logger.mode=disabled"])))
    run_dir.mkdir(parents=True, exist_ok=True)
    config.run_dir = str(run_dir)
    return launch_workers(_worker, (config, plan.to_yaml(), stage_options or {}), plan.world_size,
                          name="h1-cp", log_dir=str(run_dir / "logs"))


def _check_against_one_process(results: Dict[int, Any], overrides: List[str], seq: int, cp: int):
    from _plan_options import reference_losses

    for rank, out in results.items():   # torch's buffer sharding: the head-tail chunks of the rank's cp index
        assert out["positions"] == positions_of_rank(seq, cp, out["cp_index"]).tolist(), rank
    reference = reference_losses(overrides, STEPS)
    print(f"cp losses {results[0]['losses']}, one process {reference}")
    assert results[0]["losses"] == pytest.approx(reference, abs=1e-5)
    assert results[0]["eval"] is not None


@pytest.mark.slow
def test_pp2_by_cp2_passes_sequence_shards_between_stages_and_trains_as_one_process(tmp_path):
    """Stage 0's cp rank c sends its (b, s/cp, h) shard to stage 1's cp rank c, which carries on with
    the same positions; the loss is the mean over all tokens (each cp rank reports half); FSDP shards
    and reduces over the 2 cp ranks of each stage."""
    from hrlplan.plan import homogeneous_plan

    overrides = [*LLAMA, "train.global_batch_size=4"]
    plan = homogeneous_plan("llama-tiny", 2, [(0, 1), (1, 2)], dp=1, tp=1, cp=2, microbatch_size=1,
                            num_microbatches=4, schedule="1f1b")
    _check_against_one_process(_train_cp(plan, overrides, tmp_path), overrides, 64, 2)


@pytest.mark.slow
def test_tp2_sequence_parallel_by_cp2_trains_as_one_process(tmp_path):
    """Sequence parallelism inside a cp shard: the tp ranks split the rank's s/cp positions again,
    the attention all-gathers them back to s/cp before the ring."""
    from hrlplan.plan import homogeneous_plan

    overrides = [*LLAMA, "train.global_batch_size=4"]
    plan = homogeneous_plan("llama-tiny", 2, [(0, 2)], dp=1, tp=2, cp=2, microbatch_size=2, num_microbatches=2,
                            schedule="1f1b")
    _check_against_one_process(_train_cp(plan, overrides, tmp_path, {"sequence_parallel": True}), overrides, 64, 2)


# ---------------------------------------------------------------- CPU: refused before any worker starts
def test_a_cp_plan_on_cpu_is_refused_in_one_line_before_workers(tmp_path):
    from _runs import pretrain
    from hrlplan.plan import homogeneous_plan

    plan = homogeneous_plan("llama-tiny", 2, [(0, 2)], dp=1, tp=1, cp=2, microbatch_size=2, num_microbatches=2,
                            schedule="1f1b")
    plan.save(tmp_path / "plan.yaml")
    run = tmp_path / "run"
    proc = pretrain(run, "arch=llama-tiny", "arch.num_hidden_layers=2", "planner=manual",
                    f"planner.plan_file={tmp_path / 'plan.yaml'}", "train.device=cpu", "train.global_batch_size=4",
                    "logger.mode=disabled", "cluster.nproc_per_node=2", "cluster.oversubscribe=true", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("hrlplan: error: train.context_parallel=2: cp > 1 needs CUDA"), lines[0]
    assert "SDPA" in lines[0]
    assert not list(run.glob("**/logs/*")), "workers started"
