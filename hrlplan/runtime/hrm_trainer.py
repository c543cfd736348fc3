"""HRM training loop (arch=hrm): data parallel over every rank of the current process group.

The model is wrapped with FSDP2 `fully_shard` (train.dp_mode=fsdp) or composable `replicate`
(train.dp_mode=replicate) on a 1-D DeviceMesh. The puzzle-embedding table is a buffer outside
both wrappers; its touched rows are all-reduced by hand in SparseEmbeddingSignSGD. The weights
train with AdamATan2 (hrlplan/optim.py), as in HRM.

Counting follows HRM's pretrain.py: an epoch visits every puzzle group once; `eval_interval`
epochs form one iteration, batched together, whose one partial batch at the end is dropped (no
padded row ever trains); the model is evaluated after every iteration. The learning rate warms up
for train.warmup_steps and then follows a cosine down to min_lr_ratio * lr over HRM's
int(epochs * examples / global_batch_size) steps (train_core.warmup_cosine, HRM's counting).
train.steps sets the run's length only when epochs is not given; train.stop_after caps it either
way. ACT carries unfinished sequences across batches (and across a resume: the carry is saved).

This module is the HRM adapter of the training core (runtime/train_core.py), which runs the loop,
the LR schedules, preemption and the checkpoints (torch.distributed.checkpoint; runtime/hrm_io.py:
layout, evaluation, `hrlplan evaluate`). They go to train.checkpoint_path (HRM's checkpoint_path)
or <run_dir>/checkpoints, after every evaluation with train.checkpoint_every_eval (default) else
at the end, and every train.checkpoint_interval steps (the newest such one kept).
Peak memory is measured on the first steps (runtime/memory.py) and logged beside the memory
model's prediction (models.hrm.estimate_hrm_memory) as memory/peak_gib and memory/rank{r}/*.
"""
from __future__ import annotations

import inspect
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from hrlplan.config import HRM_RECIPE, Config, TrainConfig, as_dict, typed
from hrlplan.data.sudoku import PuzzleSplit, ensure_sudoku_dataset
from hrlplan.errors import UserError
from hrlplan.models.hrm import (ACTCarry, ACTLossHead, InnerCarry, build_hrm, check_hrm_fits, estimate_hrm_memory,
                                maybe_compile)
from hrlplan.models.sparse_embedding import SparseEmbeddingSignSGD
from hrlplan.optim import AdamATan2
from hrlplan.runtime import memory as mem
# re-exported: where callers found them before runtime/hrm_io.py
from hrlplan.runtime.hrm_io import (_all_reduce_sum, _forward_dtype, _write_sources,  # noqa: F401
                                   evaluate, evaluate_cli, find_checkpoint)
from hrlplan.runtime.train_core import (LRSchedule, TrainAdapter, TrainCore, nonfinite_check, pick_device,
                                        raise_if_nonfinite, train_config, warmup_cosine)

log = logging.getLogger("hrlplan.hrm")
# A config that leaves these train keys out (a script's dict, not the composed one, which has
# them all) takes HRM's values, not the language models' TrainConfig defaults.
HRM_FALLBACKS = {**HRM_RECIPE, "lr": 1e-4, "checkpoint_interval": 0}


# ---------------------------------------------------------------- setup
def hrm_config(cfg: Any) -> Config:
    """The run's typed config; train keys a partial plain config lacks take HRM_FALLBACKS."""
    if isinstance(cfg, Config):
        return cfg
    train = dict(cfg.get("train") or {})
    if train.get("epochs") is None and "steps" in train and train["steps"] is None:
        raise UserError("set epochs=<N> (passes over the training puzzles) or train.steps=<N>")
    for key, value in HRM_FALLBACKS.items():
        train.setdefault(key, value)
    train = {k: v for k, v in train.items() if not (k == "steps" and v is None)}
    return typed({**cfg, "train": train})


