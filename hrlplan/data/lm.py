"""Token batches for the language models, a pure function of (seed, step).

Every rank can produce the batch for any step without coordination, so data-parallel replicas
take their own rows and a resumed run continues with exactly the batches it would have seen.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hrlplan.config import DataConfig, section
from hrlplan.data.code_corpus import CodeCorpus, prepare_code_corpus
from hrlplan.data.packed_stream import StepLayout, build_packed_stream
from hrlplan.data.packing_options import packing_refusal
from hrlplan.errors import UserError


class SyntheticTokens:
    """Walks along one of `chains` fixed random permutations of the vocabulary, one chain per sequence.

    The next token is a function of the current token and the (hidden) chain: bigram statistics
    give part of it and context the rest, so even a tiny model's loss falls within a few steps.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, chains: int = 4):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.stack([torch.randperm(vocab_size, generator=g) for _ in range(chains)])

    def batch(self, step: int, batch_size: int, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "val"))
        chain = torch.randint(0, self.successor.shape[0], (batch_size,), generator=g)
        tok = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        seq = [tok]
        for _ in range(self.seq_len):
            tok = self.successor[chain, tok]
            seq.append(tok)
        rows = torch.stack(seq, dim=1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenWindows:
    """Random windows of a tokenised corpus (train or validation split)."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, seq_len: int, seed: int):
        self.tokens = {"train": train, "val": val}
        self.seq_len, self.seed = seq_len, seed
        for split, toks in self.tokens.items():
            if toks.numel() <= seq_len + 1:
                raise ValueError(f"the {split} split has {toks.numel()} tokens, fewer than data.seq_len+1={seq_len + 1}")

    def batch(self, step: int, batch_size: int, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
        toks = self.tokens[split]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "val"))
        starts = torch.randint(0, toks.numel() - self.seq_len - 1, (batch_size,), generator=g)
        rows = torch.stack([toks[s:s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def build_lm_data(data: DataConfig, vocab_size: int, seed: int, plan=None, train=None,
                  coefficients: Optional[Tuple[float, float]] = None):
    """The language-model stream `data` (a DataConfig, or its plain mapping) names. data.packing=document|
    balanced gives a PackedLMStream (data/packed_stream.py); `plan` lays a balanced step out over its
    replicas and micro-batches (without it: one replica, one row a micro-batch), and with `train`
    refuses what packed documents do not run with. `coefficients` (linear, quadratic: a document's cost,
    cost/lengths.document_coefficients) let `balanced` weigh whole steps; without them it weighs attention."""
    data = section(DataConfig, data)
    name = str(data.name)
    packing = str(getattr(data.packing, "value", data.packing))
    refused = packing_refusal(packing, name, plan=plan, train=train)
    if refused:
        raise UserError(refused)
    if name == "synthetic":
        return SyntheticTokens(vocab_size, int(data.seq_len), seed, int(data.synthetic_chains))
    if name == "code":
        path = data.path or "data/code"
        # The corpus does not depend on the training seed: changing train.seed must not rebuild it.
        corpus = CodeCorpus.load(prepare_code_corpus(
            path, int(data.vocab_size), int(data.max_files), 0, tokenizer=data.tokenizer, source=data.source))
        if corpus.vocab_size > vocab_size:
            raise ValueError(f"data: the tokenizer at {path} has {corpus.vocab_size} tokens but arch.vocab_size is "
                             f"{vocab_size}; set arch.vocab_size={corpus.vocab_size} (or larger)")
        if packing != "concat":
            if corpus.eot_id is None:
                raise UserError(f"data.packing={packing}: the corpus at {path} has no end-of-text token to cut "
                                "documents at; rebuild it with a tokenizer that has one, or use data.packing=concat")
            layout = StepLayout.of_plan(plan) if plan is not None else None
            budget_s, prefetch = float(data.dispatch_budget_s), int(data.dispatch_prefetch)
            return build_packed_stream(packing, corpus.train_tokens, corpus.val_tokens, int(corpus.eot_id),
                                       int(data.seq_len), seed, layout, coefficients=coefficients or (0.0, 1.0),
                                       time_budget_s=budget_s, prefetch=prefetch)
        return TokenWindows(corpus.train_tokens, corpus.val_tokens, int(data.seq_len), seed)
    raise ValueError(f"data.name={name!r} is not a language-model data set; choose synthetic or code "
                     "(sudoku is for arch=hrm)")
