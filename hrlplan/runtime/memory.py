"""Measured peak memory per rank, split as the cost model splits it.

CPU has no allocator statistics, so the peak is measured as the bytes of live tensor storages: a
TorchDispatchMode sees every storage an operator creates, a weak reference tells when it is freed,
and `UntypedStorage.resize_` (how FSDP2 allocates and frees its unsharded parameters) is followed
too. That is what torch.cuda.max_memory_allocated counts on a GPU, where the allocator's own
figure is the total and the tracker only splits it.

At the peak (a snapshot whenever the live bytes pass the last snapshot by SNAPSHOT_STEP; on CUDA
whenever max_memory_allocated does, so the split is the real peak's, whose bytes beyond the live
tensors -- kernels' workspaces, an optimizer's internal temporaries -- count as other), every
live storage is put in the first category that claims it:
  weights      parameters and buffers of the rank's stage modules, FSDP2's sharded and unsharded
               copies of them;
  gradients    their .grad and FSDP2's unsharded accumulated gradients;
  optimizer    the optimizers' state (AdamW's moments and step counts);
  activations  anything else created by a forward pass (grad enabled, outside backward) and still
               alive: what the schedule holds for its backward;
  other        the rest: backward's and the optimizer's temporaries, recomputation, messages.
The tracker runs for the first MEASURED_STEPS steps only (the ones step-time statistics skip):
shapes are fixed, so every later step repeats their peak.

Compiled blocks (train.compile): dynamo cannot run under a Python dispatch mode, and inductor's
kernels allocate their buffers without one, so a compiled run is measured from the allocator
instead (AllocatorPeak): on the CPU, torch.profiler's memory events -- every allocation and free the
CPU allocator makes, the compiled kernels' buffers included -- from the live tensor bytes at each
measured step's start; on CUDA, max_memory_allocated alone. The compiled code runs while measured
(runtime/compile.eager_while is asked only for the tracker). No split: the allocator does not say
what a buffer holds. Checked against the tracker on eager blocks (the same peak to the byte) and
against the prediction for compiled runs in tests/test_compile_memory.py.
"""
from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hrlplan.activations import saved_activation_bytes  # noqa: F401 -- re-exported (tests, HRM guide)
from hrlplan.activations import storages as _storages

GiB = 2 ** 30
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
MEASURED_STEPS = 2
SNAPSHOT_STEP = 0.005   # a new split when the live bytes grow by 0.5% over the last one


def _phase() -> str:
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward" if torch.is_grad_enabled() else "other"


