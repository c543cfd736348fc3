"""Calibration in a running job: every rank runs the micro-benchmarks at once, rank 0 fits the record
(.record) and broadcasts it. The orchestration on top of the package: it imports .compute, .comm,
.collectives and .record, none of them imports it."""
from __future__ import annotations

import dataclasses
import gc
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hrlplan.config import Config, DataConfig, TrainConfig, section
from hrlplan.errors import ConfigError
from hrlplan.model_meta import introspect
from hrlplan.runtime.calibrate.blocks import REPEATS
from hrlplan.runtime.calibrate.collectives import (DP_SCALING_BLOCKS, allreduce_partitions, measure_allreduce,
                                                   measure_data_parallel, pool_allreduce_passes)
from hrlplan.runtime.calibrate.comm import (HOP_SCHEDULES, measure_exchange_cpu, measure_p2p, measure_pipeline_hop,
                                            measure_tensor_parallel, pool_exchange_passes, pool_hop_passes)
from hrlplan.runtime.calibrate.compute import (busy_until_barrier, measure_block, measure_compile, measure_contention,
                                               measure_gradient_bucket_cpu, measure_optimizer, measure_pipeline_ops,
                                               measure_step, measure_tp_optimizer, measure_zb_split)
from hrlplan.cost.quota_cpu import QUOTA_CPU_KEY
from hrlplan.runtime.calibrate.record import (assess, calibration_samples, fit_calibration, fit_reference_step,
                                              fit_reference_step_cpu, measurements, predict_reference_step,
                                              prediction_check)
from hrlplan.runtime.distributed import all_gather_object, broadcast_object, local_device

REFERENCE_ROUNDS = 5        # reference steps, interleaved with block timings: a shared machine's load drifts
DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32)   # hrlplan.search.config's default candidates


def _pairs(world: int) -> List[List[int]]:
    return [[r, r + 1] for r in range(0, world - 1, 2)]


