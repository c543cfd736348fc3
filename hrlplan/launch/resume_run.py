"""A resume continues the same run: `train.resume=auto hydra.run.dir=<dir>` (or `train.resume=<checkpoint>`)
trains with the config that run recorded, not with the defaults.

Every run records its config in <run dir>/run.yaml (written atomically by the app at every start: the
task overrides and the composed config). Before Hydra starts -- and so before Hydra rewrites the run's
.hydra/ files -- `resumed_overrides` reads that record (or, for a run older than it, .hydra/overrides.yaml
and .hydra/config.yaml), replays the recorded overrides under the command line's, composes the result
and compares it with what the run trained, key by key, under RESUME_KEYS, the one table of how a key
is treated on resume:
- per-invocation keys (train.resume, train.stop_after, ...) are this command's alone, never restored;
- safe keys (cluster.*, logger.*, intervals, timeouts, ...) are restored and may be changed;
- every other key (the model, the data, the batch, steps, the LR schedule, the seed, the plan) is what
  was trained: a command-line value that differs from the record is refused in one line; a value that
  conf/ itself now composes differently (an edited default) is pinned back to the recorded one.
A run with no checkpoint yet has trained nothing: a resume of it starts afresh with the command line's
config, and says so. A changed allocation with a hand-written plan (planner=manual) re-plans with the
default planner, since that plan was written for the old one (the elastic path, tests/test_elastic.py).
"""
from __future__ import annotations

import fnmatch
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from hrlplan.config import TOP_LEVEL_ALIASES
from hrlplan.errors import ConfigError, one_line

RECORD = "run.yaml"          # in the run directory, beside checkpoints/
CHECKPOINTS = "checkpoints"

PER_INVOCATION, SAFE, TRAINED = "per-invocation", "safe", "trained"

# How each key is treated on resume: the first pattern that matches wins; a key matching none is
# TRAINED (so a key added later is protected until someone decides otherwise). docs/resume.md lists it.
RESUME_KEYS: Tuple[Tuple[str, str, str], ...] = (
    ("train.resume", PER_INVOCATION, "what to resume is this command's"),
    ("train.stop_after", PER_INVOCATION, "a stop for this invocation, as a preemption"),
    ("mode", PER_INVOCATION, "train or only plan, this time"),
    ("run_dir", PER_INVOCATION, "where this invocation writes"),
    ("cluster.*", SAFE, "the allocation: a changed one re-plans and the checkpoint reshards"),
    ("train.device", SAFE, "the allocation's device kind"),
    ("logger.*", SAFE, "where the metrics go"),
    ("train.checkpoint_interval", SAFE, "how often to checkpoint"),
    ("train.checkpoint_every_eval", SAFE, "how often to checkpoint"),
    ("train.eval_interval", SAFE, "how often to evaluate"),
    ("train.log_interval", SAFE, "how often to log"),
    ("train.profile", SAFE, "measurement only"),
    ("train.measure_memory", SAFE, "measurement only"),
    ("train.compile", SAFE, "the same math, compiled (float8 changes the numerics: it stays trained)"),
    ("train.plan_timeout_min", SAFE, "a timeout"),
    ("train.collective_timeout_min", SAFE, "a timeout"),
    ("data.num_workers", SAFE, "loader processes, not the data"),
    ("planner.name", TRAINED, "the plan the run trains"),
    ("planner.plan_file", TRAINED, "the plan the run trains"),
    ("planner.*", SAFE, "the search's knobs (calibration, recompute, limits): used when it re-plans"),
)


def treatment(key: str) -> str:
    """PER_INVOCATION, SAFE or TRAINED for a dotted key of the composed config."""
    for pattern, kind, _ in RESUME_KEYS:
        if fnmatch.fnmatchcase(key, pattern):
            return kind
    return TRAINED