def _wrap(model: ACTLossHead, mode: str, device: torch.device, world: int) -> ACTLossHead:
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    if mode == "fsdp":
        # One unit for the whole model: HRM reuses every block many times per step, so per-block
        # units would all-gather each block once per cycle instead of once per step.
        fully_shard(model, mesh=mesh)
    elif mode == "replicate":
        # Buffers (puzzle table, initial states) stay identical by construction: no per-step
        # broadcast (the keyword was renamed in torch 2.12).
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        replicate(model, device_mesh=mesh, **{"forward_sync_buffers" if newer else "broadcast_buffers": False})
    else:
        raise UserError(f"train.dp_mode={mode!r}: HRM trains with fsdp or replicate")
    return model


# ---------------------------------------------------------------- training
DEFAULT_HRM_DATA = "data/sudoku-extreme-small"


def _data_path(cfg: Config) -> str:
    # Without data_path, the small Sudoku preset (built on first use) lets `arch=hrm` run as is.
    return str(cfg.data.path or cfg.data_path or DEFAULT_HRM_DATA)


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


def hrm_schedule(train: Any, metadata: Dict[str, Any], global_batch_size: int,
                 steps_per_iter: Optional[int]) -> HRMSchedule:
    """Epochs, eval_interval (in epochs) and the step caps train.steps / train.stop_after (train: a
    TrainConfig or the plain train mapping)."""
    train = train_config(train)
    examples_per_epoch = metadata["total_groups"] * metadata.get("mean_puzzle_examples", 1)
    epochs, interval = train.epochs, train.eval_interval
    # HRM counts in epochs (its users type epochs=500); train.steps only counts when no epochs are given.
    cap = None if epochs is not None else train.steps
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
    for limit in (cap, train.stop_after):
        if limit is not None:
            stop_at = min(stop_at, int(limit))
    sched.stop_at = stop_at
    return sched


def _optimizers(model, train: TrainConfig, world: int) -> Tuple[AdamATan2, Optional[SparseEmbeddingSignSGD]]:
    """HRM's pair: AdamATan2 on the weights, SignSGD on the puzzle-embedding rows (at their base lrs:
    the LR schedule scales them)."""
    optimizer = AdamATan2(model.parameters(), lr=float(train.lr), betas=(float(train.beta1), float(train.beta2)),
                          weight_decay=float(train.weight_decay))
    emb = model.model.puzzle_emb
    sparse = SparseEmbeddingSignSGD([emb], lr=float(train.puzzle_emb_lr), weight_decay=float(train.puzzle_emb_weight_decay),
                                    world_size=world) if emb is not None else None
    return optimizer, sparse


def _carry_state(carry: Optional[ACTCarry]) -> Dict[str, torch.Tensor]:
    """The ACT carry as plain tensors (a checkpoint's extra state loads with weights_only=True)."""
    if carry is None:
        return {}
    state = {"z_H": carry.inner_carry.z_H, "z_L": carry.inner_carry.z_L, "steps": carry.steps, "halted": carry.halted}
    state.update({f"data.{k}": v for k, v in carry.current_data.items()})
    return {k: v.detach().cpu() for k, v in state.items()}


def _carry_from(state: Dict[str, torch.Tensor], device: torch.device) -> Optional[ACTCarry]:
    if not state:
        return None
    t = {k: v.to(device) for k, v in state.items()}
    return ACTCarry(InnerCarry(t["z_H"], t["z_L"]), steps=t["steps"], halted=t["halted"],
                    current_data={k[len("data."):]: v for k, v in t.items() if k.startswith("data.")})


