"""What introspection learns about a model (model_meta.json), and the error of a model that cannot be
resolved: plain data, torch-free, below both hrlplan.model_meta (which introspects) and hrlplan.models
(which build the models and fill a ModelMeta in)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from hrlplan.errors import UserError, one_line

SCHEMA_VERSION = 1


class ModelResolutionError(UserError, ValueError):
    """A model id, arch or config file that cannot be resolved or introspected: the message names it."""


@dataclass
class ModelMeta:
    name: str
    family: str                      # hf | hrm
    model_type: str
    n_layer: int                     # pipeline-splittable blocks
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    total_params: int                # sum of numel, tied weights once
    embedding_params: int            # pinned to the first stage
    head_params: int                 # final norm + output head (0 for a tied head's weight)
    block_params: List[int]
    block_matmul_params: List[int]   # weights that take part in matmuls
    head_matmul_params: int          # the output projection (counted even when tied)
    block_flops_fwd_per_token: List[float]
    head_flops_fwd_per_token: float
    block_activation_bytes_per_token: List[float]   # 16-bit activations kept for backward (+ 5*a*s scores, hf)
    head_activation_bytes_per_token: float
    tied_embeddings: bool
    first_stage_modules: List[str]
    last_stage_modules: List[str]
    block_modules: List[str]
    # How many times each block runs per forward pass (HRM's recurrent cycles); 1 for LMs.
    block_repeats: int = 1
    schema_version: int = SCHEMA_VERSION
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def matmul_params(self) -> int:
        return sum(self.block_matmul_params) + self.head_matmul_params

    def training_flops_per_token(self) -> float:
        """Forward + backward (3x forward): 6*N_matmul + 12*n_layer*seq_len*d_model for LMs."""
        return 3.0 * (self.block_repeats * sum(self.block_flops_fwd_per_token) + self.head_flops_fwd_per_token)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModelMeta":
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"model_meta schema_version {version} is not supported (expected {SCHEMA_VERSION}); "
                             "re-run `hrlplan introspect-model`")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelMeta":
        """A model_meta.json; anything wrong with it is a ModelResolutionError naming the file."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            return cls.from_dict(data)
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:
            raise ModelResolutionError(f"{path}: not a usable model_meta.json ({one_line(e, 200)}); write one with "
                                       "`hrlplan introspect-model`") from None
