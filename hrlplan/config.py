"""Typed configuration (Hydra structured configs).

Every config group has a dataclass schema registered in Hydra's ConfigStore, so a misspelled or
mistyped override fails at compose time; closed choices (dtype, schedule, logger mode, ...) are
Enums, so `train.dtype=bf16` fails there too. `finalize` then applies HRM's top-level keys, HRM's
recipe defaults and the range checks (hrlplan/validate.py), and hands the library a tree of plain
values: Enums become their strings, so library code compares `train["dtype"] == "bfloat16"`.
The library itself never needs Hydra: every function takes these dataclasses or plain dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional, Sequence

from hrlplan.search.config import ExactPlannerConfig, HRLPlannerConfig, ManualPlannerConfig, RandomPlannerConfig


# ---------------------------------------------------------------- closed choices
class Choice(str, Enum):
    """An Enum of strings whose members print as their value (f-strings, logs, yaml via to_plain).

    Member name == value: OmegaConf looks members up by name when it reads a string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choice(name: str, *values: str) -> type:
    # The functional form allows names such as "1f1b"; module/qualname keep members picklable (spawn).
    return Choice(name, [(v, v) for v in values], module=__name__, qualname=name)


DType = _choice("DType", "float32", "bfloat16")
Schedule = _choice("Schedule", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
DPMode = _choice("DPMode", "fsdp", "replicate")
Device = _choice("Device", "auto", "cpu", "cuda")
LoggerMode = _choice("LoggerMode", "offline", "online", "disabled")
Mode = _choice("Mode", "train", "plan")
PosEncodings = _choice("PosEncodings", "rope", "learned")
LossType = _choice("LossType", "stablemax_cross_entropy", "softmax_cross_entropy")
HRMLossName = _choice("HRMLossName", "losses@ACTLossHead")


# ---------------------------------------------------------------- arch (one schema per family)
@dataclass
class GPT2ArchConfig:
    name: str = "gpt2"
    family: str = "hf"
    model_type: str = "gpt2"
    # A local directory or HF-cache id to read config.json (and weights, with pretrained=true) from.
    model_id: Optional[str] = None
    pretrained: bool = False
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    n_positions: int = 1024
    vocab_size: int = 50257
    tie_word_embeddings: bool = True
    # Dropout is off by default: pipelined and single-process runs then see identical numerics.
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0


@dataclass
class LlamaArchConfig:
    name: str = "llama"
    family: str = "hf"
    model_type: str = "llama"
    model_id: Optional[str] = None
    pretrained: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    max_position_embeddings: int = 4096
    vocab_size: int = 32000
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False


@dataclass
class HRMLossConfig:
    """HRM's `arch.loss` node (config/arch/hrm_v1.yaml): the ACT loss head and its token loss."""
    name: HRMLossName = HRMLossName["losses@ACTLossHead"]
    loss_type: LossType = LossType["stablemax_cross_entropy"]


@dataclass
class HRMArchConfig:
    """Names as in HRM's config/arch/hrm_v1.yaml, so `arch.hidden_size=32 arch.H_layers=1` work."""
    name: str = "hrm"
    family: str = "hrm"
    model_type: str = "hrm_act_v1"
    H_cycles: int = 2
    L_cycles: int = 2
    H_layers: int = 4
    L_layers: int = 4
    hidden_size: int = 512
    num_heads: int = 8
    expansion: float = 4.0
    puzzle_emb_ndim: int = 512
    pos_encodings: PosEncodings = PosEncodings["rope"]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    # HRM spells it arch.loss.loss_type; the flat key is kept equal to it (see _sync_hrm_loss).
    loss: HRMLossConfig = field(default_factory=HRMLossConfig)
    loss_type: LossType = LossType["stablemax_cross_entropy"]
    forward_dtype: DType = DType["float32"]


# ---------------------------------------------------------------- planner (closed schedule names)
@dataclass
class ExactPlannerSchema(ExactPlannerConfig):
    schedules: List[Schedule] = field(default_factory=list)


@dataclass
class HRLPlannerSchema(HRLPlannerConfig):
    schedules: List[Schedule] = field(default_factory=list)


@dataclass
class ManualPlannerSchema(ManualPlannerConfig):
    schedules: List[Schedule] = field(default_factory=list)


@dataclass
class RandomPlannerSchema(RandomPlannerConfig):
    schedules: List[Schedule] = field(default_factory=list)


# ---------------------------------------------------------------- cluster
@dataclass
class NodeGroupConfig:
    """`count` identical nodes, each with `devices_per_node` devices of one type."""
    count: int = 1
    device: str = "A100-80GB"
    devices_per_node: int = 8
    memory_gb: float = 80.0
    tflops: float = 312.0          # dense bf16 peak (or measured) per device
    intra_node_GBps: float = 300.0  # per-direction link bandwidth inside a node (NVLink)


@dataclass
class ClusterConfig:
    name: str = "local"
    # probe=true measures this machine (or every node of the job); false plans for node_groups.
    probe: bool = True
    nproc_per_node: Any = "auto"   # "auto": one worker per GPU, or per CPU core without GPUs
    # More local workers than CPU cores (or GPUs) is refused unless this is set (hrlplan/validate.py).
    oversubscribe: bool = False
    spec_file: Optional[str] = None  # a cluster.json from `hrlplan probe-cluster` (skips probing)
    node_groups: List[NodeGroupConfig] = field(default_factory=list)
    inter_node_GBps: float = 25.0
    inter_node_latency_us: float = 5.0
    intra_node_latency_us: float = 2.0
    probe_matmul_n: int = 512
    probe_p2p_mb: float = 4.0
    probe_repeats: int = 3


# ---------------------------------------------------------------- train / data / logger
@dataclass
class TrainConfig:
    schedule: Schedule = Schedule["1f1b"]
    stages_per_rank: int = 1          # >1 only for interleaved_1f1b / zero_bubble
    steps: int = 50
    global_batch_size: int = 8
    microbatches: Any = "auto"        # an int, or "auto" to let the planner choose
    lr: float = 3e-3  # the tiny default model learns on every seed (1e-2 stalls on some); GPT-2 small and up want ~6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: Optional[float] = 1.0  # null or 0: no clipping (HRM's default)
    seed: int = 1234
    checkpoint_interval: int = 10     # steps; 0 disables periodic checkpoints
    checkpoint_every_eval: bool = False  # HRM: a checkpoint at every evaluation
    checkpoint_path: Optional[str] = None  # HRM: where checkpoints go (default: <run_dir>/checkpoints)
    resume: str = "none"              # none | auto | <checkpoint dir>
    stop_after: Optional[int] = None  # stop (with a checkpoint) after this step, as a preemption would
    dp_mode: DPMode = DPMode["fsdp"]  # fsdp (FSDP2 fully_shard) | replicate
    device: Device = Device["auto"]
    dtype: DType = DType["float32"]   # bfloat16: FSDP mixed precision where it shards, autocast elsewhere
    log_interval: int = 1
    profile: bool = False
    measure_memory: bool = True       # peak memory per rank and its split, tracked over the first 2 steps
    vocab_parallel: bool = True       # tp>1: token embedding and head sharded over the vocabulary (whole if vocab % tp != 0)
    tf32: bool = True                 # CUDA: float32 matmuls in TF32 (costed at the TF32 peak); false: full fp32
    plan_timeout_min: float = 60.0    # CPU-side (gloo) collectives that wait while rank 0 probes, calibrates, plans
    collective_timeout_min: float = 10.0  # training collectives (NCCL/gloo): a dead rank ends the job this fast
    # Evaluation on the validation split: every eval_interval steps (language models; always at the
    # end) or epochs (HRM, which also counts its run in epochs).
    eval_interval: Optional[int] = None
    epochs: Optional[int] = None
    puzzle_emb_lr: float = 1e-2
    puzzle_emb_weight_decay: float = 0.1


@dataclass
class DataConfig:
    name: str = "synthetic"   # synthetic | code | sudoku | hf
    seq_len: int = 64
    path: Optional[str] = None
    num_workers: int = 0
    # synthetic stream: walks along a few fixed random permutations of the vocabulary (learnable)
    synthetic_chains: int = 4
    tokenizer: Optional[str] = None  # a tokenizer.json (trained locally) or HF-cache tokenizer id
    source: Optional[str] = None     # a directory of .py / CodeSearchNet .jsonl(.gz) / .parquet files
    vocab_size: int = 4096           # for a tokenizer trained here
    max_files: int = 2000


@dataclass
class LoggerConfig:
    name: str = "wandb"
    mode: LoggerMode = LoggerMode["offline"]
    project: str = "hrlplan"
    entity: Optional[str] = None
    group: Optional[str] = None
    run_name: Optional[str] = None   # the W&B run's name (default: model and layout)
    tags: List[str] = field(default_factory=list)


@dataclass
class Config:
    arch: Any = None
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    planner: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # train = probe, plan and train; plan = stop after writing plan.yaml (planning for presets).
    mode: Mode = Mode["train"]
    run_dir: Optional[str] = None   # default: Hydra's output directory
    # HRM-compatible top-level keys (HRM's pretrain.py users type these); when set they override
    # the matching keys of TOP_LEVEL_ALIASES.
    data_path: Optional[str] = None
    epochs: Optional[int] = None
    eval_interval: Optional[int] = None
    checkpoint_every_eval: Optional[bool] = None
    global_batch_size: Optional[int] = None
    lr: Optional[float] = None
    lr_min_ratio: Optional[float] = None
    lr_warmup_steps: Optional[int] = None
    beta1: Optional[float] = None
    beta2: Optional[float] = None
    weight_decay: Optional[float] = None
    puzzle_emb_lr: Optional[float] = None
    puzzle_emb_weight_decay: Optional[float] = None
    seed: Optional[int] = None
    project_name: Optional[str] = None
    run_name: Optional[str] = None
    checkpoint_path: Optional[str] = None


TOP_LEVEL_ALIASES = {
    "data_path": ("data", "path"),
    "epochs": ("train", "epochs"),
    "eval_interval": ("train", "eval_interval"),
    "checkpoint_every_eval": ("train", "checkpoint_every_eval"),
    "global_batch_size": ("train", "global_batch_size"),
    "lr": ("train", "lr"),
    "lr_min_ratio": ("train", "min_lr_ratio"),
    "lr_warmup_steps": ("train", "warmup_steps"),
    "beta1": ("train", "beta1"),
    "beta2": ("train", "beta2"),
    "weight_decay": ("train", "weight_decay"),
    "puzzle_emb_lr": ("train", "puzzle_emb_lr"),
    "puzzle_emb_weight_decay": ("train", "puzzle_emb_weight_decay"),
    "seed": ("train", "seed"),
    "project_name": ("logger", "project"),
    "run_name": ("logger", "run_name"),
    "checkpoint_path": ("train", "checkpoint_path"),
}

# HRM's cfg_pretrain.yaml where it differs from our language-model defaults; applied when the
# arch is HRM and neither the user nor a config file changed the key (see apply_hrm_recipe).
HRM_RECIPE = {"grad_clip": None, "warmup_steps": 2000, "min_lr_ratio": 1.0, "seed": 0, "checkpoint_every_eval": True}


def apply_top_level_aliases(cfg: Any) -> Any:
    """Copy HRM-style top-level keys (global_batch_size=4, lr=1e-4, ...) into their groups."""
    for key, (group, sub) in TOP_LEVEL_ALIASES.items():
        value = cfg[key] if key in cfg else None
        if value is not None:
            cfg[group][sub] = value
    return cfg


def override_keys(overrides: Iterable[str]) -> set:
    """The dotted keys a list of Hydra overrides sets ("+train.seed=1" -> "train.seed")."""
    keys = set()
    for o in overrides:
        key = str(o).split("=", 1)[0].lstrip("+~").strip()
        if key and not key.startswith("hydra"):
            keys.add(key.split("@", 1)[0])
    return keys


def normalize_overrides(overrides: Iterable[str]) -> List[str]:
    """`+experiment=x` (the habit from before conf/config.yaml listed `experiment: null`) means experiment=x."""
    return [o[1:] if str(o).startswith("+experiment=") else str(o) for o in overrides]


def _train_defaults() -> Dict[str, Any]:
    return {f.name: f.default for f in fields(TrainConfig) if not callable(f.default_factory)}


def apply_hrm_recipe(cfg: Dict[str, Any], explicit: Iterable[str]) -> Dict[str, Any]:
    """HRM's own defaults (no clipping, 2000 warm-up steps, constant lr, seed 0) for an HRM arch.

    A key keeps its value when the user set it on the command line (either spelling) or a config
    file (an experiment) changed it from the language-model default."""
    if (cfg.get("arch") or {}).get("family") != "hrm":
        return cfg
    explicit = set(explicit)
    aliases = {sub: top for top, (group, sub) in TOP_LEVEL_ALIASES.items() if group == "train"}
    defaults = _train_defaults()
    train = cfg["train"]
    for key, value in HRM_RECIPE.items():
        if f"train.{key}" in explicit or aliases.get(key) in explicit:
            continue
        if train.get(key) == _plain(defaults[key]):
            train[key] = value
    return cfg


def _sync_hrm_loss(arch: Dict[str, Any]) -> None:
    """arch.loss.loss_type (HRM's spelling) and the flat arch.loss_type always agree: the one that
    moved away from the default wins, the nested one when both did."""
    if arch.get("family") != "hrm" or not isinstance(arch.get("loss"), dict):
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
    from omegaconf import OmegaConf

    from hrlplan.validate import check_values

    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    apply_top_level_aliases(config)
    apply_hrm_recipe(config, override_keys(overrides))
    if isinstance(config.get("arch"), dict):
        _sync_hrm_loss(config["arch"])
    if check:
        check_values(config)
    return config


def finalize(cfg: Any, overrides: Sequence[str] = ()) -> Any:
    """to_plain, as a DictConfig again (for code written against Hydra's cfg, e.g. hrlplan/launch/job.py)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(to_plain(cfg, overrides))


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (called by pretrain.py before composing)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="arch", name="gpt2_schema", node=GPT2ArchConfig)
    cs.store(group="arch", name="llama_schema", node=LlamaArchConfig)
    cs.store(group="arch", name="hrm_schema", node=HRMArchConfig)
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


SCHEMA_SUFFIX = "_schema"


def is_internal_config(name: str) -> bool:
    """A schema the yaml files extend (`- gpt2_schema`), not an option a user picks."""
    return name.endswith(SCHEMA_SUFFIX) or name == "base_config"


def _hide_schemas_from_listings() -> None:
    """Hydra has one way to list a group's options, ConfigLoader.get_group_options, and it lists every
    config stored in the group, the schemas of the Hydra-documented schema pattern included: tab
    completion (`arch=<TAB>`), Hydra's own help and glob sweeps (`-m 'planner=glob(*)'`) would offer
    gpt2_schema and friends. No config source or name is hidden by Hydra's listing (it skips only
    __pycache__ and __init__.py), so the one listing method leaves them out; composing, which reads the
    repository directly, still finds them."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.object_type import ObjectType

    listed = ConfigLoaderImpl.get_group_options
    if getattr(listed, "hides_schemas", False):
        return

    def get_group_options(self, group_name, results_filter=ObjectType.CONFIG, config_name=None, overrides=None):
        return [o for o in listed(self, group_name, results_filter, config_name, overrides)
                if not is_internal_config(o)]

    get_group_options.hides_schemas = True
    get_group_options.__doc__ = listed.__doc__
    ConfigLoaderImpl.get_group_options = get_group_options


