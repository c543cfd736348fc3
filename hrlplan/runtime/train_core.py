"""One training core for every model family, as torchtitan's train_spec: the loop is here, what
differs per family is an adapter (hrlplan/runtime/trainer.py: pipelined language models;
hrlplan/runtime/hrm_trainer.py: HRM on puzzles).

The core owns
- the step loop and the stop/resume position: `stop_at`, the steps done, and the adapter's own
  data position (HRM: iteration and batch inside it), saved in every checkpoint and handed back
  on resume;
- the learning rate: one warm-up + cosine-to-`min_lr_ratio` lambda (`warmup_cosine`) driving a
  torch.optim.lr_scheduler.LambdaLR per optimizer (`LRSchedule`), saved and restored with the run;
- the device (`pick_device`, through hrlplan.devices);
- checkpoints: torch.distributed.checkpoint, sharded and written atomically (runtime/checkpoint.py),
  RNG included; a resume that changes the layout is logged (console, replans.jsonl, W&B);
- metrics and progress: the logger's progress total, one log call per logged step, the history;
- preemption: hrlplan.runtime.preempt's collective stop flag at every step boundary, then a
  checkpoint on all ranks and `preempted: True` in the summary;
- a NaN or infinite loss or gradient norm: the adapter's check (collective, before the optimizer
  takes the update) raises NonFiniteStep; the core stops there, keeps a checkpoint of the last good
  weights (see `_stop_nonfinite`) and puts `nonfinite` in the summary (`nonfinite_line` says it).

An adapter (see `TrainAdapter`) builds the model, optimizers and data, takes one step, says which
metrics a step logs and what happens at its boundaries (evaluation, extra checkpoints).
"""
from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from hrlplan import devices
from hrlplan.config import TrainConfig, section
from hrlplan.errors import UserError
from hrlplan.runtime import checkpoint as ckpt
from hrlplan.runtime import preempt

DCP_METADATA = ckpt.METADATA   # what torch.distributed.checkpoint writes beside its shards


# ---------------------------------------------------------------- settings and device
def train_config(train: Any) -> TrainConfig:
    """The train settings as a TrainConfig: as they are, or from a plain mapping (hrlplan.config.section)."""
    return section(TrainConfig, train)


def pick_device(setting: str, local_rank: Optional[int] = None) -> torch.device:
    """This rank's device (hrlplan.devices.choose_device: a valid ordinal under per-task GPU binding),
    made current. local_rank overrides LOCAL_RANK. Under a process group that is not NCCL a GPU
    cannot train with the others: `auto` then means the CPU, `cuda` is refused."""
    env = dict(os.environ)
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    choice = devices.choose_device(str(setting), env)
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None
    if choice.is_cuda and backend is not None and "nccl" not in backend:
        if str(setting) == "cuda":
            raise UserError(f"train.device=cuda needs an NCCL process group (this one is {backend}); "
                            "use train.device=cpu or auto")
        return torch.device("cpu")
    return devices.activate(choice).device


