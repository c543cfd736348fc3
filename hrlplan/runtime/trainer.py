"""Pipeline-parallel training of an HF causal LM from a Plan.

Every rank builds only its stage(s) and runs the plan's schedule on one of two engines:
- torch_engine.py: a homogeneous plan (identical replicas, one tp degree) on torch.distributed.pipelining,
  with FSDP2/replicate over dp and DTensor tp: every torch schedule (gpipe, 1f1b, interleaved, zero-bubble);
- hetero.py: heterogeneous replicas and stages of unequal tp on hrlplan's own p2p executor (gpipe, 1f1b).
Both record a per-micro-batch timeline, from which the trainer reports per-stage compute/idle time
and, at the end, writes plan-vs-measured into plan_info.json.

PipelineTrainer is the language-model adapter of the training core (runtime/train_core.py), which
runs the step loop, the LR schedule, checkpoints, preemption and the metrics' logging.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from hrlplan import devices
from hrlplan.cluster import ClusterSpec
from hrlplan.config import Config, as_config
from hrlplan.cost.memory import packed_meta
from hrlplan.cost.plans import options_for_train, plan_memory
from hrlplan.data.lm import build_lm_data
from hrlplan.errors import UserError
from hrlplan.cost.lengths import document_coefficients
from hrlplan.model_meta import ModelMeta
from hrlplan.models.hf import build_hf_model, hf_config_from_arch, materialize
from hrlplan.plan import Plan
from hrlplan.runtime import distributed, timing
from hrlplan.runtime.checkpoint import find_resume
from hrlplan.runtime.compile import eager_while
from hrlplan.runtime import memory as mem
from hrlplan.runtime.memory import MemoryMeter
from hrlplan.runtime.mfu import mfu
from hrlplan.runtime.hetero import HeteroPipelineEngine
from hrlplan.runtime.torch_engine import TorchPipelineEngine
from hrlplan.runtime.train_core import (LRSchedule, TrainAdapter, TrainCore, nonfinite_check, raise_if_nonfinite,
                                        train_config, warmup_cosine)


def lr_lambda(train: Any, total_steps: int):
    """The language models' lr factor per update (train_core.warmup_cosine)."""
    t = train_config(train)
    return warmup_cosine(t.warmup_steps, total_steps, t.min_lr_ratio)


def grad_clip(train: Any) -> float:
    """train.grad_clip as a float; null or 0 means no clipping (0.0: the engines then only measure the norm)."""
    value = train_config(train).grad_clip
    return float(value) if value else 0.0


