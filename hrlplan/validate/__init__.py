"""Checks a user can trip, before any work starts: one line naming the key, the value and what is allowed.
What is refused, and why, is listed in docs/refused.md.

- check_values (ranges.py): ranges of a composed config (positive steps, batch, seq_len, lr > 0, finite
  numbers, probabilities in [0, 1), ...) and the checks across keys of consistency.py (unknown keys, a
  key of another option, a family's own keys (HRM's) without it, values refused together), run by
  hrlplan.compose.to_plain, so every composed config is checked.
- explain_compose_error (hydra_errors.py): Hydra's composition errors (a typo, a bad choice, a wrong
  type) as one ConfigError line, with the nearest key we have (or the option that has it) instead of
  Hydra's "+key" hint. precheck_overrides: every point of a sweep composed and checked before the
  first job starts.
- check_environment (host.py): what the launcher checks on this host before it starts workers; a
  manual plan against the run (manual_plan.py).
- load_yaml_text (files.py): YAML within hrlplan/yaml_budget.py's size and expansion budget, refused as one line.
"""
from hrlplan.validate.consistency import override_keys
from hrlplan.validate.files import load_yaml_text
from hrlplan.validate.host import check_environment, check_world_size, host_capacity
from hrlplan.validate.hydra_errors import explain_compose_error, is_compose_error, nearest_key, precheck_overrides
from hrlplan.validate.ranges import check_values
from hrlplan.yaml_budget import MAX_YAML_BYTES, MAX_YAML_NODES, YamlBudgetError, parse_yaml_limited

__all__ = ["check_values", "explain_compose_error", "is_compose_error", "nearest_key", "precheck_overrides",
           "check_environment", "check_world_size", "host_capacity", "override_keys", "load_yaml_text",
           "parse_yaml_limited", "YamlBudgetError", "MAX_YAML_BYTES", "MAX_YAML_NODES"]
