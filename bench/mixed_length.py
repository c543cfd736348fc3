"""Mixed-length data (issue 37): `document` packing (arrival order) against `balanced` (cost-aware
dispatch) on data=code's real document lengths.

    python bench/mixed_length.py --measure [--budget 4096] [--micro-batches 2] [--rounds 10] [--steps 8]

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

import mixed_length_analysis as A  # noqa: E402 (bench/, beside this file)
import mixed_length_measure as M  # noqa: E402


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


def measure(args) -> Dict:
    import tempfile

    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.model_meta import introspect
    from hrlplan.models.hf import build_stage_modules
    from hrlplan.runtime.calibrate.attention_curve import measure_attention_curve
    from hrlplan.runtime.trainer import build_full_model

    reused = M.reuse_freed_memory()
    corpus = CodeCorpus.load(prepare_code_corpus(args.path, args.vocab, 2000, 0))
    documents = PackedDocuments(corpus.train_tokens, corpus.val_tokens, corpus.eot_id, args.budget, args.seed)
    cfg = as_config(compose(M.overrides(args)))
    meta = introspect(cfg.arch, args.budget)
    spans = M.spans_of(args)
    stages = build_stage_modules(build_full_model(cfg.arch, args.seed), spans)
    calibration = M.calibration_rows(args, corpus.eot_id, documents)
    rows = [row for row, _ in calibration]
    # 3 passes (about 15 s each at 6 held-out steps): they only feed the dispatch (the prediction fits the
    # passes timed between the rounds' steps); a pass's rows vary by a few percent, the fit of their medians far less.
    # The dispatch balances the squared lengths (data/dispatch.py's model), so its line is fitted on them.
    before = [M.time_calibration(stages, calibration, M.step_rows_per_call(args)) for _ in range(3)]
    full, shares, _, _ = A.calibrate(args, rows, before, A.RowAttention(None, args.budget))
    prepared = M.step_batches(args, documents, meta, spans, {"full": full, "shares": shares})
    # the per-document attention kernel as the stages call it (heads, head width, one thread): the prediction's
    # attention measure (hrlplan/cost/attention_curve.py)
    curve = measure_attention_curve(args.n_head, args.n_embd // args.n_head, args.budget)
    timing = M.timed_rounds(args, prepared["batches"], stages, calibration)
    timing["before"], timing["calibration_rows"], timing["attention_curve"] = before, rows, curve
    report = A.analyse(args, prepared, timing, meta, spans)
    report["micro_batch_times_s"] = [r["tables"] for r in timing["rounds"]]
    # the raw calibration passes (timed between the rounds' steps, the last of a round partial; those before the rounds, which
    # fed the dispatch) and their rows, to re-fit offline
    report["freed_memory_reused"] = reused
    report["calibration_passes"] = [p for r in timing["rounds"] for p in r["calibration"]]
    report["calibration_passes_before"] = timing["before"]
    report["calibration_rows"] = [[r.documents, r.useful, r.squares, list(r.lengths)] for r in rows]
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
    parser.add_argument("--rounds", type=int, default=10, help="--measure: interleaved rounds of CPU timing "
                        "(ten: an exact prediction falls outside the min-max of n rounds with probability 2^(1-n))")
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
