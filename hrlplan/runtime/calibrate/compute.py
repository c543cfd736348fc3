"""Calibration's compute micro-benchmarks and their fits (hrlplan.runtime.calibrate.worker runs them).

- measure_block + fit_compute: one block's forward + backward per micro-batch size
  (compute_efficiency, half_saturation_tokens, backward_forward_ratio);
- measure_zb_split: the block's backward split as zero-bubble runs it (zb_backward_factors);
- measure_optimizer + fit_optimizer: clipping + AdamW per block and per call (optimizer_s_per_block,
  optimizer_fixed_s, optimizer_ends_blocks); measure_tp_optimizer: the same of a stage sharded over
  tp=2 (their "tp" entries);
- measure_pipeline_ops: torch's pipeline stage overhead per operation (op_overhead_s);
- measure_contention: every rank busy vs one alone (contention_factor);
- measure_step: one whole one-process training step (step_overhead_s, optimizer_in_step_scale).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from hrlplan.cluster import cpu_quota
from hrlplan.config import Config, TrainConfig, as_config, section
from hrlplan.cost.model import Layout
from hrlplan.cost.plans import options_for_train
from hrlplan.cost.simulator import Simulator
from hrlplan.data.lm import build_lm_data
from hrlplan.measure import least_squares_line, median_time, now, sync_device, timed_forward_backward, timed_samples
from hrlplan.models.hf import HFStage, build_hf_model, causal_lm_loss, hf_config_from_arch
from hrlplan.runtime.calibrate.blocks import REPEATS, block_stage
from hrlplan.runtime.compile import measure_compile_speedup
from hrlplan.runtime.parallel import clip_grad_norm
from hrlplan.runtime.tensor_parallel import parallelize_stage
from hrlplan.runtime.timing import StepRecorder, instrument_pipeline_stage, median_step_time
from hrlplan.runtime.trainer import build_full_model, make_optimizer
from hrlplan.schedules import DEFAULT


def measure_block(arch: Dict[str, Any], seq_len: int, microbatch_sizes: List[int], device: torch.device,
                  repeats: int = REPEATS, cpu_clock: bool = False) -> List[Dict[str, float]]:
    """Median forward and backward time of one block per micro-batch size, and each repeat's
    forward + backward (samples_s: their spread says how steady the machine was).

    Under a CPU quota (cluster.cpu_shares) the block's CPU time (quota_timer): the work the quota
    meters, which the cost model bounds a capped rank's step by (CPU work over its share: simulator
    cpu_quota_bounds). A capped rank otherwise runs each operation at full speed, in a burst, and
    one idle most of a step gets a core at once when it wakes. Measured on gpt2-tiny at shares
    [1, 1/3, 1/3], load 1-14: the capped ranks' forwards and backwards in training took their CPU
    time in wall time too, 1.3-1.8 ms, the uncapped rank's figure; the same block in calibration,
    every rank busy at once, read 1-4x that in wall time, and scaled to the rate over several CFS
    periods (the old figure) it costed them 2.8x and the pp3 layouts 1.3-1.6x their step.
    cpu_clock: in CPU time wherever it can be (a CPU worker on one intra-op thread), capped or not."""
    block, hidden = block_stage(arch, device)
    timer = quota_timer(device) or (cpu_clock and single_thread_cpu(device) and cpu_timed_forward_backward) \
        or (lambda blk, x: timed_forward_backward(blk, x, device))
    out = []
    for mbs in microbatch_sizes:
        x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
        fwd, bwd = [], []
        for i in range(repeats + 1):   # the first run pays for allocation
            f, b = timer(block, x)
            if i:
                fwd.append(f)
                bwd.append(b)
        out.append({"tokens": mbs * seq_len, "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd),
                    "samples_s": [f + b for f, b in zip(fwd, bwd)]})
    return out


def cpu_timed_forward_backward(block: torch.nn.Module, x: torch.Tensor) -> Tuple[float, float]:
    """(forward s, backward s) of one run of `block` on `x` in this thread's CPU time (a CPU tensor,
    torch on one intra-op thread: then every operation runs on this thread)."""
    c0 = time.thread_time()
    y = block(x)
    c1 = time.thread_time()
    y.backward(torch.ones_like(y))
    return c1 - c0, time.thread_time() - c1


def single_thread_cpu(device: torch.device) -> bool:
    """A CPU device on one intra-op thread: one thread's CPU time is then all of an operation's."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def quota_timer(device: torch.device):
    """cpu_timed_forward_backward where this worker runs under a CPU quota on one intra-op thread
    (cluster.cpu_shares' workers), else None (wall time). With more threads the CPU time of one
    thread would miss the others' work."""
    if device.type != "cpu" or cpu_quota() is None or torch.get_num_threads() != 1:
        return None
    return cpu_timed_forward_backward


