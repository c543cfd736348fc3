"""The homogeneous plan on torch.distributed.pipelining: every schedule of the registry (hrlplan.schedules),
built from its torch class and placed as its stage_ranks say.

A (pp, dp, cp, tp) mesh with the plan's own rank layout; each stage is tensor-parallel over its tp
sub-mesh (DTensor), then data-parallel over its dp (x cp) sub-mesh (FSDP2 or replicate), then wrapped
in a PipelineStage whose p2p group is the pp sub-mesh of this rank's (dp, cp, tp) lane. Under context
parallelism (cp > 1) every step runs inside runtime/context_parallel.sharded_step: ring attention
over the cp sub-mesh, and this rank's share of each sequence (inputs, labels and position ids), so
activations cross stage boundaries sequence-sharded, to the next stage's rank of the same cp index.

The pp sub-mesh's process group numbers its ranks in ascending global order (torch sorts a new
group's ranks), while torch's schedules assume stage k sits on group rank k: a plan whose groups are
not in rank order (stage 0 on rank 1, as a link-aware planner lays out) maps both explicitly.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from hrlplan.config import TrainConfig, section
from hrlplan.errors import UserError
from hrlplan.models.hf import build_stage_modules, materialize
from hrlplan.plan import Plan
from hrlplan.runtime import context_parallel as cp
from hrlplan.runtime.compile import apply_compile
from hrlplan.runtime.float8 import apply_float8
from hrlplan.runtime.parallel import (TiedEmbeddingSync, apply_data_parallel, build_mesh, clip_grad_norm, fsdp_mesh,
                                     rank_coords)
from hrlplan.runtime.recompute import apply_recompute
from hrlplan.runtime.tensor_parallel import loss_context, parallelize_stage, stage_loss
from hrlplan.runtime.timing import StepRecorder, instrument_pipeline_stage
from hrlplan.schedules import ScheduleSpec, resolve_schedule
from hrlplan.validate.train_options import train_options_refusal


def plan_schedule(plan: Plan) -> ScheduleSpec:
    """The registry entry the plan's schedule runs (an alias resolved by its stages per rank)."""
    return resolve_schedule(plan.schedule, plan.stages_per_rank)


def _takes_return_outputs(schedule) -> bool:
    """Whether this torch's schedule.step takes return_outputs (older builds keep the outputs regardless)."""
    return "return_outputs" in inspect.signature(schedule.step).parameters


def build_schedule(plan: Plan, stages: List[PipelineStage], loss_fn):
    """The registry's torch class for the plan; a multi-stage class takes this rank's stage list
    (also with one stage per rank, as interleaved 1F1B's and interleaved zero-bubble's do)."""
    cls = plan_schedule(plan).torch_class(plan.stages_per_rank)
    mine = stages if issubclass(cls, PipelineScheduleMulti) else stages[0]
    return cls(mine, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)


def stage_group_ranks(plan: Plan, pp_group, coords: Dict[str, int]) -> Dict[int, int]:
    """Stage index -> rank within `pp_group` of the rank that runs it in this (dp, tp) lane."""
    pos = (coords["dp"] * plan.cp + coords["cp"]) * plan.stages[0].tp + coords["tp"]
    return {k: dist.get_group_rank(pp_group, plan.device_groups[plan.stage_group(k)][pos])
            for k in range(plan.num_stages)}


def place_stages(schedule, stages: List[PipelineStage], plan: Plan, group_ranks: Dict[int, int], coords) -> None:
    """Point the stages' p2p at the group ranks that really hold their neighbours. A multi-stage
    schedule's action table is keyed by pipeline position (stage k on the registry's stage_ranks[k],
    its own mapping, which stays): this rank runs its plan position's row."""
    for stage in stages:
        stage.stage_index_to_group_rank = dict(group_ranks)
    if isinstance(schedule, PipelineScheduleMulti):
        logical = dict(enumerate(plan_schedule(plan).stage_ranks(plan.pp, plan.stages_per_rank)))
        theirs = schedule.stage_index_to_group_rank
        if theirs != logical:
            raise RuntimeError(f"torch's {type(schedule).__name__} places stages as {theirs}, the plan as "
                               f"{logical}; use a schedule whose placement the plan shares")
        schedule.rank = coords["pp"]


def sequence_parallel(plan: Plan) -> bool:
    """The plan's sequence parallelism (a per-stage `sequence_parallel`, read where present; off
    otherwise). Stages exchange sequence-sharded activations, so every stage must agree."""
    chosen = {bool(getattr(stage, "sequence_parallel", False)) for stage in plan.stages}
    if len(chosen) > 1:
        raise ValueError("sequence_parallel differs between stages: stages pass sequence-sharded activations "
                         "to each other, so set it on every stage or on none")
    return chosen.pop()


def check_device_options(train: TrainConfig, device: torch.device, plan: Plan) -> None:
    """train.compile / float8 and the plan's cp on the device this worker really got (the launcher
    checked its own host's already; a SLURM node may differ)."""
    cuda = device.type == "cuda"
    options = {"compile": train.compile, "float8": train.float8, "context_parallel": plan.cp}
    refused = train_options_refusal(options, device.type, torch.cuda.get_device_capability(device) if cuda else None,
                                    torch.cuda.get_device_name(device) if cuda else "", plan.num_stages)
    if refused:
        raise UserError(refused[1])


