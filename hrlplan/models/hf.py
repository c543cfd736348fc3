"""Hugging Face causal LMs: config from an arch dict, and a pipeline stage cut out of the model.

A stage keeps the full model's parameter names (`transformer.h.5.attn...`), so checkpoints and
gradients line up with a one-process run of the same model, whatever the layer split.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

_NOT_HF_KEYS = {"name", "family", "model_type", "model_id", "pretrained"}


def hf_config_from_arch(arch: Dict[str, Any]):
    from transformers import AutoConfig

    if arch.get("model_id"):
        # A local directory or an id already in the HF cache; never downloads.
        return AutoConfig.from_pretrained(arch["model_id"], local_files_only=True)
    kwargs = {k: v for k, v in arch.items() if k not in _NOT_HF_KEYS and v is not None}
    if arch["model_type"] == "gpt2" and kwargs.get("vocab_size", 50257) <= 50256:
        # GPT-2's special token id 50256 must lie inside a shrunken vocabulary.
        kwargs.setdefault("bos_token_id", kwargs["vocab_size"] - 1)
        kwargs.setdefault("eos_token_id", kwargs["vocab_size"] - 1)
    return AutoConfig.for_model(arch["model_type"], **kwargs)


def build_hf_model(config, pretrained_from: Optional[str] = None, on_meta: bool = False):
    """The model from its config, or from a local/cached checkpoint. on_meta: no storage at all
    (torch.device("meta")), for materialize to allocate only what a rank holds."""
    from transformers import AutoModelForCausalLM

    if pretrained_from:
        return AutoModelForCausalLM.from_pretrained(pretrained_from, config=config, local_files_only=True)
    if on_meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def module_init_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def _children_first(module: nn.Module, prefix: str = "") -> Iterator[Tuple[str, nn.Module]]:
    # HF initialises in this order too: a parent may re-initialise a child's weight (GPT-2's
    # attention scales its c_proj by depth)
    for name, child in module.named_children():
        yield from _children_first(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def materialize(model, keep: Iterable[nn.Module], seed: int, device: str | torch.device = "cpu") -> None:
    """Allocate on `device` and initialise the modules of a model built on the meta device that are
    in `keep` (the rest stay on meta, taking no memory). Each module is initialised by the model's
    own HF `_init_weights` with the RNG seeded from `seed` and the module's name in the model, so a
    rank that builds only its stage holds the weights every other layout, and a one-process run,
    start from, without the whole model ever being allocated (as torchtitan inits on meta).
    A parameter shared by several modules (a tied head) stays one tensor, initialised once, by its
    first holder (the input embedding). Buffers are filled by `_init_weights` as HF's own meta
    loading path fills them (rotary frequencies). A model not on meta (pretrained) is left alone."""
    if not any(t.is_meta for t in model.parameters()):
        return
    keep_ids = {id(m) for m in keep}
    holders: Dict[int, List[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    for mods in holders.values():   # a kept tied head needs the embedding that first holds its weight
        if len(mods) > 1 and any(id(m) in keep_ids for m in mods):
            keep_ids.update(id(m) for m in mods)
    allocated: Dict[int, nn.Parameter] = {}   # meta parameter -> its allocated tensor
    for name, module in _children_first(model):
        if id(module) not in keep_ids:
            continue
        old = dict(module.named_parameters(recurse=False))
        shared = {n: allocated[id(p)] for n, p in old.items() if id(p) in allocated}
        if any(t.is_meta for t in [*old.values(), *module.buffers(recurse=False)]):
            module.to_empty(device=device, recurse=False)
        for n, param in shared.items():
            setattr(module, n, param)
        for n, param in old.items():
            allocated.setdefault(id(param), getattr(module, n))
        if old and len(shared) == len(old):
            continue   # all its parameters belong to (and were initialised by) an earlier holder
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_init_seed(seed, name))
            model._init_weights(module)


@dataclass
class HFLayout:
    base: nn.Module          # model.transformer / model.model
    prefix: str              # "transformer" / "model"
    blocks_attr: str         # "h" / "layers"
    embed_names: List[str]   # children of base pinned to the first stage
    final_names: List[str]   # children of base (with parameters) pinned to the last stage


def hf_layout(model) -> HFLayout:
    prefix = model.base_model_prefix
    base = getattr(model, prefix)
    blocks_attr = next(n for n, m in base.named_children() if isinstance(m, nn.ModuleList))
    embed_names, final_names = [], []
    seen_blocks = False
    for name, child in base.named_children():
        if name == blocks_attr:
            seen_blocks = True
        elif isinstance(child, nn.Embedding):
            embed_names.append(name)
        elif seen_blocks and any(True for _ in child.parameters()):
            final_names.append(name)
    return HFLayout(base, prefix, blocks_attr, embed_names, final_names)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class HFStage(nn.Module):
    """Embedding (first stage), a contiguous span of blocks, final norm + head (last stage)."""

    def __init__(self, model, start: int, end: int, first: bool, last: bool):
        super().__init__()
        layout = hf_layout(model)
        self.model_type = model.config.model_type
        self.prefix, self.blocks_attr = layout.prefix, layout.blocks_attr
        self.first, self.last = first, last
        self.layer_range = (start, end)
        # Mixed precision where no FSDP MixedPrecisionPolicy casts the parameters (no data parallel,
        # replicate, heterogeneous replicas): autocast, as torchtitan does outside FSDP.
        self.autocast_dtype: Optional[torch.dtype] = None
        base = nn.Module()
        if first:
            for name in layout.embed_names:
                setattr(base, name, getattr(layout.base, name))
            if hasattr(layout.base, "drop"):
                base.drop = layout.base.drop
        blocks = getattr(layout.base, layout.blocks_attr)
        setattr(base, layout.blocks_attr, nn.ModuleDict({str(i): blocks[i] for i in range(start, end)}))
        if hasattr(layout.base, "rotary_emb"):
            base.rotary_emb = layout.base.rotary_emb
        if last:
            for name in layout.final_names:
                setattr(base, name, getattr(layout.base, name))
            self.lm_head = model.get_output_embeddings()
        setattr(self, layout.prefix, base)

    @property
    def base(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self._forward(x)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device).unsqueeze(0)
        if self.first:
            if self.model_type == "gpt2":
                h = base.drop(base.wte(x) + base.wpe(positions))
            else:
                h = base.embed_tokens(x)
        else:
            h = x
        rotary = base.rotary_emb(h, positions) if hasattr(base, "rotary_emb") else None
        for block in getattr(base, self.blocks_attr).values():
            if rotary is not None:
                out = block(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            else:
                out = block(h)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            norm = base.ln_f if hasattr(base, "ln_f") else base.norm
            h = self.lm_head(norm(h))
        return h


def build_stage_modules(model, spans: List[tuple]) -> List[HFStage]:
    """Cut `model` into stages; spans are (start, end) block ranges, end exclusive, in order."""
    n = len(spans)
    return [HFStage(model, s, e, first=(i == 0), last=(i == n - 1)) for i, (s, e) in enumerate(spans)]
