"""Two cost-model pieces timed on one GPU against their prediction (< 30 s; prints one JSON line each).

    python bench/gpu_cost_pieces.py

- unfused attention (Megatron's path: Q K^T by baddbmm with the 1/sqrt(d) scale, softmax, dropout 0.1,
  the product with V; causal mask left out, as Megatron fuses it into the softmax) forward and
  forward + backward, bf16, against cost.kernels.unfused_attention_core;
- AdamW steps (torch.optim.AdamW fused=True and foreach=True) and torch's gradient clipping over 2^28
  fp32 parameters, against cost.kernels.optimizer_step_s (OPTIMIZER_STEP_BYTES + CLIP_BYTES at HBM x
  MEMORY_FRACTION).
On a machine without CUDA it says so and exits 0.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hrlplan.cost import kernels  # noqa: E402
from hrlplan.devices import peak_flops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402  (bench/: one CUDA-event timer)


def _ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    return gpu_kernels.time_ms(fn, repeats, warmup)["median_ms"]


def unfused_attention(k: kernels.GpuKernels, batch: int, heads: int, seq: int, head_dim: int) -> dict:
    q, kk, v = (torch.randn(batch * heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3))
    grad = torch.randn(batch * heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    out_buf = torch.empty(batch * heads, seq, seq, device="cuda", dtype=torch.bfloat16)

    def fwd():
        scores = torch.baddbmm(out_buf, q, kk.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(head_dim))
        return torch.bmm(F.dropout(torch.softmax(scores, dim=-1), 0.1), v)

    def fwd_bwd():
        fwd().backward(grad)

    measured_f, measured_fb = _ms(fwd), _ms(fwd_bwd)
    meta = SimpleNamespace(hidden_size=heads * head_dim, num_heads=heads, seq_len=seq)
    pf, pb = kernels.unfused_attention_core(k, meta, batch * seq, 1, 2)
    return {"piece": "unfused_attention", "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim,
            "measured_fwd_ms": measured_f, "predicted_fwd_ms": pf * 1e3, "measured_fwd_bwd_ms": measured_fb,
            "predicted_fwd_bwd_ms": (pf + pb) * 1e3, "ratio_fwd_bwd": (pf + pb) * 1e3 / measured_fb}


def optimizer_step(k: kernels.GpuKernels, impl: str, numel: int = 1 << 28, tensors: int = 64) -> dict:
    params = [torch.nn.Parameter(torch.randn(numel // tensors, device="cuda")) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **{impl: True})
    step = _ms(opt.step, repeats=5)
    clip = _ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True), repeats=5)
    rate = k.hbm * kernels.MEMORY_FRACTION
    predicted = kernels.optimizer_step_s(k, numel, kernels.OPTIMIZER_STEP_BYTES[impl] + kernels.CLIP_BYTES["torch"])
    return {"piece": f"optimizer_{impl}", "params": numel, "measured_adamw_ms": step, "measured_clip_ms": clip,
            "predicted_step_and_clip_ms": predicted * 1e3, "ratio": predicted * 1e3 / (step + clip),
            "adamw_bytes_per_param_at_memory_fraction": step * 1e-3 * rate / numel,
            "counted_adamw_bytes": kernels.OPTIMIZER_STEP_BYTES[impl],
            "clip_bytes_per_param_at_memory_fraction": clip * 1e-3 * rate / numel,
            "counted_clip_bytes": kernels.CLIP_BYTES["torch"]}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_cost_pieces: no CUDA device: nothing measured")
        return 0
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name, "bf16") or 989e12
    hbm, sms = kernels.gpu_facts(name, peak)
    k = kernels.GpuKernels(peak=peak, hbm=hbm, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                           name=name)
    print(json.dumps({"device": name, "torch": torch.__version__}))
    for batch, heads, seq, d in ((4, 16, 2048, 128), (1, 32, 4096, 128), (8, 24, 2048, 96)):
        try:
            print(json.dumps(unfused_attention(k, batch, heads, seq, d)), flush=True)
        except Exception as e:   # one shape failing must not lose the others
            print(json.dumps({"piece": "unfused_attention", "seq": seq, "error": f"{type(e).__name__}: {e}"}))
        torch.cuda.empty_cache()
    for impl in ("fused", "foreach"):
        try:
            print(json.dumps(optimizer_step(k, impl)), flush=True)
        except Exception as e:
            print(json.dumps({"piece": f"optimizer_{impl}", "error": f"{type(e).__name__}: {e}"}))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
