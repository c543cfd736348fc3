"""Reading the files a run names (plan, cluster spec, a model's config.json) as one-line refusals: YAML
within hrlplan/yaml_budget.py's budget, a file that must exist and be small, a parser's error naming
the key that pointed at the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

from hrlplan.errors import ConfigError, UserError, one_line
from hrlplan.yaml_budget import MAX_YAML_BYTES, YamlBudgetError, parse_yaml_limited


def load_yaml_text(text: str, source: str, key: str) -> Any:
    """parse_yaml_limited, its refusals as a ConfigError naming `key` (key=source ...)."""
    try:
        return parse_yaml_limited(text)
    except YamlBudgetError as err:
        raise ConfigError(key, source, message=f"{key}={source} {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(key, source, message=f"{key}={source} is not valid YAML: {one_line(err, 200)}") from None


def read_file(key: str, path: str) -> str:
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


def refuse_on(key: str, path: str, load: Callable[[], Any]) -> Any:
    """load(), its error (whatever the parser raised) as one line naming the key."""
    try:
        return load()
    except ConfigError:
        raise
    except UserError as err:
        if str(err).startswith(f"{path}:"):   # a loader's own "<file>: <field>: what to do" (PlanError)
            raise ConfigError(key, path, message=f"{key}={one_line(err, 400)}") from None
        raise ConfigError(key, path, message=f"{key}={path} is not a valid file: {one_line(err, 300)}") from None
    except Exception as err:  # a hand-edited file can fail in any parser: say which key and why
        raise ConfigError(key, path, message=f"{key}={path} is not a valid file: {one_line(err, 300)}") from None
