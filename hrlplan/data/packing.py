"""Document-aware packing: whole documents in fixed-shape micro-batches, attention kept inside each.

`data.packing` names how a language-model step is built from a corpus of documents:

- `concat`   -- today's behaviour (data/lm.py's TokenWindows): random windows of the concatenated
                token stream; a window crosses document boundaries and attends across them.
- `document` -- whole documents (one ending with the end-of-text token), drawn as a pure function
                of (seed, step), packed in arrival order (next-fit) into the step's micro-batches;
                each token carries its document id, positions restart at 0 for every document, and
                attention is block-diagonal causal, so a token sees only its own document.
- `balanced` -- the same documents per step as `document` (the loss curves are equal in
                expectation), assigned to micro-batches by their cost (data/dispatch.py), so the
                slowest micro-batch, which the pipeline waits on, is as small as possible.

A micro-batch is one row of `token_budget` tokens (data.seq_len): every micro-batch of every step has
the same shape, as torch pipelining needs. A document longer than the budget is cut into pieces of at
most `token_budget` predictions; consecutive pieces overlap by one token, so every next-token
prediction of the document is made exactly once, but a later piece does not see the earlier ones.
Padding has document id PAD_DOCUMENT and target IGNORE_INDEX: it attends only to padding and is left
out of the loss, which is token-weighted over the whole step (token_weighted_loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

PACKING_MODES = ("concat", "document", "balanced")
IGNORE_INDEX = -100      # F.cross_entropy's default ignore_index
PAD_DOCUMENT = -1


@dataclass
class PackedBatch:
    """A step's micro-batches, each row one micro-batch of token_budget tokens."""
    inputs: torch.Tensor      # [micro_batches, budget] token ids (padding: pad_id)
    targets: torch.Tensor     # [micro_batches, budget] next token, IGNORE_INDEX on padding
    positions: torch.Tensor   # [micro_batches, budget] position inside its document, 0 on padding
    doc_ids: torch.Tensor     # [micro_batches, budget] document index in the step, PAD_DOCUMENT on padding

    @property
    def useful_tokens(self) -> int:
        """Predictions that count in the loss: the denominator of token_weighted_loss."""
        return int((self.targets != IGNORE_INDEX).sum())

    def attention_mask(self) -> torch.Tensor:
        return block_causal_mask(self.doc_ids)


def split_documents(tokens: torch.Tensor, eot_id: int) -> List[torch.Tensor]:
    """A flat token stream cut after every end-of-text token (each document keeps its own); a tail
    without one is a document too. Documents of one token give no prediction and are dropped here,
    before any step sees them."""
    if tokens.dim() != 1:
        raise ValueError(f"split_documents takes a flat token stream, got shape {tuple(tokens.shape)}")
    ends = (tokens == eot_id).nonzero().flatten() + 1
    bounds = [0, *ends.tolist()]
    if bounds[-1] != tokens.numel():
        bounds.append(tokens.numel())
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:]) if b - a >= 2]