# ---------------------------------------------------------------- the record
def write_record(run_dir: str | os.PathLike, overrides: Sequence[str], config: Dict[str, Any]) -> Path:
    """<run dir>/run.yaml: the task overrides (those a resume replays) and the composed config, atomically."""
    path = Path(run_dir) / RECORD
    kept = [o for o in overrides if treatment(_key_of(o)) != PER_INVOCATION]
    text = yaml.safe_dump({"overrides": kept, "config": config}, sort_keys=False)
    tmp = path.with_name(f".{RECORD}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def load_record(run_dir: Path) -> Optional[Tuple[List[str], Dict[str, Any], Path]]:
    """(overrides, composed config, the file) a run recorded; None when it recorded nothing."""
    own, hydra = run_dir / RECORD, run_dir / ".hydra"
    if own.is_file():
        data = _read_yaml(own)
        if isinstance(data, dict) and isinstance(data.get("overrides"), list) and isinstance(data.get("config"), dict):
            return [str(o) for o in data["overrides"]], data["config"], own
        raise ConfigError("train.resume", message=f"train.resume: {own} is not a run record (overrides, config): "
                          f"restore it, or delete it to resume with this command line's config")
    if (hydra / "overrides.yaml").is_file() and (hydra / "config.yaml").is_file():
        overrides, config = _read_yaml(hydra / "overrides.yaml"), _read_yaml(hydra / "config.yaml")
        if isinstance(overrides, list) and isinstance(config, dict):
            return [str(o) for o in overrides], _plain_from_hydra(config, overrides), hydra / "config.yaml"
    return None


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("train.resume", message=f"train.resume: cannot read the run's record {path}: "
                          f"{one_line(e, 200)}; repair or delete it") from None


def _plain_from_hydra(config: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Hydra's .hydra/config.yaml as compose() makes it plain (aliases copied, HRM's recipe applied)."""
    from omegaconf import OmegaConf

    from hrlplan.compose import to_plain

    return to_plain(OmegaConf.create(config), [str(o) for o in overrides], check=False)


# ---------------------------------------------------------------- which run, which checkpoint
def recorded_run(resume: str, run_dir: Optional[str]) -> Optional[Path]:
    """The run directory whose record a resume restores: the run directory itself for auto; for a
    checkpoint path, the run it belongs to (<run>/checkpoints/step_N)."""
    if resume == "auto":
        return Path(run_dir) if run_dir else None
    path = Path(resume).expanduser()
    if not path.is_dir():
        return None   # the environment check names it
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / RECORD).is_file() or (candidate / ".hydra" / "config.yaml").is_file():
            return candidate
    return None


def checkpoint_step(resume: str, run: Path, config: Dict[str, Any]) -> Optional[int]:
    """The step the resume starts from, as the checkpoint directory names it; None without one."""
    if resume == "auto":
        root = Path((config.get("train") or {}).get("checkpoint_path") or run / CHECKPOINTS)
    else:
        root = Path(resume).expanduser()
        if re.fullmatch(r"step_\d+", root.name):
            return int(root.name[5:])
    latest = root / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    steps = sorted(int(p.name[5:]) for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and p.is_dir())
    if re.fullmatch(r"step_\d+", name):
        return int(name[5:])
    return steps[-1] if steps else None


# ---------------------------------------------------------------- comparing configs
def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{dotted key: value}; lists are values. HRM's top-level aliases are left out: their group key counts."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        if not prefix and key in TOP_LEVEL_ALIASES:
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _key_of(override: str) -> str:
    return str(override).split("=", 1)[0].lstrip("+~").strip()


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _group_key(key: str) -> str:
    """A top-level HRM alias as its group key (lr -> train.lr)."""
    return ".".join(TOP_LEVEL_ALIASES[key]) if key in TOP_LEVEL_ALIASES else key


def _typed_by(key: str, overrides: Sequence[str]) -> Optional[str]:
    """The command-line override that sets `key` (itself, a group above it, an alias, or an experiment)."""
    for o in reversed(list(overrides)):
        k = _group_key(_key_of(o))
        if k == key or key.startswith(k + ".") or k == "experiment":
            return o
    return None


def _as_override_value(value: Any) -> Optional[str]:
    """A value in Hydra's override grammar; None when it has no such spelling here."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value else "nan"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        items = [_as_override_value(v) for v in value]
        return None if any(i is None or isinstance(v, (list, dict)) for i, v in zip(items, value)) else \
            "[" + ",".join(items) + "]"
    return None


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------- the resume itself
def _value(overrides: Sequence[str], key: str) -> Optional[Any]:
    """The last value the overrides give `key` (Hydra's parser: quotes and escapes as Hydra reads them)."""
    found = None
    for o in overrides:
        if _key_of(o) == key and "=" in o:
            found = OverridesParser.create().parse_overrides([o])[0].value()
    return found


def resumed_overrides(overrides: Sequence[str], hydra_overrides: Sequence[str],
                      compose: Callable[[List[str]], Dict[str, Any]], say: Callable[[str], None]) -> List[str]:
    """The task overrides a resume runs with: the recorded run's, then the command line's (which
    must not change what was trained). `overrides`: the command line's task overrides; hydra_overrides:
    its hydra.* ones. Returns `overrides` as they are when nothing is resumed."""
    resume = _value(overrides, "train.resume")
    if resume in (None, "", "none"):
        return list(overrides)
    run_dir = _value(overrides, "run_dir") or _value(hydra_overrides, "hydra.run.dir")
    if resume == "auto" and run_dir is None:
        say("[hrlplan] train.resume=auto without hydra.run.dir: this run gets a new directory, so there is nothing "
            "to resume; name the run's directory (hydra.run.dir=<its directory>) to continue it")
        return list(overrides)
    run = recorded_run(str(resume), None if run_dir is None else str(run_dir))
    record = load_record(run) if run is not None else None
    if record is None:
        if run is not None and checkpoint_step(str(resume), run, {}) is not None:
            say(f"[hrlplan] train.resume={resume}: {run} recorded no config (no {RECORD} or .hydra/), so none is "
                "restored: this command line's config must be the run's own")
        return list(overrides)
    recorded, trained, source = record
    step = checkpoint_step(str(resume), run, trained)
    if step is None:
        say(f"[hrlplan] train.resume={resume}: {run} has no checkpoint yet, so nothing was trained: "
            f"starting afresh with this command line's config (not the one in {source.name})")
        return list(overrides)
    typed_keys = {_group_key(_key_of(o)) for o in overrides}
    # the command line's value wins (and is compared below); a group it picks drops the old group's keys
    replayed = [o for o in recorded if treatment(_group_key(_key_of(o))) != PER_INVOCATION
                and not any(_under(_group_key(_key_of(o)), t) for t in typed_keys)]
    exempt, replan_note = _replan_manual_plan(replayed, overrides, trained)
    if replan_note:
        replayed = [o for o in replayed if _key_of(o) not in ("planner", "planner.plan_file")]
    differs = _differences(trained, compose(replayed + list(overrides)), exempt)
    pins = [_pin(key, old, new, overrides, run, source) for key, (old, new) in differs.items()]
    merged = replayed + pins + list(overrides)
    composed = compose(merged)
    left = _differences(trained, composed, exempt)
    if left:   # a pin that did not take: conf/ changed in a way an override cannot undo
        key, (old, new) = next(iter(left.items()))
        raise _drifted(key, old, new, run, "")
    if replan_note:
        say(replan_note)
    say(_restored_line(run, step, replayed + pins, composed))
    return merged


def _pin(key: str, old: Any, new: Any, overrides: Sequence[str], run: Path, source: Path) -> str:
    """The override that keeps `key` at its recorded value; refused when the command line changed it."""
    typed = _typed_by(key, overrides)
    if typed is not None:
        raise ConfigError(key, new, message=(
            f"{typed} on resume: the run in {run} trained with {key}={_shown(old)} (recorded in {source}), "
            f"here {key}={_shown(new)}; a resume continues the same run: drop {_key_of(typed)} from the command "
            "line, or start a new run in another hydra.run.dir (docs/resume.md lists the keys a resume may "
            "change)"))
    spelled = _as_override_value(old)
    if spelled is None:
        raise _drifted(key, old, new, run, ", which cannot be given back as an override")
    return f"{key}={spelled}"


def _drifted(key: str, old: Any, new: Any, run: Path, why: str) -> ConfigError:
    return ConfigError(key, new, message=f"train.resume: conf/ now composes {key}={_shown(new)} but the run in {run} "
                       f"trained with {_shown(old)}{why}: set it in conf/ as it was, or start a new run in another "
                       "hydra.run.dir")


def _differences(trained: Dict[str, Any], composed: Dict[str, Any],
                 exempt: Sequence[str]) -> Dict[str, Tuple[Any, Any]]:
    """{key: (recorded, composed)} for the keys a resume must keep (present in both configs)."""
    old, new = flatten(trained), flatten(composed)
    return {k: (old[k], new[k]) for k in old if k in new and old[k] != new[k] and treatment(k) == TRAINED
            and not any(fnmatch.fnmatchcase(k, pattern) for pattern in exempt)}


def _replan_manual_plan(replayed: Sequence[str], overrides: Sequence[str],
                        trained: Dict[str, Any]) -> Tuple[Tuple[str, ...], Optional[str]]:
    """A hand-written plan fits the allocation it was written for: when the command line changes
    the allocation (a cluster.* key) and names no plan of its own, the run re-plans with the default
    planner. Returns (keys then exempt from the comparison, the line saying so) or ((), None)."""
    planner = trained.get("planner") or {}
    if planner.get("name") != "manual":
        return (), None
    typed = {_key_of(o) for o in overrides}
    if any(k == "planner" or k.startswith("planner.") and treatment(k) == TRAINED for k in typed):
        return (), None
    cluster = flatten({"cluster": trained.get("cluster") or {}})
    changed = []
    for o in overrides:
        key = _key_of(o)
        if key.startswith("cluster.") and "=" in o:
            value = OverridesParser.create().parse_overrides([o])[0].value()
            if key in cluster and cluster[key] != value:
                changed.append(f"{key} {_shown(cluster[key])} -> {_shown(value)}")
    if not changed:
        return (), None
    return (("planner.*",), f"[hrlplan] resume on another allocation ({', '.join(changed)}): the run's hand-written "
            f"plan (planner.plan_file={planner.get('plan_file')}) was for the old one; re-planning with the default "
            "planner")


def _restored_line(run: Path, step: int, restored: Sequence[str], config: Dict[str, Any]) -> str:
    train = config.get("train") or {}
    arch = (config.get("arch") or {}).get("name")
    shown = " ".join(restored) if restored else "the defaults"
    return (f"[hrlplan] resuming {run} at step {step}: restored its config ({shown}; arch={arch} "
            f"steps={train.get('steps')} lr={train.get('lr')} global_batch_size={train.get('global_batch_size')} "
            f"seed={train.get('seed')})")


def say_once(line: str) -> None:
    """Printed by one process: under torchrun or srun every rank resumes the same way."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(line, file=sys.stderr, flush=True)

