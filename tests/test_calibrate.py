"""Calibration: the fit recovers the cost model's figures; `hrlplan calibrate` measures and stores them."""
import json

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.cost.model import CALIBRATION_KEYS
from hrlplan.runtime.calibrate import fit_compute


def test_fit_recovers_efficiency_and_half_saturation():
    flops, peak, eff, half = 1e6, 1e10, 0.25, 100.0
    # the cost model's forward time per block is flops * (tokens + h) / (peak * eff); backward twice that
    samples = [{"tokens": t, "fwd_s": flops * (t + half) / (peak * eff), "bwd_s": 2 * flops * (t + half) / (peak * eff)}
               for t in (64, 256, 512)]
    fit = fit_compute(samples, flops, peak)
    assert fit["compute_efficiency"] == pytest.approx(eff)
    assert fit["half_saturation_tokens"] == pytest.approx(half)


@pytest.mark.slow
def test_calibrate_cli_writes_calibration_the_cost_model_reads(tmp_path):
    from hrlplan.cli import main
    from hrlplan.cost.model import DeviceModel

    devices = [DeviceInfo(rank=r, node=0, local_rank=r, hostname="h", kind="cpu", name="cpu", memory_bytes=2**33,
                          peak_flops=2e10) for r in range(2)]
    spec = ClusterSpec(name="t", devices=devices, source="file", intra_node_bw=[2e9])
    spec.save(tmp_path / "cluster.json")
    main(["calibrate", "--cluster", str(tmp_path / "cluster.json"), "--model-id", "gpt2-tiny",
          "--out", str(tmp_path / "calibrated.json")])
    cal = json.loads((tmp_path / "calibrated.json").read_text())["calibration"]
    assert {"compute_efficiency", "half_saturation_tokens", "bandwidth_efficiency", "step_time_scale"} <= set(cal)
    assert set(cal) - {"measurements"} <= set(CALIBRATION_KEYS)
    assert 0 < cal["compute_efficiency"]["cpu"] and cal["step_time_scale"] > 0
    model = DeviceModel(ClusterSpec.load(tmp_path / "calibrated.json"))
    assert model.flops[0] == pytest.approx(2e10 * cal["compute_efficiency"]["cpu"])
