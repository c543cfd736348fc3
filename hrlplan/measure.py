"""Measuring helpers: one clock, timers, the spread of repeated timings, a point-to-point ping-pong and
the straight-line fits.

The probe (hrlplan.cluster), calibration (hrlplan.runtime.calibrate) and `hrlplan doctor` time with
these. A leaf: it imports torch only, nothing of hrlplan.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """The calibration's one clock: perf_counter after the device's queued work has finished (on
    CUDA a bare perf_counter times kernel launches, not kernels)."""
    sync_device(device)
    return time.perf_counter()


def timed(fn: Callable[[], object], device: torch.device, warmup: int = 0) -> float:
    """Seconds one call of fn takes on device, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    t0 = now(device)
    fn()
    return now(device) - t0


def timed_samples(fn: Callable[[], object], repeats: int, device: torch.device) -> List[float]:
    """Seconds of each of `repeats` timed calls of fn, after one untimed call (which pays for allocation)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = now(device)
        fn()
        times.append(now(device) - t0)
    return times


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The median of `repeats` timed calls of fn, after one untimed call (which pays for allocation)."""
    return statistics.median(timed_samples(fn, repeats, device))


# ---------------------------------------------------------------- spread of repeated timings
def relative_spread(samples: Sequence[float]) -> float:
    """How far the median of repeated timings sits above the quickest of them, as a fraction of the
    quickest: (median - min) / min. The median is the figure a calibration keeps; the quickest repeat
    is the best estimate of the undisturbed time (load only ever adds). One stray slow repeat leaves
    it at 0; a burst of foreign load over half the repeats or more -- which does move the median --
    shows in full. 0 for fewer than two samples; inf when the quickest took no time."""
    if len(samples) < 2:
        return 0.0
    quickest, middle = min(samples), statistics.median(samples)
    if quickest <= 0:
        return 0.0 if middle <= 0 else float("inf")
    return (middle - quickest) / quickest


def sample_summary(samples: Sequence[float]) -> Dict[str, float]:
    """{median_s, min_s, max_s, spread, n} of repeated timings (spread: relative_spread)."""
    xs = [float(x) for x in samples]
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
            "spread": relative_spread(xs), "n": len(xs)}


def timed_forward_backward(block: torch.nn.Module, x: torch.Tensor, device: torch.device) -> Tuple[float, float]:
    """(forward s, backward s) of one run of `block` on `x`, the device synchronised around each."""
    sync_device(device)
    t0 = now(device)
    y = block(x)
    sync_device(device)
    t1 = now(device)
    y.backward(torch.ones_like(y))
    sync_device(device)
    return t1 - t0, now(device) - t1


def collective_device() -> torch.device:
    """The device the default process group's collectives run on: this rank's current GPU when it
    reaches CUDA tensors through NCCL, else the CPU."""
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


# ---------------------------------------------------------------- straight lines
def least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points; xs must not all be equal."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def line_through(xs: List[float], ys: List[float]) -> List[float]:
    """The least-squares line's values at xs (ys as they are with fewer than 3 distinct xs)."""
    if len(set(xs)) < 3:
        return list(ys)
    slope, intercept = least_squares_line(xs, ys)
    return [slope * x + intercept for x in xs]


def fit_latency_bandwidth(sizes, one_way_s) -> tuple:
    """(bandwidth bytes/s, latency s) of t = latency + bytes / bandwidth, least squares over the
    sizes; a flat or falling line falls back to the largest size's rate. A latency the fit puts at
    or below 0 (noise on a shared host) is read off the smallest message instead: its time less its
    transfer, or its whole time -- a message never arrives in no time."""
    small, t_small = float(sizes[0]), float(one_way_s[0])
    if len(set(sizes)) >= 2:
        slope, lat = least_squares_line([float(x) for x in sizes], [float(t) for t in one_way_s])
        if slope > 0:
            bw = 1.0 / slope
            if lat <= 0:
                lat = t_small - small / bw if t_small > small / bw else t_small
            return bw, lat
    return sizes[-1] / max(one_way_s[-1], 1e-12), t_small


# ---------------------------------------------------------------- point to point
def ping_pong(me: int, peer: int, sizes, repeats: int, device: torch.device) -> tuple:
    """Run by ranks `me` and `peer` of the initialised default process group: (bandwidth, latency) of
    the pair, fitted over message sizes; a size's one-way time is half its QUICKEST of `repeats`
    round trips, each timed on its own by the rank that starts them (the lower), which then sends its
    figures to the other: both ranks return the same fit.
    Why the quickest and not the mean (or median): a round trip timed from its first send to its
    reply cannot take less than the link's own time, while a scheduling stall of either process, or
    anything else on the host, only adds to it -- the same reason the matmul probe keeps its quickest
    repeat. The mean of the repeats let one stall set the figure (a probed link 40-100x slow after one
    stall, round 5). The quickest is no underestimate because only the starting rank's timings count:
    the other rank's intervals are not round trips (each starts when its previous send returned, by
    which time the next message may already have arrived), so the quickest of them could undershoot.
    On CUDA each round trip includes one synchronize (a constant: it lands in the latency)."""
    starts = me < peer
    bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    _round_trip(bufs[-1], peer, starts, device)  # warm-up: connection setup
    one_way = [min(_round_trip(b, peer, starts, device) for _ in range(max(1, repeats))) / 2 for b in bufs]
    figures = torch.tensor(one_way, dtype=torch.float64, device=device)
    if starts:
        dist.send(figures, peer)
    else:
        dist.recv(figures, peer)
    return fit_latency_bandwidth(list(sizes), figures.tolist())


def _round_trip(t: torch.Tensor, peer: int, starts: bool, device: torch.device) -> float:
    """Seconds of one exchange of `t` with `peer`: send then receive where this rank starts, else
    receive then send."""
    t0 = now(device)
    if starts:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)
    return now(device) - t0
