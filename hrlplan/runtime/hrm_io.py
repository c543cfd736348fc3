"""HRM runs' checkpoints and evaluation: writing and finding step_<N> directories, the test-split
metrics, and `hrlplan evaluate` (our checkpoints or HRM's own step files).

Checkpoints (rank 0 writes, atomically: a temporary directory renamed into place):
    <checkpoints>/all_config.yaml, hrm.py, ...   config and model source (as HRM)
    <checkpoints>/step_<N>/model.pt              full state dict (torch.save)
    <checkpoints>/step_<N>/optimizer.pt          AdamATan2 state (full, unsharded)
    <checkpoints>/step_<N>/train_state.json      step, iteration, batch, planned steps
    <checkpoints>/step_<N>/all_config.yaml + model source files
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import yaml

from hrlplan.data.sudoku import PuzzleSplit
from hrlplan.errors import UserError
from hrlplan.models.hrm import ACTLossHead, build_hrm, resolve_forward_dtype, source_files

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values


# ---------------------------------------------------------------- checkpoints
def _full_model_state(model) -> Dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():   # collective for sharded models: every rank must call it
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _write_sources(directory: str, cfg: Dict[str, Any]) -> None:
    with open(os.path.join(directory, "all_config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    for path in source_files():
        shutil.copy(path, os.path.join(directory, os.path.basename(path)))


def save_checkpoint(model, optimizer, state: Dict[str, Any], cfg: Dict[str, Any], checkpoint_dir: str) -> str:
    """Collective; rank 0 writes <checkpoint_dir>/step_<N> atomically and returns its path."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model_state = _full_model_state(model)
    optim_state = (get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                   if dist.is_initialized() else optimizer.state_dict())
    final = os.path.join(checkpoint_dir, f"step_{state['step']}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save(model_state, os.path.join(tmp, "model.pt"))
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        _write_sources(tmp, cfg)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def find_checkpoint(path: str) -> Optional[str]:
    """A step_<N> directory as is; a checkpoints/ (or run) directory -> its newest step_<N>."""
    if os.path.isfile(os.path.join(path, "model.pt")):
        return path
    for base in (path, os.path.join(path, "checkpoints")):
        if os.path.isdir(base):
            steps = [(int(m.group(1)), n) for n in os.listdir(base) if (m := _STEP_DIR.match(n))
                     and os.path.isfile(os.path.join(base, n, "model.pt"))]
            if steps:
                return os.path.join(base, max(steps)[1])
    return None


def _strip_compile_prefix(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


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


def _resume_dir(resume: Optional[str], search_dir: str) -> Optional[str]:
    if resume in (None, "", "none"):
        return None
    found = find_checkpoint(search_dir if resume == "auto" else resume)
    if found is None and resume != "auto":
        raise UserError(f"train.resume={resume}: no checkpoint (step_<N>/model.pt) there")
    return found



def _forward_dtype(arch: Dict[str, Any], device: torch.device) -> str:
    """HRM's bfloat16 forward is a GPU setting: on the CPU (slow bfloat16 matmuls) it runs float32."""
    wanted = resolve_forward_dtype(arch.get("forward_dtype"), device.type)
    return "float32" if device.type == "cpu" and wanted == "bfloat16" else wanted


# ---------------------------------------------------------------- hrlplan evaluate
def _load_for_eval(checkpoint: str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(config, state dict) from one of our step dirs, or from an HRM `step_<N>` file whose
    all_config.yaml sits beside it."""
    if os.path.isfile(checkpoint):
        config_path, weights = os.path.join(os.path.dirname(checkpoint), "all_config.yaml"), checkpoint
    else:
        found = find_checkpoint(checkpoint)
        if found is None:
            raise FileNotFoundError(f"{checkpoint}: no HRM checkpoint (step_<N>/model.pt) found")
        config_path, weights = os.path.join(found, "all_config.yaml"), os.path.join(found, "model.pt")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} is missing: the checkpoint's training config is needed to rebuild the model")
    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    return cfg, _strip_compile_prefix(torch.load(weights, map_location="cpu", weights_only=True))


def evaluate_cli(args) -> None:
    """`hrlplan evaluate <checkpoint> [--data-path D]`: prints exact accuracy on the test split."""
    cfg, state = _load_for_eval(args.checkpoint)
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
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(device)
    metrics = evaluate(model, test_split, gbs, device)
    print(f"exact_accuracy {metrics.get('exact_accuracy', 0.0):.4f} on {len(test_split.inputs)} test puzzles ({data_path})")
    print(json.dumps({f"eval/{k}": round(v, 6) for k, v in metrics.items()}, indent=1))
