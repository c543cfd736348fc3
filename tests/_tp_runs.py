"""The pp 2 x tp 2 runs of the 4-block tiny models (Llama and GPT-2, sequence parallelism on or off),
each launched once per test session and shared: tests/test_tp.py checks the tp runs against one
process, tests/test_sequence_parallel.py the sp runs and the activation memory between the two."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List

from _plan_options import reference_losses, train_with_options

STEPS = 3
OVERRIDES = {"llama": ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3", "train.global_batch_size=8"],
             "gpt2": ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3", "train.global_batch_size=8"]}
_ROOT = Path(tempfile.mkdtemp(prefix="hrlplan-pp2-tp2-"))
atexit.register(shutil.rmtree, _ROOT, True)


@lru_cache(maxsize=None)
def pp2_tp2_run(arch: str, sequence_parallel: bool) -> Dict[str, Any]:
    """train_with_options' summary of the run: losses per step and each rank's measured memory."""
    from hrlplan.plan import homogeneous_plan

    model = "llama-tiny" if arch == "llama" else "gpt2-tiny"
    plan = homogeneous_plan(model, 4, [(0, 2), (2, 4)], dp=1, tp=2, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    options = {"sequence_parallel": True} if sequence_parallel else None
    return train_with_options(plan, OVERRIDES[arch], _ROOT / f"{arch}-{'sp' if sequence_parallel else 'tp'}", STEPS,
                              stage_options=options)


@lru_cache(maxsize=None)
def one_process_losses(arch: str) -> List[float]:
    return reference_losses(OVERRIDES[arch], STEPS)
