"""AdamATan2: the optimizer HRM's pretrain.py uses (the `adam-atan2` package, a CUDA-only kernel).

Per parameter, with step t (1-based), the kernel computes in float32 (float64 for float64 params):
    p   <- p * (1 - lr * weight_decay)
    m   <- lerp(m, g, 1 - beta1)
    v   <- lerp(v, g * g, 1 - beta2)
    p   <- p - lr / (1 - beta1^t) * atan2(m, sqrt(v) / sqrt(1 - beta2^t))
No epsilon: atan2 is bounded and defined at v = 0. Note the bias correction of m multiplies the
step outside atan2, and there is no 1.27 scale: `adam-atan2-pytorch`'s AdamAtan2 (a=1.27, b=1,
atan2(m_hat, b*sqrt(v_hat))) is a different update, so HRM's rule is written here.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from torch.optim.optimizer import Optimizer


class AdamATan2(Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 1e-2):
        if lr < 0.0:
            raise ValueError(f"AdamATan2: lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamATan2: betas={betas} must lie in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"AdamATan2: weight_decay={weight_decay} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _state_of(self, p: torch.Tensor):
        state = self.state[p]
        if not state:
            # Same keys and types as the reference (a float32 step tensor), so states interchange;
            # kept on the CPU (as torch's Adam does) so reading it never waits for the GPU.
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamATan2 does not support sparse gradients")
                state = self._state_of(p)
                state["step"] += 1
                _update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], float(state["step"].item()),
                        lr, beta1, beta2, wd)
        return loss


def _update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float,
            lr: float, beta1: float, beta2: float, weight_decay: float) -> None:
    """One parameter's step; low-precision tensors are updated through float32 as the kernel does."""
    # The constants are computed in double and rounded once, as the kernel's scalar setup does.
    step_size = lr / (1.0 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    math_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    low = p.dtype != math_dtype
    tensors: List[torch.Tensor] = [p, grad, exp_avg, exp_avg_sq]
    param, g, m, v = (t.to(math_dtype) for t in tensors) if low else tensors
    param.mul_(1.0 - lr * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.lerp_(g * g, 1.0 - beta2)
    param.sub_(torch.atan2(m, v.sqrt() / bias_correction2_sqrt), alpha=step_size)
    if low:
        p.copy_(param)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
