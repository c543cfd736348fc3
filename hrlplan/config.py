"""Typed configuration: one dataclass schema per config group (Hydra structured configs), closed
choices as Enums, and the conversions the library uses.

hrlplan/compose.py registers these schemas in Hydra's ConfigStore, so a misspelled or mistyped
override fails at compose time (`train.dtype=bf16` too), then makes the composed config plain and
checks it. `typed()` turns that plain tree into a `Config` -- the form passed down to the launcher,
the trainers and the data (`cfg.train.steps`); `section(TrainConfig, x)` accepts a section typed or as
a script's plain mapping; `as_dict` makes it plain again for YAML, W&B and cache keys. Choices are str
Enums: `cfg.train.dtype == "bfloat16"` holds. This module is a leaf: it imports no other layer.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from hrlplan import schedules
from hrlplan.errors import ConfigError, UserError


# ---------------------------------------------------------------- closed choices
class Choice(str, Enum):
    """An Enum of strings whose members print as their value (f-strings, logs, yaml via to_plain).

    Member name == value: OmegaConf looks members up by name when it reads a string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choice(name: str, *values: str) -> type:
    # The functional form allows names that start with a digit (a schedule's 1f1b); module/qualname keep members picklable (spawn).
    return Choice(name, [(v, v) for v in values], module=__name__, qualname=name)


DType = _choice("DType", "float32", "bfloat16")
Schedule = _choice("Schedule", *schedules.names())   # the registry's names and aliases
DPMode = _choice("DPMode", "fsdp", "replicate")
Device = _choice("Device", "auto", "cpu", "cuda")
LoggerMode = _choice("LoggerMode", "offline", "online", "disabled")
Mode = _choice("Mode", "train", "plan")
PosEncodings = _choice("PosEncodings", "rope", "learned")
LossType = _choice("LossType", "stablemax_cross_entropy", "softmax_cross_entropy")
HRMLossName = _choice("HRMLossName", "losses@ACTLossHead")
CostRuntime = _choice("CostRuntime", "torch", "megatron")
Packing = _choice("Packing", "concat", "document", "balanced")


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


# ---------------------------------------------------------------- planner
@dataclass
class CostConfig:
    """planner.cost: the runtime whose step the cost model prices. A null option takes that runtime's
    own (hrlplan.cost.plans.RUNTIME_DEFAULTS): torch -- this package's runtime -- fused attention and
    torch.distributed.pipelining's receive buffers; megatron -- Megatron-LM -- neither."""
    runtime: CostRuntime = CostRuntime["torch"]
    fused_attention: Optional[bool] = None   # attention keeps no s x s scores (SDPA / flash kernels)
    receive_buffers: Optional[bool] = None   # a pipeline stage keeps one receive buffer per micro-batch
    # train.compile's speed-up of a block's compute: null takes the calibration's measured figure, else 1.0
    compile_speedup: Optional[float] = None
    # sequence-parallel tp collectives run under the block's GEMMs, only the excess exposed (Megatron-Core's
    # --tp-comm-overlap with Transformer Engine); this package's torch runtime does not overlap them
    tp_comm_overlap: bool = False


@dataclass
class PlannerConfigBase:
    name: str = "exact"
    seed: int = 0
    max_pp: int = 64                 # upper bound on pipeline stages considered
    max_tp: int = 8                  # tp never crosses a node
    # context parallelism searched up to this degree (1: train.context_parallel only); CUDA clusters only
    max_cp: int = 1
    microbatch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    memory_margin: float = 0.9       # plan against this fraction of device memory
    dp_overlap: bool = True          # DP gradient all-reduce overlapped with backward
    schedules: List[str] = field(default_factory=list)  # empty: the train.schedule only
    # Plan from measured block, communication and optimizer times on devices that are really there
    # (probed clusters): auto = a searching planner reuses the cached calibration of this cluster
    # shape and model or measures once; true = also for a manual plan; refresh = measure again and
    # replace the cached one; false = plan from peak FLOP/s and probed links. Presets never calibrate.
    calibrate: Any = "auto"
    recompute: str = "auto"          # activation recomputation per stage: auto (searched) | none | selective | full
    allow_idle_ranks: bool = True    # a probed job's plan may leave workers idle when that is faster
    allow_over_memory: bool = False  # accept a plan predicted over a device's memory (manual plans)
    cost: CostConfig = field(default_factory=CostConfig)   # what the cost model prices (see CostConfig)
    # Data-parallel replicas with their own devices, template and batch share (hrlplan/search/hetero.py):
    # auto = searched where one template cannot use the cluster evenly (several device types, uneven
    # nodes); true = always (exact or hrl); false = one template replicated, as before.
    heterogeneous: Any = "auto"
    calibrate_budget_s: float = 300.0   # calibration stops here and plans from peak figures (nothing cached)


