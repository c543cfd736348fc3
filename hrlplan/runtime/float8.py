"""Float8 training (train.float8=true): the blocks' linears swapped for torchao's Float8Linear
(torchao.float8.convert_to_float8_training, dynamic tensorwise scaling, torchtitan's default recipe),
on GPUs with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell).

Which linears are swapped is decided here (float8_skip_reason), as torchtitan and torchao decide it:
- only nn.Linear (an embedding is a lookup; GPT-2's transformers Conv1D is not a linear torchao knows);
- never the output head (lm_head): its logits feed the loss directly and fp8 there costs accuracy,
  which is why torchtitan filters "output";
- both dims multiples of 16 (torch._scaled_mm's requirement);
- not small ones: torchao's tensorwise auto-filter rule (K <= 4096 and N <= 1024 skipped), where
  the casts cost more than the fp8 matmul gains (torchao's H100 microbenchmarks).
The dims rule lives in hrlplan/cost/memory.py (float8_swaps), so the cost model prices the linears
this swaps.
Conversion happens on the whole stage before tensor parallel, recompute, compile and FSDP
(torchtitan's model converters run first, too). torchao is an optional dependency (the `float8`
extra), imported only here and only when asked for.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn

from hrlplan.cost.memory import FLOAT8_DIM_MULTIPLE, float8_small
from hrlplan.errors import UserError
from hrlplan.validate.train_options import FLOAT8_KEY

HEAD_NAMES = ("lm_head", "output")


def float8_skip_reason(module: nn.Module, fqn: str, skip_small: bool = True) -> Optional[str]:
    """Why the module at `fqn` stays in high precision, or None when it becomes a Float8Linear."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if not isinstance(module, nn.Linear):
        return "not an nn.Linear"
    if fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
        return "output head"
    if module.in_features % FLOAT8_DIM_MULTIPLE or module.out_features % FLOAT8_DIM_MULTIPLE:
        return f"dims not multiples of {FLOAT8_DIM_MULTIPLE}"
    if skip_small and float8_small(module.in_features, module.out_features):
        return "too small to gain"
    return None


def float8_filter(skip_small: bool = True):
    """The module_filter_fn torchao's convert_to_float8_training takes: True = swap."""
    return lambda module, fqn: float8_skip_reason(module, fqn, skip_small) is None


def float8_conversion(model: nn.Module, skip_small: bool = True) -> Dict[str, str]:
    """Every linear, embedding and Conv1D of the model by name: "float8", or why it is skipped."""
    out = {}
    for fqn, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D":
            out[fqn] = float8_skip_reason(module, fqn, skip_small) or "float8"
    return out


def apply_float8(part: nn.Module, skip_small: bool = True) -> int:
    """Swap the part's eligible linears for Float8Linear in place; returns how many were swapped.
    A stage where none qualifies is refused: train.float8=true would otherwise change nothing."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise UserError(f"{FLOAT8_KEY}=true needs torchao, which is not installed: pip install 'hrlplan[float8]' "
                        f"(or pip install torchao), or set {FLOAT8_KEY}=false") from None
    plan = float8_conversion(part, skip_small)
    swapped = sum(1 for v in plan.values() if v == "float8")
    if not swapped:
        reasons = sorted(set(plan.values()))
        raise UserError(f"{FLOAT8_KEY}=true swaps no linear of this model ({', '.join(reasons) or 'no linears'}): "
                        f"fp8 needs nn.Linear blocks with both dims multiples of {FLOAT8_DIM_MULTIPLE}, larger than "
                        f"torchao's small-matmul rule; set {FLOAT8_KEY}=false")
    convert_to_float8_training(part, module_filter_fn=float8_filter(skip_small))
    return swapped
