"""data.packing=document|balanced at run time: the packed step as the trainer and the pipeline carry it.

The trainer hands a step's `(inputs, targets)` to the engine, the engine to torch's schedule, which
splits both along the rows into micro-batches. A packed step travels in that same pair (so nothing
between the data and the stage module needs to know about documents):

    inputs   long [rows, 3, budget]    channel 0 the token ids, 1 the position inside its document,
                                       2 the document id (PAD_DOCUMENT on padding)
    targets  long [rows, budget + 2]   the next tokens (IGNORE_INDEX on padding), then two columns:
                                       the step's useful tokens (all rows, all replicas) and its rows

The first stage (models/documents.py) takes channels 1-2 apart as the `side` tensor and returns it
beside its activations; every later stage receives and returns it the same way, so the document
boundaries travel with the activations through the pipeline. The loss reads the two columns to weigh
each micro-batch's summed token loss so that the step's loss is the sum over all its tokens divided by
their number (see packed_micro_batch_loss in models/documents.py).

Who decides a balanced step: global rank 0 computes the dispatch one or more steps ahead in a
background thread (the step in flight never waits on the solver) and broadcasts each step's
assignment when the step starts; the documents themselves are a pure function of (seed, step) on
every rank. The dispatch stops at its wall-clock budget, so two ranks computing it could disagree;
one decides. The assignment changes only where a document runs, never which documents a step holds:
`document` and `balanced` train on the same tokens each step, and the step's loss is the same.
"""
from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hrlplan.data import dispatch as D
from hrlplan.data.dispatch_pipeline import one_f_one_b
from hrlplan.data.packing import PackedBatch, PackedDocuments, predictions
from hrlplan.errors import UserError

INPUT_CHANNELS = 3            # tokens, positions, document ids
TARGET_EXTRA_COLUMNS = 2      # the step's useful tokens, the step's rows
DEFAULT_DISPATCH_BUDGET_S = 0.25
DEFAULT_PREFETCH_STEPS = 2
# the integer program runs only where the greedy may be this far from the optimum: below it the
# solver's CPU, taken from the training ranks on a busy host, costs more than it could win
ILP_MIN_GAIN = 0.01


