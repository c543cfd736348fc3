"""Metrics: one logger per job on one rank, writing metrics.jsonl and a W&B run (offline by default).

W&B never blocks or fails the run: offline mode needs no network, and any W&B error downgrades
the logger to the local file with one warning. The run id is stable per run directory, so a
resumed or requeued job continues the same W&B run. One W&B run per job: `group` is the sweep
(set by launch/job.py for a Hydra multirun), `job_type` what the job does (probe, plan, train).
An offline run folder (<run_dir>/wandb/offline-run-*/) holds the resolved config (files/
hrlplan_config.yaml), the files saved with `save_file` (plan.yaml, cluster.json, timeline.png),
the media (tables, images) and run-<id>.wandb (metrics, artifacts); `wandb sync` uploads it.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional


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

    def __init__(self, run_dir: str | os.PathLike, config: Dict[str, Any], logger_cfg: Dict[str, Any],
                 enabled: bool = True, job_type: str = "train", name: Optional[str] = None, echo: bool = True):
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
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.text_log = open(self.run_dir / "train.log", "a", buffering=1)
        mode = str(logger_cfg.get("mode", "offline"))
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        self._init_kwargs = dict(
            project=logger_cfg.get("project", "hrlplan"), entity=logger_cfg.get("entity"),
            group=logger_cfg.get("group"), tags=list(logger_cfg.get("tags") or []), job_type=job_type,
            name=name, mode=mode, dir=str(self.run_dir), config=config, id=stable_run_id(self.run_dir),
            resume="allow", init_timeout=float(logger_cfg.get("init_timeout_s", 90)))
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
        import yaml

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
        if self.echo:
            shown = " ".join(f"{k.split('/')[-1]}={_fmt(v)}" for k, v in metrics.items())
            print(f"step {step:>5} | {shown}", file=sys.stderr, flush=True)
        self.text_log.write(f"step {step:>5} | " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()) + "\n")

    def note(self, text: str) -> None:
        """A line for the human-readable train.log (and the console)."""
        if not self.enabled:
            return
        print(f"[hrlplan] {text}", file=sys.stderr, flush=True)
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
        import shutil

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


def _plain_tree(v: Any) -> Any:
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
