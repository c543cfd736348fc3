"""bench/mixed_length.py --measure: `document` against the pipeline-aware `balanced` on data=code, measured.

For each step the same pieces are packed three ways:

- `document`: arrival order (next fit), as data.packing=document trains;
- `min_max`: the dispatch's slowest-micro-batch objective (greedy, then HiGHS), the previous `balanced`;
- `balanced`: min-max refined for the pipeline's simulated step (dispatch_bins(step_of=...): the order
  of the micro-batches and the pieces in them), the step costed by the simulator's timeline over the
  calibrated stages (cost/lengths.dispatch_model, micro_batch_multipliers).

What is timed: every (stage, micro-batch) forward and backward of the real pipeline stages (HFStage,
per-document attention), run apart on one thread and timed in that thread's CPU time, so the other
tenants of a shared machine hardly move it; the packings interleaved within each round (their order
flipping round to round). A step's time is those measured durations walked through 1F1B
(cost/lengths.pipeline_step): what a pipeline of `pp` ranks, each with its own core, takes. The
simulator's prediction: the fixed-length micro-batch's per-stage forward and backward, timed the same
way (one document filling a row: what the planner costs), through the simulator's timeline with each
micro-batch's work multipliers (cost/lengths.micro_batch_multipliers; simulate_timeline's
micro_batch_work), averaged over draws in which each row strays from that line as the calibration's
rows of like size, timed once, do (cost/lengths.RowSpread, expected_step: a step is a maximum over
paths, so straying rows lengthen it on average). Optional real training runs (--train-rounds) give the loss curves of `document`
and the trainer's `balanced` (data.packing=balanced), which hold the same documents every step.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

PACKINGS = ("document", "min_max", "balanced")


@dataclass(frozen=True)
class Row:
    """A packed row as the line sees it: its documents, real tokens, squared lengths and (where known)
    the documents' lengths."""
    documents: int
    useful: int
    squares: float
    lengths: Optional[Tuple[int, ...]] = None


def step_rows(lengths: List[int], assignment: List[List[int]]) -> List[Row]:
    return [Row(len(g), sum(lengths[i] for i in g), float(sum(lengths[i] ** 2 for i in g)),
                tuple(lengths[i] for i in g)) for g in assignment]


def reuse_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (this process): by default it hands a freed block above its
    mmap threshold back to the OS and trims the heap's top, so the next row's 8 MiB logits (and their
    gradient) fault their pages in again -- 1.5-2 ms of a stage-1 row, there or not by the allocator's
    history: rows of one short document came out 17-25% above the calibration line or 6% below it at
    random, and stage 1's rows strayed 5-10% rms. A fixed mmap threshold (32 MiB, glibc's ceiling) and
    no trimming keep the buffers in the heap, as a caching allocator does; those rows then sit within
    1% of the line. False where the C library is not glibc (nothing set)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3   # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 1024 * 1024)) and bool(mallopt(m_trim_threshold, 1 << 30))


def quantiles(values: List[float]) -> Dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]  # noqa: E731
    return {"median": statistics.median(values), "p10": pick(0.1), "p90": pick(0.9), "min": values[0],
            "max": values[-1]}


def overrides(args) -> List[str]:
    return ["arch=gpt2-tiny", f"arch.n_layer={args.n_layer}", f"arch.n_embd={args.n_embd}", f"arch.n_head={args.n_head}",
            f"arch.vocab_size={args.vocab}", f"arch.n_positions={args.budget}", "data=code", f"data.path={args.path}",
            f"data.vocab_size={args.vocab}", f"data.seq_len={args.budget}", f"train.steps={args.steps}",
            f"train.global_batch_size={args.micro_batches}", "train.schedule=1f1b", "train.checkpoint_interval=0",
            "train.measure_memory=false", "logger.mode=disabled", f"train.seed={args.seed}"]


def spans_of(args):
    if args.spans:
        cuts = [0] + [int(x) for x in args.spans.split(",")] + [args.n_layer]
    else:
        cuts = [round(i * args.n_layer / args.pp) for i in range(args.pp + 1)]
    return list(zip(cuts, cuts[1:]))


