"""One measured-vs-predicted memory check for tests that train 4-block tiny models for 2 steps on gloo
(tests/test_sp_memory.py, tests/test_compile_memory.py): every rank's measured peak against plan_memory's
`tensors` (the prediction less the workspace reserve).

The cases of one world size train one after another in one launch (the worker of
launch/local_run.train_plan, looped): each case has its own trainer, whose live-tensor tracker counts
only what that trainer allocates, so a case measures the same as in a launch of its own. Starting the
workers is most of a tiny case's time."""
from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from hrlplan.plan import Plan

Measured = List[int]
Predicted = List[float]


def _worker(cases: List[Tuple[str, object, str]]):
    import torch.distributed as dist

    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker
    from hrlplan.runtime.trainer import PipelineTrainer

    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    peaks = {}
    try:
        for name, config, plan_yaml in cases:
            try:
                summary = PipelineTrainer(Plan.from_yaml(plan_yaml), config, config.run_dir, device=device).fit()
            except Exception as e:
                raise RuntimeError(f"memory case {name}: {e}") from e
            if dist.get_rank() == 0:
                peaks[name] = [m["peak"] for m in summary["measured"]["memory_split_per_rank"]]
            del summary
            gc.collect()   # the case's model and optimizer are gone before the next one starts
            dist.barrier()
        return peaks if dist.get_rank() == 0 else None
    finally:
        shutdown()


def measure_and_predict(cases: Dict[str, Tuple[Plan, Sequence[str]]], run_root: Path
                        ) -> Dict[str, Tuple[Measured, Predicted]]:
    """Train each case's plan 2 steps (its overrides: arch, its depth, batch and the options under test);
    {name: (measured peak of live tensor storage per rank, predicted tensors per rank)}."""
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.cost.plans import options_for_train, plan_memory
    from hrlplan.launch.local import launch_workers
    from hrlplan.model_meta import introspect
    from test_memory import cpu_cluster

    by_world: Dict[int, List[Tuple[str, object, str]]] = {}
    predicted: Dict[str, Predicted] = {}
    for name, (plan, overrides) in cases.items():
        cfg = compose([*overrides, "logger.mode=disabled", "train.steps=2", "train.checkpoint_interval=0"])
        config = copy.deepcopy(as_config(cfg))
        config.run_dir = str(Path(run_root) / name)
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        plan.save(Path(config.run_dir) / "plan.yaml")
        by_world.setdefault(plan.world_size, []).append((name, config, plan.to_yaml()))
        meta = introspect(cfg["arch"], seq_len=int(cfg["data"]["seq_len"]))
        # StageCostModel passes every train option (compile, recompute, ...) to the activation terms
        options = options_for_train(cfg["train"])
        assert options.compile == bool(cfg["train"].get("compile", False))
        predicted[name] = [row["tensors"] for row in plan_memory(plan, meta, cpu_cluster(plan.world_size), options)]
    measured: Dict[str, Measured] = {}
    for world, group in by_world.items():
        measured.update(launch_workers(_worker, (group,), world, name="memory-cases",
                                       log_dir=str(Path(run_root) / f"logs-world{world}"))[0])
    return {name: (measured[name], predicted[name]) for name in cases}


def assert_peak_within_10pct(name: str, measured: Sequence[int], predicted: Sequence[float]) -> None:
    """Within 10% on every rank, and never under-predicted by more than 5%."""
    errors = [(m - p) / p for m, p in zip(measured, predicted)]
    print(name, "measured", list(measured), "predicted", [round(p) for p in predicted], "errors",
          [f"{e:+.3f}" for e in errors])
    assert len(errors) == len(measured) and measured
    assert all(abs(e) <= 0.10 for e in errors), (name, errors)
    assert all(e <= 0.05 for e in errors), (name, errors)
