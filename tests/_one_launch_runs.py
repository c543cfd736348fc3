"""Several trainer runs of one world size in ONE launch of worker processes, each reporting what the
one-run helpers report: its losses, every rank's measured memory split (tests/_plan_options.py,
tests/_memory_runs.py) and whether every rank stepped the sharded optimizer across replicas
(tests/_sharded_optimizer_runs.py). Starting the workers (python, torch, gloo rendezvous per rank) is
most of a tiny run's time on CI's 2 cores; each run has its own trainer, whose live-tensor tracker
counts only what that trainer allocates, so a run measures the same as in a launch of its own."""
from __future__ import annotations

import copy
import gc
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hrlplan.plan import Plan


def _one_run(config, plan_yaml: str, env: Dict[str, str], device) -> Tuple[Dict[str, Any], bool]:
    """(the trainer's summary, whether this rank's optimizers shard across replicas), with `env` set while
    the trainer is built and fits (read there, e.g. HRLPLAN_GRAD_BUCKET_MB), restored afterwards."""
    from hrlplan.runtime.hetero_zero import ShardedReplicaOptimizer
    from hrlplan.runtime.trainer import PipelineTrainer

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        trainer = PipelineTrainer(Plan.from_yaml(plan_yaml), config, config.run_dir, device=device)
        sharded = any(isinstance(o, ShardedReplicaOptimizer) for o in trainer.optimizers.values())
        return trainer.fit(), sharded
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker(runs: List[Tuple[str, object, str, Dict[str, str]]]) -> Optional[Dict[str, Dict[str, Any]]]:
    import torch.distributed as dist

    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.host import prepare_worker

    device = init_distributed("cpu", {"collective_timeout_min": 5}).device
    prepare_worker()
    out: Dict[str, Dict[str, Any]] = {}
    try:
        for name, config, plan_yaml, env in runs:
            try:
                summary, sharded = _one_run(config, plan_yaml, env, device)
            except Exception as e:
                raise RuntimeError(f"run {name}: {e}") from e
            flags: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(flags, sharded)
            if dist.get_rank() == 0:
                out[name] = {"losses": [h["train/lm_loss"] for h in summary["history"]], "sharded": flags,
                             "memory": summary["measured"]["memory_split_per_rank"]}
            del summary
            gc.collect()   # the run's model and optimizer are gone before the next one starts
            dist.barrier()
        return out if dist.get_rank() == 0 else None
    finally:
        shutdown()


def train_in_one_launch(runs: Dict[str, Tuple[Plan, Sequence[str], int]], run_root: Path,
                        env: Optional[Dict[str, Dict[str, str]]] = None) -> Dict[str, Dict[str, Any]]:
    """{name: (plan, overrides, steps)} of one world size, trained one after another in one launch (in
    this order; each writes into run_root/name) -> {name: {"losses", "memory" (each rank's measured
    split), "sharded" (per rank)}}; no W&B and no checkpoints unless a run's overrides ask for them;
    env: {name: environment variables set while that run trains}. A plan with plan.meta
    replica_optimizer=sharded trains with the sharded optimizer, as tests/_sharded_optimizer_runs.py's."""
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    worlds = {plan.world_size for plan, _, _ in runs.values()}
    assert len(worlds) == 1, f"one launch trains plans of one world size, not {sorted(worlds)}"
    group = []
    for name, (plan, overrides, steps) in runs.items():
        # a run's overrides come after the defaults: it may checkpoint (train.checkpoint_interval, stop_after)
        cfg = compose(["logger.mode=disabled", "train.checkpoint_interval=0", *overrides, f"train.steps={steps}"])
        config = copy.deepcopy(as_config(cfg))
        config.run_dir = str(Path(run_root) / str(name))
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        plan.save(Path(config.run_dir) / "plan.yaml")
        group.append((name, config, plan.to_yaml(), dict((env or {}).get(name, {}))))
    return launch_workers(_worker, (group,), worlds.pop(), name="one-launch-runs",
                          log_dir=str(Path(run_root) / "logs"))[0]
