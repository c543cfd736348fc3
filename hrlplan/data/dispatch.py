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
its time is its work / speed. The dispatch minimises step_time: the slowest bin's time, or, given
the pipeline's depth p (`stages`), the slowest replica's pipeline step, (sum + (p - 1) * slowest) / p
of its bins' times. With one replica the sum is fixed and both objectives agree; across data-parallel
replicas the sums differ, and only the pipeline objective balances them. It is computed by:

- an integer program (HiGHS, through highspy) when pieces x bins <= max_ilp_variables, warm-started
  from the greedy, stopped at the step's time budget (its best solution so far is kept);
- otherwise, or with no time left, LPT (longest processing time first: each piece, largest first, to
  the bin where it finishes earliest). With identical bins and capacities that do not bind, LPT is
  within 4/3 - 1/(3m) of the optimum for m bins (Graham 1969); with speeds, within 2m/(m+1)
  (Gonzalez, Ibarra and Sahni 1977). For the pipeline objective the greedy (each piece where the
  step grows least) is a heuristic with no stated bound; the lower bound is reported beside it. If capacities make the greedy fail, the caller's feasible
  `fallback` (arrival order) is kept.

Whatever runs, the result holds each piece exactly once (checked before it is returned).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
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
    lower_bound: float            # no assignment's step_time can be smaller
    seconds: float                # wall time the dispatch took
    step_time: float              # what was minimised (see step_time)

    @property
    def slowest(self) -> float:
        return max(self.times, default=0.0)


def lower_bound(works: Sequence[float], bins: Sequence[Bin], stages: Optional[int] = None) -> float:
    """No assignment's step_time is below this (capacities ignored). Slowest micro-batch: the largest
    piece on the fastest bin, or the total work over the total speed. Pipeline step: a replica's time
    is at least its work W_r (1 + (p - 1) / m_r) / (p s_r) with m_r micro-batches, so the slowest is at
    least the total over the sum of p s_r / (1 + (p - 1) / m_r); and the replica with the largest piece
    w takes at least w / s."""
    if not works:
        return 0.0
    largest = max(works) / max(b.speed for b in bins)
    if stages is None:
        return max(largest, sum(works) / sum(b.speed for b in bins))
    per_replica: Dict[int, List[Bin]] = {}
    for b in bins:
        per_replica.setdefault(b.replica, []).append(b)
    rate = sum(stages * min(b.speed for b in members) / (1 + (stages - 1) / len(members))
               for members in per_replica.values())
    return max(largest, sum(works) / rate)


def bin_times(assignment: Sequence[Sequence[int]], works: Sequence[float], bins: Sequence[Bin]) -> List[float]:
    return [sum(works[i] for i in group) / b.speed for group, b in zip(assignment, bins)]


def replica_times(times: Sequence[float], bins: Sequence[Bin], stages: int) -> Dict[int, float]:
    """A replica's pipeline step of `stages` stages, each doing 1/stages of every micro-batch: a
    proportionate flow shop, (sum + (stages - 1) * slowest) / stages (1F1B's steady state and fill)."""
    sums: Dict[int, float] = {}
    slowest: Dict[int, float] = {}
    for t, b in zip(times, bins):
        sums[b.replica] = sums.get(b.replica, 0.0) + t
        slowest[b.replica] = max(slowest.get(b.replica, 0.0), t)
    return {r: (sums[r] + (stages - 1) * slowest[r]) / stages for r in sums}


def step_time(assignment: Sequence[Sequence[int]], works: Sequence[float], bins: Sequence[Bin],
              stages: Optional[int] = None) -> float:
    """What the dispatch minimises: the slowest micro-batch (stages None), or the slowest replica's
    pipeline step (stages = the pipeline's depth)."""
    times = bin_times(assignment, works, bins)
    if stages is None:
        return max(times, default=0.0)
    return max(replica_times(times, bins, stages).values(), default=0.0)


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


def lpt(lengths: Sequence[int], works: Sequence[float], bins: Sequence[Bin],
        stages: Optional[int] = None) -> Optional[List[List[int]]]:
    """Largest work first, each to the bin with room that leaves the smallest step_time, then the one
    where it finishes earliest, then the lower bin (with stages None: classic LPT). None when some
    piece fits nowhere."""
    assignment: List[List[int]] = [[] for _ in bins]
    load = [0.0] * len(bins)   # time, work / speed
    room = [b.capacity for b in bins]
    replicas = sorted({b.replica for b in bins})
    sums = {r: 0.0 for r in replicas}
    slowest = {r: 0.0 for r in replicas}
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        best, best_key = -1, None
        for b, spec in enumerate(bins):
            if room[b] < lengths[i]:
                continue
            finish = load[b] + works[i] / spec.speed
            if stages is None:
                key = (finish, b)
            else:
                r = spec.replica
                mine = (sums[r] + works[i] / spec.speed + (stages - 1) * max(slowest[r], finish)) / stages
                others = max(((sums[o] + (stages - 1) * slowest[o]) / stages for o in replicas if o != r), default=0.0)
                key = (max(mine, others), finish, b)
            if best_key is None or key < best_key:
                best, best_key = b, key
        if best < 0:
            return None
        spec = bins[best]
        assignment[best].append(i)
        load[best] += works[i] / spec.speed
        room[best] -= lengths[i]
        sums[spec.replica] += works[i] / spec.speed
        slowest[spec.replica] = max(slowest[spec.replica], load[best])
    return assignment


