"""Per-process host settings every worker applies at start: its CPU thread count and how glibc's
allocator keeps freed memory.

Why the allocator: glibc returns a freed heap top above M_TRIM_THRESHOLD (and every chunk above
M_MMAP_THRESHOLD, which it raises only as such chunks are freed) to the kernel, so the next step
page-faults the same memory back in. A pipeline schedule that keeps several micro-batches'
activations alive (GPipe: all of them) grows and shrinks the heap every step: measured on
gpt2-tiny (3-block stage, 4 micro-batches, one process) its later forwards ran 1.3-1.85x the time
of a forward whose memory was reused, against 1.13-1.18x with the settings below -- and the
calibration's micro-benchmarks, which reuse their memory, could not see that cost. Keeping freed
memory in the heap is what tcmalloc/jemalloc (Intel's recommended CPU setup) do too; the peak
resident memory is unchanged. Whole runs, kept vs glibc's default in alternating pairs: a 1-stage
gpt2-tiny run 0.917x and 0.932x the step time; 2-stage GPipe 1.01x and 0.96x (noise), whose
remaining in-pipeline cost is elsewhere (see the calibration's hop figures)."""
from __future__ import annotations

import ctypes
import os

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20    # glibc's ceiling for it on 64-bit systems
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """mallopt on glibc; False (and nothing changed) where the C library has no mallopt, the user
    set MALLOC_TRIM_THRESHOLD_/MALLOC_MMAP_THRESHOLD_ themselves, or HRLPLAN_KEEP_FREED_MEMORY=0."""
    if (os.environ.get("MALLOC_TRIM_THRESHOLD_") or os.environ.get("MALLOC_MMAP_THRESHOLD_")
            or os.environ.get("HRLPLAN_KEEP_FREED_MEMORY") == "0"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):   # TypeError: no CDLL(None) on Windows
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def prepare_worker() -> None:
    """Threads from OMP_NUM_THREADS (the launcher sets it: cores / workers), freed memory kept."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    keep_freed_memory()
