"""Hydra's composition errors (a typo, a bad choice, a wrong type) as one ConfigError line, with the nearest
key we have (or the option that has it) instead of Hydra's "+key" hint; and every point of a sweep composed
and checked before the first job starts (precheck_overrides)."""
from __future__ import annotations

import difflib
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
from hrlplan.families import FAMILIES
from hrlplan.validate.consistency import another_option_hint


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
