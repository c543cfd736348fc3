"""Pipeline templates: heterogeneous data-parallel replicas described by module lists per stage.

In the spirit of heterogeneous pipeline plugins (Oobleck-style templates, HSPMD strategies):

    modules = get_modules(model)                         # ordered module names of an HF model
    one = PipelineTemplate(model, [modules])             # 1 stage
    two = PipelineTemplate(model, [modules[:5], modules[5:]])
    plugin = HeterogeneousParallelPlugin(tp_size=1, world_size=3, global_batch_size=8)
    plan = plugin.set_pipelines([one, two], num_microbatches={one: 2, two: 2})

The result is an ordinary hrlplan Plan (with `pipelines`), so it is saved as plan.yaml and run with
planner=manual like any other plan. The error messages are the ones users of such plugins know.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist
import torch.nn as nn

from hrlplan.model_meta import ModelResolutionError, resolve_arch
from hrlplan.models.hf import build_hf_model, hf_config_from_arch, hf_layout
from hrlplan.plan import PipelinePlan, Plan, StagePlan, launch_meta, validate
from hrlplan.schedules import DEFAULT

MODULES_MISMATCH = "Modules in the pipeline template do not match the modules in the model"
RANKS_MISMATCH = "Number of ranks in pipeline templates does not match world size"
MICROBATCHES_MISSING = "All pipelines must have a corresponding number of microbatches"


@dataclass(frozen=True)
class ModelModules:
    """A model's modules in order, split into what must go first, the blocks, and what must go last."""
    name: str
    first: Tuple[str, ...]     # input embeddings
    blocks: Tuple[str, ...]    # transformer blocks, in order
    last: Tuple[str, ...]      # final norm and output head

    @property
    def all(self) -> List[str]:
        return list(self.first + self.blocks + self.last)


def model_modules(model: Union[nn.Module, str]) -> ModelModules:
    if isinstance(model, str):
        model = _meta_model(model)
    name = type(model).__name__
    try:
        layout = hf_layout(model)
    except ModelResolutionError as e:
        raise NotImplementedError(f"Auto policy for {name} is not implemented: {e}") from None
    n_blocks = len(getattr(layout.base, layout.blocks_attr))
    first = tuple(f"{layout.prefix}.{n}" for n in layout.embed_names)
    blocks = tuple(f"{layout.prefix}.{layout.blocks_attr}.{i}" for i in range(n_blocks))
    last = tuple(f"{layout.prefix}.{n}" for n in layout.final_names) + (layout.head_name,)
    return ModelModules(name=getattr(model.config, "name_or_path", "") or name, first=first, blocks=blocks, last=last)


def get_modules(model: Union[nn.Module, str]) -> List[str]:
    """Ordered module names of `model` (an HF model, or a shipped arch name such as gpt2-tiny)."""
    return model_modules(model).all


def _meta_model(arch_name: str) -> nn.Module:
    arch = resolve_arch(arch_name)
    model = build_hf_model(hf_config_from_arch(arch), on_meta=True)   # structure only: nothing allocated
    model.config.name_or_path = arch.get("name", arch_name)
    return model


class PipelineTemplate:
    """One pipeline's stages as module lists; hashable, so templates key the micro-batch dict."""

    def __init__(self, model: Union[nn.Module, str], modules_per_stage: Sequence[Sequence[str]],
                 tp: Union[int, Sequence[int]] = 1):
        mm = model_modules(model)
        self.model_name = model if isinstance(model, str) else mm.name
        self.modules_per_stage: Tuple[Tuple[str, ...], ...] = tuple(tuple(s) for s in modules_per_stage)
        flat = [m for s in self.modules_per_stage for m in s]
        if not self.modules_per_stage or sorted(flat) != sorted(mm.all) or len(set(flat)) != len(flat):
            raise ValueError(MODULES_MISMATCH)
        if flat != mm.all:
            raise ValueError(f"{MODULES_MISMATCH}: stages must take the modules in the model's order "
                             "(contiguous slices of get_modules(model))")
        for name in mm.first:
            if name not in self.modules_per_stage[0]:
                raise ValueError(f"The first stage must contain {name} module")
        for name in mm.last:
            if name not in self.modules_per_stage[-1]:
                raise ValueError(f"The last stage must contain {name} module")
        index = {name: i for i, name in enumerate(mm.blocks)}
        spans, start = [], 0
        for stage in self.modules_per_stage:
            count = sum(1 for m in stage if m in index)
            spans.append((start, start + count))
            start += count
        self.spans: Tuple[Tuple[int, int], ...] = tuple(spans)
        self.n_layer = len(mm.blocks)
        tps = [tp] * len(spans) if isinstance(tp, int) else list(tp)
        if len(tps) != len(spans) or any(t < 1 for t in tps):
            raise ValueError(f"tp must be one degree >= 1, or one per stage ({len(spans)} stages), got {tp!r}")
        self.tp: Tuple[int, ...] = tuple(tps)

    @staticmethod
    def get_modules(model: Union[nn.Module, str]) -> List[str]:
        return get_modules(model)

    @property
    def num_stages(self) -> int:
        return len(self.spans)

    @property
    def num_ranks(self) -> int:
        return sum(self.tp)

    def _key(self):
        return (self.model_name, self.modules_per_stage, self.tp)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, PipelineTemplate) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"PipelineTemplate({self.model_name}, {self.num_stages} stages, spans={list(self.spans)}, tp={list(self.tp)})"


