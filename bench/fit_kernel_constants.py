"""The GPU constants of hrlplan/cost/kernels.py derived from a measurement of the runtime on a GPU.

    python bench/fit_kernel_constants.py [docs/measurements/h200_kernels.json] [--json OUT]

Reads the raw file bench/gpu_kernels.py wrote (CUDA-event medians on one GPU, torch's own kernels)
and prints each constant with the figures it comes from. Nothing here reads a published training
table (bench/published_sources.py): the constants are what the GPU did on single kernels.

- MEMORY_FRACTION: the median over the elementwise kernels (copy, add, GELU, LayerNorm, RMSNorm on
  2^28 bf16 values) of the bandwidth each reached over the part's datasheet HBM bandwidth. `add`
  computes x + x: one tensor read and one written, two passes (the raw file counts three).
- KERNEL_LAUNCH_S: the median interval between tiny kernels issued back to back from eager torch (the
  rate the host feeds the GPU; a GEMM shorter than that cannot run faster in a step).
- GEMM_PEAK_FRACTION is cited (S. Bekman's matmul table, docs/cost-model.md); the largest measured GEMM
  is printed beside it as a check, not used.
- GEMM_MEMORY_FRACTION: the bandwidth memory-bound GEMMs reach (below the ridge; small K writes its
  output at well under the elementwise rate), the median of those measured.
- GEMM_K_HALF: with the three above and GEMM_PEAK_FRACTION fixed, the value (a grid over 8..1024) that
  minimises the median |log(predicted / measured)| of cost.kernels.gemm_seconds over the measured
  GEMM shapes (M 512-8192, N 1024-12288, K 64-8192) that take at least LAUNCHES_TIMED launch
  intervals (below that one kernel's event timing measures the host's dispatch).
- The fused attention curve: SDPA (causal, head dim 128) forward + backward, in FlashAttention-2's own
  FLOP count (cost.kernels.FUSED_ATTENTION_FWD_BWD takes it as measured, per sequence length).
- ELEMENTWISE_H['torch']: the whole blocks (Hugging Face Llama and GPT-2 layers, SDPA, bf16, this
  package's runtime) took longer than their GEMMs and attention; that time as values per token at HBM
  speed (forward once, backward twice), beyond the activation's 2W/tp, in units of h: the median of the
  six. Then the cost model's block time against each measured block, as a check of the sum.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hrlplan.cost import kernels  # noqa: E402
from hrlplan.devices import peak_flops  # noqa: E402

DEFAULT = ROOT / "docs" / "measurements" / "h200_kernels.json"
# passes over the tensor the raw file's byte count assumed, and what the kernel moves
ELEMENTWISE_PASSES = {"add": (3, 2)}
LAUNCHES_TIMED = 5


def memory_fraction(raw: dict, hbm: float) -> dict:
    rows = {}
    for r in raw["elementwise"]:
        counted, moved = ELEMENTWISE_PASSES.get(r["kernel"], (1, 1))
        rows[r["kernel"]] = r["bytes_per_s"] * moved / counted / hbm
    return {"value": round(statistics.median(rows.values()), 2), "per_kernel": rows}


def gemm_memory_fraction(raw: dict, peak: float, hbm: float, launch: float) -> dict:
    """GEMM_MEMORY_FRACTION: over the measured GEMMs below the ridge (2mnk / bytes under the sustained
    peak over HBM bandwidth: memory-bound) that take at least LAUNCHES_TIMED launch intervals, the
    median of their operands' and output's bytes over (time - one launch), over HBM bandwidth."""
    ridge = peak * kernels.GEMM_PEAK_FRACTION / hbm
    rows = {}
    for g in raw["gemm"]:
        m, n, k, t = g["m"], g["n"], g["k"], g["median_ms"] * 1e-3
        nbytes = 2 * (m * k + k * n + m * n)
        if t >= LAUNCHES_TIMED * launch and 2 * m * n * k / nbytes < ridge:
            rows[f"{m}x{n}x{k}"] = nbytes / (t - launch) / hbm
    return {"value": round(statistics.median(rows.values()), 2), "per_gemm": rows, "ridge_flop_per_byte": ridge}


def fit_k_half(raw: dict, peak: float, hbm: float, sms: int, launch: float, mem_fraction: float) -> dict:
    # a CUDA-event pair around one kernel on an idle GPU also times the host's dispatch of it: the
    # smallest GEMMs all read 22-45 us whatever their FLOPs. Shapes under LAUNCHES_TIMED launch
    # intervals measure the host, not the tile efficiency, and are left out.
    floor = LAUNCHES_TIMED * launch
    shapes = [(g["m"], g["n"], g["k"], g["median_ms"] * 1e-3) for g in raw["gemm"] if g["median_ms"] * 1e-3 >= floor]

    def errors(k_half):
        return [abs(math.log(kernels.gemm_seconds(m, n, k, 2, peak * kernels.GEMM_PEAK_FRACTION, hbm, sms,
                                                  k_half, launch, mem_fraction) / t)) for m, n, k, t in shapes]

    grid = [8 * i for i in range(1, 129)]
    best = min(grid, key=lambda kh: statistics.median(errors(kh)))
    err = errors(best)
    return {"value": best, "median_abs_log_error": statistics.median(err), "max_abs_log_error": max(err),
            "gemms": len(shapes), "left_out_under_s": floor, "of": len(raw["gemm"])}


def attention_curve(raw: dict) -> list:
    return [(r["seq"], round(r["fwd_bwd_tflops"], 1)) for r in raw["attention"]]


def _blocks(raw: dict, k) -> list:
    """Per measured block: (label, tokens, h, W, measured s, the cost model's GEMMs + attention s,
    its elementwise s at one value per token)."""
    out = []
    for b in raw.get("blocks") or []:
        h, w, seq, batch = b["hidden"], b["intermediate"], b["seq"], b["batch"]
        meta = SimpleNamespace(hidden_size=h, num_heads=b["heads"], seq_len=seq)
        matmul = 4 * h * h + (3 if b["family"] == "llama" else 2) * h * w   # a gated MLP: three h x W
        width = kernels.block_widths(meta, matmul)[1]
        f, bw, _ = kernels.block_times(k, meta, matmul, batch * seq, 1, 2, 4.0 * seq * h, True, "torch")
        moved = k.elementwise(batch * seq * 2 * (kernels.ELEMENTWISE_H["torch"] * h + kernels.ELEMENTWISE_W * width))
        out.append((f"{b['family']} h{h} W{w} s{seq} b{batch}", batch * seq, h, width, b["fwd_bwd"]["median_ms"] * 1e-3,
                    f + bw - 3 * moved, k.elementwise(batch * seq * 2)))
    return out


def torch_elementwise(raw: dict, k) -> dict:
    """ELEMENTWISE_H['torch']: per Hugging Face block, the values per token (in h, beyond the 2W/tp the
    count gives the activation) that the time it took beyond its GEMMs and attention moves at HBM speed
    x MEMORY_FRACTION, forward once and backward twice; the median over the blocks."""
    per_block = {}
    for label, tokens, h, width, measured, pieces, one_value in _blocks(raw, k):
        values = (measured - pieces) / (3 * one_value)
        per_block[label] = (values - kernels.ELEMENTWISE_W * width) / h
    return {"value": round(statistics.median(per_block.values())), "per_block_h": per_block}


def block_check(raw: dict, k) -> list:
    """The cost model's block forward + backward (the module's constants) against each measured block."""
    out = []
    for label, tokens, h, width, measured, pieces, one_value in _blocks(raw, k):
        moved = one_value * (kernels.ELEMENTWISE_H["torch"] * h + kernels.ELEMENTWISE_W * width)
        predicted = pieces + 3 * moved
        out.append({"block": label, "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                    "ratio": predicted / measured})
    return out


def derive(raw: dict) -> dict:
    name = raw["device"]
    peak = peak_flops(name, "bf16")
    hbm, sms = kernels.gpu_facts(name, peak)
    mem = memory_fraction(raw, hbm)
    launch = raw["launch"]["per_kernel_s_median"]
    gemm_mem = gemm_memory_fraction(raw, peak, hbm, launch)
    k_half = fit_k_half(raw, peak, hbm, raw.get("sms", sms), launch, gemm_mem["value"])
    biggest = max(raw["gemm"], key=lambda g: g["m"] * g["n"] * g["k"])
    # the blocks are priced with the constants derived above, whatever the module holds
    names = ("MEMORY_FRACTION", "GEMM_MEMORY_FRACTION", "KERNEL_LAUNCH_S", "GEMM_K_HALF")
    held = {n: getattr(kernels, n) for n in names}
    for n, v in zip(names, (mem["value"], gemm_mem["value"], launch, k_half["value"])):
        setattr(kernels, n, v)
    try:
        k = kernels.GpuKernels(peak=peak, hbm=hbm, sms=raw.get("sms", sms), name=name)
        elementwise, blocks = torch_elementwise(raw, k), block_check(raw, k)
    finally:
        for n, v in held.items():
            setattr(kernels, n, v)
    return {"device": name, "datasheet_bf16_flops": peak, "datasheet_hbm_bytes_per_s": hbm,
            "MEMORY_FRACTION": mem, "GEMM_MEMORY_FRACTION": gemm_mem, "KERNEL_LAUNCH_S": launch, "GEMM_K_HALF": k_half,
            "GEMM_PEAK_FRACTION_check": {"largest_gemm": [biggest["m"], biggest["n"], biggest["k"]],
                                         "fraction_of_peak": biggest["tflops"] * 1e12 / peak,
                                         "cited_value": kernels.GEMM_PEAK_FRACTION},
            "fused_attention_fwd_bwd_tflops": attention_curve(raw),
            "ELEMENTWISE_H_torch": elementwise, "blocks_with_module_constants": blocks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="?", default=str(DEFAULT), help="bench/gpu_kernels.py's JSON")
    ap.add_argument("--json", help="write the derived constants here")
    args = ap.parse_args(argv)
    out = derive(json.loads(Path(args.raw).read_text()))
    mem, kh = out["MEMORY_FRACTION"], out["GEMM_K_HALF"]
    print(f"device {out['device']}: datasheet {out['datasheet_bf16_flops'] / 1e12:.0f} TF/s bf16, "
          f"{out['datasheet_hbm_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"MEMORY_FRACTION = {mem['value']:.2f}  (median of "
          + ", ".join(f"{k} {v:.3f}" for k, v in mem["per_kernel"].items()) + ")")
    print(f"KERNEL_LAUNCH_S = {out['KERNEL_LAUNCH_S'] * 1e6:.1f} us  (back-to-back tiny kernels, median)")
    gm = out["GEMM_MEMORY_FRACTION"]
    print(f"GEMM_MEMORY_FRACTION = {gm['value']:.2f}  (median of the GEMMs under {gm['ridge_flop_per_byte']:.0f} "
          "FLOP/byte: " + ", ".join(f"{k} {v:.2f}" for k, v in gm["per_gemm"].items()) + ")")
    print(f"GEMM_K_HALF = {kh['value']}  (median |log error| {kh['median_abs_log_error']:.3f}, max "
          f"{kh['max_abs_log_error']:.3f}, over the {kh['gemms']} of {kh['of']} GEMMs taking >= "
          f"{kh['left_out_under_s'] * 1e6:.0f} us)")
    chk = out["GEMM_PEAK_FRACTION_check"]
    print(f"GEMM_PEAK_FRACTION (cited {chk['cited_value']}): largest measured GEMM {chk['largest_gemm']} reaches "
          f"{chk['fraction_of_peak']:.3f} of the peak")
    print("fused attention fwd+bwd TF/s (FlashAttention-2's count): "
          + ", ".join(f"{s}: {t}" for s, t in out["fused_attention_fwd_bwd_tflops"]))
    ew = out["ELEMENTWISE_H_torch"]
    print(f"ELEMENTWISE_H['torch'] = {ew['value']}  (values per token / h beyond 2W/tp; per block: "
          + ", ".join(f"{k} {v:.0f}" for k, v in ew["per_block_h"].items()) + ")")
    print("whole blocks, cost model (runtime=torch, the module's constants) against measured:")
    for b in out["blocks_with_module_constants"]:
        print(f"  block {b['block']}: measured {b['measured_ms']:.2f} ms, cost model {b['predicted_ms']:.2f} ms "
              f"(x{b['ratio']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
