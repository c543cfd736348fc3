"""Job orchestration: probe -> introspect -> plan -> train, on every rank of a job.

pretrain.py hands the composed config here. It detects its situation:
- a plain process: start the workers on this machine with the elastic launcher (hrlplan/launch/local.py);
- under torchrun (or any launcher that set RANK/WORLD_SIZE/...): this process is a worker;
- a SLURM task started by submitit (hydra/launcher=submitit_slurm, or launch.slurm.submit), or
  a task of a plain `srun python pretrain.py` (launch/sbatch/): hrlplan/launch/slurm.py sets up the same
  environment from SLURM's, then as above. No torchrun inside a SLURM task.
In a worker, every rank takes part in the probe, rank 0 introspects and plans (or reuses a cached
plan, see plan_cache.py), the plan is broadcast, and every rank builds its stage and trains.
Preemption (SLURM's USR2) stops training at a step boundary with a checkpoint, then requeues
(hrlplan/runtime/preempt.py has the contract, hrlplan/launch/slurm.py the signal and requeue side).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from hrlplan.errors import UserError
from hrlplan.runtime import preempt

ERROR_FILE = ".worker_error"
LOCAL_AGENT_ENV = "HRLPLAN_LOCAL_AGENT"
# Model types whose blocks the runtime can shard with DTensor tensor parallelism (nn.Linear layers).
# GPT-2 counts too: its Conv1D layers are converted to nn.Linear before sharding.
TP_MODEL_TYPES = {"gpt2", "llama", "mistral", "qwen2", "qwen3"}
HRM_CHECKED_ENV = "HRLPLAN_HRM_CHECKED"  # set once the HRM memory warning was considered


# ---------------------------------------------------------------- entry from Hydra
def run_from_hydra(cfg) -> Optional[Dict[str, Any]]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from hrlplan.config import to_plain
    from hrlplan.launch.slurm import in_submitit_task

    hc = HydraConfig.get()
    run_dir = cfg.run_dir or hc.runtime.output_dir
    try:
        config = to_plain(cfg, list(hc.overrides.task))
    except UserError as e:
        print(f"hrlplan: error: {e}", file=sys.stderr)
        sys.exit(2)
    config["run_dir"] = str(Path(run_dir).resolve())
    config["_t0"] = time.time()
    if hc.mode == RunMode.MULTIRUN:
        # One W&B run per job, grouped by the sweep; the run's name says which point it is.
        config["logger"]["group"] = config["logger"].get("group") or sweep_group(str(hc.sweep.dir))
        config["_job_num"] = int(hc.job.num)
    try:
        return run(config)
    except UserError as e:
        if in_submitit_task() or os.environ.get("SUBMITIT_EXECUTOR"):
            raise  # submitit records it as the job's error; an exit would leave no result at all
        print(f"hrlplan: error: {e}", file=sys.stderr)
        sys.exit(2)


def sweep_group(sweep_dir: str) -> str:
    """W&B group for a Hydra sweep: its directory, e.g. multirun/2026-01-02/03-04-05 -> multirun-2026-01-02-03-04-05."""
    path = Path(sweep_dir)
    try:
        path = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        path = Path(*path.parts[-3:])
    return "-".join(p for p in path.parts if p not in ("/", ""))[-128:]


def run(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Run the job described by a resolved config dict; returns rank 0's summary where it can."""
    from hrlplan.launch import slurm
    from hrlplan.launch.local import in_distributed_job, launch_workers

    run_dir = Path(config["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    situation = None
    if slurm.in_submitit_task():
        slurm.setup_submitit_env()
        situation = "submitit"
    elif slurm.in_srun_task():
        slurm.setup_srun_env()
        situation = "srun"
    if situation:
        slurm.install_preemption_handler(sigterm=situation == "srun")
        if slurm.restart_count() > 0 and _has_checkpoint(run_dir):
            # SLURM restarted this job (our requeue after a preemption checkpoint, a timeout, a node
            # failure): continue from this run's last checkpoint, whatever resume said at submission.
            config["train"]["resume"] = "auto"
    if in_distributed_job():
        return worker_main(config, raise_errors=situation == "submitit")
    cluster = config["cluster"]
    if not probes_here(cluster):
        return plan_only(config)   # a preset or a cluster.json: planned here, nothing to train on
    # A probed cluster, mode=plan included: the workers probe (and calibrate) the real devices.
    from hrlplan.cluster import default_nproc_per_node
    from hrlplan.validate import check_environment

    check_environment(config)   # what a user can get wrong, before any worker starts
    nproc = default_nproc_per_node(cluster.get("nproc_per_node", "auto"), config["train"]["device"])
    warn_hrm_memory(config, local_device_memory(nproc), nproc)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    try:
        results = launch_workers(worker_main, (config,), nproc)
    except UserError:
        err = run_dir / ERROR_FILE
        if err.exists():
            raise UserError(err.read_text().strip()) from None
        raise
    return results.get(0)


def probes_here(cluster: Dict[str, Any]) -> bool:
    """The job measures its own devices (cluster=local, in-job on SLURM) rather than planning for a
    preset or a cluster.json."""
    return bool(cluster.get("probe", True)) and not cluster.get("spec_file")


def wants_calibration(config: Dict[str, Any]) -> bool:
    """planner.calibrate: auto calibrates where a planner searches over real devices (a manual plan
    is only predicted, so it keeps peak figures unless asked); HRM plans data parallel only."""
    from hrlplan.search.config import calibration_mode

    mode = calibration_mode(config["planner"])
    if mode == "false" or config["arch"].get("family") == "hrm":
        return False
    return mode != "auto" or str(config["planner"].get("name")) != "manual"


def _has_checkpoint(run_dir: Path) -> bool:
    from hrlplan.runtime.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir / "checkpoints") is not None


# ---------------------------------------------------------------- checks before launch
def local_device_memory(nproc: int) -> float:
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.mem_get_info()[0])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(nproc, 1)


