"""The model families, one entry each: what a family supports and how the rest of the package treats it.

Every layer asks this table instead of comparing an arch's name: the config schema a shipped arch YAML
extends (compose registers it, validate checks its keys and ranges), its data (language-model token
sequences, or HRM's puzzles), which trainer adapter trains it (runtime/family_trainers.py), whether it
splits into pipeline stages, which tensor-parallel plan its blocks take (runtime/tensor_parallel.py),
whether its blocks are Llama-style, whether sequence parallelism applies. A leaf: it imports only config.

Adding a family (e.g. Qwen3 as a shipped arch with its own schema) is one `Family(...)` entry in FAMILIES
(and its schema dataclass in config.py, its conf/arch YAML); tests/test_model_families.py shows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from hrlplan.config import HRM_RECIPE, GPT2ArchConfig, HRMArchConfig, LlamaArchConfig

LM_DATA, PUZZLE_DATA = "lm", "puzzle"
PIPELINE_TRAINER, HRM_TRAINER = "pipeline", "hrm"
# The pipeline runtime's options a trainer may run (validate/host.py refuses them for a family without them).
LM_RUNTIME_OPTIONS = ("compile", "float8", "context_parallel")


@dataclass(frozen=True, eq=False)   # eq=False: hashable by identity (its mappings are not)
class Family:
    name: str
    arch_family: str                       # arch.family and ModelMeta.family: hf | hrm
    model_types: Tuple[str, ...]           # arch.model_type values it covers ("hrm*": a prefix)
    trainer: str                           # the trainer adapter (runtime/family_trainers.py TRAINERS)
    data_kind: str = LM_DATA               # lm: token sequences of data.seq_len; puzzle: HRM's data sets
    schema: Optional[type] = None          # config.py's dataclass for a shipped arch (None: sizes in config.json)
    schema_option: Optional[str] = None    # its name in Hydra's ConfigStore (`defaults: [gpt2_schema]`)
    pipeline: bool = True                  # splits into pipeline stages (pp > 1)
    tp_plan: Optional[str] = None          # runtime/tensor_parallel.py's plan for its blocks (None: no tp)
    llama_blocks: bool = False             # q/k/v/o + gate/up/down, RMSNorm, rotary (Llama, Mistral, Qwen)
    sequence_parallel: bool = False        # its tp plan shards the activations between blocks on the sequence
    # its tp plan keeps a block in a layout of its tp degree (GPT-2's fused c_attn, split per head):
    # replicas holding a block at different tp degrees cannot resume from one checkpoint
    tp_layout_per_degree: bool = False
    calibrates: bool = True                # planner.calibrate=auto times its blocks; False: planned from peaks
    idle_ranks: bool = True                # a plan may leave ranks idle (False: every rank the job has trains)
    runtime_options: Tuple[str, ...] = LM_RUNTIME_OPTIONS   # train.* options its trainer runs
    puzzle_embeddings: bool = False        # a sparse puzzle embedding with its own optimizer (train.puzzle_emb_*)
    trains_epochs: bool = False            # its length is train.epochs over its data set, not train.steps
    recipe: Mapping[str, Any] = field(default_factory=dict)   # train defaults of its own (compose.py)
    own_top_keys: Tuple[str, ...] = ()     # top-level keys only its trainer reads
    own_train_keys: Tuple[str, ...] = ()   # train.* keys only its trainer reads
    select_hint: str = ""                  # how a user picks it on the command line
    layers_key: Optional[str] = None       # the schema's key of the pipeline-splittable depth
    positions_key: Optional[str] = None    # the schema's key of the longest sequence
    # key -> rule name (validate's RULE_KINDS): ranges of the schema's sizes
    value_rules: Mapping[str, str] = field(default_factory=dict)
    head_splits: Tuple[Tuple[str, str], ...] = ()   # (width key, heads key): the width splits over the heads

    def covers(self, model_type: Any) -> bool:
        text = str(model_type)
        return any(text == t or (t.endswith("*") and text.startswith(t[:-1])) for t in self.model_types)


def _sizes(*keys: str) -> Dict[str, str]:
    return {k: "pos_int" for k in keys}


LLAMA_RULES = {**_sizes("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "max_position_embeddings"),
               "vocab_size": "vocab", "rms_norm_eps": "pos", "rope_theta": "pos"}

# First match wins (family_for): a family of its own for a model type goes before a group that lists it.
FAMILIES: List[Family] = [
    Family("gpt2", "hf", ("gpt2",), PIPELINE_TRAINER, schema=GPT2ArchConfig, schema_option="gpt2_schema",
           tp_plan="gpt2", sequence_parallel=True, tp_layout_per_degree=True, layers_key="n_layer",
           positions_key="n_positions",
           value_rules={**_sizes("n_layer", "n_embd", "n_head", "n_positions"), "vocab_size": "vocab",
                        **{k: "probability" for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}},
           head_splits=(("n_embd", "n_head"),)),
    Family("llama", "hf", ("llama",), PIPELINE_TRAINER, schema=LlamaArchConfig, schema_option="llama_schema",
           tp_plan="llama", llama_blocks=True, sequence_parallel=True, layers_key="num_hidden_layers",
           positions_key="max_position_embeddings", value_rules=LLAMA_RULES,
           head_splits=(("hidden_size", "num_attention_heads"), ("num_attention_heads", "num_key_value_heads"))),
    # Llama-style blocks without a shipped schema: arch.model_id names their config.json.
    Family("llama_style", "hf", ("mistral", "qwen2", "qwen3"), PIPELINE_TRAINER, tp_plan="llama",
           llama_blocks=True, sequence_parallel=True),
    Family("hrm", "hrm", ("hrm*",), HRM_TRAINER, data_kind=PUZZLE_DATA, schema=HRMArchConfig,
           schema_option="hrm_schema", pipeline=False, calibrates=False, idle_ranks=False, runtime_options=(),
           puzzle_embeddings=True, trains_epochs=True, recipe=HRM_RECIPE,
           own_top_keys=("data_path", "epochs", "checkpoint_every_eval", "puzzle_emb_lr",
                         "puzzle_emb_weight_decay", "checkpoint_path"),
           own_train_keys=("epochs", "checkpoint_every_eval", "checkpoint_path", "puzzle_emb_lr",
                           "puzzle_emb_weight_decay"),
           select_hint="arch=hrm (or experiment=hrm-sudoku)",
           value_rules={**_sizes("H_cycles", "L_cycles", "H_layers", "L_layers", "hidden_size", "num_heads",
                                 "halt_max_steps"),
                        "puzzle_emb_ndim": "nonneg_int", "expansion": "pos", "halt_exploration_prob": "unit",
                        "rms_norm_eps": "pos", "rope_theta": "pos"},
           head_splits=(("hidden_size", "num_heads"),)),
]
# Any other Hugging Face causal LM (arch.model_id): pipelined, no tensor-parallel plan.
GENERIC_HF = Family("hf", "hf", (), PIPELINE_TRAINER)


def by_schema_option() -> Dict[str, Family]:
    """{Hydra schema name: family} for the families a shipped arch YAML can extend."""
    return {f.schema_option: f for f in FAMILIES if f.schema_option}


def family_for(arch_family: Any, model_type: Any) -> Family:
    """The family of an arch (arch.family, arch.model_type) or a ModelMeta (family, model_type)."""
    for family in FAMILIES:
        if family.arch_family == str(arch_family) and family.covers(model_type):
            return family
    for family in FAMILIES:   # arch.family unset: the model type decides
        if arch_family in (None, "") and family.covers(model_type):
            return family
    # a family's own arch.family with a model type it does not list (HRM's variants)
    own = [f for f in FAMILIES if f.arch_family == str(arch_family) and f.arch_family != GENERIC_HF.arch_family]
    return own[0] if own else GENERIC_HF


def family_of(arch: Optional[Mapping[str, Any]]) -> Family:
    """The family of a config's arch mapping (cfg.arch, or model_meta.resolve_arch's)."""
    arch = arch or {}
    return family_for(arch.get("family"), arch.get("model_type"))


def family_of_meta(meta: Any) -> Family:
    return family_for(meta.family, meta.model_type)


def is_language_model(meta: Any) -> bool:
    """A ModelMeta of a token-sequence model (embedding, blocks, vocabulary head), not HRM's puzzles."""
    return family_of_meta(meta).data_kind == LM_DATA


def arch_family_for_model_type(model_type: Any) -> str:
    """arch.family for a config file that names only its model_type."""
    return next((f.arch_family for f in FAMILIES if f.covers(model_type)), GENERIC_HF.arch_family)
