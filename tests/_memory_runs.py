"""One measured-vs-predicted memory check for tests that train a 4-block tiny model for 2 steps on gloo
(tests/test_sp_memory.py, tests/test_compile_memory.py): every rank's measured peak against plan_memory's
`tensors` (the prediction less the workspace reserve)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

from hrlplan.plan import Plan


def measure_and_predict(plan: Plan, overrides: Sequence[str], run_dir: Path) -> Tuple[List[int], List[float]]:
    """Train `plan` 2 steps (overrides: arch, its depth, batch and the options under test); per rank, the
    measured peak of live tensor storage and the predicted tensors."""
    from hrlplan.compose import compose
    from hrlplan.cost.plans import options_for_train, plan_memory
    from hrlplan.launch.local_run import train_plan
    from hrlplan.model_meta import introspect
    from test_memory import cpu_cluster

    cfg = compose([*overrides, "logger.mode=disabled", "train.steps=2", "train.checkpoint_interval=0"])
    summary = train_plan(plan, cfg, run_dir, metrics_file=False)
    measured = [m["peak"] for m in summary["measured"]["memory_split_per_rank"]]
    meta = introspect(cfg["arch"], seq_len=int(cfg["data"]["seq_len"]))
    # StageCostModel passes every train option (compile, recompute, ...) to the activation terms
    options = options_for_train(cfg["train"])
    assert options.compile == bool(cfg["train"].get("compile", False))
    predicted = [row["tensors"] for row in plan_memory(plan, meta, cpu_cluster(plan.world_size), options)]
    return measured, predicted


def assert_peak_within_10pct(name: str, measured: Sequence[int], predicted: Sequence[float]) -> None:
    """Within 10% on every rank, and never under-predicted by more than 5%."""
    errors = [(m - p) / p for m, p in zip(measured, predicted)]
    print(name, "measured", list(measured), "predicted", [round(p) for p in predicted], "errors",
          [f"{e:+.3f}" for e in errors])
    assert len(errors) == len(measured) and measured
    assert all(abs(e) <= 0.10 for e in errors), (name, errors)
    assert all(e <= 0.05 for e in errors), (name, errors)
