"""Pipeline-parallel training of an HF causal LM from a Plan.

Every rank builds only its stage(s), wraps them in torch.distributed.pipelining PipelineStages on
the pp sub-mesh, shards them over dp with FSDP2 (or replicate), and runs the plan's schedule.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble)

from hrlplan.data.lm import build_lm_data
from hrlplan.models.hf import build_hf_model, build_stage_modules, causal_lm_loss, hf_config_from_arch
from hrlplan.plan import Plan
from hrlplan.runtime import checkpoint as ckpt
from hrlplan.runtime.parallel import TiedEmbeddingSync, apply_data_parallel, build_mesh, clip_grad_norm, rank_coords


def lr_lambda(train: Dict[str, Any], total_steps: int):
    warmup, min_ratio = int(train["warmup_steps"]), float(train["min_lr_ratio"])

    def factor(step: int) -> float:  # step counts from 0 (the first update)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def make_optimizer(module: torch.nn.Module, train: Dict[str, Any]) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (incl. embeddings), none on biases and norms (nanoGPT's rule)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": float(train["weight_decay"])},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=float(train["lr"]), betas=(float(train["beta1"]), float(train["beta2"])),
                             foreach=False)


def pick_device(setting: str, local_rank: int) -> torch.device:
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def build_full_model(arch: Dict[str, Any], seed: int):
    """The whole model, initialised from the seed alone, so every layout starts from the same weights."""
    torch.manual_seed(seed)
    config = hf_config_from_arch(arch)
    return build_hf_model(config, pretrained_from=arch.get("model_id") if arch.get("pretrained") else None)


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def build_schedule(plan: Plan, stages: List[PipelineStage], loss_fn):
    if plan.schedule == "zero_bubble":
        cls = ScheduleZBVZeroBubble if plan.stages_per_rank == 2 else ScheduleInterleavedZeroBubble
        return cls(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
    if plan.stages_per_rank > 1 or plan.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
    return SCHEDULES[plan.schedule](stages[0], n_microbatches=plan.num_microbatches, loss_fn=loss_fn)


class PipelineTrainer:
    def __init__(self, plan: Plan, cfg: Dict[str, Any], run_dir: str, logger=None, device: Optional[torch.device] = None):
        self.plan, self.cfg, self.logger = plan, cfg, logger
        self.train = cfg["train"]
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.device = device or torch.device("cpu")
        self.coords = rank_coords(plan, self.rank)
        self.mesh = build_mesh(plan, self.device.type)
        self.pp_group = self.mesh["pp"].get_group()
        self.stage_ids = plan.stages_of_rank(self.rank)

        full = build_full_model(cfg["arch"], int(self.train["seed"]))
        self.tied = bool(getattr(full.config, "tie_word_embeddings", False))
        all_parts = build_stage_modules(full, [tuple(s.layers) for s in plan.stages])
        self.tie_sync = TiedEmbeddingSync(plan, self.rank, self.tied)
        self.parts: Dict[int, torch.nn.Module] = {}
        mp_dtype = torch.bfloat16 if self.train["dtype"] == "bfloat16" else None
        for i in self.stage_ids:
            part = all_parts[i].to(self.device)
            blocks = getattr(part.base, part.blocks_attr)
            self.parts[i] = apply_data_parallel(part, self.mesh["dp"], self.train["dp_mode"], blocks, mp_dtype)
        del full, all_parts
        self.tie_sync.bind(self.parts, plan)
        self.stages = [PipelineStage(self.parts[i], i, plan.num_stages, self.device, group=self.pp_group)
                       for i in self.stage_ids]
        self.schedule = build_schedule(plan, self.stages, causal_lm_loss)
        self.optimizers = {i: make_optimizer(p, self.train) for i, p in self.parts.items()}
        total = int(self.train["steps"])
        self.schedulers = {i: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(self.train, total))
                           for i, o in self.optimizers.items()}
        vocab = full_vocab(cfg["arch"])
        self.data = build_lm_data(cfg["data"], vocab, int(self.train["seed"]))
        self.has_first = 0 in self.parts
        self.has_last = (plan.num_stages - 1) in self.parts
        self.step = 0
        self.ckpt_root = self.run_dir / "checkpoints"

    # ------------------------------------------------------------ state
    def maybe_resume(self) -> None:
        path = ckpt.resolve_resume(str(self.train.get("resume", "none")), self.ckpt_root)
        if path is None:
            return
        extra = ckpt.load_checkpoint(path, self.parts, self.optimizers)
        for i, sched in self.schedulers.items():
            sched.load_state_dict(extra["schedulers"][f"stage{i}"])
        self.step = int(extra["step"])
        if self.rank == 0:
            print(f"[hrlplan] resumed from {path} at step {self.step}", flush=True)

    def save(self) -> Path:
        extra = {"schedulers": {f"stage{i}": s.state_dict() for i, s in self.schedulers.items()},
                 "data_position": self.step}
        return ckpt.save_checkpoint(self.ckpt_root, self.step, self.parts, self.optimizers, extra)

    # ------------------------------------------------------------ one step
    def local_batch(self, step: int):
        inputs, targets = self.data.batch(step, int(self.plan.global_batch_size))
        rows = self.plan.global_batch_size // self.plan.dp
        d = self.coords["dp"]
        sl = slice(d * rows, (d + 1) * rows)
        return inputs[sl].to(self.device), targets[sl].to(self.device)

    def train_step(self, step: int) -> Dict[str, float]:
        inputs, targets = self.local_batch(step)
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        losses: List[torch.Tensor] = []
        t0 = time.perf_counter()
        if self.has_first:
            self.schedule.step(inputs, target=targets, losses=losses)
        else:
            self.schedule.step(target=targets, losses=losses)
        self.tie_sync.sync_grads()
        params = [p for part in self.parts.values() for p in part.parameters()]
        skip = [p for p in params if self.tie_sync.is_duplicate(p, self.parts, self.plan)]
        grad_norm = clip_grad_norm(params, float(self.train["grad_clip"]), self.pp_group, skip)
        for opt in self.optimizers.values():
            opt.step()
        lr = next(iter(self.schedulers.values())).get_last_lr()[0]
        for sched in self.schedulers.values():
            sched.step()
        # The loss lives on the last stage: average over its dp replicas and bring it to every rank.
        loss = torch.zeros(1, device=self.device)
        if self.has_last and self.coords["tp"] == 0:
            loss[0] = torch.stack([l.detach().float() for l in losses]).mean() / self.plan.dp
        dist.all_reduce(loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        return {"loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm), "step_time_s": dt}

    def fit(self) -> Dict[str, Any]:
        self.maybe_resume()
        total = int(self.train["steps"])
        stop_after = self.train.get("stop_after")
        interval = int(self.train["checkpoint_interval"])
        seq = int(self.cfg["data"]["seq_len"])
        flops_per_token = self.cfg.get("_flops_per_token")
        peak = self.cfg.get("_peak_flops")
        history = []
        first_step_at = None
        while self.step < total:
            out = self.train_step(self.step)
            self.step += 1
            first_step_at = first_step_at or time.time()
            tokens_per_s = self.plan.global_batch_size * seq / out["step_time_s"]
            metrics = {"train/lm_loss": out["loss"], "train/lr": out["lr"], "train/grad_norm": out["grad_norm"],
                       "train/step_time_s": out["step_time_s"], "train/tokens_per_s": tokens_per_s}
            if flops_per_token and peak:
                metrics["train/mfu"] = flops_per_token * tokens_per_s / peak
            history.append({"step": self.step, **metrics})
            if self.logger is not None and self.step % int(self.train["log_interval"]) == 0:
                self.logger.log(metrics, step=self.step)
            stopping = stop_after is not None and self.step >= int(stop_after)
            if (interval and self.step % interval == 0) or self.step == total or stopping:
                self.save()
            if stopping:
                break
        return {"final_step": self.step, "history": history, "first_step_at": first_step_at}


def full_vocab(arch: Dict[str, Any]) -> int:
    return int(hf_config_from_arch(arch).vocab_size)
