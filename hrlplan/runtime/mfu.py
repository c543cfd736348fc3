"""Model FLOPs utilization (PaLM's definition): the model's training FLOPs per token (model_meta:
6N + 12*n_layer*seq_len*d_model for a GPT) times the tokens trained per second, over the summed
peak FLOP/s of the devices that train. With a true peak it can never pass 1.

The peak is the hardware's, never a measurement of it:
- a GPU: its datasheet dense peak in the dtype the matmuls run in (hrlplan.devices.peak_flops; TF32
  for float32 when on); the probed matmul figure only for a GPU the table does not know;
- a CPU: cores x clock x FLOPs per cycle of its widest vector/matrix unit in that dtype (flags in
  /proc/cpuinfo; two FMA pipes assumed, an upper bound). The probe's 512x512 matmul is no peak:
  taken while the node was busy, or in float32 for a bfloat16 run, it read low and train/mfu went
  past 1 (1.50 seen). A node's ranks share its cores: their threads count up to its core count.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from hrlplan.devices import dtype_key, matmul_dtype, peak_flops, tf32_setting

CPUINFO = Path("/proc/cpuinfo")
CPUFREQ = Path("/sys/devices/system/cpu")


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_total: float) -> Optional[float]:
    """train/mfu: achieved model FLOP/s over the trainers' summed peak; None without a peak."""
    if not flops_per_token or not peak_flops_total or peak_flops_total <= 0:
        return None
    return float(flops_per_token) * float(tokens_per_s) / float(peak_flops_total)


def cpu_flops_per_cycle(flags: Iterable[str], dtype: str) -> int:
    """Peak FLOPs per cycle of one core in `dtype` (bf16 | fp16 | fp32 | tf32) from its cpuinfo flags:
    two FMA pipes of the widest vector unit (x2 for multiply-add), or AMX tiles; a dtype the CPU has
    no unit for runs at the float32 rate (converted)."""
    flags = set(flags)
    key = dtype_key(dtype)
    if key == "bf16" and "amx_bf16" in flags or key == "fp16" and "amx_fp16" in flags:
        return 1024                       # AMX TMUL: 16x16x32 multiply-adds per 16 cycles
    if key == "bf16" and "avx512_bf16" in flags or key == "fp16" and "avx512_fp16" in flags:
        return 128                        # 32 16-bit pairs into 16 fp32 lanes, 2 pipes
    if "avx512f" in flags:
        return 64                         # 16 fp32 lanes x FMA (2) x 2 pipes
    if "avx2" in flags and "fma" in flags:
        return 32
    if "avx" in flags:
        return 16
    return 8


def cpu_clock_hz(cpuinfo: Optional[str] = None, cpufreq_root: Optional[Path] = None) -> Optional[float]:
    """The highest clock this machine reports: cpufreq's cpuinfo_max_freq, the `cpu MHz` lines, the
    model name's `@ 2.50GHz`; None when none is readable."""
    clocks: List[float] = []
    for path in (cpufreq_root or CPUFREQ).glob("cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            clocks.append(float(path.read_text().strip()) * 1e3)   # kHz
        except (OSError, ValueError):
            pass
    text = cpuinfo if cpuinfo is not None else _read(CPUINFO)
    clocks += [float(m) * 1e6 for m in re.findall(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.M)]
    clocks += [float(m) * 1e9 for m in re.findall(r"@\s*([0-9.]+)\s*GHz", text)]
    return max(clocks) if clocks else None


def cpu_peak_flops(dtype: str, threads: int, cpuinfo: Optional[str] = None) -> Optional[float]:
    """Peak FLOP/s of `threads` cores of this machine in `dtype`; None when its clock is unknown."""
    text = cpuinfo if cpuinfo is not None else _read(CPUINFO)
    clock = cpu_clock_hz(text, cpufreq_root=None if cpuinfo is None else Path("/nonexistent"))
    if clock is None:
        return None
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = match.group(1).split() if match else []
    return max(1, int(threads)) * clock * cpu_flops_per_cycle(flags, dtype)


def job_peak_flops(spec, ranks: List[int], train, cores_per_node: Optional[int] = None) -> float:
    """MFU's denominator: the summed peak of the ranks that train. GPUs: the datasheet figure in the
    matmul dtype, else the probed one. CPUs: cpu_peak_flops over the ranks' threads, at most the
    node's cores (ranks of one node share them; cores_per_node: this machine's, assumed alike on
    every node), never below the probed figures."""
    dtype = matmul_dtype(str(getattr(train.dtype, "value", train.dtype)), tf32_setting(train))
    cores = cores_per_node or len(os.sched_getaffinity(0))
    total = 0.0
    cpu_threads: Dict[int, int] = defaultdict(int)
    cpu_probed: Dict[int, float] = defaultdict(float)
    for r in ranks:
        device = spec.devices[r]
        if device.kind == "cuda":
            total += peak_flops(device.name, dtype) or device.peak_flops
        else:
            cpu_threads[device.node] += max(1, int(getattr(device, "threads", 1) or 1))
            cpu_probed[device.node] += float(device.peak_flops)
    for node, threads in cpu_threads.items():
        peak = cpu_peak_flops(dtype, min(threads, cores))
        total += max(peak or 0.0, cpu_probed[node])
    return total


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