def warn_hrm_memory(config: Dict[str, Any], device_memory_bytes: float, world_size: int) -> Optional[str]:
    """HRM's memory guide, before anything starts: a warning (not an error) when it will not fit."""
    if config["arch"].get("family") != "hrm" or os.environ.get(HRM_CHECKED_ENV):
        return None
    from hrlplan.models.hrm import check_hrm_fits

    os.environ[HRM_CHECKED_ENV] = "1"  # the workers inherit it: one warning per job
    warning = check_hrm_fits(config["arch"], int(config["train"]["global_batch_size"]), device_memory_bytes,
                             world_size=world_size)
    if warning:
        print(f"[hrlplan] warning: {warning}", file=sys.stderr, flush=True)
    return warning


def check_world(plan, world: int) -> None:
    """The plan must use exactly the ranks this job has: a clear error before any training."""
    if plan.world_size == world:
        return
    where = f"this job has {world}"
    if os.environ.get("SLURM_JOB_ID"):
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES", "?")
        per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "?")
        where += f" (SLURM job {os.environ['SLURM_JOB_ID']}: {nodes} node(s) x {per_node} task(s) per node)"
    raise UserError(f"the plan needs {plan.world_size} ranks but {where}; re-plan for this allocation, or "
                    f"allocate {plan.world_size} ranks (hydra.launcher.nodes x hydra.launcher.tasks_per_node, or "
                    "torchrun --nnodes x --nproc-per-node)")


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
          f"(predicted step {info.get('chosen', {}).get('step_time_s', float('nan')):.4g} s); "
          f"wrote {run_dir / 'plan.yaml'}. Nothing is trained for a preset cluster: run on the cluster itself.",
          file=sys.stderr)
    if str(config["logger"].get("mode", "offline")) != "disabled":
        logger = _make_logger(config, 0, spec, plan, job_type="plan")
        _log_timeline(logger, run_dir, None)
        logger.summary({"plan/predicted_step_time_s": _predicted_step(plan)})
        logger.finish()
    return {"plan": plan.to_dict()}


def planner_settings(config: Dict[str, Any], family: str, model_type: str) -> Dict[str, Any]:
    planner = dict(config["planner"])
    if family == "hrm":
        planner["max_pp"] = 1  # HRM's recurrent H/L core runs every block many times: data parallel only
        # HRM is planned from peak figures (not calibrated): a job given N ranks (its users'
        # `torchrun --nproc-per-node 8`) trains on all of them rather than on a rough guess
        planner["allow_idle_ranks"] = False
    if model_type not in TP_MODEL_TYPES:
        planner["max_tp"] = 1  # e.g. GPT-2's Conv1D layers are not nn.Linear, which DTensor TP needs
    return planner


