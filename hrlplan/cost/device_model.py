"""The cluster as the cost model sees it: each device's sustained throughput, its links, and the
fixed costs a calibration measured (Overheads), with `cluster.calibration` applied.

Compute efficiency is the device's sustained fraction of peak -- nominal preset figures are
discounted more than measured ones -- and a saturation factor penalises small micro-batches
(kernels are latency-bound below a few hundred tokens). hrlplan.cost.model prices stages with it.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hrlplan.cost import kernels
from hrlplan.devices import peak_flops

GiB = 2 ** 30
log = logging.getLogger(__name__)
_WARNED: set = set()


def interpolate_by_tokens(points: Sequence[Tuple[float, ...]], tokens: float, index: int = 1) -> float:
    """points[i][index] at `tokens` (points[i][0]): piecewise linear, constant beyond the measured sizes."""
    if tokens <= points[0][0]:
        return float(points[0][index])
    for a, b in zip(points, points[1:]):
        if tokens <= b[0]:
            w = (tokens - a[0]) / max(b[0] - a[0], 1e-12)
            return float(a[index] + w * (b[index] - a[index]))
    return float(points[-1][index])


def _points(value, keys: Sequence[str]) -> Tuple[Tuple[float, ...], ...]:
    """[{tokens, k1, k2..}] -> ((tokens, k1, k2..), ...) sorted by tokens; () when absent."""
    if not value:
        return ()
    return tuple(sorted(tuple(float(p[k]) for k in ("tokens", *keys)) for p in value))


def _per_device(value, name: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, dict):
        return float(value.get(name, value.get("default", default)))
    return float(value)


def _pair(value, a: str, b: str) -> Tuple[float, float]:
    if value is None:
        return 0.0, 0.0
    if isinstance(value, dict):
        return float(value.get(a, 0.0)), float(value.get(b, 0.0))
    return float(value), float(value)


@dataclass(frozen=True)
class Overheads:
    """The fixed (per-call, per-collective, per-step) costs of CALIBRATION_KEYS; all zero uncalibrated."""
    op_fwd: float = 0.0
    op_bwd: float = 0.0
    p2p_latency: Optional[float] = None
    p2p_handshake: float = 0.0
    p2p_by_schedule: Tuple[Tuple[str, float], ...] = ()
    dp_allgather: float = 0.0
    dp_reduce: float = 0.0
    dp_allgather_fixed: float = 0.0
    dp_reduce_fixed: float = 0.0
    dp_hook_fwd: float = 0.0
    dp_hook_bwd: float = 0.0
    allreduce_latency: float = 0.0
    tied_allreduce: Optional[float] = None
    allreduce_fits: Tuple[Tuple[float, ...], ...] = ()   # (ranks, latency, s per byte): see allreduce_by_ranks
    opt_plain: float = 0.0
    opt_sharded: float = 0.0
    opt_ends_blocks: float = 0.0
    opt_plain_fixed: float = 0.0
    opt_sharded_fixed: float = 0.0
    opt_tp: Optional[float] = None        # tp > 1 without dp (default opt_sharded)
    opt_tp_fixed: Optional[float] = None
    step: float = 0.0
    zb_input_grad_share: Optional[float] = None
    zb_factors: Tuple[Tuple[float, ...], ...] = ()       # (tokens, input, weight): see zb_backward_factors
    bwd_ratio: Tuple[Tuple[float, ...], ...] = ()        # (tokens, backward / forward)
    tp_block: Tuple[Tuple[float, ...], ...] = ()         # (tokens, fwd, bwd): see tp_block_overhead_s
    contention: float = 1.0            # multiplies compute (the fields above already include theirs)
    pipeline_compute: float = 1.0      # multiplies the compute of pipelined stages (pipeline_compute_factor)
    compile_speedup: float = 1.0       # eager / regionally compiled block time (train.compile's, measured)

    @classmethod
    def from_calibration(cls, cal: Dict) -> "Overheads":
        """The figures as a step with every rank busy pays them (see contention_factor)."""
        f, b = _pair(cal.get("op_overhead_s"), "fwd", "bwd")
        ag, rd = _pair(cal.get("dp_collective_s"), "allgather", "reduce")
        agx, rdx = _pair(cal.get("dp_collective_fixed_s"), "allgather", "reduce")
        hf, hb = _pair(cal.get("dp_hook_s"), "fwd", "bwd")
        op, osh = _pair(cal.get("optimizer_s_per_block"), "plain", "sharded")
        opx, oshx = _pair(cal.get("optimizer_fixed_s"), "plain", "sharded")
        tp_opt = [v.get("tp") if isinstance(v, dict) else None
                  for v in (cal.get("optimizer_s_per_block"), cal.get("optimizer_fixed_s"))]
        c = cal.get("contention_factor")
        cc, cp = (1.0, 1.0) if c is None else (max(x, 1.0) for x in _pair(c, "compute", "paired"))
        p2p = cal.get("p2p_latency_s")
        zb = cal.get("zb_input_grad_share")
        return cls(op_fwd=f * cc, op_bwd=b * cc, p2p_latency=None if p2p is None else float(p2p) * cp,
                   p2p_handshake=float(cal.get("p2p_handshake_s", 0.0)) * cp, dp_allgather=ag * cp,
                   p2p_by_schedule=tuple(sorted((str(k), float(v) * cp)
                                                for k, v in (cal.get("p2p_latency_by_schedule_s") or {}).items())),
                   dp_reduce=rd * cp, dp_allgather_fixed=agx * cp, dp_reduce_fixed=rdx * cp, dp_hook_fwd=hf * cp, dp_hook_bwd=hb * cp,
                   allreduce_latency=float(cal.get("allreduce_latency_s", 0.0)) * cp, opt_plain=op * cc,
                   tied_allreduce=None if cal.get("tied_allreduce_s") is None else float(cal["tied_allreduce_s"]) * cp,
                   opt_sharded=osh * cp, opt_ends_blocks=float(cal.get("optimizer_ends_blocks", 0.0)),
                   opt_plain_fixed=opx * cc, opt_sharded_fixed=oshx * cp,
                   opt_tp=None if tp_opt[0] is None else float(tp_opt[0]) * cp,
                   opt_tp_fixed=None if tp_opt[1] is None else float(tp_opt[1]) * cp,
                   step=float(cal.get("step_overhead_s", 0.0)) * cc,
                   zb_input_grad_share=None if zb is None else float(zb),
                   zb_factors=_points(cal.get("zb_backward_factors"), ("input", "weight")),
                   bwd_ratio=_points(cal.get("backward_forward_ratio"), ("ratio",)), contention=cc,
                   pipeline_compute=max(float(cal.get("pipeline_compute_factor", 1.0)), 1.0),
                   compile_speedup=float(cal.get("compile_speedup") or 1.0),
                   tp_block=tuple((t, f * cp, b * cp) for t, f, b in _points(cal.get("tp_block_overhead_s"), ("fwd", "bwd"))),
                   allreduce_fits=tuple(sorted((float(f["ranks"]), float(f["latency_s"]), float(f["s_per_byte"]))
                                               for f in cal.get("allreduce_by_ranks") or ())))

    def optimizer_per_block(self, dp: int, tp: int) -> float:
        if dp == 1 and tp > 1 and self.opt_tp is not None:
            return self.opt_tp
        return self.opt_sharded if dp > 1 or tp > 1 else self.opt_plain

    def optimizer_fixed(self, dp: int, tp: int) -> float:
        if dp == 1 and tp > 1 and self.opt_tp_fixed is not None:
            return self.opt_tp_fixed
        return self.opt_sharded_fixed if dp > 1 or tp > 1 else self.opt_plain_fixed

    def allreduce(self, ranks: int, nbytes: float, default: float) -> float:
        """A step's all-reduce over `ranks` ranks of `nbytes` (allreduce_by_ranks); `default` without
        that calibration. Beyond the largest group measured, its figure grows with the ring's steps."""
        if ranks < 2:
            return 0.0
        if not self.allreduce_fits:
            return default
        fit = next((f for f in self.allreduce_fits if f[0] >= ranks), self.allreduce_fits[-1])
        scale = (ranks - 1) / (fit[0] - 1) if ranks > fit[0] else 1.0
        return scale * (fit[1] + nbytes * fit[2])

    def busy_derate(self, contention: Optional[float]) -> float:
        """How much of a cost calibrated as every rank busy pays it remains at a mean-field
        `contention` below the full factor (1 when none is given or ranks do not share cores)."""
        if contention is None or self.contention <= 1.0:
            return 1.0
        return min(contention / self.contention, 1.0)

    def hop(self, schedule: str) -> Tuple[Optional[float], float]:
        """(p2p latency, receive handshake) of a pipeline hop under `schedule`."""
        lat = dict(self.p2p_by_schedule).get(schedule)
        if lat is None or not self.p2p_latency:
            return self.p2p_latency, self.p2p_handshake
        return lat, self.p2p_handshake * lat / self.p2p_latency

    def backward_forward_ratio(self, tokens: float) -> float:
        return interpolate_by_tokens(self.bwd_ratio, tokens) if self.bwd_ratio else 2.0

    def zb_backward_factors(self, tokens: float) -> Optional[Tuple[float, float]]:
        """(B, W) of zero-bubble's split backward as multiples of a plain backward; None uncalibrated."""
        if not self.zb_factors:
            return None
        return interpolate_by_tokens(self.zb_factors, tokens, 1), interpolate_by_tokens(self.zb_factors, tokens, 2)