def make_optimizer(module: torch.nn.Module, train: Any, owned: Optional[set] = None) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (incl. embeddings), none on biases and norms (nanoGPT's rule).

    `train`: a TrainConfig or the plain train mapping. `owned` (ids of parameters another
    optimizer of this rank already steps) is skipped and extended: a tied embedding whose first
    and last stage sit on one rank (ZBV's V shape) is one Parameter in two stage modules and must
    be updated once.
    """
    t = train_config(train)
    owned = set() if owned is None else owned
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in owned]
    owned.update(id(p) for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": float(t.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    device = params[0].device if params else torch.device("cpu")
    sharded = any(hasattr(p, "placements") for p in params)
    return torch.optim.AdamW(groups, lr=float(t.lr), betas=(float(t.beta1), float(t.beta2)),
                             **devices.optimizer_impl(device, dtensor=sharded))


def build_full_model(arch: Dict[str, Any], seed: int, materialized: bool = True):
    """The whole model, its weights a function of the seed and each module's name alone (see
    models.hf.materialize), so every layout starts from the same weights. materialized=False: on the
    meta device, for an engine to materialize only its own stages."""
    torch.manual_seed(seed)
    config = hf_config_from_arch(arch)
    pretrained = arch.get("model_id") if arch.get("pretrained") else None
    model = build_hf_model(config, pretrained_from=pretrained, on_meta=not pretrained)
    if materialized:
        materialize(model, model.modules(), seed)
    return model


def runs_on_torch_schedules(plan: Plan) -> bool:
    """torch.distributed.pipelining needs identical replicas and one tp degree on every stage."""
    return not plan.heterogeneous and plan.uniform_tp


def refuse_on_hetero_engine(train: Any) -> None:
    """hrlplan's own executor (heterogeneous replicas, unequal tp) compiles nothing, converts
    nothing and shards no sequence: asking it to would be ignored, so it is refused."""
    t = train_config(train)
    asked = [k for k, on in (("train.compile", t.compile), ("train.float8", t.float8),
                             ("train.context_parallel", t.context_parallel > 1)) if on]
    if asked:
        raise UserError(f"{asked[0]}: runs on torch's pipeline schedules only (identical replicas, one tp degree), "
                        f"and this plan runs on hrlplan's heterogeneous executor; set {asked[0]}="
                        f"{'1' if asked[0].endswith('parallel') else 'false'} or use a homogeneous plan")


class MFUBasis(NamedTuple):
    """Model FLOPs utilization's figures, from the job: training FLOPs per token (model_meta) and the
    summed peak FLOP/s of the ranks that train (runtime/mfu.job_peak_flops)."""
    flops_per_token: float
    peak_flops: float


def _packing_coefficients(data, run_dir: Path):
    """A document's cost (linear, quadratic) from the job's model_meta.json, for data.packing=balanced's
    step-aware dispatch (cost/lengths.document_coefficients); None for other packings or where the run
    has no record."""
    path = Path(run_dir) / "model_meta.json"
    if str(getattr(data.packing, "value", data.packing)) != "balanced" or not path.exists():
        return None
    return document_coefficients(ModelMeta.load(path))


class PipelineTrainer(TrainAdapter):
    """The language-model adapter of the training core (runtime/train_core.py): a Plan's stages on
    this rank, their optimizers, the LM data stream, one pipelined step, evaluation and the
    plan-vs-measured report. `fit()` runs it on the core."""

    def __init__(self, plan: Plan, cfg: Config, run_dir: str, logger=None, device: Optional[torch.device] = None,
                 mfu_basis: Optional[MFUBasis] = None):
        """cfg: the run's Config (or compose()'s plain dict); mfu_basis: train/mfu is logged when given."""
        self.plan, self.logger, self.mfu_basis = plan, logger, mfu_basis
        self.cfg = as_config(cfg)
        self.train = self.cfg.train
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.device = device or torch.device("cpu")
        if self.device.type == "cuda":   # fp32 matmuls on TF32 unless train.tf32=false / HRLPLAN_TF32=0
            devices.set_tf32(devices.tf32_setting(self.train))
        self.recorder = timing.StepRecorder(self.device)
        # before the engine: a packing the plan cannot run is refused before any stage is built
        self.data = build_lm_data(self.cfg.data, full_vocab(self.cfg.arch), int(self.train.seed), plan=plan,
                                  train=self.train, coefficients=_packing_coefficients(self.cfg.data, self.run_dir))
        full = build_full_model(self.cfg.arch, int(self.train.seed), materialized=False)
        Engine = TorchPipelineEngine if runs_on_torch_schedules(plan) else HeteroPipelineEngine
        if Engine is HeteroPipelineEngine:
            refuse_on_hetero_engine(self.train)
        self.engine = Engine(plan, self.train, self.device, full, self.recorder)
        self.checkpoint_writes = getattr(self.engine, "checkpoint_writes", None)
        del full
        self.parts: Dict[int, torch.nn.Module] = self.engine.parts
        if not self.parts:   # nothing to train: the LR schedule, optimizer and step would have no stage
            raise UserError(f"rank {self.rank} holds no stage of the plan (unused_ranks {plan.unused_ranks}): ranks a "
                            "plan leaves idle leave the job before training (hrlplan.launch.ranks.leave_idle_ranks)")
        self.checkpoint_root = self.run_dir / "checkpoints"
        refusal = getattr(self.engine, "resume_refusal", "")
        if refusal and find_resume(str(self.train.resume), self.checkpoint_root)[0] is not None:
            raise UserError(f"train.resume={self.train.resume}: {refusal}; start fresh with train.resume=none")
        # heterogeneous replicas whose plan shards the optimizer across them (runtime/hetero_zero.py);
        # such a rank holds one stage, so one optimizer object is never stepped twice
        make_sharded = getattr(self.engine, "make_optimizer", None)
        sharded = make_sharded(self.train) if make_sharded is not None else None
        owned: set = set()
        self.optimizers = ({i: sharded for i in self.parts} if sharded is not None else
                           {i: make_optimizer(p, self.train, owned) for i, p in self.parts.items()})
        self.lr = LRSchedule({f"stage{i}": o for i, o in self.optimizers.items()},
                             lr_lambda(self.train, int(self.train.steps)))
        self.phase_times: List[Dict[str, float]] = []
        stop_after = self.train.stop_after
        self.stop_at = min(int(self.train.steps), int(stop_after)) if stop_after is not None else int(self.train.steps)
        self.log_interval = int(self.train.log_interval)
        self.checkpoint_interval = int(self.train.checkpoint_interval or 0)
        # peak memory and its split: the live-tensor tracker runs on the first steps only (see runtime/memory.py)
        self.meter = MemoryMeter(self.device, lambda: (list(self.parts.values()), list(self.optimizers.values())),
                                 enabled=bool(self.train.measure_memory))
        self._memory_prediction: Optional[List[Dict[str, float]]] = None

    def fit(self) -> Dict[str, Any]:
        return TrainCore(self, self.logger).fit()

    def start(self, step: int, resumed_from: Optional[Path]) -> None:
        # peaks from here on: the probe's and calibration's buffers are freed and not counted
        timing.reset_peak_memory(self.device)

    def _predicted_memory(self) -> Optional[List[float]]:
        """Rank 0: the predicted tensor bytes per rank (computed once); None elsewhere or unknown."""
        if self._memory_prediction is None:
            self._memory_prediction = predicted_memory(self.plan, self.cfg, self.run_dir) if self.rank == 0 else []
        return [row["tensors"] for row in self._memory_prediction] or None

    # ------------------------------------------------------------ the core's hooks
    def resume_setting(self) -> str:
        return str(self.train.resume)

    def position(self) -> Dict[str, Any]:
        return {"data_position": self.core.step}   # the LM stream is a function of the step

    def batches(self, step: int) -> Iterator[int]:
        return iter(range(step, int(self.train.steps)))

    def train_step(self, batch: int, step: int) -> Dict[str, float]:
        inputs, targets = self.local_batch(batch)   # the stream's batch `step`
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        dist.barrier()   # a common start, so every rank's timeline shares one origin
        self.recorder.begin()
        t0 = time.perf_counter()
        metered = self.meter.step()
        with metered, eager_while(bool(self.train.compile) and isinstance(metered, mem.LiveStorageTracker)):
            loss = self.engine.forward_backward(inputs, targets)
            t1 = self._now()
            grad_norm = self.engine.sync_and_clip(grad_clip(self.train))
            t2 = self._now()
            # each rank holds its share of the global loss (zero off the last stage): summed, and
            # checked with the gradient norm before the update (a NaN/inf stops here, weights intact)
            loss_value, bad_grad = nonfinite_check(loss, grad_norm)
            t3 = self._now()
            raise_if_nonfinite(loss_value, bad_grad, grad_norm)
            for opt in self.optimizers.values():
                opt.step()
        lr = self.lr.lr()
        dt = self._now() - t0
        # where this rank's step went, beside the simulator's breakdown (plan_info.json "phases_s")
        self.phase_times.append({"schedule": t1 - t0, "sync_and_clip": t2 - t1, "loss_allreduce": t3 - t2,
                                 "optimizer": t0 + dt - t3})
        return {"loss": loss_value, "lr": lr, "grad_norm": float(grad_norm), "step_time_s": dt}

    def step_metrics(self, step: int, out: Dict[str, float], logging_now: bool) -> Dict[str, float]:
        seq = int(self.cfg.data.seq_len)
        tokens_per_s = self.plan.global_batch_size * seq / out["step_time_s"]
        metrics = {"train/lm_loss": out["loss"], "train/lr": out["lr"], "train/grad_norm": out["grad_norm"],
                   "train/step_time_s": out["step_time_s"], "train/tokens_per_s": tokens_per_s}
        useful = getattr(self.data, "last_useful_tokens", None)   # packed documents: padding left out
        if useful is not None:
            metrics["train/useful_tokens_per_s"] = useful / out["step_time_s"]
        utilization = mfu(self.mfu_basis.flops_per_token, tokens_per_s, self.mfu_basis.peak_flops) \
            if self.mfu_basis else None
        if utilization is not None:
            metrics["train/mfu"] = utilization
        if logging_now:
            gathered = self._gather({"compute": self.recorder.compute_by_stage(),
                                     "memory": {**timing.memory_stats(self.device), **self.meter.result()}})
            for i, st in timing.stage_stats(gathered, out["step_time_s"]).items():
                metrics[f"stage/{i}/compute_s"] = st["compute_s"]
                metrics[f"stage/{i}/idle_s"] = st["idle_s"]
            metrics.update(memory_metrics([g["memory"] for g in gathered], self._predicted_memory()))
        eval_every = self.train.eval_interval
        if (eval_every and step % int(eval_every) == 0) or step == int(self.train.steps):
            # after the stage statistics: evaluation's forwards must not count as training
            metrics.update(self.evaluate())
        return metrics

    def profiler(self):
        """train.profile=true: a torch.profiler trace per rank (TensorBoard / chrome://tracing)."""
        if not self.train.profile:
            return nullcontext(None)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        return profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(str(self.run_dir / "profile"),
                                                                worker_name=f"rank{self.rank}"),
                       record_shapes=False)

    def finish(self, summary: Dict[str, Any], step_times: List[float]) -> Dict[str, Any]:
        measured = self.report_plan_vs_measured(step_times)
        if self.train.profile and self.logger is not None:
            self.logger.note(f"profiler traces: {self.run_dir / 'profile'} (tensorboard --logdir, or chrome://tracing)")
        return {k: summary[k] for k in ("final_step", "history", "first_step_at", "preempted", "nonfinite",
                                        "checkpoint")} | {"measured": measured}

    # ------------------------------------------------------------ one step
    def local_batch(self, step: int):
        inputs, targets = self.data.batch(step, int(self.plan.global_batch_size))
        rows = self.engine.local_rows()
        return inputs[rows].to(self.device), targets[rows].to(self.device)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def evaluate(self, batches: int = 2) -> Dict[str, float]:
        """Loss and perplexity on the validation split (the same batches every time)."""
        kept = (list(self.recorder.events), self.recorder.origin)   # the training step's timeline stays
        total = 0.0
        for k in range(batches):
            inputs, targets = self.data.batch(k, int(self.plan.global_batch_size), split="val")
            rows = self.engine.local_rows()
            inputs, targets = inputs[rows].to(self.device), targets[rows].to(self.device)
            if hasattr(self.engine, "evaluate"):
                loss = self.engine.evaluate(inputs, targets)
            else:  # hrlplan's own executor has no forward-only path: its gradients are dropped
                loss = self.engine.forward_backward(inputs, targets)
                for opt in self.optimizers.values():
                    opt.zero_grad(set_to_none=True)
            dist.all_reduce(loss)
            total += loss.item()
        self.recorder.events, self.recorder.origin = kept
        mean = total / batches
        return {"eval/lm_loss": mean, "eval/perplexity": math.exp(min(mean, 50.0))}

    def _gather(self, payload: Dict[str, Any]) -> List[Dict[str, Any]]:
        return distributed.all_gather_object(payload)

    def report_plan_vs_measured(self, step_times: List[float]) -> Optional[Dict[str, Any]]:
        """Collective. Rank 0 writes measured values beside the predicted ones in plan_info.json."""
        events = [{**e, "rank": self.rank} for e in self.recorder.events]
        kept = self.phase_times[timing.SKIP_STEPS:] or self.phase_times
        phases = {k: statistics.median(p[k] for p in kept) for k in kept[0]} if kept else {}
        peak = self.meter.result()
        gathered = self._gather({"events": events, "compute": self.recorder.compute_by_stage(),
                                 "memory": peak.get("peak", timing.peak_memory_bytes(self.device)),
                                 "memory_split": peak, "memory_stats": timing.memory_stats(self.device),
                                 "phases": phases})
        if self.rank != 0 or not step_times:
            return None
        step = timing.median_step_time(step_times)
        stats = timing.stage_stats(gathered, step)
        measured = {"step_time_s": step, "steps_measured": max(len(step_times) - timing.SKIP_STEPS, 1),
                    "bubble_fraction": timing.measured_bubble(gathered),
                    "analytic_bubble_fraction": timing.analytic_bubble(self.plan.schedule, self.plan.pp,
                                                                       self.plan.num_microbatches,
                                                                       self.plan.stages_per_rank),
                    # the simulator's order run with this step's median action times: the order's own bubble
                    "simulated_bubble_fraction": (timing.replayed_bubble(
                        self.plan.schedule, self.plan.pp, self.plan.num_microbatches, self.plan.stages_per_rank,
                        [e for g in gathered for e in g["events"]]) if runs_on_torch_schedules(self.plan) else None),
                    "memory_bytes_per_rank": [g["memory"] for g in gathered],
                    "memory_split_per_rank": [g["memory_split"] for g in gathered],
                    "memory_stats_per_rank": [g["memory_stats"] for g in gathered],
                    "phases_s_per_rank": [g["phases"] for g in gathered],
                    "memory_kind": self.meter.kind(),
                    "stages": {str(i): st for i, st in stats.items()}}
        timeline = sorted((e for g in gathered for e in g["events"]), key=lambda e: (e["start_s"], e["stage"]))
        measured["events"] = timeline   # the form hrlplan.runtime.timeline_plot draws
        predicted = dict(self.plan.meta.get("predicted") or {})
        self._predicted_memory()
        split = self._memory_prediction or []
        if split:   # like with like: what torch allocates, without the plan's workspace reserve
            predicted["memory_bytes_per_rank"] = [row["tensors"] for row in split]
        timing.write_plan_info(self.run_dir, predicted, measured, timeline)
        rows = mem.compare([g["memory_split"] for g in gathered],
                           predicted.get("memory_bytes_per_rank") if split else None)
        mem.add_to_plan_info(self.run_dir, rows, split, measured["memory_kind"], mem.rank_options(self.plan, self.train))
        if self.logger is not None and any(r["measured_bytes"] for r in rows):
            reserve = f"; the plan adds {split[0]['workspace'] / 2**30:.2g} GiB workspace per rank" if split else ""
            self.logger.note(f"peak memory ({measured['memory_kind']}): {mem.describe(rows)}{reserve}")
        return measured