def introspect_and_plan(config: Dict[str, Any], spec, use_cache: bool = False):
    """Rank 0 (or a plain process): model meta and plan, with their artifacts in the run dir.

    With use_cache, a plan made earlier for the same cluster shape, model, planner and training
    settings is reused (see hrlplan/launch/plan_cache.py): a requeued job trains the plan it started with."""
    from hrlplan.model_meta import introspect
    from hrlplan.plan import PlanError
    from hrlplan.search import make_plan
    from hrlplan.launch import plan_cache

    run_dir = Path(config["run_dir"])
    seq_len = config["data"]["seq_len"] if config["arch"].get("family") != "hrm" else None
    meta = introspect(config["arch"], seq_len=seq_len)
    meta.save(run_dir / "model_meta.json")
    planner = config["planner"]
    if str(planner.get("name")) == "manual" and planner.get("plan_file") and spec.source in ("probe", "file"):
        from hrlplan.plan import Plan

        try:
            check_world(Plan.load(planner["plan_file"]), spec.world_size)  # before simulating it on this cluster
        except (OSError, PlanError):
            pass  # make_plan reports a missing or invalid file in its own words
    key = plan_cache.cache_key(config, spec) if use_cache and plan_cache.cacheable(config) else None
    cached = plan_cache.load(config, key) if key else None
    if cached is not None:
        plan, info = cached
        info.setdefault("planner", {})["reused_from_cache"] = key
    else:
        train = dict(config["train"])
        try:
            plan, info = make_plan(meta, spec, planner_settings(config, meta.family, meta.model_type), train)
        except PlanError as e:
            raise UserError(str(e)) from None
        if key:
            plan_cache.store(config, key, plan, info)
    plan.save(run_dir / "plan.yaml")
    (run_dir / "plan_info.json").write_text(json.dumps(info, indent=1, default=str))
    return plan, info, meta