class LiveStorageTracker(TorchDispatchMode):
    """Live tensor bytes on one device type, their peak and its split (see the module's doc).

    `owners()` returns (modules, optimizers) whose parameters, gradients and states name the
    categories; it is called at each snapshot, since FSDP2 swaps parameters as it unshards."""

    def __init__(self, device_type: str, owners: Callable[[], Tuple[Sequence[torch.nn.Module], Sequence]],
                 allocator_peak: Optional[Callable[[], int]] = None):
        super().__init__()
        self.device_type = device_type
        self.owners = owners
        self.live: Dict[int, List] = {}        # id(storage) -> [weakref, bytes, phase]
        self.current = 0
        self.peak = 0
        self.split: Dict[str, int] = {c: 0 for c in CATEGORIES}
        self._snapshot_at = 0
        self._orig_resize = None
        # CUDA: the allocator's own peak (max_memory_allocated) decides when to split, so the split is
        # taken where the real peak is (the allocator also counts what no operator returns: kernels'
        # workspaces, the optimizer's internal temporaries); the tracker's own peak does elsewhere
        self.allocator_peak = allocator_peak
        self._allocator_top = 0

    # ------------------------------------------------------------ bookkeeping
    def _track(self, st: torch.UntypedStorage, phase: str) -> None:
        key = id(st)
        if key in self.live or st.device.type != self.device_type:
            return
        size = st.nbytes()
        self.live[key] = [weakref.ref(st, self._make_free(key)), size, phase]
        self._grow(size)

    def _make_free(self, key: int):
        def free(_ref) -> None:
            entry = self.live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]
        return free

    def _grow(self, size: int) -> None:
        self.current += size
        if self.current > self.peak:
            self.peak = self.current
            if self.allocator_peak is None and self.current > self._snapshot_at * (1.0 + SNAPSHOT_STEP):
                self._snapshot()

    def _follow_allocator(self) -> None:
        top = self.allocator_peak()
        if top > self._allocator_top * (1.0 + SNAPSHOT_STEP):
            self._allocator_top = top
            self._snapshot()
        self._allocator_top = max(self._allocator_top, top)

    def track_tensors(self, tensors: Iterable[torch.Tensor], phase: str = "other") -> None:
        """Storages that exist before tracking starts (parameters, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._track(st, phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase = None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    if id(st) not in self.live:
                        phase = phase or _phase()
                        self._track(st, phase)
        if self.allocator_peak is not None:
            self._follow_allocator()
        return out

    def __enter__(self):
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            result = orig(st, size)
            entry = tracker.live.get(id(st))
            if entry is not None and entry[1] != st.nbytes():
                delta = st.nbytes() - entry[1]
                entry[1] = st.nbytes()
                if delta > 0:
                    tracker._grow(delta)
                else:
                    tracker.current += delta
            return result
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    # ------------------------------------------------------------ the split at the peak
    def _claimed(self) -> Dict[int, str]:
        claims: Dict[int, str] = {}

        def claim(tensors: Iterable, category: str) -> None:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    for st in _storages(t):
                        claims.setdefault(id(st), category)
        modules, optimizers = self.owners()
        params = [p for m in modules for p in m.parameters()]
        fsdp = [fp for m in modules for fp in _fsdp_params(m)]
        claim(params, "weights")
        claim((b for m in modules for b in m.buffers()), "weights")
        for fp in fsdp:
            claim([fp.sharded_param, getattr(fp, "_unsharded_param", None)]
                  + list(getattr(fp, "all_gather_outputs", None) or []), "weights")
        claim((p.grad for p in params), "gradients")
        for fp in fsdp:
            unsharded = getattr(fp, "_unsharded_param", None)
            claim([fp.sharded_param.grad, getattr(fp, "unsharded_accumulated_grad", None),
                   unsharded.grad if unsharded is not None else None], "gradients")
        for opt in optimizers:
            claim((v for state in opt.state.values() for v in state.values()), "optimizer")
        return claims

    def _snapshot(self) -> None:
        self._snapshot_at = self.current
        claims = self._claimed()
        split = {c: 0 for c in CATEGORIES}
        for key, (_, size, phase) in self.live.items():
            category = claims.get(key) or ("activations" if phase == "forward" else "other")
            split[category] += size
        self.split = split

    def result(self) -> Dict[str, int]:
        """{peak, weights, gradients, optimizer, activations, other} in bytes; the split is the
        snapshot nearest the peak, its shortfall (< SNAPSHOT_STEP; with the allocator's peak, what
        the allocator held beyond the live tensors) counted as other."""
        out = dict(self.split)
        peak = self._allocator_top if self.allocator_peak is not None else self.peak
        out["other"] += max(peak - sum(self.split.values()), 0)
        out["peak"] = peak
        return out


def _fsdp_params(module: torch.nn.Module) -> List:
    out = []
    for m in module.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def has_compiled_blocks(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether any submodule was compiled in place (runtime/compile.apply_compile: nn.Module.compile)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for part in modules for m in part.modules())


def live_tensor_bytes(device_type: str) -> int:
    """Bytes of the distinct storages of every tensor Python holds on this device type (a wrapper
    subclass by its inner storages): what is alive between steps, where no autograd graph is."""
    seen: Dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):   # type(): no __class__ lookup (dead proxies raise there)
            continue
        try:
            for st in _storages(obj):
                if st.device.type == device_type:
                    seen.setdefault(st.data_ptr() or id(st), st.nbytes())
        except (ReferenceError, RuntimeError, NotImplementedError):
            continue
    return sum(seen.values())


class AllocatorPeak:
    """The peak of a compiled run's measured steps on the CPU, from torch.profiler's memory events
    (see the module's doc): each step starts from the live tensor bytes, and the running sum of
    the allocator's allocations and frees during the step gives its peak."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.peak = 0
        self._profiler = None
        self.start_bytes = 0

    def __enter__(self):
        if torch._C._autograd._profiler_enabled():   # train.profile's own profiler: one at a time
            return self
        self.start_bytes = live_tensor_bytes(self.device_type)
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self._profiler is None:
            return False
        prof, self._profiler = self._profiler, None
        prof.__exit__(*exc)
        self.peak = max(self.peak, self.start_bytes + peak_of_memory_events(prof, self.device_type))
        return False

    def result(self) -> Dict[str, int]:
        return {"peak": self.peak} if self.peak else {}


def peak_of_memory_events(prof, device_type: str = "cpu") -> int:
    """The largest running sum of a finished profile's allocations (+) and frees (-) on the device."""
    kind = getattr(torch._C._autograd.DeviceType, device_type.upper())
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == kind), key=lambda e: e.start_ns())
    running = top = 0
    for e in events:
        running += e.nbytes()
        top = max(top, running)
    return top


