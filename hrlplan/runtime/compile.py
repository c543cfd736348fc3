"""Regional compilation (train.compile=true): every transformer block of a stage compiled on its own
with torch.compile, as torchtitan's apply_compile does.

Dynamo treats a module's parameters as graph inputs (inline_inbuilt_nn_modules, torch's default
since 2.5), so blocks of one class and shape share one compiled graph: a stage of many blocks
compiles in about one block's time (bench/compile.py reports it), while the embedding, the head and
the pipeline's send/receive stay eager. Order (torchtitan's): tensor parallel, activation
recomputation, compile, then FSDP -- FSDP's hooks run around the compiled block, and a checkpointed
block is compiled with its checkpoint (dynamo traces torch.utils.checkpoint as a higher-order op,
keeping the recomputation and the op-level policy).

fullgraph=True: a graph break would silently run part of a block eagerly, which a user asking for
compile should hear about. transformers' GPT-2 and Llama blocks trace whole (tests/test_compile.py);
a block that breaks fails at its first step with dynamo's error naming the break.

Inductor on CPU builds C++ kernels: a host without a C++ compiler is refused before workers start
(hrlplan/validate/train_options.compile_refusal, from hrlplan/validate/host.py).
"""
from __future__ import annotations

import copy
import statistics
import time
from contextlib import nullcontext
from typing import Callable, Dict

import torch
import torch.nn as nn

from hrlplan.activations import saved_activation_bytes

# The calibration record's key for the measured figure (cost.device_model.Overheads.compile_speedup)
SPEEDUP_KEY = "compile_speedup"


def apply_compile(part: nn.Module, fullgraph: bool = True, backend: str = "inductor") -> nn.Module:
    """Compile every block of an HFStage (its ModuleDict of blocks) in place; returns the part.

    nn.Module.compile keeps the module's identity, names and state_dict keys (no `_orig_mod.`
    prefix): checkpoints, FSDP and the tied-weight bookkeeping see the same parameters."""
    blocks = getattr(part.base, part.blocks_attr)
    for block in blocks.values():
        block.compile(fullgraph=fullgraph, backend=backend)
    return part


def eager_while(measuring: bool):
    """Compiled blocks run eagerly while a TorchDispatchMode tracker measures: dynamo cannot trace
    under a Python dispatch mode and would mark the block's code as skipped for good -- never
    compiling it -- or, with fullgraph, fail. force_eager leaves the compiled code untouched for the
    steps after. The memory meter no longer runs its tracker over compiled blocks (it measures them
    from the allocator, runtime/memory.AllocatorPeak), so `measuring` is False there and the
    measured steps run compiled; this stays for a caller that does trace compiled code."""
    return torch.compiler.set_stance("force_eager") if measuring else nullcontext()


def _fwd_bwd_s(block: nn.Module, make_input: Callable[[], torch.Tensor]) -> float:
    x = make_input().requires_grad_(True)
    start = time.perf_counter()
    out = block(x)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    return time.perf_counter() - start


def measure_compile_speedup(block: nn.Module, make_input: Callable[[], torch.Tensor], rounds: int = 5,
                            steps: int = 3, backend: str = "inductor") -> Dict[str, float]:
    """train.compile's speed-up of one block's forward + backward on this device, for calibration
    (recorded as SPEEDUP_KEY, which the cost model divides the blocks' compute by when a run compiles).

    A copy of `block` is compiled as apply_compile compiles it (fullgraph); the first compiled call
    (the compile itself) is timed apart. Eager and compiled then alternate, `steps` calls each per
    round, so both see the same load; each round compares the fastest call of each (another tenant's
    burst only slows a call: on a shared 2-core VM single calls of one block spread 1.4-85 ms), and
    the figure is the median of the rounds' eager/compiled ratios, with its min and max. `make_input` gives a fresh input of the
    block (a micro-batch's hidden states); `backend="eager"` exercises the logic without inductor."""
    compiled = copy.deepcopy(block)
    compiled.compile(fullgraph=True, backend=backend)
    start = time.perf_counter()
    _fwd_bwd_s(compiled, make_input)
    compile_s = time.perf_counter() - start
    _fwd_bwd_s(block, make_input)   # eager's warm-up (allocator, first-call dispatch)
    ratios = []
    for _ in range(rounds):
        eager = min(_fwd_bwd_s(block, make_input) for _ in range(steps))
        fast = min(_fwd_bwd_s(compiled, make_input) for _ in range(steps))
        ratios.append(eager / max(fast, 1e-12))
    block.zero_grad(set_to_none=True)
    return {SPEEDUP_KEY: statistics.median(ratios), "min": min(ratios), "max": max(ratios), "compile_s": compile_s}


def measure_saved_bytes(part: nn.Module, make_input: Callable[[], torch.Tensor], backend: str = "inductor"
                        ) -> Dict[str, int]:
    """Bytes one forward of a stage `part` (an HFStage of blocks) saves for its backward, eager and
    with its blocks compiled as apply_compile compiles them: {"eager": ..., "compiled": ...}.
    AOTAutograd's compiled function saves its tensors through autograd's save_for_backward, so
    saved-tensor hooks see them (hrlplan.activations); the cost model's compiled term
    (cost/memory.compiled_saved_per_token) is checked against this. The compiled copy runs once
    first: dynamo compiles outside the hooks."""
    compiled = apply_compile(copy.deepcopy(part), backend=backend)
    _fwd_bwd_s(compiled, make_input)
    out = {}
    for name, module in (("eager", part), ("compiled", compiled)):
        x = make_input().requires_grad_(True)
        kept = []
        out[name] = saved_activation_bytes(lambda: kept.append(module(x)), exclude=list(module.parameters()))
        result = kept[0]
        (result[0] if isinstance(result, tuple) else result).float().sum().backward()
    part.zero_grad(set_to_none=True)
    return out