def measure_compile(arch: Dict[str, Any], seq_len: int, microbatch_size: int, device: torch.device) -> Dict[str, float]:
    """train.compile's speed-up of one block on this device (runtime/compile.measure_compile_speedup)."""
    block, hidden = block_stage(arch, device)
    return measure_compile_speedup(block, lambda: torch.randn(microbatch_size, seq_len, hidden, device=device))


def fit_compute(samples: List[Dict[str, float]], flops_per_token: float, peak: float) -> Dict[str, float]:
    """Least-squares line (F+B)/3 = a * tokens + b  ->  eff = flops/(peak a), h = b / a."""
    xs = [s["tokens"] for s in samples]
    ys = [(s["fwd_s"] + s["bwd_s"]) / 3 for s in samples]
    if len(set(xs)) < 2:
        a, b = ys[0] / xs[0], 0.0
    else:
        a, b = least_squares_line(xs, ys)
        if a <= 0:   # noise on a busy machine: fall back to the largest size's throughput
            a, b = ys[-1] / xs[-1], 0.0
    b = max(b, 0.0)
    return {"compute_efficiency": flops_per_token / (peak * a), "half_saturation_tokens": b / a}


def measure_zb_split(arch: Dict[str, Any], seq_len: int, microbatch_sizes: List[int], device: torch.device,
                     repeats: int = REPEATS) -> List[Dict[str, float]]:
    """Zero-bubble's split backward of one block as the runtime runs it -- torch.distributed.pipelining's
    own stage_backward_input (B: d/dx, walking the graph for the weights' inputs) and
    stage_backward_weight (W: d/dw) -- beside a plain backward, per micro-batch size. On CPU the split
    costs 1.5-2x a plain backward (B alone more than all of it), so shares of the plain one undercount."""
    block, hidden = block_stage(arch, device)
    out = []
    for mbs in microbatch_sizes:
        x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
        plain, b_times, w_times = [], [], []
        for i in range(repeats + 1):
            y = block(x)
            g = torch.ones_like(y)
            sync_device(device)
            t0 = now(device)
            y.backward(g)
            sync_device(device)
            plain.append(now(device) - t0)
            block.zero_grad(set_to_none=True)
            y = block(x)
            sync_device(device)
            t0 = now(device)
            _, param_groups = stage_backward_input([y], [g], [x], block.parameters())
            sync_device(device)
            t1 = now(device)
            stage_backward_weight(block.parameters(), param_groups)
            sync_device(device)
            t2 = now(device)
            block.zero_grad(set_to_none=True)
            if i:
                b_times.append(t1 - t0)
                w_times.append(t2 - t1)
        out.append({"tokens": mbs * seq_len, "plain_s": statistics.median(plain[1:]),
                    "input_s": statistics.median(b_times), "weight_s": statistics.median(w_times)})
    return out


def _clip_and_step(params, opt, max_norm: float = 1.0) -> None:
    clip_grad_norm(params, max_norm, None, [])
    opt.step()


OPTIMIZER_DEEP_BLOCKS = 4   # the second stage depth the optimizer is timed at (beside one block)


