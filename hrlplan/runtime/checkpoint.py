"""Checkpoints: sharded model + optimizer through torch.distributed.checkpoint, written atomically.

Layout: <root>/step_000010/ (DCP shards + per-rank `extra_rank<r>.pt` with RNG, scheduler and data
position) and <root>/latest (the name of the newest complete checkpoint). Every rank writes into
step_N.tmp/; only after all ranks are done does rank 0 rename it to step_N and then repoint
`latest`, so a job killed mid-write leaves the previous checkpoint intact. Model keys are the full
model's parameter names, so the model part loads under a different layer split too.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

KEEP_LAST = 3


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state(parts: Dict[int, torch.nn.Module], optimizers: Dict[int, torch.optim.Optimizer]) -> Dict[str, Any]:
    model: Dict[str, Any] = {}
    for part in parts.values():
        model.update(get_model_state_dict(part))
    optim = {f"stage{i}": get_optimizer_state_dict(parts[i], optimizers[i]) for i in parts}
    return {"model": model, "optim": optim}


def save_checkpoint(root: str | os.PathLike, step: int, parts: Dict[int, torch.nn.Module],
                    optimizers: Dict[int, torch.optim.Optimizer], extra: Dict[str, Any]) -> Path:
    """Collective. `parts`/`optimizers` map this rank's stage indices to modules/optimizers."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a write that was killed
    _barrier()
    dcp.save(_state(parts, optimizers), checkpoint_id=str(tmp))
    torch.save({**extra, "rng": rng_state(), "step": step}, tmp / f"extra_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-KEEP_LAST]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if path.is_dir():
            return path
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def load_checkpoint(path: str | os.PathLike, parts: Dict[int, torch.nn.Module],
                    optimizers: Dict[int, torch.optim.Optimizer]) -> Dict[str, Any]:
    """Collective. Loads model and optimizer in place; returns this rank's extra dict (RNG restored)."""
    path = Path(path)
    state = _state(parts, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    for i, part in parts.items():
        keys = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: state["model"][k] for k in keys})
        set_optimizer_state_dict(part, optimizers[i], state["optim"][f"stage{i}"])
    extra_file = path / f"extra_rank{_rank()}.pt"
    if not extra_file.exists():
        raise FileNotFoundError(f"{extra_file} is missing: the checkpoint was written by a job with a different "
                                "number of ranks; resume with the same plan (or start fresh with train.resume=none)")
    extra = torch.load(extra_file, weights_only=True)
    set_rng_state(extra["rng"])
    return extra


def resolve_resume(setting: str, checkpoint_root: str | os.PathLike) -> Optional[Path]:
    """train.resume: none | auto (latest under this run, if any) | an explicit checkpoint directory."""
    if setting in (None, "", "none"):
        return None
    if setting == "auto":
        return latest_checkpoint(checkpoint_root)
    path = Path(setting)
    if (path / "latest").exists() or any(path.glob("step_*")):
        found = latest_checkpoint(path)
        if found:
            return found
    if not path.is_dir():
        raise FileNotFoundError(f"train.resume={setting}: no such checkpoint directory; use auto, none or a step_N dir")
    return path


def list_checkpoints(root: str | os.PathLike) -> List[Path]:
    return sorted(p for p in Path(root).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
