"""Checks across keys of a composed config, before anything starts: keys no schema has (`+train.foo=1`),
a key of another option (`planner.train_steps` without `planner=hrl`), a family's own keys (HRM's) without it,
and values that are fine alone but not together (stages per rank and the schedule, micro-batches and
the batch, HRM's evaluation interval and epochs, the sequence length and the model's positions).

`explicit`: the dotted keys the command line set (compose.override_keys); a value a user typed is
refused where the same value coming from a default or a recipe is not (HRM's data.seq_len).
"""
from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any, Dict, Iterable, List, Optional, Sequence

from hrlplan import config as c
from hrlplan.conf_tree import arch_options_by_schema
from hrlplan.data.packing_options import packing_refusal
from hrlplan.errors import ConfigError
from hrlplan.families import FAMILIES, PUZZLE_DATA, by_schema_option, family_of
from hrlplan.schedules import multi_stage_names

PLANNER_SCHEMAS = {"exact": c.ExactPlannerSchema, "hrl": c.HRLPlannerSchema, "manual": c.ManualPlannerSchema,
                   "random": c.RandomPlannerSchema}
GROUP_SCHEMAS = {"train": c.TrainConfig, "data": c.DataConfig, "logger": c.LoggerConfig, "cluster": c.ClusterConfig}


def override_keys(overrides: Iterable[str]) -> set:
    """The dotted keys a list of Hydra overrides sets ("+train.seed=1" -> "train.seed"; HRM's top-level
    spellings also as their group key: "lr=1e-4" -> "lr" and "train.lr")."""
    keys = set()
    for o in overrides:
        key = str(o).split("=", 1)[0].lstrip("+~").strip()
        if key and not key.startswith("hydra"):
            key = key.split("@", 1)[0]
            keys.add(key)
            if key in c.TOP_LEVEL_ALIASES:
                keys.add(".".join(c.TOP_LEVEL_ALIASES[key]))
    return keys


def _names(schema: type) -> List[str]:
    return [f.name for f in fields(schema)]


def options_owning(full_key: str) -> List[str]:
    """The options (`planner=hrl`, `arch=hrm`) whose schema has this key; [] when none or not a group key."""
    group, _, rest = full_key.partition(".")
    leaf = rest.split(".")[0]
    if group == "planner":
        return [f"planner={name}" for name, schema in PLANNER_SCHEMAS.items() if leaf in _names(schema)]
    if group == "arch":
        owned = []
        for schema_name, family in by_schema_option().items():
            if leaf in _names(family.schema):   # the family's base option (gpt2) before its sizes
                options = sorted(arch_options_by_schema().get(schema_name, []), key=lambda o: (len(o), o))
                owned += [f"arch={o}" for o in options]
        return owned
    return []


def another_option_hint(full_key: str) -> Optional[str]:
    """'planner.train_steps is a key of planner=hrl; add planner=hrl' when the key is another option's."""
    owners = options_owning(full_key)
    if not owners:
        return None
    shown = owners if len(owners) <= 4 else owners[:4] + ["..."]
    return (f"{full_key} is a key of {' or '.join(shown)}, not of the {full_key.split('.')[0]} this run uses; "
            f"add {owners[0]}" + (" (or another of those)" if len(owners) > 1 else "") + " to use it, or leave it out")


def _unknown(full_key: str, known: Iterable[str]) -> ConfigError:
    leaf = full_key.rpartition(".")[2]
    parent = full_key.rpartition(".")[0]
    hint = another_option_hint(full_key)
    if hint is None:
        near = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.6)
        hint = (f"did you mean {parent + '.' if parent else ''}{near[0]}?" if near
                else "python pretrain.py --help lists the keys")
    return ConfigError(full_key, message=f"unknown key {full_key} (from +{full_key}=... or a config file): {hint}")


def check_known_keys(config: Dict[str, Any]) -> None:
    """Every key of the composed tree is one its schema has: `+train.foo=1` is refused here, not by a
    traceback when the run's typed config is built."""
    top = set(_names(c.Config))
    for key in config:
        if key not in top:
            raise _unknown(key, top)
    for group, schema in GROUP_SCHEMAS.items():
        known = _names(schema)
        for key in config.get(group) or {}:
            if key not in known:
                raise _unknown(f"{group}.{key}", known)
    for i, node in enumerate((config.get("cluster") or {}).get("node_groups") or []):
        known = _names(c.NodeGroupConfig)
        for key in node if isinstance(node, dict) else ():
            if key not in known:
                raise _unknown(f"cluster.node_groups.{i}.{key}", known)
    planner = config.get("planner") or {}
    schema = PLANNER_SCHEMAS.get(str(planner.get("name")))
    if schema is not None:
        known = _names(schema)
        for key in planner:
            if key not in known:
                raise _unknown(f"planner.{key}", known)
    arch = config.get("arch") or {}
    schema = family_of(arch).schema
    if schema is not None:
        known = _names(schema)
        for key in arch:
            if key not in known:
                raise _unknown(f"arch.{key}", known)