class TorchPipelineEngine:
    """One step = one `schedule.step`; parts maps this rank's stage indices to their modules."""

    def __init__(self, plan: Plan, train: TrainConfig, device: torch.device, full_model, recorder: StepRecorder):
        train = section(TrainConfig, train)
        self.plan, self.device, self.recorder = plan, device, recorder
        check_device_options(train, device, plan)
        self.rank = dist.get_rank()
        self.coords = rank_coords(plan, self.rank)
        self.mesh = build_mesh(plan, device.type)
        self.cp_mesh = self.mesh["cp"] if plan.cp > 1 else None
        cp.check_sdpa_attention(full_model.config, plan.cp)
        self.pp_group = self.mesh["pp"].get_group()
        self.stage_ids = plan.stages_of_rank(self.rank)
        self.tied = bool(getattr(full_model.config, "tie_word_embeddings", False))
        all_parts = build_stage_modules(full_model, [tuple(s.layers) for s in plan.stages])
        materialize(full_model, [m for i in self.stage_ids for m in all_parts[i].modules()], int(train.seed))
        self.tie_sync = TiedEmbeddingSync(plan, self.rank, self.tied)
        if self.tie_sync.local and 0 in self.stage_ids:
            TiedEmbeddingSync.untie(all_parts)
        self.parts: Dict[int, torch.nn.Module] = {}
        mp_dtype = torch.bfloat16 if train.dtype == "bfloat16" else None
        tp = plan.stages[0].tp
        self.sequence_parallel = tp > 1 and sequence_parallel(plan)
        self.reshard_after_forward = plan.resolved_reshard_after_forward()   # the plan's rule, as cost/ charges it
        for i in self.stage_ids:
            part = all_parts[i].to(self.device)
            if train.float8:   # first, as torchtitan's model converters: tp then shards the Float8Linears
                apply_float8(part)
            if tp > 1:
                parallelize_stage(part, self.mesh["tp"], vocab_parallel=bool(train.vocab_parallel),
                                  sequence_parallel=self.sequence_parallel)
            apply_recompute(part, plan.stages[i].recompute)   # after tp, before FSDP (torchtitan's order)
            if train.compile:   # each block on its own, around its checkpoint, inside FSDP's hooks
                apply_compile(part)
            blocks = getattr(part.base, part.blocks_attr)
            if mp_dtype is not None and (fsdp_mesh(self.mesh).size() == 1 or train.dp_mode != "fsdp"):
                part.autocast_dtype = mp_dtype   # FSDP's MixedPrecisionPolicy casts only what it shards
            self.parts[i] = apply_data_parallel(part, fsdp_mesh(self.mesh), str(train.dp_mode), blocks, mp_dtype,
                                                reshard_after_forward=self.reshard_after_forward)
        del all_parts
        self.tie_sync.bind(self.parts, plan)
        self.stages = [PipelineStage(self.parts[i], i, plan.num_stages, self.device, group=self.pp_group)
                       for i in self.stage_ids]
        self.spec = plan_schedule(plan)
        for i, stage in zip(self.stage_ids, self.stages):
            instrument_pipeline_stage(stage, recorder, i, self.spec.split_backward)
        self.schedule = build_schedule(plan, self.stages, stage_loss(self.parts.values()))
        place_stages(self.schedule, self.stages, plan, stage_group_ranks(plan, self.pp_group, self.coords),
                     self.coords)
        self.has_first = 0 in self.parts
        self.has_last = (plan.num_stages - 1) in self.parts
        self.loss_reporter = self.has_last and self.coords["tp"] == 0

    def local_rows(self) -> slice:
        rows = self.plan.global_batch_size // self.plan.dp
        d = self.coords["dp"]
        return slice(d * rows, (d + 1) * rows)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, through the same schedule. Split-backward schedules (zero-bubble, DualPipeV)
        cannot run without their backward in torch 2.13, so they run a full step whose gradients are dropped."""
        if self.spec.split_backward:
            loss = self.forward_backward(inputs, targets)
            for part in self.parts.values():
                part.zero_grad(set_to_none=True)
            return loss
        return self.forward_backward(inputs, targets, train=False)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True) -> torch.Tensor:
        """Runs the schedule; returns this rank's share of the global loss (a sum over ranks gives it).
        Under context parallelism each rank's loss is the mean over its equal share of the tokens."""
        losses: List[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        # a vocabulary-parallel head's loss, forward and backward; the sequences' cp shards
        with loss_context(self.parts.values()), self.sequence_shards(targets.shape[1]) as positions:
            if positions is not None:
                inputs, targets = cp.take_positions(inputs, positions), cp.take_positions(targets, positions)
            # the step needs the losses only: torch's last stage would otherwise keep every micro-batch's
            # output (the logits) until the step ends
            keep = {"return_outputs": False} if train and _takes_return_outputs(self.schedule) else {}
            if self.has_first:
                run(inputs, target=targets, losses=losses, **keep)
            else:
                run(target=targets, losses=losses, **keep)
        loss = torch.zeros(1, device=self.device)
        if self.loss_reporter:
            loss[0] = torch.stack([l.detach().float() for l in losses]).mean() / (self.plan.dp * self.plan.cp)
        return loss

    def sequence_shards(self, seq_len: int):
        """cp > 1: torch's context_parallel around the step, yielding this rank's position ids; else nothing."""
        if self.cp_mesh is None:
            return nullcontext(None)
        return cp.sharded_step(self.cp_mesh, seq_len, self.device, self.parts.values())

    def sync_and_clip(self, max_norm: float) -> torch.Tensor:
        self.tie_sync.sync_grads()
        # dict: a tied embedding held by two stages of this rank (ZBV) is one parameter, counted once
        params = list({id(p): p for part in self.parts.values() for p in part.parameters()}.values())
        skip = [p for p in params if self.tie_sync.is_duplicate(p, self.parts, self.plan)]
        return clip_grad_norm(params, max_norm, self.pp_group, skip)