def calibrated_peak_flops(cluster, name: str) -> float:
    """The peak FLOP/s a calibrated compute_efficiency is a fraction of: the one the calibration
    recorded (peak_flops), else the median probe figure of the devices named `name`. Calibration
    times every rank's blocks; the probe's one matmul per rank is noisier (two ranks of one CPU
    1.97e11 and 1.52e11 FLOP/s), and a device's own figure made the stage on the luckier rank 30%
    faster than the one beside it in the model, not in the run."""
    recorded = (cluster.calibration or {}).get("peak_flops")
    if isinstance(recorded, dict) and recorded.get(name):
        return float(recorded[name])
    return statistics.median(d.peak_flops for d in cluster.devices if d.name == name)


def matmul_dtype_key(bytes_per_value: int, tf32: bool = True) -> str:
    """The datasheet column a run's matmuls reach: 16-bit, or float32 on TF32 (train.tf32) or not."""
    return "bf16" if bytes_per_value <= 2 else ("tf32" if tf32 else "fp32")


def _datasheet(name: str, key: str) -> Optional[float]:
    """A device's datasheet peak in a dtype column: bf16 falls back to fp16 (V100), tf32 to fp32
    (a part without TF32 runs float32 matmuls in float32: V100's 15.7 TF/s, not 62.5)."""
    fallback = {"bf16": "fp16", "tf32": "fp32"}.get(key)
    return peak_flops(name, key) or (peak_flops(name, fallback) if fallback else None)


