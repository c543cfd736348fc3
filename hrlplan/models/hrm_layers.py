"""Building blocks of the Hierarchical Reasoning Model: casted linear/embedding layers, RoPE,
bidirectional attention (torch SDPA, no flash-attn), SwiGLU and a post-norm transformer block.

Attribute names follow HRM's models/layers.py (qkv_proj, o_proj, gate_up_proj, down_proj,
embedding_weight) so a state dict written by HRM loads into these modules unchanged.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

CosSin = Tuple[torch.Tensor, torch.Tensor]

# A normal truncated at +-2 sigma has std 0.8796 sigma; dividing by it makes the requested std exact.
_TRUNC_2SIGMA_STD = 0.8796256610342398


def trunc_normal_init_(tensor: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """Truncated (+-2 sigma) normal with the *resulting* standard deviation equal to `std`."""
    if std == 0:
        return tensor.zero_() if tensor.device.type != "meta" else tensor
    if tensor.device.type == "meta":
        return tensor
    sigma = std / _TRUNC_2SIGMA_STD
    with torch.no_grad():
        return nn.init.trunc_normal_(tensor, mean=0.0, std=sigma, a=-2 * sigma, b=2 * sigma)


def rms_norm(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 even for bf16 activations: the recurrent state is renormalised every
    # block, and rounding errors would otherwise compound over cycles.
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x.to(dtype)


def _round_up(value: int, multiple: int) -> int:
    return -(value // -multiple) * multiple


def swiglu_intermediate_size(hidden_size: int, expansion: float) -> int:
    """HRM's SwiGLU width: 2/3 of expansion*hidden (same parameters as a plain MLP), rounded to 256."""
    return _round_up(round(expansion * hidden_size * 2 / 3), 256)


class CastedLinear(nn.Module):
    """A bias-optional linear layer whose float32 master weight is cast to the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_init_(torch.empty(out_features, in_features), std=in_features ** -0.5))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight.to(x.dtype), bias)


class CastedEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float, cast_to: torch.dtype):
        super().__init__()
        self.cast_to = cast_to
        self.embedding_weight = nn.Parameter(trunc_normal_init_(torch.empty(num_embeddings, embedding_dim), std=init_std))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding_weight.to(self.cast_to))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, max_position_embeddings: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_position_embeddings, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not persistent: recomputable, and keeping them out of checkpoints keeps keys HRM-compatible.
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self) -> CosSin:
        return self.cos_cached, self.sin_cached


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k: [batch, heads, seq, head_dim]; cos, sin: [seq, head_dim]."""
    dtype = q.dtype
    q32, k32 = q.to(cos.dtype), k.to(cos.dtype)
    q_out = q32 * cos + _rotate_half(q32) * sin
    k_out = k32 * cos + _rotate_half(k32) * sin
    return q_out.to(dtype), k_out.to(dtype)


class Attention(nn.Module):
    """Multi-head self-attention through F.scaled_dot_product_attention (bidirectional for puzzles)."""

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.causal = causal
        self.qkv_proj = CastedLinear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = CastedLinear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos_sin: Optional[CosSin] = None) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(batch, seq, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)   # each [batch, heads, seq, head_dim]
        if cos_sin is not None:
            cos, sin = cos_sin
            q, k = apply_rotary(q, k, cos[:seq], sin[:seq])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, expansion: float):
        super().__init__()
        inter = swiglu_intermediate_size(hidden_size, expansion)
        self.gate_up_proj = CastedLinear(hidden_size, 2 * inter, bias=False)
        self.down_proj = CastedLinear(inter, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HRMBlock(nn.Module):
    """Post-norm transformer block: post-norm keeps the recurrent state's scale fixed across cycles."""

    def __init__(self, hidden_size: int, num_heads: int, expansion: float, eps: float):
        super().__init__()
        self.self_attn = Attention(hidden_size, num_heads, causal=False)
        self.mlp = SwiGLU(hidden_size, expansion)
        self.norm_eps = eps

    def forward(self, hidden_states: torch.Tensor, cos_sin: Optional[CosSin] = None) -> torch.Tensor:
        hidden_states = rms_norm(hidden_states + self.self_attn(hidden_states, cos_sin), self.norm_eps)
        return rms_norm(hidden_states + self.mlp(hidden_states), self.norm_eps)


class ReasoningModule(nn.Module):
    """One HRM level (H or L): adds its input injection to the state, then runs its blocks."""

    def __init__(self, num_layers: int, hidden_size: int, num_heads: int, expansion: float, eps: float):
        super().__init__()
        self.layers = nn.ModuleList(HRMBlock(hidden_size, num_heads, expansion, eps) for _ in range(num_layers))

    def forward(self, hidden_states: torch.Tensor, injection: torch.Tensor, cos_sin: Optional[CosSin] = None) -> torch.Tensor:
        hidden_states = hidden_states + injection
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos_sin)
        return hidden_states


def embed_scale(hidden_size: int) -> float:
    return math.sqrt(hidden_size)