def timeline_step_of_work(fwd: List[float], bwd: List[float], micro_batches: int):
    """The simulator's timeline (1F1B, no sends) over a fixed-length micro-batch's per-stage forward and
    backward: a step's time given its [stage][micro-batch] work multipliers."""
    from hrlplan.cost.timeline import simulate_timeline

    pp = len(fwd)
    zero = [0.0] * pp
    return lambda work: simulate_timeline("1f1b", pp, 1, micro_batches, fwd, bwd, zero, zero, zero, zero,
                                          micro_batch_work=work).makespan


def step_batches(args, documents, meta, spans, calibrated: Dict) -> Dict:
    """Per step: the pieces' lengths, each packing's assignment and its (inputs, targets), the dispatch's
    seconds. `balanced` minimises the simulated step, its stages and attention shares calibrated
    (calibrated: {"full": {F, B}, "shares": [RowShares]}, from the rows timed before)."""
    from hrlplan.cost.lengths import dispatch_model
    from hrlplan.data import dispatch as D
    from hrlplan.data.packed_stream import to_wire
    from hrlplan.data.packing import predictions

    model = dispatch_model(timeline_step_of_work(calibrated["full"]["F"], calibrated["full"]["B"], args.micro_batches),
                           meta, spans, args.budget, shares=calibrated["shares"])
    dp, m = args.dp, args.micro_batches
    bins = D.replica_bins(m, [args.budget] * dp, [1.0] * dp)
    out = {"lengths": [], "assignments": {p: [] for p in PACKINGS}, "batches": {p: [] for p in PACKINGS},
           "dispatch_seconds": [], "dispatch_methods": []}
    for step in range(args.steps):
        pieces, arrival = documents.step_pieces(step, m * dp)   # rows replica-major, as the engines slice them
        lengths = [predictions(p) for p in pieces]
        common = dict(time_budget_s=args.time_budget, fallback=arrival, stages=args.pp, fixed_shapes=True,
                      ilp_min_gain=0.01)
        min_max = D.dispatch_bins(lengths, bins, 0.0, 1.0, **common)   # as data.packing=balanced trains today
        common["fixed_shapes"] = False   # the model's bins carry the base work
        balanced = D.dispatch_bins(lengths, model.bins(m, args.budget, dp), model.linear,
                                   model.quadratic, step_of=model.step_of, **common)
        out["dispatch_seconds"].append(balanced.seconds)
        out["dispatch_methods"].append(balanced.method)
        out["lengths"].append(lengths)
        for p, assignment in (("document", arrival), ("min_max", min_max.assignment), ("balanced", balanced.assignment)):
            out["assignments"][p].append(assignment)
            out["batches"][p].append(to_wire(documents.pack(pieces, assignment), sum(lengths), m * dp))
    return out


def time_micro_batches(stages, inputs, targets, micro_batches: int) -> Dict[str, List[List[float]]]:
    """{F, B}: [stage][micro-batch] CPU seconds of this thread, each stage run apart as the pipeline runs it."""
    from hrlplan.models.hf import causal_lm_loss

    clock = time.thread_time
    out = {kind: [[0.0] * micro_batches for _ in stages] for kind in ("F", "B")}
    out["loss"] = 0.0   # the micro-batches' losses summed: the step's, whatever the packing
    for j in range(micro_batches):
        carried, received = (inputs[j:j + 1],), []
        for k, stage in enumerate(stages):
            t0 = clock()
            out_k = stage(*carried)
            if k == len(stages) - 1:
                out_k = causal_lm_loss(out_k, targets[j:j + 1])
            out["F"][k][j] = clock() - t0
            if k == len(stages) - 1:
                out["loss"] += float(out_k.detach())
            received.append(out_k)
            if k < len(stages) - 1:
                h = out_k[0].detach().requires_grad_(True)
                carried = (h,) + tuple(out_k[1:])
                received[-1] = (out_k[0], h)
        grad = None
        for k in reversed(range(len(stages))):
            t0 = clock()
            if k == len(stages) - 1:
                received[k].backward()
            else:
                received[k][0].backward(grad)
            out["B"][k][j] = clock() - t0
            grad = received[k - 1][1].grad if k > 0 else None
    return out


