"""Mixed-length data (issue 37): the per-micro-batch cost spread of `document` packing (arrival order)
against `balanced` (cost-aware dispatch), on data=code's real document lengths.

    python bench/mixed_length.py [--budget 4096] [--micro-batches 8] [--pp 2] [--replicas 1 2]
                                 [--steps 40] [--time-budget 0.5] [--out bench/results/mixed_length.json]

Costs are predicted, not measured: a document of L tokens costs linear * L + quadratic * L**2 FLOPs
(forward and backward) of a GPT-2 of --n-embd / --n-layer / --vocab, the work of an attention kernel
that skips the masked blocks (see hrlplan/data/dispatch.py); with fixed shapes (the default, as torch
pipelining runs) every micro-batch pays the linear work of its whole budget, padding included
(--varlen: only the documents' tokens). For each step the same documents are
packed both ways; a replica's step is the proportionate flow shop of its pipeline,
(sum + (pp - 1) * slowest) / pp of its micro-batches, and the step waits on its slowest replica. The
useful tokens of a step are the same both ways, so the predicted speed-up is the ratio of step times.
`concat` (today's windows, attention across the whole budget) is given for reference.
The corpus is data/code, built locally by hrlplan/data/code_corpus.py when absent (no downloads).
"""
from __future__ import annotations

import argparse
import json
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


def quantiles(values: List[float]) -> Dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]  # noqa: E731
    return {"median": statistics.median(values), "p10": pick(0.1), "p90": pick(0.9), "min": values[0],
            "max": values[-1]}


def run_layout(stream: PackedDocuments, replicas: int, args, linear: float, quadratic: float) -> Dict:
    bins = D.replica_bins(args.micro_batches, [args.budget] * replicas, [1.0] * replicas)
    # what a micro-batch costs, as dispatch_bins models it (fixed shapes: padding's linear work too)
    costed = [replace(b, base_work=linear * b.capacity) for b in bins] if args.fixed_shapes else bins
    total = args.micro_batches * replicas
    rows = {"document": [], "balanced": []}
    seconds, methods, useful, ratios = [], Counter(), [], []
    for step in range(args.steps):
        pieces, arrival = stream.step_pieces(step, total)
        lengths = [predictions(p) for p in pieces]
        works = [D.document_cost(n, 0.0 if args.fixed_shapes else linear, quadratic) for n in lengths]
        result = D.dispatch_bins(lengths, bins, linear, quadratic, time_budget_s=args.time_budget,
                                 fallback=arrival, stages=args.pp, fixed_shapes=args.fixed_shapes)
        seconds.append(result.seconds)
        methods[result.method] += 1
        useful.append(sum(lengths))
        for name, assignment in (("document", arrival), ("balanced", result.assignment)):
            times = D.bin_times(assignment, works, costed)
            rows[name].append({"step": D.step_time(assignment, works, costed, args.pp), "slowest": max(times),
                               **spread(times)})
        ratios.append(rows["document"][-1]["step"] / rows["balanced"][-1]["step"])
    concat_step = (total / replicas + args.pp - 1) / args.pp * D.document_cost(args.budget, linear, quadratic)
    out = {"replicas": replicas, "micro_batches_per_replica": args.micro_batches, "pp": args.pp,
           "useful_tokens_per_step": quantiles(useful), "budget_fill": statistics.fmean(useful) / (total * args.budget),
           "predicted_speedup_balanced_over_document": quantiles(ratios),
           "dispatch_seconds": quantiles(seconds), "dispatch_methods": dict(methods)}
    for name, values in rows.items():
        out[name] = {key: quantiles([v[key] for v in values]) for key in values[0]}
        out[name]["useful_tokens_per_gflop_step"] = statistics.fmean(useful) / statistics.fmean(
            v["step"] for v in values) * 1e9
    out["concat_useful_tokens_per_gflop_step"] = total * args.budget / concat_step * 1e9
    return out


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
    parser.add_argument("--varlen", dest="fixed_shapes", action="store_false",
                        help="cost only the documents' tokens (an unpadded varlen run), not fixed-shape micro-batches")
    parser.add_argument("--out", default="bench/results/mixed_length.json")
    args = parser.parse_args(argv)

    corpus = CodeCorpus.load(prepare_code_corpus(args.path, args.vocab, 2000, 0))
    if corpus.eot_id is None:
        raise SystemExit(f"mixed_length: the corpus at {args.path} has no end-of-text token to split documents at")
    documents = [predictions(d) for d in split_documents(corpus.train_tokens, corpus.eot_id)]
    stream = PackedDocuments(corpus.train_tokens, corpus.val_tokens, corpus.eot_id, args.budget, args.seed)
    linear, quadratic = gpt2_coefficients(args.n_embd, args.n_layer, args.vocab)
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
        speedup = layout["predicted_speedup_balanced_over_document"]
        print(f"dp {replicas} x pp {args.pp}, {args.micro_batches} micro-batches of {args.budget}: "
              f"slowest/mean micro-batch {layout['document']['max_over_mean']['median']:.2f} -> "
              f"{layout['balanced']['max_over_mean']['median']:.2f} (median), predicted step speed-up "
              f"{speedup['median']:.3f}x (p10 {speedup['p10']:.3f}, p90 {speedup['p90']:.3f}); "
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