def to_wire(batch: PackedBatch, step_tokens: int, step_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A packed step (or a replica's share of one) as the trainer's (inputs, targets) pair."""
    inputs = torch.stack([batch.inputs, batch.positions, batch.doc_ids], dim=1)
    extra = torch.tensor([step_tokens, step_rows], dtype=torch.long).expand(batch.targets.shape[0], 2)
    return inputs.contiguous(), torch.cat([batch.targets, extra], dim=1)


@dataclass(frozen=True)
class ReplicaShape:
    """One replica of a heterogeneous plan: its micro-batches, their rows, its pipeline's depth, its
    speed (rows per second, relative to the other replicas') and its own token budget per row (None:
    data.seq_len), up to which its rows are filled (the wire rows stay data.seq_len long, padded; the
    replica's engine cuts them to its budget: models/documents.trim_packed)."""
    micro_batches: int
    rows_per_micro_batch: int
    stages: int = 1
    speed: float = 1.0
    token_budget: Optional[int] = None

    @property
    def rows(self) -> int:
        return self.micro_batches * self.rows_per_micro_batch


@dataclass(frozen=True)
class StepLayout:
    """How a step's rows run: `replicas` data-parallel replicas, each `micro_batches` micro-batches of
    `rows_per_micro_batch` rows, a pipeline of `stages` (None: only the slowest micro-batch counts);
    or, for a heterogeneous plan, each replica its own shape (`shapes`). Rows are laid out
    replica-major, micro-batch next, as the engines slice them."""
    replicas: int = 1
    micro_batches: int = 1
    rows_per_micro_batch: int = 1
    stages: Optional[int] = None
    shapes: Tuple[ReplicaShape, ...] = ()

    def replica_shapes(self) -> Tuple[ReplicaShape, ...]:
        if self.shapes:
            return self.shapes
        return tuple(ReplicaShape(self.micro_batches, self.rows_per_micro_batch, self.stages or 1)
                     for _ in range(self.replicas))

    @property
    def rows(self) -> int:
        return sum(shape.rows for shape in self.replica_shapes())

    @property
    def depth(self) -> Optional[int]:
        """The pipeline depth the dispatch's step objective takes: replicas of unequal depth are
        balanced by their slowest micro-batch instead (data/dispatch.py takes one depth)."""
        if not self.shapes:
            return self.stages
        depths = {shape.stages for shape in self.shapes}
        return depths.pop() if len(depths) == 1 else None

    def capacities(self, token_budget: int) -> Optional[List[int]]:
        """Each row's token budget, replica by replica; None where every row takes token_budget."""
        if all(shape.token_budget is None for shape in self.shapes):
            return None
        return [shape.token_budget or token_budget for shape in self.shapes for _ in range(shape.rows)]

    def bins(self, token_budget: int) -> List[D.Bin]:
        """One bin per row, at its replica's speed and budget: a micro-batch of several rows is
        approximated by its rows, each its own bin."""
        return [D.Bin(shape.token_budget or token_budget, shape.speed, r)
                for r, shape in enumerate(self.replica_shapes()) for _ in range(shape.rows)]

    @classmethod
    def of_plan(cls, plan) -> "StepLayout":
        if not plan.heterogeneous:
            return cls(int(plan.dp), int(plan.num_microbatches), int(plan.microbatch_size), int(plan.pp))
        pipes = plan.pipelines
        speeds = [replica_speed(pipe) for pipe in pipes]
        # a replica's own sequence length: read with getattr until the plan schema holds the field
        shapes = tuple(ReplicaShape(int(pipe.num_microbatches), int(pipe.microbatch_size), len(pipe.stages),
                                    speed / max(speeds), getattr(pipe, "seq_len", None))
                       for pipe, speed in zip(pipes, speeds))
        return cls(replicas=len(pipes), shapes=shapes)


def replica_speed(pipe) -> float:
    """A replica's rows per second from its plan alone (devices alike): a row passes its slowest stage,
    whose time goes with the blocks it holds per tensor-parallel rank. The plan records no device speeds;
    a faster replica's speed would come from the planner's predicted time per pipeline."""
    return 1.0 / max(max(stage.num_layers, 1) / stage.tp for stage in pipe.stages)


class PackedLMStream:
    """The trainer's LM stream (`batch(step, rows, split) -> (inputs, targets)`) over packed documents.

    `balanced` dispatches each training step's pieces by `coefficients` (linear, quadratic: a document
    of L tokens costs linear * L + quadratic * L**2, models/cost: cost/lengths.py) with fixed shapes:
    every row pays its whole budget's linear work, so with bins of one speed the linear coefficient and
    the scale drop out of the optimum, and (0, 1) is the default. Validation batches are packed in
    arrival order: the token-weighted loss does not depend on where a document runs."""

    def __init__(self, documents: PackedDocuments, layout: Optional[StepLayout] = None,
                 coefficients: Tuple[float, float] = (0.0, 1.0), time_budget_s: float = DEFAULT_DISPATCH_BUDGET_S,
                 prefetch: int = DEFAULT_PREFETCH_STEPS):
        self.documents, self.layout = documents, layout
        for r, shape in enumerate(layout.shapes if layout is not None else ()):
            if shape.token_budget is not None and not 1 <= shape.token_budget <= documents.token_budget:
                raise UserError(f"plan: pipelines[{r}].seq_len={shape.token_budget} must lie in 1..data.seq_len="
                                f"{documents.token_budget} (a replica's rows are cut from data.seq_len's)")
        self.coefficients, self.time_budget_s, self.prefetch = coefficients, time_budget_s, prefetch
        self.balanced = documents.packing == "balanced"
        self.decides = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self._ahead: Dict[int, Future] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self.dispatches: List[Dict[str, Any]] = []   # per training step decided here: method, seconds, times
        self.last_useful_tokens: Optional[int] = None   # the last training step's, for tokens/s without padding

    def _layout(self, rows: int) -> StepLayout:
        if self.layout is None:   # no plan given: each row its own micro-batch of one replica
            return StepLayout(1, rows, 1, None)
        if self.layout.rows != rows:
            raise ValueError(f"the step asks for {rows} rows, the plan's layout holds {self.layout.rows}")
        return self.layout

    def _decide(self, step: int, rows: int) -> List[List[int]]:
        """The balanced assignment of a training step's pieces (arrival order as the fallback)."""
        layout = self._layout(rows)
        pieces, arrival = self.documents.step_pieces(step, rows, capacities=self._capacities(rows))
        linear, quadratic = self.coefficients
        # the pipeline's step (fill, drain, lock-step), not only the slowest micro-batch; it needs a linear
        # coefficient (cost/lengths.document_coefficients), else an empty micro-batch looks free
        step_of = one_f_one_b(layout.depth) if layout.depth and linear > 0 else None
        result = D.dispatch_bins([predictions(p) for p in pieces], layout.bins(self.documents.token_budget), linear,
                                 quadratic, time_budget_s=self.time_budget_s, fallback=arrival,
                                 stages=layout.depth, fixed_shapes=True, ilp_min_gain=ILP_MIN_GAIN, step_of=step_of)
        self.dispatches.append({"step": step, "method": result.method, "seconds": result.seconds,
                                "step_time": result.step_time, "lower_bound": result.lower_bound})
        return result.assignment

    def _submit(self, step: int, rows: int) -> None:
        if step not in self._ahead:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hrlplan-dispatch")
            self._ahead[step] = self._pool.submit(self._decide, step, rows)

    def assignment(self, step: int, rows: int) -> List[List[int]]:
        """This step's balanced assignment on every rank: decided ahead on rank 0, broadcast from it."""
        decided: List[Any] = [None]
        if self.decides:
            self._submit(step, rows)
            decided[0] = self._ahead.pop(step).result()
            for ahead in range(step + 1, step + 1 + self.prefetch):   # the next steps' while this one trains
                self._submit(ahead, rows)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decided, src=0)
        return decided[0]

    def _capacities(self, rows: int) -> Optional[List[int]]:
        return None if self.layout is None else self._layout(rows).capacities(self.documents.token_budget)

    def batch(self, step: int, rows: int, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
        pieces, assignment = self.documents.step_pieces(step, rows, split, self._capacities(rows))
        if self.balanced and split == "train":
            assignment = self.assignment(step, rows)
        packed = self.documents.pack(pieces, assignment)
        if split == "train":
            self.last_useful_tokens = packed.useful_tokens
        return to_wire(packed, packed.useful_tokens, rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def build_packed_stream(packing: str, train_tokens: torch.Tensor, val_tokens: torch.Tensor, eot_id: int,
                        token_budget: int, seed: int, layout: Optional[StepLayout] = None,
                        coefficients: Tuple[float, float] = (0.0, 1.0),
                        time_budget_s: float = DEFAULT_DISPATCH_BUDGET_S,
                        prefetch: int = DEFAULT_PREFETCH_STEPS) -> PackedLMStream:
    dispatcher = functools.partial(D.dispatch, fixed_shapes=True) if packing == "balanced" else None
    documents = PackedDocuments(train_tokens, val_tokens, eot_id, token_budget, seed, packing, dispatcher)
    return PackedLMStream(documents, layout, coefficients, time_budget_s, prefetch)
