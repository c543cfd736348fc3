"""Hugging Face causal LMs: config from an arch dict, and a pipeline stage cut out of the model.

A stage keeps the full model's parameter names (`transformer.h.5.attn...`), so checkpoints and
gradients line up with a one-process run of the same model, whatever the layer split.
"""
from __future__ import annotations

import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from hrlplan.errors import UserError
from hrlplan.model_record import ModelResolutionError
from hrlplan.models.documents import (document_attention_kwargs, is_packed_inputs, is_packed_targets,
                                      packed_micro_batch_loss, sharded_packed_micro_batch_loss, split_packed_inputs,
                                      use_document_attention)

_NOT_HF_KEYS = {"name", "family", "model_type", "model_id", "pretrained"}


def hf_config_from_arch(arch: Dict[str, Any]):
    from transformers import AutoConfig   # why: 1.3 s; HRM runs import this module, never transformers

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
    from transformers import AutoModelForCausalLM   # why: as in hf_config_from_arch

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
class BlockShape:
    """Block 0 as its forward ran on the meta device: what its activation memory depends on."""
    attention: str           # the attention module's path inside the block
    attention_matmul: int    # its projection weights (q, k, v, out; fused or not)
    ffn_size: int            # the MLP's inner width: the input width of its last projection
    up_projections: int      # MLP projections into ffn_size: 1 (fc, act, proj), 2 gated (gate and up, fused or not)
    norms: int               # norm layers outside the attention, each keeps its input for backward
    shared_input: bool       # attention and MLP read one tensor (a parallel block with one norm: GPT-J, Phi)


@dataclass
class HFLayout:
    base: nn.Module          # the module holding the block list: model.transformer, model.model.decoder
    prefix: str              # its path in the model: "transformer", "model", "model.decoder"
    blocks_attr: str         # "h" / "layers"
    embed_names: List[str]   # children of base run before the blocks (token/position embeddings, embedding norm)
    final_names: List[str]   # children of base with parameters run after the blocks (final norm)
    head_name: str = "lm_head"           # the output head's path in the model
    block: Optional[BlockShape] = None


_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, HFLayout]" = weakref.WeakKeyDictionary()


def hf_layout(model, scratch: bool = False) -> HFLayout:
    """Where a causal LM keeps its blocks, embeddings, final norm and head, found by structure, not
    by family: the blocks are the largest ModuleList of one block class, the embedding and head are
    get_input_/get_output_embeddings(), and every other module with parameters goes to the first or
    last stage by whether the forward runs it before or after the blocks (traced on the meta device:
    OPT registers its final norm before its blocks, BLOOM runs a norm right after its embedding).
    The trace runs on a meta copy built from the config unless `scratch` says the model is a
    throwaway meta model (a forward could leave cached state on the caller's model)."""
    if model in _LAYOUTS:
        return _LAYOUTS[model]
    path, _ = _find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is None or id(embedding) not in names:
        raise _unsupported(model, "no input embedding (get_input_embeddings() gave none)")
    if head is None or id(head) not in names:
        raise _unsupported(model, "no output head (get_output_embeddings() gave none)")
    if "." not in path:
        raise _unsupported(model, f"its block list '{path}' is not inside a base model")
    prefix, blocks_attr = path.rsplit(".", 1)
    calls, shape = _trace(model if scratch else _meta_twin(model), path)
    embed_names, final_names = _pin_outside_blocks(model, prefix, blocks_attr, names[id(head)], calls)
    emb_path = names[id(embedding)]
    if not emb_path.startswith(prefix + ".") or emb_path[len(prefix) + 1:].split(".")[0] not in embed_names:
        raise _unsupported(model, f"its input embedding {emb_path} does not run before its blocks {path}")
    layout = HFLayout(model.get_submodule(prefix), prefix, blocks_attr, embed_names, final_names,
                      names[id(head)], shape)
    _LAYOUTS[model] = layout
    return layout


def _find_blocks(model) -> Tuple[str, nn.ModuleList]:
    """The largest (by parameters) ModuleList whose items share one class; the shallowest on a tie.
    An MoE's expert list lies inside a block, so it is never the larger."""
    best: Optional[Tuple[Tuple[int, int], str, nn.ModuleList]] = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(b) for b in module}) == 1:
            key = (sum(p.numel() for p in module.parameters()), -name.count("."))
            if key[0] and (best is None or key > best[0]):
                best = (key, name, module)
    if best is None:
        raise _unsupported(model, "no list of decoder blocks (an nn.ModuleList of one block class)")
    return best[1], best[2]