def matmul_peak(device, bytes_per_value: int, tf32: bool = True) -> float:
    """A device's matmul peak in the run's dtype: its figure (a preset's 16-bit datasheet peak, or a
    probe's measurement in `peak_dtype`) converted by the datasheet's ratio of the two columns
    (hrlplan.devices). A device the table lacks keeps its figure for 16-bit, half of it for TF32
    and a sixteenth for plain float32 (the A100/H100 ratios), and says so (unknown_peak_ratio)."""
    target = matmul_dtype_key(bytes_per_value, tf32)
    source = {"fp16": "bf16"}.get(getattr(device, "peak_dtype", "bf16"), getattr(device, "peak_dtype", "bf16"))
    if target == source:
        return device.peak_flops
    have, want = _datasheet(device.name, source), _datasheet(device.name, target)
    if have and want:
        return device.peak_flops * want / have
    rank = {"bf16": 16.0, "tf32": 8.0, "fp32": 1.0}
    return device.peak_flops * rank[target] / rank[source]


def unknown_peak_ratio(device) -> bool:
    """True when matmul_peak had to guess the device's dtype ratio (a GPU not in the datasheet table)."""
    return device.kind == "cuda" and _datasheet(device.name, "bf16") is None


# NCCL's achieved bus bandwidth over a preset link's nominal per-direction rate, as the NCCL team at
# NVIDIA states it for large messages (docs/cost-model.md "Link efficiencies" quotes each source).
# NVLink, by the device's name (first row whose tokens the name has): A100 230 of 300 GB/s (12
# NVLink3 links at ~20 of 25 GB/s effective, less a GPU bottleneck); A800 160 of 200; Hopper (NVLink4)
# 370 of 450 in a ring -- NVLink SHARP's all-reduce is not modelled; V100 (NVLink2, 25 GB/s links too)
# the per-link 20 of 25, no V100 figure being found.
NVLINK_EFFICIENCY = (("A800", 160 / 200), ("A100", 230 / 300), ("H100", 370 / 450), ("H800", 370 / 450),
                     ("H200", 370 / 450), ("H20", 370 / 450), ("V100", 20 / 25))
