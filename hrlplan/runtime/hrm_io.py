"""HRM runs' checkpoints and evaluation: finding step_<N> directories, the test-split metrics, and
`hrlplan evaluate` of an HRM checkpoint (ours, older ones, or HRM's own step files; the command
itself, for every model, is runtime/evaluate_run.py).

Checkpoints are the training core's (runtime/train_core.py, runtime/checkpoint.py): sharded
torch.distributed.checkpoint directories written atomically, plus what HRM's users expect beside
the weights:
    <checkpoints>/all_config.yaml, hrm.py, ...        config and model source (as HRM)
    <checkpoints>/step_000006/                        DCP shards: model.<name>, optim.state.<name>.*
    <checkpoints>/step_000006/extra_rank<r>.pt        step, position (iteration, batch), LR schedules,
                                                      RNG and the ACT carry of rank r
    <checkpoints>/step_000006/all_config.yaml + model source files
    <checkpoints>/latest                              the newest checkpoint's name
Checkpoints written before (step_<N>/model.pt, torch.save) are still evaluated.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from hrlplan.data.sudoku import PuzzleSplit
from hrlplan.errors import UserError
from hrlplan.models.hrm import ACTLossHead, build_hrm, resolve_forward_dtype, source_files
from hrlplan.runtime import checkpoint as ckpt

_STEP_DIR = re.compile(r"^step_(\d+)$")
DCP_METADATA = ".metadata"   # what torch.distributed.checkpoint writes beside its shards


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values


# ---------------------------------------------------------------- checkpoints
def _write_sources(directory: str | os.PathLike, cfg: Dict[str, Any]) -> None:
    with open(os.path.join(directory, "all_config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    for path in source_files():
        shutil.copy(path, os.path.join(directory, os.path.basename(path)))


def _is_dcp(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, DCP_METADATA))


def _is_legacy(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, "model.pt"))


def find_checkpoint(path: str) -> Optional[str]:
    """A checkpoint directory as is; a checkpoints/ (or run) directory -> its newest checkpoint
    (the `latest` one; else the newest step_<N>/model.pt of older versions)."""
    if _is_dcp(path) or _is_legacy(path):
        return path
    for base in (path, os.path.join(path, "checkpoints")):
        if not os.path.isdir(base):
            continue
        latest = ckpt.latest_checkpoint(base)
        if latest is not None and _is_dcp(latest):
            return str(latest)
        steps = [(int(m.group(1)), n) for n in os.listdir(base) if (m := _STEP_DIR.match(n)) and _is_legacy(os.path.join(base, n))]
        if steps:
            return os.path.join(base, max(steps)[1])
    return None


def is_hrm_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """An HRM run's checkpoint: its all_config.yaml beside it (in the step directory or the
    checkpoints directory above), or an older step_<N>/model.pt (only HRM wrote those)."""
    return (_is_legacy(checkpoint) or os.path.isfile(os.path.join(checkpoint, "all_config.yaml"))
            or os.path.isfile(os.path.join(os.path.dirname(os.path.normpath(checkpoint)), "all_config.yaml")))


def _strip_compile_prefix(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def load_model_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """A whole (unwrapped) model's weights from a training-core checkpoint, in one process."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    stored = set(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
    missing = sorted(k for k in state if k not in stored)
    if missing:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}")
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=not dist.is_initialized())
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()})


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model: ACTLossHead, split: PuzzleSplit, global_batch_size: int, device: torch.device,
             rank: int = 0, world: int = 1, max_examples: Optional[int] = None) -> Dict[str, float]:
    """Test-split metrics averaged over examples (exact_accuracy = fully solved puzzles)."""
    was_training = model.training
    model.eval()
    keys: List[str] = []
    totals: Optional[torch.Tensor] = None
    halt_steps = model.model.config.halt_max_steps
    for batch in split.test_batches(global_batch_size, rank, world, max_examples):
        batch = {k: v.to(device) for k, v in batch.items()}
        carry = model.initial_carry(batch)
        # Evaluation always runs halt_max_steps segments: a fixed count keeps ranks in lockstep.
        for _ in range(halt_steps):
            carry, _, metrics, _, _ = model(carry, batch)
        if totals is None:
            keys = sorted(metrics)
            totals = torch.zeros(len(keys), dtype=torch.float64, device=device)
        totals += torch.stack([metrics[k] for k in keys]).to(torch.float64)
    model.train(was_training)
    if totals is None:
        return {}
    totals = _all_reduce_sum(totals).cpu()
    values = dict(zip(keys, totals.tolist()))
    count = max(values.pop("count"), 1.0)
    return {k: v / count for k, v in values.items()}


def _forward_dtype(arch: Dict[str, Any], device: torch.device) -> str:
    """HRM's bfloat16 forward is a GPU setting: on the CPU (slow bfloat16 matmuls) it runs float32."""
    wanted = resolve_forward_dtype(arch.get("forward_dtype"), device.type)
    return "float32" if device.type == "cpu" and wanted == "bfloat16" else wanted


# ---------------------------------------------------------------- hrlplan evaluate
def _load_for_eval(checkpoint: str) -> Tuple[Dict[str, Any], Optional[Dict[str, torch.Tensor]], Optional[str]]:
    """(config, state dict, None) from an older step dir (model.pt) or an HRM `step_<N>` file whose
    all_config.yaml sits beside it; (config, None, directory) for a training-core checkpoint."""
    if os.path.isfile(checkpoint):
        config_path, weights, found = os.path.join(os.path.dirname(checkpoint), "all_config.yaml"), checkpoint, None
    else:
        found = find_checkpoint(checkpoint)
        if found is None:
            raise UserError(f"{checkpoint}: no checkpoint here (no step_<N>/ directory with model shards or model.pt); "
                            "give <run dir>/checkpoints of a run that saved one")
        config_path, weights = os.path.join(found, "all_config.yaml"), os.path.join(found, "model.pt")
    if not os.path.exists(config_path):
        raise UserError(f"{config_path} is missing: the checkpoint's training config is needed to rebuild the model")
    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    if found is not None and _is_dcp(found):
        return cfg, None, found
    return cfg, _strip_compile_prefix(torch.load(weights, map_location="cpu", weights_only=True)), None


def evaluate_cli(args) -> None:
    """`hrlplan evaluate <checkpoint> [--data-path D]`: prints exact accuracy on the test split."""
    cfg, state, sharded = _load_for_eval(args.checkpoint)
    data_path = args.data_path or (cfg.get("data") or {}).get("path") or cfg.get("data_path")
    if not data_path:
        raise UserError("the checkpoint's config names no data set; pass --data-path")
    train_split, test_split = PuzzleSplit(data_path, "train"), PuzzleSplit(data_path, "test")
    gbs = int((cfg.get("train") or {}).get("global_batch_size") or cfg.get("global_batch_size") or 64)
    meta = train_split.metadata
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    arch = dict(cfg["arch"], forward_dtype=_forward_dtype(dict(cfg["arch"]), device))
    model = build_hrm(arch, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
                      num_puzzle_identifiers=meta["num_puzzle_identifiers"])
    if sharded is not None:
        load_model_weights(model, sharded)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(device)
    metrics = evaluate(model, test_split, gbs, device)
    print(f"exact_accuracy {metrics.get('exact_accuracy', 0.0):.4f} on {len(test_split.inputs)} test puzzles ({data_path})")
    print(json.dumps({f"eval/{k}": round(v, 6) for k, v in metrics.items()}, indent=1))