def _symmetry_groups(bins: Sequence[Bin], stages: Optional[int]) -> List[Tuple]:
    """Bins that can swap contents without changing the objective: same capacity and speed, and with a
    pipeline objective, the same replica."""
    return [(b.capacity, b.speed) + ((b.replica,) if stages is not None else ()) for b in bins]


def ilp(lengths: Sequence[int], works: Sequence[float], bins: Sequence[Bin], time_limit_s: float,
        start: Optional[Sequence[Sequence[int]]] = None,
        stages: Optional[int] = None) -> Tuple[Optional[List[List[int]]], bool]:
    """min T  s.t.  each piece in one bin; a bin's tokens <= its capacity; and
    stages None: every bin's work / speed <= T;
    stages p:    every bin's work / speed <= z_r of its replica r, (sum of r's bins + (p - 1) z_r) / p <= T.
    Pieces are ordered by work, largest first, and piece k may use only the first k + 1 bins of a group
    of interchangeable bins (any solution relabels into that form), which removes their symmetry.
    Returns (assignment or None, proven optimal)."""
    import highspy   # why: only a step small enough for the integer program needs the solver

    begin = time.perf_counter()
    n, m = len(works), len(bins)
    order = sorted(range(n), key=lambda i: (-works[i], i))
    scale = max(max(works), 1e-300)   # works near 1: HiGHS's tolerances are absolute
    w = [works[i] / scale for i in order]
    groups = _symmetry_groups(bins, stages)
    rank, seen = [], {}
    for key in groups:
        rank.append(seen.get(key, 0))
        seen[key] = rank[-1] + 1
    replicas = sorted({b.replica for b in bins}) if stages is not None else []
    z_col = {r: n * m + j for j, r in enumerate(replicas)}   # x[k, b] at column k * m + b; z_r; T last
    num_cols = n * m + len(replicas) + 1
    t_col = num_cols - 1
    inf = highspy.kHighsInf
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    upper = np.array([0.0 if rank[b] > k else 1.0 for k in range(n) for b in range(m)] + [inf] * (num_cols - n * m))
    costs = np.zeros(num_cols)
    costs[t_col] = 1.0
    h.addVars(num_cols, np.zeros(num_cols), upper)
    h.changeColsCost(num_cols, np.arange(num_cols, dtype=np.int32), costs)
    h.changeColsIntegrality(n * m, np.arange(n * m, dtype=np.int32), np.full(n * m, highspy.HighsVarType.kInteger))
    rows: List[Tuple[float, float, List[int], List[float]]] = []
    for k in range(n):
        rows.append((1.0, 1.0, [k * m + b for b in range(m)], [1.0] * m))
    for b, spec in enumerate(bins):
        cols = [k * m + b for k in range(n)]
        rows.append((-inf, float(spec.capacity), cols, [float(lengths[order[k]]) for k in range(n)]))
        bound_col = t_col if stages is None else z_col[spec.replica]
        rows.append((-inf, 0.0, cols + [bound_col], [w[k] / spec.speed for k in range(n)] + [-1.0]))
    for r in replicas:
        cols, vals = [], []
        for b, spec in enumerate(bins):
            if spec.replica == r:
                cols += [k * m + b for k in range(n)]
                vals += [w[k] / (spec.speed * stages) for k in range(n)]
        rows.append((-inf, 0.0, cols + [z_col[r], t_col], vals + [(stages - 1) / stages, -1.0]))
    starts, indices, values = [], [], []
    for _, _, cols, vals in rows:
        starts.append(len(indices))
        indices += cols
        values += vals
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), len(indices),
              np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32), np.array(values))
    if start is not None:
        _warm_start(h, start, order, w, bins, groups, z_col, stages)
    # HiGHS checks its own time_limit only now and then; its interrupt callbacks come at every node
    # and simplex iteration, so the deadline holds more tightly, and a tenth of the budget is kept
    # for what runs between checks (measured up to ~65 ms late on 2 busy cores without it).
    deadline = begin + 0.9 * time_limit_s

    def stop_at_deadline(event) -> None:
        if time.perf_counter() >= deadline:
            event.interrupt()

    h.cbMipInterrupt += stop_at_deadline
    h.cbSimplexInterrupt += stop_at_deadline
    h.setOptionValue("time_limit", max(deadline - time.perf_counter(), 1e-3))
    h.run()
    if h.getInfo().primal_solution_status != 2:   # kSolutionStatusFeasible: no solution within the time
        return None, False
    x = h.getSolution().col_value
    assignment: List[List[int]] = [[] for _ in range(m)]
    for k in range(n):
        assignment[max(range(m), key=lambda b: x[k * m + b])].append(order[k])
    for group in assignment:
        group.sort()
    return assignment, h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def _warm_start(h, start, order, w, bins, groups, z_col, stages) -> None:
    """Hand HiGHS a feasible solution, relabelled into the symmetry-broken form."""
    import highspy

    position = {piece: k for k, piece in enumerate(order)}
    members: Dict[Tuple, List[int]] = {}
    for b, key in enumerate(groups):
        members.setdefault(key, []).append(b)
    relabel = {}
    for group in members.values():   # within a group, bins by their largest piece's rank
        by_first = sorted(group, key=lambda b: min((position[i] for i in start[b]), default=len(order) + b))
        relabel.update(zip(by_first, group))
    m = len(bins)
    placed: List[List[int]] = [[] for _ in range(m)]
    for b, group in enumerate(start):
        placed[relabel[b]] = list(group)
    values = np.zeros(len(order) * m + len(z_col) + 1)
    for b, group in enumerate(placed):
        for i in group:
            values[position[i] * m + b] = 1.0
    scaled = dict(zip(order, w))
    times = bin_times(placed, scaled, bins)
    if stages is None:
        values[-1] = max(times)
    else:
        for r, t in replica_times(times, bins, stages).items():
            values[z_col[r]] = max(t_b for t_b, b in zip(times, bins) if b.replica == r)
        values[-1] = max(replica_times(times, bins, stages).values())
    solution = highspy.HighsSolution()
    solution.col_value = values.tolist()
    solution.value_valid = True
    h.setSolution(solution)


