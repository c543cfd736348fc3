"""YAML with a size and alias-expansion budget: an alias bomb cannot hang anything. Every plan load
(hrlplan.plan.Plan.from_yaml) and every file a run names (hrlplan/validate/files.py) goes through it.
A leaf: plans and the checks both read YAML, neither through the other."""
from __future__ import annotations

from typing import Any, Dict

import yaml

MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_NODES = 1_000_000   # values after alias expansion


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
