"""The simulator's prediction of a saved `bench/mixed_length.py --measure` report, re-fitted from its raw
calibration passes (for reports measured before a change of the fit):

    python bench/mixed_length_reanalyse.py REPORT.json [--passes between|before|all]

between (default): the passes timed between the rounds' steps, as the bench now fits; before: the
passes timed before the rounds (which fed the dispatch); all: both. Prints per packing the predicted
mean step (the rows straying as the chosen passes' rows of like size do: cost/lengths.expected_step) against the
measured one (median of rounds, min-max; "in" where inside), the deterministic line's, and the
predicted balanced / document.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mixed_length_analysis as A  # noqa: E402
import mixed_length_measure as M  # noqa: E402
from hrlplan.cost.attention_curve import AttentionCurve  # noqa: E402


def reanalyse(path: str, which: str = "between", squares: bool = False) -> dict:
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.model_meta import introspect

    report = json.loads(Path(path).read_text())
    args = argparse.Namespace(**report["settings"])
    curve = AttentionCurve.from_dict(report["attention_curve"]) if report.get("attention_curve") and not squares else None
    calibration = [M.Row(c[0], c[1], c[2], tuple(c[3]) if len(c) > 3 else None) for c in report["calibration_rows"]]
    passes = {"between": report["calibration_passes"], "before": report["calibration_passes_before"],
              "all": report["calibration_passes_before"] + report["calibration_passes"]}[which]
    attention = A.RowAttention(curve, args.budget)
    full, shares, _, per_kind = A.calibrate(args, calibration, passes, attention)
    meta = introspect(as_config(compose(M.overrides(args))).arch, args.budget)
    spread = A.row_spread(args, meta, report["spans"], calibration, passes, full, per_kind, attention)
    lengths = report.get("row_lengths") or {}
    rows = {p: [[M.Row(n, u, sq, tuple(lengths[p][s][j]) if lengths else None)
                 for j, (n, u, sq) in enumerate(zip(*x))]
                for s, x in enumerate(zip(report["documents_per_micro_batch"][p], report["useful_tokens_per_micro_batch"][p],
                                          report["square_sums"][p]))] for p in M.PACKINGS}
    predicted, line, _, _ = A.simulated(args, meta, report["spans"], full, shares, per_kind, rows, attention, spread)
    out = {"passes": which, "attention": "squares" if curve is None else "timed kernel", "packings": {}}
    for p in M.PACKINGS:
        measured = report["packings"][p]["mean_step_s_per_round"]
        mean = statistics.fmean(predicted[p])
        out["packings"][p] = {"predicted_mean_step_s": mean, "measured": measured,
                              "line_mean_step_s": statistics.fmean(line[p]),
                              "predicted_over_measured": mean / measured["median"],
                              "within": measured["min"] <= mean <= measured["max"]}
    out["predicted_balanced_over_document"] = sum(predicted["document"]) / sum(predicted["balanced"])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--passes", choices=("between", "before", "all"), default="between")
    parser.add_argument("--squares", action="store_true", help="the squared lengths as the rows' attention, "
                        "even where the report has a timed kernel curve (reports before round 7 have none)")
    args = parser.parse_args(argv)
    out = reanalyse(args.report, args.passes, args.squares)
    parts = []
    for p, x in out["packings"].items():
        m = x["measured"]
        parts.append(f"{p} {x['predicted_mean_step_s']:.3f} s vs {m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f}), "
                     f"{x['predicted_over_measured']:.4f}x{' in' if x['within'] else ''} (line "
                     f"{x['line_mean_step_s'] / m['median']:.4f}x)")
    print(f"{Path(args.report).name} ({args.passes} passes, {out['attention']}): " + "; ".join(parts)
          + f"; predicted balanced / document {out['predicted_balanced_over_document']:.3f}x")
    return out


if __name__ == "__main__":
    main()