# held-out steps of the corpus itself (its validation split, never a measured step), each packed three
# ways -- arrival order, min-max, pipeline-aware -- so the calibration rows are rows like the measured
# ones (their mix of documents, lengths and padding) and the fit holds where the steps are. Synthetic
# rows (16 or 64 equal documents, a row of padding) were tried before: they sit off the steps' line
# (64 documents of 32 tokens took 3.4x what the steps' own fit gives) and pulled the fit 2-7% off.
HELD_OUT_STEPS = 6
# a pipeline-aware packing of the held-out steps needs a row's fixed work against its attention; any
# value near the measured one gives rows of the same kind (light ones to the ends, heavy ones inside)
HELD_OUT_ATTENTION_RATIO = 3.5


def calibration_rows(args, eot_id: int, documents):
    """(Row, (inputs, targets)) per calibration row, in steps of
    args.micro_batches rows: first the fixed-length micro-batch the planner costs (one document filling
    the row) m x dp times, then HELD_OUT_STEPS steps of the validation split, each packed in arrival
    order, by the min-max dispatch and by the pipeline-aware one (data/dispatch.py)."""
    import torch

    from hrlplan.data import dispatch as D
    from hrlplan.data.packed_stream import to_wire
    from hrlplan.data.packing import pack_micro_batches, predictions

    g = torch.Generator().manual_seed(args.seed)
    m = args.micro_batches
    out = []
    # the one-document row as many times as a timed call has rows (`step_rows_per_call`)
    for _ in range(m * args.dp):
        one = torch.randint(1, args.vocab, (args.budget + 1,), generator=g)
        one[one == eot_id] = 1
        out.append((Row(1, args.budget, float(args.budget) ** 2, (args.budget,)),
                    to_wire(pack_micro_batches([one], [[0]], args.budget, eot_id), args.budget, 1)))
    base = D.Bin(args.budget, 1.0, 0, args.budget ** 2 / HELD_OUT_ATTENTION_RATIO)
    for step in range(HELD_OUT_STEPS):
        pieces, arrival = documents.step_pieces(step, m, split="val")
        lengths = [predictions(x) for x in pieces]
        common = dict(time_budget_s=0.3, fallback=arrival, stages=args.pp, ilp_min_gain=0.01)
        min_max = D.dispatch_bins(lengths, [base] * m, 0.0, 1.0, **common).assignment
        aware = D.dispatch_bins(lengths, [base] * m, 0.0, 1.0, step_of=D.one_f_one_b(args.pp), **common).assignment
        for assignment in (arrival, min_max, aware):
            for group in assignment:
                row = [pieces[i] for i in group]
                held = [predictions(x) for x in row]
                wire = to_wire(documents.pack(row, [list(range(len(row)))]), max(sum(held), 1), 1)
                out.append((Row(len(row), sum(held), float(sum(n * n for n in held)), tuple(held)), wire))
    return out


def time_calibration(stages, calibration, micro_batches: int, groups=None) -> List:
    """Per calibration row, its {F, B}; the rows timed as steps are, `micro_batches` consecutive rows
    at a time (one held-out step as one packing packs it), gradients accumulating across them and
    cleared after: rows timed one at a time, each from cleared gradients, ran 1-3.5% faster than the
    same kind of row inside a measured step. groups: which of those steps to time (default all);
    rows of the others are None."""
    import torch

    torch.set_num_threads(1)
    rows: List = [None] * len(calibration)
    count = len(calibration) // micro_batches
    for g in (range(count) if groups is None else groups):
        chunk = calibration[g * micro_batches:(g + 1) * micro_batches]
        inputs = torch.cat([wire[0] for *_, wire in chunk])
        targets = torch.cat([wire[1] for *_, wire in chunk])
        got = time_micro_batches(stages, inputs, targets, micro_batches)
        for j in range(micro_batches):
            rows[g * micro_batches + j] = {kind: [[got[kind][k][j]] for k in range(len(stages))] for kind in ("F", "B")}
        for s in stages:
            s.zero_grad(set_to_none=True)
    return rows