CALIBRATE_CHOICES = ("auto", "true", "false", "refresh")


def calibration_mode(planner_cfg) -> str:
    """planner.calibrate as one of CALIBRATE_CHOICES (YAML's true/false arrive as booleans)."""
    value = planner_cfg.get("calibrate", "auto")
    mode = str(value).lower() if not isinstance(value, bool) else ("true" if value else "false")
    if mode not in CALIBRATE_CHOICES:
        raise UserError(f"planner.calibrate={value!r} is not one of {', '.join(CALIBRATE_CHOICES)}")
    return mode


@dataclass
class ExactPlannerConfig(PlannerConfigBase):
    name: str = "exact"
    max_evaluations: int = 20_000_000  # (stage, layer span) DP cells; gives up (saying so) beyond
    max_simulations: int = 20_000      # simulator calls of the layer-split branch-and-bound; likewise
    max_search_s: Optional[float] = 120.0   # wall-clock seconds of the branch and bound (null: none); likewise
    # planner.heterogeneous (search/hetero_exact.py): the replica search's time from the planning's start;
    # the batch-share grid (B/steps); integer-program rounds; simulator calls per replica template;
    # simulator calls of the single-template search (search/hetero_single.py: bounded by work, 3/4 of
    # hetero_time_s its wall-clock safety)
    hetero_time_s: float = 45.0
    hetero_share_steps: int = 16
    hetero_max_rounds: int = 300
    hetero_template_simulations: int = 400
    hetero_single_simulations: int = 1600


@dataclass
class HRLPlannerConfig(PlannerConfigBase):
    name: str = "hrl"
    samples: int = 256               # plans sampled at inference; the best by simulated time wins
    train_steps: int = 30            # policy-gradient updates on this instance before sampling (0: zero-shot)
    batch_size: int = 32             # episodes per update
    lr: float = 3e-3
    entropy_coef: float = 0.01
    hidden: int = 64
    checkpoint_dir: Optional[str] = None  # trained policies; None: the shipped generalist policy
    train_if_missing: bool = True
    use_pretrained: bool = True      # start from the shipped generalist when no checkpoint_dir is given
    refine: bool = True              # hill-climb the best sampled plan's stage boundaries
    greedy_configs: int = 16         # greedy rollouts of the policy's top-scored configurations at inference
    refine_evaluations: int = 64     # simulator calls the hill-climb may spend
    progress: bool = True            # tqdm bar (with the current best) while training
    # planner.heterogeneous: seconds the learned replica policy (search/hrl_replicas.py) samples replica plans
    hetero_time_s: float = 45.0


@dataclass
class ManualPlannerConfig(PlannerConfigBase):
    name: str = "manual"
    plan_file: Optional[str] = None


@dataclass
class RandomPlannerConfig(PlannerConfigBase):
    name: str = "random"
    samples: int = 256               # simulator evaluations (the benchmark sets hrl's count)


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
    # Local workers capped to a share of one CPU core each (cgroup v1 cpu quotas; hrlplan/launch/cpu_quota.py):
    # slower and faster workers on one machine, e.g. [1.0,0.33,0.33]; null (or a null entry) is uncapped.
    cpu_shares: Optional[List[Optional[float]]] = None


# ---------------------------------------------------------------- timeouts
# train.<key> when set, else the environment variable, else the default (minutes); docs/runtime.md.
TIMEOUTS = {"plan_timeout_min": ("HRLPLAN_PLAN_TIMEOUT_MIN", 60.0),
            "collective_timeout_min": ("HRLPLAN_TRAIN_TIMEOUT_MIN", 10.0)}


def timeout_minutes(train: Any, env: Dict[str, str]) -> Dict[str, float]:
    """Each of TIMEOUTS in minutes, from the train config (typed, plain, or missing keys), else its
    environment variable, else its default; a value that is not a positive number raises ConfigError
    naming the key or the variable."""
    out = {}
    for key, (var, default) in TIMEOUTS.items():
        value = train.get(key) if isinstance(train, Mapping) else getattr(train, key, None)
        where, shown = f"train.{key}", f"train.{key}={value}"
        if value is None and env.get(var) not in (None, ""):
            value, where = env[var], var
            shown = f"{var}={value} (environment)"
        try:
            minutes = default if value is None else float(value)
        except (TypeError, ValueError):
            minutes = float("nan")
        if not (0 < minutes < float("inf")):
            raise ConfigError(where, value, message=f"{shown} is not a positive number of minutes: "
                              f"{'unset it' if where == var else 'leave it out'} (default {default:g}) "
                              "or give a number > 0")
        out[key] = minutes
    return out


