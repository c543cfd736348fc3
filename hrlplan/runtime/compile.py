"""Regional compilation (train.compile=true): every transformer block of a stage compiled on its own
with torch.compile, as torchtitan's apply_compile does.

One block is compiled once and its code reused by every block of the same shape (dynamo caches by
code object and guards), so a stage of many blocks compiles in about one block's time, and the
embedding, the head and the pipeline's send/receive stay eager. Order (torchtitan's): tensor
parallel, activation recomputation, compile, then FSDP -- FSDP's hooks run around the compiled
block, and a checkpointed block is compiled with its checkpoint (dynamo traces torch.utils.checkpoint
as a higher-order op, keeping the recomputation).

fullgraph=True where the block allows it: a graph break would silently fall back to eager for part
of the block, which a user asking for compile should hear about. HF's blocks carry a few Python-side
branches (a deprecation shim, an attention-interface lookup) that dynamo resolves at trace time;
should a future transformers release add a real break, the compile error names the block.

Inductor on CPU builds C++ kernels: a host without a C++ compiler is refused before workers start
(hrlplan/validate/train_options.compile_refusal, from hrlplan/validate/host.py).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from hrlplan.validate.train_options import COMPILE_KEY, compile_refusal  # noqa: F401


def apply_compile(part: nn.Module, fullgraph: bool = True) -> nn.Module:
    """Compile every block of an HFStage (its ModuleDict of blocks) in place; returns the part.

    nn.Module.compile keeps the module's identity, names and state_dict keys (no `_orig_mod.`
    prefix): checkpoints, FSDP and the tied-weight bookkeeping see the same parameters."""
    blocks = getattr(part.base, part.blocks_attr)
    for block in blocks.values():
        block.compile(fullgraph=fullgraph)
    return part


def eager_while(measuring: bool):
    """Compiled blocks run eagerly while the memory meter's TorchDispatchMode is on (the first
    steps): dynamo cannot trace under a Python dispatch mode and would mark the block's code as
    skipped for good -- never compiling it -- or, with fullgraph, fail. force_eager leaves the
    compiled code untouched for the steps after; the measured memory is then eager's."""
    return torch.compiler.set_stance("force_eager") if measuring else nullcontext()
