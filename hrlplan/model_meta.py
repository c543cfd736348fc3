"""Model introspection: parameters, FLOPs and activation memory per block, on the meta device.

No weights are materialised and no hub is contacted: a model is built from its config (a shipped
arch YAML, a local directory with config.json, a config file, or an id already in the HF cache).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict

import yaml

from hrlplan.conf_tree import load_shipped_arch, shipped_archs
from hrlplan.errors import one_line
from hrlplan.families import GENERIC_HF, arch_family_for_model_type, family_of
from hrlplan.model_record import SCHEMA_VERSION, ModelMeta, ModelResolutionError  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- resolving a model id
def resolve_arch(model_id: str) -> Dict[str, Any]:
    """Turn a user's --model-id into an arch dict (the same shape as cfg.arch)."""
    if model_id in shipped_archs():
        return load_shipped_arch(model_id)
    path = Path(model_id)
    if path.is_dir() and (path / "config.json").exists():
        return {"name": path.name, "family": GENERIC_HF.arch_family, "model_id": str(path)}
    if path.is_file() and path.suffix in (".yaml", ".yml", ".json"):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ModelResolutionError(f"{path}: not a readable model config ({one_line(e, 200)})") from None
        if not isinstance(data, dict):
            raise ModelResolutionError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        if "model_type" not in data:
            raise ModelResolutionError(f"{path}: no 'model_type' key (e.g. model_type: gpt2)")
        data.setdefault("family", arch_family_for_model_type(data["model_type"]))
        data.setdefault("name", path.stem)
        return data
    try:  # an id already in the local HF cache; never downloads
        from transformers import AutoConfig   # why: 1.3 s, for ids in the HF cache only

        AutoConfig.from_pretrained(model_id, local_files_only=True)
        return {"name": model_id.split("/")[-1], "family": GENERIC_HF.arch_family, "model_id": model_id}
    except Exception:
        pass
    raise ModelResolutionError(
        f"model '{model_id}' is not a shipped arch, a local directory with config.json, a config file, "
        f"or an id in the local Hugging Face cache (no downloads here). Shipped archs: {', '.join(shipped_archs())}")


# ---------------------------------------------------------------- introspection
def introspect(arch: Dict[str, Any], seq_len: int | None = None) -> ModelMeta:
    """Model meta for an arch dict (cfg.arch, or resolve_arch(model_id)), by its family's introspection."""
    arch = dict(arch)
    return INTROSPECTION[family_of(arch).arch_family](arch, seq_len)


def _introspect_hrm(arch: Dict[str, Any], seq_len: int | None) -> ModelMeta:
    from hrlplan.models.hrm import introspect_hrm   # why: torch; `import hrlplan.model_meta` stays torch-free

    return introspect_hrm(arch, seq_len)


def _config_int(config, name: str, required: bool = True) -> int | None:
    """An int config field by its common name; the config's attribute_map finds a family's own
    spelling (GPT-2's n_embd is hidden_size). A missing required field is an error naming it."""
    value = getattr(config, name, None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if required:
        own = getattr(config, "attribute_map", {}).get(name, name)
        raise ModelResolutionError(f"{type(config).__name__} has no {own}"
                                   + (f" ({name})" if own != name else "") + ": set it in the model's config")
    return None


def _matmul_numel(module) -> int:
    """Weights with two or more dims take part in a matmul (Linear, Conv1D, fused QKV), except
    embedding tables, which are looked up."""
    import torch.nn as nn   # why: `import hrlplan.model_meta` stays torch-free (ModelMeta.load, conf_dir)

    return sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False) if p.dim() >= 2)


def _numel_once(modules, seen: set) -> int:
    """Parameters of `modules` not counted yet (a tied head's weight belongs to the embedding)."""
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _positions(config, seq_len: int | None) -> int:
    max_positions = _config_int(config, "max_position_embeddings", required=False)
    if max_positions is None:   # ALiBi (BLOOM): no learned or rotary table bounds the length
        if not seq_len:
            raise ModelResolutionError(f"{type(config).__name__} has no max_position_embeddings to default the "
                                       "sequence length to: give it (--seq-len, or data.seq_len)")
        return int(seq_len)
    seq = int(seq_len or max_positions)
    if seq > max_positions:
        key = getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
        raise ModelResolutionError(f"data.seq_len={seq} is longer than the model's {max_positions} positions; "
                                   f"set data.seq_len<={max_positions} or arch.{key}={seq}")
    return seq


