"""Time the per-document attention kernel by length (cost/attention_curve.AttentionCurve).

Each length is timed as models/documents.py runs a document: one causal
F.scaled_dot_product_attention over a slice of a row's queries, keys and values ([1, heads, L, head
width] views of the whole row's tensors), and its backward, in this thread's CPU time on one thread
(a pipeline rank's), the median of `repeats`. The row is as long as the budget, so the slices'
strides are the runtime's.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hrlplan.cost.attention_curve import AttentionCurve, grid_lengths


def _time_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, repeats: int):
    forward, backward = [], []
    for _ in range(repeats):
        q.grad = k.grad = v.grad = None
        t0 = time.thread_time()
        out = F.scaled_dot_product_attention(q[:, :, :length], k[:, :, :length], v[:, :, :length], is_causal=True)
        t1 = time.thread_time()
        out.backward(torch.ones_like(out))
        t2 = time.thread_time()
        forward.append(t1 - t0)
        backward.append(t2 - t1)
    return statistics.median(forward), statistics.median(backward)


def measure_attention_curve(heads: int, head_width: int, budget: int, dtype: torch.dtype = torch.float32,
                            repeats: int = 7, lengths: Optional[Sequence[int]] = None,
                            seed: int = 0) -> AttentionCurve:
    """One block's per-document attention, forward and backward, at each of `lengths` (default
    cost/attention_curve.grid_lengths(budget)), on one thread."""
    lengths = tuple(lengths) if lengths is not None else grid_lengths(budget)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(seed)
        whole = torch.randn(3, 1, heads, max(budget, lengths[-1]), head_width, generator=g, dtype=dtype)
        q, k, v = (whole[i].clone().requires_grad_(True) for i in range(3))
        _time_one(q, k, v, lengths[-1], 1)   # the first call allocates
        timed = [_time_one(q, k, v, n, repeats) for n in lengths]
    finally:
        torch.set_num_threads(threads)
    return AttentionCurve(lengths, tuple(f for f, _ in timed), tuple(b for _, b in timed))
