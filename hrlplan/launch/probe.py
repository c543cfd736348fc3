"""`hrlplan probe-cluster`: run the collective probe (hrlplan.cluster.probe_distributed) in local
workers (or in the current torchrun job), each with its process group initialised here."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.cluster import ClusterSpec, default_nproc_per_node, probe_distributed, spec_from_preset
from hrlplan.compose import compose
from hrlplan.config import ClusterConfig
from hrlplan.launch.local import in_distributed_job, launch_workers
from hrlplan.runtime.distributed import cpu_group, init_distributed, shutdown
from hrlplan.runtime.host import prepare_worker
from hrlplan.runtime.metrics import MetricsLogger


def _probe_worker(cluster_cfg: ClusterConfig, out: str, device: str = "auto",
                  dtype: str = "float32") -> Optional[Dict[str, Any]]:
    choice = init_distributed(device)   # a valid ordinal under any SLURM GPU binding
    prepare_worker()   # the threads and allocator the training workers run with: the probe measures those
    try:
        spec = probe_distributed(cluster_cfg, name=str(cluster_cfg.name), device=choice.device,
                                 dtype=dtype, group=cpu_group())
        if spec is not None:
            spec.save(out)
            return spec.to_dict()
        return None
    finally:
        shutdown()


def probe_cluster_cli(args: argparse.Namespace) -> None:
    if args.preset:
        cfg = compose([f"cluster={args.preset}"])
        spec = spec_from_preset(cfg["cluster"])   # compose()'s plain section
        spec.save(args.out)
        print(spec.summary())
        return
    cluster_cfg = ClusterConfig()
    device, dtype = getattr(args, "device", "auto"), getattr(args, "dtype", "float32")
    if in_distributed_job():  # torchrun on every node: one file, gathered over the process group
        result = _probe_worker(cluster_cfg, args.out, device, dtype)
    else:
        nproc = default_nproc_per_node(args.nproc_per_node, device)
        result = launch_workers(_probe_worker, (cluster_cfg, args.out, device, dtype), nproc, name="probe")[0]
    if result is not None:
        spec = ClusterSpec.from_dict(result)
        print(spec.summary())
        if args.wandb != "disabled":
            log_probe_run(spec, args.out, args.wandb)
        print(json.dumps({"devices": [(d.rank, d.name, round(d.peak_flops / 1e9, 1)) for d in spec.devices],
                          "bandwidth_GBps": [[round(x / 1e9, 2) for x in row] for row in spec.bandwidth or []]}))
        print(f"wrote {args.out}")


def log_probe_run(spec, out: str, mode: str) -> None:
    """A W&B run of job_type=probe beside cluster.json: the device table and the spec as an artifact."""
    run_dir = Path(out).resolve().parent
    logger = MetricsLogger(run_dir, {"cluster": spec.name}, {"mode": mode, "project": "hrlplan"},
                           job_type="probe", name=f"probe-{spec.name}", echo=False)
    logger.log_table("probe/devices", ["rank", "node", "host", "kind", "name", "memory_GiB", "TFLOPs"],
                     [[d.rank, d.node, d.hostname, d.kind, d.name, d.memory_bytes / 2**30, d.peak_flops / 1e12]
                      for d in spec.devices])
    logger.log_artifact(out, "cluster-spec", name="cluster")
    logger.finish()
