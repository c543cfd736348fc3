"""Cost-aware dispatch: a step's documents assigned to micro-batches (and replicas) so the slowest is small.

A pipeline waits on its slowest micro-batch. A document of L tokens costs

    linear * L + quadratic * L**2

(the blocks' matmuls, then attention's query-key pairs; plain numbers the caller takes from the
planner's cost model -- data/ is below cost/ and never imports it). A micro-batch costs the sum of its
documents. That holds for an attention kernel that skips the masked blocks of the block-diagonal mask
(FlexAttention's block mask, flash-attention's varlen); a dense masked kernel does the whole
budget x budget square whatever the documents, and balancing then buys nothing. With fixed shapes
(torch pipelining) a micro-batch also computes its padding's linear work: `fixed_shapes=True` gives
every micro-batch its whole budget's linear work, and the documents only their attention.

Every bin (one micro-batch of one replica) has a token capacity (that replica's sequence length)
and a speed (1.0 for a homogeneous plan; a replica's relative throughput for a heterogeneous one);
its time is its work / speed. The dispatch minimises step_time: the slowest bin's time, or, given
the pipeline's depth p (`stages`), the slowest replica's pipeline step, (sum + (p - 1) * slowest) / p
of its bins' times. With one replica the sum is fixed and both objectives agree; across data-parallel
replicas the sums differ, and only the pipeline objective balances them. It is computed by:

- LPT first (longest processing time first: each piece, largest first, to the bin where it finishes
  earliest). With identical bins and capacities that do not bind, LPT is within 4/3 - 1/(3m) of the
  optimum for m bins (Graham 1969); with speeds, within 2m/(m+1) (Gonzalez, Ibarra and Sahni 1977).
  For the pipeline objective the greedy (each piece where the step grows least) is a heuristic with
  no stated bound; the lower bound is reported beside it. If capacities make the greedy fail, the
  caller's feasible `fallback` (arrival order) is kept;
- then, when pieces x bins <= max_ilp_variables and time is left, an integer program (HiGHS, through
  highspy) searching only for steps better than the greedy's, stopped at the step's time budget
  (its best solution so far is kept).

Given `step_of` -- the pipeline's step from the bins' times in micro-batch order (one_f_one_b: 1F1B
over equal stages, data/dispatch_pipeline.py; or the simulator's, cost/lengths.dispatch_model) -- the
result is then refined for that step (refine_for_step), which sees what min-max cannot: with one
replica the total work is fixed, but the pipeline's fill waits on the first micro-batch's forward,
its drain on the last one's backward, and in the steady state a slot waits for the slower of two
different micro-batches (lock-step), so the order and the inequality of the micro-batches matter.

Whatever runs, the result holds each piece exactly once (checked before it is returned).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hrlplan.data.dispatch_pipeline import StepOf, one_f_one_b  # noqa: F401 (one_f_one_b: the default step_of)
from hrlplan.solver import quiet_highs

DEFAULT_TIME_BUDGET_S = 0.5
DEFAULT_MAX_ILP_VARIABLES = 4000


def document_cost(length: int, linear: float, quadratic: float) -> float:
    """The work of one document (or piece) of `length` tokens."""
    return linear * length + quadratic * length * length


def micro_batch_cost(lengths: Sequence[int], linear: float, quadratic: float) -> float:
    return sum(document_cost(n, linear, quadratic) for n in lengths)


@dataclass(frozen=True)
class Bin:
    """One micro-batch slot: `capacity` tokens, run at `speed` (work per second, relative).
    base_work: what it costs whatever it holds (fixed_shapes: the linear work of its whole budget,
    padding included)."""
    capacity: int
    speed: float = 1.0
    replica: int = 0
    base_work: float = 0.0


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
    method: str                   # ilp-optimal, ilp-time-limit, greedy, fallback (-optimal: proven), empty
    lower_bound: float            # no assignment's step_time (the min-max objective's, not step_of's) can be smaller
    seconds: float                # wall time the dispatch took
    step_time: float              # what was minimised (see step_time; step_of's when given)

    @property
    def slowest(self) -> float:
        return max(self.times, default=0.0)


def lower_bound(works: Sequence[float], bins: Sequence[Bin], stages: Optional[int] = None) -> float:
    """No assignment's step_time is below this (capacities ignored). Every bin runs, and the bin
    holding the largest piece w takes at least (base + w) / speed. Slowest micro-batch: also the total
    work over the total speed. Pipeline step of p stages: a replica r of m_r bins takes at least
    d_r + W_r / c_r, with d_r = a_r * sum(base / speed), c_r = max speed / a_r, a_r = (1 + (p-1)/m_r) / p,
    so the slowest takes at least every d_r and (total work + sum c_r d_r) / sum c_r."""
    own = max((b.base_work / b.speed for b in bins), default=0.0)
    if not works:
        return own
    largest = max(own, min((b.base_work + max(works)) / b.speed for b in bins))
    if stages is None:
        return max(largest, (sum(works) + sum(b.base_work for b in bins)) / sum(b.speed for b in bins))
    per_replica: Dict[int, List[Bin]] = {}
    for b in bins:
        per_replica.setdefault(b.replica, []).append(b)
    floors, rates = [], []
    for members in per_replica.values():
        a = (1 + (stages - 1) / len(members)) / stages
        floors.append(a * sum(b.base_work / b.speed for b in members))
        rates.append(max(b.speed for b in members) / a)
    spread = (sum(works) + sum(c * d for c, d in zip(rates, floors))) / sum(rates)
    return max(largest, max(floors), spread)


def bin_times(assignment: Sequence[Sequence[int]], works: Sequence[float], bins: Sequence[Bin]) -> List[float]:
    return [(b.base_work + sum(works[i] for i in group)) / b.speed for group, b in zip(assignment, bins)]


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
    load = [b.base_work / b.speed for b in bins]   # time, work / speed
    room = [b.capacity for b in bins]
    replicas = sorted({b.replica for b in bins})
    sums = {r: 0.0 for r in replicas}
    slowest = {r: 0.0 for r in replicas}
    for b, spec in enumerate(bins):
        sums[spec.replica] += load[b]
        slowest[spec.replica] = max(slowest[spec.replica], load[b])
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        best, best_key = -1, None
        if stages is not None:   # the slowest replica but r is the first of these two unless it is r
            now = sorted(((sums[r] + (stages - 1) * slowest[r]) / stages, r) for r in replicas)[-2:]
        for b, spec in enumerate(bins):
            if room[b] < lengths[i]:
                continue
            finish = load[b] + works[i] / spec.speed
            if stages is None:
                key = (finish, b)
            else:
                r = spec.replica
                mine = (sums[r] + works[i] / spec.speed + (stages - 1) * max(slowest[r], finish)) / stages
                others = next((t for t, o in reversed(now) if o != r), 0.0)
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


def _build_model(h, lengths: Sequence[int], w: Sequence[float], bins: Sequence[Bin], rank: Sequence[int],
                 stages: Optional[int]) -> None:
    """ilp's columns (x[k, b] at k * m + b, then z_r per replica with stages, then T) and rows; pieces
    in work order, works and base works scaled."""
    import highspy

    n, m = len(w), len(bins)
    replicas = sorted({b.replica for b in bins}) if stages is not None else []
    z_col = {r: n * m + j for j, r in enumerate(replicas)}
    num_cols = n * m + len(replicas) + 1
    t_col = num_cols - 1
    inf = highspy.kHighsInf
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
        rows.append((-inf, float(spec.capacity), cols, [float(lengths[k]) for k in range(n)]))
        bound_col = t_col if stages is None else z_col[spec.replica]
        rows.append((-inf, -spec.base_work / spec.speed, cols + [bound_col],
                     [w[k] / spec.speed for k in range(n)] + [-1.0]))
    for r in replicas:
        cols, vals, fixed = [], [], 0.0
        for b, spec in enumerate(bins):
            if spec.replica == r:
                cols += [k * m + b for k in range(n)]
                vals += [w[k] / (spec.speed * stages) for k in range(n)]
                fixed += spec.base_work / (spec.speed * stages)
        rows.append((-inf, -fixed, cols + [z_col[r], t_col], vals + [(stages - 1) / stages, -1.0]))
    starts, indices, values = [], [], []
    for _, _, cols, vals in rows:
        starts.append(len(indices))
        indices += cols
        values += vals
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), len(indices),
              np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32), np.array(values))


def ilp(lengths: Sequence[int], works: Sequence[float], bins: Sequence[Bin], time_limit_s: float,
        cutoff: Optional[float] = None, stages: Optional[int] = None) -> Tuple[Optional[List[List[int]]], bool]:
    """min T  s.t.  each piece in one bin; a bin's tokens <= its capacity; and
    stages None: every bin's work / speed <= T;
    stages p:    every bin's work / speed <= z_r of its replica r, (sum of r's bins + (p - 1) z_r) / p <= T.
    Pieces are ordered by work, largest first, and piece k may use only the first k + 1 bins of a group
    of interchangeable bins (any solution relabels into that form), which removes their symmetry.
    cutoff: a step_time already in hand (the greedy's); only better solutions are searched for.
    Returns (assignment, proven optimal), or (None, True) when nothing beats the cutoff, or
    (None, False) when nothing better was found in time."""
    import highspy   # why: only a step small enough for the integer program needs the solver

    begin = time.perf_counter()
    n, m = len(works), len(bins)
    order = sorted(range(n), key=lambda i: (-works[i], i))
    scale = max(max(works), max(b.base_work for b in bins), 1e-300)   # near 1: HiGHS's tolerances are absolute
    w = [works[i] / scale for i in order]
    bins = [replace(b, base_work=b.base_work / scale) for b in bins]
    groups = _symmetry_groups(bins, stages)
    rank, seen = [], {}
    for key in groups:
        rank.append(seen.get(key, 0))
        seen[key] = rank[-1] + 1
    h = quiet_highs()
    h.setOptionValue("random_seed", 0)
    # the default 1e-4 relative gap stops short when a fixed-shape step's constant work dominates
    h.setOptionValue("mip_rel_gap", 1e-9)
    _build_model(h, [lengths[i] for i in order], w, bins, rank, stages)
    if cutoff is not None:
        # why not setSolution: HiGHS 1.16 handed a warm start can report an objective below the one of
        # the solution it returns, and stop there (seen on a 7-piece, 2-replica step)
        h.setOptionValue("objective_bound", cutoff / scale)
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
    status = h.getModelStatus()
    if h.getInfo().primal_solution_status != 2:   # kSolutionStatusFeasible
        # none better than the cutoff exists (the search ended), or none was found in time
        searched = status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kObjectiveBound)
        return None, searched
    x = h.getSolution().col_value
    assignment: List[List[int]] = [[] for _ in range(m)]
    for k in range(n):
        assignment[max(range(m), key=lambda b: x[k * m + b])].append(order[k])
    for group in assignment:
        group.sort()
    return assignment, status == highspy.HighsModelStatus.kOptimal


def refine_for_step(lengths: Sequence[int], works: Sequence[float], bins: Sequence[Bin],
                    assignment: Sequence[Sequence[int]], step_of: StepOf, deadline: float) -> List[List[int]]:
    """Local search on step_of from `assignment` until no move helps or the deadline: swap two
    interchangeable bins' contents (the order of micro-batches), move a piece to another bin, swap two
    pieces of different bins; each kept when the step shrinks. The same pieces, within capacities."""
    best = [list(g) for g in assignment]
    load = [b.base_work + sum(works[i] for i in g) for g, b in zip(best, bins)]
    room = [b.capacity - sum(lengths[i] for i in g) for g, b in zip(best, bins)]
    times = [w / b.speed for w, b in zip(load, bins)]
    value = step_of(times, bins)
    groups = _symmetry_groups(bins, stages=1)
    tolerance = 1e-12 * max(value, 1e-300)

    def attempt(a: int, b: int, out_a: List[int], out_b: List[int]) -> bool:
        nonlocal value
        moved_to_b = sum(works[i] for i in out_a) - sum(works[i] for i in out_b)
        tokens_to_b = sum(lengths[i] for i in out_a) - sum(lengths[i] for i in out_b)
        if tokens_to_b > room[b] or -tokens_to_b > room[a]:
            return False
        trial = list(times)
        trial[a], trial[b] = (load[a] - moved_to_b) / bins[a].speed, (load[b] + moved_to_b) / bins[b].speed
        got = step_of(trial, bins)
        if got >= value - tolerance:
            return False
        for i in out_a:
            best[a].remove(i)
            best[b].append(i)
        for i in out_b:
            best[b].remove(i)
            best[a].append(i)
        load[a], load[b] = load[a] - moved_to_b, load[b] + moved_to_b
        room[a], room[b] = room[a] + tokens_to_b, room[b] - tokens_to_b
        times[:], value = trial, got
        return True

    def moves():
        """Every move of one pass, in order; the deadline is checked before each (a step_of call
        may be a whole simulated step, and a pass over n pieces makes O(n^2) of them)."""
        for a in range(len(bins)):
            for b in range(a + 1, len(bins)):
                if groups[a] == groups[b] and bins[a].base_work == bins[b].base_work:
                    yield a, b, list(best[a]), list(best[b])   # the two micro-batches trade places
        for a in range(len(bins)):
            for b in range(len(bins)):
                if a == b:
                    continue
                for i in list(best[a]):
                    yield a, b, [i], []
                for i in list(best[a]):
                    for k in list(best[b]) if a < b else []:
                        if i in best[a] and k in best[b]:
                            yield a, b, [i], [k]

    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for a, b, out_a, out_b in moves():
            if time.perf_counter() >= deadline:
                break
            if attempt(a, b, out_a, out_b):
                improved = True
    for g in best:
        g.sort()
    return best


def dispatch_bins(lengths: Sequence[int], bins: Sequence[Bin], linear: float, quadratic: float,
                  time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_ilp_variables: int = DEFAULT_MAX_ILP_VARIABLES,
                  fallback: Optional[Sequence[Sequence[int]]] = None, stages: Optional[int] = None,
                  fixed_shapes: bool = False, ilp_min_gain: float = 0.0, step_of: Optional[StepOf] = None) -> Dispatch:
    """Assign pieces of `lengths` tokens to `bins`, minimising step_time: the slowest bin's work / speed
    (stages None) or the slowest replica's pipeline step of `stages` stages. fixed_shapes: every bin
    computes its whole budget's linear work (padding included; its base_work), pieces only attention.
    ilp_min_gain: the integer program runs only when the greedy's step is more than this fraction
    above the lower bound (it cannot gain more; a trainer's solver thread then leaves the cores alone).
    step_of (one_f_one_b(pp), or the simulator's: cost/lengths.simulated_step_of): the pipeline's
    step given each bin's time in micro-batch order; the min-max result is then refined for it
    (refine_for_step: the order of micro-batches, pieces moved or swapped) with the integer program
    given half of what is left of the budget, and step_time is step_of's. The pieces stay the same:
    a step holds the same documents whatever the objective."""
    begin = time.perf_counter()
    if not bins:
        raise ValueError("a dispatch needs at least one micro-batch")
    if stages is not None and stages < 1:
        raise ValueError(f"stages must be at least 1 (the pipeline's depth), got {stages}")
    if fixed_shapes:
        bins = [replace(b, base_work=b.base_work + linear * b.capacity) for b in bins]
        linear = 0.0
    works = [document_cost(n, linear, quadratic) for n in lengths]
    bound = lower_bound(works, bins, stages)
    if not lengths:
        empty: List[List[int]] = [[] for _ in bins]
        return Dispatch(empty, bin_times(empty, works, bins), "empty", bound, time.perf_counter() - begin,
                        step_time(empty, works, bins, stages))
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
    ilp_share = left if step_of is None else left / 2
    if len(lengths) * len(bins) <= max_ilp_variables and left > 0 and value > bound * (1 + max(ilp_min_gain, 1e-9)):
        solved, optimal = ilp(lengths, works, bins, ilp_share, cutoff=value, stages=stages)
        if solved is not None and step_time(solved, works, bins, stages) <= value:
            best, method = solved, "ilp-optimal" if optimal else "ilp-time-limit"
        elif solved is None and optimal:
            method += "-optimal"   # the integer program proved nothing beats it
    value = step_time(best, works, bins, stages)
    if step_of is not None:
        # local optima differ by start: the min-max result and the caller's arrival order, each refined
        # in its share of what is left of the budget; the better is kept
        starts = [best] + ([[list(g) for g in fallback]] if fallback is not None else [])
        refined, value = best, step_of(bin_times(best, works, bins), bins)
        for i, start in enumerate(starts):
            left = begin + 0.9 * time_budget_s - time.perf_counter()
            candidate = refine_for_step(lengths, works, bins, start, step_of,
                                        time.perf_counter() + left / (len(starts) - i))
            got = step_of(bin_times(candidate, works, bins), bins)
            if got < value:
                refined, value = candidate, got
        if refined != best:
            best, method = refined, method + "+pipeline"
    check_assignment(best, lengths, bins)
    return Dispatch(best, bin_times(best, works, bins), method, bound, time.perf_counter() - begin, value)


def dispatch(lengths: Sequence[int], micro_batches: int, capacity: int, linear: float = 1.0, quadratic: float = 0.0,
             time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_ilp_variables: int = DEFAULT_MAX_ILP_VARIABLES,
             fallback: Optional[Sequence[Sequence[int]]] = None, stages: Optional[int] = None,
             fixed_shapes: bool = False) -> List[List[int]]:
    """One replica's micro-batches, all of `capacity` tokens: the assignment only (PackedDocuments'
    dispatcher: functools.partial(dispatch, linear=..., quadratic=...)). For one replica the pipeline
    objective (stages) and the slowest micro-batch have the same optimum: the sum is fixed."""
    return dispatch_bins(lengths, micro_batch_bins(micro_batches, capacity), linear, quadratic, time_budget_s,
                         max_ilp_variables, fallback, stages, fixed_shapes).assignment

