"""Cluster probe (real gloo workers on this machine) and the spec's JSON schema."""
import json

import pytest

from hrlplan.errors import UserError

from hrlplan.cli import main
from hrlplan.cluster import ClusterSpec, _round_robin


def test_round_robin_pairs_every_pair_once():
    for n in (2, 3, 4, 7):
        pairs = [tuple(sorted(p)) for rnd in _round_robin(n) for p in rnd]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for rnd in _round_robin(n):
            ranks = [r for p in rnd for r in p]
            assert len(ranks) == len(set(ranks))


@pytest.mark.slow
def test_probe_cluster_cli_measures_three_workers(tmp_path):
    out = tmp_path / "cluster.json"
    main(["probe-cluster", "--out", str(out), "--nproc-per-node", "3", "--wandb", "offline"])
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1
    spec = ClusterSpec.load(out)
    assert spec.world_size == 3 and spec.nnodes == 1
    assert all(d.kind == "cpu" and d.peak_flops > 1e8 and d.memory_bytes > 0 for d in spec.devices)
    for a in range(3):
        for b in range(3):
            if a != b:
                assert spec.bw(a, b) > 1e6 and spec.lat(a, b) > 0
    blob = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    assert b"probe" in blob and b"cluster-spec" in blob   # a job_type=probe run with the spec artifact


def test_unsupported_schema_version_is_refused(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"schema_version": 99, "devices": []}))
    with pytest.raises(UserError, match="schema_version 99") as e:
        ClusterSpec.load(path)
    assert str(path) in str(e.value)   # the file is named


@pytest.mark.parametrize("change,field", [
    (lambda d: d.update(devices=[]), "no devices"),
    (lambda d: d.update(bandwidth=[[0.0]]), "bandwidth: must be a 2x2 matrix"),
    (lambda d: d.update(latency=[[0.0, -1.0], [1e-6, 0.0]]), "latency[0][1]=-1.0"),
    (lambda d: d.update(bandwidth=[[0.0, 0.0], [1e9, 0.0]]), "bandwidth[0][1]=0.0"),
    (lambda d: d["devices"][1].update(memory_bytes=-5), "devices[1].memory_bytes=-5"),
    (lambda d: d["devices"][0].update(peak_flops=0), "devices[0].peak_flops=0"),
    (lambda d: d["devices"][1].update(rank=5), "ranks [0, 5] are not 0..1"),
    (lambda d: d["devices"][0].pop("memory_bytes"), "devices[0]: missing memory_bytes"),
    (lambda d: d.update(colour="blue"), "unknown key 'colour'"),
])
def test_a_damaged_cluster_json_names_the_field_and_the_file(tmp_path, change, field):
    device = {"rank": 0, "node": 0, "local_rank": 0, "hostname": "h", "kind": "cpu", "name": "cpu",
              "memory_bytes": 2**30, "peak_flops": 1e10}
    spec = {"schema_version": 1, "name": "x", "devices": [device, dict(device, rank=1, local_rank=1)],
            "bandwidth": [[0.0, 1e9], [1e9, 0.0]], "latency": [[0.0, 1e-6], [1e-6, 0.0]]}
    ClusterSpec.from_dict(json.loads(json.dumps(spec)))   # the untouched spec loads
    change(spec)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(UserError) as e:
        ClusterSpec.load(path)
    assert field in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
