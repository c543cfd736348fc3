"""What packed documents of mixed length cost a pipeline step (issue 37, item 3).

The simulator costs a micro-batch as `microbatch_size x seq_len` tokens of one fixed length: its blocks'
matmuls (linear in the tokens) and attention over the whole `seq_len` square. With data.packing=
document|balanced a micro-batch still holds `seq_len` positions (fixed shapes: the padding pays its
linear work), but attention covers only each document's own square, so a micro-batch's work depends
on which documents it holds: its sum of squared lengths. This module

- measures the length distribution of a corpus (LengthDistribution: the pieces a packed step draws);
- samples the steps a packing makes from it (`sample_steps`: next-fit in arrival order for `document`,
  the dispatch's greedy for `balanced`, as hrlplan/data/dispatch.py runs it);
- turns one step's per-micro-batch squares into per-(stage, micro-batch) work multipliers against the
  fixed-length micro-batch the simulator costs (`micro_batch_multipliers`), from the planner's own
  FLOP counts (ModelMeta.block_flops_fwd_per_token: 2 per weight + 4 * seq * query width per token);
- costs a step through the simulator: Simulator.evaluate(layout, micro_batch_work=multipliers) runs
  its timeline with stage k's durations times multipliers[k][j] for micro-batch j (`simulator_step_of`,
  `packed_step_times`), so fill, drain and the lock-step of a pipeline whose micro-batches differ
  are in the predicted step;
- gives the dispatch the same step to minimise (`dispatch_model`: its costs in units of a fixed-length
  row, and a bin's time back to work multipliers, then the simulated step);
- walks measured per-(stage, micro-batch) forward and backward times through a schedule's order
  (`pipeline_step`, equal to the simulator's timeline without its FSDP extras and handshake: tested);
- gives the mean step when each micro-batch's time strays from its predicted one as measured rows do
  (`expected_step`): a step is the longest path through the schedule, a maximum, so rows that stray
  either way lengthen it on average -- more the more paths are near-critical (a balanced packing's,
  the slowest of several replicas) -- and a deterministic timeline of the predicted rows falls short.
"""
from __future__ import annotations

import bisect
import os
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hrlplan.cost.schedule_orders import B, BW, F, structure
from hrlplan.data import dispatch as D
from hrlplan.data.code_corpus import CodeCorpus
from hrlplan.data.packing import document_pieces, next_fit, predictions, split_documents


@dataclass
class LengthDistribution:
    """The pieces (documents, cut at `budget` predictions) of a corpus: their prediction counts."""
    lengths: List[int]
    budget: int

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eot_id: int, budget: int) -> "LengthDistribution":
        pieces = [predictions(p) for d in split_documents(tokens, eot_id) for p in document_pieces(d, budget)]
        if not pieces:
            raise ValueError("the corpus holds no document of two or more tokens")
        return cls(pieces, budget)

    def summary(self) -> Dict[str, float]:
        ordered = sorted(self.lengths)
        total = sum(ordered)
        return {"pieces": len(ordered), "mean": total / len(ordered), "median": statistics.median(ordered),
                "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1],
                # the length a token sits in, on average: what attention's per-token work follows
                "token_weighted_mean": sum(n * n for n in ordered) / total}

    def to_dict(self) -> Dict:
        return {"budget": self.budget, "lengths": list(self.lengths)}

    @classmethod
    def from_dict(cls, d: Dict) -> "LengthDistribution":
        return cls([int(n) for n in d["lengths"]], int(d["budget"]))

    @classmethod
    def of_corpus(cls, path: str, budget: int) -> Optional["LengthDistribution"]:
        """The pieces of the data=code corpus built at `path`, cut at `budget`; None where none is built
        yet (training builds it) or it has no end-of-text token to cut documents at."""
        if not os.path.exists(os.path.join(path, "meta.json")):
            return None
        corpus = CodeCorpus.load(path)
        if corpus.eot_id is None:
            return None
        return cls.from_tokens(corpus.train_tokens, int(corpus.eot_id), int(budget))


@dataclass
class PackedStep:
    """One sampled step: per row (micro-batch of one row), its pieces' lengths."""
    rows: List[List[int]]

    @property
    def useful_tokens(self) -> int:
        return sum(sum(r) for r in self.rows)

    @property
    def square_sums(self) -> List[int]:
        return [sum(n * n for n in r) for r in self.rows]

    @property
    def documents(self) -> List[int]:
        return [len(r) for r in self.rows]


