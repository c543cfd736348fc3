"""Reading the files a run names (plan, cluster spec, a model's config.json) as one-line refusals: YAML
with a size and alias-expansion budget (an alias bomb cannot hang anything; every plan load,
hrlplan.plan.Plan.from_yaml, goes through it), a file that must exist and be small, a parser's error
naming the key that pointed at the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

import yaml

from hrlplan.errors import ConfigError, UserError, one_line

MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_NODES = 1_000_000   # values after alias expansion


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
