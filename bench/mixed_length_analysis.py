"""bench/mixed_length.py --measure's analysis: the calibration line fitted on the timed calibration rows,
the simulator's prediction of each packing's steps from it, and the report (bench/mixed_length_reanalyse.py
re-runs it on a saved report).

A row's attention is the per-document attention kernel's timed curve summed over its documents
(hrlplan/cost/attention_curve.py; runtime/calibrate/attention_curve.py times it) where the report has
one, else the sum of squared lengths (reports measured before round 7).
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Dict, List

import mixed_length_measure as M  # noqa: E402 (bench/, beside this file)
from mixed_length_measure import Row, step_rows  # noqa: E402

quantiles = M.quantiles


class RowAttention:
    """A row's attention in the line's measure, per kind ("F", "B" and "FB", the two together): the
    timed per-document kernel summed over its documents (curve), or -- without a curve, or for a row
    whose lengths are unknown (a report from before round 7) -- its sum of squared lengths."""

    def __init__(self, curve, budget: int):
        self.curve, self.budget = curve, budget

    def of(self, row: Row, kind: str) -> float:
        if self.curve is None:
            return float(row.squares)
        if row.lengths is None:
            raise ValueError("a timed attention curve needs each row's document lengths")
        return sum(self.curve.row_seconds(row.lengths, k) for k in (("F", "B") if kind == "FB" else (kind,)))

    def unit(self, kind: str) -> float:
        """The one-document row's (a document filling the budget)."""
        return self.of(Row(1, self.budget, float(self.budget) ** 2, (self.budget,)), kind)


def squares_fit(times: List[float], squares: List[float], docs: List[float]) -> Dict[str, float]:
    """time = fixed + per_square * (sum of squared lengths) + per_document * (documents), least squares."""
    import numpy as np

    x = np.column_stack([np.ones(len(times)), np.asarray(squares, float), np.asarray(docs, float)])
    coef, *_ = np.linalg.lstsq(x, np.asarray(times, float), rcond=None)
    residual = np.asarray(times) - x @ coef
    return {"fixed_s": float(coef[0]), "per_square_s": float(coef[1]), "per_document_s": float(coef[2]),
            "rms_residual_s": float(np.sqrt(np.mean(residual ** 2)))}


def calibrate(args, calibration: List[Row], passes: List[List[Dict]], attention: RowAttention):
    """From the calibration rows (median over the passes), per stage and kind (forward, backward, and
    the two together) the least-squares line time = fixed + per_square * S + per_document * n +
    per_useful * U (the per-document term left out where it comes out negative: it then only absorbs
    noise); its value at the one-document row is the fixed-length micro-batch (`full`), and its
    RowShares are the terms' shares of that value, so the prediction of a row is the fitted line's.
    (Normalising by the timed one-document row instead put that row's own timing noise, a few ms,
    into every row's fixed work: the steps came out 2-6% off.) Returns full ({F, B}: per stage), the
    RowShares of F + B per stage, the fits, and the RowShares per kind ({"F": [...], "B": [...]}).
    S is the row's attention in `attention`'s measure (RowAttention: the timed kernel's seconds, its
    coefficient then about the stage's block count; or the squared lengths); calibration: Rows."""
    import numpy as np

    from hrlplan.cost.lengths import RowShares

    # a pass timed between a round's steps leaves rows out (None) where the round has fewer steps than the
    # calibration; a row no pass timed is left out of the fit
    timed = [i for i in range(len(calibration)) if any(c[i] is not None for c in passes)]
    med = [{kind: [statistics.median(c[i][kind][k][0] for c in passes if c[i] is not None) for k in range(args.pp)]
            for kind in ("F", "B")} for i in timed]
    xs = {kind: np.array([[1.0, attention.of(r, kind), r.documents, r.useful] for r in (calibration[i] for i in timed)],
                         dtype=float) for kind in ("F", "B", "FB")}

    def fitted(times, kind):
        x, unit = xs[kind], attention.unit(kind)
        at_one = np.array([1.0, unit, 1.0, float(args.budget)])
        coef, *_ = np.linalg.lstsq(x, times, rcond=None)
        if coef[2] < 0:
            kept = [0, 1, 3]
            part, *_ = np.linalg.lstsq(x[:, kept], times, rcond=None)
            coef = np.zeros(4)
            coef[kept] = part
        one = float(coef @ at_one)
        shares = RowShares(attention=float(coef[1]) * unit / one, per_document=float(coef[2]) / one,
                           useful=float(coef[3]) * args.budget / one)
        return one, shares, {"fixed_s": float(coef[0]), "per_attention": float(coef[1]), "per_document_s": float(coef[2]),
                             "per_useful_token_s": float(coef[3]), "one_document_row_s": one,
                             "one_document_row_timed_s": float(times[0]), "rows_s": times.tolist(),
                             "rms_residual_s": float(np.sqrt(np.mean((times - x @ coef) ** 2)))}

    full: Dict[str, List[float]] = {"F": [], "B": []}
    shares, fits, per_kind = [], [], {"F": [], "B": []}
    for k in range(args.pp):
        for kind in ("F", "B"):
            one, kind_shares, _ = fitted(np.array([m[kind][k] for m in med]), kind)
            full[kind].append(one)
            per_kind[kind].append(kind_shares)
        _, together, fit = fitted(np.array([m["F"][k] + m["B"][k] for m in med]), "FB")
        shares.append(together)
        fits.append(fit)
    return full, shares, fits, per_kind


