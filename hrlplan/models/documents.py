"""Packed documents inside a pipeline stage: positions, the per-document attention, the token-weighted loss.

data/packed_stream.py describes the step's wire form. A stage given it:
- embeds at each token's position inside its document (learned positions) or rotates by it (RoPE);
- attends only inside each document. With SDPA (HF's default) the attention runs document by document
  ("hrlplan_documents", registered with HF's AttentionInterface): each document's causal square
  and nothing else, as a variable-length kernel does, so a micro-batch's attention costs the sum of
  its documents' squares (what data/dispatch.py balances), and padding costs none. With eager
  attention the block-diagonal causal mask is added to the scores (the whole budget's square);
- passes (positions, document ids) on beside its activations to the next stage.
The loss of a micro-batch is its summed token loss over the step's useful tokens, scaled so that
torch's schedules (which divide the gradients by the number of micro-batches) and data parallelism
(which averages over replicas) give the gradient of the step's mean loss per token.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from hrlplan.data.packed_stream import INPUT_CHANNELS, TARGET_EXTRA_COLUMNS
from hrlplan.data.packing import IGNORE_INDEX, PAD_DOCUMENT, additive_attention_mask

DOCUMENT_ATTENTION = "hrlplan_documents"
Span = Tuple[int, int, bool]   # start, end (exclusive), padding


def is_packed_inputs(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.shape[1] == INPUT_CHANNELS and not x.is_floating_point()


def split_packed_inputs(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token ids [rows, budget], side [rows, 2, budget]: positions and document ids)."""
    return x[:, 0], x[:, 1:]


def trim_packed(inputs: torch.Tensor, targets: torch.Tensor, budget: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A replica's packed rows cut to its own token budget (its plan's seq_len): the wire rows are
    data.seq_len long and filled only up to `budget` (data/packed_stream.py); the two step columns
    stay. Raises if a document would be cut off (a layout that does not match the plan's)."""
    width = inputs.shape[-1]
    if budget >= width:
        return inputs, targets
    if (inputs[:, 2, budget:] != PAD_DOCUMENT).any():
        raise ValueError(f"packed rows hold documents past this replica's {budget}-token budget: the data's "
                         "layout was not built from this plan")
    return inputs[..., :budget], torch.cat([targets[:, :budget], targets[:, width:]], dim=1)


def is_packed_targets(logits: torch.Tensor, targets: torch.Tensor) -> bool:
    return targets.dim() == 2 and targets.shape[-1] == logits.shape[-2] + TARGET_EXTRA_COLUMNS


def packed_micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum of this micro-batch's token losses / the step's useful tokens, times the step's rows over
    this micro-batch's rows (= micro-batches x replicas): the schedule's 1/micro-batches and the data
    parallel average cancel it, and a replica's losses, averaged as the engine reports them and summed
    over replicas, give the step's loss per token."""
    token_targets = targets[:, :logits.shape[-2]]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), token_targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return _step_weighted(total, logits, targets)


def sharded_packed_micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor, mesh) -> torch.Tensor:
    """packed_micro_batch_loss over logits sharded on the vocabulary (this rank's vocab/tp columns of a
    vocabulary-parallel head, runtime/tensor_parallel.py): under torch's loss_parallel() the summed
    cross entropy (padding ignored) reduces per-token maxima and sums over `mesh` instead of gathering
    the logits. A plain tensor, equal on every rank of `mesh` (not a view: zero-bubble schedules detach
    the loss in place)."""
    token_targets = targets[:, :logits.shape[-2]]
    local = logits.reshape(-1, logits.size(-1)).float()
    sharded = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    total = F.cross_entropy(sharded, token_targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return _step_weighted(total.to_local().clone(), logits, targets)


def _step_weighted(total: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    budget = logits.shape[-2]
    step_tokens, step_rows = targets[0, budget], targets[0, budget + 1]
    return total * (step_rows.float() / targets.shape[0]) / step_tokens.clamp(min=1).float()


def document_spans(doc_ids: torch.Tensor) -> List[List[Span]]:
    """Per row, its runs of one document id in order (padding runs flagged), covering the whole row."""
    out: List[List[Span]] = []
    for row in doc_ids.tolist():
        spans: List[Span] = []
        start = 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                spans.append((start, i, row[start] == PAD_DOCUMENT))
                start = i
        out.append(spans)
    return out


def documents_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask, document_spans=None, **kwargs):
    """HF's attention interface: SDPA over each document's causal square; without document_spans,
    HF's own SDPA forward, untouched. Padding's outputs are zero (its targets are ignored)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward   # why: transformers is optional here

    if document_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    for b, spans in enumerate(document_spans):
        parts = []
        for start, end, padding in spans:
            if padding:
                parts.append(query.new_zeros(1, end - start, query.shape[1], value.shape[-1]))
                continue
            out, _ = sdpa_attention_forward(module, query[b:b + 1, :, start:end], key[b:b + 1, :, start:end],
                                            value[b:b + 1, :, start:end], None, is_causal=True, **kwargs)
            parts.append(out)
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


def register_document_attention() -> None:
    from transformers import AttentionInterface   # why: as above

    if DOCUMENT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(DOCUMENT_ATTENTION, documents_attention_forward)


def use_document_attention(blocks) -> str:
    """Point the attention modules of `blocks` at the per-document SDPA (a copy of their config, so the
    model's own config and other stages are untouched); their implementation before ("sdpa", "eager")."""
    modules = [m for block in blocks for m in block.modules() if hasattr(m, "config") and
               "attention" in type(m).__name__.lower() and hasattr(m.config, "_attn_implementation")]
    if not modules:
        return "sdpa"
    before = modules[0].config._attn_implementation
    if before in ("sdpa", DOCUMENT_ATTENTION):
        register_document_attention()
        for m in modules:
            if m.config._attn_implementation != DOCUMENT_ATTENTION:
                m.config = copy.copy(m.config)
                m.config._attn_implementation = DOCUMENT_ATTENTION
        return "sdpa"
    if before != "eager":
        raise NotImplementedError(f"data.packing: attention {before!r} does not take packed documents here; "
                                  "use the default sdpa (per-document) or eager (block-diagonal mask)")
    return before


def document_attention_kwargs(doc_ids: torch.Tensor, implementation: str, dtype: torch.dtype) -> Dict:
    """What each block is called with: the per-document spans (sdpa) or the additive mask (eager)."""
    if implementation == "eager":
        return {"attention_mask": additive_attention_mask(doc_ids, dtype)}
    return {"attention_mask": None, "document_spans": document_spans(doc_ids)}
