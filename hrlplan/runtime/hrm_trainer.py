"""HRM training loop (arch=hrm): data parallel over every rank of the current process group.

The model is wrapped with FSDP2 `fully_shard` (train.dp_mode=fsdp) or composable `replicate`
(train.dp_mode=replicate) on a 1-D DeviceMesh. The puzzle-embedding table is a buffer outside
both wrappers; its touched rows are all-reduced by hand in SparseEmbeddingSignSGD.

Counting follows HRM's pretrain.py: an epoch visits every puzzle group once, a step consumes one
global batch, `eval_interval` is in epochs, the learning rate warms up for train.warmup_steps and
then follows a cosine down to min_lr_ratio * lr over all planned steps. train.steps sets the run's
length only when epochs is not given; train.stop_after caps it either way. ACT carries unfinished sequences across batches.

Checkpoints (rank 0 writes, atomically: a temporary directory renamed into place):
    <run_dir>/checkpoints/all_config.yaml, hrm.py, ...   config and model source (as HRM)
    <run_dir>/checkpoints/step_<N>/model.pt              full state dict (torch.save)
    <run_dir>/checkpoints/step_<N>/optimizer.pt          AdamW state (full, unsharded)
    <run_dir>/checkpoints/step_<N>/train_state.json      step, epoch, planned steps
    <run_dir>/checkpoints/step_<N>/all_config.yaml + model source files
`hrlplan evaluate <step dir | checkpoints dir | HRM step file>` reports test exact accuracy.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import yaml

from hrlplan.data.sudoku import PuzzleSplit, ensure_sudoku_dataset
from hrlplan.errors import UserError
from hrlplan.models.hrm import ACTLossHead, build_hrm, check_hrm_fits, maybe_compile, source_files
from hrlplan.models.sparse_embedding import SparseEmbeddingSignSGD
from hrlplan.runtime import preempt

log = logging.getLogger("hrlplan.hrm")
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ---------------------------------------------------------------- setup
def _pick_device(preference: str) -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    gpu_ok = torch.cuda.is_available() and "nccl" in str(backend)
    if preference == "cuda" and not gpu_ok:
        raise UserError("train.device=cuda needs CUDA and an NCCL process group; use train.device=cpu or auto")
    if preference in ("cuda", "auto") and gpu_ok:
        local = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wrap(model: ACTLossHead, mode: str, device: torch.device, world: int) -> ACTLossHead:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One unit for the whole model: HRM reuses every block many times per step, so per-block
        # units would all-gather each block once per cycle instead of once per step.
        fully_shard(model, mesh=mesh)
    elif mode == "replicate":
        import inspect

        from torch.distributed._composable import replicate
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (puzzle table, initial states) stay identical by construction: no per-step
        # broadcast (the keyword was renamed in torch 2.12).
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        replicate(model, device_mesh=mesh, **{"forward_sync_buffers" if newer else "broadcast_buffers": False})
    else:
        raise UserError(f"train.dp_mode={mode!r}: HRM trains with fsdp or replicate")
    return model


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up, then a cosine from base_lr down to min_ratio * base_lr (HRM's schedule)."""
    if step < warmup_steps:
        return base_lr * step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * (min_ratio + max(0.0, (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))))


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


def save_checkpoint(model, optimizer, state: Dict[str, Any], cfg: Dict[str, Any], run_dir: str) -> str:
    """Collective; rank 0 writes <run_dir>/checkpoints/step_<N> atomically and returns its path."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model_state = _full_model_state(model)
    optim_state = (get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                   if dist.is_initialized() else optimizer.state_dict())
    final = os.path.join(run_dir, "checkpoints", f"step_{state['step']}")
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


# ---------------------------------------------------------------- training
DEFAULT_HRM_DATA = "data/sudoku-extreme-small"


def _data_path(cfg: Dict[str, Any]) -> str:
    # Without data_path, the small Sudoku preset (built on first use) lets `arch=hrm` run as is.
    return str((cfg.get("data") or {}).get("path") or cfg.get("data_path") or DEFAULT_HRM_DATA)


def _say(logger, text: str) -> None:
    """A human-readable line: Python logging, and the run's train.log when the logger keeps one."""
    log.info(text)
    note = getattr(logger, "note", None)
    if callable(note):
        note(text)


def _prepare_data(path: str, rank: int, logger) -> Tuple[PuzzleSplit, PuzzleSplit]:
    if rank == 0:
        ensure_sudoku_dataset(path, seed=0, log=lambda text: _say(logger, text))
    if dist.is_initialized():
        dist.barrier()
    return PuzzleSplit(path, "train"), PuzzleSplit(path, "test")


def _resume_dir(resume: Optional[str], run_dir: str) -> Optional[str]:
    if resume in (None, "", "none"):
        return None
    found = find_checkpoint(run_dir if resume == "auto" else resume)
    if found is None and resume != "auto":
        raise UserError(f"train.resume={resume}: no checkpoint (step_<N>/model.pt) there")
    return found


