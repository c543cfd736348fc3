"""Composing the run's config with Hydra: the schemas registered in Hydra's ConfigStore (hidden from
listings and completion), conf/ composed with overrides outside @hydra.main, and the composed config
made plain for the library -- HRM's top-level keys copied into their groups, a family's recipe defaults
(hrlplan/families.py), the range checks of hrlplan/validate/. The schemas themselves are in
hrlplan/config.py and the families' in families.py (leaves), the tree on disk in conf_tree.py; this
module sits with the facts because it validates."""
from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Any, Dict, Iterable, List, Sequence

from hydra import compose as hydra_compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from omegaconf import OmegaConf

from hrlplan.conf_tree import conf_dir, config_groups_help, is_internal_config
from hrlplan.config import (TOP_LEVEL_ALIASES, ClusterConfig, Config, DataConfig, ExactPlannerSchema, HRLPlannerSchema,
                            HRMLossConfig, LoggerConfig, ManualPlannerSchema, RandomPlannerSchema, TrainConfig)
from hrlplan.families import by_schema_option, family_of
from hrlplan.validate import check_values, explain_compose_error, is_compose_error, override_keys


def apply_top_level_aliases(cfg: Any) -> Any:
    """Copy HRM-style top-level keys (global_batch_size=4, lr=1e-4, ...) into their groups."""
    for key, (group, sub) in TOP_LEVEL_ALIASES.items():
        value = cfg[key] if key in cfg else None
        if value is not None:
            cfg[group][sub] = value
    return cfg


def normalize_overrides(overrides: Iterable[str]) -> List[str]:
    """`+experiment=x` (the habit from before conf/config.yaml listed `experiment: null`) means experiment=x."""
    return [o[1:] if str(o).startswith("+experiment=") else str(o) for o in overrides]


def _train_defaults() -> Dict[str, Any]:
    return {f.name: f.default for f in fields(TrainConfig) if not callable(f.default_factory)}


def apply_family_recipe(cfg: Dict[str, Any], explicit: Iterable[str]) -> Dict[str, Any]:
    """The arch family's own train defaults (families.py's recipe; HRM's: no clipping, 2000 warm-up
    steps, constant lr, seed 0).

    A key keeps its value when the user set it on the command line (either spelling) or a config
    file (an experiment) changed it from the language-model default."""
    recipe = family_of(cfg.get("arch")).recipe
    if not recipe:
        return cfg
    explicit = set(explicit)
    aliases = {sub: top for top, (group, sub) in TOP_LEVEL_ALIASES.items() if group == "train"}
    defaults = _train_defaults()
    train = cfg["train"]
    for key, value in recipe.items():
        if f"train.{key}" in explicit or aliases.get(key) in explicit:
            continue
        if train.get(key) == _plain(defaults[key]):
            train[key] = value
    return cfg




def _sync_hrm_loss(arch: Dict[str, Any]) -> None:
    """arch.loss.loss_type (HRM's spelling) and the flat arch.loss_type always agree: the one that
    moved away from the default wins, the nested one when both did. An arch whose schema has no
    nested loss node (every family but HRM's) is left as it is."""
    if not isinstance(arch.get("loss"), dict) or "loss_type" not in arch:
        return
    default = str(HRMLossConfig.loss_type)
    nested, flat = arch["loss"].get("loss_type", default), arch.get("loss_type", default)
    chosen = nested if nested != default else flat
    arch["loss"]["loss_type"] = arch["loss_type"] = chosen


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Enum) else value


def to_plain(cfg: Any, overrides: Sequence[str] = (), check: bool = True) -> Dict[str, Any]:
    """A composed DictConfig as the library takes it: resolved, Enums as strings, HRM's top-level
    keys copied into their groups, HRM's recipe defaults applied, values range-checked."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    apply_top_level_aliases(config)
    apply_family_recipe(config, override_keys(overrides))
    if isinstance(config.get("arch"), dict):
        _sync_hrm_loss(config["arch"])
    if check:
        check_values(config, override_keys(overrides))
    return config


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (called by pretrain.py before composing)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for option, family in by_schema_option().items():
        cs.store(group="arch", name=option, node=family.schema)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="planner", name="exact_schema", node=ExactPlannerSchema)
    cs.store(group="planner", name="hrl_schema", node=HRLPlannerSchema)
    cs.store(group="planner", name="manual_schema", node=ManualPlannerSchema)
    cs.store(group="planner", name="random_schema", node=RandomPlannerSchema)
    cs.store(group="train", name="train_schema", node=TrainConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    if not OmegaConf.has_resolver("hrlplan_groups"):
        # conf/config.yaml's --help lists the groups through this: the *_schema entries stay hidden
        OmegaConf.register_new_resolver("hrlplan_groups", config_groups_help)
    _hide_schemas_from_listings()


def _hide_schemas_from_listings() -> None:
    """Hydra has one way to list a group's options, ConfigLoader.get_group_options, and it lists every
    config stored in the group, the schemas of the Hydra-documented schema pattern included: tab
    completion (`arch=<TAB>`), Hydra's own help and glob sweeps (`-m 'planner=glob(*)'`) would offer
    gpt2_schema and friends. No config source or name is hidden by Hydra's listing (it skips only
    __pycache__ and __init__.py), so the one listing method leaves them out; composing, which reads the
    repository directly, still finds them."""
    listed = ConfigLoaderImpl.get_group_options
    if getattr(listed, "hides_schemas", False):
        return

    def get_group_options(self, group_name, results_filter=ObjectType.CONFIG, config_name=None, overrides=None):
        return [o for o in listed(self, group_name, results_filter, config_name, overrides)
                if not is_internal_config(o)]

    get_group_options.hides_schemas = True
    get_group_options.__doc__ = listed.__doc__
    ConfigLoaderImpl.get_group_options = get_group_options


def compose(overrides: Sequence[str] = (), resolve: bool = True) -> Any:
    """Compose conf/config.yaml with overrides outside @hydra.main (tests, notebooks, tools).

    Returns the plain, checked dict (to_plain); resolve=False returns Hydra's DictConfig as
    composed (with the top-level aliases applied). A bad override raises ConfigError (one line)."""
    register_configs()
    overrides = normalize_overrides(overrides)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        try:
            cfg = hydra_compose("config", overrides=overrides)
        except Exception as e:
            if not is_compose_error(e):
                raise
            raise explain_compose_error(e, overrides) from None
    if not resolve:
        return apply_top_level_aliases(cfg)
    return to_plain(cfg, overrides)
