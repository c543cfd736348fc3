"""HRM training loop (arch=hrm): data parallel over every rank of the current process group.

The model is wrapped with FSDP2 `fully_shard` (train.dp_mode=fsdp) or composable `replicate`
(train.dp_mode=replicate) on a 1-D DeviceMesh. The puzzle-embedding table is a buffer outside
both wrappers; its touched rows are all-reduced by hand in SparseEmbeddingSignSGD. The weights
train with AdamATan2 (hrlplan/optim.py), as in HRM.

Counting follows HRM's pretrain.py: an epoch visits every puzzle group once; `eval_interval`
epochs form one iteration, batched together, whose one partial batch at the end is dropped (no
padded row ever trains); the model is evaluated after every iteration. The learning rate warms up
for train.warmup_steps and then follows a cosine down to min_lr_ratio * lr over HRM's
int(epochs * examples / global_batch_size) steps. train.steps sets the run's length only when
epochs is not given; train.stop_after caps it either way. ACT carries unfinished sequences across
batches.

Checkpoints (runtime/hrm_io.py: format, evaluation, `hrlplan evaluate`) go to train.checkpoint_path
(HRM's checkpoint_path) or <run_dir>/checkpoints, after every evaluation with
train.checkpoint_every_eval (default) else at the end, and every train.checkpoint_interval steps.
Peak memory is measured on the first steps (runtime/memory.py) and logged beside the memory
model's prediction (models.hrm.estimate_hrm_memory) as memory/peak_gib and memory/rank{r}/*.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hrlplan.data.sudoku import PuzzleSplit, ensure_sudoku_dataset
from hrlplan.devices import choose_device, use_device
from hrlplan.errors import UserError
from hrlplan.models.hrm import ACTLossHead, build_hrm, check_hrm_fits, estimate_hrm_memory, maybe_compile
from hrlplan.models.sparse_embedding import SparseEmbeddingSignSGD
from hrlplan.optim import AdamATan2
from hrlplan.runtime import memory as mem
from hrlplan.runtime import preempt
# re-exported: where callers found them before runtime/hrm_io.py
from hrlplan.runtime.hrm_io import (_all_reduce_sum, _forward_dtype, _resume_dir, _write_sources,  # noqa: F401
                                   evaluate, evaluate_cli, find_checkpoint, save_checkpoint)

log = logging.getLogger("hrlplan.hrm")


# ---------------------------------------------------------------- setup
def _pick_device(setting: str) -> torch.device:
    """The rank's device (hrlplan.devices' choice); CUDA only under an NCCL process group."""
    backend = str(dist.get_backend()) if dist.is_initialized() else "gloo"
    if choose_device(setting).is_cuda and "nccl" not in backend:
        if setting == "cuda":
            raise UserError(f"train.device=cuda needs an NCCL process group (this one is {backend}); "
                            "use train.device=cpu or auto")
        return torch.device("cpu")
    return use_device(setting).device


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


# ---------------------------------------------------------------- training
DEFAULT_HRM_DATA = "data/sudoku-extreme-small"


def _data_path(cfg: Dict[str, Any]) -> str:
    # Without data_path, the small Sudoku preset (built on first use) lets `arch=hrm` run as is.
    return str((cfg.get("data") or {}).get("path") or cfg.get("data_path") or DEFAULT_HRM_DATA)


def _gather(obj: Any) -> List[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _say(logger, text: str) -> None:
    """A human-readable line: the run's train.log and console through the logger's note (once), else
    Python logging."""
    note = getattr(logger, "note", None)
    if callable(note):
        note(text)
    else:
        log.info(text)


def _prepare_data(path: str, rank: int, logger) -> Tuple[PuzzleSplit, PuzzleSplit]:
    if rank == 0:
        ensure_sudoku_dataset(path, seed=0, log=lambda text: _say(logger, text))
    if dist.is_initialized():
        dist.barrier()
    return PuzzleSplit(path, "train"), PuzzleSplit(path, "test")


@dataclass
class HRMSchedule:
    """How long a run is, counted as HRM's pretrain.py counts."""
    epochs: int
    epochs_per_iter: int            # eval_interval: epochs batched together between evaluations
    iterations: int
    total_steps: int                # the learning-rate schedule's length: int(epochs * examples / batch)
    steps_per_iter: Optional[int]   # full batches per iteration (None: drawn, puzzles of many examples)
    stop_at: int                    # the step this run stops at

    @property
    def run_steps(self) -> Optional[int]:
        """Optimizer steps of the whole recipe: every iteration's full batches (one partial batch
        dropped per iteration), at most total_steps as in HRM."""
        return None if self.steps_per_iter is None else min(self.total_steps, self.iterations * self.steps_per_iter)


