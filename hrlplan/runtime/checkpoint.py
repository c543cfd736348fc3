"""Checkpoints: sharded model + optimizer through torch.distributed.checkpoint, written atomically.

Layout: <root>/step_000010/ (DCP shards + per-rank `extra_rank<r>.pt` with RNG, scheduler and data
position) and <root>/latest (the name of the newest complete checkpoint). Every rank writes into
step_N.tmp/; only after all ranks are done does rank 0 rename it to step_N and then repoint
`latest`, so a job killed mid-write leaves the previous checkpoint intact. Keys are the full model's
parameter names for the weights and, flattened, for the optimizer state (`state.<fqn>.exp_avg`,
`param_groups.<fqn>.lr`): a checkpoint written by one layout (stage split, dp degree, number of
ranks) loads under another, torch.distributed.checkpoint resharding it (elastic re-plan on a
requeue onto fewer nodes, or `train.resume=auto` with another cluster.nproc_per_node).

A checkpoint damaged on disk (a shard cut short, a missing `.metadata` or extra_rank file) is told
before loading (`checkpoint_problem`, from sizes and headers): `train.resume=<that dir>` is one
error naming the file; `train.resume=auto` falls back to the newest complete one and says so.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from hrlplan.errors import UserError, one_line

KEEP_LAST = 3
METADATA = ".metadata"            # what torch.distributed.checkpoint writes beside its shards
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
LAYOUT_FILE = "layout.json"       # who wrote the checkpoint: every rank's host and stages
REPLAN_LOG = "replans.jsonl"      # beside the checkpoints: one line per resume under another layout
# A tied output head and input embedding: one Parameter in a one-stage model (its optimizer state
# under one of the names), two equal copies on different stages. Either name stands for the other.
TIED_NAMES = (("lm_head.weight", "transformer.wte.weight"), ("lm_head.weight", "model.embed_tokens.weight"))
log = logging.getLogger("hrlplan")


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


def _model_state(parts: Dict[int, torch.nn.Module]) -> Dict[str, Any]:
    model: Dict[str, Any] = {}
    for part in parts.values():
        model.update(get_model_state_dict(part))
    return model


def _optim_state(part: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    # Flattened: `state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`, keyed by the model's parameter
    # names, so a checkpoint written under one stage split / dp degree loads under another.
    return get_optimizer_state_dict(part, optimizer, options=FLAT)


def _state(parts: Dict[int, torch.nn.Module], optimizers: Dict[int, torch.optim.Optimizer]) -> Dict[str, Any]:
    """One flat, layout-independent dict: model.<fqn> and optim.state.<fqn>.* / optim.param_groups.<fqn>.*"""
    state = {f"model.{k}": v for k, v in _model_state(parts).items()}
    for i, part in parts.items():
        state.update({f"optim.{k}": v for k, v in _optim_state(part, optimizers[i]).items()})
    return state


def _parameter_of(key: str) -> Optional[str]:
    """The parameter a key of _state belongs to: model.<fqn>, optim.state.<fqn>.<name>, optim.param_groups.<fqn>.<name>."""
    if key.startswith("model."):
        return key[len("model."):]
    for prefix in ("optim.state.", "optim.param_groups."):
        if key.startswith(prefix):
            return key[len(prefix):].rsplit(".", 1)[0]
    return None


def _layout(parts: Dict[int, torch.nn.Module]) -> List[Dict[str, Any]]:
    """Collective: every rank's host and stages (with their block ranges), in rank order."""
    mine = {"host": socket.gethostname(),
            "stages": {str(i): list(getattr(p, "layer_range", ())) for i, p in sorted(parts.items())}}
    if not dist.is_initialized():
        return [mine]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def describe_layout(layout: List[Dict[str, Any]]) -> str:
    """'2 ranks on 1 node(s) (login): stage 0 blocks [0, 4) on rank 0, stage 1 blocks [4, 6) on rank 1'"""
    hosts = list(dict.fromkeys(r["host"] for r in layout))
    stages: Dict[str, Any] = {}
    for rank, r in enumerate(layout):
        for i, span in r["stages"].items():
            entry = stages.setdefault(i, {"span": span, "ranks": []})
            entry["ranks"].append(rank)
    parts = [f"stage {i} blocks {tuple(v['span'])} on rank(s) {v['ranks']}" for i, v in
             sorted(stages.items(), key=lambda kv: int(kv[0]))]
    return f"{len(layout)} rank(s) on {len(hosts)} node(s) ({', '.join(hosts)}): " + "; ".join(parts)


