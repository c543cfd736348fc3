"""Which settings data.packing=document|balanced runs with: one line saying why not. Torch-free, so the
config check (validate/consistency.py) asks it before any worker starts."""
from __future__ import annotations

import functools
from typing import Mapping, Optional


def packing_refusal(packing: str, data_name: str, puzzle: bool = False, plan=None, train=None) -> Optional[str]:
    """One line saying why data.packing=document|balanced cannot run with these settings, or None.
    puzzle: the model trains on fixed-size puzzle examples (families.py: data kind); train: a TrainConfig or
    its plain mapping. Without `train` (the config check before any worker starts) only what the config
    alone decides. Every plan layout runs packed documents (pipelines, data parallelism, tensor parallelism
    with or without sequence parallelism, heterogeneous replicas); with `plan`, a replica's own seq_len
    without packing is refused (only packed rows are filled to it)."""
    if packing == "concat":
        own = [i for i, pipe in enumerate(getattr(plan, "pipelines", None) or []) if getattr(pipe, "seq_len", None)]
        if own:
            return (f"plan: pipelines[{own[0]}].seq_len gives a replica its own sequence length, which only packed "
                    "documents fill; set data.packing=document|balanced or remove the replica's seq_len")
        return None
    if puzzle:
        return f"data.packing={packing}: HRM's puzzles are fixed-size examples; arch=hrm takes data.packing=concat"
    if data_name != "code":
        return (f"data.packing={packing}: data={data_name} has no documents (packing keeps whole documents ending "
                f"in an end-of-text token apart); use data=code or data.packing=concat")
    if plan is not None and getattr(plan, "cp", 1) > 1:
        return (f"data.packing={packing}: context parallelism (the plan's cp: {plan.cp}) shards one sequence and its "
                "ring attention takes no per-document mask; use data.packing=concat or a plan with cp: 1")
    if train is not None:
        setting = train.get if isinstance(train, Mapping) else functools.partial(getattr, train)
        if int(setting("context_parallel", 1) or 1) > 1:
            return f"data.packing={packing}: context parallelism shards one sequence; set train.context_parallel=1"
        if setting("compile", False):
            return (f"data.packing={packing}: the per-document attention has a shape per document, which "
                    "torch.compile would recompile for; set train.compile=false")
    return None
