"""The pipeline schedules: one registry entry per schedule, the one place that knows their names.

Every fact the rest of the code asks about a schedule is here: the torch class that runs it (resolved
with torch.distributed.pipelining's get_schedule_class), which stages per rank it takes, where each
virtual stage lives (looped or V-shaped), whether it splits the backward into input-gradient (B) and
weight-gradient (W) passes, whether hrlplan's own heterogeneous executor runs it, the order family the
simulator's timeline generates (hrlplan.cost.schedule_orders.ORDER_GENERATORS), and its textbook bubble.

A leaf: stdlib only at import; torch is imported inside torch_class (tab completion, `--help`).
Adding a schedule: docs/schedules.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional, Tuple

from hrlplan.errors import ConfigError


class Order(Enum):
    """The per-position operation order a schedule's timeline follows (one generator each in
    hrlplan.cost.schedule_orders). Schedules that differ only in their facts share one."""
    FILL_DRAIN = "fill_drain"            # every forward, then every backward (GPipe)
    ONE_F_ONE_B = "one_f_one_b"          # warm-up forwards, then one forward one backward (Megatron's, looped)
    ZERO_BUBBLE_H1 = "zero_bubble_h1"    # 1F1B with W split off and deferred into the cool-down (ZB-H1)
    ZBV = "zbv"                          # torch's ScheduleZBVZeroBubble: V placement, F/B/W per chunk
    DUALPIPEV = "dualpipev"              # torch's ScheduleDualPipeV: V placement, F0B1-F1B0 pairs


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    multi_stage: bool              # takes stages_per_rank > 1
    v_shape: bool                  # rank r holds virtual stages r and 2*pp-1-r (stages_per_rank must be 2)
    split_backward: bool           # input-gradient B and weight-gradient W run apart (no torch.compile)
    heterogeneous: bool            # hrlplan's own executor runs it (replica / `pipelines:` plans, unequal tp)
    order: Order
    torch_single: Optional[str]    # get_schedule_class name with one stage per rank (None: not taken)
    torch_multi: Optional[str]     # ... with several stages per rank
    # the stages per rank it takes; None: any >= 1
    fixed_stages_per_rank: Optional[Tuple[int, ...]] = None
    # least micro-batches as a multiple of pp (1F1B's torch class: m >= pp; DualPipeV: m >= 2 pp)
    min_microbatches_per_pp: int = 0
    summary: str = ""

    # -- which stages per rank ------------------------------------------------------------------
    def takes(self, stages_per_rank: int) -> bool:
        if self.fixed_stages_per_rank is not None:
            return stages_per_rank in self.fixed_stages_per_rank
        return stages_per_rank >= 1 and (self.multi_stage or stages_per_rank == 1)

    def allowed_stages_per_rank(self) -> str:
        """In words, for messages: '2', '1', 'any >= 1'."""
        if self.fixed_stages_per_rank is not None:
            return " or ".join(str(v) for v in self.fixed_stages_per_rank)
        return "any >= 1" if self.multi_stage else "1"

    def stages_per_rank_for(self, requested: int) -> int:
        """The stages per rank a search uses for this schedule when `requested` are configured:
        a V schedule's own 2, a looped multi-stage schedule's request, a single-stage schedule's 1."""
        if self.fixed_stages_per_rank is not None:
            return requested if requested in self.fixed_stages_per_rank else self.fixed_stages_per_rank[0]
        return max(1, requested) if self.multi_stage else 1

    # -- torch -----------------------------------------------------------------------------------
    def torch_name(self, stages_per_rank: int) -> str:
        name = self.torch_single if stages_per_rank == 1 else self.torch_multi
        if name is None or not self.takes(stages_per_rank):
            raise ConfigError("train.stages_per_rank", stages_per_rank,
                              message=f"train.stages_per_rank={stages_per_rank} is not allowed with schedule "
                                      f"{self.name}: it takes {self.allowed_stages_per_rank()}")
        return name

    def torch_class(self, stages_per_rank: int) -> type:
        from torch.distributed.pipelining.schedules import get_schedule_class  # torch stays out of the leaf's import
        return get_schedule_class(self.torch_name(stages_per_rank))

    def uses_multi_stage_class(self, stages_per_rank: int) -> bool:
        """Whether the torch class takes a list of stages (PipelineScheduleMulti) rather than one."""
        return stages_per_rank > 1 or self.torch_single in _MULTI_CLASS_NAMES

    # -- placement ---------------------------------------------------------------------------------
    def stage_rank(self, stage: int, pp: int, stages_per_rank: int) -> int:
        """The pipeline position (rank in the pp group) that runs virtual stage `stage`."""
        if stages_per_rank == 1:
            return stage
        if self.v_shape:
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def stage_ranks(self, pp: int, stages_per_rank: int) -> List[int]:
        """The position of each virtual stage, in model order: looped (0..pp-1, 0..pp-1, ...) or V
        (0..pp-1, pp-1..0)."""
        return [self.stage_rank(k, pp, stages_per_rank) for k in range(pp * stages_per_rank)]

    def rank_stages(self, position: int, pp: int, stages_per_rank: int) -> List[int]:
        """The virtual stages position `position` runs, in its local (chunk) order."""
        return [k for k in range(pp * stages_per_rank) if self.stage_rank(k, pp, stages_per_rank) == position]

    # -- micro-batches ---------------------------------------------------------------------------
    def microbatch_refusal(self, pp: int, m: int, stages_per_rank: int) -> Optional[str]:
        """Why `m` micro-batches cannot run on `pp` positions, or None. The torch classes' own
        constraints: Schedule1F1B m >= pp, DualPipeV m >= its 2 pp stages, the interleaved classes
        m a multiple of their rounds (max(1, m // pp))."""
        if pp > 1 and m < self.min_microbatches_per_pp * pp:
            return (f"schedule {self.name} needs at least {self.min_microbatches_per_pp * pp} micro-batches on "
                    f"{pp} pipeline positions, got {m}")
        if pp > 1 and self.uses_multi_stage_class(stages_per_rank) and not self.v_shape:
            rounds = max(1, m // pp)
            if m % rounds:
                return (f"schedule {self.name} needs the micro-batches ({m}) to be a multiple of its rounds "
                        f"max(1, m // pp) = {rounds}")
        return None

    # -- analytic bubble -------------------------------------------------------------------------
    def bubble(self, pp: int, m: int, stages_per_rank: int = 1) -> float:
        """Idle fraction of a position with equal stages, free communication and one pass per F, B
        and W (a whole backward is B + W), counted in passes of one virtual stage: GPipe and 1F1B
        (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1); ZB-H1 a third of that; torch's ZB-V order leaves
        p-1 passes over 6 m of work, 2(2p-1-m) with fewer than 2p-1 micro-batches; DualPipeV 2(p-1):
        torch 2.13 runs each F&B pair as F then B+W and sends the F's output only once the pair has
        run (measured: the next stage's forward starts after the pair's backward), which doubles the
        (p-1) of the DualPipe paper's overlapped pairs. The simulator's
        timeline on such a plan reproduces each (tests/test_schedule_registry.py)."""
        p, v = pp, stages_per_rank
        if p <= 1 or m <= 0:
            return 0.0
        idle = _BUBBLE_PASSES[self.order](p, m, v)
        work = 3.0 * m * v
        return idle / (work + idle)

    def idle_share_of_1f1b(self, pp: int, m: int, stages_per_rank: int = 1) -> float:
        """The idle time this schedule leaves over 1F1B's on the same stages with equal passes:
        1 for GPipe and 1F1B, 1/v interleaved, 1/(3v) ZB-H1, 1/6 ZB-V, 1/3 DualPipeV."""
        if pp <= 1:
            return 1.0
        return _BUBBLE_PASSES[self.order](pp, m, stages_per_rank) / (3.0 * (pp - 1) * stages_per_rank)


_BUBBLE_PASSES = {   # idle passes of a position, per order family
    Order.FILL_DRAIN: lambda p, m, v: 3.0 * (p - 1),
    Order.ONE_F_ONE_B: lambda p, m, v: 3.0 * (p - 1),
    Order.ZERO_BUBBLE_H1: lambda p, m, v: 1.0 * (p - 1),
    Order.ZBV: lambda p, m, v: float(max(p - 1, 2 * (2 * p - 1 - m))),
    Order.DUALPIPEV: lambda p, m, v: 2.0 * (p - 1),
}
_MULTI_CLASS_NAMES = ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble", "DualPipeV")

SCHEDULES: Dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", multi_stage=False, v_shape=False, split_backward=False, heterogeneous=True,
                 order=Order.FILL_DRAIN, torch_single="GPipe", torch_multi=None, fixed_stages_per_rank=(1,),
                 summary="all forwards, then all backwards (Huang et al. 2019)"),
    ScheduleSpec("1f1b", multi_stage=False, v_shape=False, split_backward=False, heterogeneous=True,
                 order=Order.ONE_F_ONE_B, torch_single="1F1B", torch_multi=None, fixed_stages_per_rank=(1,),
                 min_microbatches_per_pp=1, summary="one forward one backward (PipeDream-Flush)"),
    ScheduleSpec("interleaved_1f1b", multi_stage=True, v_shape=False, split_backward=False, heterogeneous=False,
                 order=Order.ONE_F_ONE_B, torch_single="Interleaved1F1B", torch_multi="Interleaved1F1B",
                 summary="1F1B over looped virtual stages (Narayanan et al. 2021)"),
    ScheduleSpec("interleaved_zero_bubble", multi_stage=True, v_shape=False, split_backward=True,
                 heterogeneous=False, order=Order.ZERO_BUBBLE_H1, torch_single="InterleavedZeroBubble",
                 torch_multi="InterleavedZeroBubble",
                 summary="ZB-H1 over looped virtual stages: W passes fill the cool-down (Qi et al. 2024)"),
    ScheduleSpec("zbv", multi_stage=True, v_shape=True, split_backward=True, heterogeneous=False,
                 order=Order.ZBV, torch_single=None, torch_multi="ZBVZeroBubble", fixed_stages_per_rank=(2,),
                 summary="ZB-V: two V-placed stages per rank, W passes fill the bubbles (Qi et al. 2024)"),
    ScheduleSpec("dualpipev", multi_stage=True, v_shape=True, split_backward=True, heterogeneous=False,
                 order=Order.DUALPIPEV, torch_single=None, torch_multi="DualPipeV", fixed_stages_per_rank=(2,),
                 min_microbatches_per_pp=2,
                 summary="DualPipeV: V-placed, a forward of one micro-batch beside a backward of another "
                         "(DeepSeek-V3 2024)"),
)}

