"""Checks a user can trip, before any work starts: one line naming the key, the value and what is allowed.

- check_values: ranges of a composed config (positive steps, batch, seq_len, lr > 0, ...), run by
  hrlplan.compose.to_plain, so every composed config is checked.
- explain_compose_error: Hydra's composition errors (a typo, a bad choice, a wrong type) as one
  ConfigError line, with the nearest key we have instead of Hydra's "+key" hint.
- check_environment: what the launcher checks on this host before it starts workers: paths that
  must exist (resume, data, plan and cluster files, a model's config.json), a world size the host
  can run, a device that is there.
- load_yaml_text / parse_yaml_limited: YAML parsing with a size and expansion budget (an alias bomb
  cannot hang anything); every plan load (hrlplan.plan.Plan.from_yaml) goes through it.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Transformer
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from hrlplan import config as c
from hrlplan.data.sudoku import dataset_exists, resolve_preset
from hrlplan.errors import ConfigError, one_line

MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_NODES = 1_000_000   # values after alias expansion
LM_DATA = ("synthetic", "code")


# ---------------------------------------------------------------- value ranges
def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


POS_INT = ("a positive integer", lambda v: _int(v) and v > 0)
NONNEG_INT = ("an integer >= 0", lambda v: _int(v) and v >= 0)
POS = ("a number > 0", lambda v: _num(v) and v > 0)
NONNEG = ("a number >= 0", lambda v: _num(v) and v >= 0)
UNIT = ("a number in [0, 1]", lambda v: _num(v) and 0 <= v <= 1)
BETA = ("a number in [0, 1)", lambda v: _num(v) and 0 <= v < 1)
MARGIN = ("a number in (0, 1]", lambda v: _num(v) and 0 < v <= 1)
AUTO_OR_POS_INT = ("auto or a positive integer", lambda v: v == "auto" or _int(v) and v > 0)


def _optional(rule):
    desc, ok = rule
    return f"null or {desc}", lambda v: v is None or ok(v)


RULES = {
    "train.steps": POS_INT, "train.global_batch_size": POS_INT, "train.microbatches": AUTO_OR_POS_INT,
    "train.stages_per_rank": POS_INT, "train.lr": POS, "train.min_lr_ratio": UNIT,
    "train.warmup_steps": NONNEG_INT, "train.weight_decay": NONNEG, "train.beta1": BETA, "train.beta2": BETA,
    "train.grad_clip": ("null (no clipping) or a number >= 0", lambda v: v is None or _num(v) and v >= 0),
    "train.checkpoint_interval": NONNEG_INT, "train.log_interval": POS_INT,
    "train.eval_interval": _optional(POS_INT), "train.epochs": _optional(POS_INT),
    "train.stop_after": _optional(POS_INT), "train.puzzle_emb_lr": POS, "train.puzzle_emb_weight_decay": NONNEG,
    "train.resume": ("none, auto or a checkpoint directory", lambda v: isinstance(v, str) and v.strip() != ""),
    "data.seq_len": POS_INT, "data.num_workers": NONNEG_INT, "data.synthetic_chains": POS_INT,
    "data.vocab_size": POS_INT, "data.max_files": POS_INT,
    "cluster.nproc_per_node": AUTO_OR_POS_INT, "cluster.probe_matmul_n": POS_INT, "cluster.probe_p2p_mb": POS,
    "cluster.probe_repeats": POS_INT,
    "planner.max_pp": POS_INT, "planner.max_tp": POS_INT, "planner.memory_margin": MARGIN,
    "planner.microbatch_sizes": ("a non-empty list of positive integers",
                                 lambda v: isinstance(v, list) and bool(v) and all(_int(x) and x > 0 for x in v)),
    "planner.samples": POS_INT, "planner.train_steps": NONNEG_INT, "planner.batch_size": POS_INT,
    "planner.lr": POS, "planner.max_evaluations": POS_INT, "planner.refine_evaluations": NONNEG_INT,
    "planner.greedy_configs": NONNEG_INT,
}
ARCH_RULES = {
    "gpt2": {k: POS_INT for k in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")},
    "llama": {k: POS_INT for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "max_position_embeddings", "vocab_size")},
    "hrm": {**{k: POS_INT for k in ("H_cycles", "L_cycles", "H_layers", "L_layers", "hidden_size", "num_heads",
                                    "halt_max_steps")},
            "puzzle_emb_ndim": NONNEG_INT, "expansion": POS, "halt_exploration_prob": UNIT},
}
# (model kind, width key, heads key): the width must split evenly over the heads
HEAD_SPLITS = [("gpt2", "n_embd", "n_head"), ("llama", "hidden_size", "num_attention_heads"),
               ("llama", "num_attention_heads", "num_key_value_heads"), ("hrm", "hidden_size", "num_heads")]


def _get(tree: Dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _arch_kind(arch: Dict[str, Any]) -> Optional[str]:
    if arch.get("family") == "hrm":
        return "hrm"
    return arch.get("model_type") if arch.get("model_type") in ("gpt2", "llama") else None


def check_values(config: Dict[str, Any]) -> None:
    """Range checks of a plain (to_plain) config; the first bad value raises ConfigError."""
    for key, (desc, ok) in RULES.items():
        try:
            value = _get(config, key)
        except KeyError:
            continue   # a key of another planner or an older tree
        if not ok(value):
            raise ConfigError(key, value, desc)
    arch = config.get("arch") or {}
    kind = _arch_kind(arch)
    if arch.get("model_id"):
        kind = None   # sizes come from the model's own config.json
    for key, (desc, ok) in ARCH_RULES.get(kind, {}).items():
        if key in arch and not ok(arch[key]):
            raise ConfigError(f"arch.{key}", arch[key], desc)
    for k, width, heads in HEAD_SPLITS:
        if k == kind and _int(arch.get(width)) and _int(arch.get(heads)) and arch[width] % arch[heads]:
            raise ConfigError(f"arch.{width}", arch[width], f"a multiple of arch.{heads}={arch[heads]}")


# ---------------------------------------------------------------- Hydra's composition errors
def is_compose_error(e: BaseException) -> bool:
    return isinstance(e, (HydraException, OmegaConfBaseException))


def _schema_keys() -> Dict[str, List[str]]:
    """The keys a user can set, by parent path (arch/planner: the union over their schemas)."""
    def names(*schemas) -> List[str]:
        return sorted({f.name for s in schemas for f in fields(s)})

    keys = {"": names(c.Config) + ["experiment"], "train": names(c.TrainConfig), "data": names(c.DataConfig),
            "logger": names(c.LoggerConfig), "cluster": names(c.ClusterConfig),
            "arch": names(c.GPT2ArchConfig, c.LlamaArchConfig, c.HRMArchConfig), "arch.loss": names(c.HRMLossConfig),
            "planner": names(c.ExactPlannerSchema, c.HRLPlannerSchema, c.ManualPlannerSchema, c.RandomPlannerSchema)}
    return keys


def nearest_key(full_key: str) -> Optional[str]:
    parent, _, leaf = full_key.rpartition(".")
    known = _schema_keys()
    candidates = known.get(parent, [])
    if parent == "":   # a group key typed at the top level (steps=3) is close to train.steps too
        candidates = candidates + [f"{g}.{k}" for g in ("train", "data", "logger") for k in known[g]]
    best = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in candidates], n=1, cutoff=0.6)
    if not best:
        return None
    match = next(k for k in candidates if k.rpartition(".")[2] == best[0])
    return f"{parent}.{match}" if parent else match


def _override_value(key: str, overrides: Sequence[str]) -> Optional[str]:
    for o in overrides:
        k, sep, v = str(o).partition("=")
        if sep and k.lstrip("+~") == key:
            return v
    return None


def _allowed(object_type: Any, key: Any) -> Optional[str]:
    """What a schema field takes, in words, from its type hint."""
    if not (isinstance(object_type, type) and is_dataclass(object_type)):
        return None
    try:
        hint = typing.get_type_hints(object_type).get(str(key))
    except Exception:
        return None
    optional = type(None) in typing.get_args(hint)
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) in (list, List):
        inner = _allowed_type(typing.get_args(hint)[0]) if typing.get_args(hint) else "values"
        return f"a list of {inner}"
    words = ("one of " + ", ".join(m.value for m in hint)) if isinstance(hint, type) and issubclass(hint, Enum) \
        else _allowed_type(hint)
    return f"null or {words}" if optional and words else words


def _allowed_type(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "(" + " | ".join(m.value for m in hint) + ")"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, "a value")


def explain_compose_error(e: BaseException, overrides: Sequence[str] = ()) -> ConfigError:
    """Hydra's composition error as one ConfigError line naming the key, the value and what is allowed."""
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__
    text = str(e)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and re.search(r"Key '[^']+' (is )?not in",
                                                                                   str(cause)):
        key = getattr(cause, "full_key", None) or re.search(r"Key '([^']+)'", str(cause)).group(1)
        value = _override_value(key, overrides)
        near = nearest_key(key)
        hint = f"did you mean {near}?" if near else "python pretrain.py --help lists the keys"
        return ConfigError(key, value, message=f"unknown key {key}" + (f" (in {key}={value})" if value else "")
                           + f": {hint}")
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key = cause.full_key
        value = _override_value(key, overrides)
        if value is None:
            m = re.search(r"(?:value|Value) '([^']*)'", str(cause))
            value = m.group(1) if m else None
        choices = re.search(r"expected one of \[([^\]]*)\]", str(cause))
        allowed = (f"one of {choices.group(1)}" if choices else
                   _allowed(getattr(cause, "object_type", None), getattr(cause, "key", None)))
        return ConfigError(key, value, allowed or one_line(str(cause).splitlines()[0]))
    if isinstance(e, MissingConfigException):
        m = re.search(r"Could not (?:find|load) '([^']+)'", text)
        group, _, option = (m.group(1) if m else "").rpartition("/")
        if group and not group.startswith("hydra"):
            from hrlplan.compose import group_options   # why: compose imports this module

            return ConfigError(group, option, group_options(group))
    m = re.search(r"An item is already at '([^']+)'|'([^']+)' is already in the defaults list", text)
    if m:
        key = m.group(1) or m.group(2)
        return ConfigError(key, message=f"{key} is already in the config: set it without the leading + "
                                        f"({key}=...)")
    if isinstance(e, OverrideParseException):
        return ConfigError("override", message=f"could not parse the override: {one_line(text)}")
    return ConfigError("config", message=one_line(text + (f" ({cause})" if cause is not None else "")))


