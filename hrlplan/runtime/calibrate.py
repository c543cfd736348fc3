"""Calibration: measure the real devices and store the figures the cost model reads.

What is measured, and which ClusterSpec.calibration key (hrlplan.cost.model.CALIBRATION_KEYS) it sets:
- one transformer block's forward + backward at several micro-batch sizes on every rank. The cost
  model's compute time is flops * (tokens + h) / (peak * eff) per forward, backward twice that, so a
  straight line through (tokens, measured (F+B)/3) gives the sustained efficiency `eff`
  (compute_efficiency, per device name) and the half-saturation point `h` (half_saturation_tokens);
- an activation-sized point-to-point transfer between ranks 0 and 1: bandwidth_efficiency, the
  fraction of the probed bandwidth that a message of that size achieves after the probed latency;
- one whole one-process training step of the model vs the simulator's prediction for it with the
  figures above: step_time_scale, which covers what the model does not count (optimizer, Python).
Raw measurements are kept under calibration["measurements"] for inspection.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

REPEATS = 5


def _block(arch: Dict[str, Any], device: torch.device):
    """A one-block stage of the model (no embedding, no head), on `device`."""
    from hrlplan.models.hf import HFStage, build_hf_model, hf_config_from_arch

    config = hf_config_from_arch(arch)
    config.num_hidden_layers = 1   # GPT-2 maps n_layer onto this; only one block is built
    torch.manual_seed(0)
    model = build_hf_model(config)
    return HFStage(model, 0, 1, first=False, last=False).to(device), int(config.hidden_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_block(arch: Dict[str, Any], seq_len: int, microbatch_sizes: List[int], device: torch.device,
                  repeats: int = REPEATS) -> List[Dict[str, float]]:
    """Median forward and backward time of one block per micro-batch size."""
    block, hidden = _block(arch, device)
    out = []
    for mbs in microbatch_sizes:
        x = torch.randn(mbs, seq_len, hidden, device=device, requires_grad=True)
        fwd, bwd = [], []
        for i in range(repeats + 1):   # the first run pays for allocation
            _sync(device)
            t0 = time.perf_counter()
            y = block(x)
            _sync(device)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            _sync(device)
            t2 = time.perf_counter()
            if i:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        out.append({"tokens": mbs * seq_len, "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd)})
    return out


def fit_compute(samples: List[Dict[str, float]], flops_per_token: float, peak: float) -> Dict[str, float]:
    """Least-squares line (F+B)/3 = a * tokens + b  ->  eff = flops/(peak a), h = b / a."""
    xs = [s["tokens"] for s in samples]
    ys = [(s["fwd_s"] + s["bwd_s"]) / 3 for s in samples]
    if len(set(xs)) < 2:
        a, b = ys[0] / xs[0], 0.0
    else:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        b = my - a * mx
        if a <= 0:   # noise on a busy machine: fall back to the largest size's throughput
            a, b = ys[-1] / xs[-1], 0.0
    b = max(b, 0.0)
    return {"compute_efficiency": flops_per_token / (peak * a), "half_saturation_tokens": b / a}


def measure_p2p(nbytes: int, device: torch.device, repeats: int = 10) -> Optional[float]:
    """Collective. Ranks 0 and 1 exchange an activation-sized message; rank 0 gets the one-way time."""
    from hrlplan.cluster import _ping_pong

    rank = dist.get_rank()
    result = None
    if rank in (0, 1) and dist.get_world_size() > 1:
        bw, _ = _ping_pong(rank, 1 - rank, nbytes, repeats, device)
        result = nbytes / bw
    dist.barrier()
    return result


def measure_step(config: Dict[str, Any], steps: int = 4) -> float:
    """Median time of a one-process training step (model, data, AdamW as the trainer uses them)."""
    from hrlplan.runtime.reference import train_single_process

    cfg = dict(config, train=dict(config["train"], steps=steps))
    times = [h["step_time_s"] for h in train_single_process(cfg, steps)]
    return statistics.median(times[1:] if len(times) > 1 else times)


def _predict_one_process_step(meta, spec, train: Dict[str, Any]) -> float:
    from hrlplan.cost.model import Layout
    from hrlplan.cost.simulator import Simulator
    from hrlplan.search.common import cost_options

    layout = Layout(spans=((0, meta.n_layer),), groups=((0,),), tp=1, dp=1,
                    microbatch_size=int(train["global_batch_size"]), num_microbatches=1, schedule="1f1b")
    return Simulator(meta, spec, cost_options({}, train)).evaluate(layout).step_time_s


def calibrate_in_job(spec, arch: Dict[str, Any], train: Dict[str, Any], data: Dict[str, Any]):
    """Collective: every rank of an initialised process group calls it; every rank returns the
    ClusterSpec with `calibration` filled (rank 0 measures the one-process step, then broadcasts)."""
    from hrlplan.model_meta import introspect

    rank = dist.get_rank()
    box = [spec]   # the probe returns the spec on rank 0 only
    dist.broadcast_object_list(box, src=0)
    spec = box[0]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    seq = int(data["seq_len"])
    meta = introspect(arch, seq_len=seq)
    g = int(train["global_batch_size"])
    sizes = sorted({1, max(1, g // 4), g})
    samples = measure_block(arch, seq, sizes, device)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    msg = max(1, g // 2) * seq * meta.hidden_size * (2 if train.get("dtype") == "bfloat16" else 4)
    one_way = measure_p2p(msg, device)
    cal: Optional[Dict[str, Any]] = None
    if rank == 0:
        cal = dict(spec.calibration or {})
        flops = meta.block_flops_fwd_per_token[0] * meta.block_repeats
        eff, half = {}, {}
        for name in sorted({d.name for d in spec.devices}):
            fits = [fit_compute(gathered[d.rank], flops, d.peak_flops) for d in spec.devices
                    if d.name == name and d.rank < len(gathered)]
            eff[name] = statistics.median(f["compute_efficiency"] for f in fits)
            half[name] = statistics.median(f["half_saturation_tokens"] for f in fits)
        cal.update(compute_efficiency=eff, half_saturation_tokens=half, step_time_scale=1.0)
        if one_way is not None and spec.world_size > 1:
            wire = one_way - spec.lat(0, 1)
            cal["bandwidth_efficiency"] = min(1.0, msg / (max(wire, 1e-9) * spec.bw(0, 1)))
        spec.calibration = cal
        config = {"arch": arch, "train": dict(train), "data": dict(data)}
        measured = measure_step(config)
        predicted = _predict_one_process_step(meta, spec, train)
        cal["step_time_scale"] = measured / predicted if predicted > 0 else 1.0
        cal["measurements"] = {"model": meta.name, "seq_len": seq, "block": gathered, "p2p_bytes": msg,
                               "p2p_one_way_s": one_way, "one_process_step_s": measured,
                               "one_process_step_predicted_s": predicted}
    box = [cal]
    dist.broadcast_object_list(box, src=0)
    spec.calibration = box[0]
    return spec


def predict_plan(plan, meta, spec, train: Dict[str, Any]) -> Dict[str, Any]:
    """The simulator's step time, bubble and memory per rank for any plan the runtime runs.

    A heterogeneous plan is simulated pipeline by pipeline (each as a dp=1 layout at its largest
    tp degree) and takes the slowest; the cross-replica gradient reduce is not modelled."""
    from hrlplan.cost.model import Layout
    from hrlplan.cost.simulator import Simulator
    from hrlplan.search import layout_of
    from hrlplan.search.common import cost_options

    sim = Simulator(meta, spec, cost_options({}, train))
    devices = (plan.meta.get("launch") or {}).get("rank_to_device") or list(range(plan.world_size))
    if not plan.heterogeneous and plan.uniform_tp:
        layouts = [layout_of(plan)]
    else:
        layouts = [Layout(spans=tuple(tuple(s.layers) for s in p.stages),
                          groups=tuple(tuple(devices[r] for r in s.ranks) for s in p.stages),
                          tp=max(s.tp for s in p.stages), dp=1, microbatch_size=p.microbatch_size,
                          num_microbatches=p.num_microbatches, schedule=plan.schedule) for p in plan.as_pipelines()]
    results = [sim.evaluate(lay, detail=True) for lay in layouts]
    worst = max(results, key=lambda r: r.step_time_s)
    memory: Dict[int, float] = {}
    for r in results:
        memory.update(r.memory_bytes)
    return {"step_time_s": worst.step_time_s, "bubble_fraction": worst.bubble_fraction,
            "memory_bytes_per_rank": [int(memory.get(devices[r], 0)) for r in range(plan.world_size)]}


# ---------------------------------------------------------------- `hrlplan calibrate`
def _cli_worker(spec_dict: Dict[str, Any], arch: Dict[str, Any], train: Dict[str, Any], data: Dict[str, Any]):
    from datetime import timedelta

    from hrlplan.cluster import ClusterSpec

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        spec = calibrate_in_job(ClusterSpec.from_dict(spec_dict), arch, train, data)
        return spec.to_dict() if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def calibrate_cli(args) -> None:
    """Measure on this machine's workers (as many as the spec's first node lists) and write the spec."""
    from hrlplan.cluster import ClusterSpec, default_nproc_per_node
    from hrlplan.config import compose
    from hrlplan.model_meta import resolve_arch
    from hrlplan.search.instances import load_cluster
    from launch.local import launch_workers

    spec = load_cluster(args.cluster)
    arch = resolve_arch(args.model_id)
    cfg = compose([])
    nproc = min(spec.node_sizes()[0], default_nproc_per_node("auto"))
    sub = ClusterSpec.from_dict(dict(spec.to_dict(), devices=[d.__dict__ for d in spec.devices[:nproc]],
                                     bandwidth=None if spec.bandwidth is None else [r[:nproc] for r in spec.bandwidth[:nproc]],
                                     latency=None if spec.latency is None else [r[:nproc] for r in spec.latency[:nproc]]))
    result = launch_workers(_cli_worker, (sub.to_dict(), arch, cfg["train"], cfg["data"]), nproc,
                            name="hrlplan-calibrate")[0]
    spec.calibration = result["calibration"]
    out = args.out or args.cluster
    spec.save(out)
    m = spec.calibration["measurements"]
    print(f"calibrated {spec.name} for {m['model']}: compute_efficiency {spec.calibration['compute_efficiency']}, "
          f"half_saturation_tokens {spec.calibration['half_saturation_tokens']}, bandwidth_efficiency "
          f"{spec.calibration.get('bandwidth_efficiency', 'n/a')}, step_time_scale "
          f"{spec.calibration['step_time_scale']:.3g}; wrote {out}")