# Old names kept working: zero_bubble meant ZB-V with 2 stages per rank, interleaved zero-bubble otherwise.
ALIASES: Dict[str, str] = {"zero_bubble": "zbv | interleaved_zero_bubble (by stages_per_rank)"}


def names() -> Tuple[str, ...]:
    """Every name train.schedule takes: the registry's and the aliases."""
    return tuple(SCHEDULES) + tuple(ALIASES)


def canonical_name(name: str, stages_per_rank: int) -> str:
    """The registry name `name` stands for (an alias resolved by stages_per_rank)."""
    if name in ALIASES:
        return "zbv" if stages_per_rank == 2 else "interleaved_zero_bubble"
    return name


def get(name: str, stages_per_rank: int = 1) -> ScheduleSpec:
    """The spec of a name (aliases resolved) without checking stages_per_rank; ConfigError if unknown."""
    spec = SCHEDULES.get(canonical_name(str(name), stages_per_rank))
    if spec is None:
        raise ConfigError("train.schedule", name, allowed=names())
    return spec


def resolve_schedule(name: str, stages_per_rank: int) -> ScheduleSpec:
    """The spec a (schedule, stages_per_rank) pair runs; one-line ConfigError for an unknown name or
    stages per rank the schedule does not take."""
    spec = get(name, stages_per_rank)
    if not spec.takes(stages_per_rank):
        raise ConfigError("train.stages_per_rank", stages_per_rank,
                          message=f"train.stages_per_rank={stages_per_rank} is not allowed with schedule {name}: "
                                  f"it takes {spec.allowed_stages_per_rank()}")
    return spec


def multi_stage_names() -> Tuple[str, ...]:
    return tuple(n for n, s in SCHEDULES.items() if s.multi_stage) + tuple(ALIASES)


def heterogeneous_names() -> Tuple[str, ...]:
    return tuple(n for n, s in SCHEDULES.items() if s.heterogeneous)


DEFAULT = "1f1b"