def slowest_replica(args, table) -> float:
    """A step's measured time: each replica's micro-batches (replica-major) walked through 1F1B, the slowest."""
    from hrlplan.cost.lengths import pipeline_step

    m = args.micro_batches
    return max(pipeline_step("1f1b", args.pp, [row[r * m:(r + 1) * m] for row in table["F"]],
                             [row[r * m:(r + 1) * m] for row in table["B"]]) for r in range(args.dp))


def line_rows(args, meta, spans, per_kind, rows: List[Row], attention: RowAttention) -> Dict[str, List[List[float]]]:
    """{F, B}: [stage][row] the calibrated line's work multipliers of these rows (times full[kind][stage]:
    their predicted seconds)."""
    from hrlplan.cost.lengths import micro_batch_multipliers

    return {kind: micro_batch_multipliers(meta, spans, args.budget, [attention.of(r, kind) for r in rows],
                                          [r.documents for r in rows], [r.useful for r in rows], per_kind[kind],
                                          attention_unit=attention.unit(kind))
            for kind in ("F", "B")}


def row_spread(args, meta, spans, calibration: List[Row], passes, full, per_kind, attention: RowAttention):
    """How each calibration row timed once (every pass between the rounds' steps) strays from the
    calibrated line (cost/lengths.RowSpread): what a step's rows, each timed once, do too."""
    from hrlplan.cost.lengths import RowSpread

    work = line_rows(args, meta, spans, per_kind, calibration, attention)
    timed: Dict[str, List[List[float]]] = {"F": [], "B": []}
    predicted: Dict[str, List[List[float]]] = {"F": [], "B": []}
    for kind in ("F", "B"):
        for k in range(args.pp):
            rows = [(row[kind][k][0], full[kind][k] * work[kind][k][i])
                    for one_pass in passes for i, row in enumerate(one_pass) if row is not None]
            timed[kind].append([t for t, _ in rows])
            predicted[kind].append([p for _, p in rows])
    return RowSpread.from_timings(timed, predicted)


def simulated(args, meta, spans, full, shares, per_kind, rows: Dict[str, List[List[Row]]], attention: RowAttention,
               spread=None, draws=200):
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

    def over(row_shares, measure: RowAttention):
        kind = "FB"
        return {p: [step_of_work(micro_batch_multipliers(
            meta, spans, args.budget, [measure.of(r, kind) for r in step], [r.documents for r in step],
            [r.useful for r in step], row_shares, attention_unit=measure.unit(kind)), None)
            for step in rows[p]] for p in M.PACKINGS}

    by_kind = {p: [line_rows(args, meta, spans, per_kind, step, attention) for step in rows[p]] for p in M.PACKINGS}
    line = {p: [step_of_work(w["F"], w["B"]) for w in by_kind[p]] for p in M.PACKINGS}
    predicted = line if spread is None else {
        p: [expected_step(step_of_work, w["F"], w["B"], spread, full, draws=draws, seed=i) for i, w in enumerate(by_kind[p])]
        for p in M.PACKINGS}
    return predicted, line, over(shares, attention), over(None, RowAttention(None, args.budget))


def analyse(args, prepared: Dict, timing: Dict, meta, spans) -> Dict:
    """The report of a measured run: timing["calibration_rows"] are Rows, timing["attention_curve"] the
    timed kernel (or None: the squared lengths)."""
    P = M.PACKINGS
    timed = timing["timed_steps"]
    useful = [sum(prepared["lengths"][s]) for s in timed]
    rows = {p: [step_rows(prepared["lengths"][s], prepared["assignments"][p][s]) for s in timed] for p in P}
    squares = {p: [[r.squares for r in step] for step in rows[p]] for p in P}
    docs = {p: [[r.documents for r in step] for step in rows[p]] for p in P}
    attention = RowAttention(timing.get("attention_curve"), args.budget)
    per_round, steps_measured, spreads, paired = [], {p: [] for p in P}, {p: [] for p in P}, {p: [] for p in P}
    for rnd in timing["rounds"]:
        steps = {p: [slowest_replica(args, t) for t in rnd["tables"][p]] for p in P}
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
    passes = [p for r in timing["rounds"] for p in r["calibration"]]
    full, shares, calibration, per_kind = calibrate(args, timing["calibration_rows"], passes, attention)
    tokens = {p: [[r.useful for r in step] for step in rows[p]] for p in P}
    spread = row_spread(args, meta, spans, timing["calibration_rows"], passes, full, per_kind, attention)
    predicted, line, one_table, flops_only = simulated(args, meta, spans, full, shares, per_kind, rows, attention,
                                                        spread)
    rows_t, rows_sq, rows_docs = [], [], []
    for rnd in timing["rounds"]:
        for p in P:
            for i, t in enumerate(rnd["tables"][p]):
                for j in range(args.micro_batches * args.dp):
                    rows_t.append(sum(t[kind][k][j] for kind in ("F", "B") for k in range(args.pp)))
                    rows_sq.append(squares[p][i][j])
                    rows_docs.append(docs[p][i][j])
    fit = squares_fit(rows_t, rows_sq, rows_docs)
    full_row_s = sum(full["F"]) + sum(full["B"])
    report = {"settings": dict(vars(args)), "spans": spans, "timed_steps": timed, "useful_tokens_per_step": useful,
              "square_sums": squares, "documents_per_micro_batch": docs, "useful_tokens_per_micro_batch": tokens,
              "row_lengths": {p: [[list(r.lengths) for r in step] for step in rows[p]] for p in P},
              "attention_curve": attention.curve.to_dict() if attention.curve is not None else None,
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


