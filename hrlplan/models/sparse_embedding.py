"""Puzzle-identifier embeddings with a sparse optimizer that only touches the rows a batch used.

A puzzle set can have many identifiers (ARC: one per augmented task) while a batch uses a few, so
the table is a persistent *buffer* (no dense gradient, not seen by AdamW or by FSDP/replicate) and
each training forward gathers the batch's rows into a fresh leaf tensor that receives the gradient.
`SparseEmbeddingSignSGD` then all-reduces those row gradients over the data-parallel ranks by hand
(FSDP/replicate never see them) and applies sign-SGD with decoupled weight decay to the touched rows: for
rows that are updated rarely Adam's normalised step is close to sign(grad), without per-row state.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from hrlplan.models.hrm_layers import trunc_normal_init_


class CastedSparseEmbedding(nn.Module):
    """Embedding table kept as a buffer; the rows of the last gradient-enabled forward are exposed
    as `local_weights` (a leaf with .grad after backward) and `local_ids`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = 0.0,
                 cast_to: torch.dtype = torch.float32):
        super().__init__()
        self.cast_to = cast_to
        self.register_buffer("weights", trunc_normal_init_(torch.empty(num_embeddings, embedding_dim), std=init_std),
                             persistent=True)
        self.local_weights: Optional[torch.Tensor] = None
        self.local_ids: Optional[torch.Tensor] = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weights[ids.long()]
        if not (self.training and torch.is_grad_enabled()):
            # Evaluation and HRM's no-grad target-Q forward must not replace the rows that carry
            # this step's gradient.
            return rows.to(self.cast_to)
        self.local_weights = rows.detach().requires_grad_(True)
        self.local_ids = ids.detach().long()
        return self.local_weights.to(self.cast_to)


def _union_ids(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sorted union of the row ids every rank touched (ranks may hold different counts)."""
    if world_size <= 1:
        return ids.unique()
    count = torch.tensor([ids.numel()], dtype=torch.long, device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count)
    longest = int(max(int(c) for c in counts))
    padded = torch.full((longest,), -1, dtype=torch.long, device=ids.device)
    padded[: ids.numel()] = ids
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    union = torch.cat(gathered).unique()
    return union[union >= 0]


class SparseEmbeddingSignSGD(torch.optim.Optimizer):
    """Sign-SGD with decoupled weight decay on the rows of `CastedSparseEmbedding`s a step touched.

    `step()` is collective when world_size > 1: every rank must call it, in the same order.
    Rows that no rank touched are left exactly as they are (no decay either)."""

    def __init__(self, embeddings: Iterable[CastedSparseEmbedding], lr: float = 1e-2, weight_decay: float = 0.1,
                 world_size: Optional[int] = None):
        embeddings = list(embeddings)
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"puzzle_emb_lr ({lr}) and puzzle_emb_weight_decay ({weight_decay}) must be >= 0")
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.embeddings = embeddings
        self.world_size = world_size
        # torch.optim.Optimizer needs tensors for its param groups and state_dict: the tables.
        super().__init__([e.weights for e in embeddings], dict(lr=lr, weight_decay=weight_decay))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for emb in self.embeddings:
            emb.local_weights = None
            emb.local_ids = None

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        group = self.param_groups[0]
        lr, weight_decay = group["lr"], group["weight_decay"]
        for emb in self.embeddings:
            local, ids = emb.local_weights, emb.local_ids
            if local is None or local.grad is None:
                # Keep the collectives identical on every rank: a rank without rows joins with none.
                if self.world_size <= 1:
                    continue
                grad = torch.zeros(0, emb.weights.shape[1], dtype=emb.weights.dtype, device=emb.weights.device)
                ids = torch.zeros(0, dtype=torch.long, device=emb.weights.device)
            else:
                grad = local.grad.to(emb.weights.dtype)
            apply_sparse_signsgd(emb.weights, grad, ids, lr, weight_decay, self.world_size)
        return None


def apply_sparse_signsgd(table: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, lr: float,
                         weight_decay: float, world_size: int = 1) -> torch.Tensor:
    """Update `table` in place at the rows in `ids`; returns the updated row ids.

    Duplicate ids are summed; across ranks, only the union of touched rows is all-reduced (for
    Sudoku that is a single row, however large the batch)."""
    ids = ids.long()
    union = _union_ids(ids, world_size)
    if union.numel() == 0:
        return union
    summed = torch.zeros(union.shape[0], table.shape[1], dtype=torch.float32, device=table.device)
    if ids.numel():
        summed.index_add_(0, torch.searchsorted(union, ids), grad.to(torch.float32))
    if world_size > 1:
        dist.all_reduce(summed)
    rows = table[union]
    rows.mul_(1.0 - lr * weight_decay).add_(torch.sign(summed).to(rows.dtype), alpha=-lr)
    table[union] = rows
    return union
