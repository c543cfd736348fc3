"""A cache of plans, keyed by the cluster's shape, the model, the planner and the training settings.

Why: probed figures vary a little from run to run, so re-planning a requeued job could pick
another layout (or micro-batching), and its checkpoint would then continue a different numerical
path. The key leaves the measured figures out on purpose: the number of nodes and devices per
node, each device's kind, name and memory (GiB), and the backend describe the cluster.

Where: $HRLPLAN_PLAN_CACHE when set (share it between runs and sweeps), else <run_dir>/plan_cache
(a requeued or resumed run reuses its own plan). Entries are written atomically (a directory
renamed into place), so concurrent jobs of a sweep never read half an entry.

Calibrations (planner.calibrate, on by default for probed clusters) that held steady (an unsteady one,
taken on a busy node, plans its own job only: hrlplan.runtime.calibrate.record) are cached per user, not per
run, under calibration-<key> in $HRLPLAN_CALIBRATION_CACHE, else $HRLPLAN_PLAN_CACHE, else
$XDG_CACHE_HOME/hrlplan (~/.cache/hrlplan): their key is the cluster's shape, the model, the
sequence length and the training settings calibration reads, so the README's command, a requeued
job and the jobs of a sweep over other settings (lr, steps, the planner) measure the devices once.
planner.calibrate=refresh measures afresh and replaces the entry. Sweep points that start together
measure once too: the first to miss a key holds a lock on it while it measures, the others wait and
read its entry (load_calibration / store_calibration).

A calibration entry keeps the probe's link figures it was fitted against (probe_links.json: the
bandwidth and latency matrices and the hosts; its bandwidth_efficiency is a fraction of that probe's
bandwidth), and a run on the same hosts that reuses the calibration plans with them rather than with
its own probe's: two runs on an unchanged machine plan from the same figures, so they plan the same
layout (a ping-pong timed on a busy host came out 100x slow and flipped a near tie). On other hosts (a
new allocation of a cluster's nodes) the run's own probe stands. planner.calibrate=refresh measures
both again.
"""
from __future__ import annotations

import hashlib
import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import hrlplan
from hrlplan.config import Config, as_dict
from hrlplan.plan import Plan, PlanError

# The training settings make_plan reads (see hrlplan.search.make_plan).
PLAN_TRAIN_KEYS = ("global_batch_size", "schedule", "stages_per_rank", "microbatches", "dtype", "dp_mode", "compile",
                   "float8", "context_parallel")
CACHE_ENV = "HRLPLAN_PLAN_CACHE"
CALIBRATION_CACHE_ENV = "HRLPLAN_CALIBRATION_CACHE"


def cacheable(config: Config) -> bool:
    # A manual plan is read from its file every time: an edited file must win over a cache entry.
    return str(config.planner.get("name", "exact")) != "manual"


def cache_dir(config: Config) -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(config.run_dir) / "plan_cache")


def shared() -> bool:
    """Plans are cached where other runs read them too ($HRLPLAN_PLAN_CACHE), not in this run's directory."""
    return bool(os.environ.get(CACHE_ENV))


def calibration_dir(config: Config) -> Path:
    explicit = os.environ.get(CALIBRATION_CACHE_ENV) or os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hrlplan"


def _key(config: Config, spec, **parts: Any) -> str:
    cluster = {
        "node_sizes": list(spec.node_sizes()),
        "devices": [[d.kind, d.name, round(d.memory_bytes / 2**30)] for d in spec.devices],
        "backend": spec.backend,
        "source": spec.source,
    }
    payload = {"version": hrlplan.__version__, "cluster": cluster, "arch": config.arch,
               "seq_len": config.data.seq_len, **parts}
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def packs_documents(config: Config) -> bool:
    """data.packing=document|balanced: rows of whole documents, attention kept to each."""
    packing = getattr(config.data, "packing", None)
    return str(getattr(packing, "value", packing)) in ("document", "balanced")