# ---------------------------------------------------------------- train / data / logger
@dataclass
class TrainConfig:
    schedule: Schedule = Schedule[schedules.DEFAULT]
    stages_per_rank: int = 1          # >1 only for multi-stage schedules (hrlplan.schedules; zbv/dualpipev take exactly 2)
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
    # torch.compile of each transformer block on its own (regional, runtime/compile.py); CPU needs a C++ compiler
    compile: bool = False
    # Float8 training: torchao's float8 linears in the blocks (runtime/float8.py); CUDA compute capability >= 8.9
    # and `pip install 'hrlplan[float8]'`
    float8: bool = False
    # context-parallel degree the planners use (plan.yaml's per-stage `cp`: each sequence sharded over this
    # many ranks, runtime/context_parallel.py); a manual plan decides it (a different value typed is refused);
    # > 1 needs CUDA (torch's context-parallel attention)
    context_parallel: int = 1
    # CPU-side (gloo) collectives that wait while rank 0 probes, calibrates, plans; null: $HRLPLAN_PLAN_TIMEOUT_MIN, else 60
    plan_timeout_min: Optional[float] = None
    # training collectives (NCCL/gloo): a dead rank ends the job this fast; null: $HRLPLAN_TRAIN_TIMEOUT_MIN, else 10
    collective_timeout_min: Optional[float] = None
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
    # concat: one stream cut into seq_len chunks (documents attend across boundaries); document: whole
    # documents packed into seq_len rows, attention kept to each document; balanced: as document, with each
    # step's documents dispatched over micro-batches (and replicas) by their cost (hrlplan/data/dispatch.py)
    packing: Packing = Packing["concat"]
    dispatch_budget_s: float = 0.25   # balanced: the dispatch solver's wall-clock seconds per step
    dispatch_prefetch: int = 2        # balanced: steps dispatched ahead, in a background thread on rank 0


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
# arch is HRM and neither the user nor a config file changed the key (see compose.apply_family_recipe).
HRM_RECIPE = {"grad_clip": None, "warmup_steps": 2000, "min_lr_ratio": 1.0, "seed": 0, "checkpoint_every_eval": True}


def section(schema: type, value: Any) -> Any:
    """A config section as its dataclass (`section(TrainConfig, cfg.train)`): as it is, or built from
    a plain mapping -- a script's or a test's dict. Missing keys take the schema's defaults, unknown
    ones are left out, choices become their Enums (a bad one raises here, naming it)."""
    if isinstance(value, schema):
        return value
    # Built directly (OmegaConf's merge costs ~9 ms, and the planners convert per instance): the
    # values were checked when composed; a script's own dict is taken as written, choices checked.
    hints = _field_types(schema)
    return schema(**{k: _coerce(hints[k], v, k) for k, v in dict(value or {}).items() if k in hints})


@functools.lru_cache(maxsize=None)
def _field_types(schema: type) -> Dict[str, Any]:
    return typing.get_type_hints(schema)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """A plain value as the field's type wants it: a choice's Enum, a list of sections' dataclasses."""
    if value is None:
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(str(value))
        except ValueError:
            raise UserError(f"{key}={value!r} is not one of {', '.join(m.value for m in hint)}") from None
    if typing.get_origin(hint) in (list, List) and typing.get_args(hint):
        inner = typing.get_args(hint)[0]
        if dataclasses.is_dataclass(inner):
            return [section(inner, v) for v in value]
        return [_coerce(inner, v, key) for v in value]
    return value


def as_config(cfg: Any) -> "Config":
    """The run's config as typed objects, whether it arrives typed or as compose()'s plain dict."""
    return cfg if isinstance(cfg, Config) else typed(cfg)


def as_dict(cfg: Any) -> Dict[str, Any]:
    """A typed config (or section) as plain values, Enums as strings: for YAML, W&B and cache keys."""
    if isinstance(cfg, dict):
        return cfg
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


def typed(plain: Dict[str, Any]) -> Config:
    """The run's config as typed objects (`cfg.train.steps`, `cfg.train.dtype is DType.bfloat16`), the
    form passed down to the runtime and launcher. `arch` and `planner` stay mappings: their schema
    depends on the chosen option. Choices are str Enums, so they still compare equal to their strings."""
    known = {f for f in Config.__dataclass_fields__}
    body = {k: v for k, v in plain.items() if k in known and k not in ("arch", "planner")}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), body))
    cfg.arch, cfg.planner = plain.get("arch"), plain.get("planner")
    return cfg
