"""The training options a device must support -- train.compile, train.float8, train.context_parallel --
as pure refusals (one line naming the key, or None), so the launcher says them before any worker
starts (host.py) and the engines again on the device they really got (runtime/torch_engine.py)."""
from __future__ import annotations

import shutil
from typing import Any, Mapping, Optional, Tuple

COMPILE_KEY = "train.compile"
FLOAT8_KEY = "train.float8"
CP_KEY = "train.context_parallel"
FLOAT8_MIN_CAPABILITY = (8, 9)


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


def context_parallel_refusal(cp: int, device_type: str, num_stages: int = 1) -> Optional[str]:
    """One line saying why cp > 1 cannot run here, or None (cp == 1 always runs). torch 2.13 runs
    context-parallel attention only through SDPA's CUDA kernels: on CPU SDPA dispatches
    _scaled_dot_product_flash_attention_for_cpu, which has no sharding rule."""
    if cp <= 1:
        return None
    if device_type != "cuda":
        return (f"{CP_KEY}={cp}: cp > 1 needs CUDA: torch's context-parallel attention runs only SDPA's CUDA "
                f"kernels (flash, efficient, cuDNN), not its CPU kernel; set {CP_KEY}=1 on CPU")
    return (f"{CP_KEY}={cp} (plan.yaml's stages' cp): the engine does not enter torch's context_parallel yet, so "
            f"cp ranks would train unsharded sequences; plan with {CP_KEY}=1 (cp: 1 on every stage)")


def train_options_refusal(train: Mapping[str, Any], device_type: str, capability: Optional[Tuple[int, int]] = None,
                          device_name: str = "", num_stages: int = 1) -> Optional[Tuple[str, str]]:
    """(key, one line) of the first refusal among the train section's compile, float8 and
    context_parallel, or None."""
    checks = (("compile", lambda: compile_refusal(device_type)),
              ("float8", lambda: float8_refusal(device_type, capability, device_name)),
              ("context_parallel", lambda: context_parallel_refusal(int(train.get("context_parallel") or 1),
                                                                    device_type, num_stages)))
    for key, refusal in checks:
        why = train.get(key) and refusal()
        if why:
            return f"train.{key}", why
    return None
