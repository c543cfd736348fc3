"""Context parallelism (a plan's `cp` degree) in the cost model and the search.

Each sequence is sharded over cp ranks (torch's context_parallel, head-tail load balanced:
runtime/context_parallel.py), so a rank computes and keeps tokens / cp of every micro-batch: the
linears' work and the activations divide by cp. Attention needs every key: torch's ring attention
passes the K and V shards around the cp ranks, cp - 1 steps per block in forward, each overlapped
with the attention on the shard already there; backward passes K, V and their gradients (twice the
bytes) the same way. The exposed part is what the ring takes beyond the block's attention core.
FSDP shards over dp * cp ranks, as torchtitan does (its dp_shard_cp mesh): the cp ranks hold the
same weights, so their gradients are reduced with dp's in one collective.

A stage's group holds tp * dp * cp devices, ordered (dp d, cp c, tp t) -> (d * cp + c) * tp + t.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

# torch's context-parallel attention runs SDPA's CUDA kernels only (runtime/context_parallel.py)
CP_DEVICE_KINDS = ("cuda",)


def cp_of_group(group_size: int, tp: int, dp: int) -> int:
    """The cp degree a stage's group implies (tp * dp * cp devices)."""
    return max(group_size // max(tp * dp, 1), 1)


def cp_ring_group(group: Sequence[int], tp: int, cp: int) -> List[int]:
    """The devices of one cp ring (dp 0, tp rank 0): tp apart within the first dp block."""
    return list(group[0:cp * tp:tp])


def kv_bytes_per_token(meta, tp: int, bytes_per_value: int) -> float:
    """K and V of one token on one tp rank (the kv width: grouped-query attention's, or h)."""
    kv = float((meta.extra or {}).get("kv_width") or meta.hidden_size)
    return 2.0 * kv / tp * bytes_per_value


def ring_exchange_s(meta, tokens_per_rank: float, tp: int, cp: int, bytes_per_value: int, bw: float,
                    lat: float) -> Tuple[float, float]:
    """(forward, backward) seconds of one block's ring passes, before overlap: cp - 1 steps of a
    shard's K and V; backward sends K, V and dK, dV."""
    if cp <= 1:
        return 0.0, 0.0
    step = tokens_per_rank * kv_bytes_per_token(meta, tp, bytes_per_value) / bw + lat
    return (cp - 1) * step, 2.0 * (cp - 1) * step


def exposed(comm, compute):
    """What an overlapped transfer adds beyond the compute it hides behind."""
    return comm - compute if comm > compute else 0.0


def ring_buffer_bytes(meta, tokens_per_rank: float, tp: int, cp: int, bytes_per_value: int) -> float:
    """The ring's in-flight K, V shards: the one arriving beside the one in use (backward: with
    their gradients, twice that)."""
    if cp <= 1:
        return 0.0
    return 2.0 * 2.0 * tokens_per_rank * kv_bytes_per_token(meta, tp, bytes_per_value)


def context_parallel_degrees(seq_len: int, devices_per_group: int, tp: int, device_kinds: Sequence[str],
                             requested: int = 1, search: bool = False) -> List[int]:
    """The cp degrees a planner may give a layout of `devices_per_group` devices per pipeline
    position at tensor parallel `tp`: `requested` (train.context_parallel) alone, or with `search`
    every degree that runs -- only on devices torch's ring attention supports, a sequence that
    splits into 2 * cp load-balanced chunks, and groups of tp * cp * (a whole dp)."""
    runs = all(k in CP_DEVICE_KINDS for k in device_kinds)
    candidates = range(1, devices_per_group + 1) if search else [requested]
    out = []
    for cp in candidates:
        if cp == 1:
            out.append(1)
        elif runs and seq_len % (2 * cp) == 0 and devices_per_group % (tp * cp) == 0:
            out.append(cp)
    return out