def dispatch_bins(lengths: Sequence[int], bins: Sequence[Bin], linear: float, quadratic: float,
                  time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_ilp_variables: int = DEFAULT_MAX_ILP_VARIABLES,
                  fallback: Optional[Sequence[Sequence[int]]] = None, stages: Optional[int] = None) -> Dispatch:
    """Assign pieces of `lengths` tokens to `bins`, minimising step_time: the slowest bin's work / speed
    (stages None) or the slowest replica's pipeline step of `stages` stages."""
    begin = time.perf_counter()
    if not bins:
        raise ValueError("a dispatch needs at least one micro-batch")
    if stages is not None and stages < 1:
        raise ValueError(f"stages must be at least 1 (the pipeline's depth), got {stages}")
    works = [document_cost(n, linear, quadratic) for n in lengths]
    bound = lower_bound(works, bins, stages)
    if not lengths:
        return Dispatch([[] for _ in bins], [0.0] * len(bins), "empty", 0.0, time.perf_counter() - begin, 0.0)
    best, method = lpt(lengths, works, bins, stages), "greedy"
    if best is None:
        if fallback is None:
            raise ValueError(f"{len(lengths)} pieces ({sum(lengths)} tokens) do not fit the step's "
                             f"{len(bins)} micro-batches by the greedy, and no fallback assignment was given")
        best, method = [list(g) for g in fallback], "fallback"
    elif fallback is not None and step_time(fallback, works, bins, stages) < step_time(best, works, bins, stages):
        best, method = [list(g) for g in fallback], "fallback"
    left = time_budget_s - (time.perf_counter() - begin)
    value = step_time(best, works, bins, stages)
    if len(lengths) * len(bins) <= max_ilp_variables and left > 0 and value > bound * (1 + 1e-9):
        solved, optimal = ilp(lengths, works, bins, left, start=best, stages=stages)
        if solved is not None and step_time(solved, works, bins, stages) <= value:
            best, method = solved, "ilp-optimal" if optimal else "ilp-time-limit"
    check_assignment(best, lengths, bins)
    return Dispatch(best, bin_times(best, works, bins), method, bound, time.perf_counter() - begin,
                    step_time(best, works, bins, stages))


def dispatch(lengths: Sequence[int], micro_batches: int, capacity: int, linear: float = 1.0, quadratic: float = 0.0,
             time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_ilp_variables: int = DEFAULT_MAX_ILP_VARIABLES,
             fallback: Optional[Sequence[Sequence[int]]] = None, stages: Optional[int] = None) -> List[List[int]]:
    """One replica's micro-batches, all of `capacity` tokens: the assignment only (PackedDocuments'
    dispatcher: functools.partial(dispatch, linear=..., quadratic=...)). For one replica the pipeline
    objective (stages) and the slowest micro-batch have the same optimum: the sum is fixed."""
    return dispatch_bins(lengths, micro_batch_bins(micro_batches, capacity), linear, quadratic, time_budget_s,
                         max_ilp_variables, fallback, stages).assignment

