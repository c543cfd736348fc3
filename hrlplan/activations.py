"""Activation memory as autograd really keeps it: the bytes a forward saves for its backward.

A formula (Korthikanti et al. 2022) counts one tensor per operation; real blocks keep more or
less: a composite GELU keeps four tensors where a fused one keeps its input, RMSNorm keeps its
fp32 upcast and its normalised output, rotary attention keeps copies of q and k. So introspection
runs block 0 of a Hugging Face model on the CPU under saved-tensor hooks and counts the distinct
storages it saves (`hf_block_saved_bytes_per_token`).

This module sits below runtime/ and cost/: model_meta (facts about a model) uses it, and
runtime/memory.py takes `storages` and `saved_activation_bytes` from here.

Large models are measured at reduced width and sequence and scaled:
  - per token, a block's saved bytes do not depend on the sequence length once attention is fused
    (torch's scaled_dot_product_attention keeps q, k, v, its output and one log-sum-exp per row
    and head, never the s x s scores), so a short sequence measures the same figure per token;
  - at fixed head counts and fixed ratios (ffn / hidden, head_dim / hidden) every saved tensor is
    either proportional to the width (activations, q/k/v, masks) or independent of it (per-head
    log-sum-exp): saved(w) = a + b * w. Two reduced widths w and 2w give a and b exactly, and the
    line is extrapolated to the model's width (tests/test_model_meta.py checks it against a
    full-width measurement).
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Iterable, Iterator, Optional

import torch
from torch.utils._pytree import tree_flatten

# Below this width a block is measured as it is; above it at reduced widths (a + b*w, see above).
MEASURE_WIDTH = 256
MEASURE_TOKENS = 32           # one row of at most this many tokens (the figure is per token)
MEASURE_VOCAB = 64            # the embedding and head are not measured: a small table is enough
_WIDTH_FIELDS = ("hidden_size", "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                 "inner_hidden_size", "head_dim", "word_embed_proj_dim", "rotary_dim")
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The real storages behind a tensor or a wrapper subclass (DTensor's local shard)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        yield t.untyped_storage()
        return
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, torch.Tensor):
        yield from storages(inner)
        return
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        for attr in flatten()[0]:
            sub = getattr(t, attr, None)
            if isinstance(sub, torch.Tensor):
                yield from storages(sub)
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs, tensors in
    `exclude` (parameters) left out: what a forward really keeps, kernel by kernel (e.g. a
    composite GELU keeps four tensors where a fused one keeps its input)."""
    skip = {id(st) for t in exclude for st in storages(t)}
    kept: Dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for st in storages(t):
            if id(st) not in skip:
                kept.setdefault(id(st), st)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(st.nbytes() for st in kept.values())


def block_saved_bytes(block: torch.nn.Module, run: Callable[[], object]) -> int:
    """Bytes `block` saves for backward while run() (a whole model's forward) calls it once. The
    block's inputs that are off the autograd graph (attention masks, rotary tables, positions) are
    one for all blocks and left out; its hidden-state input counts (its first norm keeps it)."""
    box: Dict[str, int] = {}
    original = block.forward

    def measured(*args, **kwargs):   # the block's own call, once
        shared = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.requires_grad]
        out = []
        box["bytes"] = saved_activation_bytes(lambda: out.append(original(*args, **kwargs)),
                                              exclude=[*block.parameters(), *shared])
        return out[0]
    block.forward = measured
    try:
        run()
    finally:
        del block.forward    # back to the class's forward
    if "bytes" not in box:
        raise RuntimeError(f"{type(block).__name__} was not called by the model's forward")
    return box["bytes"]


def _width_fields(config) -> Dict[str, int]:
    hidden = int(config.hidden_size)
    out = {}
    for name in _WIDTH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if name == "word_embed_proj_dim" and value != hidden:
                continue   # OPT's projected embedding: outside the blocks
            out[name] = value
    return out


def _reduced_config(config, divisor: int, vocab: int):
    """`config` with one layer, a small vocabulary and every width divided by `divisor` (head
    counts kept); None when a width does not divide."""
    fields = _width_fields(config)
    if any(v % divisor for v in fields.values()):
        return None
    cfg = copy.deepcopy(config)
    for name, value in fields.items():
        setattr(cfg, name, value // divisor)
    cfg.num_hidden_layers = 1
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:1]
    cfg.vocab_size = vocab
    for name in _TOKEN_FIELDS:
        ids = getattr(cfg, name, None)
        if (isinstance(ids, int) and ids >= vocab) or (isinstance(ids, list) and any(i >= vocab for i in ids)):
            setattr(cfg, name, None)
    cfg.use_cache = False
    return cfg


def _divisors(config) -> list:
    """Width divisors to measure at: [1] for a small model, else the two largest powers of two
    d, d/2 that keep the width >= MEASURE_WIDTH, every width field divisible and head_dim >= 8."""
    fields = _width_fields(config)
    hidden = fields["hidden_size"]
    heads = int(config.num_attention_heads)
    head_dim = fields.get("head_dim", hidden // heads)
    ok = [d for d in (2 ** k for k in range(1, 12))
          if hidden // d >= MEASURE_WIDTH and head_dim % d == 0 and head_dim // d >= 8
          and all(v % d == 0 for v in fields.values())]
    if not ok or max(ok) == 2:   # a width below 2 * MEASURE_WIDTH: once, as it is
        return [1]
    return [max(ok), max(ok) // 2]


def _measure(config, blocks_path: str, tokens: int) -> tuple:
    """(saved bytes per token of block 0, its matmul weights) for a one-layer model of `config`."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):   # weights' values matter little; the caller's RNG stays
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.train()   # dropout keeps its masks, as in training
        block = model.get_submodule(blocks_path)[0]
        x = torch.randint(0, config.vocab_size, (1, tokens))
        kept = block_saved_bytes(block, lambda: model(input_ids=x, use_cache=False))
    matmul = sum(p.numel() for p in block.parameters() if p.dim() >= 2)
    return kept / tokens, matmul


def hf_block_saved_bytes_per_token(config, blocks_path: str, seq: int, block_matmul: int) -> float:
    """Bytes per token block 0 of a Hugging Face causal LM saves for backward in float32 (no
    recomputation), measured on the CPU (see the module's doc for reduced widths). `block_matmul`
    is the full block's matmul weights: a reduced model whose block does not have 1/d^2 of them
    (a width field this does not know) is an error, for the caller to fall back on a formula."""
    tokens = max(1, min(int(seq), MEASURE_TOKENS))
    hidden = int(config.hidden_size)
    points = []
    for d in _divisors(config):
        cfg = _reduced_config(config, d, min(int(config.vocab_size), MEASURE_VOCAB))
        if cfg is None:
            raise ValueError(f"widths of {type(config).__name__} do not divide by {d}")
        kept, matmul = _measure(cfg, blocks_path, tokens)
        if matmul * d * d != block_matmul:
            raise ValueError(f"{type(config).__name__} reduced {d}x has {matmul} block matmul weights, "
                             f"not 1/{d * d} of {block_matmul}: a width field is not scaled")
        points.append((hidden / d, kept))
    if len(points) == 1:
        return points[0][1]
    (w1, k1), (w2, k2) = points
    return k1 + (k2 - k1) * (hidden - w1) / (w2 - w1)