def largest_microbatch(global_batch: int, microbatches: Any = "auto", wanted: Optional[List[int]] = None) -> int:
    """The largest micro-batch the planner may pick: global / train.microbatches when that is fixed,
    else the largest candidate (planner.microbatch_sizes) dividing the global batch (dp 1)."""
    if microbatches not in (None, "auto"):
        return max(1, global_batch // int(microbatches))
    wanted = list(wanted or DEFAULT_MICROBATCH_SIZES)
    fits = [d for d in wanted if 0 < d <= global_batch and global_batch % d == 0]
    return max(fits) if fits else global_batch


def memory_cap(cap: int, seq: int, block_bytes_per_token: float, free_bytes: Optional[float],
               blocks: int = 1, fixed_bytes: float = 0.0, headroom: float = 0.5) -> int:
    """Halve `cap` until `blocks` blocks' activations at cap x seq tokens, plus fixed_bytes (weights,
    optimizer states), fit in headroom x free_bytes (probed free memory); 0 when nothing fits.
    None free_bytes (CPU): cap unchanged."""
    if free_bytes is None:
        return cap
    while cap >= 1 and fixed_bytes + cap * seq * block_bytes_per_token * blocks > headroom * free_bytes:
        cap //= 2
    return cap


def calibration_sizes(global_batch: int, cap: int) -> tuple:
    """(micro-batch sizes of the block fits, of the compute fit): 1, a quarter, a half and the whole
    of the batch, none above cap (the largest micro-batch the planner may pick, or what fits)."""
    g = max(1, min(global_batch, cap))
    sizes = sorted({1, max(1, g // 4), g})
    return sizes, sorted(set(sizes) | {max(1, g // 2)})


def calibrate_in_job(spec, arch: Dict[str, Any], train: TrainConfig, data: DataConfig,
                     planner: Optional[Dict[str, Any]] = None):
    """Collective: every rank of an initialised process group calls it; every rank returns the
    ClusterSpec with `calibration` filled. Every rank runs the micro-benchmarks at once (on a shared
    machine a rank's speed depends on how many others compete for it); rank 0 fits and broadcasts.
    Everything runs on the training device (the current GPU under NCCL); with
    train.dtype=bfloat16 every forward runs under bf16 autocast, as the runtime computes. Sizes stop
    at the largest micro-batch the planner (planner.microbatch_sizes) may pick and what fits.
    Rank 0 says which group of micro-benchmarks runs (Progress); past planner.calibrate_budget_s every
    rank raises CalibrationOverBudget. The record's "steadiness" says whether the machine held still
    (.record's assess): an unsteady record is for this plan only, never cached."""
    started = time.monotonic()
    train, data = section(TrainConfig, train), section(DataConfig, data)   # typed, or a script's plain mappings
    device = local_device()
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.dtype == "bfloat16"):
            return _calibrate_in_job(spec, arch, train, data, device, planner or {}, started)
    finally:   # over budget too: the benchmarks' models and buffers go before the plan's
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _sizes(meta, train: TrainConfig, seq: int, device: torch.device,
           planner: Dict[str, Any]) -> Tuple[List[int], List[int], int]:
    """(micro-batch sizes, those of the compute fit, the reference step's batch: 0 when the whole
    model does not fit one device)."""
    g = int(train.global_batch_size)
    free = float(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
    act = meta.block_activation_bytes_per_token[0] * (1 if train.dtype == "bfloat16" else 2)
    cap = memory_cap(largest_microbatch(g, train.microbatches, planner.get("microbatch_sizes")),
                     seq, act, free)
    # the compute fit also at half the batch: its line through three sizes put a 256-token block
    # (the micro-batch the planner then picked here) 8% below its measured time
    sizes, block_sizes = calibration_sizes(g, max(cap, 1))
    # the one-process reference step holds the whole model and its AdamW states (16 B/parameter)
    step_batch = memory_cap(max(sizes), seq, act, free, blocks=meta.n_layer, fixed_bytes=16.0 * meta.total_params)
    return sizes, block_sizes, step_batch


# ---------------------------------------------------------------- progress and budget
# Calibration's progress on the console and its time budget.
#
# Rank 0 says which group of micro-benchmarks starts, k of n, and the seconds spent so far. Before each
# group every rank learns rank 0's verdict on the budget (planner.calibrate_budget_s), so all of them
# stop together: a calibration past its budget raises CalibrationOverBudget on every rank, and the job
# plans from peak figures instead (hrlplan.launch.planning.calibrated). The budget is checked between
# groups (and between the reference step's rounds), so a group that starts inside it runs to its end.

DEFAULT_BUDGET_S = 300.0   # planner.calibrate_budget_s when unset: the default job calibrates in ~15 s here
BUDGET_KEY = "planner.calibrate_budget_s"


class CalibrationOverBudget(Exception):
    """Calibration ran past its budget at `stage` (`done` of `total` groups finished before it)."""

    def __init__(self, budget_s: float, elapsed_s: float, done: int, total: int, stage: str):
        super().__init__(budget_s, elapsed_s, done, total, stage)
        self.budget_s, self.elapsed_s, self.done, self.total, self.stage = budget_s, elapsed_s, done, total, stage

    def __str__(self) -> str:
        return (f"calibration stopped after {self.elapsed_s:.0f} s, over {BUDGET_KEY}={self.budget_s:g}, "
                f"at {self.stage} ({self.done} of {self.total} groups done)")


class Progress:
    """Collective use: every rank calls start() for the same stages in the same order (or none but
    rank 0 with collective=False). `agree` turns rank 0's over-budget verdict into every rank's (a
    broadcast); `say` prints rank 0's line."""

    def __init__(self, stages: Sequence[str], budget_s: float, rank: int,
                 agree: Callable[[bool], bool] = lambda over: over,
                 say: Callable[[str], None] = lambda line: print(line, flush=True),
                 clock: Callable[[], float] = time.monotonic, started: Optional[float] = None):
        self.stages, self.budget_s, self.rank = list(stages), float(budget_s), rank
        self.agree, self.say, self.clock = agree, say, clock
        self.started = clock() if started is None else started   # the budget counts the set-up before it too

    def elapsed(self) -> float:
        return self.clock() - self.started

    def check(self, stage: str, collective: bool = True) -> None:
        """Raise CalibrationOverBudget (on every rank, when collective) once the budget is spent."""
        over = self.rank == 0 and self.elapsed() > self.budget_s
        if collective:
            over = bool(self.agree(over))
        if over:
            raise CalibrationOverBudget(self.budget_s, self.elapsed(), self.stages.index(stage), len(self.stages),
                                        stage)

    def start(self, stage: str, collective: bool = True) -> None:
        """Group `stage` begins: check the budget, then rank 0 says k/n and the time so far."""
        self.check(stage, collective)
        if self.rank == 0:
            self.say(f"[hrlplan] calibration {self.stages.index(stage) + 1}/{len(self.stages)}: {stage} "
                     f"({self.elapsed():.1f} s so far)")


def budget_seconds(planner: Optional[dict]) -> float:
    """planner.calibrate_budget_s (DEFAULT_BUDGET_S when unset); a value that is not a positive number
    is refused naming the key."""
    value = (planner or {}).get("calibrate_budget_s")
    if value is None:
        return DEFAULT_BUDGET_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)) or isinstance(value, bool):
        raise ConfigError(BUDGET_KEY, value, message=f"{BUDGET_KEY}={value!r} is not allowed: it must be a "
                          f"positive number of seconds (default {DEFAULT_BUDGET_S:g}); planner.calibrate=false "
                          "skips calibration")
    return seconds


# The groups of micro-benchmarks, as the console names them (calibration k/n: ...)
STAGE_BLOCKS = "the model's blocks: forward + backward per micro-batch size, zero-bubble's split backward"
STAGE_SOLO = "the pipeline library's per-op overhead (rank 0 alone), clipping + AdamW"
STAGE_PAIRS = "pairs of ranks: pipeline hops, FSDP, tensor parallel; all-reduces"
STAGE_SHARED = "ping-pong, every rank at once vs one alone, all-reduces"
STAGE_REFERENCE = f"the whole model's one-process step (rank 0 alone, {REFERENCE_ROUNDS} rounds)"


def calibration_stages(world: int, reference_step: bool) -> List[str]:
    """The groups a calibration of `world` ranks runs, in order (with a reference step or without)."""
    return ([STAGE_BLOCKS, STAGE_SOLO] + ([STAGE_PAIRS] if world > 1 else []) + [STAGE_SHARED]
            + ([STAGE_REFERENCE] if reference_step else []))


def _calibrate_in_job(spec, arch: Dict[str, Any], train: TrainConfig, data: DataConfig, device: torch.device,
                      planner: Dict[str, Any], started: float):
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = broadcast_object(spec)   # the probe returns the spec on rank 0 only
    progress = Progress(calibration_stages(world, True), budget_seconds(planner), rank,
                        agree=broadcast_object, started=started)
    # said before the model is first built: importing its transformers classes took 7-9 s on a busy VM
    progress.start(STAGE_BLOCKS)
    seq = int(data.seq_len)
    meta = introspect(arch, seq_len=seq)
    sizes, block_sizes, step_batch = _sizes(meta, train, seq, device, planner)
    if step_batch < 1:
        progress.stages.remove(STAGE_REFERENCE)   # the whole model does not fit one device
    # groups are created collectively, in one order on every rank
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = _pairs(world)
    pair_groups = [dist.new_group(p) for p in pairs]
    partitions = [(k, lists, [dist.new_group(r) if len(r) > 1 else None for r in lists])
                  for k, lists in allreduce_partitions(world)]
    try:
        local, p2p, msg = _measure_everything(arch, train, device, meta, seq, sizes, block_sizes, progress,
                                              singles, pairs, pair_groups, partitions)
        gathered = all_gather_object(local)
        outcome: Any = None
        if step_batch >= 1:
            progress.start(STAGE_REFERENCE)
        if rank == 0:
            try:
                outcome = _fit_record(spec, meta, gathered, p2p, msg, step_batch,
                                      Config(arch=arch, train=train, data=data), block_sizes, device, progress)
            except CalibrationOverBudget as over:   # rank 0's alone: the others learn it below
                outcome = over
        dist.barrier()
        outcome = broadcast_object(outcome)
        if isinstance(outcome, CalibrationOverBudget):
            raise outcome
        spec.calibration = outcome
    finally:
        for group in singles + pair_groups + [g for _, _, groups in partitions for g in groups if g is not None]:
            dist.destroy_process_group(group)
    return spec


def _measure_everything(arch: Dict[str, Any], train: TrainConfig, device: torch.device, meta, seq: int,
                        sizes: List[int], block_sizes: List[int], progress: Progress, singles, pairs,
                        pair_groups, partitions) -> Tuple[Dict[str, Any], Any, int]:
    """Collective: every rank's micro-benchmarks, group by group as `progress` announces them (and
    stops them at its budget). (this rank's measurements, rank 0's ping-pong, its message bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = max(sizes)
    samples = measure_block(arch, seq, block_sizes, device)
    zb_split = measure_zb_split(arch, seq, sizes, device)
    progress.start(STAGE_SOLO)
    # The pipeline library's per-op overhead is an alone figure (contention_factor scales it): rank 0
    # measures it with the others waiting. Measured on every rank at once, ranks time-sliced on
    # shared cores put their slices into the slope of the longer schedule: 0.3-2.7 ms per backward
    # with 4 ranks on 2 cores (0.01-0.1 ms with 2), and every plan's backward costed that much more.
    ops = None
    if rank == 0:
        alone_one = measure_block(arch, seq, [1], device)[0]
        ops = measure_pipeline_ops(arch, seq, device, singles[0], alone_one["fwd_s"], alone_one["bwd_s"])
    dist.barrier()
    optim = measure_optimizer(arch, train, device)
    bucket_cpu = measure_gradient_bucket_cpu(arch, seq, device)
    if world > 1:
        progress.start(STAGE_PAIRS)
    # The all-reduces and the pipeline hops are measured in passes at different moments and pooled:
    # a burst of another tenant's load then inflates one pass, not the figure (a 2-rank all-reduce
    # once measured 2.5 ms instead of 0.25 ms, every pipelined plan predicted 25% slow).
    allreduce_passes = [measure_allreduce(device, partitions, repeats=REPEATS)]
    dist.barrier()
    paired = _pair_benchmarks(arch, seq, train, device, meta, sizes, pairs, pair_groups)
    allreduce_passes.append(measure_allreduce(device, partitions, repeats=REPEATS))
    progress.start(STAGE_SHARED)
    msg = max(1, g // 2) * seq * meta.hidden_size * (2 if train.dtype == "bfloat16" else 4)
    p2p = measure_p2p(msg, device)
    contention = measure_contention(arch, seq, max(1, g // 4), device)
    allreduce_passes.append(measure_allreduce(device, partitions, repeats=REPEATS))
    local = {"block": samples, "zb_split": zb_split, "pipeline_ops": ops, "optimizer": optim,
             "gradient_bucket_cpu": bucket_cpu, **paired,
             "contention": contention, "allreduce": pool_allreduce_passes(allreduce_passes)}
    return local, p2p, msg


def _pair_benchmarks(arch: Dict[str, Any], seq: int, train: TrainConfig, device: torch.device, meta,
                     sizes: List[int], pairs: List[List[int]], pair_groups: List[Any]) -> Dict[str, Any]:
    """Collective: the two-rank micro-benchmarks, every pair at once and a rank left over kept busy (a
    step has every rank working too, so what they measure needs no scaling for ranks sharing cores).
    {data_parallel, pipeline_hop, p2p_exchange_cpu, tensor_parallel, tp_optimizer}: None on a rank left over."""
    g = max(sizes)
    rank = dist.get_rank()
    out: Dict[str, Any] = dict(data_parallel=None, pipeline_hop=None, p2p_exchange_cpu=None, tensor_parallel=None,
                               tp_optimizer=None)
    mine = next((i for i, pair in enumerate(pairs) if rank in pair), None)
    if mine is None:
        busy_until_barrier(arch, seq, max(1, g // 4), device)
        return out
    group = pair_groups[mine]
    tied_numel = int(meta.head_matmul_params) if meta.tied_embeddings else 0
    hop_passes: Dict[str, List[Dict[str, Any]]] = {sched: [] for sched in HOP_SCHEDULES}
    exchange_passes: List[Any] = []
    # the activation message (fp32, as the hop sends it) at the smallest, a middle and the largest micro-batch
    exchange_sizes = [mbs * seq * meta.hidden_size * 4 for mbs in sorted({min(sizes), sorted(sizes)[len(sizes) // 2],
                                                                         max(sizes)})]

    def hop_pass() -> None:
        # one-block stages: plan-sized ones (half the blocks, a quarter of the batch) fitted GPipe's
        # hop no better here and, with more ranks than cores, twice as long as pp2 x dp2 pays it
        for sched in HOP_SCHEDULES:
            hop_passes[sched].append(measure_pipeline_hop(arch, seq, device, group, pairs[mine],
                                                          schedule=sched, repeats=REPEATS, tied_numel=tied_numel))
        exchange_passes.append(measure_exchange_cpu(group, pairs[mine], exchange_sizes, device))

    hop_pass()
    dp = measure_data_parallel(arch, seq, train, device, group)
    hop_pass()
    # the same stage at other depths: how the collectives' exposed time grows per unit (each
    # unit's reduce-scatter overlaps the backward of the units after it) vs the stage's tail
    dp["by_blocks"] = [{k: d[k] for k in ("n_blocks", "allgather_total", "reduce_total", "optimizer_total")}
                       for d in [dp] + [measure_data_parallel(arch, seq, train, device, group, n_blocks=nb)
                                        for nb in DP_SCALING_BLOCKS]]
    hop_pass()
    out["data_parallel"] = dp
    out["pipeline_hop"] = {sched: pool_hop_passes(passes) for sched, passes in hop_passes.items()}
    out["p2p_exchange_cpu"] = pool_exchange_passes(exchange_passes)
    out["tensor_parallel"] = measure_tensor_parallel(arch, seq, sizes, device, group)
    out["tp_optimizer"] = measure_tp_optimizer(arch, train, device, group)
    dist.barrier()
    return out


def _fit_record(spec, meta, gathered: List[Dict[str, Any]], p2p, msg: int, step_batch: int, config: Config,
                block_sizes: List[int], device: torch.device, progress: Progress) -> Dict[str, Any]:
    """Rank 0: the calibration record, with the reference step's figures when the whole model fits
    one device. The reference step runs on rank 0 alone (the others wait), in interleaved rounds with
    the blocks timed alone (medians: a shared machine's load drifts between two measurements)."""
    seq = int(config.data.seq_len)
    cal = fit_calibration(spec, meta, gathered, p2p, msg)
    if config.train.compile:   # compiling a block takes 6-26 s on a CPU: measured only for a run that compiles
        cal["compile_speedup"] = measure_compile(config.arch, seq, min(block_sizes), device)["compile_speedup"]
    if step_batch < 1:
        cal["step_overhead_s"] = 0.0   # the whole model does not fit one device: no reference step
        cal["measurements"] = measurements(meta, seq, config.train, gathered, msg, p2p, one_process_step_s=None)
        cal["steadiness"] = assess(calibration_samples(gathered))
        return cal
    train = dataclasses.replace(config.train, global_batch_size=step_batch)   # the reference step's batch, predicted alike
    step_config = dataclasses.replace(config, train=train)
    rounds = []
    for i in range(REFERENCE_ROUNDS):
        if i:
            progress.check(STAGE_REFERENCE, collective=False)
        step = measure_step(step_config, device)
        blocks = measure_block(config.arch, seq, block_sizes, device)
        # capped workers are bounded by the CPU the step costs: its blocks in CPU time beside it
        cpu_blocks = measure_block(config.arch, seq, block_sizes, device, cpu_clock=True) \
            if QUOTA_CPU_KEY in cal and "step_cpu_s" in step else None
        rounds.append((step, blocks, cpu_blocks))
    measured, predicted, alone = fit_reference_step(cal, spec, meta, train, rounds, gathered, seq)
    fit_reference_step_cpu(cal, spec, meta, train, rounds)
    cal["measurements"] = measurements(meta, seq, train, gathered, msg, p2p, one_process_step_s=measured,
                                       block_alone=alone, one_process_step_rounds_s=[r[0]["step_s"] for r in rounds],
                                       one_process_step_predicted_without_step_overhead_s=predicted)
    cal["steadiness"] = assess(calibration_samples(gathered, rounds),
                               prediction_check(predict_reference_step(cal, spec, meta, train), measured))
    return cal