# InfiniBand with GPUDirect RDMA, by the per-GPU NIC's line rate (bytes/s): 100 Gb/s 12 GB/s, HDR 200
# Gb/s 24 GB/s, NDR 400 Gb/s 46-48 GB/s (the middle taken).
NIC_EFFICIENCY = ((12.5e9, 12 / 12.5), (25e9, 24 / 25), (50e9, 47 / 50))
# Every other uncalibrated link (PCIe, a CPU's network, a GPU or NIC the tables lack, a probed matrix): no source.
UNSOURCED_LINK_EFFICIENCY = 0.8


def link_efficiency(cluster, a: int, b: int) -> float:
    """The fraction of a preset's nominal bandwidth between ranks a and b that NCCL achieves."""
    da, db = cluster.devices[a], cluster.devices[b]
    if da.kind != "cuda" or db.kind != "cuda":
        return UNSOURCED_LINK_EFFICIENCY
    if da.node == db.node:
        found = [next((e for key, e in NVLINK_EFFICIENCY if kernels.name_has_key(d.name, key)), None)
                 for d in (da, db)]
        return UNSOURCED_LINK_EFFICIENCY if None in found else min(found)
    rate = cluster.inter_node_bw
    return next((e for nominal, e in NIC_EFFICIENCY if abs(rate - nominal) <= 0.01 * nominal),
                UNSOURCED_LINK_EFFICIENCY)


class DeviceModel:
    """Throughput, links and memory of a cluster's devices, with calibration applied."""

    def __init__(self, cluster):
        self.cluster = cluster
        cal = cluster.calibration or {}
        # measured peaks: a probe, or a probe saved to a file (it keeps its bandwidth matrix); a preset
        # saved to a file (spec_file) keeps its nominal figures and their discount
        measured = cluster.source == "probe" or (cluster.source == "file" and cluster.bandwidth is not None)
        self.measured = measured
        self.flat_compute = cal.get("compute_efficiency") is not None   # calibrated: FLOPs / fitted speed
        self.flops: List[float] = []
        self.half_tokens: List[float] = []
        self.workspace: List[float] = []
        for d in cluster.devices:
            default_eff = 0.7 if measured else 0.5
            eff = _per_device(cal.get("compute_efficiency"), d.name, default_eff)
            peak = d.peak_flops if cal.get("compute_efficiency") is None else calibrated_peak_flops(cluster, d.name)
            self.flops.append(peak * eff)
            self.half_tokens.append(_per_device(cal.get("half_saturation_tokens"), d.name,
                                                256.0 if d.kind == "cuda" else 8.0))
            self.workspace.append(_per_device(cal.get("workspace_bytes"), d.name,
                                              1.0 * GiB if d.kind == "cuda" else 0.1 * GiB))
        # a calibrated efficiency is the user's own links'; else a preset's nominal links get NCCL's
        # sourced figures (link_efficiency) and anything measured keeps the unsourced default
        calibrated_eff = cal.get("bandwidth_efficiency")
        self.bw_eff = UNSOURCED_LINK_EFFICIENCY if calibrated_eff is None else float(calibrated_eff)
        self.sourced_links = calibrated_eff is None and not measured and cluster.bandwidth is None
        self.time_scale = float(cal.get("step_time_scale", 1.0))
        self.overheads = Overheads.from_calibration(cal)
        self._bw_cache: Dict[Tuple[int, int], float] = {}

    def memory_limit(self, dev: int, margin: float) -> float:
        return self.cluster.devices[dev].memory_bytes * margin

    def throughput(self, dev: int, tokens: float) -> float:
        """Sustained FLOP/s on a micro-batch of `tokens` tokens."""
        return self.flops[dev] * tokens / (tokens + self.half_tokens[dev])

    def bw(self, a: int, b: int) -> float:
        key = (a, b)
        if key not in self._bw_cache:
            eff = link_efficiency(self.cluster, a, b) if self.sourced_links else self.bw_eff
            self._bw_cache[key] = self.cluster.bw(a, b) * eff
        return self._bw_cache[key]

    def ring_bw_lat(self, ranks: Sequence[int]) -> Tuple[float, float]:
        """Bandwidth and per-hop latency of a ring over `ranks` (in ring order): its slowest hop."""
        if len(ranks) < 2:
            return float("inf"), 0.0
        hops = list(zip(ranks, list(ranks[1:]) + [ranks[0]]))
        return (min(self.bw(a, b) for a, b in hops), max(self.cluster.lat(a, b) for a, b in hops))