def measure_optimizer(arch: Dict[str, Any], train: TrainConfig, device: torch.device,
                      repeats: int = REPEATS) -> Dict[str, float]:
    """Gradient clipping + AdamW step (as the trainer runs them) of a one-block and an
    OPTIMIZER_DEEP_BLOCKS-block stage, and of the embedding + final norm/head (a first-and-last stage
    without blocks), on plain tensors: fit_calibration separates the per-call cost, paid once per
    rank and step, from the per-block one."""
    config = hf_config_from_arch(arch)
    config.num_hidden_layers = OPTIMIZER_DEEP_BLOCKS
    torch.manual_seed(0)
    model = build_hf_model(config)
    out = {}
    for name, part in (("block", HFStage(model, 0, 1, first=False, last=False)),
                       ("deep", HFStage(model, 0, OPTIMIZER_DEEP_BLOCKS, first=False, last=False)),
                       ("ends", HFStage(model, 0, 0, first=True, last=True))):
        part = part.to(device)
        params = [p for p in part.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = make_optimizer(part, train)
        samples = timed_samples(lambda: _clip_and_step(params, opt), repeats, device)
        out[name] = statistics.median(samples)
        out[f"{name}_samples_s"] = samples
    out["deep_blocks"] = OPTIMIZER_DEEP_BLOCKS
    return out


def measure_gradient_bucket_cpu(arch: Dict[str, Any], seq_len: int, device: torch.device,
                                repeats: int = REPEATS) -> Optional[Dict[str, float]]:
    """CPU devices (else None): the process CPU time of packing one block's gradients into a bucket
    and back, as a cross-replica sync does for every gradient it reduces (runtime/hetero_sync: each
    gradient weighted by its replica's batch share, flattened into one buffer; after the all-reduce,
    each copied back) -- per tensor, beyond the all-reduce's own CPU. {bytes, tensors, cpu_s}.
    Measured on gpt2-tiny at shares [1, 1/3, 1/3]: a capped replica stage's gradient sync and
    clipping cost it 1.6-2.3 ms a step where the all-reduces' calibrated CPU came to 0.5."""
    if device.type != "cpu":
        return None
    block, hidden = block_stage(arch, device)
    y = block(torch.randn(1, seq_len, hidden, device=device))
    y.backward(torch.ones_like(y))
    grads = [p.grad for p in block.parameters() if p.grad is not None]
    sizes = [g.numel() for g in grads]
    cpu = []
    for i in range(repeats + 1):   # the first run pays for allocation
        c0 = time.process_time()
        flat = torch.cat([(g.detach().float() * 0.5).reshape(-1) for g in grads])
        with torch.no_grad():
            for g, piece in zip(grads, flat.split(sizes)):
                g.copy_(piece.reshape(g.shape))
        if i:
            cpu.append(time.process_time() - c0)
    return {"bytes": float(sum(g.numel() * g.element_size() for g in grads)), "tensors": len(grads),
            "cpu_s": statistics.median(cpu)}


def measure_tp_optimizer(arch: Dict[str, Any], train: TrainConfig, device: torch.device, pair_group,
                         repeats: int = 3 * REPEATS) -> Optional[Dict[str, float]]:
    """Collective over `pair_group`: gradient clipping + AdamW of a one-block and an
    OPTIMIZER_DEEP_BLOCKS-block stage sharded over tp=2 as the runtime shards it, on both ranks at
    once, without the norm's all-reduce (step_collectives costs that once per step). Tensor parallel
    leaves norms plain and shards the linears, and on CPU AdamW's per-parameter DTensor dispatch is
    most of its time: FSDP's all-DTensor figure overcosted a tp=2 step's clipping + optimizer by up to
    a quarter (gpt2-tiny: 11.9 ms against 9.7 ms measured). None when the model cannot be sharded
    over 2."""
    mesh = DeviceMesh.from_group(pair_group, device.type, mesh_dim_names=("tp",))
    out: Dict[str, Any] = {"deep_blocks": OPTIMIZER_DEEP_BLOCKS}
    small = torch.zeros(1, device=device)
    for name, n_blocks in (("block", 1), ("deep", OPTIMIZER_DEEP_BLOCKS)):
        stage, hidden = block_stage(arch, device, n_blocks)
        try:
            parallelize_stage(stage, mesh)
        except (ValueError, NotImplementedError):
            return None
        y = stage(torch.randn(1, 8, hidden, device=device))
        y.backward(torch.ones_like(y))
        params = [p for p in stage.parameters() if p.requires_grad]
        opt = make_optimizer(stage, train)
        step, reduce = [], []
        for i in range(repeats + 1):   # the first run pays for allocation
            dist.barrier(group=pair_group)
            t0 = now(device)
            _clip_and_step(params, opt)
            sync_device(device)
            t1 = now(device)
            dist.all_reduce(small, group=pair_group)
            sync_device(device)
            if i:
                step.append(t1 - t0)
                reduce.append(now(device) - t1)
        out[name] = max(statistics.median(step) - statistics.median(reduce), 0.0)
    return out


def fit_optimizer(one: float, deep: Optional[float], deep_blocks: int, ends: float) -> Dict[str, float]:
    """{per_block, fixed, ends_blocks}: a line through the one-block and the deep stage's optimizer
    time (the intercept is the per-call cost: norms, foreach launches, Python), and the embedding +
    head's time beyond that per-call cost, in blocks."""
    per_block, fixed = one, 0.0
    if deep is not None and deep_blocks > 1 and deep > one:
        per_block = (deep - one) / (deep_blocks - 1)
        fixed = max(one - per_block, 0.0)
        per_block = one - fixed
    return {"per_block": per_block, "fixed": fixed,
            "ends_blocks": max(ends - fixed, 0.0) / per_block if per_block > 0 else 0.0}


def measure_pipeline_ops(arch: Dict[str, Any], seq_len: int, device: torch.device, group,
                         block_fwd_s: float, block_bwd_s: float, m: int = 4, repeats: int = REPEATS) -> Dict[str, float]:
    """Per-call overhead of torch.distributed.pipelining: a one-block middle stage alone in a
    one-rank group, its schedule run with 1 and with m micro-batches of one sequence. The slope per
    micro-batch minus the bare block's forward + backward is the overhead of one F and one B; the
    recorded forward span (minus the bare forward) is the F part.

    On a CPU worker with one intra-op thread everything is timed in CPU time, the block's forward
    and backward included (block_fwd_s / block_bwd_s are then not used): the overhead is the small
    difference of two larger times, and wall times on a shared host carry whatever the other
    processes took of the core -- with the host at load 20, op_overhead_s read 2.7-8.1 ms per
    backward instead of ~0.02 ms, and every pipelined plan was costed that much more per backward.
    The contention_factor scales the alone figure as before."""
    block, hidden = block_stage(arch, device)
    recorder = StepRecorder(device)
    loss_fn = lambda out, target: out.float().pow(2).mean()  # noqa: E731
    cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
    if cpu_clock:
        x1 = torch.randn(1, seq_len, hidden, device=device, requires_grad=True)
        runs = [cpu_timed_forward_backward(block, x1) for _ in range(repeats + 1)][1:]
        block_fwd_s, block_bwd_s = (statistics.median(r[i] for r in runs) for i in (0, 1))

    def run(n: int) -> float:
        stage = PipelineStage(block, 0, 1, device, group=group)
        instrument_pipeline_stage(stage, recorder, 0)
        sched = Schedule1F1B(stage, n_microbatches=n, loss_fn=loss_fn)
        x = torch.randn(n, seq_len, hidden, device=device)
        target = torch.zeros(n, device=device)

        def step():
            block.zero_grad(set_to_none=True)
            recorder.begin()
            sched.step(x, target=target, losses=[])
        if not cpu_clock:
            return median_time(step, repeats, device)
        samples = []
        for i in range(repeats + 1):   # the first run pays for allocation
            c0 = time.thread_time()
            step()
            if i:
                samples.append(time.thread_time() - c0)
        return statistics.median(samples)

    one = run(1)
    many = run(m)
    f_spans = [(e["cpu_s"] if cpu_clock else e["end_s"] - e["start_s"]) for e in recorder.events if e["kind"] == "F"]
    per_mb = max((many - one) / (m - 1), 0.0)
    op_f = max(statistics.median(f_spans) - block_fwd_s, 0.0) if f_spans else 0.0
    op_b = max(per_mb - block_fwd_s - block_bwd_s - op_f, 0.0)
    return {"fwd": op_f, "bwd": op_b, "per_microbatch_s": per_mb, "one_microbatch_step_s": one,
            "clock": "cpu" if cpu_clock else "wall"}


CONTENTION_SLACK = 1.15                 # contention beyond ranks/cores allowed for (memory bandwidth, caches)


def measure_contention(arch: Dict[str, Any], seq_len: int, microbatch_size: int, device: torch.device,
                       iters: int = 40, rounds: int = 5) -> Dict[str, Any]:
    """Collective. The mean time of one block's forward + backward over `iters` back-to-back runs: on
    rank 0 alone (the others wait) and on every rank at once. Means over a long
    run, not medians of single runs: with more ranks than cores the scheduler time-slices them, and
    most single runs fit inside one slice, so a median hides the sharing that a real step pays for."""
    block, hidden = block_stage(arch, device)
    x = torch.randn(microbatch_size, seq_len, hidden, device=device, requires_grad=True)
    rank = dist.get_rank()

    def run() -> float:
        sync_device(device)
        t0 = now(device)
        for _ in range(iters):
            y = block(x)
            y.backward(torch.ones_like(y))
        sync_device(device)
        return (now(device) - t0) / iters

    run()
    out: Dict[str, List[float]] = {"alone": [], "together": []}
    for _ in range(rounds):
        for mode, busy in (("alone", rank == 0), ("together", True)):
            dist.barrier()
            if busy:
                out[mode].append(run())
    dist.barrier()
    # per round too: fit_calibration takes ratios within a round (a shared machine's load drifts)
    return {**{f"{k}_s": statistics.median(v) if v else None for k, v in out.items()},
            **{f"{k}_rounds_s": v for k, v in out.items()},
            "cpu_cores": len(os.sched_getaffinity(0)) if device.type == "cpu" and hasattr(os, "sched_getaffinity")
            else None}


def measure_step(config: Config, device: torch.device = torch.device("cpu"),
                 steps: int = 10) -> Dict[str, float]:
    """{step_s, optimizer_s}: median time of a one-process training step of the whole model as the
    runtime runs its stages (one HFStage holding every layer, its loss, our gradient clipping,
    AdamW), and of its clipping + optimizer step, without the warm-up steps that the runtime's own
    step times leave out too. Not HF's full forward: what that
    adds (mask and output bookkeeping) no pipeline stage pays, and it would land in step_overhead_s."""
    config = as_config(config)
    train = config.train
    model = build_full_model(config.arch, int(train.seed))
    stage = HFStage(model, 0, model.config.num_hidden_layers, first=True, last=True).to(device)
    data = build_lm_data(config.data, model.config.vocab_size, int(train.seed))
    opt = make_optimizer(stage, train)
    params = [p for p in stage.parameters() if p.requires_grad]
    times, after, cpu, cpu_after = [], [], [], []
    for step in range(steps):
        inputs, targets = data.batch(step, int(train.global_batch_size))
        inputs, targets = inputs.to(device), targets.to(device)
        opt.zero_grad(set_to_none=True)
        t0, c0 = now(device), time.process_time()
        causal_lm_loss(stage(inputs), targets).backward()
        t1, c1 = now(device), time.process_time()
        clip_grad_norm(params, float(train.grad_clip or 0.0), None, [])
        opt.step()
        t2, c2 = now(device), time.process_time()
        times.append(t2 - t0)
        after.append(t2 - t1)
        cpu.append(c2 - c0)
        cpu_after.append(c2 - c1)
    out = {"step_s": median_step_time(times), "optimizer_s": median_step_time(after)}
    if single_thread_cpu(device):   # the step in CPU time too: what a CPU quota meters (cost/quota_cpu.py)
        out.update(step_cpu_s=median_step_time(cpu), optimizer_cpu_s=median_step_time(cpu_after))
    return out


def predict_one_process_step(meta, spec, train: TrainConfig) -> Dict[str, float]:
    """The simulator's breakdown of the whole model as one stage on one process, one micro-batch of
    the global batch (what measure_step times)."""
    layout = Layout(spans=((0, meta.n_layer),), groups=((0,),), tp=1, dp=1,
                    microbatch_size=int(section(TrainConfig, train).global_batch_size), num_microbatches=1,
                    schedule=DEFAULT)
    return Simulator(meta, spec, options_for_train(train)).evaluate(layout, detail=True).breakdown


def busy_until_barrier(arch: Dict[str, Any], seq_len: int, microbatch_size: int, device: torch.device) -> None:
    """One block's forward + backward, over and over, until every other rank reaches the barrier."""
    block, hidden = block_stage(arch, device)
    x = torch.randn(microbatch_size, seq_len, hidden, device=device, requires_grad=True)
    done = dist.barrier(async_op=True)
    while not done.is_completed():
        y = block(x)
        y.backward(torch.ones_like(y))
    done.wait()