def train_hrm(cfg: Dict[str, Any], run_dir: str, plan, logger) -> Dict[str, Any]:
    """Train HRM on cfg['data']['path']; returns the final metrics, step and checkpoint path."""
    if not dist.is_initialized():
        raise RuntimeError("train_hrm needs an initialised torch.distributed process group (gloo or nccl)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if plan is not None and getattr(plan, "pp", 1) != 1:
        raise UserError(f"HRM trains data parallel only; the plan has pp={plan.pp} (use a pp=1 plan)")
    train, arch = dict(cfg["train"]), dict(cfg["arch"])
    gbs = int(train.get("global_batch_size") or 8)
    if gbs % world:
        raise UserError(f"global_batch_size={gbs} must be a multiple of the {world} data-parallel ranks")
    seed = int(train.get("seed", 0))
    device = _pick_device(str(train.get("device", "auto")))
    train_split, test_split = _prepare_data(_data_path(cfg), rank, logger)
    meta = train_split.metadata

    steps_per_epoch = train_split.steps_per_epoch(gbs)
    epochs = train.get("epochs")
    # HRM counts in epochs (its users type epochs=500); train.steps only counts when no epochs are
    # given, and train.stop_after caps either.
    cap = None if epochs is not None else train.get("steps")
    if epochs is None and cap is None:
        raise UserError("set epochs=<N> (passes over the training puzzles) or train.steps=<N>")
    epochs = int(epochs) if epochs is not None else -(-int(cap) // steps_per_epoch)
    total_steps = epochs * steps_per_epoch
    stop_at = min(total_steps, int(cap)) if cap is not None else total_steps
    stop_after = train.get("stop_after")
    if stop_after is not None:
        stop_at = min(stop_at, int(stop_after))
    eval_interval = int(train.get("eval_interval") or epochs)

    torch.manual_seed(seed)   # identical initial weights on every rank
    with torch.device(device):
        model = build_hrm(arch, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
                          num_puzzle_identifiers=meta["num_puzzle_identifiers"])
    resume_from = _resume_dir(train.get("resume"), run_dir)
    state = {"step": 0, "epoch": 0}
    if resume_from:
        model.load_state_dict(torch.load(os.path.join(resume_from, "model.pt"), map_location=device, weights_only=True))
        with open(os.path.join(resume_from, "train_state.json")) as f:
            state = json.load(f)
    if device.type == "cuda":
        warning = check_hrm_fits(arch, gbs, torch.cuda.get_device_properties(device).total_memory, world, meta["seq_len"])
        if warning and rank == 0:
            _say(logger, f"warning: {warning}")
    model = _wrap(model, str(train.get("dp_mode", "fsdp")), device, world)
    compiled = maybe_compile(model, device)
    torch.manual_seed(seed + rank)   # ACT exploration differs per rank, as in HRM

    betas = (float(train.get("beta1", 0.9)), float(train.get("beta2", 0.95)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=float(train.get("weight_decay", 0.1)), betas=betas)
    emb = model.model.puzzle_emb
    sparse = SparseEmbeddingSignSGD([emb], lr=0.0, weight_decay=float(train.get("puzzle_emb_weight_decay", 0.1)),
                                    world_size=world) if emb is not None else None
    if resume_from:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved = torch.load(os.path.join(resume_from, "optimizer.pt"), map_location="cpu", weights_only=True)
        set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
    lrs = (float(train.get("lr", 1e-4)), float(train.get("puzzle_emb_lr", 1e-2)))
    warmup, min_ratio = int(train.get("warmup_steps", 0)), float(train.get("min_lr_ratio", 1.0))
    grad_clip, log_every = float(train.get("grad_clip") or 0.0), max(1, int(train.get("log_interval") or 1))
    checkpoint_every = int(train.get("checkpoint_interval") or 0)

    step = int(state["step"])
    checkpoints = os.path.join(run_dir, "checkpoints")
    if rank == 0:
        os.makedirs(checkpoints, exist_ok=True)
        _write_sources(checkpoints, cfg)
        n_params = sum(p.numel() for p in model.parameters())
        _say(logger, f"HRM: {n_params:,} parameters, {world} rank(s) on {device}, {train.get('dp_mode', 'fsdp')}, "
                 f"{epochs} epochs x {steps_per_epoch} steps = {total_steps} steps"
                 + (f", stopping at step {stop_at} (train.steps / train.stop_after)" if stop_at < total_steps else "")
                 + (" (compiled)" if compiled else "") + (f", resumed from {resume_from}" if resume_from else ""))
        logger.log({"num_params": n_params}, step=step)
    from tqdm import tqdm

    bar = tqdm(total=stop_at, initial=step, desc="HRM", unit="step", disable=rank != 0)
    result: Dict[str, Any] = {}
    history: List[Dict[str, float]] = []
    last_ckpt: Optional[str] = None
    periodic: Optional[str] = None   # the latest interval checkpoint; replaced by the next one
    first_step_at: Optional[float] = None
    carry = None
    local_bs = gbs // world
    started, start_step = time.time(), step
    preempted = False
    model.train()
    for epoch in range(step // steps_per_epoch, epochs):
        first_batch = step - epoch * steps_per_epoch
        for batch in train_split.epoch_batches(epoch, seed, gbs, rank, world, start_batch=first_batch):
            if step >= stop_at:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            if carry is None:
                carry = model.initial_carry(batch)
            carry, loss, metrics, _, _ = model(carry, batch)
            # Losses are sums over sequences; wrappers average gradients over ranks, so dividing
            # by the local batch gives HRM's sum / global_batch_size.
            (loss / local_bs).backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            # HRM counts the step being taken (1-based), so the first update already has a learning rate.
            lr = lr_at(step + 1, lrs[0], warmup, total_steps, min_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if sparse is not None:
                sparse.param_groups[0]["lr"] = lr_at(step + 1, lrs[1], warmup, total_steps, min_ratio)
                sparse.step()
                sparse.zero_grad()
            step += 1
            bar.update(1)
            if first_step_at is None:
                first_step_at = time.time()
            if step % log_every == 0 or step == stop_at:
                keys = sorted(metrics)
                totals = _all_reduce_sum(torch.stack([metrics[k] for k in keys]).to(torch.float64)).cpu().tolist()
                values = dict(zip(keys, totals))
                count = max(values.pop("count"), 1.0)
                train_metrics = {f"train/{k}": v / (gbs if k.endswith("loss") else count) for k, v in values.items()}
                train_metrics.update({"train/lr": lr, "train/epoch": step / steps_per_epoch})
                result.update(train_metrics)
                history = (history + [dict(train_metrics, step=step)])[-100:]
                if rank == 0:
                    logger.log(train_metrics, step=step)
                    bar.set_postfix(lm_loss=f"{train_metrics['train/lm_loss']:.3f}")
            if checkpoint_every and step % checkpoint_every == 0:
                last_ckpt = save_checkpoint(model, optimizer, _state(step, total_steps, steps_per_epoch), cfg, run_dir)
                # Interval checkpoints are for resuming: keep the newest only (evaluation ones stay).
                if periodic and periodic != last_ckpt and rank == 0:
                    shutil.rmtree(periodic, ignore_errors=True)
                periodic = last_ckpt
            # Collective (preempt's contract): all ranks agree, checkpoint together and stop.
            if preempt.stop_agreed(device):
                preempted = True
                if last_ckpt is None or not last_ckpt.endswith(f"step_{step}"):
                    last_ckpt = save_checkpoint(model, optimizer, _state(step, total_steps, steps_per_epoch), cfg,
                                                run_dir)
                break
        if preempted:
            break
        finished_epoch = step // steps_per_epoch
        at_end = step >= stop_at
        if (finished_epoch % eval_interval == 0 and step % steps_per_epoch == 0) or at_end:
            eval_metrics = {f"eval/{k}": v for k, v in evaluate(model, test_split, gbs, device, rank, world).items()}
            result.update(eval_metrics)
            if rank == 0:
                logger.log(eval_metrics, step=step)
                _say(logger, f"step {step} (epoch {finished_epoch}): eval exact_accuracy "
                         f"{eval_metrics.get('eval/exact_accuracy', float('nan')):.4f}")
            if last_ckpt is None or not last_ckpt.endswith(f"step_{step}"):
                last_ckpt = save_checkpoint(model, optimizer, _state(step, total_steps, steps_per_epoch), cfg, run_dir)
            if periodic == last_ckpt:
                periodic = None   # now an evaluation checkpoint: kept
        if at_end:
            break
    bar.close()
    elapsed = time.time() - started
    result.update(step=step, final_step=step, total_steps=total_steps, checkpoint=last_ckpt, history=history,
                  first_step_at=first_step_at, preempted=preempted, steps_per_second=(step - start_step) / elapsed if elapsed > 0 else 0.0)
    return result


def _state(step: int, total_steps: int, steps_per_epoch: int) -> Dict[str, Any]:
    return {"step": step, "epoch": step // steps_per_epoch, "total_steps": total_steps}


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
    model = build_hrm(dict(cfg["arch"]), seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
                      num_puzzle_identifiers=meta["num_puzzle_identifiers"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    metrics = evaluate(model, test_split, gbs, device)
    print(f"exact_accuracy {metrics.get('exact_accuracy', 0.0):.4f} on {len(test_split.inputs)} test puzzles ({data_path})")
    print(json.dumps({f"eval/{k}": round(v, 6) for k, v in metrics.items()}, indent=1))