class MemoryMeter:
    """A trainer's memory measurement: wrap each of the first MEASURED_STEPS steps in `step()`.

    On CUDA the peak is torch.cuda.max_memory_allocated (since the trainer's reset) and the
    tracker splits it; on CPU the tracker's peak is the figure. enabled=False: CUDA's figure only.
    Compiled blocks: AllocatorPeak on the CPU, CUDA's figure alone on CUDA (see the module's doc)."""

    def __init__(self, device: torch.device, owners, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        allocator = (lambda: torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        self.tracker = LiveStorageTracker(device.type, owners, allocator) if enabled else None
        self.allocator: Optional[AllocatorPeak] = None
        self.steps = 0
        self.start_bytesed = False

    def step(self):
        if not self.enabled or self.steps >= MEASURED_STEPS:
            return _Nothing()
        self.steps += 1
        if not self.start_bytesed:
            self.start_bytesed = True
            self._choose()
        return self.allocator or self.tracker or _Nothing()

    def _choose(self) -> None:
        """At the first measured step: the tracker with the state that exists, or the allocator's
        figure when the stage's blocks are compiled."""
        modules, optimizers = self.tracker.owners()
        if has_compiled_blocks(modules):
            self.tracker = None
            self.allocator = AllocatorPeak(self.device.type) if self.device.type == "cpu" else None
            return
        self.tracker.track_tensors((t for m in modules for t in (*m.parameters(), *m.buffers())))
        self.tracker.track_tensors(v for o in optimizers for s in o.state.values() for v in s.values())

    def kind(self) -> str:
        """What the peak is (plan_info.json's memory_kind)."""
        if self.device.type == "cuda":
            return "cuda max_memory_allocated" + (", split at its peak" if self.tracker is not None else "")
        if self.allocator is not None:
            return "CPU allocator (profiler memory events; compiled blocks)"
        return "live tensor storages" if self.tracker is not None and self.steps else "process peak RSS"

    def result(self) -> Dict[str, int]:
        """Bytes: peak and (when tracked) its split; {} when nothing was measured."""
        out: Dict[str, int] = dict(self.tracker.result()) if self.tracker is not None and self.steps else {}
        if self.allocator is not None:
            out = self.allocator.result()
        if self.device.type == "cuda":
            out["peak"] = int(torch.cuda.max_memory_allocated(self.device))
        return out


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def memory_metrics(per_rank: Sequence[Dict[str, int]], predicted: Optional[Sequence[float]] = None) -> Dict[str, float]:
    """memory/peak_gib (the largest rank's), memory/rank{r}/peak_gib and its split, and the
    prediction beside it when the plan has one."""
    out: Dict[str, float] = {}
    peaks = [m.get("peak") for m in per_rank if m and m.get("peak")]
    if peaks:
        out["memory/peak_gib"] = max(peaks) / GiB
    for r, m in enumerate(per_rank):
        for key, value in (m or {}).items():
            out[f"memory/rank{r}/{key}_gib"] = value / GiB
        if predicted is not None and r < len(predicted) and predicted[r]:
            out[f"memory/rank{r}/predicted_gib"] = float(predicted[r]) / GiB
    return out


def compare(measured: Sequence[Dict[str, int]], predicted: Optional[Sequence[float]]) -> List[Dict[str, float]]:
    """Per rank: measured peak, predicted, and (measured - predicted) / predicted."""
    out = []
    for r, m in enumerate(measured):
        p = float(predicted[r]) if predicted and r < len(predicted) and predicted[r] else None
        peak = (m or {}).get("peak")
        out.append({"rank": r, "measured_bytes": peak, "predicted_bytes": p,
                    "relative_error": (peak - p) / p if peak is not None and p else None,
                    "measured_split": {k: (m or {}).get(k) for k in CATEGORIES}})
    return out


def describe(rows: Sequence[Dict[str, float]]) -> str:
    """`rank 0 12.3 MiB (predicted 11.9 MiB, +3%), rank 1 ...` for the end-of-run line."""
    parts = []
    for row in rows:
        if row["measured_bytes"] is None:
            continue
        text = f"rank {row['rank']} {_mib(row['measured_bytes'])}"
        if row["predicted_bytes"]:
            text += f" (predicted {_mib(row['predicted_bytes'])}, {100 * row['relative_error']:+.0f}%)"
        parts.append(text)
    return ", ".join(parts)


def _mib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2 ** 20:.1f} MiB"


def rank_options(plan, train) -> List[Dict[str, object]]:
    """Per rank, what changes its memory beside the layout: its stages' recompute modes, sequence
    parallelism, FSDP resharding, the cp degree, train.compile and train.float8 (plan_info.json's
    memory split carries them, so a figure is read with what produced it)."""
    reshard = not plan.heterogeneous and plan.resolved_reshard_after_forward()
    out = []
    for rank in range(plan.world_size):
        stages = [s for s in plan.stages if rank in s.ranks] or \
                 [s for p in plan.pipelines for s in p.stages if rank in s.ranks]
        out.append({"recompute": sorted({s.recompute for s in stages}),
                    "sequence_parallel": any(s.sequence_parallel for s in stages),
                    "reshard_after_forward": bool(reshard and any(s.dp > 1 for s in stages)),
                    "cp": max((s.cp for s in stages), default=1),
                    "compile": bool(getattr(train, "compile", False)), "float8": bool(getattr(train, "float8", False))})
    return out


def add_to_plan_info(run_dir, rows: Sequence[Dict[str, float]], predicted_split: Sequence[Dict[str, float]],
                     kind: str, options: Optional[Sequence[Dict[str, object]]] = None) -> None:
    """plan_info.json["memory"]: per rank the measured peak and split beside the predicted ones, and
    the options it ran with (rank_options) where given."""
    path = Path(run_dir) / "plan_info.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    per_rank = [dict(row, predicted_split=predicted_split[row["rank"]] if row["rank"] < len(predicted_split) else None)
                for row in rows]
    for row in per_rank:
        if options and row["rank"] < len(options):
            row["options"] = dict(options[row["rank"]])
    info["memory"] = {
        "measured_kind": kind,
        "compared": "measured peak vs predicted tensor bytes (the predicted total less its workspace reserve)",
        "per_rank": per_rank}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1, default=float))
    os.replace(tmp, path)