def _unsupported(model, what: str) -> Exception:
    return ModelResolutionError(f"{type(model).__name__} is not a supported causal LM structure: {what}")


def _meta_twin(model):
    with torch.device("meta"):
        return type(model)._from_config(model.config)


class _MetaScalars(TorchDispatchMode):
    """A scalar read from a meta tensor (HF's "is the mask all ones?" checks) answers True / 1, the
    no-padding path: the trace needs which modules run and in what order, not values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype is torch.bool else 1
        return func(*args, **(kwargs or {}))


def _first_tensor(args, kwargs) -> Optional[torch.Tensor]:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _trace(model, blocks_path: str) -> Tuple[Dict[str, Tuple[int, int]], BlockShape]:
    """Run a 2-token forward on the meta device: (first, last) call index of every module with
    parameters of its own, and block 0's shape from what its matmuls read and wrote."""
    calls: Dict[str, Tuple[int, int]] = {}
    matmuls: List[Tuple[str, Any, int, int]] = []   # block 0: (path, input, in width, out width)
    clock = [0]

    def on_call(name):
        def hook(module, args, kwargs):
            clock[0] += 1
            calls[name] = (calls.get(name, (clock[0],))[0], clock[0])
        return hook

    def on_matmul(name):
        def hook(module, args, kwargs, out):
            x, y = _first_tensor(args, kwargs), _first_tensor((out,), {})
            if x is not None and y is not None:
                matmuls.append((name, x if x._base is None else x._base, x.shape[-1], y.shape[-1]))
        return hook

    block0 = f"{blocks_path}.0."
    hooks = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            hooks.append(module.register_forward_pre_hook(on_call(name), with_kwargs=True))
        if name.startswith(block0) and any(p.dim() >= 2 for p in own):
            hooks.append(module.register_forward_hook(on_matmul(name[len(block0):]), with_kwargs=True))
    ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
    model.to(torch.bfloat16)   # MoE grouped-matmul kernels take only the dtype training runs in; meta: free
    try:
        with torch.no_grad(), _MetaScalars():
            model(input_ids=ids, use_cache=False)
    except Exception as e:
        raise _unsupported(model, f"its forward does not run on the meta device "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    finally:
        for h in hooks:
            h.remove()
    return calls, _block_shape(model, model.get_submodule(blocks_path)[0], matmuls)


def _block_shape(model, block: nn.Module, matmuls) -> BlockShape:
    attention = next((n for n, m in block.named_modules() if n and "attention" in type(m).__name__.lower()), None)
    if attention is None:
        raise _unsupported(model, f"no attention module (a submodule class named *Attention) "
                                  f"in its block {type(block).__name__}")
    experts = next((n for n, m in block.named_modules() if any(p.dim() >= 3 for p in m.parameters(recurse=False))
                    or (isinstance(m, nn.ModuleList) and len(m) > 1 and any(True for _ in m.parameters()))), None)
    if experts is not None:   # every expert's weights would count as per-token FLOPs, num_experts/top_k too many
        raise _unsupported(model, f"its block {type(block).__name__} is a mixture of experts "
                                  f"({experts}): routed FLOPs per token are not modelled")
    inside = attention + "."
    attn_calls = [m for m in matmuls if m[0].startswith(inside)]
    mlp_calls = [m for m in matmuls if not m[0].startswith(inside)]
    if not attn_calls or not mlp_calls:
        what = "attention projections" if not attn_calls else "MLP projections outside the attention"
        raise _unsupported(model, f"no {what} ran in its block {type(block).__name__}")
    hidden, ffn = mlp_calls[-1][3], mlp_calls[-1][2]   # the last projection maps ffn -> hidden
    up = round(sum(i * o for _, _, i, o in mlp_calls[:-1]) / (hidden * ffn))
    attention_matmul = sum(p.numel() for p in block.get_submodule(attention).parameters() if p.dim() >= 2)
    norms = _count_norms(block, attention)
    return BlockShape(attention=attention, attention_matmul=attention_matmul, ffn_size=int(ffn),
                      up_projections=int(up), norms=norms, shared_input=attn_calls[0][1] is mlp_calls[0][1])


def _count_norms(block: nn.Module, attention: str) -> int:
    """Norm layers outside the attention: modules holding only 1-D parameters (LayerNorm, RMSNorm),
    or none at all under a *Norm class name (OLMo's LayerNorm without affine weights)."""
    found: List[str] = []
    for name, module in block.named_modules():
        if not name or name == attention or name.startswith(attention + ".") or \
                any(name.startswith(f + ".") for f in found):
            continue
        own = list(module.parameters(recurse=False))
        children = any(True for _ in module.children())
        if (own and all(p.dim() == 1 for p in own) and not children) or \
                (not own and not children and "norm" in type(module).__name__.lower()):
            found.append(name)
    return len(found)


def _pin_outside_blocks(model, prefix: str, blocks_attr: str, head_name: str, calls):
    """Children of the base with parameters, first stage if they run before block 0, last if after
    the last block; one that never ran goes by its place beside the block list."""
    blocks = f"{prefix}.{blocks_attr}."
    block_calls = [c for n, c in calls.items() if n.startswith(blocks)]
    begin, end = min(c[0] for c in block_calls), max(c[1] for c in block_calls)
    order = [n for n, _ in model.get_submodule(prefix).named_children()]
    first: List[str] = []
    last: List[str] = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)) or name.startswith(blocks):
            continue
        if name == head_name or name.startswith(head_name + "."):
            continue
        if not name.startswith(prefix + "."):
            raise _unsupported(model, f"parameters in {name}, outside its base model {prefix} and its head")
        child = name[len(prefix) + 1:].split(".")[0]
        if name in calls:
            when = calls[name]
            if when[1] < begin:
                side = first
            elif when[0] > end:
                side = last
            else:
                raise _unsupported(model, f"{name} runs between its blocks {blocks}*")
        else:
            side = first if order.index(child) < order.index(blocks_attr) else last
        if child not in first + last:
            side.append(child)
        elif child not in side:
            raise _unsupported(model, f"{prefix}.{child} runs both before and after its blocks")
    return first, last


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if is_packed_targets(logits, targets):   # data.packing=document|balanced: token-weighted over the step
        return packed_micro_batch_loss(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def sharded_causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, mesh) -> torch.Tensor:
    """causal_lm_loss over logits sharded on the vocabulary: `logits` are this rank's vocab/tp
    columns (a vocabulary-parallel head, tensor_parallel.shard_vocabulary), `targets` the whole
    (replicated) token ids. Under torch's loss_parallel() -- which the caller enters around forward
    and backward -- the cross entropy reduces per-token maxima and sums over `mesh` instead of
    gathering the logits. Returns the loss as a plain tensor, equal on every rank of `mesh`; not a
    view of the DTensor's local tensor (to_local's output is one), because zero-bubble schedules
    detach the loss in place after its input-gradient pass, which a view refuses."""
    if is_packed_targets(logits, targets):   # data.packing=document|balanced: token-weighted over the step
        return sharded_packed_micro_batch_loss(logits, targets, mesh)
    local = logits.reshape(-1, logits.size(-1)).float()
    sharded = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    return F.cross_entropy(sharded, targets.reshape(-1)).to_local().clone()


