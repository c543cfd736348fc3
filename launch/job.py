"""Job orchestration: probe -> introspect -> plan -> train, on every rank of a job.

pretrain.py hands the composed config here. Three situations:
- a plain process: start the workers on this machine with the elastic launcher (launch/local.py);
- under torchrun (or any launcher that set RANK/WORLD_SIZE/...): this process is a worker;
- a SLURM task started by submitit: launch/slurm.py sets up the same environment, then as above.
In a worker, every rank takes part in the probe, rank 0 introspects and plans, the plan is
broadcast, and every rank builds its stage and trains.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.errors import UserError

ERROR_FILE = ".worker_error"
# Model types whose blocks the runtime can shard with DTensor tensor parallelism (nn.Linear layers).
TP_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


# ---------------------------------------------------------------- entry from Hydra
def run_from_hydra(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from hrlplan.config import apply_top_level_aliases

    cfg = apply_top_level_aliases(cfg)
    run_dir = cfg.run_dir or HydraConfig.get().runtime.output_dir
    config = OmegaConf.to_container(cfg, resolve=True)
    config["run_dir"] = str(Path(run_dir).resolve())
    config["_t0"] = time.time()
    try:
        run(config)
    except UserError as e:
        print(f"hrlplan: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Run the job described by a resolved config dict; returns rank 0's summary where it can."""
    from launch.local import in_distributed_job, launch_workers
    from launch.slurm import in_submitit_task, setup_submitit_env

    run_dir = Path(config["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    if in_submitit_task():
        setup_submitit_env()
    if in_distributed_job():
        return worker_main(config)
    cluster = config["cluster"]
    if config["mode"] == "plan" or not cluster.get("probe", True) and not cluster.get("spec_file"):
        return plan_only(config)
    from hrlplan.cluster import default_nproc_per_node

    nproc = default_nproc_per_node(cluster.get("nproc_per_node", "auto"))
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    try:
        results = launch_workers(worker_main, (config,), nproc)
    except UserError as e:
        err = run_dir / ERROR_FILE
        if err.exists():
            raise UserError(err.read_text().strip()) from None
        raise
    return results.get(0)


# ---------------------------------------------------------------- planning without workers
def plan_only(config: Dict[str, Any]) -> Dict[str, Any]:
    """mode=plan or a preset cluster: plan in this process and stop (nothing to train here)."""
    from hrlplan.cluster import ClusterSpec, spec_from_preset

    run_dir = Path(config["run_dir"])
    c = config["cluster"]
    spec = ClusterSpec.load(c["spec_file"]) if c.get("spec_file") else spec_from_preset(c)
    spec.save(run_dir / "cluster.json")
    plan, info, meta = introspect_and_plan(config, spec)
    print(f"[hrlplan] planned for {spec.summary()}: {plan.layout()} "
          f"(predicted step {info.get('predicted', {}).get('step_time_s', float('nan')):.4g} s); "
          f"wrote {run_dir / 'plan.yaml'}. Nothing is trained for a preset cluster: run on the cluster itself.",
          file=sys.stderr)
    return {"plan": plan.to_dict()}


def planner_settings(config: Dict[str, Any], family: str, model_type: str) -> Dict[str, Any]:
    planner = dict(config["planner"])
    if family == "hrm":
        planner["max_pp"] = 1  # HRM's recurrent H/L core runs every block many times: data parallel only
    if model_type not in TP_MODEL_TYPES:
        planner["max_tp"] = 1  # e.g. GPT-2's Conv1D layers are not nn.Linear, which DTensor TP needs
    return planner


def introspect_and_plan(config: Dict[str, Any], spec):
    """Rank 0 (or a plain process): model meta and plan, with their artifacts in the run dir."""
    from hrlplan.model_meta import introspect
    from hrlplan.plan import PlanError
    from hrlplan.search import make_plan

    run_dir = Path(config["run_dir"])
    seq_len = config["data"]["seq_len"] if config["arch"].get("family") != "hrm" else None
    meta = introspect(config["arch"], seq_len=seq_len)
    meta.save(run_dir / "model_meta.json")
    train = dict(config["train"])
    try:
        plan, info = make_plan(meta, spec, planner_settings(config, meta.family, meta.model_type), train)
    except PlanError as e:
        raise UserError(str(e)) from None
    plan.save(run_dir / "plan.yaml")
    (run_dir / "plan_info.json").write_text(json.dumps(info, indent=1, default=str))
    return plan, info, meta


# ---------------------------------------------------------------- inside a worker
def worker_main(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Entry point of every rank. Errors a user can fix are written once for the launcher to show."""
    import torch.distributed as dist

    try:
        return _worker(config)
    except UserError as e:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        if rank == 0:
            Path(config["run_dir"], ERROR_FILE).write_text(str(e))
            print(f"hrlplan: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    except Exception:
        rank = int(os.environ.get("RANK", 0))
        print(f"[hrlplan] rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_distributed(config: Dict[str, Any]):
    import torch
    import torch.distributed as dist

    from hrlplan.runtime.trainer import pick_device

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(config["train"]["device"], local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    return device


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    import torch.distributed as dist

    from hrlplan.cluster import load_or_probe_in_job
    from hrlplan.plan import Plan, PlanError, check_fits

    device = _init_distributed(config)
    rank = dist.get_rank()
    run_dir = Path(config["run_dir"])
    t_probe = time.time()
    spec = load_or_probe_in_job(config["cluster"])
    probe_s = time.time() - t_probe

    # Rank 0 plans; every rank learns the plan or the one error message.
    result: Dict[str, Any] = {}
    if rank == 0:
        try:
            spec.save(run_dir / "cluster.json")
            plan, info, meta = introspect_and_plan(config, spec)
            check_fits(plan, spec)
            result = {"plan": plan.to_yaml(), "flops_per_token": meta.training_flops_per_token(),
                      "family": meta.family}
        except (UserError, PlanError, ValueError) as e:
            result = {"error": str(e)}
    result = _broadcast(result)
    if "error" in result:
        raise UserError(result["error"])
    plan = Plan.from_yaml(result["plan"])
    peak = sum(d.peak_flops for d in spec.devices) if spec is not None else None
    config["_flops_per_token"] = result["flops_per_token"]
    config["_peak_flops"] = _broadcast(peak)

    logger = _make_logger(config, rank, spec, plan)
    if logger is not None and rank == 0:
        logger.note(f"cluster: {spec.summary()} (probed in {probe_s:.1f} s)")
        logger.note(f"plan: {plan.layout()}  pp={plan.pp} dp={plan.dp} micro-batches "
                    f"{plan.num_microbatches}x{plan.microbatch_size} schedule={plan.schedule}")
    if result["family"] == "hrm":
        from hrlplan.runtime.hrm_trainer import train_hrm

        summary = train_hrm(config, str(run_dir), plan, logger)
    else:
        from hrlplan.runtime.trainer import PipelineTrainer

        trainer = PipelineTrainer(plan, config, str(run_dir), logger=logger, device=device)
        summary = trainer.fit()
    if rank == 0 and logger is not None:
        history = summary.get("history", [])
        if history:
            first_step_s = (summary.get("first_step_at") or time.time()) - config.get("_t0", time.time())
            logger.summary({"final_loss": history[-1].get("train/lm_loss"), "final_step": summary.get("final_step"),
                            "time_to_first_step_s": first_step_s})
    if logger is not None:
        logger.finish()
    return {k: v for k, v in summary.items()} if rank == 0 else None


def _make_logger(config: Dict[str, Any], rank: int, spec, plan):
    from hrlplan.runtime.metrics import MetricsLogger

    run_dir = Path(config["run_dir"])
    public = {k: v for k, v in config.items() if not k.startswith("_")}
    logger = MetricsLogger(run_dir, public, config["logger"], enabled=(rank == 0), job_type="train",
                           name=f"{config['arch']['name']}-{plan.layout().replace(' ', '')}"[:120])
    if rank == 0:
        logger.log_artifact(run_dir / "plan.yaml", "parallel-plan", name="plan")
        logger.log_artifact(run_dir / "cluster.json", "cluster-spec", name="cluster")
        rows = [[d.rank, d.node, d.hostname, d.kind, d.name, d.memory_bytes / 2**30, d.peak_flops / 1e12]
                for d in spec.devices]
        logger.log_table("probe/devices", ["rank", "node", "host", "kind", "name", "memory_GiB", "TFLOPs"], rows)
    return logger