def group_options(group: str) -> List[str]:
    """The options a user can pick for a config group (schemas left out)."""
    from hydra.core.global_hydra import GlobalHydra

    from hrlplan.model_meta import conf_dir

    if GlobalHydra.instance().is_initialized():
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    else:
        options = [p.stem for p in (conf_dir() / group).glob("*.yaml")]
    return sorted(o for o in options if not is_internal_config(o))


def config_groups_help() -> str:
    from hydra.core.global_hydra import GlobalHydra

    from hrlplan.model_meta import conf_dir

    if GlobalHydra.instance().is_initialized():
        groups = GlobalHydra.instance().config_loader().list_groups("")
    else:
        groups = [p.name for p in conf_dir().iterdir() if p.is_dir()]
    groups = sorted(g for g in groups if g != "hydra")
    return "\n".join(f"{g}: {', '.join(group_options(g))}" for g in groups)


def compose(overrides: Sequence[str] = (), resolve: bool = True) -> Any:
    """Compose conf/config.yaml with overrides outside @hydra.main (tests, notebooks, tools).

    Returns the plain, checked dict (to_plain); resolve=False returns Hydra's DictConfig as
    composed (with the top-level aliases applied). A bad override raises ConfigError (one line)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from hrlplan.model_meta import conf_dir
    from hrlplan.validate import explain_compose_error, is_compose_error

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


def typed(plain: Dict[str, Any]) -> Config:
    """The run's config as typed objects (`cfg.train.steps`, `cfg.train.dtype is DType.bfloat16`), the
    form passed down to the runtime and launcher. `arch` and `planner` stay mappings: their schema
    depends on the chosen option. Choices are str Enums, so they still compare equal to their strings."""
    from omegaconf import OmegaConf

    known = {f for f in Config.__dataclass_fields__}
    body = {k: v for k, v in plain.items() if k in known and k not in ("arch", "planner")}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), body))
    cfg.arch, cfg.planner = plain.get("arch"), plain.get("planner")
    return cfg
