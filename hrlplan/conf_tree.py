"""The shipped Hydra config tree (conf/) on disk: where it is, the options of each group as a user
sees them (the schemas left out), and a shipped arch read without Hydra. A leaf beside config.py (the
schemas): compose, validate and model_meta read the tree through this module, none through another."""
from __future__ import annotations

import functools
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import yaml
from hydra.core.global_hydra import GlobalHydra

from hrlplan.errors import UserError
from hrlplan.families import by_schema_option

SCHEMA_SUFFIX = "_schema"


def conf_dir() -> Path:
    """The shipped Hydra config tree: $HRLPLAN_CONF, else the package's conf/ (a link to the
    checkout's conf/, copied into a wheel), else conf/ beside the package (a checkout whose
    filesystem kept the link as a plain file)."""
    env = os.environ.get("HRLPLAN_CONF")
    here = Path(__file__).resolve().parent
    candidates = [Path(env)] if env else [here / "conf", here.parent / "conf"]
    for path in candidates:
        if (path / "config.yaml").is_file():
            return path
    raise UserError(f"hrlplan's config tree is not at {candidates[-1]}" + (" ($HRLPLAN_CONF)" if env else "") +
                    ": reinstall hrlplan (`pip install -e .` from a checkout), or set HRLPLAN_CONF=<checkout>/conf")


def is_internal_config(name: str) -> bool:
    """A schema the yaml files extend (`- gpt2_schema`), not an option a user picks."""
    return name.endswith(SCHEMA_SUFFIX) or name == "base_config"


def group_options(group: str) -> List[str]:
    """The options a user can pick for a config group (schemas left out): Hydra's listing inside a
    composition (a hydra.searchpath adds the user's own), else conf/<group>/*.yaml."""
    if GlobalHydra.instance().is_initialized():
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    else:
        options = [p.stem for p in (conf_dir() / group).glob("*.yaml")]
    return sorted(o for o in options if not is_internal_config(o))


def config_groups_help() -> str:
    if GlobalHydra.instance().is_initialized():
        groups = GlobalHydra.instance().config_loader().list_groups("")
    else:
        groups = [p.name for p in conf_dir().iterdir() if p.is_dir()]
    groups = sorted(g for g in groups if g != "hydra")
    return "\n".join(f"{g}: {', '.join(group_options(g))}" for g in groups)


def shipped_archs() -> List[str]:
    return sorted(p.stem for p in (conf_dir() / "arch").glob("*.yaml"))


def _schema_defaults(raw: Dict[str, Any]) -> List[str]:
    return [d for d in raw.get("defaults") or [] if isinstance(d, str) and d in by_schema_option()]


def load_shipped_arch(name: str) -> Dict[str, Any]:
    """A conf/arch/<name>.yaml merged over its family's schema defaults (without Hydra)."""
    raw = yaml.safe_load((conf_dir() / "arch" / f"{name}.yaml").read_text()) or {}
    defaults = _schema_defaults(raw)
    raw.pop("defaults", None)
    base = asdict(by_schema_option()[defaults[0]].schema()) if defaults else {}
    base.update(raw)
    return base


@functools.lru_cache(maxsize=None)
def arch_options_by_schema() -> Dict[str, List[str]]:
    """The shipped arch options, by the schema their YAML extends (gpt2_schema: gpt2, gpt2-tiny, ...)."""
    out: Dict[str, List[str]] = {name: [] for name in by_schema_option()}
    for path in sorted((conf_dir() / "arch").glob("*.yaml")):
        try:
            raw = yaml.safe_load(path.read_text()) or {}
            defaults = _schema_defaults(raw) if isinstance(raw, dict) else []
        except (OSError, yaml.YAMLError):
            continue
        for d in defaults:
            out.setdefault(d, []).append(path.stem)
    return out
