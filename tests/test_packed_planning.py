"""A data.packing=document|balanced run is planned with the packed block's memory (cost/memory.packed_meta)
and cached apart from a concat run's plan; the saved model_meta.json stays plain."""
import json

from hrlplan.cluster import spec_from_preset
from hrlplan.compose import compose
from hrlplan.config import as_config
from hrlplan.launch import planning, plan_cache
from hrlplan.launch.plan_cache import packs_documents
from hrlplan.launch.planning import introspect_and_plan


def _config(tmp_path, *extra):
    return as_config(compose(["arch=gpt2-tiny", "data=code", f"run_dir={tmp_path}", "train.global_batch_size=4"]
                             + list(extra)))


def _spec():
    return spec_from_preset(dict(name="two", node_groups=[dict(count=1, device="cpu", devices_per_node=2,
                                                                memory_gb=4, tflops=0.1, intra_node_GBps=10)],
                                 inter_node_GBps=10, intra_node_latency_us=2, inter_node_latency_us=5))


def test_packed_runs_plan_with_the_packed_memory_and_cache_apart(tmp_path, monkeypatch):
    seen = []
    real = planning.make_plan
    monkeypatch.setattr(planning, "make_plan", lambda meta, *a: seen.append(meta) or real(meta, *a))
    monkeypatch.setattr(planning, "packed_step_prediction", lambda *a: None)   # no corpus here
    concat, packed = _config(tmp_path), _config(tmp_path, "data.packing=balanced")
    assert not packs_documents(concat) and packs_documents(packed)
    assert plan_cache.cache_key(concat, _spec()) != plan_cache.cache_key(packed, _spec())
    assert plan_cache.cache_key(concat, _spec()) == plan_cache.cache_key(_config(tmp_path, "data.packing=concat"),
                                                                         _spec())
    introspect_and_plan(concat, _spec())
    introspect_and_plan(packed, _spec())
    plain, held = (m.block_activation_bytes_per_token for m in seen)
    assert all(b > a for a, b in zip(plain, held))
    saved = json.loads((tmp_path / "model_meta.json").read_text())
    assert saved["block_activation_bytes_per_token"] == plain