class HFStage(nn.Module):
    """Embedding (first stage), a contiguous span of blocks, final norm + head (last stage)."""

    def __init__(self, model, start: int, end: int, first: bool, last: bool):
        super().__init__()
        layout = hf_layout(model)
        self.model_type = model.config.model_type
        # GPT-2's way in: token plus learned position embeddings (wte + wpe); Llama-style: tokens only
        self.learned_positions = hasattr(layout.base, "wpe")
        if not self.learned_positions and (layout.embed_names, layout.final_names) != (["embed_tokens"], ["norm"]):
            # _forward knows GPT-2's and Llama's ways in and out; the others introspect and plan only
            raise NotImplementedError(f"pipeline stages of {type(model).__name__} are not implemented: stages run "
                                      "GPT-2 and Llama-style models (embed_tokens, blocks, norm: Llama, Mistral, "
                                      "Qwen2, Gemma); this model introspects and plans but does not train here")
        self.prefix, self.blocks_attr = layout.prefix, layout.blocks_attr
        self.first, self.last = first, last
        self.layer_range = (start, end)
        # Mixed precision where no FSDP MixedPrecisionPolicy casts the parameters (no data parallel,
        # replicate, heterogeneous replicas): autocast, as torchtitan does outside FSDP.
        self.autocast_dtype: Optional[torch.dtype] = None
        # Sequence parallelism (runtime/tensor_parallel.py) hands a later stage 1/sequence_shards of
        # the positions; its rotary positions still span the whole sequence.
        self.sequence_shards = 1
        # Context parallelism (runtime/context_parallel.sharded_step) sets this rank's positions of the
        # whole sequence, (1, seq/cp), for a step: its tokens are not 0..seq/cp-1.
        self.position_ids: Optional[torch.Tensor] = None
        self.attention_kind: Optional[str] = None   # packed documents: "sdpa" (per document) or "eager" (mask)
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

    def forward(self, x: torch.Tensor, side: Optional[torch.Tensor] = None):
        """x: token ids (first stage) or activations; side: the packed documents' positions and ids
        (data.packing=document|balanced), which the first stage finds inside its packed input."""
        packed = side is not None or (self.first and is_packed_inputs(x))
        if packed and self.position_ids is not None:
            raise UserError("data.packing: packed documents do not run with context parallelism (the ring attention "
                            "takes no per-document mask); use data.packing=concat or a plan with cp: 1")
        run, args = (self._forward_packed, (x, side)) if packed else (self._forward, (x,))
        if self.autocast_dtype is None:
            return run(*args)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return run(*args)

    def _forward_packed(self, x: torch.Tensor, side: Optional[torch.Tensor]):
        """Packed documents (models/documents.py): positions restart per document, attention stays inside
        each; returns (activations, side) for the next stage, the logits on the last. Under sequence
        parallelism h holds this rank's 1/sequence_shards of the positions while `side` stays whole: the
        position embedding is scattered to h's shard, and the attention, gathered, sees every document whole."""
        base = self.base
        blocks = getattr(base, self.blocks_attr).values()
        if self.attention_kind is None:
            self.attention_kind = use_document_attention(blocks)
        if self.first:
            x, side = split_packed_inputs(x)
        positions, doc_ids = side[:, 0], side[:, 1]
        if self.first:
            h = base.drop(base.wte(x) + base.wpe(positions)) if self.learned_positions else base.embed_tokens(x)
        else:
            h = x
        rotary = base.rotary_emb(h, positions) if hasattr(base, "rotary_emb") else None
        extra = document_attention_kwargs(doc_ids, self.attention_kind, h.dtype)
        for block in blocks:
            if rotary is not None:
                out = block(h, position_ids=positions, position_embeddings=rotary, **extra)
            else:
                out = block(h, **extra)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            norm = base.ln_f if hasattr(base, "ln_f") else base.norm
            return self.lm_head(norm(h))
        # a copy: the side received here sits in the schedule's receive buffer
        return h, side.clone()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        seq = x.shape[1] if self.first else x.shape[1] * self.sequence_shards
        if self.first and seq % self.sequence_shards:
            raise ValueError(f"sequence parallelism over tp={self.sequence_shards} needs a sequence length "
                             f"divisible by it, got {seq}: set data.seq_len to a multiple of {self.sequence_shards}")
        positions = self._positions(seq, x.device)
        if self.first:
            if self.learned_positions:
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

    def _positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """The position ids of this rank's `seq` tokens: 0..seq-1, or context parallelism's shard of
        the whole sequence's (on x's device: older torch infers stage shapes on meta)."""
        if self.position_ids is None:
            return torch.arange(seq, device=device).unsqueeze(0)
        if self.position_ids.shape[-1] != seq:
            raise ValueError(f"context parallelism gave this stage {self.position_ids.shape[-1]} position ids for "
                             f"{seq} tokens: the batch was not sharded with the same positions")
        return self.position_ids.to(device)


def build_stage_modules(model, spans: List[tuple]) -> List[HFStage]:
    """Cut `model` into stages; spans are (start, end) block ranges, end exclusive, in order."""
    n = len(spans)
    return [HFStage(model, s, e, first=(i == 0), last=(i == n - 1)) for i, (s, e) in enumerate(spans)]
