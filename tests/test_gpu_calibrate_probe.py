"""Calibration and probe logic for GPU nodes, on CPU: sizes capped at what the planner may pick and
what fits, one synchronizing clock, the probe on the training device, latency + bandwidth fitted."""
import pytest
import torch

from hrlplan import cluster, measure
from hrlplan.runtime import calibrate


def test_largest_microbatch_the_planner_may_pick():
    assert calibrate.largest_microbatch(256) == 32
    assert calibrate.largest_microbatch(256, "auto", [1, 2, 4]) == 4
    assert calibrate.largest_microbatch(8) == 8
    assert calibrate.largest_microbatch(6, "auto", [4, 16]) == 6   # no candidate divides: every divisor
    assert calibrate.largest_microbatch(256, 64) == 4


def test_llama7b_calibration_fits_the_device():
    """Llama-7B, gbs 256, seq 4096 ran one block on the whole batch (~146 GB of activations)."""
    from hrlplan.compose import compose
    from hrlplan.model_meta import introspect

    arch = compose(["arch=llama-7b"])["arch"]
    meta = introspect(arch, seq_len=4096)
    per_token = meta.block_activation_bytes_per_token[0]
    assert 256 * 4096 * per_token > 100e9          # the old size
    cap = calibrate.memory_cap(calibrate.largest_microbatch(256), 4096, per_token, free_bytes=78e9)
    sizes, block_sizes = calibrate.calibration_sizes(256, cap)
    assert max(block_sizes) * 4096 * per_token <= 0.5 * 78e9
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    # the one-process reference step (weights + AdamW states, 16 B/parameter) does not fit one GPU
    assert calibrate.memory_cap(cap, 4096, per_token, 78e9, blocks=meta.n_layer,
                                fixed_bytes=16.0 * meta.total_params) == 0
    assert calibrate.memory_cap(32, 4096, per_token, None) == 32   # CPU: no free-memory cap


def test_calibration_sizes_unchanged_for_small_batches():
    assert calibrate.calibration_sizes(8, 8) == ([1, 2, 8], [1, 2, 4, 8])


def test_one_clock_synchronizes_on_cuda(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: syncs.append(d))
    dev = torch.device("cuda", 0)
    measure.now(dev)
    assert syncs == [dev]
    assert measure.timed(lambda: None, dev, warmup=2) >= 0
    assert len(syncs) == 3
    syncs.clear()
    measure.now(torch.device("cpu"))
    assert syncs == []


def test_probe_measures_the_training_device(monkeypatch):
    """train.device=cpu on a GPU node: the probe measures the CPU it will train on."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = cluster._measure_device(torch.device("cpu"), 32, 1)
    assert info["kind"] == "cpu" and info["name"] == "cpu"


def test_probe_reports_free_memory(monkeypatch):
    class Props:
        name, total_memory = "NVIDIA H100 80GB HBM3", 80 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cluster, "GPU_MATMUL_N", 8)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: torch.ones(8, 8, dtype=k.get("dtype")))
    monkeypatch.setattr(measure, "sync_device", lambda d: None)
    info = cluster._measure_device(torch.device("cuda", 0), 8, 1, "bfloat16")
    assert info["kind"] == "cuda" and info["memory_bytes"] == 60 << 30 and info["peak_dtype"] == "bf16"


def test_latency_and_bandwidth_fit():
    sizes = [2**20, 16 * 2**20, 64 * 2**20]
    bw, lat = 150e9, 8e-6
    times = [lat + n / bw for n in sizes]
    got_bw, got_lat = measure.fit_latency_bandwidth(sizes, times)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)
    # 4 MiB alone, latency not subtracted, under-reports the link
    assert 4 * 2**20 / (lat + 4 * 2**20 / bw) < got_bw
    assert measure.fit_latency_bandwidth([10, 10], [1.0, 1.0]) == (10.0, 1.0)
    # noise that puts the fitted intercept below 0: the latency comes from the smallest message
    bw_n, lat_n = measure.fit_latency_bandwidth([1000, 10**6], [2e-6, 1.1e-3])
    assert bw_n > 0 and 0 < lat_n <= 2e-6


def test_p2p_sizes():
    cfg = {"probe_p2p_mb": 4.0, "probe_repeats": 3}
    sizes, repeats = cluster.p2p_sizes("cuda", cfg)
    assert len(sizes) >= 2 and max(sizes) >= 64 * 2**20 and repeats >= 10
    sizes, repeats = cluster.p2p_sizes("cpu", cfg)
    assert len(sizes) == 2 and max(sizes) == 4 * 2**20 and repeats == 3
