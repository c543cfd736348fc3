"""Mixed-length data (issue 37): `document` packing (arrival order) against `balanced` (cost-aware
dispatch) on data=code's real document lengths.

    python bench/mixed_length.py --measure [--budget 4096] [--micro-batches 2] [--rounds 4] [--steps 8]

--measure: real pp-2 training runs (torch pipelining, gloo, this machine's CPU workers) of both packings
in interleaved rounds: useful (non-pad) tokens per second, the loss curves, the per-micro-batch
forward+backward times of the same steps before and after balancing, and the cost model's predicted
step per packing (hrlplan/cost/lengths.py) beside the measured one. Without --measure:

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


# ---------------------------------------------------------------- measured (--measure)
PACKINGS = ("document", "balanced")


def _overrides(args) -> List[str]:
    return ["arch=gpt2-tiny", f"arch.n_layer={args.n_layer}", f"arch.n_embd={args.n_embd}",
            f"arch.n_head={args.n_head}",
            f"arch.vocab_size={args.vocab}", f"arch.n_positions={args.budget}", "data=code", f"data.path={args.path}",
            f"data.seq_len={args.budget}", f"train.steps={args.steps}", f"train.global_batch_size={args.micro_batches}",
            "train.schedule=1f1b", "train.checkpoint_interval=0", "train.measure_memory=false", "logger.mode=disabled",
            f"train.seed={args.seed}"]


def _spans(n_layer: int, pp: int):
    cuts = [round(i * n_layer / pp) for i in range(pp + 1)]
    return list(zip(cuts, cuts[1:]))


def _training_runs(args, workdir: Path) -> Dict:
    """Interleaved rounds (the order flips each round): per packing, per run, the step times, losses
    and the machine's load around it. --with-concat: today's windows too, last in each round."""
    from hrlplan.compose import compose
    from hrlplan.launch.local_run import train_plan
    from hrlplan.plan import homogeneous_plan

    plan = homogeneous_plan("gpt2-tiny", args.n_layer, _spans(args.n_layer, args.pp), dp=1, tp=1, microbatch_size=1,
                            num_microbatches=args.micro_batches, schedule="1f1b")
    extra = ("concat",) if args.with_concat else ()
    runs: Dict[str, List[Dict]] = {p: [] for p in PACKINGS + extra}
    for r in range(args.rounds):
        for packing in (PACKINGS if r % 2 == 0 else PACKINGS[::-1]) + extra:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            summary = train_plan(plan, compose(_overrides(args) + [f"data.packing={packing}"]),
                                 workdir / f"round{r}-{packing}", metrics_file=False)
            history = summary["history"]
            runs[packing].append({"round": r, "step_time_s": [h["train/step_time_s"] for h in history],
                                  "loss": [h["train/lm_loss"] for h in history], "load_before": load,
                                  "load_after": os.getloadavg()[0], "wall_s": time.perf_counter() - t0,
                                  # the last training step's per-(stage, micro-batch) operations, every rank
                                  "events": [{k: e[k] for k in ("stage", "microbatch", "kind", "start_s", "end_s")}
                                             for e in (summary.get("measured") or {}).get("events", [])]})
            print(f"round {r} {packing}: step median "
                  f"{statistics.median(runs[packing][-1]['step_time_s'][args.warmup:]):.3f} s, load {load:.1f}",
                  flush=True)
    return runs


def _micro_batch_times(args, streams: Dict, steps: List[int]) -> Dict[str, Dict[str, List[List[List[float]]]]]:
    """Per packing, kind (F, B), step: [stage][micro-batch] CPU seconds of this thread (one thread, so
    the machine's other load hardly moves them), each stage run apart as the pipeline runs it; the best
    of --repeats."""
    import torch

    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.models.hf import build_stage_modules, causal_lm_loss
    from hrlplan.runtime.trainer import build_full_model

    torch.set_num_threads(1)
    cfg = as_config(compose(_overrides(args)))
    model = build_full_model(cfg.arch, args.seed)
    stages = build_stage_modules(model, _spans(args.n_layer, args.pp))
    clock = time.thread_time
    out = {p: {"F": [], "B": []} for p in PACKINGS}
    for step in steps:
        for packing in PACKINGS:
            inputs, targets = streams[packing].batch(step, args.micro_batches)
            best = {kind: [[float("inf")] * args.micro_batches for _ in stages] for kind in ("F", "B")}
            for _ in range(args.repeats):
                for j in range(args.micro_batches):
                    carried, received = (inputs[j:j + 1],), []
                    for k, stage in enumerate(stages):
                        t0 = clock()
                        out_k = stage(*carried)
                        if k == len(stages) - 1:
                            out_k = causal_lm_loss(out_k, targets[j:j + 1])
                        best["F"][k][j] = min(best["F"][k][j], clock() - t0)
                        received.append(out_k)
                        if k < len(stages) - 1:
                            h = out_k[0].detach().requires_grad_(True)
                            carried = (h, out_k[1])
                            received[-1] = (out_k[0], h)
                    grad = None
                    for k in reversed(range(len(stages))):
                        t0 = clock()
                        if k == len(stages) - 1:
                            received[k].backward()
                        else:
                            received[k][0].backward(grad)
                        best["B"][k][j] = min(best["B"][k][j], clock() - t0)
                        grad = received[k - 1][1].grad if k > 0 else None
            model.zero_grad(set_to_none=True)
            for kind in ("F", "B"):
                out[packing][kind].append(best[kind])
    return out


def _fit_row_cost(times: List[float], squares: List[float]):
    """time = fixed + per_square * (sum of squared lengths), least squares over every measured row."""
    n = len(times)
    mx, my = sum(squares) / n, sum(times) / n
    var = sum((x - mx) ** 2 for x in squares)
    slope = sum((x - mx) * (y - my) for x, y in zip(squares, times)) / var if var else 0.0
    return my - slope * mx, slope


def _stage_fits(args, rows: Dict, squares: Dict, timed_steps: List[int]) -> Dict[str, List[tuple]]:
    """Per kind (F, B) and stage: CPU seconds = fixed + per_square * (its micro-batch's sum of squared
    document lengths), fitted on the timed micro-batches of both packings."""
    fits: Dict[str, List[tuple]] = {}
    for kind in ("F", "B"):
        fits[kind] = []
        for k in range(args.pp):
            times, sq = [], []
            for p in PACKINGS:
                for i, step in enumerate(timed_steps):
                    times += rows[p][kind][i][k]
                    sq += squares[p][step]
            fits[kind].append(_fit_row_cost(times, sq))
    return fits


def _measured_compute_steps(args, rows: Dict) -> Dict[str, List[float]]:
    """Per packing, per timed step: its measured per-(stage, micro-batch) CPU times walked through 1F1B."""
    from hrlplan.cost.lengths import pipeline_step

    return {p: [pipeline_step("1f1b", args.pp, f, b) for f, b in zip(rows[p]["F"], rows[p]["B"])] for p in PACKINGS}


def _predicted_steps(args, meta, fits, squares: List[List[int]]) -> Dict[str, List[float]]:
    """Per sampled step: `fitted`, the per-(stage, micro-batch) durations of the fits walked through
    1F1B (cost/lengths.pipeline_step); `planner`, the fixed-length micro-batch's fitted per-stage time
    scaled by the planner's FLOP counts (cost/lengths.micro_batch_multipliers), as the simulator
    would cost it given the multipliers."""
    from hrlplan.cost.lengths import micro_batch_multipliers, pipeline_step, scaled

    full = args.budget ** 2
    fixed_length = {kind: [a + b * full for a, b in fits[kind]] for kind in fits}
    out: Dict[str, List[float]] = {"fitted": [], "planner": []}
    for sq in squares:
        per = {kind: [[a + b * s for s in sq] for a, b in fits[kind]] for kind in fits}
        out["fitted"].append(pipeline_step("1f1b", args.pp, per["F"], per["B"]))
        mult = micro_batch_multipliers(meta, _spans(args.n_layer, args.pp), args.budget, sq)
        out["planner"].append(pipeline_step("1f1b", args.pp, scaled(fixed_length["F"], mult),
                                            scaled(fixed_length["B"], mult)))
    return out


def measure(args) -> Dict:
    import tempfile

    from hrlplan.data.packed_stream import build_packed_stream
    from hrlplan.model_meta import introspect
    from hrlplan.compose import compose
    from hrlplan.config import as_config

    corpus = CodeCorpus.load(prepare_code_corpus(args.path, args.vocab, 2000, 0))
    streams = {p: build_packed_stream(p, corpus.train_tokens, corpus.val_tokens, corpus.eot_id, args.budget,
                                      args.seed) for p in PACKINGS}
    steps = list(range(args.steps))
    useful, squares = [], {p: [] for p in PACKINGS}
    for step in steps:
        pieces, _ = streams["document"].documents.step_pieces(step, args.micro_batches)
        useful.append(sum(predictions(x) for x in pieces))
        for p in PACKINGS:
            inputs, _ = streams[p].batch(step, args.micro_batches)
            lengths = document_lengths_of(inputs)
            squares[p].append([sum(n * n for n in row) for row in lengths])
    with tempfile.TemporaryDirectory(prefix="mixed_length_") as workdir:
        runs = _training_runs(args, Path(workdir))
    timed_steps = steps[args.warmup:args.warmup + args.timed_steps]
    rows = _micro_batch_times(args, streams, timed_steps)
    fits = _stage_fits(args, rows, squares, timed_steps)
    whole = {p: [[sum(rows[p][kind][i][k][j] for kind in ("F", "B") for k in range(args.pp))
                  for j in range(args.micro_batches)] for i in range(len(timed_steps))] for p in PACKINGS}
    fixed, per_square = _fit_row_cost([t for p in PACKINGS for step in whole[p] for t in step],
                                      [s for p in PACKINGS for step in timed_steps for s in squares[p][step]])
    compute_steps = _measured_compute_steps(args, rows)
    meta = introspect(as_config(compose(_overrides(args))).arch, args.budget)
    report = {"settings": {k: v for k, v in vars(args).items()}, "useful_tokens_per_step": useful,
              "square_sums": squares, "runs": runs, "micro_batch_times_s": rows, "timed_steps": timed_steps,
              "stage_fits_s": fits,
              "row_cost_fit": {"fixed_s": fixed, "per_square_token_s": per_square,
                               "attention_share_of_a_full_row": per_square * args.budget ** 2 /
                               (fixed + per_square * args.budget ** 2)},
              "packings": {}}
    for p in PACKINGS:
        tps_rounds, step_all = [], []
        for run in runs[p]:
            times = run["step_time_s"][args.warmup:]
            step_all += times
            tps_rounds.append(statistics.median(u / t for u, t in zip(useful[args.warmup:], times)))
        predicted = _predicted_steps(args, meta, fits, squares[p][args.warmup:])
        spreads = [max(t) / statistics.fmean(t) for t in whole[p]]
        report["packings"][p] = {
            "useful_tokens_per_s_per_round": tps_rounds, "useful_tokens_per_s": quantiles(tps_rounds),
            "step_time_s": quantiles(step_all), "predicted_step_time_s": quantiles(predicted["fitted"]),
            "predicted_step_time_s_planner_flops": quantiles(predicted["planner"]),
            "pipeline_micro_batch_slowest_over_mean": quantiles(_pipeline_spreads(runs[p])),
            "measured_compute_step_s": quantiles(compute_steps[p]),
            "micro_batch_slowest_over_mean": quantiles(spreads),
            "loss_curves": [run["loss"] for run in runs[p]]}
    doc, bal = report["packings"]["document"], report["packings"]["balanced"]
    ratios = [b / d for b, d in zip(bal["useful_tokens_per_s_per_round"], doc["useful_tokens_per_s_per_round"])]
    report["balanced_over_document"] = {"measured_per_round": ratios, "measured": quantiles(ratios),
                                        "measured_compute_per_step": [d / b for d, b in zip(
                                            compute_steps["document"], compute_steps["balanced"])],
                                        "predicted": doc["predicted_step_time_s"]["median"] /
                                        bal["predicted_step_time_s"]["median"]}
    if "concat" in runs:   # every position is a useful token; attention over the whole budget
        concat_tps = [statistics.median(args.micro_batches * args.budget / t for t in run["step_time_s"][args.warmup:])
                      for run in runs["concat"]]
        report["concat"] = {"useful_tokens_per_s": quantiles(concat_tps),
                            "step_time_s": quantiles([t for run in runs["concat"]
                                                      for t in run["step_time_s"][args.warmup:]])}
        report["document_over_concat"] = quantiles([d / c for d, c in zip(doc["useful_tokens_per_s_per_round"],
                                                                           concat_tps)])
    report["loss_curves_max_abs_difference"] = max(abs(a - b) for x, y in zip(doc["loss_curves"], bal["loss_curves"])
                                                   for a, b in zip(x, y))
    return report


def _pipeline_spreads(runs: List[Dict]) -> List[float]:
    """Per run, its last step's slowest over mean micro-batch compute (F + B summed over the stages)."""
    out = []
    for run in runs:
        per: Dict[int, float] = {}
        for e in run["events"]:
            per[e["microbatch"]] = per.get(e["microbatch"], 0.0) + e["end_s"] - e["start_s"]
        if per:
            out.append(max(per.values()) / statistics.fmean(per.values()))
    return out or [float("nan")]


def document_lengths_of(inputs) -> List[List[int]]:
    from hrlplan.data.packing import document_lengths

    return document_lengths(inputs[:, 2])


def print_measured(report: Dict) -> None:
    for p, r in report["packings"].items():
        tps, st, pr = r["useful_tokens_per_s"], r["step_time_s"], r["predicted_step_time_s"]
        print(f"{p:9s} useful tokens/s median {tps['median']:.0f} (min {tps['min']:.0f}, max {tps['max']:.0f}); "
              f"step {st['median']:.3f} s (p10 {st['p10']:.3f}, p90 {st['p90']:.3f}), predicted {pr['median']:.3f} s "
              f"(planner FLOPs {r['predicted_step_time_s_planner_flops']['median']:.3f}); slowest/mean micro-batch "
              f"{r['micro_batch_slowest_over_mean']['median']:.3f} alone, "
              f"{r['pipeline_micro_batch_slowest_over_mean']['median']:.3f} in the pipeline")
    ratio = report["balanced_over_document"]
    paired = ratio["measured_compute_per_step"]
    print(f"balanced / document from measured per-micro-batch CPU times through 1F1B (same steps, paired): median "
          f"{statistics.median(paired):.3f}x (min {min(paired):.3f}, max {max(paired):.3f})")
    print(f"balanced / document: measured {ratio['measured']['median']:.3f}x (per round "
          f"{', '.join(f'{x:.3f}' for x in ratio['measured_per_round'])}), predicted {ratio['predicted']:.3f}x; "
          f"attention share of a full row {report['row_cost_fit']['attention_share_of_a_full_row']:.2f}; "
          f"loss curves differ by at most {report['loss_curves_max_abs_difference']:.2g}")
    if "concat" in report:
        print(f"concat    useful tokens/s median {report['concat']['useful_tokens_per_s']['median']:.0f}; document / "
              f"concat {report['document_over_concat']['median']:.3f}x")


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
    parser.add_argument("--out", default=None, help="default bench/results/mixed_length[_measured].json")
    parser.add_argument("--measure", action="store_true", help="real pp-2 training runs of both packings")
    parser.add_argument("--rounds", type=int, default=4, help="--measure: interleaved rounds")
    parser.add_argument("--warmup", type=int, default=2, help="--measure: first steps of a run left out")
    parser.add_argument("--timed-steps", type=int, default=4, help="--measure: steps whose micro-batches are timed")
    parser.add_argument("--repeats", type=int, default=2, help="--measure: best of this many per micro-batch")
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--with-concat", action="store_true", help="--measure: today's concat windows too")
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
