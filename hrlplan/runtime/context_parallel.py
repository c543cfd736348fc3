"""Context parallelism: each sequence sharded over `cp` ranks, the way torch's context_parallel
(torch.distributed.tensor.experimental) shards it, with its head-tail load balancing.

Causal attention makes a later query attend to more keys, so cutting the sequence into cp
contiguous pieces would leave the last rank with most of the work. Torch cuts it into 2*cp chunks
and gives rank r chunks r and 2*cp-1-r (head and tail), so every rank holds the same share of the
causal mask. The functions here are that sharding: which positions a rank holds, its shard of a
batch, its rotary position ids (positions of the whole sequence, not 0..s/cp), and the inverse.

torch 2.13 runs context-parallel attention only through SDPA's CUDA kernels (flash, efficient,
cuDNN): on CPU, SDPA dispatches _scaled_dot_product_flash_attention_for_cpu, which has no sharding
rule ("does not have a sharding strategy registered"), so cp > 1 is refused on CPU before workers
start (validate/train_options.context_parallel_refusal). Training under cp on CUDA needs the plan's
cp degree (a cp mesh dimension beside pp/dp/tp); until the plan carries it, cp > 1 is refused there.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from hrlplan.validate.train_options import CP_KEY


def check_divisible(seq_len: int, cp: int) -> None:
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"{CP_KEY}={cp} shards a sequence into 2*cp={2 * cp} load-balanced chunks: data.seq_len "
                         f"({seq_len}) must be a multiple of {2 * cp}")


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
