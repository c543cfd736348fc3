"""hrlplan/launch/job.py and friends without a cluster: the preemption flag, the plan cache key, the
rank-count error, Hydra launcher presets, the submitit entry's checkpoint hook, the timeline picture."""
from __future__ import annotations

import copy

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.compose import compose
from hrlplan.config import typed
from hrlplan.runtime import preempt


@pytest.fixture(autouse=True)
def clear_flag():
    preempt.clear()
    yield
    preempt.clear()


def spec(n=2, bw=1e9, source="probe"):
    devices = [DeviceInfo(rank=i, local_rank=i, node=0, hostname="h", kind="cpu", name="cpu", memory_bytes=8 * 2**30,
                          peak_flops=1e11, threads=1) for i in range(n)]
    return ClusterSpec(name="local", devices=devices, backend="gloo", source=source,
                       bandwidth=[[bw] * n for _ in range(n)], latency=[[1e-5] * n for _ in range(n)],
                       intra_node_bw=[bw], inter_node_bw=bw)


def test_stop_flag_is_set_by_request_and_read_without_a_process_group():
    assert not preempt.stop_requested() and not preempt.stop_agreed()
    preempt.request_stop("test")
    assert preempt.stop_requested() and preempt.stop_agreed() and preempt.stop_reason() == "test"


def test_plan_cache_key_ignores_measured_figures_but_not_settings(tmp_path):
    from hrlplan.launch import plan_cache

    config = typed(compose([]))
    config.run_dir = str(tmp_path)
    key = plan_cache.cache_key(config, spec(bw=1e9))
    assert plan_cache.cache_key(config, spec(bw=3e9)) == key  # a re-probe measures other bandwidths
    assert plan_cache.cache_key(config, spec(n=4)) != key
    other = copy.deepcopy(config)
    other.train.schedule = "gpipe"
    assert plan_cache.cache_key(other, spec()) != key
    other = copy.deepcopy(config)
    other.planner["name"] = "hrl"
    assert plan_cache.cache_key(other, spec()) != key
    assert not plan_cache.cacheable(typed(compose(["planner=manual"])))


def test_plan_cache_round_trip(tmp_path):
    from hrlplan.plan import homogeneous_plan
    from hrlplan.launch import plan_cache

    config = typed(compose([]))
    config.run_dir = str(tmp_path)
    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    assert plan_cache.load(config, "k1") is None
    plan_cache.store(config, "k1", plan, {"chosen": {"step_time_s": 1.0}})
    loaded, info = plan_cache.load(config, "k1")
    assert loaded.to_dict() == plan.to_dict() and info["chosen"]["step_time_s"] == 1.0


def test_calibration_cache_is_shared_across_runs_that_measure_the_same_thing(tmp_path, monkeypatch):
    """A sweep over lr, steps or the planner calibrates once; the dtype, batch or cluster shape
    measure something else. Entries round-trip; an unreadable one means calibrating again; the
    cache is per user (not per run), and refresh replaces an entry."""
    from hrlplan.launch import plan_cache

    monkeypatch.delenv(plan_cache.CALIBRATION_CACHE_ENV, raising=False)
    monkeypatch.delenv(plan_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = typed(compose([]))
    config.run_dir = str(tmp_path)
    key = plan_cache.calibration_key(config, spec(bw=1e9))
    assert key.startswith("calibration-") and key != plan_cache.cache_key(config, spec())
    same = [("train", "lr", 1e-4), ("train", "steps", 7), ("planner", "name", "hrl"), ("train", "schedule", "gpipe")]
    other = [("train", "dtype", "bfloat16"), ("train", "global_batch_size", 16), ("data", "seq_len", 32)]
    for group, field, value in same + other:
        changed = copy.deepcopy(config)
        if group == "planner":
            changed.planner[field] = value
        else:
            setattr(getattr(changed, group), field, value)
        assert (plan_cache.calibration_key(changed, spec()) == key) == ((group, field, value) in same), field
    assert plan_cache.calibration_key(config, spec(n=4)) != key
    assert plan_cache.load_calibration(config, key) is None
    plan_cache.store_calibration(config, key, {"compute_efficiency": {"cpu": 0.4}})
    assert plan_cache.load_calibration(config, key) == {"compute_efficiency": {"cpu": 0.4}}
    plan_cache.store_calibration(config, key, {"compute_efficiency": {"cpu": 0.5}})   # kept: no refresh
    assert plan_cache.load_calibration(config, key) == {"compute_efficiency": {"cpu": 0.4}}
    plan_cache.store_calibration(config, key, {"compute_efficiency": {"cpu": 0.5}}, replace=True)
    assert plan_cache.load_calibration(config, key) == {"compute_efficiency": {"cpu": 0.5}}
    entry = tmp_path / "xdg" / "hrlplan" / key / "calibration.json"
    entry.write_text("{not json")
    assert plan_cache.load_calibration(config, key) is None


def test_rank_count_mismatch_names_both_numbers(monkeypatch):
    from hrlplan.errors import UserError
    from hrlplan.plan import homogeneous_plan
    from hrlplan.launch.planning import check_world

    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 2), (2, 4), (4, 6)], dp=1, tp=1, microbatch_size=1,
                            num_microbatches=4, schedule="gpipe")
    check_world(plan, 3)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError) as err:
        check_world(plan, 2)
    assert "needs 3 ranks" in str(err.value) and "has 2" in str(err.value) and "SLURM job 77" in str(err.value)


