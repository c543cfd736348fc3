"""Activation memory as autograd really keeps it: the bytes a forward saves for its backward.

A formula (Korthikanti et al. 2022) counts one tensor per operation; real blocks keep more or
less: a composite GELU keeps four tensors where a fused one keeps its input, RMSNorm keeps its
fp32 upcast and its normalised output, rotary attention keeps copies of q and k. So introspection
runs block 0 of a Hugging Face model on the CPU under saved-tensor hooks and counts the distinct
storages it saves (`hf_block_saved_bytes_per_token`).

This module sits below runtime/ and cost/: model_meta (facts about a model) uses it, and
runtime/memory.py takes `storages` and `saved_activation_bytes` from here.

Large models are measured at reduced width and sequence and scaled:
  - per token, a block saves c + e*s bytes at sequence length s: e is 0 with fused attention
    (torch's scaled_dot_product_attention keeps q, k, v, its output and one log-sum-exp per row
    and head, never the s x s scores); an eager attention keeps its scores, a*s values a row.
    Rows of s1, 2*s1 and 4*s1 tokens give c and e exactly (and a few bytes per call, c0);
  - at fixed head counts and fixed ratios (ffn / hidden, head_dim / hidden) every saved tensor is
    either proportional to the width (activations, q/k/v, masks) or independent of it (per-head
    log-sum-exp): c(w) = a + b * w. Two reduced widths w and 2w give a and b exactly, and the
    line is extrapolated to the model's width (tests/test_model_meta.py checks it against a
    full-width measurement).
The measurement is in float32 and halved for the cost model's 16-bit convention; dropout masks
(one byte an element whatever the dtype) are then counted half in bfloat16 -- the shipped archs
train without dropout.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Iterable, Iterator, Tuple

import torch
from torch.utils._pytree import tree_flatten

# Below this width a block is measured as it is; above it at reduced widths (a + b*w, see above).
MEASURE_WIDTH = 256
MEASURE_TOKENS = 16           # rows of at most this many tokens (the figure is per token)
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
        if divisor > 1 and not isinstance(getattr(type(cfg), name, None), property):   # Falcon's head_dim
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


def _measure(config, blocks_path: str, lengths: Tuple[int, ...]) -> tuple:
    """([saved bytes per token of block 0 for one row of each length], its matmul weights) for a
    one-layer model of `config`."""
    from transformers import AutoModelForCausalLM   # why: 1.3 s; runtime/memory.py imports this module

    with torch.random.fork_rng(devices=[]):   # weights' values matter little; the caller's RNG stays
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.train()   # dropout keeps its masks, as in training
        block = model.get_submodule(blocks_path)[0]
        kept = []
        for n in lengths:
            x = torch.randint(0, config.vocab_size, (1, n))
            kept.append(block_saved_bytes(block, lambda: model(input_ids=x, use_cache=False)) / n)
    matmul = sum(p.numel() for p in block.parameters() if p.dim() >= 2)
    return kept, matmul


def _line(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def _per_call_token_scores(lengths: Tuple[int, ...], per_token) -> Tuple[float, float, float]:
    """A block's saved bytes for one row of n tokens, n * per_token, is c0 + c*n + e*n^2: c0 per
    call (tensors made from weights, as Gemma's 1 + norm weight), c per token, e the scores per
    token per position. Three lengths give them exactly."""
    rows = torch.tensor([[1.0, n, n * n] for n in lengths], dtype=torch.float64)
    totals = torch.tensor([n * y for n, y in zip(lengths, per_token)], dtype=torch.float64)
    c0, c, e = torch.linalg.solve(rows, totals).tolist()
    return c0, c, e


def hf_block_saved_bytes_per_token(config, blocks_path: str, seq: int, block_matmul: int) -> Tuple[float, float]:
    """(bytes per token block 0 of a Hugging Face causal LM saves for backward in float32, no
    recomputation, without attention scores; the scores' bytes per token per sequence position),
    measured on the CPU (see the module's doc). The scores are 0 with fused attention; an eager
    attention (ALiBi's BLOOM) or SDPA with attention dropout on the CPU (its math path) keeps
    them, a * s values a row: two lengths s1, 2*s1 separate them from the rest. `block_matmul` is
    the full block's matmul weights: a reduced model whose block does not have 1/d^2 of them (a
    width field this does not know) is an error, for the caller to fall back on a formula."""
    s1 = max(1, min(int(seq), MEASURE_TOKENS) // 4)
    lengths = (s1, 2 * s1, 4 * s1)
    hidden = int(config.hidden_size)
    points = []
    for d in _divisors(config):
        cfg = _reduced_config(config, d, min(int(config.vocab_size), MEASURE_VOCAB))
        if cfg is None:
            raise ValueError(f"widths of {type(config).__name__} do not divide by {d}")
        kept, matmul = _measure(cfg, blocks_path, lengths)
        if matmul * d * d != block_matmul:
            raise ValueError(f"{type(config).__name__} reduced {d}x has {matmul} block matmul weights, "
                             f"not 1/{d * d} of {block_matmul}: a width field is not scaled")
        c0, c, e = _per_call_token_scores(lengths, kept)
        points.append((hidden / d, c + max(c0, 0.0) / seq, e if e > 1e-6 else 0.0))   # c0: one row at least
    if len(points) == 1:
        return points[0][1], points[0][2]
    (w1, rest1, _), (w2, rest2, scores) = points
    return _line(w1, rest1, w2, rest2, hidden), scores   # scores: a per row, whatever the width
