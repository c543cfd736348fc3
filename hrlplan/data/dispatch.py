"""Cost-aware dispatch: a step's documents assigned to micro-batches (and replicas) so the slowest is small.

A pipeline waits on its slowest micro-batch. A document of L tokens costs

    linear * L + quadratic * L**2

(the blocks' matmuls, then attention's query-key pairs; plain numbers the caller takes from the
planner's cost model -- data/ is below cost/ and never imports it). A micro-batch costs the sum of its
documents. That holds for an attention kernel that skips the masked blocks of the block-diagonal mask
(FlexAttention's block mask, flash-attention's varlen); a dense masked kernel does the whole
budget x budget square whatever the documents, and balancing then buys nothing.

Every bin (one micro-batch of one replica) has a token capacity (that replica's sequence length)
and a speed (1.0 for a homogeneous plan; a replica's relative throughput for a heterogeneous one);
its time is its work / speed. The dispatch minimises the largest time:

- an integer program (HiGHS, through highspy) when pieces x bins <= max_ilp_variables, warm-started
  from the greedy, stopped at the step's time budget (its best solution so far is kept);
- otherwise, or with no time left, LPT (longest processing time first: each piece, largest first, to
  the bin where it finishes earliest). With identical bins and capacities that do not bind, LPT is
  within 4/3 - 1/(3m) of the optimum for m bins (Graham 1969); with speeds, within 2m/(m+1)
  (Gonzalez, Ibarra and Sahni 1977). If capacities make the greedy fail, the caller's feasible
  `fallback` (arrival order) is kept.

Whatever runs, the result holds each piece exactly once (checked before it is returned).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

DEFAULT_TIME_BUDGET_S = 0.5
DEFAULT_MAX_ILP_VARIABLES = 4000


def document_cost(length: int, linear: float, quadratic: float) -> float:
    """The work of one document (or piece) of `length` tokens."""
    return linear * length + quadratic * length * length


def micro_batch_cost(lengths: Sequence[int], linear: float, quadratic: float) -> float:
    return sum(document_cost(n, linear, quadratic) for n in lengths)


@dataclass(frozen=True)
class Bin:
    """One micro-batch slot: `capacity` tokens, run at `speed` (work per second, relative)."""
    capacity: int
    speed: float = 1.0
    replica: int = 0


def micro_batch_bins(micro_batches: int, capacity: int) -> List[Bin]:
    return [Bin(capacity) for _ in range(micro_batches)]


def replica_bins(micro_batches: int, capacities: Sequence[int], speeds: Sequence[float]) -> List[Bin]:
    """micro_batches bins for each replica, with its own sequence length and relative speed."""
    if len(capacities) != len(speeds):
        raise ValueError(f"one capacity per replica and one speed per replica: got {len(capacities)} and {len(speeds)}")
    if any(s <= 0 for s in speeds):
        raise ValueError(f"replica speeds must be positive, got {list(speeds)}")
    return [Bin(int(c), float(s), r) for r, (c, s) in enumerate(zip(capacities, speeds)) for _ in range(micro_batches)]


@dataclass
class Dispatch:
    assignment: List[List[int]]   # per bin, the piece indices it holds (in the caller's order)
    times: List[float]            # per bin, work / speed
    method: str                   # "ilp-optimal", "ilp-time-limit", "greedy", "fallback", "empty"
    lower_bound: float            # no assignment's slowest bin can be faster
    seconds: float                # wall time the dispatch took
    notes: Dict[str, float] = field(default_factory=dict)

    @property
    def slowest(self) -> float:
        return max(self.times, default=0.0)


def lower_bound(works: Sequence[float], bins: Sequence[Bin]) -> float:
    """Max of: the largest piece on the fastest bin that can hold it, and the total work spread over
    the total speed. (Ignores capacities otherwise.)"""
    if not works:
        return 0.0
    total_speed = sum(b.speed for b in bins)
    return max(max(works) / max(b.speed for b in bins), sum(works) / total_speed)


def bin_times(assignment: Sequence[Sequence[int]], works: Sequence[float], bins: Sequence[Bin]) -> List[float]:
    return [sum(works[i] for i in group) / b.speed for group, b in zip(assignment, bins)]


def check_assignment(assignment: Sequence[Sequence[int]], lengths: Sequence[int], bins: Sequence[Bin]) -> None:
    """Each piece exactly once, every bin within its capacity; raises otherwise."""
    if len(assignment) != len(bins):
        raise ValueError(f"the assignment has {len(assignment)} bins, the step {len(bins)}")
    held = sorted(i for group in assignment for i in group)
    if held != list(range(len(lengths))):
        missing = sorted(set(range(len(lengths))) - set(held))
        raise ValueError(f"a dispatch must hold each of {len(lengths)} pieces exactly once: "
                         f"missing {missing}, held {len(held)}")
    for b, (group, spec) in enumerate(zip(assignment, bins)):
        used = sum(lengths[i] for i in group)
        if used > spec.capacity:
            raise ValueError(f"bin {b} holds {used} tokens, over its capacity {spec.capacity}")


def lpt(lengths: Sequence[int], works: Sequence[float], bins: Sequence[Bin]) -> Optional[List[List[int]]]:
    """Largest work first, each to the bin where it would finish earliest among those with room
    (ties: the lower bin). None when some piece fits nowhere."""
    assignment: List[List[int]] = [[] for _ in bins]
    load = [0.0] * len(bins)
    room = [b.capacity for b in bins]
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        best, best_time = -1, float("inf")
        for b, spec in enumerate(bins):
            if room[b] >= lengths[i]:
                finish = (load[b] + works[i]) / spec.speed
                if finish < best_time:
                    best, best_time = b, finish
        if best < 0:
            return None
        assignment[best].append(i)
        load[best] += works[i]
        room[best] -= lengths[i]
    return assignment


def _symmetry_cut(bins: Sequence[Bin]) -> List[int]:
    """For each bin, its rank among the bins identical to it (same capacity and speed)."""
    seen: Dict[Tuple[int, float], int] = {}
    rank = []
    for b in bins:
        key = (b.capacity, b.speed)
        rank.append(seen.get(key, 0))
        seen[key] = rank[-1] + 1
    return rank


def ilp(lengths: Sequence[int], works: Sequence[float], bins: Sequence[Bin], time_limit_s: float,
        start: Optional[Sequence[Sequence[int]]] = None) -> Tuple[Optional[List[List[int]]], bool]:
    """min z  s.t.  each piece in one bin; a bin's tokens <= its capacity; a bin's work / speed <= z.
    Pieces are ordered by work, largest first, and piece k may use only the first k + 1 of a group of
    identical bins (any solution relabels into that form), which removes the bins' symmetry.
    Returns (assignment or None, proven optimal)."""
    import highspy   # why: only a step small enough for the integer program needs the solver

    n, m = len(works), len(bins)
    order = sorted(range(n), key=lambda i: (-works[i], i))
    scale = max(max(works), 1e-300)   # works near 1: HiGHS's tolerances are absolute
    w = [works[i] / scale for i in order]
    rank = _symmetry_cut(bins)
    inf = highspy.kHighsInf
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("time_limit", max(time_limit_s, 1e-3))
    num_x = n * m   # x[k, b] at column k * m + b; z last
    upper = np.array([0.0 if rank[b] > k else 1.0 for k in range(n) for b in range(m)] + [inf])
    costs = np.zeros(num_x + 1)
    costs[-1] = 1.0
    h.addVars(num_x + 1, np.zeros(num_x + 1), upper)
    h.changeColsCost(num_x + 1, np.arange(num_x + 1, dtype=np.int32), costs)
    h.changeColsIntegrality(num_x, np.arange(num_x, dtype=np.int32),
                            np.full(num_x, highspy.HighsVarType.kInteger))
    rows: List[Tuple[float, float, List[int], List[float]]] = []
    for k in range(n):
        rows.append((1.0, 1.0, [k * m + b for b in range(m)], [1.0] * m))
    for b, spec in enumerate(bins):
        cols = [k * m + b for k in range(n)]
        rows.append((-inf, float(spec.capacity), cols, [float(lengths[order[k]]) for k in range(n)]))
        rows.append((-inf, 0.0, cols + [num_x], [w[k] / spec.speed for k in range(n)] + [-1.0]))
    starts, indices, values = [], [], []
    for _, _, cols, vals in rows:
        starts.append(len(indices))
        indices += cols
        values += vals
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), len(indices),
              np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32), np.array(values))
    if start is not None:
        _warm_start(h, start, order, w, bins, m)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if info.primal_solution_status != 2:   # kSolutionStatusFeasible
        return None, False
    x = h.getSolution().col_value
    assignment: List[List[int]] = [[] for _ in range(m)]
    for k in range(n):
        b = max(range(m), key=lambda b: x[k * m + b])
        assignment[b].append(order[k])
    for group in assignment:
        group.sort()
    return assignment, status == highspy.HighsModelStatus.kOptimal


def _warm_start(h, start, order, w, bins, m) -> None:
    """Hand HiGHS a feasible solution, relabelled into the symmetry-broken form."""
    import highspy

    position = {piece: k for k, piece in enumerate(order)}
    groups = {}
    for b, spec in enumerate(bins):
        groups.setdefault((spec.capacity, spec.speed), []).append(b)
    relabel = {}
    for members in groups.values():   # within a group, bins by their largest piece's rank
        by_first = sorted(members, key=lambda b: min((position[i] for i in start[b]), default=len(order) + b))
        relabel.update(zip(by_first, members))
    values = np.zeros(len(order) * m + 1)
    loads = [0.0] * m
    for b, group in enumerate(start):
        for i in group:
            values[position[i] * m + relabel[b]] = 1.0
            loads[relabel[b]] += w[position[i]] / bins[relabel[b]].speed
    values[-1] = max(loads)
    solution = highspy.HighsSolution()
    solution.col_value = values.tolist()
    solution.value_valid = True
    h.setSolution(solution)


def dispatch_bins(lengths: Sequence[int], bins: Sequence[Bin], linear: float, quadratic: float,
                  time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_ilp_variables: int = DEFAULT_MAX_ILP_VARIABLES,
                  fallback: Optional[Sequence[Sequence[int]]] = None) -> Dispatch:
    """Assign pieces of `lengths` tokens to `bins`, minimising the slowest bin's work / speed."""
    begin = time.perf_counter()
    if not bins:
        raise ValueError("a dispatch needs at least one micro-batch")
    works = [document_cost(n, linear, quadratic) for n in lengths]
    bound = lower_bound(works, bins)
    if not lengths:
        return Dispatch([[] for _ in bins], [0.0] * len(bins), "empty", 0.0, time.perf_counter() - begin)
    best, method = lpt(lengths, works, bins), "greedy"
    if best is None:
        if fallback is None:
            raise ValueError(f"{len(lengths)} pieces ({sum(lengths)} tokens) do not fit the step's "
                             f"{len(bins)} micro-batches by the greedy, and no fallback assignment was given")
        best, method = [list(g) for g in fallback], "fallback"
    if fallback is not None and method == "greedy":
        fallback_times, greedy_times = bin_times(fallback, works, bins), bin_times(best, works, bins)
        if max(fallback_times) < max(greedy_times):
            best, method = [list(g) for g in fallback], "fallback"
    left = time_budget_s - (time.perf_counter() - begin)
    if len(lengths) * len(bins) <= max_ilp_variables and left > 0 and max(bin_times(best, works, bins)) > bound:
        solved, optimal = ilp(lengths, works, bins, left, start=best)
        if solved is not None and max(bin_times(solved, works, bins)) <= max(bin_times(best, works, bins)):
            best, method = solved, "ilp-optimal" if optimal else "ilp-time-limit"
    check_assignment(best, lengths, bins)
    return Dispatch(best, bin_times(best, works, bins), method, bound, time.perf_counter() - begin)


def dispatch(lengths: Sequence[int], micro_batches: int, capacity: int, linear: float = 1.0, quadratic: float = 0.0,
             time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_ilp_variables: int = DEFAULT_MAX_ILP_VARIABLES,
             fallback: Optional[Sequence[Sequence[int]]] = None) -> List[List[int]]:
    """One replica's micro-batches, all of `capacity` tokens: the assignment only (PackedDocuments'
    dispatcher: functools.partial(dispatch, linear=..., quadratic=...))."""
    return dispatch_bins(lengths, micro_batch_bins(micro_batches, capacity), linear, quadratic, time_budget_s,
                         max_ilp_variables, fallback).assignment