def _attention_widths(config, shape, hidden: int) -> tuple[int, int, int]:
    """(heads, q width, k/v width): heads and head_dim from the config, the K/V width from the
    attention's own weights (q, o: hidden x q; k, v: hidden x kv each), so GQA and multi-query
    need no family-specific field."""
    heads = _config_int(config, "num_attention_heads")
    head_dim = _config_int(config, "head_dim", required=False)
    if head_dim is None:
        if hidden % heads:
            raise ModelResolutionError(f"{type(config).__name__}: hidden size {hidden} is no multiple of "
                                       f"{heads} heads and no head_dim is set")
        head_dim = hidden // heads
    q = heads * head_dim
    kv2, rem = divmod(shape.attention_matmul - 2 * hidden * q, 2 * hidden)
    if rem or not 0 < kv2 <= q:
        raise ModelResolutionError(f"{type(config).__name__}: its attention's {shape.attention_matmul} projection "
                                   f"weights do not fit {heads} heads of {head_dim} (q, k, v, out projections)")
    return heads, q, kv2


def block_activation_bytes(hidden: int, q: int, kv: int, heads: int, seq: int, shape) -> float:
    """The fallback of _block_activation (a block that cannot be measured).
    Korthikanti et al. (2022), 16-bit activations kept for backward per token, no recomputation,
    in its parts so that families differ where their blocks do. Attention 11h + 5*a*s for MHA: input
    2h, Q 2q, K and V 2kv each (GQA / multi-query keep less), context 2q, dropout mask h, scores,
    softmax and dropout 5*a*s (ALiBi adds a bias, nothing kept). Each norm keeps its input, 2h. MLP
    3h + 4*I (6*I gated: two up projections): its input 2h -- not kept twice where a parallel block
    feeds attention and MLP one normed tensor (GPT-J, Phi) -- dropout mask h."""
    attention = 2 * hidden + 2 * q + 4 * kv + 2 * q + hidden + 5 * heads * seq
    norms = 2 * hidden * shape.norms
    mlp = (0 if shape.shared_input else 2 * hidden) + hidden + (4 if shape.up_projections == 1 else 6) * shape.ffn_size
    return float(attention + norms + mlp)