def document_pieces(document: torch.Tensor, token_budget: int) -> List[torch.Tensor]:
    """The document (n tokens, n - 1 predictions) in pieces of at most token_budget + 1 tokens;
    consecutive pieces share one token, so each prediction is in exactly one piece."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be at least 1, got {token_budget}")
    n = document.numel()
    return [document[start:min(n, start + token_budget + 1)] for start in range(0, n - 1, token_budget)]


def predictions(piece_or_length) -> int:
    """Positions a piece takes in a micro-batch: its tokens less one (the last is only a target)."""
    n = piece_or_length if isinstance(piece_or_length, int) else piece_or_length.numel()
    return n - 1


def pack_micro_batches(pieces: Sequence[torch.Tensor], assignment: Sequence[Sequence[int]], token_budget: int,
                       pad_id: int = 0) -> PackedBatch:
    """Micro-batch m holds pieces assignment[m], in that order. Every piece must be assigned exactly
    once and fit: anything else is a bug in the caller, raised, never silently dropped."""
    seen = sorted(i for group in assignment for i in group)
    if seen != list(range(len(pieces))):
        raise ValueError(f"the assignment must hold each of the {len(pieces)} pieces exactly once, got {seen}")
    rows = len(assignment)
    inputs = torch.full((rows, token_budget), pad_id, dtype=torch.long)
    targets = torch.full((rows, token_budget), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((rows, token_budget), dtype=torch.long)
    doc_ids = torch.full((rows, token_budget), PAD_DOCUMENT, dtype=torch.long)
    for row, group in enumerate(assignment):
        at = 0
        for i in group:
            piece = pieces[i]
            n = predictions(piece)
            if at + n > token_budget:
                raise ValueError(f"micro-batch {row} overflows its {token_budget}-token budget with piece {i}")
            inputs[row, at:at + n] = piece[:-1]
            targets[row, at:at + n] = piece[1:]
            positions[row, at:at + n] = torch.arange(n)
            doc_ids[row, at:at + n] = i
            at += n
    return PackedBatch(inputs, targets, positions, doc_ids)


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean, True where query q may attend to key k: same document and k <= q
    (scaled_dot_product_attention's boolean attn_mask; HF models take it as a 4-D attention_mask).
    Padding shares PAD_DOCUMENT, so a pad attends to earlier pads and no real token attends to a pad;
    every row keeps its diagonal, so no row is fully masked (which would give NaN)."""
    seq = doc_ids.shape[-1]
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal).unsqueeze(1)


def additive_attention_mask(doc_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """block_causal_mask as eager attention adds it to the scores: 0 where allowed, the dtype's most
    negative value elsewhere (not -inf: a fully masked row would give NaN)."""
    allowed = block_causal_mask(doc_ids)
    return torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device).masked_fill(~allowed, torch.finfo(dtype).min)


def document_lengths(doc_ids: torch.Tensor) -> List[List[int]]:
    """Per row, the lengths of its documents in order (padding left out): the varlen form
    (cu_seqlens) a kernel that skips masked blocks takes, and what the dispatch cost is computed from."""
    out = []
    for row in doc_ids.tolist():
        lengths: List[int] = []
        previous = None
        for d in row:
            if d == PAD_DOCUMENT:
                previous = None
                continue
            if d == previous:
                lengths[-1] += 1
            else:
                lengths.append(1)
            previous = d
        out.append(lengths)
    return out