def predicted_memory(plan: Plan, cfg: Config, run_dir: Path) -> List[Dict[str, float]]:
    """The plan's predicted memory per rank and its split (hrlplan.cost.plans.plan_memory), from
    the model and cluster the job saved in the run directory; [] where they are missing."""
    meta_path, cluster_path = run_dir / "model_meta.json", run_dir / "cluster.json"
    if not (meta_path.exists() and cluster_path.exists()):
        return []
    cfg = as_config(cfg)
    meta = ModelMeta.load(meta_path)
    packing = getattr(cfg.data, "packing", None)
    if str(getattr(packing, "value", packing)) in ("document", "balanced"):
        meta = packed_meta(meta)   # per-document attention keeps more per block (cost/memory.packed_meta)
    return plan_memory(plan, meta, ClusterSpec.load(cluster_path), options_for_train(cfg.train, cfg.planner))


def memory_metrics(per_rank: List[Dict[str, int]], predicted: Optional[List[float]] = None) -> Dict[str, float]:
    """memory/peak_gib (largest rank), memory/rank{r}/peak_gib with its split (weights_gib, gradients_gib,
    optimizer_gib, activations_gib, other_gib) and predicted_gib (the plan's tensor bytes), and on CUDA
    memory/rank{r}/max_memory_allocated_gib and _reserved_gib; the CPU's peak RSS is left out (it
    counts the whole process)."""
    keep = ("peak", *mem.CATEGORIES, "max_memory_allocated", "max_memory_reserved")
    return mem.memory_metrics([{k: v for k, v in (s or {}).items() if k in keep} for s in per_rank], predicted)


def full_vocab(arch: Dict[str, Any]) -> int:
    return int(hf_config_from_arch(arch).vocab_size)