def sample_steps(distribution: LengthDistribution, rows: int, packing: str, steps: int, seed: int = 0,
                 stages: Optional[int] = None, model: Optional[DispatchModel] = None,
                 time_budget_s: float = 0.05, replicas: int = 1) -> List[PackedStep]:
    """Steps drawn as PackedDocuments draws them (pieces at random, taken in arrival order while they
    fit next-fit), packed as `packing` would: arrival order, or the dispatch's greedy (its integer
    program only improves on it, within its time budget); given a DispatchModel, the dispatch
    refined for its simulated step over `replicas` replicas of rows / replicas micro-batches each."""
    rng = random.Random(seed)
    budget = distribution.budget
    out = []
    for _ in range(steps):
        drawn = [rng.choice(distribution.lengths) for _ in range(rows * budget // max(1, min(distribution.lengths)))]
        arrival, taken = next_fit(drawn, rows, budget)
        lengths = drawn[:taken]
        if packing == "balanced" and model is None:
            greedy = D.lpt(lengths, [float(n * n) for n in lengths], D.micro_batch_bins(rows, budget), stages)
            assignment = greedy if greedy is not None else arrival
        elif packing == "balanced":
            assignment = D.dispatch_bins(lengths, model.bins(rows // replicas, budget, replicas), model.linear,
                                         model.quadratic,
                                         time_budget_s, fallback=arrival, stages=stages, ilp_min_gain=0.01,
                                         step_of=model.step_of).assignment
        elif packing == "document":
            assignment = arrival
        else:
            raise ValueError(f"sample_steps packs 'document' or 'balanced', not {packing!r}")
        out.append(PackedStep([[lengths[i] for i in group] for group in assignment]))
    return out


def document_coefficients(meta) -> Tuple[float, float]:
    """(training FLOPs per token, per squared document length) of the whole model, from the planner's
    counts: a block's forward is 2 per matmul weight and 4 * seq * query width per token, x3 with the
    backward. A document of L tokens costs linear * L + quadratic * L**2."""
    q = float(meta.extra.get("query_width", meta.hidden_size))
    attention_per_block = 4.0 * meta.seq_len * q
    linear = sum(f - attention_per_block for f in meta.block_flops_fwd_per_token) + meta.head_flops_fwd_per_token
    return 3.0 * linear, 3.0 * 4.0 * q * meta.n_layer


def stage_flops(meta, spans: Sequence[Tuple[int, int]], budget: int) -> List[Tuple[float, float]]:
    """Per stage, (linear, attention) forward FLOPs of one fixed-length micro-batch row of `budget`
    tokens: the part that does not depend on the documents, and the part that scales with their squares."""
    q = float(meta.extra.get("query_width", meta.hidden_size))
    per_block_attention = 4.0 * meta.seq_len * q
    out = []
    for k, (start, end) in enumerate(spans):
        linear = sum(meta.block_flops_fwd_per_token[i] - per_block_attention for i in range(start, end))
        if k == len(spans) - 1:
            linear += meta.head_flops_fwd_per_token
        out.append((linear * budget, 4.0 * q * (end - start) * budget * budget))
    return out


@dataclass(frozen=True)
class RowShares:
    """One stage's fixed-length micro-batch (one document filling each row), its time split by what
    each part follows: `attention`, the sum of squared document lengths (its share at budget**2);
    `per_document`, the document count (a share per document: attention run document by document pays
    its calls per document -- measured on CPU by bench/mixed_length.py; a variable-length kernel has
    none); `useful`, the real tokens (its share at a full row: work padding skips, as the loss on
    padding); the rest is fixed (the matmuls over every position, padding's too)."""
    attention: float
    per_document: float = 0.0
    useful: float = 0.0


def stage_attention_shares(meta, spans: Sequence[Tuple[int, int]], budget: int) -> List[RowShares]:
    """Per stage, attention's share of a fixed-length micro-batch's work, from the FLOP counts."""
    return [RowShares(attention / (linear + attention)) for linear, attention in stage_flops(meta, spans, budget)]


def simulator_attention_shares(sim, layout) -> List[RowShares]:
    """Per stage, attention's share of a fixed-length micro-batch's compute as the simulator's cost
    model times it (StageCostModel.compute_parts: the blocks, the head, one block's attention core --
    on a GPU with a kernel model, the fused attention's own rate)."""
    meta, last = sim.meta, len(layout.spans) - 1
    tokens = float(layout.microbatch_size * meta.seq_len)
    out = []
    for k, (start, end) in enumerate(layout.spans):
        group = layout.groups[layout.stage_group(k)]
        blocks, head, core = sim.costs.compute_parts(start, end, k == last, group, layout.tp_of(k), tokens)
        total = blocks + head
        out.append(RowShares(min(1.0, (end - start) * meta.block_repeats * core / total) if total > 0 else 0.0))
    return out


def micro_batch_multipliers(meta, spans: Sequence[Tuple[int, int]], budget: int, square_sums: Sequence[float],
                            documents: Optional[Sequence[int]] = None, useful: Optional[Sequence[int]] = None,
                            shares: Optional[Sequence[RowShares]] = None,
                            rows_per_micro_batch: int = 1, attention_unit: Optional[float] = None) -> List[List[float]]:
    """[stage][micro-batch]: its work over that of a fixed-length micro-batch of `budget` tokens a row
    (one document filling each row), the micro-batch the simulator costs. square_sums[j]: micro-batch
    j's attention, by default its sum of squared document lengths; with attention_unit, in any measure
    whose one-document row is attention_unit (a timed kernel's seconds: cost/attention_curve.py);
    documents[j], useful[j]: its document count and real tokens
    (needed where the shares count them); shares: each stage's RowShares (simulator_attention_shares,
    or measured), default the FLOP counts' attention share. Every row pays its fixed work (fixed shapes)."""
    shares = list(shares) if shares is not None else stage_attention_shares(meta, spans, budget)
    if len(shares) != len(spans):
        raise ValueError(f"shares has {len(shares)} stages, the spans {len(spans)}")
    if any(x.per_document for x in shares) and documents is None:
        raise ValueError("a per-document share needs each micro-batch's document count (documents)")
    if any(x.useful for x in shares) and useful is None:
        raise ValueError("a useful-token share needs each micro-batch's real tokens (useful)")
    r = rows_per_micro_batch
    unit = float(attention_unit) if attention_unit is not None else float(budget * budget)
    out = []
    for x in shares:
        fixed = 1.0 - x.attention - x.per_document - x.useful
        out.append([(r * fixed + x.attention * sq / unit
                     + (x.per_document * documents[j] if x.per_document else 0.0)
                     + (x.useful * useful[j] / budget if x.useful else 0.0)) / r
                    for j, sq in enumerate(square_sums)])
    return out


def simulator_step_of(sim, layout) -> Callable[[List[List[float]]], float]:
    """step_of(multipliers) for packed_step_times: the simulator's step of `layout` with its
    [stage][micro-batch] work multipliers (Simulator.evaluate's micro_batch_work)."""
    return lambda work: sim.evaluate(layout, micro_batch_work=work).step_time_s


@dataclass(frozen=True)
class DispatchModel:
    """What the dispatch minimises, in units of a fixed-length micro-batch (one document filling the
    row) averaged over the stages: every bin's base work (`base`: what a row of padding costs), a piece
    of L tokens linear * L + quadratic * L**2 (its real tokens, its attention), and step_of, the
    simulated step of the bins' times in micro-batch order -- dispatch_bins(lengths, bins(m, budget),
    linear, quadratic, step_of=step_of) with fixed_shapes False (the base is in the bins)."""
    base: float
    linear: float
    quadratic: float
    step_of: D.StepOf

    def bins(self, micro_batches: int, capacity: int, replicas: int = 1) -> List[D.Bin]:
        """micro_batches bins for each of `replicas` replicas, replica-major (as the engines slice rows)."""
        return [D.Bin(capacity, 1.0, r, self.base) for r in range(replicas) for _ in range(micro_batches)]


def dispatch_model(step_of_work: Callable[[List[List[float]]], float], meta, spans: Sequence[Tuple[int, int]],
                   budget: int, shares: Optional[Sequence[RowShares]] = None) -> DispatchModel:
    """The dispatch's costs and step_of from the stages' RowShares (default the FLOP counts'): a bin's
    time above the base, over a full row's, is its share of the variable work, and stage k's
    multiplier is fixed_k + (1 - fixed_k) x that share -- exact where attention alone varies (the
    stages' shares then differ only by a factor), the stages' mean split of attention against real
    tokens otherwise. Per-document costs are left to the prediction (a few thousandths a document)."""
    shares = list(shares) if shares is not None else stage_attention_shares(meta, spans, budget)
    fixed = [1.0 - x.attention - x.useful - x.per_document for x in shares]
    attention = statistics.fmean(x.attention for x in shares)
    useful = statistics.fmean(x.useful for x in shares)
    base = 1.0 - attention - useful
    variable_full = max(attention + useful, 1e-12)

    def step_of(times: Sequence[float], bins: Sequence[D.Bin]) -> float:
        """The slowest replica's simulated step (data-parallel replicas run their pipelines side by side)."""
        shares_of: Dict[int, List[float]] = {}
        for t, b in zip(times, bins):
            shares_of.setdefault(b.replica, []).append(max(t * b.speed - b.base_work, 0.0) / variable_full)
        return max(step_of_work([[f + (1.0 - f) * x for x in share] for f in fixed]) for share in shares_of.values())

    return DispatchModel(base, useful / budget, attention / (budget * budget), step_of)


def pipeline_step(schedule: str, pp: int, fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]],
                  send: Sequence[float] = (), stages_per_rank: int = 1) -> float:
    """The step's makespan when micro-batch j of stage k takes fwd[k][j] forward and bwd[k][j] backward
    (send[k]: stage k's hop to k + 1, each way)."""
    m = len(fwd[0])
    st = structure(schedule, pp, stages_per_rank, m)
    n = pp * stages_per_rank
    send = list(send) or [0.0] * n
    f_end = [[0.0] * m for _ in range(n)]
    b_end = [[0.0] * m for _ in range(n)]
    free = [0.0] * pp
    for pos, kind, k, j in st.order:
        if kind == F:
            ready, dur = (f_end[k - 1][j] + send[k - 1] if k > 0 else 0.0), fwd[k][j]
        elif kind in (B, BW):
            ready, dur = (b_end[k + 1][j] + send[k] if k < n - 1 else f_end[k][j]), bwd[k][j]
        else:   # a split weight gradient: its share is in bwd already
            ready, dur = b_end[k][j], 0.0
        start = max(free[pos], ready)
        free[pos] = start + dur
        (f_end if kind == F else b_end)[k][j] = start + dur
    return max(free)


@dataclass(frozen=True)
class RowSpread:
    """How rows timed once stray from their predicted times: per kind ("F", "B") and stage, the
    (predicted seconds, timed / predicted - 1) pairs of measured rows, sorted by predicted seconds. A
    row's pool is the deviations of the `neighbours` rows nearest it in predicted seconds, centred on
    their mean: small rows stray more, relatively, than large ones (timer and call overheads against
    the work; the bench's calibration rows and its steps' rows alike: rms 5-11% in the smallest
    quarter, 2-5% in the largest), while where a neighbourhood's mean lies is the calibrated line's
    lack of fit at those rows, which does not carry over to other rows (the steps' smallest rows sat
    1-4% below the line where the calibration's sat 0-2.5% above)."""
    pairs: Dict[str, List[List[Tuple[float, float]]]]
    neighbours: int

    @classmethod
    def from_timings(cls, timed: Dict[str, Sequence[Sequence[float]]], predicted: Dict[str, Sequence[Sequence[float]]],
                     neighbours: Optional[int] = None) -> "RowSpread":
        """timed[kind][stage], predicted[kind][stage]: rows timed once and their predicted seconds (rows
        predicted at no time left out). neighbours: default a sixth of a stage's rows, at least 12."""
        pairs = {kind: [sorted((p, t / p - 1.0) for t, p in zip(times, preds) if p > 0)
                        for times, preds in zip(timed[kind], predicted[kind])] for kind in ("F", "B")}
        if any(not stage for kind in pairs.values() for stage in kind):
            raise ValueError("RowSpread needs at least one timed row predicted above zero for every kind and stage")
        fewest = min(len(stage) for kind in pairs.values() for stage in kind)
        return cls(pairs, min(fewest, neighbours if neighbours is not None else max(12, fewest // 6)))

    def pool(self, kind: str, stage: int, seconds: float) -> List[float]:
        """The deviations of the `neighbours` rows of (kind, stage) nearest `seconds` in predicted time,
        less their mean."""
        pairs = self.pairs[kind][stage]
        lo = hi = bisect.bisect_left(pairs, (seconds, float("-inf")))
        while hi - lo < self.neighbours:   # widen towards the nearer side
            if lo > 0 and (hi == len(pairs) or seconds - pairs[lo - 1][0] <= pairs[hi][0] - seconds):
                lo -= 1
            else:
                hi += 1
        near = [d for _, d in pairs[lo:hi]]
        mean = statistics.fmean(near)
        return [d - mean for d in near]


def expected_step(step_of_work: Callable[[List[List[float]], List[List[float]]], float],
                  forward_work: Sequence[Sequence[float]], backward_work: Sequence[Sequence[float]],
                  spread: Optional[RowSpread], unit: Dict[str, Sequence[float]], draws: int = 200,
                  seed: int = 0) -> float:
    """The mean of step_of_work(forward, backward) over `draws` steps whose [stage][micro-batch] work
    is the predicted work times 1 + a deviation drawn (with replacement) from the pool of measured
    rows of like size (spread.pool at unit[kind][stage] x work: the row's predicted seconds). A step
    is the longest path through the schedule, a maximum of sums, convex in the durations: rows that
    stray either way lengthen it on average -- more the more paths are near-critical (a balanced
    packing's; the slowest of several replicas) -- so the deterministic timeline of the predicted
    rows falls short of the mean step. spread None: that deterministic step."""
    if spread is None:
        return step_of_work([list(r) for r in forward_work], [list(r) for r in backward_work])
    works = {"F": forward_work, "B": backward_work}
    for kind, work in works.items():
        if len(spread.pairs[kind]) != len(work) or len(unit[kind]) != len(work):
            raise ValueError(f"the spread and unit of {kind!r} need one entry for each of the {len(work)} stages")
    pools = {kind: [[spread.pool(kind, k, unit[kind][k] * w) for w in row] for k, row in enumerate(work)]
             for kind, work in works.items()}
    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        strayed = {kind: [[w * (1.0 + rng.choice(pool)) for w, pool in zip(row, row_pools)]
                          for row, row_pools in zip(work, pools[kind])] for kind, work in works.items()}
        total += step_of_work(strayed["F"], strayed["B"])
    return total / draws


def scaled(per_stage: Sequence[float], multipliers: Sequence[Sequence[float]]) -> List[List[float]]:
    """Per-(stage, micro-batch) durations: a fixed-length micro-batch's per stage, times its multiplier."""
    return [[t * x for x in row] for t, row in zip(per_stage, multipliers)]


def packed_step_times(step_of: Callable[[List[List[float]]], float], meta, spans: Sequence[Tuple[int, int]],
                      distribution: LengthDistribution, micro_batches: int, packing: str, steps: int = 20,
                      seed: int = 0, order_aware: bool = True,
                      shares: Optional[Sequence[RowShares]] = None, replicas: int = 1) -> List[float]:
    """The predicted step of `steps` steps sampled from the distribution and packed as `packing`
    (micro-batches of one row, `micro_batches` per replica): step_of(multipliers) costs one replica's
    step given its [stage][micro-batch] work multipliers -- simulator_step_of(sim, layout), or a
    timeline over fixed-length stage times (bench/mixed_length.py); a step is its slowest replica's.
    `balanced` is dispatched for that same step (order_aware; else min-max). shares: as
    micro_batch_multipliers."""
    budget = distribution.budget
    model = (dispatch_model(step_of, meta, spans, budget, shares=shares)
             if order_aware and packing == "balanced" else None)
    out = []
    for step in sample_steps(distribution, micro_batches * replicas, packing, steps, seed, stages=len(spans),
                             model=model, replicas=replicas):
        per_replica = []
        for r in range(replicas):
            rows = step.rows[r * micro_batches:(r + 1) * micro_batches]
            part = PackedStep(rows)
            per_replica.append(step_of(micro_batch_multipliers(meta, spans, budget, part.square_sums, part.documents,
                                                               [sum(x) for x in rows], shares)))
        out.append(max(per_replica))
    return out


def rank_by_packed_step(sim, layouts: Sequence, distribution: LengthDistribution, packing: str,
                        steps: int = 12, seed: int = 0) -> List[Tuple[float, int]]:
    """(mean predicted step over `steps` steps sampled from the corpus and packed as `packing`, index)
    per layout, fastest first: the search's candidates ranked by the packed step a data.packing run
    trains rather than by the fixed-length micro-batch (each layout's attention shares from the
    simulator's own cost model; each replica its own micro-batches). Layouts whose micro-batches hold
    more than one row, or are not costed at `distribution.budget` tokens, are refused."""
    ranked = []
    for i, layout in enumerate(layouts):
        if layout.microbatch_size != 1 or sim.meta.seq_len != distribution.budget:
            raise ValueError(f"layout {i}: packed steps are costed for one-row micro-batches of the corpus's "
                             f"{distribution.budget}-token budget (microbatch_size {layout.microbatch_size}, "
                             f"seq_len {sim.meta.seq_len})")
        times = packed_step_times(simulator_step_of(sim, layout), sim.meta, layout.spans, distribution,
                                  layout.num_microbatches, packing, steps, seed=seed,
                                  shares=simulator_attention_shares(sim, layout), replicas=layout.dp)
        ranked.append((statistics.fmean(times), i))
    return sorted(ranked)