def build_plan(pipelines: Sequence[PipelineTemplate], num_microbatches: Dict[PipelineTemplate, int],
               world_size: int, global_batch_size: int, batch_sizes: Optional[Sequence[int]] = None,
               schedule: str = DEFAULT, unused_ranks: Sequence[int] = (),
               rank_to_device: Optional[Sequence[int]] = None, model: Optional[str] = None,
               tp_size: int = 1) -> Plan:
    """A heterogeneous Plan: ranks are handed out pipeline by pipeline, stage by stage, tp-minor.

    Without batch_sizes, every pipeline gets the same micro-batch size and hence a batch share
    proportional to its micro-batch count (HSPMD's convention). A template built without tp takes
    `tp_size` for each of its stages.
    """
    def tps(t: PipelineTemplate) -> Tuple[int, ...]:
        return (tp_size,) * t.num_stages if set(t.tp) == {1} else t.tp

    if not pipelines:
        raise ValueError("set_pipelines needs at least one pipeline template")
    if any(t not in num_microbatches for t in pipelines):
        raise AssertionError(MICROBATCHES_MISSING)
    needed = sum(sum(tps(t)) for t in pipelines)
    if needed + len(unused_ranks) != world_size:
        raise AssertionError(f"{RANKS_MISMATCH}: the templates need {needed} ranks "
                             f"(+{len(unused_ranks)} unused) but world size is {world_size}")
    counts = [int(num_microbatches[t]) for t in pipelines]
    if batch_sizes is None:
        if global_batch_size % sum(counts):
            raise ValueError(f"global batch {global_batch_size} does not split into {sum(counts)} equal micro-batches; "
                             "give batch_sizes per pipeline")
        mbs = global_batch_size // sum(counts)
        batch_sizes = [mbs * m for m in counts]
    if len(batch_sizes) != len(pipelines):
        raise ValueError(f"{len(batch_sizes)} batch sizes for {len(pipelines)} pipelines")
    free = [r for r in range(world_size) if r not in set(unused_ranks)]
    out: List[PipelinePlan] = []
    for t, m, rows in zip(pipelines, counts, batch_sizes):
        stages = []
        for i, ((start, end), tp) in enumerate(zip(t.spans, tps(t))):
            ranks, free = free[:tp], free[tp:]
            stages.append(StagePlan(layers=[start, end], ranks=ranks, tp=tp, embedding=(i == 0),
                                    head=(i == t.num_stages - 1)))
        out.append(PipelinePlan(stages=stages, num_microbatches=m, batch_size=int(rows)))
    first = out[0]
    meta: Dict[str, Any] = {"launch": launch_meta(world_size)}
    if rank_to_device is not None:
        meta["launch"]["rank_to_device"] = list(rank_to_device)
    plan = Plan(model=model or pipelines[0].model_name, n_layer=pipelines[0].n_layer, world_size=world_size,
                pp=len(first.stages), microbatch_size=max(first.microbatch_size, 1),
                num_microbatches=first.num_microbatches, global_batch_size=global_batch_size, schedule=schedule,
                stages=first.stages, device_groups=[list(s.ranks) for s in first.stages], meta=meta,
                pipelines=out, unused_ranks=sorted(unused_ranks))
    validate(plan)
    return plan


class HeterogeneousParallelPlugin:
    """The familiar plugin shape: tp size and world, then set_pipelines(...) -> Plan (also .plan)."""

    def __init__(self, tp_size: int = 1, world_size: Optional[int] = None, global_batch_size: int = 8,
                 schedule: str = DEFAULT, unused_ranks: Sequence[int] = ()):
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.tp_size, self.world_size = tp_size, world_size
        self.global_batch_size, self.schedule, self.unused_ranks = global_batch_size, schedule, list(unused_ranks)
        self.plan: Optional[Plan] = None

    def set_pipelines(self, pipelines: Sequence[PipelineTemplate], num_microbatches: Dict[PipelineTemplate, int],
                      batch_sizes: Optional[Sequence[int]] = None) -> Plan:
        self.plan = build_plan(pipelines, num_microbatches, self.world_size, self.global_batch_size, batch_sizes,
                               self.schedule, self.unused_ranks, tp_size=self.tp_size)
        return self.plan
