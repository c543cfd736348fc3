"""How much gain the dispatch leaves on the table (issue 37): per step, `balanced` within its budget
against a long multi-start search and against lower bounds no dispatch can beat (pure simulation).

    python bench/mixed_length_ceiling.py [--seeds 0 1 2] [--steps 16] [--long 4] [--restarts 16]

Setup as bench/mixed_length.py's simulation of the measured configuration (data/code1024, 2048-token
rows, 6 micro-batches, pp 2, 1F1B over equal stages, attention ratio 3.5: a one-document row's
attention 3.5x its matmuls; fixed shapes). Per step:

- `document`: arrival order; `balanced`: dispatch_bins(step_of=one_f_one_b(pp)) in --time-budget;
- `long`: the same dispatch given --long seconds, then refine_for_step from --restarts random
  feasible starts (each refined to a local optimum), the best: what more search finds;
- `loose_floor`: the bound bench/mixed_length.py reports (total work over pp, plus one padding row:
  first and last micro-batches may be empty), which ignores that the rows are nearly full;
- `floor`: the last stage works through every micro-batch; before it starts, the other stages run the
  first micro-batch's forward, after it ends the last one's backward; and the first and last rows
  together hold at least the tokens the other m - 2 rows cannot (total - (m - 2) x budget), at least
  the squares of the shortest pieces that many tokens take (fractional: a bound). Lock-step waits in
  the steady state are not in it, so it is a bound, not a reachable step.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.data import dispatch as D  # noqa: E402
from hrlplan.data.code_corpus import CodeCorpus, prepare_code_corpus  # noqa: E402
from hrlplan.data.packing import PackedDocuments, predictions  # noqa: E402


def least_squares(lengths, tokens: float) -> float:
    """The least sum of squared lengths of pieces holding `tokens` tokens (fractional pieces)."""
    total, need = 0.0, float(tokens)
    for n in sorted(lengths):
        if need <= 0:
            break
        take = min(1.0, need / n) if n else 1.0
        total += take * n * n
        need -= take * n
    return total


def floor(lengths, micro_batches: int, budget: int, linear: float, quadratic: float, pp: int,
          forward_share: float = 1.0 / 3.0) -> float:
    """A lower bound on a one-replica 1F1B step over pp equal stages (module docstring)."""
    base = linear * budget
    total = micro_batches * base + quadratic * sum(n * n for n in lengths)
    need = max(0.0, sum(lengths) - (micro_batches - 2) * budget)
    both = least_squares(lengths, need)
    last_alone = least_squares(lengths, max(0.0, need - budget))
    # f q0 + (1 - f) q1 = f (q0 + q1) + (1 - 2 f) q1 (f <= 1/2)
    ends = base + quadratic * (forward_share * both + (1 - 2 * forward_share) * last_alone)
    return (total + (pp - 1) * ends) / pp


def fluid_floor(lengths, micro_batches: int, budget: int, linear: float, quadratic: float, pp: int,
                forward_share: float = 1.0 / 3.0) -> float:
    """A lower bound with the lock-step in it: the least 1F1B makespan over every vector of row times
    that holds the step's work (pieces divisible but the two longest, each row between a padding
    row and one document filling it, the times summing to the total). For a fixed order of operations the makespan is the
    longest path, convex and piecewise linear in the durations, so this is a linear program."""
    from scipy.optimize import linprog

    m, p, base = micro_batches, pp, linear * budget
    ops = []   # per position: [(kind, j)] in 1F1B order (as data/dispatch_pipeline.py)
    for q in range(p):
        warm = min(p - 1 - q, m)
        order = [(0, j) for j in range(warm)]
        for j in range(m - warm):
            order += [(0, warm + j), (1, j)]
        order += [(1, j) for j in range(m - warm, m)]
        ops.append(order)
    index = {(q, k, j): m + 1 + n for n, (q, k, j) in enumerate((q, k, j) for q in range(p) for k, j in ops[q])}
    n_vars = m + 1 + len(index)   # t_0..t_{m-1}, makespan, each operation's end
    rows, rhs = [], []

    def at_least(end, before, j, share):   # end >= before + share * t_j / p, as -end + before + share t_j / p <= 0
        row = [0.0] * n_vars
        row[end] -= 1.0
        if before is not None:
            row[before] += 1.0
        row[j] += share / p
        rows.append(row)
        rhs.append(0.0)

    for q in range(p):
        prev = None
        for k, j in ops[q]:
            share = forward_share if k == 0 else 1.0 - forward_share
            end = index[(q, k, j)]
            at_least(end, prev, j, share)
            ready = (index[(q - 1, 0, j)] if q > 0 else None) if k == 0 else (
                index[(q + 1, 1, j)] if q < p - 1 else index[(q, 0, j)])
            at_least(end, ready, j, share)
            prev = end
        row = [0.0] * n_vars
        row[prev], row[m] = 1.0, -1.0
        rows.append(row)
        rhs.append(0.0)
    total = m * base + quadratic * sum(n * n for n in lengths)
    cost = [0.0] * n_vars
    cost[m] = 1.0
    top = sorted(lengths, reverse=True)[:2] + [0, 0]
    w1, w2 = quadratic * top[0] ** 2, quadratic * top[1] ** 2
    best = float("inf")
    # the two longest pieces are whole: in one row (i == k), or in rows i and k; the least over the cases
    for i in range(m):
        for k in range(m):
            floor_of = [base] * m
            floor_of[i] += w1
            floor_of[k] += w2
            if i == k and top[0] + top[1] > budget:
                continue
            bounds = ([(f, base + quadratic * budget * budget) for f in floor_of] + [(0, None)] * (n_vars - m))
            got = linprog(cost, A_ub=rows, b_ub=rhs, A_eq=[[1.0] * m + [0.0] * (n_vars - m)], b_eq=[total],
                          bounds=bounds, method="highs")
            if got.status == 0:
                best = min(best, float(got.fun))
    if best == float("inf"):
        raise RuntimeError("fluid floor: no case is feasible")
    return best


def random_start(lengths, m: int, budget: int, rng: random.Random):
    """A feasible assignment: pieces in random order, each to a random bin with room (first fit else)."""
    while True:
        groups, room = [[] for _ in range(m)], [budget] * m
        ok = True
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], rng.random())):
            fits = [b for b in range(m) if room[b] >= lengths[i]]
            if not fits:
                ok = False
                break
            b = rng.choice(fits)
            groups[b].append(i)
            room[b] -= lengths[i]
        if ok:
            return groups


def study(args, seed: int):
    corpus = CodeCorpus.load(prepare_code_corpus(args.path, args.vocab, 2000, 0))
    stream = PackedDocuments(corpus.train_tokens, corpus.val_tokens, corpus.eot_id, args.budget, seed)
    linear = 1.0
    quadratic = args.attention_ratio * linear / args.budget
    m, pp = args.micro_batches, args.pp
    bins = [D.Bin(args.budget, 1.0, 0, linear * args.budget) for _ in range(m)]
    step_of = D.one_f_one_b(pp)
    rng = random.Random(seed)
    rows = []
    for step in range(args.steps):
        pieces, arrival = stream.step_pieces(step, m)
        lengths = [predictions(p) for p in pieces]
        works = [quadratic * n * n for n in lengths]

        def value(a):
            return step_of(D.bin_times(a, works, bins), bins)

        common = dict(fallback=arrival, stages=pp, ilp_min_gain=0.01, step_of=step_of)
        balanced = D.dispatch_bins(lengths, bins, 0.0, quadratic, time_budget_s=args.time_budget, **common)
        long = D.dispatch_bins(lengths, bins, 0.0, quadratic, time_budget_s=args.long, **common).assignment
        best = min([long, balanced.assignment], key=value)
        for _ in range(args.restarts):
            start = random_start(lengths, m, args.budget, rng)
            got = D.refine_for_step(lengths, works, bins, start, step_of, time.perf_counter() + args.long)
            best = min([best, got], key=value)
        loose = (sum(D.bin_times(arrival, works, bins)) + (pp - 1) * linear * args.budget) / pp
        rows.append({"document": value(arrival), "balanced": value(balanced.assignment), "long": value(best),
                     "floor": floor(lengths, m, args.budget, linear, quadratic, pp), "loose_floor": loose,
                     "fluid_floor": fluid_floor(lengths, m, args.budget, linear, quadratic, pp),
                     "fill": sum(lengths) / (m * args.budget), "dispatch_s": balanced.seconds})
        r = rows[-1]
        print(f"seed {seed} step {step}: document/balanced {r['document'] / r['balanced']:.3f}, "
              f"document/long {r['document'] / r['long']:.3f}, document/floor {r['document'] / r['floor']:.3f}, "
              f"document/loose {r['document'] / r['loose_floor']:.3f}, document/fluid {r['document'] / r['fluid_floor']:.3f}, fill {r['fill']:.3f}", flush=True)
    total = {k: sum(r[k] for r in rows) for k in ("document", "balanced", "long", "floor", "loose_floor", "fluid_floor")}
    summary = {f"document_over_{k}": total["document"] / total[k] for k in ("balanced", "long", "floor", "loose_floor", "fluid_floor")}
    summary["per_step_median"] = {k: statistics.median(r["document"] / r[k] for r in rows)
                                  for k in ("balanced", "long", "floor", "loose_floor", "fluid_floor")}
    print(f"seed {seed}: over the steps, document / balanced {summary['document_over_balanced']:.3f}x, "
          f"/ long search {summary['document_over_long']:.3f}x, / floor {summary['document_over_floor']:.3f}x, "
          f"/ loose floor {summary['document_over_loose_floor']:.3f}x, / fluid floor "
          f"{summary['document_over_fluid_floor']:.3f}x", flush=True)
    return {"seed": seed, "steps": rows, "summary": summary}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="data/code1024")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=6)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--attention-ratio", type=float, default=3.5)
    parser.add_argument("--time-budget", type=float, default=0.5)
    parser.add_argument("--long", type=float, default=4.0, help="seconds for the long dispatch and each restart")
    parser.add_argument("--restarts", type=int, default=16)
    parser.add_argument("--out", default="bench/results/mixed_length_ceiling.json")
    args = parser.parse_args(argv)
    report = {"settings": vars(args), "seeds": [study(args, s) for s in args.seeds]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