def token_weighted_loss(logits: torch.Tensor, targets: torch.Tensor, step_tokens: Optional[int] = None) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-padding targets, divided by step_tokens (the
    step's useful tokens, summed over all its micro-batches; this micro-batch's own when None): the
    sum of every micro-batch's value is the step's mean loss per token, as training on each document
    on its own and averaging over all their tokens gives."""
    if logits.dtype in (torch.float16, torch.bfloat16):   # summing many terms: not in half precision
        logits = logits.float()
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    count = int((targets != IGNORE_INDEX).sum()) if step_tokens is None else step_tokens
    return total / max(count, 1)


def next_fit(lengths: Sequence[int], micro_batches: int, token_budget: int) -> Tuple[List[List[int]], int]:
    """Arrival order: pieces fill micro-batch 0 until the next does not fit, then 1, and so on.
    Returns the assignment of the first `taken` pieces (those that fit in the step) and taken."""
    assignment: List[List[int]] = [[] for _ in range(micro_batches)]
    row, used = 0, 0
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"piece {i} makes {n} predictions, more than the {token_budget}-token budget")
        if used + n > token_budget:
            row, used = row + 1, 0
            if row == micro_batches:
                return assignment, i
        assignment[row].append(i)
        used += n
    return assignment, len(lengths)


def first_fit(lengths: Sequence[int], capacities: Sequence[int]) -> Tuple[List[List[int]], List[int]]:
    """Arrival order over rows of unequal budgets (replicas with their own sequence length): each piece
    to the first row it still fits, so long pieces land in long rows and short rows fill with short
    pieces; a piece that fits no row is passed over (it is not drawn for this step), until the rows are
    full or the pieces run out. Returns (assignment, taken): the assignment indexes `taken`, the
    positions in `lengths` of the pieces the step holds, in arrival order."""
    assignment: List[List[int]] = [[] for _ in capacities]
    left = [int(c) for c in capacities]
    taken: List[int] = []
    for i, n in enumerate(lengths):
        if max(left) == 0:
            break
        row = next((r for r, free in enumerate(left) if n <= free), None)
        if row is not None:
            assignment[row].append(len(taken))
            taken.append(i)
            left[row] -= n
    return assignment, taken


class PackedDocuments:
    """A step's packed micro-batches of whole documents, a pure function of (seed, step, split).

    The step's pieces are drawn at random (with replacement across steps) and taken in arrival order
    while they fit next-fit into `micro_batches` rows of `token_budget` (so the padding is what the
    last piece that did not fit leaves). `balanced` then re-dispatches those same pieces by cost
    through `dispatcher` (pieces lengths -> assignment), e.g. functools.partial(dispatch.dispatch, ...).
    The documents are the same on every rank; a balanced assignment is not when the integer program
    stops at its wall-clock deadline, so one rank per pipeline (the first stage, whose activations
    carry on) or per job (broadcasting the assignment) must decide it."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, eot_id: int, token_budget: int, seed: int,
                 packing: str = "document", dispatcher=None, pad_id: Optional[int] = None):
        if packing not in ("document", "balanced"):
            raise ValueError(f"data.packing={packing!r}: PackedDocuments packs 'document' or 'balanced' "
                             "('concat' is data/lm.py's TokenWindows)")
        if packing == "balanced" and dispatcher is None:
            raise ValueError("data.packing=balanced needs a dispatcher (data/dispatch.py's dispatch with the "
                             "cost coefficients)")
        self.pieces = {}
        for split, tokens in (("train", train), ("val", val)):
            pieces = [p for doc in split_documents(tokens, eot_id) for p in document_pieces(doc, token_budget)]
            if not pieces:
                raise ValueError(f"the {split} split holds no document of two or more tokens")
            self.pieces[split] = pieces
        self.token_budget, self.seed, self.packing, self.dispatcher = token_budget, seed, packing, dispatcher
        self.pad_id = eot_id if pad_id is None else pad_id

    def step_pieces(self, step: int, micro_batches: int, split: str = "train",
                    capacities: Optional[Sequence[int]] = None):
        """The step's pieces in arrival order and their next-fit (document packing) assignment;
        capacities: each row's own budget, at most token_budget (then first_fit)."""
        pool = self.pieces[split]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "val"))
        # more draws than can fit: a step of micro_batches x budget never takes all of them
        draws = torch.randint(0, len(pool), (micro_batches * self.token_budget,), generator=g).tolist()
        candidates = [pool[i] for i in draws]
        lengths = [predictions(p) for p in candidates]
        if capacities is None:
            assignment, taken = next_fit(lengths, micro_batches, self.token_budget)
        else:
            if len(capacities) != micro_batches or any(not 1 <= c <= self.token_budget for c in capacities):
                raise ValueError(f"capacities must give each of {micro_batches} rows 1..{self.token_budget} tokens, "
                                 f"got {list(capacities)}")
            assignment, kept = first_fit(lengths, capacities)
            return [candidates[i] for i in kept], assignment
        return candidates[:taken], assignment

    def pack(self, pieces: Sequence[torch.Tensor], assignment: Sequence[Sequence[int]]) -> PackedBatch:
        return pack_micro_batches(pieces, assignment, self.token_budget, self.pad_id)

    def batch(self, step: int, micro_batches: int, split: str = "train") -> PackedBatch:
        pieces, assignment = self.step_pieces(step, micro_batches, split)
        if self.packing == "balanced":
            assignment = self.dispatcher([predictions(p) for p in pieces], micro_batches=micro_batches,
                                         capacity=self.token_budget, fallback=assignment)
        return self.pack(pieces, assignment)