def cache_key(config: Config, spec) -> str:
    train = as_dict(config.train)
    # packed documents hold more activation memory (cost/memory.packed_meta): their plan is its own
    extra = {"packing": config.data.packing.value} if packs_documents(config) else {}
    return _key(config, spec, planner=config.planner, train={k: train[k] for k in PLAN_TRAIN_KEYS}, **extra)


# The training settings calibrate_in_job reads: micro-batch sizes from the global batch, the dtype it
# computes in, the optimizer and FSDP figures.
CALIBRATION_TRAIN_KEYS = ("global_batch_size", "dtype", "dp_mode", "weight_decay", "beta1", "beta2", "grad_clip",
                          "compile")   # a compiling run measures compile_speedup too


def calibration_key(config: Config, spec) -> str:
    train = as_dict(config.train)
    return "calibration-" + _key(config, spec, train={k: train[k] for k in CALIBRATION_TRAIN_KEYS})


def load(config: Config, key: str) -> Optional[Tuple[Any, Dict[str, Any]]]:
    entry = cache_dir(config) / key
    try:
        plan = Plan.load(entry / "plan.yaml")
        info = json.loads((entry / "plan_info.json").read_text())
    except (OSError, ValueError, PlanError):
        return None  # missing or unreadable: plan again
    return plan, info


