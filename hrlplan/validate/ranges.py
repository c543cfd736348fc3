"""Value ranges of a composed config: positive steps and batch, lr > 0, finite numbers, probabilities in
[0, 1), each arch family's sizes (hrlplan/families.py names their rules), then the checks across keys
(consistency.py). Run by hrlplan.compose.to_plain, so every composed config is checked."""
from __future__ import annotations

import math
from typing import Any, Dict, Sequence

from hrlplan import config as c
from hrlplan.errors import ConfigError
from hrlplan.families import family_of
from hrlplan.validate.consistency import check_together


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
    "data.vocab_size": POS_INT, "data.max_files": POS_INT, "data.dispatch_budget_s": POS, "data.dispatch_prefetch": POS_INT,
    "cluster.nproc_per_node": AUTO_OR_POS_INT, "cluster.probe_matmul_n": POS_INT, "cluster.probe_p2p_mb": POS,
    "cluster.probe_repeats": POS_INT,
    "planner.max_pp": POS_INT, "planner.max_tp": POS_INT, "planner.memory_margin": MARGIN,
    "planner.microbatch_sizes": ("a non-empty list of positive integers",
                                 lambda v: isinstance(v, list) and bool(v) and all(_int(x) and x > 0 for x in v)),
    "planner.samples": POS_INT, "planner.train_steps": NONNEG_INT, "planner.batch_size": POS_INT,
    "planner.lr": POS, "planner.max_evaluations": POS_INT, "planner.refine_evaluations": NONNEG_INT,
    "planner.greedy_configs": NONNEG_INT, "planner.max_simulations": POS_INT, "planner.max_search_s": _optional(POS), "planner.hidden": POS_INT,
    "planner.hetero_time_s": POS, "planner.hetero_share_steps": POS_INT, "planner.hetero_max_rounds": POS_INT,
    "planner.hetero_template_simulations": POS_INT, "planner.hetero_single_simulations": POS_INT,
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
