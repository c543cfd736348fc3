"""The pp 2 x tp 2 runs of the 4-block tiny models (Llama and GPT-2, sequence parallelism on or off)
and the FSDP2 x tp 2 one, all on 4 gloo ranks: launched once per test session, in one launch
(tests/_memory_runs.py), and shared: tests/test_tp.py checks the tp runs against one process,
tests/test_sequence_parallel.py the others and the activation memory between sp and tp."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List

from _memory_runs import train_in_few_launches
from _plan_options import reference_losses

STEPS = 3
OVERRIDES = {"llama": ["arch=llama-tiny", "arch.num_hidden_layers=4", "train.lr=3e-3", "train.global_batch_size=8"],
             "gpt2": ["arch=gpt2-tiny", "arch.n_layer=4", "train.lr=3e-3", "train.global_batch_size=8"],
             # the layout torch-native trainers run at scale: FSDP2 (resharded after forward) over tp 2
             "fsdp2-tp2": ["arch=llama-tiny", "arch.num_hidden_layers=2", "train.lr=3e-3", "train.global_batch_size=8",
                           "train.dp_mode=fsdp"]}


@lru_cache(maxsize=None)
def _runs() -> Dict[str, Dict[str, Any]]:
    from hrlplan.plan import homogeneous_plan

    root = Path(tempfile.mkdtemp(prefix="hrlplan-tp-runs-"))
    atexit.register(shutil.rmtree, root, True)
    runs = {}
    for arch, model in (("llama", "llama-tiny"), ("gpt2", "gpt2-tiny")):
        plan = homogeneous_plan(model, 4, [(0, 2), (2, 4)], dp=1, tp=2, microbatch_size=2, num_microbatches=4,
                                schedule="1f1b")
        runs[f"{arch}-tp"] = (plan, OVERRIDES[arch], STEPS, None, None)
        runs[f"{arch}-sp"] = (plan, OVERRIDES[arch], STEPS, {"sequence_parallel": True}, None)
    fsdp = homogeneous_plan("llama-tiny", 2, [(0, 2)], dp=2, tp=2, microbatch_size=4, num_microbatches=1,
                            schedule="1f1b", recompute="selective")
    runs["fsdp2-tp2"] = (fsdp, OVERRIDES["fsdp2-tp2"], STEPS, {"sequence_parallel": True},
                         {"reshard_after_forward": None})
    return train_in_few_launches(runs, root)


def pp2_tp2_run(arch: str, sequence_parallel: bool) -> Dict[str, Any]:
    """The run's losses per step and each rank's measured memory (train_with_options' summary)."""
    return _runs()[f"{arch}-{'sp' if sequence_parallel else 'tp'}"]


def fsdp2_by_tp2_sp_selective_run() -> Dict[str, Any]:
    """FSDP2 (dp 2) x tp 2 with sequence parallelism and op-level selective recomputation."""
    return _runs()["fsdp2-tp2"]


@lru_cache(maxsize=None)
def one_process_losses(arch: str) -> List[float]:
    return reference_losses(OVERRIDES[arch], STEPS)
