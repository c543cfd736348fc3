"""Metrics: one logger per job on one rank, writing metrics.jsonl and a W&B run (offline by default).

W&B never blocks or fails the run: offline mode needs no network, and any W&B error downgrades
the logger to the local file with one warning. The run id is stable per run directory, so a
resumed or requeued job continues the same W&B run. One W&B run per job: `group` is the sweep
(set by hrlplan/launch/job.py for a Hydra multirun), `job_type` what the job does (probe, plan, train).
An offline run folder (<run_dir>/wandb/offline-run-*/) holds the resolved config (files/
hrlplan_config.yaml), the files saved with `save_file` (plan.yaml, cluster.json, timeline.png),
the media (tables, images) and run-<id>.wandb (metrics, artifacts); `wandb sync` uploads it; the
logger names the folder and the command when it finishes.

On the console (rank 0 only): on a terminal the tqdm bar alone over the training steps (loss, step
time, tokens/s, ETA), with notes and evaluation lines printed above it through tqdm's logging
redirect; off a terminal (a file, SLURM logs) one short line per logged step, `step 10/50 (20%) |
loss 2.5 | 50.0 ms/step | 12.3k tokens/s | eta 1m02s`, the same in train.log. Every other figure
(per stage, memory, lr, grad norm, MFU) goes to metrics.jsonl and W&B only; an evaluation's keep their
prefixes (eval/lm_loss). Times print in plain ms or s (duration_text). Everything goes through the
`hrlplan` logger, so Hydra's job log (pretrain.log) holds the run's story too.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import uuid
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import yaml
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from hrlplan.config import LoggerConfig, section
from hrlplan.families import family_of

log = logging.getLogger("hrlplan")
WANDB_INIT_TIMEOUT_S = 90.0   # offline mode starts in seconds; online, a slow network must not stall the job


def stable_run_id(run_dir: str | os.PathLike) -> str:
    path = Path(run_dir) / "wandb_run_id.txt"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id)
    os.replace(tmp, path)
    return run_id


class MetricsLogger:
    """Logs to <run_dir>/metrics.jsonl and W&B. Create it on every rank; only `enabled` ranks write.

    Every W&B call goes through `_wandb()`: an error there never stops training. SLURM signals
    every process of a job step on preemption, W&B's service process included, which then dies;
    the first failing call starts a new service and continues the same run id (a new offline
    folder), after that W&B is dropped for this job with one warning."""

    MAX_RECONNECTS = 2

    def __init__(self, run_dir: str | os.PathLike, config: Dict[str, Any], logger_cfg: LoggerConfig,
                 enabled: bool = True, job_type: str = "train", name: Optional[str] = None, echo: bool = True):
        """config: the run's config as plain values (W&B's run config); logger_cfg: the `logger` section."""
        logger_cfg = section(LoggerConfig, logger_cfg)
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.echo = echo
        self.wandb = None
        self.file = None
        self.text_log = None
        self.config = config
        self._init_kwargs: Dict[str, Any] = {}
        self._reconnects = 0
        # Added to every log() call, e.g. the plan's predicted step time next to the measured one.
        self.constant_metrics: Dict[str, Any] = {}
        self.run_name = logger_cfg.run_name or name
        self.progress: Optional[Progress] = None
        self.total_steps: Optional[int] = _planned_steps(config)
        if not enabled:
            return
        setup_console_logging(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.text_log = open(self.run_dir / "train.log", "a", buffering=1)
        mode = str(logger_cfg.mode)
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        self._init_kwargs = dict(
            project=logger_cfg.project, entity=logger_cfg.entity,
            group=logger_cfg.group, tags=list(logger_cfg.tags or []), job_type=job_type,
            name=self.run_name, mode=mode, dir=str(self.run_dir), config=config, id=stable_run_id(self.run_dir),
            resume="allow", init_timeout=WANDB_INIT_TIMEOUT_S)
        try:
            self._start()
        except Exception as e:  # never let logging take the training down
            warnings.warn(f"W&B could not start ({e}); metrics go to {self.run_dir / 'metrics.jsonl'} only")
            self.wandb = None

    def _start(self) -> None:
        import wandb

        kwargs = dict(self._init_kwargs)
        timeout = kwargs.pop("init_timeout")
        self.wandb = wandb.init(**kwargs, settings=wandb.Settings(init_timeout=timeout))
        # Offline runs keep no readable copy of the config: put one in the run folder.
        path = Path(self.wandb.dir) / "hrlplan_config.yaml"
        path.write_text(yaml.safe_dump(_plain_tree(self.config), sort_keys=False))
        self.wandb.save(str(path), base_path=self.wandb.dir, policy="now")

    def _wandb(self, call: Callable[[Any], Any]) -> None:
        """call(run), with one reconnect if W&B's service went away."""
        while self.enabled and self.wandb is not None:
            try:
                call(self.wandb)
                return
            except Exception as e:
                if self._reconnects >= self.MAX_RECONNECTS:
                    warnings.warn(f"W&B failed ({type(e).__name__}: {e}); metrics go to "
                                  f"{self.run_dir / 'metrics.jsonl'} only from here on")
                    self.wandb = None
                    return
                self._reconnects += 1
                try:
                    import wandb

                    wandb.teardown()
                except Exception:
                    pass  # the service is gone: nothing to tear down
                try:
                    self._start()
                except Exception as e2:
                    warnings.warn(f"W&B could not restart ({e2}); metrics go to {self.run_dir / 'metrics.jsonl'} only")
                    self.wandb = None

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        full = {**metrics, **{k: v for k, v in self.constant_metrics.items() if k not in metrics}}
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in full.items()}}
        self.file.write(json.dumps(record) + "\n")
        self._wandb(lambda run: run.log(full, step=step))
        shown = console_metrics(metrics)
        if not any(k.startswith("train/") for k in metrics):
            if shown:
                self._say(metrics_line(step, shown))
            return
        if self.progress is None and self.total_steps is not None and self.echo:
            self.progress = Progress(self.total_steps, initial=max(0, step - 1))
        plain = self.progress.update(step, metrics) if self.progress is not None else None
        line = step_line(step, metrics, plain) + (" | " + metrics_text(shown) if shown else "")
        if self.progress is not None and plain is None:   # a terminal: the bar alone stands for the step
            self.text_log.write(line + "\n")
            if shown:   # an evaluation: printed above the bar
                log.info(metrics_line(step, shown))
            return
        self._say(line)

    def _say(self, line: str) -> None:
        self.text_log.write(line + "\n")
        if self.echo:
            log.info(line)

    def set_total(self, total_steps: Optional[int], initial: int = 0) -> None:
        """The run's length in steps (a trainer that counts in epochs knows it first): shows the
        progress bar from `initial` on."""
        self.total_steps = total_steps
        if self.enabled and self.echo and total_steps:
            if self.progress is not None:
                self.progress.close()
            self.progress = Progress(int(total_steps), initial=initial)

    def note(self, text: str) -> None:
        """A line for the human-readable train.log (and the console)."""
        if not self.enabled:
            return
        log.info(text)
        self.text_log.write(text + "\n")

    def log_artifact(self, path: str | os.PathLike, artifact_type: str, name: Optional[str] = None) -> None:
        if not self.enabled or self.wandb is None:
            return
        import wandb

        def call(run):
            art = wandb.Artifact(name or Path(path).stem.replace(".", "-"), type=artifact_type)
            art.add_file(str(path))
            run.log_artifact(art)
        self._wandb(call)

    def save_file(self, path: str | os.PathLike) -> None:
        """Copy a file into the W&B run folder (uploaded by `wandb sync` / online mode)."""
        if not self.enabled or self.wandb is None or not Path(path).exists():
            return
        def call(run):
            dest = Path(run.dir) / Path(path).name
            shutil.copyfile(path, dest)
            run.save(str(dest), base_path=run.dir, policy="now")
        self._wandb(call)

    def log_table(self, key: str, columns: List[str], rows: List[List[Any]]) -> None:
        if not self.enabled or self.wandb is None:
            return
        import wandb

        self._wandb(lambda run: run.log({key: wandb.Table(columns=columns, data=[[_plain(x) for x in r] for r in rows])}))

    def log_image(self, key: str, figure_or_path: Any) -> None:
        if not self.enabled or self.wandb is None:
            return
        import wandb

        self._wandb(lambda run: run.log({key: wandb.Image(figure_or_path)}))

    def summary(self, values: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        path = self.run_dir / "summary.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        old.update({k: _plain(v) for k, v in values.items()})
        path.write_text(json.dumps(old, indent=1))
        self._wandb(lambda run: run.summary.update({k: _plain(v) for k, v in values.items() if v is not None}))

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        offline = self._offline_folder()
        if self.file is not None:
            self.file.close()
            self.text_log.close()
            self.file = self.text_log = None
        if self.wandb is not None:
            try:
                self.wandb.finish()
                import wandb

                # finish() can return before the service wrote everything to the offline file;
                # teardown waits for it, so the folder is complete before a requeue or exit.
                wandb.teardown()
            except Exception as e:  # the service died (e.g. signalled): what it wrote is kept
                warnings.warn(f"W&B finish failed ({type(e).__name__}: {e})")
            self.wandb = None
        if offline is not None and self.echo:
            log.info(f"W&B offline run: {offline}; upload it with: wandb sync {offline}")

    def _offline_folder(self) -> Optional[Path]:
        if self.wandb is None or str(self._init_kwargs.get("mode")) != "offline":
            return None
        try:
            return Path(self.wandb.dir).parent   # <run_dir>/wandb/offline-run-*/files -> the run folder
        except Exception:
            return None


def _plain_tree(v: Any) -> Any:
    if isinstance(v, Enum):
        return str(v.value)
    if isinstance(v, dict):
        return {str(k): _plain_tree(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain_tree(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(_plain(v))


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


def _fmt(v: Any) -> str:
    v = _plain(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def read_metrics(run_dir: str | os.PathLike) -> List[Dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---------------------------------------------------------------- console
# Logged, never printed: the per-stage, memory and table figures are for metrics.jsonl and W&B.
CONSOLE_HIDDEN = ("memory/", "stage/", "stage", "perf/", "probe/", "replan/", "num_params")


def metrics_text(metrics: Dict[str, Any]) -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())


def metrics_line(step: int, metrics: Dict[str, Any]) -> str:
    """`step 12 | eval/lm_loss=3.21 stage0/compute_s=0.012`: full names, so two stages' compute_s differ."""
    return f"step {step:>5} | " + metrics_text(metrics)


def console_metrics(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """What a log call shows beside the step's short line: neither train/ figures (the line has the
    ones that matter) nor the hidden prefixes."""
    return {k: v for k, v in metrics.items() if not k.startswith(("train/", *CONSOLE_HIDDEN))}


def step_line(step: int, metrics: Dict[str, Any], progress: Optional[str] = None) -> str:
    """One short line per logged step: `step 10/50 (20%) | loss 2.5 | 50.0 ms/step | 12.3k tokens/s |
    eta 1m02s` (progress: Progress.update's text, which has the step count and ETA)."""
    head = progress.split(", ")[0] if progress else f"{step}"
    rest = progress.split(", ")[1:] if progress else _progress_fields(metrics)
    return " | ".join([f"step {head}", *rest])


def duration_text(seconds: Optional[float]) -> str:
    """A time in plain notation, never 4.16e+03 ms: `0.412 ms`, `43.0 ms`, `4.16 s`, `611 s`; `?` unknown."""
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    ms = seconds * 1e3
    if abs(ms) < 1:
        return f"{ms:.3f} ms"
    if abs(ms) < 10:
        return f"{ms:.2f} ms"
    if abs(ms) < 1000:
        return f"{ms:.1f} ms"
    if abs(seconds) < 10:
        return f"{seconds:.2f} s"
    if abs(seconds) < 100:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s"


def _planned_steps(config: Dict[str, Any]) -> Optional[int]:
    """train.steps for a language model; None for a family trained in epochs (HRM), whose trainer knows
    its length (set_total)."""
    if not isinstance(config, dict) or not isinstance(config.get("train"), dict):
        return None
    if family_of(config.get("arch")).trains_epochs:
        return None
    steps = config["train"].get("steps")
    stop = config["train"].get("stop_after")
    return int(min(steps, stop) if stop else steps) if steps else None


class _Handler(logging.StreamHandler):
    """The console handler a worker adds (Hydra configures the main process only)."""


def setup_console_logging(run_dir: Optional[Path] = None) -> None:
    """Give the `hrlplan` logger a console (and pretrain.log, Hydra's job log, when the run has one)
    in a process where nobody configured logging, e.g. a worker the launcher started."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if logging.getLogger().handlers or any(isinstance(h, _Handler) for h in log.handlers):
        return   # Hydra (or the application) already shows our records
    console = _Handler(sys.stderr)
    console.setFormatter(logging.Formatter("[hrlplan] %(message)s"))
    log.addHandler(console)
    job_log = Path(run_dir) / "pretrain.log" if run_dir is not None else None
    if job_log is not None and job_log.exists():
        file = logging.FileHandler(job_log)
        file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        log.addHandler(file)


def _is_tty() -> bool:
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Training progress on rank 0: a tqdm bar on a terminal (log lines go above it), else a
    plain `12/50 (24%), 45.1 ms/step, 5.6k tokens/s, eta 1m02s` suffix for the step's line."""

    def __init__(self, total: int, initial: int = 0, tty: Optional[bool] = None):
        self.total, self.step, self.tty = int(total), int(initial), _is_tty() if tty is None else tty
        self.t0, self.s0 = time.time(), int(initial)
        self.bar = self._redirect = None
        if self.tty:
            self.bar = tqdm(total=self.total, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            # only loggers that print to the console: tqdm's redirect would give the others one
            consoles = [lg for lg in (logging.getLogger(), log) if any(
                isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in lg.handlers)]
            self._redirect = logging_redirect_tqdm(loggers=consoles)
            self._redirect.__enter__()

    def update(self, step: int, metrics: Dict[str, Any]) -> Optional[str]:
        shown = _progress_fields(metrics)
        if self.bar is not None:
            self.bar.set_postfix_str(", ".join(shown), refresh=False)
            self.bar.update(max(0, step - self.step))
            self.step = step
            return None
        self.step = step
        rate = (step - self.s0) / max(time.time() - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        return ", ".join([f"{step}/{self.total} ({100 * step / max(self.total, 1):.0f}%)", *shown,
                          f"eta {_duration(eta)}"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = self._redirect = None


def _progress_fields(metrics: Dict[str, Any]) -> List[str]:
    loss = next((k for k in ("train/lm_loss", "train/loss") if k in metrics),
                next((k for k in metrics if "loss" in k), None))
    out = [f"loss {_fmt(metrics[loss])}"] if loss else []
    if "train/step_time_s" in metrics:
        out.append(f"{duration_text(float(_plain(metrics['train/step_time_s'])))}/step")
    if "train/tokens_per_s" in metrics:
        out.append(f"{_si(float(_plain(metrics['train/tokens_per_s'])))} tokens/s")
    return out


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
