"""Two measurements the H100 table's open ranking needs (issue 33), on one CUDA GPU, no cluster:

    python bench/h100_te_chunks_measure.py [--out FILE] [--sustain-s 120]

1. The sustained bf16 GEMM rate: one block-sized GEMM (4096 x 28672 x 7168, 32B's MLP-up at tp 1)
   back to back for --sustain-s seconds, its TFLOP/s per second of wall time with the SM clock and
   power nvidia-smi reports beside it: the first seconds against the last (the cost model's
   GEMM_PEAK_FRACTION was checked on a short H200 run only).
2. Transformer Engine's split GEMMs (bench/published_whatif.py `te_streams`): the ring-exchange GEMMs
   of a tp 8 block (QKV and MLP-up forward of the README table's 32B and 70B rows: 8 chunks of 512 rows)
   whole, as 8 chunks on one stream, and as 8 chunks round-robin on 3 streams (TE's
   _NUM_MAX_UB_STREAMS), median of --repeats; with the cost model's price of each beside it.

Times kernels: run it alone on the GPU (house rule: under `flock /tmp/hrlplan-measure.lock` where
benches share a machine). Writes a JSON record (--out) for a later fit-free comparison.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hrlplan.cost import kernels  # noqa: E402

STREAMS = 3
# (label, rows of a chunk, n, k): tp 8 ring-exchange GEMMs of the README table's 32B (h 7168) and 70B (h 8192)
SPLIT_SHAPES = (("32B qkv", 512, 3 * 7168 // 8, 7168), ("32B mlp-up", 512, 4 * 7168 // 8, 7168),
                ("70B qkv", 512, 3 * 8192 // 8, 8192), ("70B mlp-up", 512, 4 * 8192 // 8, 8192))
CHUNKS = 8


def smi() -> dict:
    """SM clock (MHz) and power (W) of GPU 0 as nvidia-smi reports them; {} without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=10).stdout.strip().split(",")
        return {"sm_clock_mhz": float(out[0]), "power_w": float(out[1])}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {}


def sustained(seconds: float) -> list:
    m, n, k = 4096, 28672, 7168
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0, count = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            torch.matmul(a, b)
            count += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out.append(dict(t_s=round(time.perf_counter() - start, 1), tflops=2 * m * n * k * count / wall / 1e12, **smi()))
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def split_gemms(repeats: int) -> list:
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(STREAMS)]
    props = torch.cuda.get_device_properties(0)
    model = kernels.kernels_for(type("D", (), {"kind": "cuda", "name": props.name})(),
                                989e12, measured=False)
    out = []
    for label, rows, n, k in SPLIT_SHAPES:
        a = torch.randn(rows * CHUNKS, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        chunks = a.split(rows)

        def whole():
            torch.matmul(a, w)

        def one_stream():
            for c in chunks:
                torch.matmul(c, w)

        def three_streams():
            ready = torch.cuda.Event()
            ready.record(main)
            for i, c in enumerate(chunks):
                s = streams[i % STREAMS]
                s.wait_event(ready)
                with torch.cuda.stream(s):
                    torch.matmul(c, w)
            for s in streams:
                main.wait_stream(s)

        for fn in (whole, one_stream, three_streams):   # warm-up
            fn()
        row = {"gemm": label, "m": rows * CHUNKS, "n": n, "k": k, "chunks": CHUNKS,
               "whole_s": timed(whole, repeats), "one_stream_s": timed(one_stream, repeats),
               "three_streams_s": timed(three_streams, repeats)}
        if model is not None:
            rate = model.peak * model.gemm_fraction
            row["model_whole_s"] = model.gemm(rows * CHUNKS, n, k, 2)
            row["model_chunks_s"] = CHUNKS * kernels.gemm_seconds(rows, n, k, 2, rate, model.hbm, model.sms)
            row["model_three_streams_s"] = (CHUNKS // STREAMS * kernels.gemm_seconds(STREAMS * rows, n, k, 2, rate,
                                                                                 model.hbm, model.sms)
                                            + kernels.gemm_seconds(CHUNKS % STREAMS * rows, n, k, 2, rate, model.hbm,
                                                                   model.sms)
                                            + (CHUNKS - CHUNKS // STREAMS - 1) * kernels.KERNEL_LAUNCH_S)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the record here (JSON)")
    ap.add_argument("--sustain-s", type=float, default=120.0)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("h100_te_chunks_measure: error: needs a CUDA GPU (run it on the device machine)", file=sys.stderr)
        return 2
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "split_gemms": split_gemms(args.repeats)}
    record["sustained_gemm"] = sustained(args.sustain_s)
    first, last = record["sustained_gemm"][:5], record["sustained_gemm"][-30:]
    print(f"sustained bf16 GEMM: first 5 s {statistics.median(r['tflops'] for r in first):.0f} TF/s, last 30 s "
          f"{statistics.median(r['tflops'] for r in last):.0f} TF/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