# ---------------------------------------------------------------- inside a worker
def worker_main(config: Dict[str, Any], raise_errors: bool = False) -> Optional[Dict[str, Any]]:
    """Entry point of every rank. Errors a user can fix are written once for the launcher to show.

    raise_errors (submitit tasks): raise the UserError instead of exiting, so submitit stores it as
    the job's result and the submitter sees the message."""
    import torch.distributed as dist

    try:
        return _worker(config)
    except UserError as e:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        if rank == 0:
            Path(config["run_dir"], ERROR_FILE).write_text(str(e))
            if not os.environ.get(LOCAL_AGENT_ENV):  # our local launcher prints it once itself
                print(f"hrlplan: error: {e}", file=sys.stderr, flush=True)
        if raise_errors:
            raise
        raise SystemExit(2)
    except SystemExit:
        raise
    except Exception as e:
        from hrlplan.launch.local import is_peer_loss

        rank = int(os.environ.get("RANK", 0))
        if os.environ.get(LOCAL_AGENT_ENV) and is_peer_loss(e):
            # only another rank's death: the local launcher names that rank and its first error
            print(f"[hrlplan] rank {rank} stopped: {str(e).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        else:
            print(f"[hrlplan] rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        from hrlplan.runtime.distributed import shutdown

        shutdown()


def _init_distributed(config: Dict[str, Any]):
    """This rank's device (the helper that reads LOCAL_RANK, CUDA_VISIBLE_DEVICES and the GPUs
    visible), set before the process group; object collectives go on a long-timeout gloo group."""
    from hrlplan.runtime.distributed import init_distributed
    from hrlplan.runtime.host import prepare_worker

    device = init_distributed(config["train"]["device"], config["train"]).device
    prepare_worker()
    return device


def _peak_flops(spec, ranks: List[int], train: Dict[str, Any]) -> float:
    """MFU's denominator: the datasheet dense peak in the dtype the matmuls run in (TF32 for
    float32 when on), the probed figure where the device is not in the table (CPUs)."""
    from hrlplan.devices import matmul_dtype, peak_flops, tf32_setting

    dtype = matmul_dtype(train["dtype"], tf32_setting(train))
    return sum((peak_flops(spec.devices[r].name, dtype) if spec.devices[r].kind == "cuda" else None)
               or spec.devices[r].peak_flops for r in ranks)


def train_ranks(plan) -> List[int]:
    """The job ranks that train the plan (all but its unused_ranks)."""
    idle = set(plan.unused_ranks)
    return [r for r in range(plan.world_size) if r not in idle]


def leave_idle_ranks(plan, setting: str = "auto", train: Optional[Dict[str, Any]] = None):
    """Ranks a plan leaves idle drop out of the job: the used ones form a process group of their
    own over the job's store (rank 0 serves it and always trains) and train the plan renumbered
    0..k-1; an idle rank returns None. Hetero plans keep their idle ranks (their executor skips them)."""
    import torch.distributed as dist

    from hrlplan.search.placement import compact

    trained, used = compact(plan)
    if len(used) == plan.world_size:
        return plan
    if 0 not in used:
        raise UserError(f"the plan leaves rank 0 idle (unused_ranks {plan.unused_ranks}); rank 0 hosts the job's "
                        "rendezvous, so list the highest ranks as unused instead")
    from hrlplan.devices import choose_device
    from hrlplan.runtime import distributed

    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()   # no public accessor; kept alive by this reference
    distributed.shutdown()
    if rank not in used:
        return None
    new_rank = used.index(rank)
    choice = choose_device(setting)
    dist.init_process_group(**distributed.init_kwargs(choice, distributed.timeouts(train)),
                            store=dist.PrefixStore("hrlplan-used-ranks", store), rank=new_rank, world_size=len(used))
    os.environ.update(RANK=str(new_rank), WORLD_SIZE=str(len(used)))
    distributed.init_distributed(setting, train)   # the object-collective group of the new world
    return trained


def _broadcast(obj: Any) -> Any:
    from hrlplan.runtime.distributed import broadcast_object

    return broadcast_object(obj)


def _calibrated(config: Dict[str, Any], spec):
    """Collective: the spec with its calibration, the cached one for this cluster shape, model and
    settings when there is one (a requeued job, a sweep: see hrlplan/launch/plan_cache.py), else measured
    now on every rank and cached."""
    import torch.distributed as dist

    from hrlplan.runtime.calibrate import calibrate_in_job
    from hrlplan.launch import plan_cache

    from hrlplan.search.config import calibration_mode

    rank = dist.get_rank()
    refresh = calibration_mode(config["planner"]) == "refresh"
    key = plan_cache.calibration_key(config, spec) if rank == 0 else None
    cached = plan_cache.load_calibration(config, key) if rank == 0 and not refresh else None
    if _broadcast(cached is not None):
        if rank == 0:   # only rank 0 plans; the others hold no spec, as without calibration
            spec.calibration = cached
            print(f"[hrlplan] planning from the cached calibration {plan_cache.calibration_dir(config) / key} "
                  "(planner.calibrate=refresh measures again, false plans from peak figures)", flush=True)
        return spec
    if rank == 0:
        print(f"[hrlplan] calibrating: timing blocks, pipeline hops and collectives on the {spec.world_size} "
              "workers (~10-30 s, once per cluster shape and model; cached)", flush=True)
    t0 = time.time()
    spec = calibrate_in_job(spec, config["arch"], config["train"], config["data"], planner=config["planner"])
    if rank == 0:
        plan_cache.store_calibration(config, key, spec.calibration, replace=refresh)
        print(f"[hrlplan] calibrated in {time.time() - t0:.1f} s; cached in "
              f"{plan_cache.calibration_dir(config) / key}", flush=True)
    return spec


def _worker(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    import torch.distributed as dist

    from hrlplan.cluster import load_or_probe_in_job
    from hrlplan.plan import Plan, PlanError, check_fits

    device = _init_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(config["run_dir"])
    t_probe = time.time()
    spec = load_or_probe_in_job(config["cluster"], device=device, dtype=config["train"]["dtype"])
    probe_s = time.time() - t_probe
    if wants_calibration(config):
        # measured block/p2p times replace peak-FLOP estimates in the cost model
        from hrlplan.model_meta import ModelResolutionError

        try:
            spec = _calibrated(config, spec)
        except ModelResolutionError as e:   # the model cannot be built as configured: every rank says so
            raise UserError(str(e)) from None

    # Rank 0 plans; every rank learns the plan or the one error message.
    result: Dict[str, Any] = {}
    if rank == 0:
        try:
            spec.save(run_dir / "cluster.json")
            plan, info, meta = introspect_and_plan(config, spec, use_cache=True)
            check_world(plan, world)
            check_fits(plan, spec)
            warn_hrm_memory(config, min(d.memory_bytes for d in spec.devices), world)
            result = {"plan": plan.to_yaml(), "flops_per_token": meta.training_flops_per_token(),
                      "family": meta.family, "cached": bool(info.get("planner", {}).get("reused_from_cache"))}
        except (UserError, PlanError, ValueError) as e:
            result = {"error": str(e)}
        except Exception:  # a bug: still tell every rank, or they would wait in the broadcast forever
            result = {"internal_error": traceback.format_exc()}
    result = _broadcast(result)
    if "error" in result:
        raise UserError(result["error"])
    if "internal_error" in result:
        raise RuntimeError(f"planning failed on rank 0:\n{result['internal_error']}")
    plan = Plan.from_yaml(result["plan"])
    if config["mode"] == "plan":
        if rank == 0:
            print(f"[hrlplan] mode=plan: wrote {run_dir / 'plan.yaml'} ({plan.layout()}, predicted step "
                  f"{(_predicted_step(plan) or float('nan')) * 1e3:.4g} ms); train it with planner=manual "
                  f"planner.plan_file={run_dir / 'plan.yaml'}", flush=True)
        return {"plan": plan.to_dict()} if rank == 0 else None
    used = train_ranks(plan)
    peak = _peak_flops(spec, used, config["train"]) if spec is not None else None
    config["_flops_per_token"] = result["flops_per_token"]
    config["_peak_flops"] = _broadcast(peak)
    if rank == 0 and plan.unused_ranks and not plan.heterogeneous:
        print(f"[hrlplan] the plan trains on {len(used)} of {world} workers (faster than all of them here); "
              f"idle: ranks {plan.unused_ranks}", flush=True)
    plan = leave_idle_ranks(plan, config["train"]["device"], config["train"])
    if plan is None:
        return None   # an idle worker: out of every collective, it exits cleanly
    rank = dist.get_rank()

    logger = _make_logger(config, rank, spec, plan)
    if rank == 0:
        logger.note(f"cluster: {spec.summary()} (probed in {probe_s:.1f} s)")
        logger.note(f"plan: {plan.layout()}  pp={plan.pp} dp={plan.dp} micro-batches "
                    f"{plan.num_microbatches}x{plan.microbatch_size} schedule={plan.schedule}"
                    + (" (cached plan)" if result.get("cached") else ""))
    summary = _train(config, plan, logger, device, result["family"])
    if rank == 0:
        _report(config, plan, logger, summary)
    logger.finish()
    if summary.get("preempted"):
        from hrlplan.launch.slurm import finish_preempted

        finish_preempted(_broadcast, rank)  # requeues and exits when this is a SLURM job
    # Leave together: a rank that tears its process group down while rank 0 still reports was
    # seen to abort at exit ("terminate called without an active exception"), failing the step.
    dist.barrier()
    return dict(summary) if rank == 0 else None


def _train(config: Dict[str, Any], plan, logger, device, family: str) -> Dict[str, Any]:
    """Train; a trainer follows hrlplan.runtime.preempt's contract: it checks the stop flag at
    every step boundary, checkpoints on all ranks and returns `preempted: True` (or raises
    preempt.Preempted)."""
    run_dir = str(config["run_dir"])
    try:
        if family == "hrm":
            from hrlplan.runtime.hrm_trainer import train_hrm

            summary = train_hrm(config, run_dir, plan, logger)
        else:
            from hrlplan.runtime.trainer import PipelineTrainer

            summary = PipelineTrainer(plan, config, run_dir, logger=logger, device=device).fit()
    except preempt.Preempted as p:
        summary = {"final_step": p.step, "history": [], "preempted": True, "checkpoint": p.checkpoint}
    total = int(summary.get("total_steps") or config["train"]["steps"])
    if summary.get("preempted") and int(summary.get("final_step") or 0) >= total:
        summary["preempted"] = False  # the signal came with the last step: the run is complete
    if summary.get("preempted"):
        logger.note(f"stopped at step {summary.get('final_step')} for preemption/timeout ({preempt.stop_reason()}), "
                    "after a checkpoint")
    return summary


# ---------------------------------------------------------------- W&B and the report
def _predicted_step(plan) -> Optional[float]:
    return (plan.meta.get("predicted") or {}).get("step_time_s")


def _make_logger(config: Dict[str, Any], rank: int, spec, plan, job_type: str = "train"):
    from hrlplan.runtime.metrics import MetricsLogger

    run_dir = Path(config["run_dir"])
    public = {k: v for k, v in config.items() if not k.startswith("_")}
    name = f"{config['arch']['name']}-{plan.layout().replace(' ', '')}"
    if config.get("_job_num") is not None:
        name = f"{config['_job_num']}-{name}"
    logger = MetricsLogger(run_dir, public, config["logger"], enabled=(rank == 0), job_type=job_type,
                           name=name[:120])
    if rank == 0:
        predicted = _predicted_step(plan)
        if predicted:  # drawn next to the measured train/step_time_s on the same chart
            logger.constant_metrics["train/predicted_step_time_s"] = float(predicted)
        logger.log_artifact(run_dir / "plan.yaml", "parallel-plan", name="plan")
        logger.log_artifact(run_dir / "cluster.json", "cluster-spec", name="cluster")
        for name in ("plan.yaml", "plan_info.json", "cluster.json"):
            logger.save_file(run_dir / name)
        rows = [[d.rank, d.node, d.hostname, d.kind, d.name, d.memory_bytes / 2**30, d.peak_flops / 1e12]
                for d in spec.devices]
        logger.log_table("probe/devices", ["rank", "node", "host", "kind", "name", "memory_GiB", "TFLOPs"], rows)
    return logger


def measured_step_time(history) -> Optional[float]:
    """Median step time, leaving out the first step (shape inference, allocator warm-up)."""
    times = [h["train/step_time_s"] for h in history if "train/step_time_s" in h]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times) if times else None


def _log_timeline(logger, run_dir: Path, measured: Optional[float]) -> None:
    try:
        from hrlplan.runtime.timeline_plot import save_timeline

        path = save_timeline(run_dir, measured)
    except Exception as e:  # a picture is never worth failing a finished run
        logger.note(f"could not draw the pipeline timeline: {e}")
        return
    if path is not None:
        logger.log_image("pipeline/timeline", str(path))
        logger.save_file(path)


def _report(config: Dict[str, Any], plan, logger, summary: Dict[str, Any]) -> None:
    """Rank 0, after training: final numbers, predicted vs measured step time, the timeline picture."""
    run_dir = Path(config["run_dir"])
    history = summary.get("history") or []
    predicted = _predicted_step(plan)
    measured = measured_step_time(history)
    values: Dict[str, Any] = {"final_step": summary.get("final_step"), "plan/predicted_step_time_s": predicted}
    if history:
        first_step_s = (summary.get("first_step_at") or time.time()) - config.get("_t0", time.time())
        values.update(final_loss=history[-1].get("train/lm_loss"), time_to_first_step_s=first_step_s)
    if measured is not None:
        values["train/measured_step_time_s"] = measured
        if predicted:
            values["train/measured_over_predicted"] = measured / predicted
            logger.log_table("perf/step_time", ["predicted_s", "measured_s", "measured_over_predicted"],
                             [[predicted, measured, measured / predicted]])
            hint = ("" if config["planner"].get("calibrate") or config["arch"].get("family") == "hrm" else
                    "; uncalibrated: predicted from peak FLOPs and probed links, planner.calibrate=true "
                    "measures the devices first")
            logger.note(f"step time: predicted {predicted * 1e3:.3g} ms, measured {measured * 1e3:.3g} ms "
                        f"(x{measured / predicted:.2f}{hint})")
    if summary.get("preempted"):
        values["preempted_at_step"] = summary.get("final_step")
    logger.summary(values)
    _log_timeline(logger, run_dir, measured)
