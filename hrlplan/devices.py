"""Which device a worker trains on, and what that device can do on paper.

One helper chooses the device for every caller (trainer, probe, calibration, CLI, HRM). The
environments users meet under SLURM and torchrun differ in what a task sees:

- all of the node's GPUs visible to every task (torchrun, `srun --gpus-per-node=4` without
  binding): `LOCAL_RANK` is the CUDA ordinal;
- one GPU per task (`--gpus-per-task=1`, `--gpu-bind=single:1`, cgroup-constrained gres):
  `CUDA_VISIBLE_DEVICES=<id>` and `device_count()==1` while `LOCAL_RANK` is 0..3, so the ordinal
  is 0 on every task (LOCAL_RANK as the ordinal dies with "invalid device ordinal");
- k GPUs per task: each task owns its own k, so `LOCAL_RANK % k` stays inside the task's set.

The physical id (the `CUDA_VISIBLE_DEVICES` entry of the chosen ordinal, or the ordinal when that
variable is unset) is what `plan.yaml`'s `meta.launch.per_node_visible_devices` holds; two ranks of
one node on one physical id is refused by `check_unique_devices` (NCCL would fail on it much later).

The peak table holds datasheet dense (no sparsity) matmul FLOP/s per device and dtype: MFU is a
fraction of it, and the cost model prices each plan at the peak of the dtype it really runs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from hrlplan.config import TrainConfig, section
from hrlplan.errors import UserError

SETTINGS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    physical_id: Optional[str] = None   # the CUDA_VISIBLE_DEVICES entry (None on CPU)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def visible_devices(env: Mapping[str, str]) -> Optional[List[str]]:
    """CUDA_VISIBLE_DEVICES as a list of ids (indices, GPU-/MIG- UUIDs); None when unset."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [x.strip() for x in raw.split(",") if x.strip()]


def local_rank_of(env: Mapping[str, str]) -> int:
    """torchrun's LOCAL_RANK, else SLURM's SLURM_LOCALID (a plain `srun` task), else 0."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(key)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise UserError(f"{key}={value!r} is not an integer") from None
    return 0


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(setting: str, env: Optional[Mapping[str, str]] = None,
                  cuda_count: Optional[int] = None) -> DeviceChoice:
    """The device this worker trains on (pure: sets nothing; `activate` makes it current).

    setting is train.device (auto | cpu | cuda); env defaults to os.environ and cuda_count to
    torch.cuda.device_count() (0 without CUDA), both injectable so the logic is tested on CPU.
    """
    setting = str(setting).lower()
    if setting not in SETTINGS:
        raise UserError(f"train.device={setting!r}: use one of {', '.join(SETTINGS)}")
    env = os.environ if env is None else env
    count = _cuda_count() if cuda_count is None else int(cuda_count)
    if setting == "cpu" or (setting == "auto" and count == 0):
        return DeviceChoice(torch.device("cpu"), None)
    if count == 0:
        raise UserError("train.device=cuda but no CUDA device is visible to this process "
                        f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}); "
                        "ask SLURM for GPUs (--gpus-per-node) or use train.device=auto or cpu")
    local = local_rank_of(env)
    # fewer visible GPUs than LOCAL_RANK: the task owns its own GPUs (per-task binding)
    ordinal = local if local < count else local % count
    visible = visible_devices(env)
    if visible is not None and len(visible) >= count:
        physical = visible[ordinal]
    else:
        physical = str(ordinal)
    return DeviceChoice(torch.device("cuda", ordinal), physical)


def activate(choice: DeviceChoice) -> DeviceChoice:
    """Make the chosen GPU current (before init_process_group: NCCL binds to the current device)."""
    if choice.is_cuda:
        torch.cuda.set_device(choice.device)
    return choice


def use_device(setting: str) -> DeviceChoice:
    """choose_device from this process's environment, made current."""
    return activate(choose_device(setting))