# ---------------------------------------------------------------- YAML with a budget
class YamlBudgetError(ValueError):
    """A YAML text over the size or alias-expansion budget; the message says which and the limit."""


def parse_yaml_limited(text: str) -> Any:
    """yaml.safe_load within MAX_YAML_BYTES and MAX_YAML_NODES once aliases are expanded; raises
    YamlBudgetError beyond them, yaml.YAMLError for text that is not YAML. An alias bomb (a billion
    laughs) is small on disk and expands exponentially in whatever walks the loaded tree: the node
    graph is composed first (aliases share their node, so this is linear) and its expanded size
    counted with memoization, before anything is built."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlBudgetError(f"is {len(text) / 2**20:.1f} MiB; a plan or cluster file is at most "
                              f"{MAX_YAML_BYTES // 2**20} MiB")
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    expanded = _expanded_size(node, {}) if node is not None else 0
    if expanded > MAX_YAML_NODES:
        raise YamlBudgetError(f"expands to {expanded:.3g} values through its YAML aliases (at most "
                              f"{MAX_YAML_NODES}); write the values out")
    return yaml.safe_load(text)


def load_yaml_text(text: str, source: str, key: str) -> Any:
    """parse_yaml_limited, its refusals as a ConfigError naming `key` (key=source ...)."""
    try:
        return parse_yaml_limited(text)
    except YamlBudgetError as err:
        raise ConfigError(key, source, message=f"{key}={source} {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(key, source, message=f"{key}={source} is not valid YAML: {one_line(err, 200)}") from None


def _expanded_size(node: Any, seen: Dict[int, int]) -> int:
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = MAX_YAML_NODES + 1   # a node reached again while counting it: a cycle, refuse
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(n, seen) for n in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, seen) + _expanded_size(v, seen) for k, v in node.value)
    else:
        size = 1
    seen[id(node)] = size
    return size


def _read_file(key: str, path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, path, message=f"{key}={path}: no such file" +
                          (" (it is a directory)" if p.is_dir() else ""))
    if p.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(key, path, message=f"{key}={path} is {p.stat().st_size / 2**20:.1f} MiB; at most "
                                             f"{MAX_YAML_BYTES // 2**20} MiB")
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(key, path, message=f"{key}={path} cannot be read: {one_line(err, 200)}") from None


def _refuse_on(key: str, path: str, load: Callable[[], Any]) -> Any:
    """load(), its error (whatever the parser raised) as one line naming the key."""
    try:
        return load()
    except ConfigError:
        raise
    except Exception as err:  # a hand-edited file can fail in any parser: say which key and why
        raise ConfigError(key, path, message=f"{key}={path} is not a valid file: {one_line(err, 300)}") from None


# ---------------------------------------------------------------- this host, before workers start
def check_environment(config: Any, launching: bool = True) -> None:
    """Everything the launcher can check before it starts workers; launching=False inside a job
    someone else launched (torchrun, SLURM), where the world size is theirs. config: the run's Config
    or its plain form (checked as plain values, the keys as users type them)."""
    config = c.as_dict(config)
    train, data, arch = config["train"], config.get("data") or {}, config.get("arch") or {}
    resume = str(train.get("resume", "none"))
    if resume not in ("none", "auto") and not Path(resume).exists():
        raise ConfigError("train.resume", resume, "none, auto or an existing checkpoint directory")
    _check_data(config, arch, data)
    _check_model_config(arch)
    planner, cluster = config.get("planner") or {}, config.get("cluster") or {}
    if str(planner.get("name")) == "manual":
        _check_plan_file(planner.get("plan_file"))
    if cluster.get("spec_file"):
        path = str(cluster["spec_file"])
        _refuse_on("cluster.spec_file", path, lambda: _load_cluster_spec(path))
    if train.get("device") == "cuda":
        import torch   # why: composing and checking a config never needs torch (`--help`, completion)

        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", message="train.device=cuda but this host has no CUDA device: "
                                                              "use train.device=auto or cpu")
    local = cluster.get("probe", True) and not cluster.get("spec_file")   # mode=plan probes these too
    if launching and local:
        check_world_size(cluster, str(train.get("device", "auto")))


def _check_data(config: Dict[str, Any], arch: Dict[str, Any], data: Dict[str, Any]) -> None:
    if arch.get("family") == "hrm":
        path = data.get("path") or config.get("data_path")
        if not path:
            return   # the trainer's default preset, built on first use
        if not dataset_exists(str(path)) and resolve_preset(str(path)) is None:
            key = "data_path" if config.get("data_path") else "data.path"
            raise ConfigError(key, path, message=f"{key}={path} has no train/dataset.json and test/dataset.json, "
                              "and its name is not a preset to build (sudoku-extreme-small, "
                              "sudoku-extreme-1k-aug-1000): give HRM's data directory, or build one with "
                              f"`hrlplan build-sudoku sudoku-extreme-small --out-dir {path}`")
    elif data.get("name") not in LM_DATA:
        raise ConfigError("data", data.get("name"), message=f"data={data.get('name')} is not a language-model "
                          f"data set: choose data=synthetic or data=code (or arch=hrm for puzzle data)")
    elif data.get("name") == "code" and data.get("source") and not Path(str(data["source"])).exists():
        raise ConfigError("data.source", data["source"], "an existing directory of .py/.jsonl(.gz)/.parquet files")


def _check_model_config(arch: Dict[str, Any]) -> None:
    """A local model directory (arch.model_id) must hold a readable config.json."""
    model_id = arch.get("model_id")
    if not model_id:
        return
    path = Path(str(model_id))
    target = path / "config.json" if path.is_dir() else path if path.suffix == ".json" else None
    if target is None:
        if str(model_id).startswith((".", "/", "~")) and not path.exists():
            raise ConfigError("arch.model_id", model_id, "a shipped arch, a local directory with config.json, "
                                                         "or a model id in the local HF cache")
        return   # an HF-cache id: model_meta resolves it, offline
    text = _read_file("arch.model_id", str(target))
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError("arch.model_id", model_id, message=f"arch.model_id={model_id}: {target} is not valid "
                          f"JSON ({err.msg} at line {err.lineno}); restore the model's config.json") from None
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise ConfigError("arch.model_id", model_id, message=f"arch.model_id={model_id}: {target} has no "
                          "model_type; restore the model's config.json")


def _check_plan_file(plan_file: Any) -> None:
    if not plan_file:
        raise ConfigError("planner.plan_file", None, "the path of a plan.yaml (planner=manual trains that plan)")
    from hrlplan.plan import Plan   # why: plan loads its YAML through this module

    path = str(plan_file)
    text = _read_file("planner.plan_file", path)
    data = load_yaml_text(text, path, "planner.plan_file")
    _refuse_on("planner.plan_file", path, lambda: Plan.from_dict(data, source=path))


def _load_cluster_spec(path: str) -> Any:
    from hrlplan.cluster import ClusterSpec   # why: it brings torch, as above

    data = json.loads(_read_file("cluster.spec_file", path))
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return ClusterSpec.from_dict(data)


def host_capacity(device: str = "auto") -> tuple:
    """(workers this host runs without sharing, what they are): GPUs, else CPU cores."""
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "GPU(s)"
    return len(os.sched_getaffinity(0)), "CPU core(s)"


def check_world_size(cluster: Dict[str, Any], device: str = "auto") -> None:
    """More local workers than GPUs (or CPU cores) would share devices, or hang a CPU host for
    minutes in rendezvous and probing: refused unless cluster.oversubscribe=true."""
    n = cluster.get("nproc_per_node", "auto")
    if n in (None, "auto") or cluster.get("oversubscribe"):
        return
    capacity, what = host_capacity(device)
    if int(n) > capacity:
        raise ConfigError("cluster.nproc_per_node", n, message=f"cluster.nproc_per_node={n} is more workers than "
                          f"this host has {what} ({capacity}): use at most {capacity} (or auto), or set "
                          "cluster.oversubscribe=true to start them anyway")


def precheck_overrides(overrides: Sequence[str], compose: Callable[[List[str]], Any], multirun: bool = True,
                       limit: int = 24) -> List[Any]:
    """Compose each point a (multirun) override list describes, one sweep value at a time, so a bad
    value anywhere in a sweep is refused before the first job starts. Returns the composed configs."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        if not is_compose_error(e):
            raise
        raise explain_compose_error(e, overrides) from None
    base, sweeps = [], []
    for text, o in zip(overrides, parsed):
        if o.is_sweep_override():
            if not multirun:
                raise ConfigError(o.get_key_element(), text.partition("=")[2], message=f"{text} lists several "
                                  "values: add -m (--multirun) to run one job per value")
            try:
                if isinstance(o.value(), Glob):   # `-m 'arch=glob(gpt2*)'`: the group's options it matches
                    from hrlplan.compose import group_options   # why: as above

                    values = o.value().filter(group_options(o.key_or_group))
                else:
                    values = list(o.sweep_iterator(transformer=Transformer.encode))
            except Exception:  # an interval sweep (a sweeper plugin samples it): nothing to list
                continue
            if not values:
                continue
            sweeps.append((o.get_key_element(), values))
        else:
            base.append(text)
    points = [[f"{k}={v[0]}" for k, v in sweeps]]
    for i, (k, values) in enumerate(sweeps):
        for v in values[1:]:
            point = list(points[0])
            point[i] = f"{k}={v}"
            points.append(point)
    return [compose(base + p) for p in points[:limit]]