def _store_entry(root: Path, key: str, write, replace: bool = False) -> Optional[str]:
    """write(tmp_dir) fills a fresh directory, which is then renamed into place as the entry. None
    when the entry is there (stored now, or by another job first); else why nothing was stored."""
    final = root / key
    if final.exists():
        if not replace:
            return None
        old = root / f".{key}.{uuid.uuid4().hex[:8]}.old"
        try:
            os.replace(final, old)
        except OSError as e:
            return _why(e, root)
        shutil.rmtree(old, ignore_errors=True)
    tmp = root / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        os.replace(tmp, final)
    except OSError as e:
        if not final.exists():   # another job stored it first: it is there all the same
            return _why(e, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None


def _why(error: OSError, where: Path) -> str:
    """An OSError in a few words, naming the cache's path (not the scratch entry's): "permission
    denied: /shared/cache"."""
    reason = (error.strerror or str(error) or type(error).__name__).lower()
    return f"{reason}: {where}"


def store(config: Config, key: str, plan, info: Dict[str, Any]) -> None:
    def write(tmp: Path) -> None:
        plan.save(tmp / "plan.yaml")
        (tmp / "plan_info.json").write_text(json.dumps(info, indent=1, default=str))

    _store_entry(cache_dir(config), key, write)


# ---------------------------------------------------------------- calibrations, measured once per key
# Jobs of a sweep may start together (submitit/SLURM arrays run points in parallel): the first to miss
# an entry takes an advisory lock on it (flock, released by the kernel if that job dies), measures and
# stores; the others wait on the lock and then read the stored entry instead of measuring again.
CALIBRATION_WAIT_S = 15 * 60
_held: Dict[str, Any] = {}   # lock path -> open file, for the locks this process holds


def _read_calibration(config: Config, key: str) -> Optional[Dict[str, Any]]:
    try:
        cal = json.loads((calibration_dir(config) / key / "calibration.json").read_text())
    except (OSError, ValueError):
        return None   # missing or unreadable: calibrate again
    return cal if isinstance(cal, dict) else None


def _lock_calibration(config: Config, key: str, wait_s: float) -> None:
    """Hold key's lock (waiting for a job that holds it, up to wait_s), or go on without one where the
    cache cannot lock (a read-only directory, a filesystem without flock)."""
    path = calibration_dir(config) / f".{key}.lock"
    if str(path) in _held:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError:
        return
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _held[str(path)] = handle
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            if not said:
                print(f"[hrlplan] another job is calibrating {calibration_dir(config) / key}: waiting for it (at "
                      f"most {wait_s / 60:.0f} min) to plan from its measurements", flush=True)
                said = True
            time.sleep(0.5)
        except OSError:
            break
    handle.close()


def _unlock_calibration(config: Config, key: str) -> None:
    handle = _held.pop(str(calibration_dir(config) / f".{key}.lock"), None)
    if handle is not None:
        handle.close()   # closing the file releases its flock


def load_calibration(config: Config, key: str,
                     wait_s: float = CALIBRATION_WAIT_S) -> Optional[Dict[str, Any]]:
    """The stored calibration for key, or None: then this process holds key's lock until it calls
    store_calibration (another job of the sweep that misses waits for that entry instead of measuring)."""
    cal = _read_calibration(config, key)
    if cal is None:
        _lock_calibration(config, key, wait_s)
        cal = _read_calibration(config, key)   # stored by the job we waited for
        if cal is not None:
            _unlock_calibration(config, key)
    return cal


def store_calibration(config: Config, key: str, calibration: Dict[str, Any], replace: bool = False,
                      links: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """Store key's entry (links: probe_links(spec) of the probe it was fitted against) and release
    its lock. None when it is stored, else why it could not be (a read-only or full cache): the run
    goes on, and the next one measures again."""
    def write(tmp: Path) -> None:
        (tmp / "calibration.json").write_text(json.dumps(calibration, default=str))
        if links is not None:
            (tmp / LINKS_FILE).write_text(json.dumps(links))

    try:
        return _store_entry(calibration_dir(config), key, write, replace)
    finally:
        _unlock_calibration(config, key)


# ---------------------------------------------------------------- the probe's links, kept with a calibration
LINKS_FILE = "probe_links.json"
LINK_FIELDS = ("bandwidth", "latency", "intra_node_bw", "inter_node_bw")


def probe_links(spec) -> Dict[str, Any]:
    """The link figures a probe measured (bytes/s and seconds): what a calibration is fitted against;
    with each rank's host, which they were measured between."""
    return {**{name: getattr(spec, name) for name in LINK_FIELDS}, "hosts": [d.hostname for d in spec.devices]}


def load_calibration_links(config: Config, key: str) -> Optional[Dict[str, Any]]:
    """The links stored with key's calibration, or None (an entry written without them, unreadable)."""
    try:
        links = json.loads((calibration_dir(config) / key / LINKS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return links if isinstance(links, dict) and all(name in links for name in LINK_FIELDS) else None


def adopt_links(spec, links: Dict[str, Any]) -> bool:
    """Give spec the stored links when they were measured between the same hosts, rank for rank (the
    same machine; another allocation of a cluster's nodes has links of its own) and describe its ranks
    and nodes (a square matrix of its world size, one intra-node figure per node); False, spec left as
    probed, when not."""
    world = spec.world_size
    if links.get("hosts") != [d.hostname for d in spec.devices]:
        return False

    def square(matrix: Any) -> bool:
        return isinstance(matrix, list) and len(matrix) == world and all(
            isinstance(row, list) and len(row) == world for row in matrix)

    if not (square(links["bandwidth"]) and square(links["latency"])
            and len(links["intra_node_bw"] or []) == spec.nnodes):
        return False
    for name in LINK_FIELDS:
        setattr(spec, name, links[name])
    return True


def release_calibration(config: Config, key: str, drop: bool = False) -> None:
    """Give key's lock up without storing (an unsteady calibration): a job waiting for it measures.
    drop: remove the stored entry too (planner.calibrate=refresh was asked to replace it)."""
    try:
        if drop:
            final = calibration_dir(config) / key
            old = final.parent / f".{key}.{uuid.uuid4().hex[:8]}.old"
            try:
                os.replace(final, old)
            except OSError:
                return   # none there, or a read-only cache: nothing to drop
            shutil.rmtree(old, ignore_errors=True)
    finally:
        _unlock_calibration(config, key)