def hrm_schedule(train: Dict[str, Any], metadata: Dict[str, Any], global_batch_size: int,
                 steps_per_iter: Optional[int]) -> HRMSchedule:
    """Epochs, eval_interval (in epochs) and the step caps train.steps / train.stop_after."""
    examples_per_epoch = metadata["total_groups"] * metadata.get("mean_puzzle_examples", 1)
    epochs, interval = train.get("epochs"), train.get("eval_interval")
    # HRM counts in epochs (its users type epochs=500); train.steps only counts when no epochs are given.
    cap = None if epochs is not None else train.get("steps")
    if epochs is None and cap is None:
        raise UserError("set epochs=<N> (passes over the training puzzles) or train.steps=<N>")
    if epochs is None:
        epochs = max(1, -(-int(cap) * global_batch_size // int(examples_per_epoch)))
        epochs = -(-epochs // int(interval)) * int(interval) if interval else epochs
    epochs = int(epochs)
    interval = int(interval) if interval else epochs
    if interval <= 0 or epochs % interval:
        raise UserError(f"eval_interval={interval} must divide epochs={epochs} (HRM evaluates every eval_interval "
                        "epochs and runs epochs / eval_interval such rounds)")
    total = int(epochs * examples_per_epoch / global_batch_size)
    sched = HRMSchedule(epochs, interval, epochs // interval, total, steps_per_iter, total)
    stop_at = sched.run_steps if sched.run_steps is not None else total
    for limit in (cap, train.get("stop_after")):
        if limit is not None:
            stop_at = min(stop_at, int(limit))
    sched.stop_at = stop_at
    return sched


def _optimizers(model, train: Dict[str, Any], world: int):
    """HRM's pair: AdamATan2 on the weights, SignSGD on the puzzle-embedding rows."""
    betas = (float(train.get("beta1", 0.9)), float(train.get("beta2", 0.95)))
    optimizer = AdamATan2(model.parameters(), lr=0.0, betas=betas, weight_decay=float(train.get("weight_decay", 0.1)))
    emb = model.model.puzzle_emb
    sparse = SparseEmbeddingSignSGD([emb], lr=0.0, weight_decay=float(train.get("puzzle_emb_weight_decay", 0.1)),
                                    world_size=world) if emb is not None else None
    return optimizer, sparse


def _checkpoint_dir(train: Dict[str, Any], run_dir: str) -> str:
    # HRM's checkpoint_path names the directory its step_<N> files go to.
    return str(train.get("checkpoint_path") or os.path.join(run_dir, "checkpoints"))


def _state(step: int, iteration: int, batch: int, sched: HRMSchedule) -> Dict[str, Any]:
    return {"step": step, "iteration": iteration, "batch": batch,
            "epoch": iteration * sched.epochs_per_iter, "total_steps": sched.total_steps}


def _resume_position(state: Dict[str, Any], sched: HRMSchedule) -> Tuple[int, int]:
    """(iteration, batch inside it) to continue from."""
    if "iteration" in state:
        return int(state["iteration"]), int(state.get("batch", 0))
    if sched.steps_per_iter:   # a checkpoint written before iterations were recorded
        return divmod(int(state["step"]), sched.steps_per_iter)
    raise UserError("the checkpoint records no iteration; resume it with the hrlplan version that wrote it")


class _Run:
    """One HRM training run's state and the pieces of its loop."""

    def __init__(self, cfg: Dict[str, Any], run_dir: str, logger):
        self.cfg, self.logger = cfg, logger
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.train, self.arch = dict(cfg["train"]), dict(cfg["arch"])
        self.gbs = int(self.train.get("global_batch_size") or 8)
        if self.gbs % self.world:
            raise UserError(f"global_batch_size={self.gbs} must be a multiple of the {self.world} data-parallel ranks")
        self.seed = int(self.train.get("seed", 0))
        self.device = _pick_device(str(self.train.get("device", "auto")))
        self.arch["forward_dtype"] = _forward_dtype(self.arch, self.device)
        self.train_split, self.test_split = _prepare_data(_data_path(cfg), self.rank, logger)
        meta = self.train_split.metadata
        self.sched = hrm_schedule(self.train, meta, self.gbs, None)
        self.sched = hrm_schedule(self.train, meta, self.gbs,
                                  self.train_split.steps_per_iteration(self.sched.epochs_per_iter, self.gbs))
        if self.sched.steps_per_iter == 0:
            raise UserError(f"global_batch_size={self.gbs} is more than the {self.train_split.num_groups} puzzles x "
                            f"eval_interval={self.sched.epochs_per_iter} epochs of one iteration: no full batch to "
                            "train on; lower global_batch_size or raise eval_interval")
        self.ckpt_dir = _checkpoint_dir(self.train, run_dir)
        self.every_eval = bool(self.train.get("checkpoint_every_eval", True))
        self.checkpoint_every = int(self.train.get("checkpoint_interval") or 0)
        self.grad_clip = float(self.train.get("grad_clip") or 0.0)   # None / 0: none (HRM clips nothing)
        self.lrs = (float(self.train.get("lr", 1e-4)), float(self.train.get("puzzle_emb_lr", 1e-2)))
        self.warmup = int(self.train.get("warmup_steps", 2000))
        self.min_ratio = float(self.train.get("min_lr_ratio", 1.0))
        self.last_ckpt: Optional[str] = None
        self.periodic: Optional[str] = None   # the latest interval checkpoint; replaced by the next one

    def build(self, resume_from: Optional[str]) -> Dict[str, Any]:
        meta = self.train_split.metadata
        torch.manual_seed(self.seed)   # identical initial weights on every rank
        with torch.device(self.device):
            model = build_hrm(self.arch, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
                              num_puzzle_identifiers=meta["num_puzzle_identifiers"])
        state = {"step": 0, "iteration": 0, "batch": 0}
        if resume_from:
            model.load_state_dict(torch.load(os.path.join(resume_from, "model.pt"), map_location=self.device,
                                             weights_only=True))
            with open(os.path.join(resume_from, "train_state.json")) as f:
                state = json.load(f)
        if self.device.type == "cuda":
            warning = check_hrm_fits(self.arch, self.gbs, torch.cuda.get_device_properties(self.device).total_memory,
                                     self.world, meta["seq_len"])
            if warning and self.rank == 0:
                _say(self.logger, f"warning: {warning}")
        self.model = _wrap(model, str(self.train.get("dp_mode", "fsdp")), self.device, self.world)
        self.compiled = maybe_compile(self.model, self.device)
        # a compiled model's ops never reach a dispatch mode: CUDA's allocator figure only, then
        self.meter = mem.MemoryMeter(self.device, lambda: ([self.model], [self.optimizer]),
                                     enabled=bool(self.train.get("measure_memory", True)) and not self.compiled)
        torch.manual_seed(self.seed + self.rank)   # ACT exploration differs per rank, as in HRM
        self.optimizer, self.sparse = _optimizers(self.model, self.train, self.world)
        if resume_from:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            saved = torch.load(os.path.join(resume_from, "optimizer.pt"), map_location="cpu", weights_only=True)
            set_optimizer_state_dict(self.model, self.optimizer, saved, options=StateDictOptions(full_state_dict=True))
        return state

    def announce(self, step: int, resume_from: Optional[str]) -> None:
        s = self.sched
        n_params = sum(p.numel() for p in self.model.parameters())
        runs = f"{s.run_steps} steps" if s.run_steps is not None else "steps drawn per iteration"
        parts = [f"HRM: {n_params:,} parameters", f"{self.world} rank(s) on {self.device}",
                 f"forward in {self.arch['forward_dtype']}{self._dtype_note()}", str(self.train.get("dp_mode", "fsdp")),
                 "AdamATan2", f"{s.iterations} x {s.epochs_per_iter} epochs: {runs} (schedule over {s.total_steps})"]
        if s.run_steps is None or s.stop_at < s.run_steps:
            parts.append(f"stopping at step {s.stop_at}")
        text = ", ".join(parts) + (" (compiled)" if self.compiled else "")
        _say(self.logger, text + (f", resumed from {resume_from}" if resume_from else ""))
        self.logger.log({"num_params": n_params}, step=step)

    def _dtype_note(self) -> str:
        asked = str(self.cfg["arch"].get("forward_dtype") or "auto")
        return f" (arch.forward_dtype={asked} on {self.device.type})" if asked != self.arch["forward_dtype"] else ""

    def step(self, carry, batch: Dict[str, torch.Tensor], step: int):
        """One optimizer step (step is the 1-based number of the step taken)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if carry is None:
            carry = self.model.initial_carry(batch)
        carry, loss, metrics, _, _ = self.model(carry, batch)
        # Losses are sums over sequences; wrappers average gradients over ranks, so dividing by the
        # local batch gives HRM's sum / global_batch_size.
        (loss / (self.gbs // self.world)).backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        lr = lr_at(step, self.lrs[0], self.warmup, self.sched.total_steps, self.min_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse is not None:
            self.sparse.param_groups[0]["lr"] = lr_at(step, self.lrs[1], self.warmup, self.sched.total_steps,
                                                      self.min_ratio)
            self.sparse.step()
            self.sparse.zero_grad()
        return carry, metrics, lr

    def log_memory(self, step: int) -> None:
        """Collective: every rank's measured peak (and split) beside the memory model's prediction."""
        per_rank = [m for m in _gather(self.meter.result())]
        if self.rank != 0 or not any(per_rank):
            return
        est = estimate_hrm_memory(self.arch, self.gbs, self.world, self.train_split.metadata["seq_len"],
                                  str(self.train.get("dp_mode", "fsdp")), cuda=self.device.type == "cuda")
        predicted = [est["tensors"]] * self.world
        self.logger.log(mem.memory_metrics(per_rank, predicted), step=step)
        kind = "cuda max_memory_allocated" if self.device.type == "cuda" else "live tensors"
        _say(self.logger, f"peak memory ({kind}): {mem.describe(mem.compare(per_rank, predicted))}")

    def train_metrics(self, metrics: Dict[str, torch.Tensor], lr: float, step: int) -> Dict[str, float]:
        keys = sorted(metrics)
        totals = _all_reduce_sum(torch.stack([metrics[k] for k in keys]).to(torch.float64)).cpu().tolist()
        values = dict(zip(keys, totals))
        count = max(values.pop("count"), 1.0)
        out = {f"train/{k}": v / (self.gbs if k.endswith("loss") else count) for k, v in values.items()}
        examples = self.train_split.metadata["total_groups"] * self.train_split.metadata.get("mean_puzzle_examples", 1)
        out.update({"train/lr": lr, "train/epoch": step * self.gbs / examples})
        return out

    def save(self, step: int, iteration: int, batch: int) -> str:
        self.last_ckpt = save_checkpoint(self.model, self.optimizer, _state(step, iteration, batch, self.sched),
                                         self.cfg, self.ckpt_dir)
        return self.last_ckpt

    def saved_at(self, step: int) -> bool:
        return self.last_ckpt is not None and self.last_ckpt.endswith(f"step_{step}")

    def periodic_checkpoint(self, step: int, iteration: int, batch: int) -> None:
        if not (self.checkpoint_every and step % self.checkpoint_every == 0):
            return
        self.save(step, iteration, batch)
        # Interval checkpoints are for resuming: keep the newest only (evaluation ones stay).
        if self.periodic and self.periodic != self.last_ckpt and self.rank == 0:
            shutil.rmtree(self.periodic, ignore_errors=True)
        self.periodic = self.last_ckpt

    def evaluate_and_checkpoint(self, step: int, iteration: int, batch: int, last: bool, result: Dict) -> None:
        eval_metrics = {f"eval/{k}": v for k, v in
                        evaluate(self.model, self.test_split, self.gbs, self.device, self.rank, self.world).items()}
        result.update(eval_metrics)
        if self.rank == 0:
            self.logger.log(eval_metrics, step=step)
            epoch = min(iteration, self.sched.iterations) * self.sched.epochs_per_iter
            _say(self.logger, f"step {step} (epoch {epoch}): "
                              f"eval exact_accuracy {eval_metrics.get('eval/exact_accuracy', float('nan')):.4f}")
        if (self.every_eval or last) and not self.saved_at(step):
            self.save(step, iteration, batch)
        if self.periodic == self.last_ckpt:
            self.periodic = None   # now an evaluation checkpoint: kept


def train_hrm(cfg: Dict[str, Any], run_dir: str, plan, logger) -> Dict[str, Any]:
    """Train HRM on cfg['data']['path']; returns the final metrics, step and checkpoint path."""
    if not dist.is_initialized():
        raise RuntimeError("train_hrm needs an initialised torch.distributed process group (gloo or nccl)")
    if plan is not None and getattr(plan, "pp", 1) != 1:
        raise UserError(f"HRM trains data parallel only; the plan has pp={plan.pp} (use a pp=1 plan)")
    run = _Run(cfg, run_dir, logger)
    resume_from = _resume_dir(run.train.get("resume"), run.ckpt_dir)
    state = run.build(resume_from)
    step = int(state["step"])
    iteration, first_batch = _resume_position(state, run.sched)
    if run.rank == 0:
        os.makedirs(run.ckpt_dir, exist_ok=True)
        _write_sources(run.ckpt_dir, cfg)
        run.announce(step, resume_from)
    sched, log_every = run.sched, max(1, int(run.train.get("log_interval") or 1))
    if run.rank == 0 and hasattr(run.logger, "set_total"):
        run.logger.set_total(sched.stop_at, initial=step)   # the shared progress bar, counted in HRM's steps
    measured_at = min(step + mem.MEASURED_STEPS, sched.stop_at)
    result: Dict[str, Any] = {}
    history: List[Dict[str, float]] = []
    first_step_at: Optional[float] = None
    carry, preempted = None, False
    started, start_step = time.time(), step
    run.model.train()
    while iteration < sched.iterations and step < sched.stop_at and not preempted:
        plan_ = run.train_split.iteration_plan(iteration, run.seed, sched.epochs_per_iter, run.gbs)
        batch_index = first_batch
        for batch in run.train_split.iteration_batches(plan_, run.rank, run.world, first_batch):
            if step >= sched.stop_at:
                break
            with run.meter.step():
                carry, metrics, lr = run.step(carry, batch, step + 1)
            step, batch_index = step + 1, batch_index + 1
            first_step_at = first_step_at or time.time()
            if step % log_every == 0 or step == sched.stop_at:
                train_metrics = run.train_metrics(metrics, lr, step)
                result.update(train_metrics)
                history = (history + [dict(train_metrics, step=step)])[-100:]
                if run.rank == 0:
                    run.logger.log(train_metrics, step=step)
            if step == measured_at:
                run.log_memory(step)
            run.periodic_checkpoint(step, iteration, batch_index)
            # Collective (preempt's contract): all ranks agree, checkpoint together and stop.
            if preempt.stop_agreed(run.device):
                preempted = True
                if not run.saved_at(step):
                    run.save(step, iteration, batch_index)
                break
        if preempted:
            break
        finished = batch_index >= len(plan_[0])
        position = (iteration + 1, 0) if finished else (iteration, batch_index)
        if finished or step >= sched.stop_at:
            last = step >= sched.stop_at or position[0] >= sched.iterations
            run.evaluate_and_checkpoint(step, *position, last=last, result=result)
        iteration, first_batch = position
    elapsed = time.time() - started
    result.update(step=step, final_step=step, total_steps=sched.total_steps, run_steps=sched.run_steps,
                  checkpoint=run.last_ckpt, history=history, first_step_at=first_step_at, preempted=preempted,
                  steps_per_second=(step - start_step) / elapsed if elapsed > 0 else 0.0)
    return result