def test_sweep_group_names_the_sweep_directory(tmp_path, monkeypatch):
    from hrlplan.launch.job import sweep_group

    monkeypatch.chdir(tmp_path)
    assert sweep_group("multirun/2026-01-02/03-04-05") == "multirun-2026-01-02-03-04-05"
    assert sweep_group("/elsewhere/runs/sweep7") == "elsewhere-runs-sweep7"


def _hydra_launcher(*overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    from hrlplan.compose import register_configs
    from hrlplan.conf_tree import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.hydra.launcher, resolve=False)


@pytest.mark.filterwarnings("ignore:(?s).*validated against ConfigStore schema")
def test_launcher_presets():
    slurm = _hydra_launcher("hydra/launcher=submitit_slurm")
    assert slurm["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert slurm["max_num_timeout"] > 0 and slurm["tasks_per_node"] == 2
    local = _hydra_launcher("hydra/launcher=submitit_local")
    assert local["_target_"].endswith("submitit_launcher.LocalLauncher")
    site = _hydra_launcher("hydra/launcher=slurm_site_example")
    for key in ("partition", "account", "gpus_per_node", "tasks_per_node", "nodes", "timeout_min", "setup",
                "additional_parameters"):
        assert site[key], key
    assert site["tasks_per_node"] == "${.gpus_per_node}"  # one task per GPU
    assert "export WANDB_MODE=offline" in site["setup"] and site["max_num_timeout"] > 0


def test_submitit_checkpoint_hook_only_flags_and_resubmits_with_resume():
    from hrlplan.launch.submitit_job import SubmititTask

    config = compose(["train.steps=3"])
    task = SubmititTask(config)
    delayed = task.checkpoint()
    assert preempt.stop_requested()
    assert delayed.function.config.train.resume == "auto"
    assert task.config.train.resume == "none" and config["train"]["resume"] == "none"  # the running job's is untouched


def test_finish_preempted_outside_slurm_just_returns(monkeypatch):
    from hrlplan.launch.slurm import finish_preempted

    for var in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    assert finish_preempted(lambda x: x, 0) is None


def test_hrm_memory_warning(monkeypatch, capsys):
    from hrlplan.launch.planning import HRM_CHECKED_ENV, warn_hrm_memory

    monkeypatch.delenv(HRM_CHECKED_ENV, raising=False)
    config = typed(compose(["arch=hrm", "data=sudoku"]))
    warning = warn_hrm_memory(config, 2**28, 1)  # 256 MiB: the default HRM does not fit
    assert warning and "arch.hidden_size=" in warning
    assert "warning" in capsys.readouterr().err
    assert warn_hrm_memory(config, 2**28, 1) is None  # once per job


def test_predicted_timeline_replays_gpipe():
    from hrlplan.runtime.timeline_plot import predicted_events

    plan = {"schedule": "gpipe", "pp": 2, "stages_per_rank": 1, "num_microbatches": 2}
    info = {"chosen": {"stages": [{"stage": k, "fwd_s": 1.0, "bwd_s": 2.0, "send_s": 0.0} for k in range(2)]}}
    ev = {(e["position"], e["kind"], e["microbatch"]): (e["start_s"], e["end_s"]) for e in predicted_events(plan, info)}
    assert ev[(0, "F", 0)] == (0, 1) and ev[(0, "F", 1)] == (1, 2)
    assert ev[(1, "F", 0)] == (1, 2) and ev[(1, "F", 1)] == (2, 3)
    assert ev[(1, "B", 0)] == (3, 5) and ev[(1, "B", 1)] == (5, 7)
    assert ev[(0, "B", 0)] == (5, 7) and ev[(0, "B", 1)] == (7, 9)


def test_timeline_picture_with_measured_rows(tmp_path):
    import json

    from hrlplan.plan import homogeneous_plan
    from hrlplan.runtime.timeline_plot import save_timeline

    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=1, num_microbatches=2,
                            schedule="1f1b")
    plan.save(tmp_path / "plan.yaml")
    stages = [{"stage": k, "fwd_s": 0.001, "bwd_s": 0.002, "send_s": 0.0001} for k in range(2)]
    events = [{"rank": r, "stage": r, "kind": k, "microbatch": j, "start_s": t, "end_s": t + 0.001}
              for r in range(2) for j, k, t in [(0, "F", 0.0), (1, "F", 0.001), (0, "B", 0.003), (1, "B", 0.005)]]
    (tmp_path / "plan_info.json").write_text(json.dumps(
        {"chosen": {"step_time_s": 0.009, "stages": stages}, "measured": {"step_time_s": 0.012, "events": events}}))
    out = save_timeline(tmp_path)
    assert out is not None and out.stat().st_size > 5000


def test_workers_keep_freed_memory_unless_the_user_tuned_the_allocator(monkeypatch):
    import platform
    import subprocess
    import sys

    from hrlplan.runtime.host import keep_freed_memory

    probe = [sys.executable, "-c", "from hrlplan.runtime.host import keep_freed_memory as k; print(k())"]
    if platform.libc_ver()[0] == "glibc":   # a fresh process, so the test run's own allocator stays as it was
        assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == "True"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False
