"""Raw GPU kernel timings behind cost/kernels.py's constants (run on one GPU; prints JSON).

    python bench/gpu_kernels.py out.json

Measures, in bf16 on the current CUDA device, with CUDA events (median of repeats after warm-up):
- GEMMs over (M, N, K): the tile efficiency the cost model's roofline assumes (GEMM_PEAK_FRACTION,
  GEMM_K_HALF) is fitted to these by bench/fit_kernel_constants.py, never to a published row;
- elementwise kernels (copy, add, GELU, LayerNorm, RMSNorm-like) on large tensors: the fraction of HBM
  bandwidth they reach (MEMORY_FRACTION);
- a one-element kernel issued back to back: the launch-bound time per kernel (KERNEL_LAUNCH_S);
- scaled_dot_product_attention (causal, head dim 128) forward + backward by sequence length, counted as
  FlashAttention-2's benchmark counts it (cost/kernels.FLASH2_FWD_BWD).
Only measurements; the fit lives apart so the raw file can be re-fitted and cited (docs/cost-model.md).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def time_ms(fn, repeats: int = 10, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def gemms(dtype=torch.bfloat16) -> list:
    rows = []
    shapes = []
    for m in (512, 2048, 8192):
        for n in (1024, 4096, 12288):
            for k in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
                shapes.append((m, n, k))
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        t = time_ms(lambda: torch.mm(a, b), repeats=7)
        rows.append({"m": m, "n": n, "k": k, **t, "tflops": 2 * m * n * k / (t["median_ms"] * 1e-3) / 1e12})
    return rows


def elementwise(numel: int = 1 << 28, dtype=torch.bfloat16) -> list:
    x = torch.randn(numel, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    h = 4096
    x2 = x.view(-1, h)
    w = torch.ones(h, device="cuda", dtype=dtype)
    size = x.element_size()
    cases = {
        # name: (callable, bytes moved: reads + writes)
        "copy": (lambda: y.copy_(x), 2 * numel * size),
        "add": (lambda: torch.add(x, x, out=y), 3 * numel * size),
        "gelu": (lambda: F.gelu(x), 2 * numel * size),
        "layer_norm": (lambda: F.layer_norm(x2, (h,), w, None), 2 * numel * size),
        "rms_norm": (lambda: F.rms_norm(x2, (h,), w), 2 * numel * size),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        t = time_ms(fn)
        rows.append({"kernel": name, "numel": numel, "bytes": nbytes, **t,
                     "bytes_per_s": nbytes / (t["median_ms"] * 1e-3)})
    return rows


def launch(count: int = 2000) -> dict:
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(count):
            x.add_(1)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / count)
    return {"per_kernel_s_median": statistics.median(samples), "samples": samples, "count": count}


def attention(tokens: int = 16384, heads: int = 16, head_dim: int = 128) -> list:
    rows = []
    for seq in (512, 1024, 2048, 4096, 8192, 16384):
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            out = fwd()
            out.backward(grad)

        tf = time_ms(fwd)
        tfb = time_ms(fwd_bwd)
        flops_fwd = 4 * batch * heads * seq * seq * head_dim / 2     # causal, as FlashAttention-2 counts
        rows.append({"seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim, "fwd": tf, "fwd_bwd": tfb,
                     "fwd_tflops": flops_fwd / (tf["median_ms"] * 1e-3) / 1e12,
                     "fwd_bwd_tflops": 3.5 * flops_fwd / (tfb["median_ms"] * 1e-3) / 1e12})
    return rows


def blocks() -> list:
    """Whole transformer blocks (Hugging Face Llama and GPT-2 layers, bf16, SDPA): what the cost model's
    per-block sum of GEMMs, attention and elementwise work predicts, measured as one piece."""
    from transformers import GPT2Config, LlamaConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    rows = []
    for hidden, heads, inter, seq, batch in ((2048, 16, 5632, 2048, 4), (4096, 32, 11008, 4096, 1),
                                            (4096, 32, 14336, 8192, 1), (8192, 64, 28672, 4096, 1)):
        cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                          intermediate_size=inter, max_position_embeddings=seq, attn_implementation="sdpa")
        layer = LlamaDecoderLayer(cfg, 0).cuda().to(torch.bfloat16)
        rotary = LlamaRotaryEmbedding(cfg).cuda()
        x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(seq, device="cuda").unsqueeze(0)
        emb = rotary(x, pos)

        def fwd():
            out = layer(x, position_embeddings=emb, position_ids=pos, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out

        def fwd_bwd():
            fwd().sum().backward()

        rows.append({"family": "llama", "hidden": hidden, "heads": heads, "intermediate": inter, "seq": seq,
                     "batch": batch, "fwd": time_ms(fwd, repeats=5), "fwd_bwd": time_ms(fwd_bwd, repeats=5)})
        del layer, x
    for hidden, heads, seq, batch in ((768, 12, 1024, 8), (1600, 25, 1024, 8)):
        cfg = GPT2Config(n_embd=hidden, n_head=heads, n_positions=seq, attn_implementation="sdpa")
        layer = GPT2Block(cfg, layer_idx=0).cuda().to(torch.bfloat16)
        x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def fwd():
            out = layer(x)
            return out[0] if isinstance(out, tuple) else out

        def fwd_bwd():
            fwd().sum().backward()

        rows.append({"family": "gpt2", "hidden": hidden, "heads": heads, "intermediate": 4 * hidden, "seq": seq,
                     "batch": batch, "fwd": time_ms(fwd, repeats=5), "fwd_bwd": time_ms(fwd_bwd, repeats=5)})
    return rows


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device: nothing measured")
        return 0
    props = torch.cuda.get_device_properties(0)
    out = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "memory_bytes": props.total_memory, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    for name, fn in (("launch", launch), ("elementwise", elementwise), ("attention", attention), ("gemm", gemms),
                     ("blocks", blocks)):
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:   # one failing group must not lose the others' figures
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if len(argv) > 1:   # after every group: a run cut short keeps what it measured
            with open(argv[1], "w") as f:
                json.dump(out, f, indent=1)
    if len(argv) == 1:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
