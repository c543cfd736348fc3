"""Context parallelism: each sequence sharded over `cp` ranks, the way torch's context_parallel
(torch.distributed.tensor.experimental) shards it, with its head-tail load balancing.

Causal attention makes a later query attend to more keys, so cutting the sequence into cp
contiguous pieces would leave the last rank with most of the work. Torch cuts it into 2*cp chunks
and gives rank r chunks r and 2*cp-1-r (head and tail), so every rank holds the same share of the
causal mask. `positions_of_rank` and its friends describe that sharding (the cost model and tests
use them; a test pins them to torch's own load balancer).

The engine (torch_engine.py) trains under `sharded_step`: it enters torch's context_parallel over
the cp sub-mesh, which patches SDPA into ring attention and shards one buffer -- the position ids
0..s-1 -- with torch's own balancer. Those sharded positions are the one fact every other shard
follows: the micro-batches' inputs and labels are indexed by them (`take_positions`) and every
stage of the rank computes its rotary/learned position embeddings from them
(HFStage.position_ids), so a stage boundary carries the sequence-sharded activation to the next
stage's rank of the same cp index. Each rank's loss is the mean over its s/cp tokens; the shards
are equal, so the mean of the cp ranks' losses is the mean over all tokens, and FSDP's gradient
reduce over dp x cp averages the gradients to match.

torch 2.13 runs context-parallel attention only through SDPA's CUDA kernels (flash, efficient,
cuDNN): on CPU, SDPA dispatches _scaled_dot_product_flash_attention_for_cpu, which has no sharding
rule ("does not have a sharding strategy registered"), so cp > 1 is refused on CPU before workers
start (validate/train_options.context_parallel_refusal). CPU tests replace `ring_attention` (the
one seam) by an exact all-gather of K/V and train the real engine with it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

from hrlplan.errors import ConfigError, UserError
from hrlplan.validate.train_options import CP_KEY, context_parallel_length_refusal


def check_divisible(seq_len: int, cp: int) -> None:
    why = context_parallel_length_refusal(cp, seq_len)
    if why:
        raise ConfigError("data.seq_len", seq_len, message=why)


def chunks_of_rank(cp: int, rank: int) -> tuple:
    """The two chunk indices (of 2*cp) that `rank` holds: head r and tail 2*cp-1-r."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is not in [0, {cp})")
    return rank, 2 * cp - 1 - rank


def positions_of_rank(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions `rank` holds, in the order it holds them (its position ids)."""
    check_divisible(seq_len, cp)
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of_rank(cp, rank)])


def load_balanced_order(seq_len: int, cp: int) -> torch.Tensor:
    """All positions in rank order (rank 0's, then rank 1's, ...): torch's head-tail indices."""
    return torch.cat([positions_of_rank(seq_len, cp, r) for r in range(cp)])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s shard of a batch along its sequence dimension."""
    index = positions_of_rank(tensor.shape[dim], cp, rank).to(tensor.device)
    return tensor.index_select(dim, index)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's shard (rank order)."""
    cp = len(shards)
    joined = torch.cat(list(shards), dim=dim)
    restore = torch.argsort(load_balanced_order(joined.shape[dim], cp)).to(joined.device)
    return joined.index_select(dim, restore)


def attention_work(seq_len: int, cp: int) -> List[int]:
    """Causal (query, key) pairs each rank computes: equal under head-tail balancing."""
    return [int((positions_of_rank(seq_len, cp, r) + 1).sum()) for r in range(cp)]


# ---------------------------------------------------------------- the engine's step under context parallelism
def take_positions(tensor: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The entries of `tensor` at this rank's sequence positions (positions: (1, s/cp), as
    sharded_step yields them), in the order the rank holds them."""
    return tensor.index_select(dim, positions[0].to(tensor.device))


def check_sdpa_attention(config, cp: int) -> None:
    """Under cp > 1 every block must attend through torch's SDPA, the call context_parallel turns
    into ring attention: an eager (or flash-attn) attention would attend to the rank's own keys only
    and train silently wrong."""
    kind = getattr(config, "_attn_implementation", None)
    if cp > 1 and kind != "sdpa":
        raise UserError(f"{CP_KEY}={cp}: context parallelism runs attention through torch's SDPA (its ring "
                        f"attention), and this model's attention implementation is {kind!r}: build it with "
                        f"attn_implementation='sdpa' or plan with cp: 1")


def ring_attention(cp_mesh, positions: torch.Tensor) -> Callable:
    """The SDPA every rank calls on its own queries, keys and values inside sharded_step: torch's
    ring attention, which its context_parallel has patched in as F.scaled_dot_product_attention.
    The one seam CPU tests replace (by an exact all-gather of K and V: torch has no CPU ring)."""
    return F.scaled_dot_product_attention


def _attention_for_ring(ring: Callable, plain: Callable, calls: Optional[List[int]] = None) -> Callable:
    """What the blocks call in place of SDPA. Meta tensors (older torch pipelining infers stage
    shapes by a forward on meta) take plain SDPA: shapes are all it needs and no ring runs on meta.
    Grouped-query attention gets its K/V heads repeated here, as torchtitan does before SDPA: the
    ring's CUDA kernels take one head count. `calls` counts the ring's calls."""
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        if query.is_meta:
            return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None or not is_causal:
            raise UserError(f"{CP_KEY}: context parallelism runs causal attention without a mask (torch's "
                            "load-balanced ring needs is_causal=True), and this model's attention passed a mask; "
                            "plan with cp: 1")
        if enable_gqa and key.shape[1] != query.shape[1]:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        if calls is not None:
            calls[0] += 1
        return ring(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale)
    return attention


@contextmanager
def sharded_step(cp_mesh, seq_len: int, device: torch.device, parts: Iterable[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """One training (or evaluation) step under context parallelism, around the schedule's step:
    torch's context_parallel over `cp_mesh` (ring attention in every SDPA call), this rank's
    position ids -- torch's own sharding of 0..seq_len-1, (1, seq_len/cp) -- set on every part
    (HFStage.position_ids) and yielded, for the caller to shard inputs and labels with
    take_positions. Everything is put back on exit."""
    check_divisible(seq_len, cp_mesh.size())
    parts = list(parts)
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    plain = F.scaled_dot_product_attention
    calls = [0]
    with torch_context_parallel(cp_mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}):
        patched = F.scaled_dot_product_attention   # torch's: restored by its own exit, so ours goes first
        F.scaled_dot_product_attention = _attention_for_ring(ring_attention(cp_mesh, positions), plain, calls)
        for part in parts:
            part.position_ids = positions
        try:
            yield positions
        finally:
            F.scaled_dot_product_attention = patched
            for part in parts:
                part.position_ids = None
    # after torch's context has exited: some torch releases undo their patch only on a clean exit
    if not calls[0] and any(_blocks(part) for part in parts):
        raise UserError(f"{CP_KEY}={cp_mesh.size()}: a step ran blocks whose attention never called torch's "
                        "SDPA, so it never reached the ring and each rank attended to its own tokens only; "
                        "use a model whose attention runs through SDPA, or plan with cp: 1")


def _blocks(part: torch.nn.Module) -> int:
    """How many transformer blocks a stage module runs (HFStage), 0 for anything else."""
    base, attr = getattr(part, "base", None), getattr(part, "blocks_attr", None)
    return len(getattr(base, attr)) if base is not None and attr else 0