def all_reduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce: 2(n-1)/n of the payload over the slowest link, 2(n-1) latency hops."""
    if n < 2:  # (nbytes may be an array: the planners evaluate every layer span at once)
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * lat


_GUESSES = {   # cost_options key: (the table lacking it, what is guessed)
    "kernel_table_missing": ("hrlplan/cost/kernels.py GPU_FACTS", "HBM bandwidth and SM count are guessed"),
    "datasheet_missing": ("hrlplan/devices.py PEAKS", "float32 peak is guessed from its 16-bit one"),
    "bf16_missing": ("its datasheet's bf16 column (no bf16 tensor cores)", "bfloat16 is costed at its fp16 peak"),
    "attention_curve_missing": ("hrlplan/cost/kernels.py FLASH2_FWD_BWD (published or measured fused-attention rates)",
                                "fused attention runs at ATTENTION_FRACTION of its peak"),
}


def fp8_speedup(device, bytes_per_value: int, tf32: bool) -> float:
    """The device's fp8 matmul peak over its peak in the run's dtype (1 without an fp8 path: such
    a device is refused train.float8 before any worker starts)."""
    fp8 = peak_flops(device.name, "fp8") if device.kind == "cuda" else None
    base = matmul_peak(device, bytes_per_value, tf32)
    return fp8 / base if fp8 and base else 1.0


def guessed_device_facts(cluster, shape_aware: bool, float32: bool, fused_attention: bool = True) -> Dict[str, list]:
    """GPU names whose kernel facts (HBM bandwidth, SMs: kernels.GPU_FACTS), float32 ratio
    (hrlplan.devices.PEAKS), bf16 path (V100, T4) or fused-attention rate (a published or measured curve) the
    tables lack, so the cost model guesses; each warned of once."""
    gpus = sorted({d.name for d in cluster.devices if d.kind == "cuda"})
    out = {"kernel_table_missing": [n for n in gpus if shape_aware and not kernels.in_kernel_table(n)],
           "datasheet_missing": sorted({d.name for d in cluster.devices if float32 and unknown_peak_ratio(d)}),
           "bf16_missing": [n for n in gpus if not float32 and peak_flops(n, "bf16") is None
                            and peak_flops(n, "fp16") is not None],
           "attention_curve_missing": [n for n in gpus if shape_aware and fused_attention and not float32
                                       and kernels.flash_attention_fraction(n, 2048) is None]}
    for key, names in out.items():
        for name in names:
            if (key, name) not in _WARNED:
                _WARNED.add((key, name))
                table, guess = _GUESSES[key]
                log.warning("cost model: device %r is not in %s: its %s (calibrate for a measured figure: "
                            "planner.calibrate=true)", name, table, guess)
    return out
