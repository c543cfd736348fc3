"""Calibration's point-to-point and tensor-parallel micro-benchmarks and their fits
(hrlplan.runtime.calibrate.worker runs them; the collectives are in .collectives).

- measure_p2p: a ping-pong between ranks 0 and 1 (bandwidth_efficiency);
- measure_pipeline_hop + fit_hop_delay: a real two-stage torch pipeline (p2p_latency_s,
  p2p_handshake_s) and the small all-reduces a step makes after it (allreduce_latency_s,
  tied_allreduce_s); fit_pipeline_compute: its blocks against the same blocks alone
  (pipeline_compute_factor); pool_hop_passes: passes run at different moments, pooled;
- measure_tensor_parallel + fit_tensor_parallel: stages of 1 and 6 blocks sharded over tp=2 beside
  the whole ones (tp_block_overhead_s, per block).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from hrlplan.cost.timeline import simulate_timeline
from hrlplan.measure import line_through, now, ping_pong, timed_forward_backward
from hrlplan.runtime.calibrate.blocks import REPEATS, block_stage
from hrlplan.runtime.tensor_parallel import parallelize_stage
from hrlplan.runtime.timing import StepRecorder, instrument_pipeline_stage
from hrlplan.schedules import DEFAULT, SCHEDULES, resolve_schedule


def measure_p2p(nbytes: int, device: torch.device, repeats: int = 10) -> Optional[Dict[str, float]]:
    """Collective. Ranks 0 and 1 ping-pong a tiny and an activation-sized message; rank 0 gets the
    one-way times {latency_s, message_s}."""
    rank = dist.get_rank()
    result = None
    if rank in (0, 1) and dist.get_world_size() > 1:
        bw, lat = ping_pong(rank, 1 - rank, sorted({1, nbytes}), repeats, device)
        result = {"latency_s": lat, "message_s": lat + nbytes / bw}
    dist.barrier()
    return result


def measure_pipeline_hop(arch: Dict[str, Any], seq_len: int, device: torch.device, pair_group, pair: List[int],
                         m: int = 4, microbatch_size: int = 1, n_blocks: int = 1, schedule: str = DEFAULT,
                         repeats: int = REPEATS, tied_numel: int = 0) -> Optional[Dict[str, Any]]:
    """Collective over `pair_group` (ranks `pair`): a real two-stage torch.distributed.pipelining
    pipeline, an `n_blocks`-block stage on each rank, one step of `m` micro-batches per repeat.
    Each rank returns its stage's median recorded forward / backward span and the span of its
    operations in each step (first start to last end). fit_hop_delay turns the first stage's span
    into the per-hop delay (p2p_latency_s) that makes the simulator's timeline end when the real one
    did: the send/recv batching, gloo's rendezvous and the waits of torch's schedule, which a
    ping-pong of a tiny message does not see. After each step, the small all-reduces a training step
    then makes (a tied embedding's gradient of `tied_numel` values, the gradient norm, the loss) are
    timed as they run there -- one rank arriving late, the other woken from a wait -- which costs
    several times an all-reduce between two ranks that have just met at a barrier."""
    me = pair.index(dist.get_rank())
    block, hidden = block_stage(arch, device, n_blocks)
    recorder = StepRecorder(device)
    stage = PipelineStage(block, me, 2, device, group=pair_group)
    instrument_pipeline_stage(stage, recorder, me)
    cls = resolve_schedule(schedule, 1).torch_class(1)
    sched = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out.float().pow(2).mean())
    torch.manual_seed(1)
    x = torch.randn(m * microbatch_size, seq_len, hidden, device=device)
    target = torch.zeros(m * microbatch_size, device=device)
    spans, fwd, bwd, steps, tied_t, small_t, beyond = [], [], [], [], [], [], []
    tied, small = torch.zeros(max(tied_numel, 1), device=device), torch.zeros(1, device=device)
    for i in range(repeats + 2):   # two warm-up steps: shape inference, buffers, connections
        block.zero_grad(set_to_none=True)
        dist.barrier(group=pair_group)
        recorder.begin()
        t0, c0 = now(device), time.process_time()
        if me == 0:
            sched.step(x)
        else:
            sched.step(target=target, losses=[])
        t1, c1 = now(device), time.process_time()
        if tied_numel:
            dist.all_reduce(tied, group=pair_group)
        t2 = now(device)
        dist.all_reduce(small, group=pair_group)
        dist.all_reduce(small, group=pair_group)
        t3 = now(device)
        if i >= 2 and recorder.events:
            tied_t.append(t2 - t1)
            small_t.append((t3 - t2) / 2)
            if device.type == "cpu":
                beyond.append(cpu_beyond_actions(c1 - c0, recorder.events) / m)
            ev = recorder.events
            spans.append(max(e["end_s"] for e in ev) - min(e["start_s"] for e in ev))
            fwd += [e["end_s"] - e["start_s"] for e in ev if e["kind"] == "F"]
            bwd += [e["end_s"] - e["start_s"] for e in ev if e["kind"] == "B"]
            steps.append(t1 - t0)
            last_events = list(ev)
    dist.barrier(group=pair_group)
    return {"stage": me, "schedule": schedule, "m": m, "microbatch_size": microbatch_size, "n_blocks": n_blocks,
            "fwd_all": fwd, "bwd_all": bwd, "spans_s": spans, "steps_all": steps, "tail_all": small_t,
            "tail_tied_all": tied_t if tied_numel else None, "cpu_beyond_actions_per_microbatch_all": beyond,
            "message_bytes": microbatch_size * seq_len * hidden * x.element_size(),
            "events": [(e["kind"], e["microbatch"], round(e["start_s"] * 1e3, 3), round(e["end_s"] * 1e3, 3))
                       for e in last_events]}


def cpu_beyond_actions(process_cpu_s: float, events: Sequence[Dict[str, Any]]) -> float:
    """A pipeline step's process CPU time (every thread: gloo's included, as a CPU quota meters it)
    beyond its recorded forwards and backwards (their thread CPU time): what torch's schedule, its
    sends and receives and their waits cost the rank's CPU (gloo's transport thread, which at times
    spends CPU while a message is outstanding, included)."""
    return max(process_cpu_s - sum(e.get("cpu_s") or 0.0 for e in events), 0.0)


P2P_CPU_ROUND_TRIPS = 20


def measure_exchange_cpu(pair_group, pair: List[int], sizes_bytes: Sequence[int], device: torch.device,
                         round_trips: int = P2P_CPU_ROUND_TRIPS) -> Optional[List[Dict[str, float]]]:
    """Collective over `pair_group` (ranks `pair`), CPU devices only (else None): a ping-pong of
    each size, back to back; each rank's process CPU time (every thread: the send and receive
    copies, gloo's transport and work threads, as a CPU quota meters them) per round trip -- one
    send and one receive of that size, the exchange a pipeline stage makes per micro-batch with
    each neighbour (the activation one way, its gradient back). [{bytes, cpu_s}]. Why apart from
    the pipeline hop: that hop sends one size, so its CPU beyond the forwards and backwards cannot
    say how it grows with the message; measured with gloo on 2 loopback ranks, 0.07 ms per round
    trip at 32 KB, 0.23 at 128 KB, 1.4 at 512 KB, and a capped stage of pp3 4/1/1 at 4 sequences
    spent twice the CPU beyond its forwards and backwards that the hop's 1-sequence figure gave."""
    if device.type != "cpu":
        return None
    me = pair.index(dist.get_rank())
    peer = pair[1 - me]

    def loop(buf: torch.Tensor, n: int) -> float:
        dist.barrier(group=pair_group)
        c0 = time.process_time()
        for _ in range(n):
            if me == 0:
                dist.send(buf, peer, group=pair_group)
                dist.recv(buf, peer, group=pair_group)
            else:
                dist.recv(buf, peer, group=pair_group)
                dist.send(buf, peer, group=pair_group)
        return (time.process_time() - c0) / n

    bufs = [torch.zeros(max(1, int(nbytes) // 4), device=device) for nbytes in sizes_bytes]
    for buf in bufs:   # connections and buffers first: the first size measured read 0.4 ms against 0.02-0.09
        loop(buf, 2)
    out = [{"bytes": float(buf.numel() * buf.element_size()),
            "cpu_s": statistics.median(loop(buf, round_trips) for _ in range(3))} for buf in bufs]
    dist.barrier(group=pair_group)
    return out


def pool_exchange_passes(passes: Sequence[Optional[List[Dict[str, float]]]]) -> Optional[List[Dict[str, float]]]:
    """measure_exchange_cpu's passes as the median per size (a burst of foreign load in one pass is
    not what the exchange costs); None when none ran."""
    runs = [p for p in passes if p]
    if not runs:
        return None
    return [{"bytes": point["bytes"], "cpu_s": statistics.median(r[i]["cpu_s"] for r in runs)}
            for i, point in enumerate(runs[0])]


def pool_hop_passes(passes: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One rank's measure_pipeline_hop passes (same settings, run at different moments of the
    calibration) pooled into medians: another tenant's burst of load inflates one pass, not the
    median of them all."""
    med = statistics.median
    pooled = {k: passes[-1].get(k) for k in ("stage", "schedule", "m", "microbatch_size", "n_blocks", "events",
                                             "message_bytes")}
    raw = {k: [x for p in passes for x in (p.get(k) or [])] for k in
           ("fwd_all", "bwd_all", "spans_s", "steps_all", "tail_all", "tail_tied_all",
            "cpu_beyond_actions_per_microbatch_all")}
    pooled.update(fwd_s=med(raw["fwd_all"]), bwd_s=med(raw["bwd_all"]), span_s=med(raw["spans_s"]),
                  spans_s=raw["spans_s"], step_s=med(raw["steps_all"]), tail_allreduce_s=med(raw["tail_all"]),
                  tail_tied_allreduce_s=med(raw["tail_tied_all"]) if raw["tail_tied_all"] else None,
                  # the mean, not the median: a quota meters the sum, and gloo's transport thread spends
                  # CPU in bursts (0.6-11 ms of a step in some steps, near nothing in others)
                  cpu_beyond_actions_per_microbatch_s=(statistics.fmean(raw["cpu_beyond_actions_per_microbatch_all"])
                                                       if raw["cpu_beyond_actions_per_microbatch_all"] else None),
                  cpu_beyond_actions_per_microbatch_all=raw["cpu_beyond_actions_per_microbatch_all"])
    return pooled


TP_DEPTHS = (1, 6)   # blocks per stage measure_tensor_parallel shards: the overhead per block is the slope


def measure_tensor_parallel(arch: Dict[str, Any], seq_len: int, microbatch_sizes: List[int], device: torch.device,
                            pair_group, repeats: int = 3 * REPEATS) -> Optional[List[Dict[str, float]]]:
    """Collective over `pair_group`: stages of TP_DEPTHS blocks as the runtime shards them over tp=2
    (tensor_parallel.parallelize_stage: DTensor, an all-reduce per half in forward and in backward)
    beside the same stages whole, alternating, on both ranks at once, per micro-batch size.
    fit_tensor_parallel turns them into what tp costs per block beyond half the block's compute:
    the all-reduces, and DTensor's dispatch, which on CPU outweighs the halved matmuls. Two depths,
    because a block costs more inside a deeper stage than alone (measured on gpt2-tiny: 9.2 ms
    beyond half the block alone, 10.5-11.5 ms per block of a 6-block stage; the slope over 1 and 2
    blocks, 10.6 ms). 1 and 6 blocks here: runs a few seconds apart gave slopes of 4.5-7.6 ms over
    1 and 3 blocks, 5.0-6.5 ms over 1 and 6 (512 tokens, 15 repeats). None when the model cannot be
    sharded over 2 (heads not divisible, an architecture without a tp plan)."""
    mesh = DeviceMesh.from_group(pair_group, device.type, mesh_dim_names=("tp",))
    stages = []
    for n_blocks in TP_DEPTHS:
        plain, hidden = block_stage(arch, device, n_blocks)
        sharded, _ = block_stage(arch, device, n_blocks)
        try:
            parallelize_stage(sharded, mesh)
        except (ValueError, NotImplementedError):
            return None
        stages.append((n_blocks, plain, sharded))

    out = []
    for mbs in microbatch_sizes:
        torch.manual_seed(2)   # tp ranks hold the same (replicated) block input
        x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
        times: Dict[int, Dict[str, List[float]]] = {
            n: {"plain_fwd_s": [], "plain_bwd_s": [], "tp_fwd_s": [], "tp_bwd_s": []} for n in TP_DEPTHS}
        for i in range(repeats + 1):   # the first run pays for allocation
            for n_blocks, plain, sharded in stages:
                pf, pb = timed_forward_backward(plain, x, device)
                dist.barrier(group=pair_group)
                tf, tb = timed_forward_backward(sharded, x, device)
                if i:
                    for key, t in zip(times[n_blocks], (pf, pb, tf, tb)):
                        times[n_blocks][key].append(t)
        out.append({"tokens": mbs * seq_len,
                    "depths": [{"n_blocks": n, **{k: statistics.median(v) for k, v in times[n].items()}}
                               for n in TP_DEPTHS]})
    return out


def fit_tensor_parallel(measured: Sequence[Optional[List[Dict[str, Any]]]]) -> List[Dict[str, float]]:
    """[{tokens, fwd, bwd}]: what one more block of a tp=2 stage costs in forward / backward beyond
    half its whole compute -- the slope over the stage depths measured -- the median over the ranks
    that measured it, smoothed by a least-squares line over the micro-batch sizes (>= 0). [] when
    none did. The line, because each size's figure is a difference of differences: with 4 ranks on
    2 cores one size once measured 5.8 ms between 7.9 and 8.5 ms, and pp2 x tp2, costed between
    two sizes, was predicted 12% fast."""
    runs = [m for m in measured if m]
    if not runs:
        return []
    med = statistics.median

    def beyond_half(depth: Dict[str, float], part: str) -> float:
        return depth[f"tp_{part}_s"] - depth[f"plain_{part}_s"] / 2

    def slope(point: Dict[str, Any], part: str) -> float:
        lo, hi = point["depths"][0], point["depths"][-1]
        return (beyond_half(hi, part) - beyond_half(lo, part)) / (hi["n_blocks"] - lo["n_blocks"])

    tokens = [float(p["tokens"]) for p in runs[0]]
    fits = {part: line_through(tokens, [med(slope(r[i], part) for r in runs) for i in range(len(tokens))])
            for part in ("fwd", "bwd")}
    return [{"tokens": p["tokens"], **{part: max(fits[part][i], 0.0) for part in fits}}
            for i, p in enumerate(runs[0])]


# the one-stage-per-rank schedules (GPipe, 1F1B): they wait for their messages at different points
HOP_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if not spec.multi_stage)
HANDSHAKE_LATENCIES = 2.0   # a rendezvous receive posted after its send: notice to the sender, data back


def fit_hop_delay(first: Dict[str, Any], second: Dict[str, Any], handshake: float = HANDSHAKE_LATENCIES) -> float:
    """The one-way point-to-point delay l with which the simulator's two-stage timeline (the
    stages' measured forward / backward spans, messages arriving l after a late send and a receive
    posted after its send waiting `handshake` x l) ends when the first stage's measured operations
    did (bisection: the makespan does not decrease as l grows). 0 when the timeline without delay
    is already as long."""
    m, schedule = int(first["m"]), str(first["schedule"])
    fwd, bwd = [first["fwd_s"], second["fwd_s"]], [first["bwd_s"], second["bwd_s"]]

    def makespan(lat: float) -> float:
        return simulate_timeline(schedule, 2, 1, m, fwd, bwd, [0.0, 0.0], [lat, 0.0], [lat, 0.0],
                                 [0.0, 0.0], recv_handshake=[handshake * lat] * 2).end[0]

    target = float(first["span_s"])
    if makespan(0.0) >= target:
        return 0.0
    lo, hi = 0.0, target
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if makespan(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_pipeline_compute(hops: Sequence[Dict[str, Any]], alone: Sequence[Dict[str, Any]], seq_len: int,
                         op_overhead: Dict[str, float], contention: float) -> float:
    """How much longer a block's forward + backward takes inside the real two-stage pipeline
    (measure_pipeline_hop's recorded spans, less the per-op overhead costed apart) than the same block
    timed alone at the same size, beyond what `contention` (contention_factor's compute) already
    explains; the median over the hop pipelines, at least 1. Why: on a loaded 2-core VM the blocks
    of a 2-rank pipeline ran 1.0-1.65x their time alone from one calibration to the next, and the
    pipelines' step times moved with it, while contention_factor (a loop of one block on every rank,
    capped at the job's own ranks per core) read 1.0-1.15. On the same runs of three benches this
    factor took the median |error| of the calibrated step times from 12.4/14.2/22.5% to
    3.0/13.7/13.1%. (Timing the block outside the pipeline right before it, both ranks at once,
    read about 1.0: the slowdown is the two ranks computing at once, which the contention loop
    under-reads, more than anything torch's pipeline adds.)"""
    by_tokens = {int(a["tokens"]): a for a in alone}
    ratios = []
    for h in hops:
        a = by_tokens.get(int(h["microbatch_size"]) * seq_len)
        if a is not None and a["fwd_s"] + a["bwd_s"] > 0:
            inside = h["fwd_s"] - op_overhead.get("fwd", 0.0) + h["bwd_s"] - op_overhead.get("bwd", 0.0)
            ratios.append(inside / (a["fwd_s"] + a["bwd_s"]))
    return max(1.0, statistics.median(ratios) / max(contention, 1.0)) if ratios else 1.0
