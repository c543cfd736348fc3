"""What every micro-benchmark of the calibration runs on: stages of the model's blocks (no embedding,
no head), built as the runtime builds them; the number of timed repeats. The package's bottom:
compute, comm and collectives import it, it imports none of them."""
from __future__ import annotations

from typing import Any, Dict

import torch

from hrlplan.models.hf import HFStage, build_hf_model, hf_config_from_arch

REPEATS = 5


def block_stage(arch: Dict[str, Any], device: torch.device, n_blocks: int = 1):
    """A stage of `n_blocks` blocks of the model (no embedding, no head), on `device`."""
    config = hf_config_from_arch(arch)
    config.num_hidden_layers = n_blocks   # GPT-2 maps n_layer onto this; only these blocks are built
    torch.manual_seed(0)
    model = build_hf_model(config)
    return HFStage(model, 0, n_blocks, first=False, last=False).to(device), int(config.hidden_size)