def save_checkpoint(root: str | os.PathLike, step: int, parts: Dict[int, torch.nn.Module],
                    optimizers: Dict[int, torch.optim.Optimizer], extra: Dict[str, Any],
                    keep_last: Optional[int] = KEEP_LAST,
                    write_files: Optional[Callable[[Path], None]] = None,
                    writes: Optional[Callable[[str], bool]] = None) -> Path:
    """Collective. `parts`/`optimizers` map this rank's stage indices to modules/optimizers.
    keep_last: the newest checkpoints kept (None: all); write_files(directory): rank 0 adds files of
    its own (a config, sources) to the checkpoint before it is renamed into place; writes(name):
    whether this rank writes parameter `name` and its optimizer state (default: every one it holds)."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    layout = _layout(parts)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a write that was killed
    _barrier()
    state = _state(parts, optimizers)
    if writes is not None:
        state = {k: v for k, v in state.items() if (name := _parameter_of(k)) is None or writes(name)}
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save({**extra, "rng": rng_state(), "step": step}, tmp / f"extra_rank{_rank()}.pt")
    if _rank() == 0:
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout))
        if write_files is not None:
            write_files(tmp)
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        for old in (list_checkpoints(root)[:-keep_last] if keep_last else []):
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


def _alias(key: str, stored: set) -> Optional[str]:
    """The stored key holding `key`'s value when the writer kept it under a tied twin's name."""
    for a, b in TIED_NAMES:
        for x, y in ((a, b), (b, a)):
            if x in key and key.replace(x, y) in stored:
                return key.replace(x, y)
    return None


def _load_flat(path: Path, parts, optimizers) -> None:
    """Load the layout-independent state into this rank's parts and optimizers (DCP reshards)."""
    target = _state(parts, optimizers)
    stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    request: Dict[str, Any] = {}
    source: Dict[str, str] = {}
    for key, value in target.items():
        name = key if key in stored else _alias(key, stored)
        if name is None:
            raise ValueError(f"checkpoint {path} has no '{key}': it was written for another model or optimizer; "
                             "start fresh with train.resume=none (or resume it with its own arch/train settings)")
        if name in request:   # a tied twin asked for the same entry: load once, copy after
            source[key] = name
            continue
        request[name] = value
        source[key] = name
    dcp.load(request, checkpoint_id=str(path))
    loaded = {key: request[name] for key, name in source.items()}
    for i, part in parts.items():
        keys = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: loaded[f"model.{k}"] for k in keys})
        flat = {k: loaded[f"optim.{k}"] for k in _optim_state(part, optimizers[i])}
        set_optimizer_state_dict(part, optimizers[i], flat, options=FLAT)


def _load_legacy(path: Path, parts, optimizers) -> None:
    """Checkpoints written before the flat layout (optimizer state per stage index): same layout only."""
    model: Dict[str, Any] = {}
    for part in parts.values():
        model.update(get_model_state_dict(part))
    state = {"model": model, "optim": {f"stage{i}": get_optimizer_state_dict(parts[i], optimizers[i]) for i in parts}}
    dcp.load(state, checkpoint_id=str(path))
    for i, part in parts.items():
        keys = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: state["model"][k] for k in keys})
        set_optimizer_state_dict(part, optimizers[i], state["optim"][f"stage{i}"])


def _replan_note(path: Path, parts) -> Optional[Dict[str, str]]:
    """Collective. The old and new layout and why they differ, when the checkpoint was written by another."""
    now = _layout(parts)
    file = path / LAYOUT_FILE
    if not file.exists():
        return None
    old = json.loads(file.read_text())
    if old == now:
        return None
    old_hosts, new_hosts = list(dict.fromkeys(r["host"] for r in old)), list(dict.fromkeys(r["host"] for r in now))
    if old_hosts != new_hosts:
        reason = f"the job now runs on {len(new_hosts)} node(s) {new_hosts} (was {len(old_hosts)}: {old_hosts})"
    elif len(old) != len(now):
        reason = (f"the job now has {len(now)} worker(s) (was {len(old)}: cluster.nproc_per_node or the "
                  "allocation changed)")
    else:
        reason = "the planner chose another layout for the same workers (probe or settings changed)"
    return {"old": describe_layout(old), "new": describe_layout(now), "reason": reason}


def replan_line(checkpoint_name: str, replan: Dict[str, str]) -> str:
    return (f"re-plan on resume from {checkpoint_name}: {replan['reason']}; checkpoint layout: {replan['old']}; "
            f"new layout: {replan['new']}; weights and optimizer state resharded by torch.distributed.checkpoint")


def load_checkpoint(path: str | os.PathLike, parts: Dict[int, torch.nn.Module],
                    optimizers: Dict[int, torch.optim.Optimizer], announce: bool = True) -> Dict[str, Any]:
    """Collective. Loads model and optimizer in place, resharded onto this job's layout when it
    differs from the writer's; returns this rank's extra dict (RNG restored). extra["replan"]
    holds the old and new layout and the reason when the layout changed (rank 0 appends it to
    replans.jsonl, and with announce=True also prints and logs replan_line)."""
    path = Path(path)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    replan = _replan_note(path, parts)
    if any(k.startswith("optim.stage") for k in stored):
        if replan:
            raise ValueError(f"checkpoint {path} predates layout-independent checkpoints and was written by another "
                             f"layout ({replan['old']}); resume it with its own plan, or start fresh")
        _load_legacy(path, parts, optimizers)
    else:
        _load_flat(path, parts, optimizers)
    extra_file = path / f"extra_rank{_rank()}.pt"
    if not extra_file.exists():
        # A job with more ranks than the writer: rank 0's RNG, step and schedule stand for all.
        extra_file = path / "extra_rank0.pt"
    extra = torch.load(extra_file, weights_only=True)
    set_rng_state(extra["rng"])
    schedulers = extra.get("schedulers")
    if schedulers:
        # Every stage's LR schedule is the same function of the step: a stage this rank holds
        # now but whose writer was another rank takes any stage's state.
        any_state = next(iter(schedulers.values()))
        for i in parts:
            schedulers.setdefault(f"stage{i}", any_state)
    if replan:
        extra["replan"] = replan
        if _rank() == 0:
            if announce:
                log.warning(replan_line(path.name, replan))
                print(f"[hrlplan] {replan_line(path.name, replan)}", flush=True)
            with open(path.parent / REPLAN_LOG, "a") as f:
                f.write(json.dumps({"step": int(extra.get("step", 0)), "checkpoint": path.name, **replan}) + "\n")
    return extra