def check_unique_devices(records: Sequence[Mapping[str, Any]]) -> None:
    """Refuse two ranks of one host on one physical GPU. records: {rank, hostname, physical_id}
    per rank (all_gather_object of each rank's choice); CPU ranks (physical_id None) share freely."""
    seen: Dict[Tuple[str, str], int] = {}
    for r in records:
        if r.get("physical_id") is None:
            continue
        key = (str(r["hostname"]), str(r["physical_id"]))
        if key in seen:
            raise UserError(f"ranks {seen[key]} and {r['rank']} both chose GPU {key[1]} on {key[0]}: more tasks "
                            "than GPUs on the node; start one task per GPU (--ntasks-per-node = GPUs per node)")
        seen[key] = int(r["rank"])


# ---------------------------------------------------------------- datasheet peaks
T = 1e12
# dense tensor-core FLOP/s by dtype key: bf16, fp16, tf32 (fp32 matmuls with TF32 on), fp32 (TF32 off),
# fp8 (e4m3/e5m2 matmuls with fp32 accumulation, torch._scaled_mm's: train.float8). None or absent:
# the device has no such path (V100 has no bf16 or TF32; only Ada, Hopper and newer have fp8).
# fp8 figures are the datasheets' sparse ones halved: H100 SXM / H200 / H800 3958 TF, H100 NVL / H200 NVL
# 3341 TF, H100 PCIe 3026 TF (NVIDIA H100 and H200 datasheets); L40S 1466 TF, L4 485 TF (their datasheets);
# RTX 4090 660.6 TF with FP32 accumulate (NVIDIA Ada Lovelace architecture whitepaper, appendix table);
# H20 296 TF dense (its spec sheet as reported).
_H100_SXM = {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T, "fp8": 1978.9 * T}
_H100_NVL = {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60.0 * T, "fp8": 1670.5 * T}
_A100 = {"bf16": 312.0 * T, "fp16": 312.0 * T, "tf32": 156.0 * T, "fp32": 19.5 * T}
# (name, tokens every one of which the device name must hold, peaks); first match wins, so the
# more specific entry comes first. Tokens are the upper-cased name split on space, '-', '_', '/'.
PEAKS: List[Tuple[str, Tuple[str, ...], Dict[str, Optional[float]]]] = [
    ("H200 NVL", ("H200", "NVL"), _H100_NVL),
    ("H200", ("H200",), _H100_SXM),
    ("GH200", ("GH200",), _H100_SXM),
    ("H100 NVL", ("H100", "NVL"), _H100_NVL),
    ("H100 PCIe", ("H100", "PCIE"), {"bf16": 756.0 * T, "fp16": 756.0 * T, "tf32": 378.0 * T, "fp32": 51.2 * T,
                                   "fp8": 1513.0 * T}),
    ("H100 SXM", ("H100",), _H100_SXM),
    # H800: the H100 SXM's compute with a narrower NVLink; H20: NVIDIA's spec sheet as reported (no
    # public datasheet page): 148 TF bf16, 74 TF TF32, 44 TF fp32 dense
    ("H800", ("H800",), _H100_SXM),
    ("H20", ("H20",), {"bf16": 148.0 * T, "fp16": 148.0 * T, "tf32": 74.0 * T, "fp32": 44.0 * T,
                        "fp8": 296.0 * T}),
    ("A100", ("A100",), _A100),
    ("A800", ("A800",), _A100),
    ("L40S", ("L40S",), {"bf16": 362.05 * T, "fp16": 362.05 * T, "tf32": 183.0 * T, "fp32": 91.6 * T,
                          "fp8": 733.0 * T}),
    ("L4", ("L4",), {"bf16": 121.0 * T, "fp16": 121.0 * T, "tf32": 60.0 * T, "fp32": 30.3 * T, "fp8": 242.5 * T}),
    # GeForce: fp32 accumulation at half the fp16-accumulate rate (Ada whitepaper: 165.2 TF bf16/fp16)
    ("RTX 4090", ("4090",), {"bf16": 165.2 * T, "fp16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T,
                             "fp8": 330.3 * T}),
    ("A10", ("A10",), {"bf16": 125.0 * T, "fp16": 125.0 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
    # Turing and Volta: no bf16, no TF32 (float32 matmuls run at the fp32 peak)
    ("T4", ("T4",), {"bf16": None, "fp16": 65.0 * T, "tf32": None, "fp32": 8.1 * T}),
    ("V100S", ("V100S",), {"bf16": None, "fp16": 130.0 * T, "tf32": None, "fp32": 16.4 * T}),
    ("V100 PCIe", ("V100", "PCIE"), {"bf16": None, "fp16": 112.0 * T, "tf32": None, "fp32": 14.0 * T}),
    ("V100 SXM2", ("V100",), {"bf16": None, "fp16": 125.0 * T, "tf32": None, "fp32": 15.7 * T}),
    ("MI300X", ("MI300X",), {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T, "fp32": 163.4 * T}),
    # an MI250(X) is two GCDs, and torch sees each GCD as one device: half the package's figure
    ("MI250X GCD", ("MI250X",), {"bf16": 191.5 * T, "fp16": 191.5 * T, "tf32": None, "fp32": 47.9 * T}),
    ("MI250 GCD", ("MI250",), {"bf16": 181.0 * T, "fp16": 181.0 * T, "tf32": None, "fp32": 45.3 * T}),
]
_DTYPE_KEYS = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
               "tf32": "tf32", "float32": "fp32", "fp32": "fp32", "float": "fp32",
               "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def dtype_key(dtype: Any) -> str:
    """bf16 | fp16 | tf32 | fp32 | fp8 from a torch dtype or its name ('tf32': fp32 matmuls on TF32)."""
    name = str(dtype).replace("torch.", "").lower()
    if name not in _DTYPE_KEYS:
        raise UserError(f"dtype {dtype!r} has no datasheet peak; use bfloat16, float16 or float32")
    return _DTYPE_KEYS[name]


def _tokens(device_name: str) -> set:
    return set(t for t in re.split(r"[\s\-_/]+", device_name.upper()) if t)


def match_device(device_name: str) -> Optional[str]:
    """The table's name for a device name (e.g. 'NVIDIA H100 80GB HBM3' -> 'H100 SXM'); None if absent."""
    tokens = _tokens(device_name)
    for name, need, _ in PEAKS:
        if all(t in tokens for t in need):
            return name
    return None


def peak_flops(device_name: str, dtype: Any) -> Optional[float]:
    """Datasheet dense peak FLOP/s of a device (matched on its name) in a dtype; None when the
    device is not in the table or has no such path (V100 bf16). dtype: torch dtype, its name, or
    'tf32' for fp32 matmuls on TF32 (see `matmul_dtype`)."""
    key = dtype_key(dtype)
    tokens = _tokens(device_name)
    for _, need, peaks in PEAKS:
        if all(t in tokens for t in need):
            return peaks.get(key)
    return None


def matmul_dtype(train_dtype: Any, tf32: bool = True) -> str:
    """The dtype key whose peak a run in train.dtype reaches: float32 runs on TF32 when it is on."""
    key = dtype_key(train_dtype)
    return "tf32" if key == "fp32" and tf32 else key


def set_tf32(enabled: bool) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer; ~8x the fp32 peak,
    10 mantissa bits) or in full fp32. Process-wide; a no-op on CPU."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = bool(enabled)


def tf32_setting(train: TrainConfig) -> bool:
    """train.tf32 (default on); HRLPLAN_TF32=0 turns it off without touching the config."""
    env = os.environ.get("HRLPLAN_TF32")
    if env is not None:
        return env.strip().lower() not in ("0", "false", "no", "off")
    return bool(section(TrainConfig, train).tf32)


def optimizer_impl(device: torch.device, dtensor: bool = False) -> Dict[str, bool]:
    """AdamW's implementation flags: fused kernels on CUDA (foreach, the multi-tensor path, for
    DTensor parameters of FSDP2/tp), the per-parameter loop on CPU (where foreach buys nothing and
    costs an extra copy of the states; CPU runs keep their numerics)."""
    if device.type == "cuda":
        return {"foreach": True} if dtensor else {"fused": True}
    return {"foreach": False}


def compile_disabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """DISABLE_COMPILE=1 (any value but 0/false/empty) turns torch.compile off."""
    env = os.environ if env is None else env
    return env.get("DISABLE_COMPILE", "").strip().lower() not in ("", "0", "false", "no")


def device_names(records: Iterable[Mapping[str, Any]]) -> List[str]:
    return sorted({str(r.get("name")) for r in records})
