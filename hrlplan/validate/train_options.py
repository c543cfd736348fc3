"""The training options a device must support -- train.compile, train.float8, train.context_parallel --
as pure refusals (one line naming the key, or None), so the launcher says them before any worker
starts (host.py) and the engines again on the device they really got (runtime/torch_engine.py);
and the settings context parallelism does not run beside (context_parallel_combination_refusal)."""
from __future__ import annotations

import shutil
from typing import Any, Mapping, Optional, Tuple

COMPILE_KEY = "train.compile"
FLOAT8_KEY = "train.float8"
CP_KEY = "train.context_parallel"
FLOAT8_MIN_CAPABILITY = (8, 9)
# where torch runs context-parallel (ring) attention; CPU tests that stand in for the ring add "cpu"
CONTEXT_PARALLEL_DEVICES = ("cuda",)


def compile_refusal(device_type: str, which=shutil.which, has_triton: Optional[bool] = None) -> Optional[str]:
    """Why train.compile=true cannot run here, or None. CPU: inductor builds C++ kernels, so it
    needs a C++ compiler; CUDA: it builds Triton kernels."""
    if device_type != "cuda":
        if not any(which(c) for c in ("g++", "c++", "clang++")):
            return (f"{COMPILE_KEY}=true needs a C++ compiler on a CPU host (torch.compile's inductor builds C++ "
                    f"kernels) and none of g++, c++, clang++ is on PATH: install one (apt-get install g++) or set "
                    f"{COMPILE_KEY}=false")
        return None
    if has_triton is None:
        import importlib.util
        has_triton = importlib.util.find_spec("triton") is not None
    if not has_triton:
        return (f"{COMPILE_KEY}=true on CUDA needs Triton (torch.compile's inductor builds Triton kernels), which "
                f"is not installed: pip install triton, or set {COMPILE_KEY}=false")
    return None


def float8_supported(device_type: str, capability: Optional[Tuple[int, int]] = None) -> bool:
    """fp8 matmuls (torch._scaled_mm) run on CUDA devices of compute capability >= 8.9 only."""
    return device_type == "cuda" and capability is not None and tuple(capability) >= FLOAT8_MIN_CAPABILITY


def float8_refusal(device_type: str, capability: Optional[Tuple[int, int]] = None, name: str = "") -> Optional[str]:
    """One line saying why train.float8=true cannot run on this device, or None."""
    if float8_supported(device_type, capability):
        return None
    if device_type != "cuda":
        where = "a CPU run"
    else:
        shown = ".".join(map(str, capability)) if capability else "unknown"
        where = f"{name or 'this GPU'} (compute capability {shown})"
    need = ".".join(map(str, FLOAT8_MIN_CAPABILITY))
    return (f"{FLOAT8_KEY}=true needs a GPU with fp8 tensor cores (compute capability >= {need}: Ada, Hopper, "
            f"Blackwell) and this is {where}: set {FLOAT8_KEY}=false")


def context_parallel_runs_on(device_type: str) -> bool:
    """Whether torch's context-parallel (ring) attention runs on this device type: SDPA's CUDA
    kernels (flash, efficient, cuDNN) have its sharding rules; its CPU kernel has none in torch 2.13."""
    return device_type in CONTEXT_PARALLEL_DEVICES


def context_parallel_refusal(cp: int, device_type: str, num_stages: int = 1) -> Optional[str]:
    """One line saying why cp > 1 cannot run on this device type, or None (cp == 1 always runs)."""
    if cp <= 1 or context_parallel_runs_on(device_type):
        return None
    return (f"{CP_KEY}={cp}: cp > 1 needs CUDA: torch's context-parallel attention runs only SDPA's CUDA "
            f"kernels (flash, efficient, cuDNN), not its CPU kernel; set {CP_KEY}=1 on CPU")


def context_parallel_length_refusal(cp: int, seq_len: int) -> Optional[str]:
    """One line when a sequence does not cut into torch's 2*cp load-balanced chunks, or None."""
    if cp < 1 or seq_len % (2 * cp):
        return (f"{CP_KEY}={cp} shards a sequence into 2*cp={2 * cp} load-balanced chunks: data.seq_len "
                f"({seq_len}) must be a multiple of {2 * cp}")
    return None


def context_parallel_combination_refusal(cp: int, compile: bool = False) -> Optional[str]:
    """One line naming a train setting that does not run with cp > 1, or None. torch.compile would
    trace the ring's patched SDPA, which is not tested here: refused rather than trusted. (Packed
    documents: data/packing_options.py; heterogeneous plans: plan/checks.py.)"""
    if cp > 1 and compile:
        return (f"{COMPILE_KEY}=true with context parallelism ({CP_KEY}={cp}) is not supported: compiled blocks "
                f"would trace torch's ring attention; set {COMPILE_KEY}=false or plan with cp: 1")
    return None


def train_options_refusal(train: Mapping[str, Any], device_type: str, capability: Optional[Tuple[int, int]] = None,
                          device_name: str = "", num_stages: int = 1) -> Optional[Tuple[str, str]]:
    """(key, one line) of the first refusal among the train section's compile, float8 and
    context_parallel (on this device, then beside compile), or None."""
    cp = int(train.get("context_parallel") or 1)
    checks = (("compile", lambda: compile_refusal(device_type)),
              ("float8", lambda: float8_refusal(device_type, capability, device_name)),
              ("context_parallel", lambda: context_parallel_refusal(cp, device_type, num_stages)),
              ("context_parallel", lambda: context_parallel_combination_refusal(cp, bool(train.get("compile")))))
    for key, refusal in checks:
        why = train.get(key) and refusal()
        if why:
            return f"train.{key}", why
    return None
