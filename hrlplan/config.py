"""Typed configuration (Hydra structured configs).

Every config group has a dataclass schema registered in Hydra's ConfigStore, so a misspelled or
mistyped override fails at compose time with Hydra's own message. The library itself never needs
Hydra: every function takes these dataclasses or plain dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hrlplan.search.config import ExactPlannerConfig, HRLPlannerConfig, ManualPlannerConfig, RandomPlannerConfig


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
    pos_encodings: str = "rope"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    loss_type: str = "stablemax_cross_entropy"
    forward_dtype: str = "float32"


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
    schedule: str = "1f1b"            # gpipe | 1f1b | interleaved_1f1b | zero_bubble
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
    grad_clip: float = 1.0
    seed: int = 1234
    checkpoint_interval: int = 10     # steps; 0 disables periodic checkpoints
    resume: str = "none"              # none | auto | <checkpoint dir>
    stop_after: Optional[int] = None  # stop (with a checkpoint) after this step, as a preemption would
    dp_mode: str = "fsdp"             # fsdp (FSDP2 fully_shard) | replicate
    device: str = "auto"              # auto | cpu | cuda
    dtype: str = "float32"            # float32 | bfloat16 (FSDP mixed precision where it shards, autocast elsewhere)
    log_interval: int = 1
    profile: bool = False
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
    mode: str = "offline"   # offline | online | disabled
    project: str = "hrlplan"
    entity: Optional[str] = None
    group: Optional[str] = None
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
    mode: str = "train"
    run_dir: Optional[str] = None   # default: Hydra's output directory
    # HRM-compatible top-level keys (HRM's pretrain.py users type these); when set they override
    # the matching train.* / data.* keys.
    data_path: Optional[str] = None
    epochs: Optional[int] = None
    eval_interval: Optional[int] = None
    global_batch_size: Optional[int] = None
    lr: Optional[float] = None
    puzzle_emb_lr: Optional[float] = None
    weight_decay: Optional[float] = None
    puzzle_emb_weight_decay: Optional[float] = None


TOP_LEVEL_ALIASES = {
    "data_path": ("data", "path"),
    "epochs": ("train", "epochs"),
    "eval_interval": ("train", "eval_interval"),
    "global_batch_size": ("train", "global_batch_size"),
    "lr": ("train", "lr"),
    "puzzle_emb_lr": ("train", "puzzle_emb_lr"),
    "weight_decay": ("train", "weight_decay"),
    "puzzle_emb_weight_decay": ("train", "puzzle_emb_weight_decay"),
}


def apply_top_level_aliases(cfg: Any) -> Any:
    """Copy HRM-style top-level keys (global_batch_size=4, lr=1e-4, ...) into their groups."""
    for key, (group, sub) in TOP_LEVEL_ALIASES.items():
        value = cfg[key] if key in cfg else None
        if value is not None:
            cfg[group][sub] = value
    return cfg


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (called by pretrain.py before composing)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="arch", name="gpt2_schema", node=GPT2ArchConfig)
    cs.store(group="arch", name="llama_schema", node=LlamaArchConfig)
    cs.store(group="arch", name="hrm_schema", node=HRMArchConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="planner", name="exact_schema", node=ExactPlannerConfig)
    cs.store(group="planner", name="hrl_schema", node=HRLPlannerConfig)
    cs.store(group="planner", name="manual_schema", node=ManualPlannerConfig)
    cs.store(group="planner", name="random_schema", node=RandomPlannerConfig)
    cs.store(group="train", name="train_schema", node=TrainConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


def compose(overrides: List[str] = (), resolve: bool = True) -> Any:
    """Compose conf/config.yaml with overrides outside @hydra.main (tests, notebooks, tools)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hrlplan.model_meta import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    cfg = apply_top_level_aliases(cfg)
    return OmegaConf.to_container(cfg, resolve=True) if resolve else cfg
