"""Resolving the CLI's --cluster / --model-meta arguments and planner config files (no Hydra)."""
from __future__ import annotations

from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Tuple

import yaml

from hrlplan.cluster import ClusterSpec, spec_from_preset
from hrlplan.config import ClusterConfig, TrainConfig
from hrlplan.errors import UserError
from hrlplan.conf_tree import conf_dir
from hrlplan.model_meta import ModelMeta, introspect, resolve_arch
from hrlplan.search.config import (ExactPlannerConfig, HRLPlannerConfig, ManualPlannerConfig,
                                   RandomPlannerConfig)

PLANNER_SCHEMAS = {"exact": ExactPlannerConfig, "hrl": HRLPlannerConfig, "manual": ManualPlannerConfig,
                   "random": RandomPlannerConfig}
TRAIN_KEYS = ("global_batch_size", "schedule", "stages_per_rank", "microbatches", "dtype", "dp_mode")


def cluster_presets() -> list:
    return sorted(p.stem for p in (conf_dir() / "cluster").glob("*.yaml") if p.stem != "local")


def load_preset_config(name: str) -> Dict[str, Any]:
    path = conf_dir() / "cluster" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text()) or {}
    raw.pop("defaults", None)
    base = asdict(ClusterConfig())
    base.update(raw)
    base["node_groups"] = [dict(g) for g in base["node_groups"]]
    return base


def load_cluster(arg: str) -> ClusterSpec:
    """A cluster.json path, or a conf/cluster preset name."""
    path = Path(arg)
    if path.is_file():
        return ClusterSpec.load(path)
    if arg in cluster_presets():
        return spec_from_preset(load_preset_config(arg))
    raise UserError(f"--cluster '{arg}' is neither a cluster.json file nor a preset; presets: "
                    f"{', '.join(cluster_presets())} (or run `hrlplan probe-cluster --out cluster.json`)")


@lru_cache(maxsize=32)
def _introspect_arch(name: str, seq_len) -> ModelMeta:
    return introspect(resolve_arch(name), seq_len=seq_len)


def load_meta(arg: str, seq_len: int | None = None) -> ModelMeta:
    """A model_meta.json path, or a shipped arch name (introspected on the meta device)."""
    path = Path(arg)
    if path.is_file() and path.suffix == ".json":
        return ModelMeta.load(path)
    try:
        return _introspect_arch(arg, seq_len)
    except ValueError as e:
        raise UserError(f"--model-meta '{arg}': not a model_meta.json file; {e}") from None


def planner_and_train_cfg(path: str | None, name: str = "hrl") -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Merge a --planner-cfg YAML ({planner: {...}, train: {...}} or flat planner keys) over defaults."""
    data: Dict[str, Any] = {}
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a mapping with planner: and train: sections")
    planner = dict(data.get("planner", {k: v for k, v in data.items() if k != "train"}))
    planner.pop("defaults", None)
    name = planner.get("name", name)
    if name not in PLANNER_SCHEMAS:
        raise UserError(f"planner name '{name}' unknown; choose one of {', '.join(PLANNER_SCHEMAS)}")
    base = asdict(PLANNER_SCHEMAS[name]())
    unknown = set(planner) - set(base)
    if unknown:
        raise UserError(f"{path}: unknown planner key(s) {sorted(unknown)}; known: {', '.join(sorted(base))}")
    base.update(planner)
    train = {k: v for k, v in asdict(TrainConfig()).items() if k in TRAIN_KEYS}
    train.update(data.get("train", {}) or {})
    return base, train