class HRMTrainer(TrainAdapter):
    """The HRM adapter of the training core: the model with its ACT loss head and carry, AdamATan2
    plus the puzzle-embedding SignSGD, HRM's iterations of epochs and the evaluation after each."""

    history_limit = 100
    keep_last = None   # evaluation checkpoints all stay; interval ones replace each other (checkpoint_written)

    def __init__(self, cfg: Config, run_dir: str, logger):
        self.cfg, self.logger = hrm_config(cfg), logger
        self.train = t = self.cfg.train
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gbs = int(t.global_batch_size or 8)
        if self.gbs % self.world:
            raise UserError(f"global_batch_size={self.gbs} must be a multiple of the {self.world} data-parallel ranks")
        self.seed = int(t.seed)
        self.device = pick_device(str(t.device))
        self.arch = dict(self.cfg.arch)
        self.arch["forward_dtype"] = _forward_dtype(self.arch, self.device)
        self.train_split, self.test_split = _prepare_data(_data_path(self.cfg), self.rank, logger)
        meta = self.train_split.metadata
        sched = hrm_schedule(t, meta, self.gbs, None)
        self.sched = hrm_schedule(t, meta, self.gbs, self.train_split.steps_per_iteration(sched.epochs_per_iter, self.gbs))
        if self.sched.steps_per_iter == 0:
            raise UserError(f"global_batch_size={self.gbs} is more than the {self.train_split.num_groups} puzzles x "
                            f"eval_interval={self.sched.epochs_per_iter} epochs of one iteration: no full batch to "
                            "train on; lower global_batch_size or raise eval_interval")
        # HRM's checkpoint_path names the directory its step checkpoints go to.
        self.checkpoint_root = Path(t.checkpoint_path or os.path.join(run_dir, "checkpoints"))
        self.checkpoint_interval = int(t.checkpoint_interval or 0)
        self.log_interval = max(1, int(t.log_interval or 1))
        self.stop_at = self.sched.stop_at
        self.grad_clip = float(t.grad_clip or 0.0)   # None / 0: none (HRM clips nothing)
        self.iteration, self.batch_index, self.iteration_len = 0, 0, 0
        self.carry: Optional[ACTCarry] = None
        self.periodic: Optional[Path] = None   # the latest interval checkpoint; replaced by the next one
        self._build()

    def _build(self) -> None:
        meta = self.train_split.metadata
        torch.manual_seed(self.seed)   # identical initial weights on every rank
        with torch.device(self.device):
            model = build_hrm(self.arch, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
                              num_puzzle_identifiers=meta["num_puzzle_identifiers"])
        if self.device.type == "cuda":
            warning = check_hrm_fits(self.arch, self.gbs, torch.cuda.get_device_properties(self.device).total_memory,
                                     self.world, meta["seq_len"])
            if warning and self.rank == 0:
                _say(self.logger, f"warning: {warning}")
        self.model = _wrap(model, str(self.train.dp_mode), self.device, self.world)
        self.compiled = maybe_compile(self.model, self.device)
        # a compiled model's ops never reach a dispatch mode: CUDA's allocator figure only, then
        self.meter = mem.MemoryMeter(self.device, lambda: ([self.model], [self.optimizer]),
                                     enabled=bool(self.train.measure_memory) and not self.compiled)
        torch.manual_seed(self.seed + self.rank)   # ACT exploration differs per rank, as in HRM
        self.optimizer, self.sparse = _optimizers(self.model, self.train, self.world)
        self.parts, self.optimizers = {0: self.model}, {0: self.optimizer}
        lr_optimizers = {"weights": self.optimizer, **({"puzzle_emb": self.sparse} if self.sparse is not None else {})}
        self.lr = LRSchedule(lr_optimizers, warmup_cosine(self.train.warmup_steps, self.sched.total_steps,
                                                          self.train.min_lr_ratio, hrm_counting=True))

    # ------------------------------------------------------------ position and checkpoints
    def resume_setting(self) -> str:
        return str(self.train.resume)

    def position(self) -> Dict[str, Any]:
        return {"iteration": self.iteration, "batch": self.batch_index,
                "epoch": self.iteration * self.sched.epochs_per_iter, "total_steps": self.sched.total_steps}

    def restore(self, extra: Dict[str, Any]) -> None:
        position = extra.get("position") or {}
        if "iteration" not in position:
            raise UserError("the checkpoint records no HRM iteration (written by another trainer); "
                            "start fresh with train.resume=none")
        self.iteration, self.batch_index = int(position["iteration"]), int(position.get("batch", 0))
        # the ACT carry continues when every rank reads its own (the same data-parallel world)
        if extra.get("world") == self.world:
            self.carry = _carry_from((extra.get("adapter") or {}).get("carry") or {}, self.device)

    def extra_state(self) -> Dict[str, Any]:
        return {"carry": _carry_state(self.carry)}

    def checkpoint_files(self, directory: Path) -> None:
        _write_sources(directory, as_dict(self.cfg))

    def checkpoint_written(self, path: Path, step: int, periodic: bool) -> None:
        if not periodic:
            return
        # Interval checkpoints are for resuming: keep the newest only (evaluation ones stay).
        if self.periodic is not None and self.periodic != path and self.rank == 0:
            shutil.rmtree(self.periodic, ignore_errors=True)
        self.periodic = path

    # ------------------------------------------------------------ the loop's hooks
    def start(self, step: int, resumed_from: Optional[Path]) -> None:
        self.measured_at = min(step + mem.MEASURED_STEPS, self.stop_at)
        self.logged_at = (time.perf_counter(), step)   # step time: the mean over the steps between logs
        if self.rank == 0:
            os.makedirs(self.checkpoint_root, exist_ok=True)
            _write_sources(self.checkpoint_root, as_dict(self.cfg))
            self.announce(step, resumed_from)
        self.model.train()

    def batches(self, step: int) -> Iterator[Dict[str, torch.Tensor]]:
        """Every iteration's batches from the resume position on; an iteration resumed after its
        last batch (a preemption came there) is evaluated first."""
        while self.iteration < self.sched.iterations:
            plan = self.train_split.iteration_plan(self.iteration, self.seed, self.sched.epochs_per_iter, self.gbs)
            self.iteration_len = len(plan[0])
            if self.batch_index >= self.iteration_len:
                self.core.log(self.boundary(self.core.step, stopping=False))
                continue
            iteration = self.iteration
            yield from self.train_split.iteration_batches(plan, self.rank, self.world, self.batch_index)
            if self.iteration == iteration:   # not moved on by boundary(): nothing more to train
                return

    def train_step(self, batch: Dict[str, torch.Tensor], step: int) -> Dict[str, Any]:
        """One optimizer step (`step` steps were taken before it)."""
        with self.meter.step():
            batch = {k: v.to(self.device) for k, v in batch.items()}
            if self.carry is None:
                self.carry = self.model.initial_carry(batch)
            self.carry, loss, metrics, _, _ = self.model(self.carry, batch)
            # Losses are sums over sequences; wrappers average gradients over ranks, so dividing by the
            # local batch gives HRM's sum / global_batch_size.
            (loss / (self.gbs // self.world)).backward()
            grad_norm = None
            if self.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            # collective, before the update: a NaN/inf loss or gradient stops the run with the weights intact
            loss_sum, bad_grad = nonfinite_check(loss, grad_norm)
            raise_if_nonfinite(loss_sum / self.gbs, bad_grad, grad_norm)
            lr = self.lr.lr("weights")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.sparse is not None:
                self.sparse.step()
                self.sparse.zero_grad()
        self.batch_index += 1
        return {"metrics": metrics, "lr": lr}

    def step_metrics(self, step: int, out: Dict[str, Any], logging_now: bool) -> Dict[str, float]:
        if not logging_now:
            return {}
        metrics = out["metrics"]
        keys = sorted(metrics)
        totals = _all_reduce_sum(torch.stack([metrics[k] for k in keys]).to(torch.float64)).cpu().tolist()
        values = dict(zip(keys, totals))
        count = max(values.pop("count"), 1.0)
        result = {f"train/{k}": v / (self.gbs if k.endswith("loss") else count) for k, v in values.items()}
        examples = self.train_split.metadata["total_groups"] * self.train_split.metadata.get("mean_puzzle_examples", 1)
        result.update({"train/lr": out["lr"], "train/epoch": step * self.gbs / examples})
        # after the all-reduce above, which waits for the device: no extra synchronisation per step
        now, (then, last) = time.perf_counter(), self.logged_at
        if step > last:
            step_s = (now - then) / (step - last)
            result.update({"train/step_time_s": step_s,
                           "train/tokens_per_s": self.gbs * self.train_split.metadata["seq_len"] / step_s})
        self.logged_at = (now, step)
        return result

    def after_step(self, step: int) -> None:
        if step == self.measured_at:
            self.log_memory(step)

    def boundary(self, step: int, stopping: bool) -> Dict[str, float]:
        """At an iteration's end (or the run's): evaluation, and its checkpoint."""
        finished = self.batch_index >= self.iteration_len
        if not (finished or stopping):
            return {}
        if finished:
            self.iteration, self.batch_index = self.iteration + 1, 0
        last = stopping or self.iteration >= self.sched.iterations
        metrics = {f"eval/{k}": v for k, v in
                   evaluate(self.model, self.test_split, self.gbs, self.device, self.rank, self.world).items()}
        if self.rank == 0:
            epoch = min(self.iteration, self.sched.iterations) * self.sched.epochs_per_iter
            _say(self.logger, f"step {step} (epoch {epoch}): "
                              f"eval exact_accuracy {metrics.get('eval/exact_accuracy', float('nan')):.4f}")
        if self.train.checkpoint_every_eval or last:
            self.core.save_once()
        self.logged_at = (time.perf_counter(), step)   # evaluation and its checkpoint are no training step
        if self.periodic == self.core.last_checkpoint:
            self.periodic = None   # now an evaluation checkpoint: kept
        return metrics

    def finish(self, summary: Dict[str, Any], step_times: List[float]) -> Dict[str, Any]:
        step = summary["final_step"]
        return {**summary.pop("latest"), **summary, "step": step, "total_steps": self.sched.total_steps,
                "run_steps": self.sched.run_steps}

    # ------------------------------------------------------------ reports
    def announce(self, step: int, resume_from: Optional[Path]) -> None:
        s = self.sched
        n_params = sum(p.numel() for p in self.model.parameters())
        runs = f"{s.run_steps} steps" if s.run_steps is not None else "steps drawn per iteration"
        parts = [f"HRM: {n_params:,} parameters", f"{self.world} rank(s) on {self.device}",
                 f"forward in {self.arch['forward_dtype']}{self._dtype_note()}", str(self.train.dp_mode),
                 "AdamATan2", f"{s.iterations} x {s.epochs_per_iter} epochs: {runs} (schedule over {s.total_steps})"]
        if s.run_steps is None or s.stop_at < s.run_steps:
            parts.append(f"stopping at step {s.stop_at}")
        text = ", ".join(parts) + (" (compiled)" if self.compiled else "")
        _say(self.logger, text + (f", resumed from {resume_from}" if resume_from else ""))
        self.logger.log({"num_params": n_params}, step=step)

    def _dtype_note(self) -> str:
        asked = str(self.cfg.arch.get("forward_dtype") or "auto")
        return f" (arch.forward_dtype={asked} on {self.device.type})" if asked != self.arch["forward_dtype"] else ""

    def log_memory(self, step: int) -> None:
        """Collective: every rank's measured peak (and split) beside the memory model's prediction."""
        per_rank = [m for m in _gather(self.meter.result())]
        if self.rank != 0 or not any(per_rank):
            return
        est = estimate_hrm_memory(self.arch, self.gbs, self.world, self.train_split.metadata["seq_len"],
                                  str(self.train.dp_mode), cuda=self.device.type == "cuda")
        predicted = [est["tensors"]] * self.world
        self.logger.log(mem.memory_metrics(per_rank, predicted), step=step)
        kind = "cuda max_memory_allocated" if self.device.type == "cuda" else "live tensors"
        _say(self.logger, f"peak memory ({kind}): {mem.describe(mem.compare(per_rank, predicted))}")


def train_hrm(cfg: Config, run_dir: str, plan, logger) -> Dict[str, Any]:
    """Train HRM on cfg.data.path (cfg: the run's Config, or compose()'s plain dict); returns the final metrics,
    step and checkpoint path."""
    if not dist.is_initialized():
        raise RuntimeError("train_hrm needs an initialised torch.distributed process group (gloo or nccl)")
    if plan is not None and getattr(plan, "pp", 1) != 1:
        raise UserError(f"HRM trains data parallel only; the plan has pp={plan.pp} (use a pp=1 plan)")
    return TrainCore(HRMTrainer(cfg, run_dir, logger), logger).fit()