def step_rows_per_call(args) -> int:
    """Rows a timed call runs: a measured step's (m x dp, the replicas' rows one after another in this
    thread), so the calibration's rows sit at the positions the steps' do. A row's time depends on its
    place in the call by a few tenths of a percent (round 8, dp 2: the first row 0.3-0.6% below the
    line, the second 0.3-0.6% above, the second replica's rows 0.1-0.4% above the first's): timed in
    calls of m rows, the calibration had no rows at the second replica's places and put dp 2 steps
    0.2% low."""
    return args.micro_batches * args.dp


def timed_rounds(args, batches: Dict, stages, calibration) -> Dict:
    """Per round (packings interleaved, order flipping): per packing and step the {F, B} tables; the
    calibration's passes timed between the round's steps (in the steps' own conditions: passes timed
    in a burst before the rounds came out 1-5% faster than the steps on a busy host); the load
    average around the round."""
    import torch

    torch.set_num_threads(1)
    timed = list(range(args.warmup, args.steps))
    rounds = []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        order = PACKINGS if r % 2 == 0 else PACKINGS[::-1]
        per = {p: [] for p in PACKINGS}
        # the calibration's steps, one between each two of the round's, starting over when all are timed:
        # a pass per turn (the last one partial, its other rows None)
        call = step_rows_per_call(args)
        count = len(calibration) // call
        passes: List[List] = []
        for t, step in enumerate(timed):
            if t % count == 0:
                passes.append([None] * len(calibration))
            mine = time_calibration(stages, calibration, call, [t % count])
            passes[-1] = [x if x is not None else y for x, y in zip(mine, passes[-1])]
            gradients = {}
            for p in order:
                inputs, targets = batches[p][step]
                per[p].append(time_micro_batches(stages, inputs, targets, args.micro_batches * args.dp))
                # the step's gradient (the weights never change here): a packing moves documents, not the sum
                gradients[p] = torch.cat([q.grad.flatten() for s in stages for q in s.parameters() if q.grad is not None])
                for s in stages:
                    s.zero_grad(set_to_none=True)
            scale = float(gradients["document"].abs().max())
            for p in PACKINGS:
                per[p][-1]["gradient_max_abs_difference"] = float((gradients[p] - gradients["document"]).abs().max())
                per[p][-1]["gradient_max_abs"] = scale
        rounds.append({"round": r, "load_before": load, "load_after": os.getloadavg()[0], "tables": per,
                       "calibration": passes})
        print(f"round {r}: load {load:.1f} -> {rounds[-1]['load_after']:.1f}", flush=True)
    return {"timed_steps": timed, "rounds": rounds}


def training_runs(args, workdir: Path) -> Dict[str, List[Dict]]:
    """Real pp-`args.pp` training runs of data.packing=document and =balanced (the trainer's dispatch),
    interleaved: losses, wall-clock steps and the load."""
    from hrlplan.compose import compose
    from hrlplan.launch.local_run import train_plan
    from hrlplan.plan import homogeneous_plan

    plan = homogeneous_plan("gpt2-tiny", args.n_layer, spans_of(args), dp=1, tp=1, microbatch_size=1,
                            num_microbatches=args.micro_batches, schedule="1f1b")
    runs: Dict[str, List[Dict]] = {"document": [], "balanced": []}
    for r in range(args.train_rounds):
        for packing in (("document", "balanced") if r % 2 == 0 else ("balanced", "document")):
            load = os.getloadavg()[0]
            summary = train_plan(plan, compose(overrides(args) + [f"data.packing={packing}"]),
                                 workdir / f"round{r}-{packing}", metrics_file=False)
            history = summary["history"]
            runs[packing].append({"round": r, "loss": [h["train/lm_loss"] for h in history],
                                  "step_time_s": [h["train/step_time_s"] for h in history], "load_before": load,
                                  "load_after": os.getloadavg()[0]})
            print(f"train round {r} {packing}: load {load:.1f}", flush=True)
    return runs
