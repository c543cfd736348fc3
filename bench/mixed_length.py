"""Mixed-length data (issue 37): `document` packing (arrival order) against `balanced` (cost-aware
dispatch) on data=code's real document lengths.

    python bench/mixed_length.py --measure [--budget 4096] [--micro-batches 2] [--rounds 4] [--steps 8]

--measure (bench/mixed_length_measure.py): every (stage, micro-batch) forward and backward of the real
pipeline stages timed in one thread's CPU time, document / min-max / balanced interleaved in rounds,
walked through 1F1B; useful tokens per CPU-second, per-micro-batch time spread, the simulator's
calibrated prediction per packing; --train-rounds N adds real pp training runs for the loss curves.
Without --measure:

    python bench/mixed_length.py [--budget 4096] [--micro-batches 8] [--pp 2] [--replicas 1 2]
                                 [--steps 40] [--time-budget 0.5] [--out bench/results/mixed_length.json]

Costs are predicted, not measured: a document of L tokens costs linear * L + quadratic * L**2 FLOPs
(forward and backward) of a GPT-2 of --n-embd / --n-layer / --vocab, the work of an attention kernel
that skips the masked blocks (see hrlplan/data/dispatch.py); with fixed shapes (the default, as torch
pipelining runs) every micro-batch pays the linear work of its whole budget, padding included
(--varlen: only the documents' tokens). For each step the same documents are
packed three ways (document, min_max, balanced: min-max refined for the pipeline's step); a replica's step
is the 1F1B timeline of its micro-batches in order over pp equal stages (data/dispatch_pipeline.py,
tested equal to the simulator's timeline), and the step waits on its slowest replica. The useful
tokens of a step are the same every way, so the predicted speed-up is the ratio of step times.
`concat` (today's windows, attention across the whole budget) is given for reference.
The corpus is data/code, built locally by hrlplan/data/code_corpus.py when absent (no downloads).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.data import dispatch as D  # noqa: E402
from hrlplan.data.code_corpus import CodeCorpus, prepare_code_corpus  # noqa: E402
from hrlplan.data.packing import PackedDocuments, predictions, split_documents  # noqa: E402

import mixed_length_measure as M  # noqa: E402 (bench/, beside this file)


def gpt2_coefficients(n_embd: int, n_layer: int, vocab: int):
    """FLOPs per token (matmuls: 12 h^2 a block and the head, x2 multiply-add, x3 forward and backward)
    and per squared document length (Q K^T and A V: 4 h a query-key pair, half the pairs causal, x3)."""
    linear = 3 * 2 * (12 * n_embd * n_embd * n_layer + n_embd * vocab)
    quadratic = 3 * 2 * n_embd * n_layer
    return float(linear), float(quadratic)


def spread(times: List[float]) -> Dict[str, float]:
    mean = statistics.fmean(times)
    return {"max_over_mean": max(times) / mean, "max_minus_min_over_mean": (max(times) - min(times)) / mean,
            "cv": statistics.pstdev(times) / mean}


quantiles = M.quantiles


def run_layout(stream: PackedDocuments, replicas: int, args, linear: float, quadratic: float) -> Dict:
    """Per step, the same pieces as `document` (arrival order), `min_max` (the slowest micro-batch's
    objective) and `balanced` (min-max refined for the pipeline's step: dispatch_bins(step_of=
    one_f_one_b(pp))), each step costed by the 1F1B timeline of equal stages (dispatch_pipeline,
    tested equal to the simulator's), the slowest replica's."""
    bins = D.replica_bins(args.micro_batches, [args.budget] * replicas, [1.0] * replicas)
    # what a micro-batch costs, as dispatch_bins models it (fixed shapes: padding's linear work too)
    costed = [replace(b, base_work=linear * b.capacity) for b in bins] if args.fixed_shapes else bins
    total = args.micro_batches * replicas
    step_of = D.one_f_one_b(args.pp)
    rows: Dict[str, List[Dict]] = {"document": [], "min_max": [], "balanced": []}
    seconds, methods, useful, bounds = [], Counter(), [], []
    for step in range(args.steps):
        pieces, arrival = stream.step_pieces(step, total)
        lengths = [predictions(p) for p in pieces]
        works = [D.document_cost(n, 0.0 if args.fixed_shapes else linear, quadratic) for n in lengths]
        common = dict(time_budget_s=args.time_budget, fallback=arrival, stages=args.pp, fixed_shapes=args.fixed_shapes,
                      ilp_min_gain=0.01)
        min_max = D.dispatch_bins(lengths, bins, linear, quadratic, **common)
        result = D.dispatch_bins(lengths, bins, linear, quadratic, step_of=step_of, **common)
        seconds.append(result.seconds)
        methods[result.method] += 1
        useful.append(sum(lengths))
        packed = (("document", arrival), ("min_max", min_max.assignment), ("balanced", result.assignment))
        for name, assignment in packed:
            times = D.bin_times(assignment, works, costed)
            rows[name].append({"step": step_of(times, costed), "slowest": max(times), **spread(times)})
        # no assignment of these pieces does better (one replica, equal stages): the last stage works
        # through every micro-batch's share, after the first one's forward and before the last one's
        # backward of the other stages, each at least an empty (padding only) micro-batch
        base = min(b.base_work for b in costed)
        floor = (sum(D.bin_times(arrival, works, costed)) + (args.pp - 1) * base) / args.pp
        bounds.append(rows["document"][-1]["step"] / floor)
    concat_times = [D.document_cost(args.budget, linear, quadratic)] * total
    concat_step = step_of(concat_times, bins)
    out = {"replicas": replicas, "micro_batches_per_replica": args.micro_batches, "pp": args.pp,
           "useful_tokens_per_step": quantiles(useful), "budget_fill": statistics.fmean(useful) / (total * args.budget),
           "dispatch_seconds": quantiles(seconds), "dispatch_methods": dict(methods),
           # one replica: document's step over the floor no dispatch can beat (per step)
           "bound_over_document_per_step": quantiles(bounds) if replicas == 1 else None}
    for name in ("min_max", "balanced"):
        out[f"predicted_{name}_over_document_per_step"] = quantiles(
            [d["step"] / x["step"] for d, x in zip(rows["document"], rows[name])])
        out[f"predicted_{name}_over_document"] = (sum(d["step"] for d in rows["document"])
                                                  / sum(x["step"] for x in rows[name]))
    for name, values in rows.items():
        out[name] = {key: quantiles([v[key] for v in values]) for key in values[0]}
        out[name]["useful_tokens_per_gflop_step"] = statistics.fmean(useful) / statistics.fmean(
            v["step"] for v in values) * 1e9
    out["concat_useful_tokens_per_gflop_step"] = total * args.budget / concat_step * 1e9
    return out


# ---------------------------------------------------------------- measured (--measure)
def _fit(times: List[float], squares: List[float], docs: List[float]) -> Dict[str, float]:
    """time = fixed + per_square * (sum of squared lengths) + per_document * (documents), least squares."""
    import numpy as np

    x = np.column_stack([np.ones(len(times)), np.asarray(squares, float), np.asarray(docs, float)])
    coef, *_ = np.linalg.lstsq(x, np.asarray(times, float), rcond=None)
    residual = np.asarray(times) - x @ coef
    return {"fixed_s": float(coef[0]), "per_square_s": float(coef[1]), "per_document_s": float(coef[2]),
            "rms_residual_s": float(np.sqrt(np.mean(residual ** 2)))}


def _calibrate(args, calibration, passes: List[List[Dict]]):
    """From the calibration rows (median over the passes), per stage and kind (forward, backward, and
    the two together) the least-squares line time = fixed + per_square * S + per_document * n +
    per_useful * U (the per-document term left out where it comes out negative: it then only absorbs
    noise); its value at the one-document row is the fixed-length micro-batch (`full`), and its
    RowShares are the terms' shares of that value, so the prediction of a row is the fitted line's.
    (Normalising by the timed one-document row instead put that row's own timing noise, a few ms,
    into every row's fixed work: the steps came out 2-6% off.) Returns full ({F, B}: per stage), the
    RowShares of F + B per stage, the fits, and the RowShares per kind ({"F": [...], "B": [...]})."""
    import numpy as np

    from hrlplan.cost.lengths import RowShares

    # a pass timed between a round's steps leaves rows out (None) where the round has fewer steps than the
    # calibration; a row no pass timed is left out of the fit
    timed = [i for i in range(len(calibration)) if any(c[i] is not None for c in passes)]
    med = [{kind: [statistics.median(c[i][kind][k][0] for c in passes if c[i] is not None) for k in range(args.pp)]
            for kind in ("F", "B")} for i in timed]
    x = np.array([[1.0, sq, n, u] for n, u, sq, *_ in (calibration[i] for i in timed)], dtype=float)
    at_one = np.array([1.0, float(args.budget) ** 2, 1.0, float(args.budget)])

    def fitted(times):
        coef, *_ = np.linalg.lstsq(x, times, rcond=None)
        if coef[2] < 0:
            kept = [0, 1, 3]
            part, *_ = np.linalg.lstsq(x[:, kept], times, rcond=None)
            coef = np.zeros(4)
            coef[kept] = part
        one = float(coef @ at_one)
        shares = RowShares(attention=float(coef[1]) * args.budget ** 2 / one, per_document=float(coef[2]) / one,
                           useful=float(coef[3]) * args.budget / one)
        return one, shares, {"fixed_s": float(coef[0]), "per_square_s": float(coef[1]), "per_document_s": float(coef[2]),
                             "per_useful_token_s": float(coef[3]), "one_document_row_s": one,
                             "one_document_row_timed_s": float(times[0]), "rows_s": times.tolist(),
                             "rms_residual_s": float(np.sqrt(np.mean((times - x @ coef) ** 2)))}

    full: Dict[str, List[float]] = {"F": [], "B": []}
    shares, fits, per_kind = [], [], {"F": [], "B": []}
    for k in range(args.pp):
        for kind in ("F", "B"):
            one, kind_shares, _ = fitted(np.array([m[kind][k] for m in med]))
            full[kind].append(one)
            per_kind[kind].append(kind_shares)
        _, together, fit = fitted(np.array([m["F"][k] + m["B"][k] for m in med]))
        shares.append(together)
        fits.append(fit)
    return full, shares, fits, per_kind


def _slowest_replica(args, table) -> float:
    """A step's measured time: each replica's micro-batches (replica-major) walked through 1F1B, the slowest."""
    from hrlplan.cost.lengths import pipeline_step

    m = args.micro_batches
    return max(pipeline_step("1f1b", args.pp, [row[r * m:(r + 1) * m] for row in table["F"]],
                             [row[r * m:(r + 1) * m] for row in table["B"]]) for r in range(args.dp))


def _line_rows(args, meta, spans, full, per_kind, sq, n_docs, useful) -> Dict[str, List[List[float]]]:
    """{F, B}: [stage][row] the calibrated line's work multipliers of rows with these squares, documents
    and real tokens (times full[kind][stage]: their predicted seconds)."""
    from hrlplan.cost.lengths import micro_batch_multipliers

    return {kind: micro_batch_multipliers(meta, spans, args.budget, sq, n_docs, useful, per_kind[kind])
            for kind in ("F", "B")}


def _row_spread(args, meta, spans, calibration, passes, full, per_kind):
    """How each calibration row timed once (every pass between the rounds' steps) strays from the
    calibrated line (cost/lengths.RowSpread): what a step's rows, each timed once, do too."""
    from hrlplan.cost.lengths import RowSpread

    work = _line_rows(args, meta, spans, full, per_kind, [c[2] for c in calibration], [c[0] for c in calibration],
                      [c[1] for c in calibration])
    timed: Dict[str, List[List[float]]] = {"F": [], "B": []}
    predicted: Dict[str, List[List[float]]] = {"F": [], "B": []}
    for kind in ("F", "B"):
        for k in range(args.pp):
            rows = [(row[kind][k][0], full[kind][k] * work[kind][k][i])
                    for one_pass in passes for i, row in enumerate(one_pass) if row is not None]
            timed[kind].append([t for t, _ in rows])
            predicted[kind].append([p for _, p in rows])
    return RowSpread.from_timings(timed, predicted)


def _simulated(args, meta, spans, full, shares, per_kind, squares, docs, tokens, spread=None, draws=200):
    """Per packing and step, the simulator's step: `predicted`, the mean step when each row's forward
    and backward (each stage's RowShares from the calibration rows) stray from the line as the
    calibration rows of like size timed once do, about the line (cost/lengths.expected_step over
    `spread`); `line`, the deterministic timeline of the line's rows; `one_table` with forward and
    backward together (as the dispatch costs them); `flops_only` with the planner's FLOP shares alone
    (what an uncalibrated planner would say)."""
    from hrlplan.cost.lengths import expected_step, micro_batch_multipliers
    from hrlplan.cost.timeline import simulate_timeline

    zero = [0.0] * args.pp
    m = args.micro_batches

    def replica_step(work, back):
        return simulate_timeline("1f1b", args.pp, 1, m, full["F"], full["B"], zero, zero, zero, zero,
                                 micro_batch_work=work, backward_work=back).makespan

    def step_of_work(work, back):   # the slowest replica's (rows replica-major)
        return max(replica_step([w[r * m:(r + 1) * m] for w in work],
                                None if back is None else [b[r * m:(r + 1) * m] for b in back]) for r in range(args.dp))

    def over(row_shares):
        return {p: [step_of_work(micro_batch_multipliers(meta, spans, args.budget, *x, row_shares), None)
                    for x in zip(squares[p], docs[p], tokens[p])] for p in M.PACKINGS}

    by_kind = {p: [_line_rows(args, meta, spans, full, per_kind, *x) for x in zip(squares[p], docs[p], tokens[p])]
               for p in M.PACKINGS}
    line = {p: [step_of_work(w["F"], w["B"]) for w in by_kind[p]] for p in M.PACKINGS}
    predicted = line if spread is None else {
        p: [expected_step(step_of_work, w["F"], w["B"], spread, full, draws=draws, seed=i) for i, w in enumerate(by_kind[p])]
        for p in M.PACKINGS}
    return predicted, line, over(shares), over(None)


def _analyse(args, prepared: Dict, timing: Dict, meta, spans) -> Dict:
    P = M.PACKINGS
    timed = timing["timed_steps"]
    useful = [sum(prepared["lengths"][s]) for s in timed]
    squares = {p: [[sum(prepared["lengths"][s][i] ** 2 for i in g) for g in prepared["assignments"][p][s]]
                   for s in timed] for p in P}
    docs = {p: [[len(g) for g in prepared["assignments"][p][s]] for s in timed] for p in P}
    per_round, steps_measured, spreads, paired = [], {p: [] for p in P}, {p: [] for p in P}, {p: [] for p in P}
    for rnd in timing["rounds"]:
        steps = {p: [_slowest_replica(args, t) for t in rnd["tables"][p]] for p in P}
        per_round.append({p: sum(useful) / sum(steps[p]) for p in P})
        for p in P:
            steps_measured[p].append(statistics.fmean(steps[p]))
            paired[p] += [d / x for d, x in zip(steps["document"], steps[p])]
            for t in rnd["tables"][p]:
                per_mb = [sum(t[kind][k][j] for kind in ("F", "B") for k in range(args.pp))
                          for j in range(args.micro_batches * args.dp)]
                spreads[p].append(max(per_mb) / statistics.fmean(per_mb))
    # the calibration passes timed between the rounds' steps, in their conditions (those timed in a burst
    # before the rounds, which fed the dispatch, came out 1-5% faster than the steps on a busy host)
    full, shares, calibration, per_kind = _calibrate(args, timing["calibration_rows"],
                                                     [p for r in timing["rounds"] for p in r["calibration"]])
    tokens = {p: [[sum(prepared["lengths"][s][i] for i in g) for g in prepared["assignments"][p][s]] for s in timed]
              for p in P}
    passes = [p for r in timing["rounds"] for p in r["calibration"]]
    spread = _row_spread(args, meta, spans, timing["calibration_rows"], passes, full, per_kind)
    predicted, line, one_table, flops_only = _simulated(args, meta, spans, full, shares, per_kind, squares, docs,
                                                        tokens, spread)
    rows_t, rows_sq, rows_docs = [], [], []
    for rnd in timing["rounds"]:
        for p in P:
            for i, t in enumerate(rnd["tables"][p]):
                for j in range(args.micro_batches * args.dp):
                    rows_t.append(sum(t[kind][k][j] for kind in ("F", "B") for k in range(args.pp)))
                    rows_sq.append(squares[p][i][j])
                    rows_docs.append(docs[p][i][j])
    fit = _fit(rows_t, rows_sq, rows_docs)
    full_row_s = sum(full["F"]) + sum(full["B"])
    report = {"settings": dict(vars(args)), "spans": spans, "timed_steps": timed, "useful_tokens_per_step": useful,
              "square_sums": squares, "documents_per_micro_batch": docs, "useful_tokens_per_micro_batch": tokens,
              "dispatch_seconds": quantiles(prepared["dispatch_seconds"]),
              "dispatch_methods": dict(Counter(prepared["dispatch_methods"])),
              "loads": [(r["load_before"], r["load_after"]) for r in timing["rounds"]],
              "full_row_s": full, "row_fit": fit, "calibration": calibration, "row_shares": [vars(x) for x in shares],
              "row_shares_by_kind": {kind: [vars(x) for x in v] for kind, v in per_kind.items()},
              "row_spread": {"neighbours": spread.neighbours, **{kind: [{
                  "rows": len(v), "mean": statistics.fmean(d for _, d in v),
                  "rms": statistics.fmean(d * d for _, d in v) ** 0.5} for v in stages]
                  for kind, stages in spread.pairs.items()}},
              "attention_share": {"full_row": fit["per_square_s"] * args.budget ** 2 / full_row_s,
                                  "document_rows": fit["per_square_s"] * statistics.fmean(
                                      x for sq in squares["document"] for x in sq) / statistics.fmean(rows_t)},
              "packings": {}}
    for p in P:
        mean_pred = statistics.fmean(predicted[p])
        report["packings"][p] = {
            "useful_tokens_per_cpu_s": quantiles([r[p] for r in per_round]),
            "mean_step_s_per_round": quantiles(steps_measured[p]),
            "predicted_mean_step_s": mean_pred,
            "predicted_mean_step_s_flops_only": statistics.fmean(flops_only[p]),
            "predicted_mean_step_s_one_table": statistics.fmean(one_table[p]),
            "predicted_mean_step_s_line": statistics.fmean(line[p]),
            "predicted_within_round_spread": min(steps_measured[p]) <= mean_pred <= max(steps_measured[p]),
            "line_within_round_spread": min(steps_measured[p]) <= statistics.fmean(line[p]) <= max(steps_measured[p]),
            "predicted_over_measured": mean_pred / statistics.median(steps_measured[p]),
            "micro_batch_slowest_over_mean": quantiles(spreads[p]),
            "document_step_over_this_paired": quantiles(paired[p])}
    for p in ("min_max", "balanced"):
        report[f"{p}_over_document"] = {
            "measured_per_round": [r[p] / r["document"] for r in per_round],
            "measured": quantiles([r[p] / r["document"] for r in per_round]),
            "predicted": sum(predicted["document"]) / sum(predicted[p]),
            "predicted_flops_only": sum(flops_only["document"]) / sum(flops_only[p]),
            "predicted_one_table": sum(one_table["document"]) / sum(one_table[p]),
            "predicted_line": sum(line["document"]) / sum(line[p])}
    tables = [t for rnd in timing["rounds"] for p in P for t in rnd["tables"][p]]
    report["same_documents"] = {
        "loss_max_abs_difference": max(abs(a["loss"] - b["loss"]) for rnd in timing["rounds"]
                                       for a, b in zip(rnd["tables"]["document"], rnd["tables"]["balanced"])),
        "loss_mean": statistics.fmean(t["loss"] for t in tables),
        "gradient_max_abs_difference": max(t["gradient_max_abs_difference"] for t in tables),
        "gradient_max_abs": max(t["gradient_max_abs"] for t in tables)}
    measured_rank = sorted(P, key=lambda p: statistics.median(steps_measured[p]))
    predicted_rank = sorted(P, key=lambda p: statistics.fmean(predicted[p]))
    report["ranking"] = {"measured": measured_rank, "predicted": predicted_rank}
    return report


def measure(args) -> Dict:
    import tempfile

    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.model_meta import introspect
    from hrlplan.models.hf import build_stage_modules
    from hrlplan.runtime.trainer import build_full_model

    corpus = CodeCorpus.load(prepare_code_corpus(args.path, args.vocab, 2000, 0))
    documents = PackedDocuments(corpus.train_tokens, corpus.val_tokens, corpus.eot_id, args.budget, args.seed)
    cfg = as_config(compose(M.overrides(args)))
    meta = introspect(cfg.arch, args.budget)
    spans = M.spans_of(args)
    stages = build_stage_modules(build_full_model(cfg.arch, args.seed), spans)
    calibration = M.calibration_rows(args, corpus.eot_id, documents)
    # 3 passes (about 15 s each at 6 held-out steps): they only feed the dispatch (the prediction fits the
    # passes timed between the rounds' steps); a pass's rows vary by a few percent, the fit of their medians far less
    before = [M.time_calibration(stages, calibration, args.micro_batches) for _ in range(3)]
    full, shares, _, _ = _calibrate(args, calibration, before)
    prepared = M.step_batches(args, documents, meta, spans, {"full": full, "shares": shares})
    timing = M.timed_rounds(args, prepared["batches"], stages, calibration)
    timing["before"], timing["calibration_rows"] = before, calibration
    report = _analyse(args, prepared, timing, meta, spans)
    report["micro_batch_times_s"] = [r["tables"] for r in timing["rounds"]]
    # the raw calibration passes (timed between the rounds' steps, the last of a round partial; those before the rounds, which
    # fed the dispatch) and their rows, to re-fit offline
    report["calibration_passes"] = [p for r in timing["rounds"] for p in r["calibration"]]
    report["calibration_passes_before"] = timing["before"]
    report["calibration_rows"] = [[n, u, sq] for n, u, sq, _ in calibration]
    if args.train_rounds:
        with tempfile.TemporaryDirectory(prefix="mixed_length_") as workdir:
            runs = M.training_runs(args, Path(workdir))
        report["training_runs"] = runs
        report["loss_curves_max_abs_difference"] = max(
            abs(a - b) for x, y in zip(runs["document"], runs["balanced"]) for a, b in zip(x["loss"], y["loss"]))
    return report


def print_measured(report: Dict) -> None:
    s = report["settings"]
    print(f"dp {s['dp']} x pp {s['pp']} 1F1B, {s['micro_batches']} micro-batches of one {s['budget']}-token row, width {s['n_embd']}, "
          f"{s['n_layer']} blocks {report['spans']}, vocabulary {s['vocab']}; attention share: "
          f"{report['attention_share']['full_row']:.2f} of a one-document row, "
          f"{report['attention_share']['document_rows']:.2f} of a document-packed row; loads {report['loads']}")
    for p, r in report["packings"].items():
        tps, st, sp = r["useful_tokens_per_cpu_s"], r["mean_step_s_per_round"], r["micro_batch_slowest_over_mean"]
        paired = r["document_step_over_this_paired"]
        print(f"{p:9s} useful tokens per CPU-s median {tps['median']:.0f} ({tps['min']:.0f}-{tps['max']:.0f}); "
              f"mean step {st['median']:.4f} s ({st['min']:.4f}-{st['max']:.4f}), simulator "
              f"{r['predicted_mean_step_s']:.4f} s (within: {r['predicted_within_round_spread']}; line "
              f"{r['predicted_mean_step_s_line']:.4f} s, within {r['line_within_round_spread']}; FLOP shares "
              f"{r['predicted_mean_step_s_flops_only']:.3f} s); slowest/mean micro-batch {sp['median']:.3f} "
              f"(p10 {sp['p10']:.3f}, p90 {sp['p90']:.3f}); document/this per step {paired['median']:.3f} "
              f"({paired['p10']:.3f}-{paired['p90']:.3f})")
    for p in ("min_max", "balanced"):
        x = report[f"{p}_over_document"]
        print(f"{p} / document useful tokens per CPU-s: median {x['measured']['median']:.3f}x "
              f"({x['measured']['min']:.3f}-{x['measured']['max']:.3f}), simulator {x['predicted']:.3f}x "
              f"(uncalibrated FLOP shares: {x['predicted_flops_only']:.3f}x)")
    print(f"ranking fastest first: measured {report['ranking']['measured']}, simulator "
          f"{report['ranking']['predicted']}; "
          f"dispatch {report['dispatch_seconds']['median'] * 1e3:.0f} ms median, max "
          f"{report['dispatch_seconds']['max'] * 1e3:.0f} ms; calibrated row shares "
          f"{[{k: round(v, 4) for k, v in x.items()} for x in report['row_shares']]}")
    same = report["same_documents"]
    print(f"same documents, same step: the step's loss differs by at most {same['loss_max_abs_difference']:.2g} "
          f"(per token {same['loss_mean'] / (s['micro_batches'] * s['dp']):.3f}), its gradient by {same['gradient_max_abs_difference']:.2g} "
          f"(largest entry {same['gradient_max_abs']:.2g})")
    if "loss_curves_max_abs_difference" in report:
        print(f"loss curves of document and balanced differ by at most {report['loss_curves_max_abs_difference']:.2g}")


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="data/code")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (data.seq_len)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per replica and step")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--time-budget", type=float, default=0.5, help="dispatch seconds per step")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-ratio", type=float, default=None,
                        help="attention of a one-document row over the row's linear work (default: GPT-2's FLOPs)")
    parser.add_argument("--varlen", dest="fixed_shapes", action="store_false",
                        help="cost only the documents' tokens (an unpadded varlen run), not fixed-shape micro-batches")
    parser.add_argument("--out", default=None, help="default bench/results/mixed_length[_measured].json")
    parser.add_argument("--measure", action="store_true", help="real pp-2 training runs of both packings")
    parser.add_argument("--rounds", type=int, default=4, help="--measure: interleaved rounds of CPU timing")
    parser.add_argument("--warmup", type=int, default=1, help="--measure: first steps left out (and of each run)")
    parser.add_argument("--train-rounds", type=int, default=0,
                        help="--measure: real pp training runs of document and balanced, for the loss curves")
    parser.add_argument("--dp", type=int, default=1,
                        help="--measure: data-parallel replicas, each its pipeline of --micro-batches (the step: "
                             "the slowest replica's; the gradient all-reduce, alike for every packing, left out)")
    parser.add_argument("--spans", default="", help="--measure: stage cuts, e.g. 3 for blocks 0-2 | 3-(n-1)")
    parser.add_argument("--n-head", type=int, default=4)
    args = parser.parse_args(argv)
    if args.measure:
        args.out = args.out or "bench/results/mixed_length_measured.json"
        report = measure(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print_measured(report)
        return report
    args.out = args.out or "bench/results/mixed_length.json"

    corpus = CodeCorpus.load(prepare_code_corpus(args.path, args.vocab, 2000, 0))
    if corpus.eot_id is None:
        raise SystemExit(f"mixed_length: the corpus at {args.path} has no end-of-text token to split documents at")
    documents = [predictions(d) for d in split_documents(corpus.train_tokens, corpus.eot_id)]
    stream = PackedDocuments(corpus.train_tokens, corpus.val_tokens, corpus.eot_id, args.budget, args.seed)
    linear, quadratic = gpt2_coefficients(args.n_embd, args.n_layer, args.vocab)
    if args.attention_ratio is not None:   # attention of a one-document row = this many times a row's linear work
        quadratic = args.attention_ratio * linear / args.budget
    report = {"corpus": {"path": args.path, "documents": len(documents), "document_tokens": quantiles(documents),
                         "longer_than_budget": sum(n > args.budget for n in documents)},
              "model": {"n_embd": args.n_embd, "n_layer": args.n_layer, "vocab": args.vocab,
                        "linear_flops_per_token": linear, "quadratic_flops_per_token_squared": quadratic,
                        "attention_equals_linear_at_tokens": linear / quadratic},
              "budget": args.budget, "steps": args.steps, "fixed_shapes": args.fixed_shapes,
              "time_budget_s": args.time_budget, "layouts": []}
    begin = time.perf_counter()
    for replicas in args.replicas:
        layout = run_layout(stream, replicas, args, linear, quadratic)
        report["layouts"].append(layout)
        speedup = layout["predicted_balanced_over_document_per_step"]
        print(f"dp {replicas} x pp {args.pp}, {args.micro_batches} micro-batches of {args.budget}: "
              f"slowest/mean micro-batch {layout['document']['max_over_mean']['median']:.2f} -> min-max "
              f"{layout['min_max']['max_over_mean']['median']:.2f}, balanced "
              f"{layout['balanced']['max_over_mean']['median']:.2f} (median); predicted useful tokens/s over "
              f"document: min-max {layout['predicted_min_max_over_document']:.3f}x, balanced "
              f"{layout['predicted_balanced_over_document']:.3f}x (per step p10 {speedup['p10']:.3f}, p90 "
              f"{speedup['p90']:.3f}; at most "
              f"{(layout['bound_over_document_per_step'] or {}).get('median', float('nan')):.3f}x "
              f"per step median for any dispatch); "
              f"dispatch {layout['dispatch_seconds']['median'] * 1e3:.0f} ms median, "
              f"max {layout['dispatch_seconds']['max'] * 1e3:.0f} ms, {layout['dispatch_methods']}")
    report["seconds"] = round(time.perf_counter() - begin, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"documents: {len(documents)}, tokens median {report['corpus']['document_tokens']['median']}, "
          f"max {report['corpus']['document_tokens']['max']}; written {args.out}")
    return report


if __name__ == "__main__":
    main()