def _block_activation(config, layout, seq: int, block_matmul: int, formula_args, extra: Dict[str, Any]) -> float:
    """16-bit bytes per token block 0 keeps for backward, in the cost model's convention: what autograd
    really saves (hrlplan.activations, measured in float32 on the CPU and halved) plus Korthikanti's
    scores 5*a*s, which cost/memory.py drops again for fused attention (SDPA never keeps them).
    Korthikanti's formula is the fallback when the block cannot run on the CPU (a family whose
    forward needs a GPU kernel, or width fields the reduced model does not scale): it is 1.2-1.8x
    too low for real blocks (composite GELU, RMSNorm's fp32 copies, rotary q/k copies), but a
    figure beats no plan."""
    from hrlplan.activations import hf_block_saved_bytes_per_token   # why: torch, as in _matmul_numel

    hidden, q, kv, heads, shape = formula_args
    blocks_path = f"{layout.prefix}.{layout.blocks_attr}"
    try:
        kept, scores = hf_block_saved_bytes_per_token(config, blocks_path, seq, block_matmul)
    except Exception as e:   # noqa: BLE001 -- any failure of a foreign forward falls back
        log.info("%s: block activations from Korthikanti's formula, the block did not run on the CPU (%s)",
                 type(config).__name__, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        return block_activation_bytes(hidden, q, kv, heads, seq, shape)
    extra["measured_scores_bytes_per_token"] = scores / 2.0 * seq   # 0 unless the attention keeps its scores
    return kept / 2.0 + 5.0 * heads * seq


def _introspect_hf(arch: Dict[str, Any], seq_len: int | None) -> ModelMeta:
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch, hf_layout   # why: torch, as in _introspect_hrm

    try:
        config = hf_config_from_arch(arch)
    except (OSError, ValueError, KeyError, TypeError) as e:   # a damaged config.json: transformers' traceback
        where = arch.get("model_id") or arch.get("name")
        raise ModelResolutionError(f"{where}: its config cannot be read ({type(e).__name__}: {one_line(e, 200)}); "
                                   "restore the model's config.json") from None
    try:
        model = build_hf_model(config, on_meta=True)
    except ValueError as e:   # transformers lists every causal LM class it knows, over many lines
        raise ModelResolutionError(f"{type(config).__name__}: no causal LM to build from it "
                                   f"({str(e).splitlines()[0][:200]})") from None
    layout = hf_layout(model, scratch=True)
    shape = layout.block
    blocks = list(getattr(layout.base, layout.blocks_attr))
    hidden = _config_int(config, "hidden_size")
    heads, q, kv = _attention_widths(config, shape, hidden)
    seq = _positions(config, seq_len)
    vocab = _config_int(config, "vocab_size")

    base = layout.base
    first = [getattr(base, n) for n in layout.embed_names]
    final = [getattr(base, n) for n in layout.final_names]
    lm_head = model.get_output_embeddings()
    tied = lm_head.weight is model.get_input_embeddings().weight
    seen: set = set()
    embedding = _numel_once(first, seen)
    block_params = [_numel_once([b], seen) for b in blocks]
    head = _numel_once(final + [lm_head], seen)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    head_matmul = lm_head.weight.numel()
    final_matmul = sum(_matmul_numel(m) for m in final)    # OPT's project_out back to the embedding width

    block_matmul = [_matmul_numel(b) for b in blocks]
    # 2 FLOPs per weight per token, plus QK^T and AV: 2*2*seq*(heads*head_dim) per token.
    block_flops = [2.0 * mm + 4.0 * seq * q for mm in block_matmul]
    measured: Dict[str, Any] = {}
    block_act = [_block_activation(config, layout, seq, block_matmul[0], (hidden, q, kv, heads, shape), measured)] \
        * len(blocks)

    prefix = layout.prefix
    return ModelMeta(
        name=str(arch.get("name", config.model_type)),
        family="hf",
        model_type=config.model_type,
        n_layer=len(blocks),
        hidden_size=hidden,
        num_heads=heads,
        seq_len=seq,
        vocab_size=vocab,
        total_params=total,
        embedding_params=embedding,
        head_params=head,
        block_params=block_params,
        block_matmul_params=block_matmul,
        head_matmul_params=head_matmul,
        block_flops_fwd_per_token=block_flops,
        head_flops_fwd_per_token=2.0 * (head_matmul + final_matmul),
        block_activation_bytes_per_token=block_act,
        # final norm input (2h) + logits in fp32 for the loss (4*vocab)
        head_activation_bytes_per_token=float(2 * hidden + 4 * vocab),
        tied_embeddings=bool(tied),
        first_stage_modules=[f"{prefix}.{n}" for n in layout.embed_names],
        last_stage_modules=[f"{prefix}.{n}" for n in layout.final_names] + [layout.head_name],
        block_modules=[f"{prefix}.{layout.blocks_attr}.{i}" for i in range(len(blocks))],
        extra={"block_class": type(blocks[0]).__name__, "attention_module": shape.attention,
               "kv_width": kv, "query_width": q, "ffn_size": shape.ffn_size, "gated_mlp": shape.up_projections > 1,
               "norms_per_block": shape.norms, "parallel_shared_input": shape.shared_input,
               "first_stage_matmul_params": sum(_matmul_numel(m) for m in first),   # OPT's project_in
               "block_activations": "measured" if measured else "formula", **measured},
    )


# arch.family -> how its models are introspected
INTROSPECTION = {"hf": _introspect_hf, "hrm": _introspect_hrm}
