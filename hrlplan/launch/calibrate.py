"""`hrlplan calibrate`: start this machine's workers, calibrate in them (hrlplan.runtime.calibrate)
and store the figures in the cluster spec."""
from __future__ import annotations

from typing import Any, Dict

import torch.distributed as dist

from hrlplan.cluster import ClusterSpec, default_nproc_per_node
from hrlplan.compose import compose
from hrlplan.config import DataConfig, TrainConfig, typed
from hrlplan.launch.local import launch_workers
from hrlplan.model_meta import resolve_arch
from hrlplan.errors import UserError
from hrlplan.runtime.calibrate import (CalibrationOverBudget, budget_seconds, calibrate_in_job, is_steady,
                                       unsteady_reason, unsteady_threshold)
from hrlplan.runtime.distributed import init_distributed, shutdown
from hrlplan.runtime.host import prepare_worker
from hrlplan.search.instances import load_cluster


def _cli_worker(spec_dict: Dict[str, Any], arch: Dict[str, Any], train: TrainConfig, data: DataConfig,
                planner: Dict[str, Any]):
    init_distributed(str(train.device), train)
    prepare_worker()
    try:
        spec = calibrate_in_job(ClusterSpec.from_dict(spec_dict), arch, train, data, planner=planner)
        return spec.to_dict() if dist.get_rank() == 0 else None
    except CalibrationOverBudget as over:   # every rank raised it; rank 0 tells the parent
        return {"over_budget": str(over)} if dist.get_rank() == 0 else None
    finally:
        shutdown()


def _first_ranks(spec: ClusterSpec, nproc: int) -> ClusterSpec:
    """The spec of its first `nproc` ranks (devices and link matrices)."""
    return ClusterSpec.from_dict(dict(spec.to_dict(), devices=[d.__dict__ for d in spec.devices[:nproc]],
                                      bandwidth=None if spec.bandwidth is None else [r[:nproc] for r in spec.bandwidth[:nproc]],
                                      latency=None if spec.latency is None else [r[:nproc] for r in spec.latency[:nproc]]))


def calibrate_cli(args) -> None:
    """Measure on this machine's workers (as many as the spec's first node lists) and write the spec."""
    spec = load_cluster(args.cluster)
    arch = resolve_arch(args.model_id)
    cfg = typed(compose([f"train.dtype={getattr(args, 'dtype', 'float32')}"]))
    nproc = min(spec.node_sizes()[0], default_nproc_per_node("auto"))
    sub = _first_ranks(spec, nproc)
    planner = dict(cfg.planner)
    budget_seconds(planner)   # bad settings are refused before any worker starts
    unsteady_threshold()
    result = launch_workers(_cli_worker, (sub.to_dict(), arch, cfg.train, cfg.data, planner), nproc,
                            name="hrlplan-calibrate")[0]
    if "over_budget" in result:
        raise UserError(f"{result['over_budget']}; nothing written to {args.out or args.cluster}")
    spec.calibration = result["calibration"]
    out = args.out or args.cluster
    spec.save(out)
    m = spec.calibration["measurements"]
    print(f"calibrated {spec.name} for {m['model']} in {m['dtype']}: compute_efficiency {spec.calibration['compute_efficiency']}, "
          f"half_saturation_tokens {spec.calibration['half_saturation_tokens']}, bandwidth_efficiency "
          f"{spec.calibration.get('bandwidth_efficiency', 'n/a')}, step_time_scale "
          f"{spec.calibration['step_time_scale']:.3g}; wrote {out}")
    if not is_steady(spec.calibration):
        print(f"warning: unsteady calibration -- {unsteady_reason(spec.calibration['steadiness'])}; a busy node? "
              f"plans costed from {out} may be far off: calibrate again on a quiet machine")