def check_family_keys(config: Dict[str, Any], explicit: Sequence[str]) -> None:
    """Keys only another family's trainer reads (HRM's, families.py's own_*_keys) would be stored and
    silently unused: refused, naming them. Refused rather than selecting that family: a language-model
    command with a stray key must not turn into another model on another data set (docs/refused.md)."""
    family = family_of(config.get("arch"))
    train = config.get("train") or {}
    for other in FAMILIES:
        if other is family or not (other.own_top_keys or other.own_train_keys):
            continue
        typed = [k for k in other.own_top_keys if config.get(k) is not None]
        typed += [f"train.{k}" for k in other.own_train_keys if config.get(k) is None and (
            f"train.{k}" in explicit or (k in ("epochs", "checkpoint_path") and train.get(k) is not None))]
        if typed:
            names = ", ".join(dict.fromkeys(typed))
            plural = "s" if len(typed) > 1 else ""
            model = (config.get("arch") or {}).get("name")
            raise ConfigError(typed[0], message=f"{names}: {other.name.upper()}'s key{plural}, which a language "
                              f"model ({model}) does not read: add {other.select_hint} "
                              f"to train {other.name.upper()}, or leave them out (a language model trains "
                              "train.steps steps)")


def check_together(config: Dict[str, Any], explicit: Sequence[str] = ()) -> None:
    """Values that are refused together; each message names both keys and what to do."""
    explicit = set(explicit)
    check_known_keys(config)
    check_family_keys(config, explicit)
    train, data = config.get("train") or {}, config.get("data") or {}
    arch, planner = config.get("arch") or {}, config.get("planner") or {}
    cluster = config.get("cluster") or {}
    if cluster.get("probe") is False and not cluster.get("spec_file") and not cluster.get("node_groups"):
        raise ConfigError("cluster.probe", False, message="cluster.probe=false plans for cluster.node_groups, and "
                          "there are none: choose a preset (cluster=a100x8-1n), give cluster.spec_file, or probe")
    _check_stages_per_rank(train, planner)
    _check_microbatches(train)
    family = family_of(arch)
    packing = str(data.get("packing") or "concat")
    refused = packing_refusal(packing, str(data.get("name")), family.data_kind == PUZZLE_DATA,
                              train=train)
    if refused:
        raise ConfigError("data.packing", packing, message=refused)
    if family.data_kind == PUZZLE_DATA:
        _check_puzzle_run(train, data, explicit)
    elif not arch.get("model_id"):
        _check_positions(family.positions_key, arch, data)


def _check_stages_per_rank(train: Dict[str, Any], planner: Dict[str, Any]) -> None:
    spr = train.get("stages_per_rank", 1)
    if not isinstance(spr, int) or spr <= 1:
        return
    schedules = [str(s) for s in planner.get("schedules") or []] or [str(train.get("schedule"))]
    if not any(s in multi_stage_names() for s in schedules):
        where = (f"planner.schedules={schedules}" if planner.get("schedules")
                 else f"train.schedule={train.get('schedule')}")
        raise ConfigError("train.stages_per_rank", spr, message=f"train.stages_per_rank={spr} needs a schedule that "
                          f"runs several stages per rank ({' or '.join(multi_stage_names())}), but {where} runs "
                          f"one: set train.schedule=interleaved_1f1b, or train.stages_per_rank=1")


def _check_microbatches(train: Dict[str, Any]) -> None:
    m, batch = train.get("microbatches"), train.get("global_batch_size")
    if not isinstance(m, int) or isinstance(m, bool) or not isinstance(batch, int) or batch <= 0:
        return
    if m > batch or batch % m:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        raise ConfigError("train.microbatches", m, message=f"train.microbatches={m} does not divide "
                          f"train.global_batch_size={batch} into equal micro-batches: set train.microbatches to "
                          f"one of {shown} (or auto, the planner's choice), or change train.global_batch_size")


def _check_puzzle_run(train: Dict[str, Any], data: Dict[str, Any], explicit: set) -> None:
    epochs, every = train.get("epochs"), train.get("eval_interval")
    if isinstance(epochs, int) and isinstance(every, int) and every > 0 and epochs % every:
        raise ConfigError("train.eval_interval", every, message=f"eval_interval={every} does not divide "
                          f"epochs={epochs}: HRM trains in rounds of eval_interval epochs, so epochs must be a "
                          f"multiple of it (e.g. epochs={epochs - epochs % every or every})")
    if "data.seq_len" in explicit:
        raise ConfigError("data.seq_len", data.get("seq_len"), message=f"data.seq_len={data.get('seq_len')} is not "
                          "used by arch=hrm: HRM's sequence length is its data set's (81 for sudoku, from "
                          "data.path); leave data.seq_len out")


def _check_positions(key: Optional[str], arch: Dict[str, Any], data: Dict[str, Any]) -> None:
    key = key or ("n_positions" if "n_positions" in arch else "max_position_embeddings")
    positions, seq = arch.get(key), data.get("seq_len")
    if isinstance(positions, int) and isinstance(seq, int) and seq > positions:
        raise ConfigError("data.seq_len", seq, message=f"data.seq_len={seq} is longer than the model's "
                          f"{positions} positions (arch.{key}={positions}): set data.seq_len<={positions} or "
                          f"arch.{key}={seq}")
