"""Checks a user can trip, before any work starts: one line naming the key, the value and what is allowed.
What is refused, and why, is listed in docs/refused.md.

- check_values: ranges of a composed config (positive steps, batch, seq_len, lr > 0, finite numbers,
  probabilities in [0, 1), ...) and the checks across keys of consistency.py (unknown keys, a key of
  another option, HRM's keys without arch=hrm, values refused together), run by
  hrlplan.compose.to_plain, so every composed config is checked.
- explain_compose_error: Hydra's composition errors (a typo, a bad choice, a wrong type) as one
  ConfigError line, with the nearest key we have (or the option that has it) instead of Hydra's
  "+key" hint.
- precheck_overrides: every point of a sweep composed and checked before the first job starts.
- check_environment (host.py): what the launcher checks on this host before it starts workers.
- load_yaml_text (files.py): YAML within hrlplan/yaml_budget.py's size and expansion budget, refused as one line.
"""
from __future__ import annotations

import difflib
import math
import re
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Transformer
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from hrlplan import config as c
from hrlplan.conf_tree import group_options
from hrlplan.errors import ConfigError, one_line
from hrlplan.families import FAMILIES, family_of
from hrlplan.validate.consistency import another_option_hint, check_together, override_keys
from hrlplan.validate.files import load_yaml_text
from hrlplan.yaml_budget import MAX_YAML_BYTES, MAX_YAML_NODES, YamlBudgetError, parse_yaml_limited
from hrlplan.validate.host import check_environment, check_world_size, host_capacity

__all__ = ["check_values", "explain_compose_error", "is_compose_error", "nearest_key", "precheck_overrides",
           "check_environment", "check_world_size", "host_capacity", "override_keys", "load_yaml_text",
           "parse_yaml_limited", "YamlBudgetError", "MAX_YAML_BYTES", "MAX_YAML_NODES"]


# ---------------------------------------------------------------- value ranges
def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


POS_INT = ("a positive integer", lambda v: _int(v) and v > 0)
NONNEG_INT = ("an integer >= 0", lambda v: _int(v) and v >= 0)
POS = ("a finite number > 0", lambda v: _num(v) and 0 < v < math.inf)
NONNEG = ("a finite number >= 0", lambda v: _num(v) and 0 <= v < math.inf)
UNIT = ("a number in [0, 1]", lambda v: _num(v) and 0 <= v <= 1)
BETA = ("a number in [0, 1)", lambda v: _num(v) and 0 <= v < 1)
PROBABILITY = ("a probability in [0, 1) (1 would drop everything)", BETA[1])
VOCAB = ("an integer >= 2 (with one token there is nothing to predict, and nothing trains)",
         lambda v: _int(v) and v >= 2)
MARGIN = ("a number in (0, 1]", lambda v: _num(v) and 0 < v <= 1)
AUTO_OR_POS_INT = ("auto or a positive integer", lambda v: v == "auto" or _int(v) and v > 0)
RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")   # auto: searched per stage (hrlplan.plan.checks)


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
    "planner.greedy_configs": NONNEG_INT, "planner.max_simulations": POS_INT, "planner.hidden": POS_INT,
    "planner.hetero_time_s": POS, "planner.hetero_share_steps": POS_INT, "planner.hetero_max_rounds": POS_INT,
    "planner.hetero_template_simulations": POS_INT,
    "planner.entropy_coef": NONNEG,
    "planner.calibrate": ("one of " + ", ".join(c.CALIBRATE_CHOICES),
                          lambda v: isinstance(v, bool) or str(v).lower() in c.CALIBRATE_CHOICES),
    "planner.heterogeneous": ("one of auto, true, false",
                              lambda v: isinstance(v, bool) or str(v).lower() in ("auto", "true", "false")),
    "planner.recompute": ("one of " + ", ".join(RECOMPUTE_CHOICES), lambda v: v in RECOMPUTE_CHOICES),
    "train.context_parallel": POS_INT,
    "train.plan_timeout_min": _optional(POS), "train.collective_timeout_min": _optional(POS),
    "cluster.inter_node_GBps": POS, "cluster.inter_node_latency_us": NONNEG, "cluster.intra_node_latency_us": NONNEG,
}
NODE_GROUP_RULES = {"count": POS_INT, "devices_per_node": POS_INT, "memory_gb": POS, "tflops": POS,
                    "intra_node_GBps": POS}
# families.py names each arch size's rule; these are the rules
RULE_KINDS = {"pos_int": POS_INT, "nonneg_int": NONNEG_INT, "pos": POS, "unit": UNIT, "probability": PROBABILITY,
              "vocab": VOCAB}


def _get(tree: Dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def check_values(config: Dict[str, Any], explicit: Sequence[str] = ()) -> None:
    """Range checks of a plain (to_plain) config, then the checks across keys (consistency.py);
    explicit: the keys the command line set. The first bad value raises ConfigError."""
    for key, (desc, ok) in RULES.items():
        try:
            value = _get(config, key)
        except KeyError:
            continue   # a key of another planner or an older tree
        if not ok(value):
            raise ConfigError(key, value, desc)
    for i, group in enumerate((config.get("cluster") or {}).get("node_groups") or []):
        for key, (desc, ok) in NODE_GROUP_RULES.items():
            if isinstance(group, dict) and key in group and not ok(group[key]):
                raise ConfigError(f"cluster.node_groups.{i}.{key}", group[key], desc)
    _check_arch_sizes(config.get("arch") or {})
    check_together(config, explicit)


def _check_arch_sizes(arch: Dict[str, Any]) -> None:
    """The ranges of the arch family's sizes (families.py), unless the model's own config.json has them."""
    if arch.get("model_id"):
        return
    family = family_of(arch)
    for key, kind in family.value_rules.items():
        desc, ok = RULE_KINDS[kind]
        if key in arch and not ok(arch[key]):
            raise ConfigError(f"arch.{key}", arch[key], desc)
    for width, heads in family.head_splits:
        if _int(arch.get(width)) and _int(arch.get(heads)) and arch[width] % arch[heads]:
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
            "arch": names(*(f.schema for f in FAMILIES if f.schema)), "arch.loss": names(c.HRMLossConfig),
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
        hint = another_option_hint(key) if near == key else None   # the key of another arch or planner
        hint = hint or (f"did you mean {near}?" if near and near != key else "python pretrain.py --help lists the keys")
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
            return ConfigError(group, option, group_options(group))
    m = re.search(r"An item is already at '([^']+)'|'([^']+)' is already in the defaults list", text)
    if m:
        key = m.group(1) or m.group(2)
        return ConfigError(key, message=f"{key} is already in the config: set it without the leading + "
                                        f"({key}=...)")
    if isinstance(e, OverrideParseException):
        return ConfigError("override", message=f"could not parse the override: {one_line(text)}")
    return ConfigError("config", message=one_line(text + (f" ({cause})" if cause is not None else "")))


def precheck_overrides(overrides: Sequence[str], compose: Callable[[List[str]], Any], multirun: bool = True,
                       limit: int = 24) -> List[Any]:
    """Compose each point a (multirun) override list describes, one sweep value at a time, so a bad
    value anywhere in a sweep is refused before the first job starts. Returns the composed configs.
    A `hydra.searchpath=[...]` among the overrides (the user's own arch/cluster/... options) is
    composed with every point."""
    overrides = list(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
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


def _is_searchpath(override: str) -> bool:
    return str(override).lstrip("+~").startswith("hydra.searchpath=")
