"""Several tiny runs in few launches, and one measured-vs-predicted memory check for tests that train
4-block tiny models for 2 steps on gloo (tests/test_sp_memory.py, tests/test_compile_memory.py): every
rank's measured peak against plan_memory's `tensors` (the prediction less the workspace reserve).

The runs of one world size train one after another in one launch (the worker of
tests/_plan_options.train_with_options, looped): each run has its own trainer, whose live-tensor
tracker counts only what that trainer allocates, so a run measures the same as in a launch of its own.
Starting the workers is most of a tiny run's time."""
from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from hrlplan.plan import Plan

Measured = List[int]
Predicted = List[float]


def _worker(runs: List[Tuple[str, object, str, dict, dict]]):
    import torch.distributed as dist

    from _plan_options import fit_with_options
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker

    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    out = {}
    try:
        for name, config, plan_yaml, stage_options, plan_options in runs:
            try:
                _, summary = fit_with_options(config, plan_yaml, stage_options, plan_options, device)
            except Exception as e:
                raise RuntimeError(f"run {name}: {e}") from e
            if dist.get_rank() == 0:
                measured = summary["measured"]
                out[name] = {"losses": [h["train/lm_loss"] for h in summary["history"]],
                             "memory": measured["memory_split_per_rank"], "step_time_s": measured["step_time_s"]}
            del summary
            gc.collect()   # the run's model and optimizer are gone before the next one starts
            dist.barrier()
        return out if dist.get_rank() == 0 else None
    finally:
        shutdown()


def train_in_few_launches(runs: Dict[str, Tuple[Plan, Sequence[str], int, dict, dict]], run_root: Path
                          ) -> Dict[str, Dict[str, Any]]:
    """{name: (plan, overrides, steps, stage options, plan options)} -> {name: {"losses", "memory" (each
    rank's measured split), "step_time_s"}}, as tests/_plan_options.train_with_options returns for one
    run: the runs of one world size train one after another in one launch."""
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    by_world: Dict[int, List[Tuple[str, object, str, dict, dict]]] = {}
    for name, (plan, overrides, steps, stage_options, plan_options) in runs.items():
        cfg = compose([*overrides, "logger.mode=disabled", f"train.steps={steps}", "train.checkpoint_interval=0"])
        config = copy.deepcopy(as_config(cfg))
        config.run_dir = str(Path(run_root) / str(name))
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        plan.save(Path(config.run_dir) / "plan.yaml")
        by_world.setdefault(plan.world_size, []).append((name, config, plan.to_yaml(), stage_options or {},
                                                         plan_options or {}))
    results: Dict[str, Dict[str, Any]] = {}
    for world, group in by_world.items():
        results.update(launch_workers(_worker, (group,), world, name="grouped-runs",
                                      log_dir=str(Path(run_root) / f"logs-world{world}"))[0])
    return {name: results[name] for name in runs}


def measure_and_predict(cases: Dict[str, Tuple[Plan, Sequence[str]]], run_root: Path
                        ) -> Dict[str, Tuple[Measured, Predicted]]:
    """Train each case's plan 2 steps (its overrides: arch, its depth, batch and the options under test);
    {name: (measured peak of live tensor storage per rank, predicted tensors per rank)}."""
    from hrlplan.compose import compose
    from hrlplan.cost.plans import options_for_train, plan_memory
    from hrlplan.model_meta import introspect
    from test_memory import cpu_cluster

    predicted: Dict[str, Predicted] = {}
    for name, (plan, overrides) in cases.items():
        cfg = compose([*overrides, "logger.mode=disabled", "train.steps=2", "train.checkpoint_interval=0"])
        meta = introspect(cfg["arch"], seq_len=int(cfg["data"]["seq_len"]))
        # StageCostModel passes every train option (compile, recompute, ...) to the activation terms
        options = options_for_train(cfg["train"])
        assert options.compile == bool(cfg["train"].get("compile", False))
        predicted[name] = [row["tensors"] for row in plan_memory(plan, meta, cpu_cluster(plan.world_size), options)]
    runs = train_in_few_launches({name: (plan, overrides, 2, None, None) for name, (plan, overrides) in cases.items()},
                                 run_root)
    return {name: ([m["peak"] for m in runs[name]["memory"]], predicted[name]) for name in cases}


def assert_peak_within_10pct(name: str, measured: Sequence[int], predicted: Sequence[float]) -> None:
    """Within 10% on every rank, and never under-predicted by more than 5%."""
    errors = [(m - p) / p for m, p in zip(measured, predicted)]
    print(name, "measured", list(measured), "predicted", [round(p) for p in predicted], "errors",
          [f"{e:+.3f}" for e in errors])
    assert len(errors) == len(measured) and measured
    assert all(abs(e) <= 0.10 for e in errors), (name, errors)
    assert all(e <= 0.05 for e in errors), (name, errors)
