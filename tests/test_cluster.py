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