def checkpoint_problem(path: str | os.PathLike) -> Optional[str]:
    """What makes checkpoint directory `path` unusable, naming the file, or None when it is complete.
    Cheap (no tensor is read): the DCP metadata must load, every shard it points into must be at
    least as long as the bytes it names, and every extra_rank<r>.pt (rank 0's at least) must be a whole zip."""
    path = Path(path)
    meta = path / METADATA
    if not meta.is_file():
        older = " (a checkpoint of an older hrlplan: it can be evaluated, not resumed)" if (path / "model.pt").exists() else ""
        return f"{meta} is missing{older}"
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:   # a truncated pickle: EOFError, UnpicklingError, ...
        return f"{meta} is unreadable ({type(e).__name__}: {one_line(str(e), 120)})"
    needed: Dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} is truncated ({file.stat().st_size} bytes, the metadata needs {size})"
    layout = path / LAYOUT_FILE
    try:
        json.loads(layout.read_text()) if layout.exists() else None
    except (OSError, ValueError) as e:
        return f"{layout} is unreadable ({one_line(str(e), 120)})"
    # rank 0's extra state stands in for a rank without its own (see load_checkpoint): it must be there
    extras = sorted(set(path.glob("extra_rank*.pt")) | {path / "extra_rank0.pt"})
    for file in extras:
        if not file.is_file():
            return f"{file} is missing"
        try:
            with zipfile.ZipFile(file) as z:   # torch.save's format: a cut-short file has no directory
                bad = z.testzip()
        except (OSError, zipfile.BadZipFile) as e:
            return f"{file} is truncated or damaged ({one_line(str(e), 120)})"
        if bad is not None:
            return f"{file} is damaged (its member {bad} fails its checksum)"
    return None


def _newest_complete(root: Path, what: str) -> Tuple[Optional[Path], List[str]]:
    """The newest complete checkpoint under `root` (from the one `latest` names, down), and a line
    for each newer one skipped as damaged. None when there is none at all; an error when every
    checkpoint there is damaged."""
    found = list_checkpoints(root)
    latest = latest_checkpoint(root)
    if latest in found:
        found = found[:found.index(latest) + 1]   # newer ones are of a run that went on elsewhere
    skipped: List[Tuple[Path, str]] = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            notes = [f"{what}: checkpoint {p.name} is incomplete ({why}); resuming from {path.name}, the newest "
                     "complete one" for p, why in skipped]
            return path, notes
        skipped.append((path, problem))
    if skipped:
        raise UserError(f"{what}: no complete checkpoint in {root}: " +
                        "; ".join(f"{p.name}: {why}" for p, why in skipped) + "; start fresh with train.resume=none")
    return None, []


def find_resume(setting: Optional[str], checkpoint_root: str | os.PathLike) -> Tuple[Optional[Path], List[str]]:
    """train.resume: none | auto (the newest complete checkpoint of this run, if any) | a checkpoint
    directory (or a checkpoints/ directory: its newest complete one). Returns (the checkpoint, lines to
    tell: damaged checkpoints skipped); a named checkpoint that is damaged is a UserError naming the file."""
    if setting in (None, "", "none"):
        return None, []
    if setting == "auto":
        return _newest_complete(Path(checkpoint_root), "train.resume=auto")
    path = Path(setting)
    if (path / "latest").exists() or list_checkpoints(path):
        return _newest_complete(path, f"train.resume={setting}")
    if not path.is_dir():
        raise UserError(f"train.resume={setting}: no such checkpoint directory; use auto, none or a step_N directory")
    problem = checkpoint_problem(path)
    if problem:
        raise UserError(f"train.resume={setting}: the checkpoint cannot be loaded: {problem}; name an earlier one, "
                        "use train.resume=auto (the newest complete one) or start fresh with train.resume=none")
    return path, []


def resolve_resume(setting: Optional[str], checkpoint_root: str | os.PathLike) -> Optional[Path]:
    """find_resume's checkpoint alone."""
    return find_resume(setting, checkpoint_root)[0]


def list_checkpoints(root: str | os.PathLike) -> List[Path]:
    return sorted(p for p in Path(root).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