# ---------------------------------------------------------------- learning rate
def warmup_cosine(warmup: int, total: int, min_ratio: float, hrm_counting: bool = False) -> Callable[[int], float]:
    """The lr factor of update n (0-based, LambdaLR's count): a linear warm-up to 1 over `warmup`
    updates, then a cosine down to min_ratio at update `total`.

    Language models start the cosine at update `warmup` + 1 (nanoGPT); HRM's pretrain.py counts
    the update being taken from 1 and starts it one update earlier (hrm_counting=True)."""
    warmup, total, min_ratio = int(warmup), int(total), float(min_ratio)
    shift = 0 if hrm_counting else 1

    def factor(n: int) -> float:
        taken = n + 1
        if taken < warmup or (taken == warmup and not hrm_counting):
            return taken / warmup
        progress = min(1.0, max(0.0, (taken - shift - warmup) / max(1, total - warmup)))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class LRSchedule:
    """One LambdaLR per optimizer, all on the same lambda; `step()` after every update."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer], factor: Callable[[int], float]):
        self.factor = factor
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, factor) for name, opt in optimizers.items()}

    def lr(self, name: Optional[str] = None) -> float:
        """The lr the next update of `name` (default: the first optimizer) takes."""
        sched = self.schedulers[name] if name is not None else next(iter(self.schedulers.values()))
        return float(sched.get_last_lr()[0])

    def step(self) -> None:
        for sched in self.schedulers.values():
            sched.step()

    def state_dict(self) -> Dict[str, Any]:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        if not states:
            return
        for name, sched in self.schedulers.items():
            # every schedule is the same function of the update: a missing one takes any other's state
            sched.load_state_dict(states.get(name) or next(iter(states.values())))
            # the lr of the next update, also for an optimizer whose state the checkpoint does not hold
            for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr


# ---------------------------------------------------------------- the adapter contract
class TrainAdapter:
    """What the core needs from a model family. Attributes set by the adapter's constructor:

    rank, device; parts / optimizers (this rank's modules and their optimizers, keyed by stage
    index: checkpointed through torch.distributed.checkpoint under the model's parameter names);
    lr (an LRSchedule); stop_at (the step the run stops at); log_interval; checkpoint_interval
    (0: none between the others); checkpoint_root; keep_last (checkpoints kept, None: all);
    history_limit (None: every logged step's metrics kept in the summary)."""

    rank: int = 0
    device: torch.device = torch.device("cpu")
    parts: Dict[int, torch.nn.Module]
    optimizers: Dict[int, torch.optim.Optimizer]
    lr: LRSchedule
    stop_at: int = 0
    log_interval: int = 1
    checkpoint_interval: int = 0
    checkpoint_root: Path
    keep_last: Optional[int] = ckpt.KEEP_LAST
    checkpoint_writes: Optional[Callable[[str], bool]] = None   # which parameters this rank writes (all)
    history_limit: Optional[int] = None

    def resume_setting(self) -> str:
        return "none"

    def batches(self, step: int) -> Iterator[Any]:
        """The training batches from the resume position on (the adapter's position restored)."""
        raise NotImplementedError

    def train_step(self, batch: Any, step: int) -> Dict[str, Any]:
        """One update; `step` updates were taken before it. The core steps the LR schedule after it."""
        raise NotImplementedError

    def step_metrics(self, step: int, out: Dict[str, Any], logging_now: bool) -> Dict[str, float]:
        """Collective when logging_now. The metrics of update `step` (1-based) for history and logger."""
        return {}

    def after_step(self, step: int) -> None:
        """Collective; after the step's metrics (e.g. memory figures)."""

    def boundary(self, step: int, stopping: bool) -> Dict[str, float]:
        """Collective; after the stop flag was agreed, unless preempted (e.g. an evaluation). Its
        metrics are logged at `step`."""
        return {}

    def position(self) -> Dict[str, Any]:
        """Where the data stands after the steps taken (saved with every checkpoint)."""
        return {}

    def restore(self, extra: Dict[str, Any]) -> None:
        """On resume: the extra dict of the checkpoint (position, adapter state)."""

    def extra_state(self) -> Dict[str, Any]:
        """This rank's adapter state for a checkpoint (plain tensors and numbers only)."""
        return {}

    def checkpoint_files(self, directory: Path) -> None:
        """Rank 0 writes files of its own into a checkpoint being written (before it is renamed in)."""

    def checkpoint_written(self, path: Path, step: int, periodic: bool) -> None:
        """After every checkpoint (all ranks)."""

    def profiler(self):
        return nullcontext(None)

    def start(self, step: int, resumed_from: Optional[Path]) -> None:
        """Before the first step (all ranks): announcements."""

    def finish(self, summary: Dict[str, Any], step_times: List[float]) -> Dict[str, Any]:
        """Collective, after the loop: the adapter's part of the summary."""
        return summary


# ---------------------------------------------------------------- a NaN or infinite step
class NonFiniteStep(Exception):
    """An adapter's train_step raises it on every rank together (its check is a collective) when
    the loss or the gradient norm of the update it is taking is NaN or infinite, before the
    optimizer takes that update. what: "loss" or "gradient norm"."""

    def __init__(self, what: str, value: float):
        super().__init__(f"the {what} is {value}")
        self.what, self.value = what, float(value)


def nonfinite_check(loss: torch.Tensor, grad_norm: Optional[torch.Tensor] = None) -> Tuple[float, bool]:
    """Collective (one all_reduce): (the loss summed over ranks, whether any rank's gradient norm is
    NaN/inf). A NaN or inf on any rank makes the sum NaN or inf, so every rank sees the same answer."""
    bad_grad = torch.zeros((), device=loss.device) if grad_norm is None else \
        (~torch.isfinite(_plain_tensor(grad_norm).detach().float().reshape(()).to(loss.device))).float()
    packed = torch.stack([loss.detach().float().reshape(()), bad_grad])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed)
    total, bad = packed.tolist()
    return total, bad > 0


def raise_if_nonfinite(loss_value: float, bad_grad: bool, grad_norm: Optional[torch.Tensor] = None) -> None:
    """After nonfinite_check: NonFiniteStep on every rank alike."""
    if not math.isfinite(loss_value):
        raise NonFiniteStep("loss", loss_value)
    if bad_grad:
        value = float(_plain_tensor(grad_norm)) if grad_norm is not None else float("nan")
        raise NonFiniteStep("gradient norm", value if not math.isfinite(value) else float("nan"))


def _plain_tensor(t: Any) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return torch.as_tensor(t)


def likely_cause(train: Any, hrm: bool = False) -> str:
    """The setting a NaN/inf step most likely comes from, as `key=value (why; what to do)`."""
    t = train_config(train)
    lr, wd = float(t.lr), float(t.weight_decay)
    if not math.isfinite(lr) or lr >= 1.0:
        return f"train.lr={t.lr} (far too large: models train at 1e-5 to 1e-2; lower it)"
    if not math.isfinite(wd) or lr * wd >= 1.0:
        return (f"train.weight_decay={t.weight_decay} (each update shrinks the weights by lr x weight_decay, "
                "which must stay far below 1; typical values are 0 to 0.1)")
    if hrm:
        emb_lr, emb_wd = float(t.puzzle_emb_lr), float(t.puzzle_emb_weight_decay)
        if not math.isfinite(emb_lr) or not math.isfinite(emb_wd) or emb_lr >= 1.0 or emb_lr * emb_wd >= 1.0:
            return f"train.puzzle_emb_lr={t.puzzle_emb_lr} / train.puzzle_emb_weight_decay={t.puzzle_emb_weight_decay} " \
                   "(too large; lower them)"
    if str(getattr(t.dtype, "value", t.dtype)) != "float32":
        return f"train.dtype={getattr(t.dtype, 'value', t.dtype)} (overflow in low precision; try train.dtype=float32)"
    if not t.grad_clip:
        return f"train.lr={t.lr} without clipping (set train.grad_clip=1.0 or lower train.lr)"
    return f"train.lr={t.lr} (lower it) or train.dtype / the data"


def nonfinite_line(info: Mapping[str, Any], train: Any, hrm: bool = False) -> str:
    """The one line a run stopped by a NaN/inf step ends with (summary["nonfinite"])."""
    step, what, value = info["step"], info["what"], info["value"]
    kept = info.get("checkpoint")
    if not kept:
        where = "no checkpoint of good weights was written before it: start again once it is fixed"
    elif what == "gradient norm":
        where = (f"the weights before it are checkpointed in {kept}: continue with train.resume={kept} "
                 "once it is fixed")
    else:
        where = f"the last good checkpoint is {kept}: continue with train.resume={kept} once it is fixed"
    return (f"step {step}: the {what} is {value} (not finite), so the run stopped without taking that update; "
            f"likely {likely_cause(train, hrm)}; {where}")


# ---------------------------------------------------------------- the core
def tell(logger, line: str) -> None:
    """One line on the console and in train.log (the logger's note), printed without a logger."""
    note = getattr(logger, "note", None)
    if callable(note) and getattr(logger, "enabled", True):
        note(line)
    else:
        print(f"[hrlplan] {line}", flush=True)


def log_replan(logger, replan: Optional[Dict[str, str]], step: int, checkpoint_name: str) -> None:
    """A resume under another layout: one line (tell) and the summary keys replan/old, replan/new,
    replan/reason and replan/step (W&B's run summary)."""
    if not replan:
        return
    tell(logger, ckpt.replan_line(checkpoint_name, replan))
    summary = getattr(logger, "summary", None)
    if callable(summary):
        summary({"replan/old": replan["old"], "replan/new": replan["new"], "replan/reason": replan["reason"],
                 "replan/step": step})


class TrainCore:
    """Runs an adapter: resume, the step loop, checkpoints, metrics, preemption."""

    def __init__(self, adapter: TrainAdapter, logger=None):
        self.adapter, self.logger = adapter, logger
        adapter.core = self   # an adapter's boundary may write a checkpoint (core.save_once)
        self.step = 0
        self.last_checkpoint: Optional[Path] = None
        self.saved_step: Optional[int] = None

    # ------------------------------------------------------------ checkpoints
    def resume(self) -> Optional[Path]:
        """Collective. Loads the checkpoint train.resume names (none | auto | a directory), if any."""
        a = self.adapter
        # a damaged checkpoint (cut short on disk): named in one error, or with auto skipped for an older one
        path, notes = ckpt.find_resume(a.resume_setting(), a.checkpoint_root)
        if path is None:
            return None
        if a.rank == 0:
            for line in notes:
                tell(self.logger, line)
        extra = ckpt.load_checkpoint(path, a.parts, a.optimizers, announce=False)
        a.lr.load_state_dict(extra.get("schedulers") or {})
        self.step = int(extra["step"])
        a.restore(extra)
        if a.rank == 0:
            print(f"[hrlplan] resumed from {path} at step {self.step}", flush=True)
            log_replan(self.logger, extra.get("replan"), self.step, path.name)
        self.last_checkpoint, self.saved_step = path, self.step
        return path

    def save(self, periodic: bool = False) -> Path:
        """Collective: a checkpoint of this step (model, optimizer, LR schedule, RNG, position)."""
        a = self.adapter
        extra = {"schedulers": a.lr.state_dict(), "position": a.position(), "adapter": a.extra_state(),
                 "world": dist.get_world_size() if dist.is_initialized() else 1}
        path = ckpt.save_checkpoint(a.checkpoint_root, self.step, a.parts, a.optimizers, extra,
                                    keep_last=a.keep_last, write_files=a.checkpoint_files,
                                    writes=a.checkpoint_writes)
        self.last_checkpoint, self.saved_step = path, self.step
        a.checkpoint_written(path, self.step, periodic)
        return path

    def save_once(self, periodic: bool = False) -> Path:
        """A checkpoint of this step unless one was written at it."""
        if self.saved_step == self.step and self.last_checkpoint is not None:
            return self.last_checkpoint
        return self.save(periodic)

    def _stop_nonfinite(self, bad: NonFiniteStep) -> Dict[str, Any]:
        """Collective. Update self.step + 1 came out NaN/inf and was not taken. A non-finite gradient
        norm from a finite loss: these weights are still good and are checkpointed. A non-finite
        loss: these weights produce it, so none of them is written, and a checkpoint that holds
        them (written at this step) is set aside as nonfinite_step_N; the newest other one is the
        last good. Returns the summary's `nonfinite` entry."""
        if bad.what == "gradient norm":
            kept: Optional[Path] = self.save_once()
        else:
            kept = self._set_aside_poisoned()
        return {"step": self.step + 1, "what": bad.what, "value": bad.value,
                "checkpoint": str(kept) if kept is not None else None}

    def _set_aside_poisoned(self) -> Optional[Path]:
        """Collective: the checkpoint of this step renamed out of resume's way; the newest other one."""
        root = Path(self.adapter.checkpoint_root)
        poisoned = self.last_checkpoint if self.saved_step == self.step else None
        if self.adapter.rank == 0 and poisoned is not None and poisoned.is_dir():
            os.replace(poisoned, poisoned.with_name(f"nonfinite_{poisoned.name}"))
            remaining = ckpt.list_checkpoints(root)
            pointer = root / "latest"
            if remaining:
                (root / "latest.tmp").write_text(remaining[-1].name)
                os.replace(root / "latest.tmp", pointer)
            else:
                pointer.unlink(missing_ok=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        remaining = ckpt.list_checkpoints(root)
        return remaining[-1] if remaining else None

    # ------------------------------------------------------------ the loop
    def log(self, metrics: Dict[str, float]) -> None:
        if metrics and self.logger is not None and self.adapter.rank == 0:
            self.logger.log(metrics, step=self.step)

    def _after_update(self, out: Dict[str, Any], history: List[Dict[str, Any]]) -> bool:
        """Metrics, checkpoints and the stop flag after update `self.step`; True: stop here."""
        a = self.adapter
        logging_now = self.step % max(1, int(a.log_interval)) == 0 or self.step == a.stop_at
        metrics = a.step_metrics(self.step, out, logging_now)
        if metrics:
            history.append({"step": self.step, **metrics})
            if a.history_limit is not None:
                del history[:-a.history_limit]
            self.latest.update(metrics)
        if logging_now:
            self.log(metrics)
        a.after_step(self.step)
        if a.checkpoint_interval and self.step % int(a.checkpoint_interval) == 0:
            self.save_once(periodic=True)
        # collective (preempt's contract): every rank stops at the same step, with a checkpoint
        self.preempted = preempt.stop_agreed(a.device)
        stopping = self.preempted or self.step >= a.stop_at
        if not self.preempted:
            extra = a.boundary(self.step, stopping)
            self.latest.update(extra)
            self.log(extra)
        if stopping:
            self.save_once()
        return stopping

    def fit(self) -> Dict[str, Any]:
        a = self.adapter
        resumed_from = self.resume()
        if a.rank == 0 and hasattr(self.logger, "set_total"):
            self.logger.set_total(a.stop_at, initial=self.step)   # the progress bar, from the resumed step
        a.start(self.step, resumed_from)
        history: List[Dict[str, Any]] = []
        step_times: List[float] = []
        self.latest: Dict[str, float] = {}
        self.preempted = False
        self.nonfinite: Optional[Dict[str, Any]] = None
        first_step_at, started, start_step = None, time.time(), self.step
        with a.profiler() as prof:
            batches: Iterable[Any] = a.batches(self.step) if self.step < a.stop_at else ()
            for batch in batches:
                try:
                    out = a.train_step(batch, self.step)
                except NonFiniteStep as bad:   # on every rank alike: its check was collective
                    self.nonfinite = self._stop_nonfinite(bad)
                    break
                a.lr.step()
                self.step += 1
                if prof is not None:
                    prof.step()
                first_step_at = first_step_at or time.time()
                if "step_time_s" in out:
                    step_times.append(out["step_time_s"])
                if self._after_update(out, history):
                    break
        elapsed = time.time() - started
        summary = {"final_step": self.step, "history": history, "first_step_at": first_step_at,
                   "preempted": self.preempted, "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
                   "latest": dict(self.latest), "nonfinite": self.nonfinite,
                   "steps_per_second": (self.step - start_step) / elapsed if elapsed > 0 else 0.0}
        return a.finish(summary, step_times)
