"""Job orchestration: probe -> introspect -> plan -> train, on every rank of a job.

pretrain.py hands the composed config here. It detects its situation:
- a plain process: start the workers on this machine with the elastic launcher (hrlplan/launch/local.py);
- under torchrun (or any launcher that set RANK/WORLD_SIZE/...): this process is a worker;
- a SLURM task started by submitit (hydra/launcher=submitit_slurm, or launch.submitit_job.submit), or
  a task of a plain `srun python pretrain.py` (launch/sbatch/): hrlplan/launch/slurm.py sets up the same
  environment from SLURM's, then as above. No torchrun inside a SLURM task.
In a worker (_worker), every rank takes part in the probe, rank 0 introspects and plans (or reuses a
cached plan), the plan is broadcast, and every rank builds its stage and trains. The pieces live
beside this file: planning.py (calibration, introspection, the plan and its checks), ranks.py (process
groups, idle ranks), report.py (the logger and the report after training), plan_cache.py.
Preemption (SLURM's USR2) stops training at a step boundary with a checkpoint, then requeues
(hrlplan/runtime/preempt.py has the contract, hrlplan/launch/slurm.py the signal and requeue side).
Ctrl-C or SIGTERM outside SLURM does the same without the requeue: every worker's SIGINT/SIGTERM
handler raises the stop flag (the local launcher passes the signal on, as torchrun does), and the
launching process says where the checkpoint is and how to continue, then exits 128 + the signal.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from hrlplan.cluster import ClusterSpec, default_nproc_per_node, load_or_probe_in_job
from hrlplan.config import Config, as_config
from hrlplan.errors import UserError
from hrlplan.families import family_of
from hrlplan.launch import slurm
from hrlplan.launch.local import Interrupted, in_distributed_job, is_peer_loss, launch_workers
from hrlplan.launch.planning import (announce_workers, calibrated, check_calibration_settings, check_world,
                                     introspect_and_plan, local_device_memory, plan_only, probes_here,
                                     wants_calibration, warn_hrm_memory)
from hrlplan.launch.ranks import broadcast, init_worker, leave_idle_ranks, train_ranks
from hrlplan.launch.report import JobInfo, idle_devices_line, make_logger, predicted_step, report
from hrlplan.model_meta import ModelResolutionError
from hrlplan.plan import Plan, PlanError, check_fits
from hrlplan.search.plan_text import plan_summary
from hrlplan.runtime import preempt
from hrlplan.runtime.checkpoint import checkpoint_problem, latest_checkpoint, list_checkpoints
from hrlplan.runtime.distributed import cpu_group, shutdown
from hrlplan.runtime.metrics import duration_text
from hrlplan.runtime.mfu import job_peak_flops
from hrlplan.runtime.family_trainers import train_family
from hrlplan.runtime.train_core import nonfinite_line
from hrlplan.runtime.trainer import MFUBasis
from hrlplan.validate import check_environment

ERROR_FILE = ".worker_error"
LOCAL_AGENT_ENV = "HRLPLAN_LOCAL_AGENT"


# ---------------------------------------------------------------- entry from Hydra
def run_from_hydra(config: Config) -> Optional[Dict[str, Any]]:
    """The Hydra app's job (hrlplan/app.py, which composed and checked `config`): run in Hydra's
    output directory unless run_dir is set; in a sweep, one W&B group and a numbered run per point."""
    hc = HydraConfig.get()
    # one run: from the command's start; a sweep's jobs share a process, each from its own start
    job = JobInfo(started_at=time.time()) if hc.mode == RunMode.MULTIRUN else JobInfo()
    config.run_dir = str(Path(config.run_dir or hc.runtime.output_dir).resolve())
    if hc.mode == RunMode.MULTIRUN:
        # One W&B run per job, grouped by the sweep; the run's name says which point it is.
        config.logger.group = config.logger.group or sweep_group(str(hc.sweep.dir))
        job.sweep_index = int(hc.job.num)
    try:
        return run(config, job)
    except Interrupted as e:   # Ctrl-C/SIGTERM: where the checkpoint is, and the shell's exit status
        print(f"[hrlplan] {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except UserError as e:
        if slurm.in_submitit_task() or os.environ.get("SUBMITIT_EXECUTOR"):
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


def run(config: Config, job: Optional[JobInfo] = None) -> Optional[Dict[str, Any]]:
    """Run the job `config` describes (a Config, or compose()'s plain dict); returns rank 0's summary
    where it can."""
    config, job = as_config(config), job or JobInfo()
    run_dir = Path(config.run_dir)
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
            config.train.resume = "auto"
    if config.cluster.cpu_shares and (situation or in_distributed_job() or not probes_here(config.cluster)):
        raise UserError("cluster.cpu_shares caps the local workers this command starts; under torchrun, SLURM or "
                        "a preset cluster it starts none: leave cluster.cpu_shares out")
    if in_distributed_job():
        return worker_main(config, raise_errors=situation == "submitit", job=job)
    if not probes_here(config.cluster):
        result = plan_only(config)   # a preset or a cluster.json: planned here, nothing to train on
        _say_idle(Plan.from_dict(result["plan"]), run_dir)
        return result
    # A probed cluster, mode=plan included: the workers probe (and calibrate) the real devices.
    check_environment(config)   # what a user can get wrong, before any worker starts
    check_calibration_settings(config)
    nproc = default_nproc_per_node(config.cluster.nproc_per_node, str(config.train.device))
    warn_hrm_memory(config, local_device_memory(nproc), nproc)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    try:
        announce_workers(config, nproc)   # the workers' imports are seconds of silence otherwise
        results = launch_workers(worker_main, (config, False, job), nproc, cpu_shares=config.cluster.cpu_shares)
    except Interrupted as stop:
        return _interrupted(run_dir, stop)
    except UserError:
        err = run_dir / ERROR_FILE
        if err.exists():
            raise UserError(err.read_text().strip()) from None
        raise
    return results.get(0)


def _has_checkpoint(run_dir: Path) -> bool:
    return latest_checkpoint(run_dir / "checkpoints") is not None


def _interrupted(run_dir: Path, stop: Interrupted) -> Dict[str, Any]:
    """After Ctrl-C/SIGTERM: rank 0's summary when the run had finished anyway; else Interrupted with
    one line saying where the checkpoint is and how to continue."""
    summary = (stop.results or {}).get(0)
    if summary is not None and not summary.get("preempted"):
        return summary   # the signal came with the last step, or before a run that trains nothing
    how = f"continue with train.resume=auto (in the same run directory, hydra.run.dir={run_dir})"
    step = summary.get("final_step") if summary is not None else None
    written = summary.get("checkpoint") if summary is not None else None
    if step is not None and not written:
        written = run_dir / "checkpoints" / f"step_{int(step):06d}"   # the trainer checkpoints the step it stops at
    if written and checkpoint_problem(written) is None:
        message = (f"stopped by {stop.signal_name} at step {step}, checkpoint {written}; {how} or "
                   f"train.resume={written}")
    else:
        last = next((p for p in reversed(list_checkpoints(run_dir / "checkpoints")) if checkpoint_problem(p) is None),
                    None)
        message = f"stopped by {stop.signal_name}: {stop.how}; " + (
            f"the last complete checkpoint is {last}: {how} or train.resume={last}" if last else
            "no checkpoint was written: the run starts again from step 0")
    raise Interrupted(stop.signum, stop.results, stop.how, message=message) from None


def _stop_on_signal(signum: int, frame: Any) -> None:
    """A worker's SIGINT/SIGTERM (Ctrl-C reaches every process of the terminal's group; the local
    launcher and torchrun pass theirs on): checkpoint at the next step boundary and stop."""
    preempt.request_stop(f"signal {signal.Signals(signum).name}")


def _install_stop_handler() -> Dict[int, Any]:
    """Outside SLURM (whose tasks have slurm.install_preemption_handler): SIGINT/SIGTERM raise the
    stop flag. Returns the handlers it replaced."""
    # in_submitit_task() is False once setup_submitit_env set RANK: SLURM's own variables say it
    in_slurm_task = bool(os.environ.get("SUBMITIT_EXECUTOR") or os.environ.get("SLURM_STEP_ID"))
    if in_slurm_task or slurm.in_srun_task() or threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}



# ---------------------------------------------------------------- inside a worker
def worker_main(config: Config, raise_errors: bool = False, job: Optional[JobInfo] = None) -> Optional[Dict[str, Any]]:
    """Entry point of every rank. Errors a user can fix are written once for the launcher to show.

    raise_errors (submitit tasks): raise the UserError instead of exiting, so submitit stores it as
    the job's result and the submitter sees the message."""
    config, job = as_config(config), job or JobInfo()
    replaced = _install_stop_handler()
    try:
        return _worker(config, job)
    except UserError as e:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        if rank == 0:
            Path(config.run_dir, ERROR_FILE).write_text(str(e))
            if not os.environ.get(LOCAL_AGENT_ENV):  # our local launcher prints it once itself
                print(f"hrlplan: error: {e}", file=sys.stderr, flush=True)
        if raise_errors:
            raise
        raise SystemExit(2)
    except SystemExit:
        raise
    except Exception as e:
        rank = int(os.environ.get("RANK", 0))
        if (os.environ.get(LOCAL_AGENT_ENV) or os.environ.get("SLURM_STEP_ID")) and is_peer_loss(e):
            # only another rank's death: the local launcher (or srun and elastic.sbatch) names that rank
            print(f"[hrlplan] rank {rank} stopped: {str(e).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        else:
            print(f"[hrlplan] rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        shutdown()
        for sig, old in replaced.items():
            signal.signal(sig, old)


def _worker(config: Config, job: JobInfo) -> Optional[Dict[str, Any]]:
    """One rank's job: probe (and calibrate) -> rank 0 plans, every rank gets the plan -> train -> report."""
    device = init_worker(config.train)
    spec, probe_s = _measure(config, device)
    plan, facts = _agree_on_plan(config, spec)
    if config.mode == "plan":
        return _stop_after_planning(config, plan)
    joined = _join_training_ranks(config, spec, plan, facts)
    if joined is None:
        return None   # an idle worker: out of every collective, it exits cleanly
    plan, mfu_basis = joined
    rank = dist.get_rank()
    logger = make_logger(config, rank, spec, plan, job=job)
    if rank == 0:
        logger.note(f"cluster: {spec.summary()} (probed in {probe_s:.1f} s)")
        logger.note(f"plan: {plan.layout()}  {plan_summary(plan)}" + (" (cached plan)" if facts.get("cached") else ""))
    summary = _train(config, plan, logger, device, mfu_basis)
    if summary.get("nonfinite"):
        _stop_nonfinite(config, logger, summary)
    if rank == 0:
        report(config, plan, logger, summary, job)
    logger.finish()
    if summary.get("preempted"):
        slurm.finish_preempted(broadcast, rank)  # requeues and exits when this is a SLURM job
    # Leave together: a rank that tears its process group down while rank 0 still reports was
    # seen to abort at exit ("terminate called without an active exception"), failing the step.
    dist.barrier()
    return dict(summary) if rank == 0 else None


def _stop_nonfinite(config: Config, logger, summary: Dict[str, Any]) -> None:
    """Every rank, after a NaN/inf step stopped training (train_core): the run's record, then the one
    line as the job's error (exit 2)."""
    info = summary["nonfinite"]
    line = nonfinite_line(info, config.train, hrm=family_of(config.arch).puzzle_embeddings)
    logger.summary({"final_step": summary.get("final_step"), "stopped_at_nonfinite_step": info["step"],
                    "nonfinite": f"{info['what']} {info['value']}", "nonfinite_checkpoint": info.get("checkpoint")})
    if logger.enabled and logger.text_log is not None:
        logger.text_log.write(line + "\n")
    logger.finish()
    dist.barrier()
    raise UserError(line)


def _measure(config: Config, device) -> Tuple[Any, float]:
    """Collective: the cluster as probed (or loaded), with measured block/p2p times replacing the
    peak-FLOP estimates when calibration is wanted."""
    t_probe = time.time()
    spec = load_or_probe_in_job(config.cluster, device=device, dtype=str(config.train.dtype), group=cpu_group())
    probe_s = time.time() - t_probe
    if wants_calibration(config):
        try:
            spec = calibrated(config, spec)
        except ModelResolutionError as e:   # the model cannot be built as configured: every rank says so
            raise UserError(str(e)) from None
    return spec, probe_s


def _agree_on_plan(config: Config, spec) -> Tuple[Plan, Dict[str, Any]]:
    """Collective: rank 0 introspects and plans; every rank learns the plan or the one error message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result: Dict[str, Any] = {}
    if rank == 0:
        try:
            spec.save(Path(config.run_dir) / "cluster.json")
            plan, info, meta = introspect_and_plan(config, spec, use_cache=True)
            check_world(plan, world)
            check_fits(plan, spec)
            warn_hrm_memory(config, min(d.memory_bytes for d in spec.devices), world)
            result = {"plan": plan.to_yaml(), "flops_per_token": meta.training_flops_per_token(),
                      "cached": bool(info.get("planner", {}).get("reused_from_cache"))}
        except (UserError, PlanError, ValueError) as e:
            result = {"error": str(e)}
        except Exception:  # a bug: still tell every rank, or they would wait in the broadcast forever
            result = {"internal_error": traceback.format_exc()}
    result = broadcast(result)
    if "error" in result:
        raise UserError(result["error"])
    if "internal_error" in result:
        raise RuntimeError(f"planning failed on rank 0:\n{result['internal_error']}")
    return Plan.from_yaml(result.pop("plan")), result


def _stop_after_planning(config: Config, plan: Plan) -> Optional[Dict[str, Any]]:
    if dist.get_rank() != 0:
        return None
    run_dir = Path(config.run_dir)
    print(f"[hrlplan] mode=plan: wrote {run_dir / 'plan.yaml'} ({plan.layout()}, predicted step "
          f"{duration_text(predicted_step(plan))}); train it with planner=manual "
          f"planner.plan_file={run_dir / 'plan.yaml'}", flush=True)
    _say_idle(plan, run_dir, unit="workers")
    return {"plan": plan.to_dict()}


def _say_idle(plan: Plan, run_dir: Path, unit: str = "devices") -> None:
    """The console line of a plan that leaves some of the cluster's devices idle (cluster.json)."""
    try:
        devices = len(ClusterSpec.load(run_dir / "cluster.json").devices)
    except (OSError, ValueError, KeyError, UserError):   # no cluster.json: the plan's own ranks
        devices = plan.world_size
    line = idle_devices_line(plan, devices, unit)
    if line:
        print(f"[hrlplan] {line}", flush=True)


def _join_training_ranks(config: Config, spec, plan: Plan,
                         facts: Dict[str, Any]) -> Optional[Tuple[Plan, MFUBasis]]:
    """Collective: the plan this rank trains (renumbered when ranks stay idle) and MFU's figures;
    None on a rank the plan leaves idle, which has left the job."""
    used = train_ranks(plan)
    peak = broadcast(job_peak_flops(spec, used, config.train) if spec is not None else None)
    if dist.get_rank() == 0:
        _say_idle(plan, Path(config.run_dir), unit="workers")
    trained = leave_idle_ranks(plan, str(config.train.device), config.train)
    return None if trained is None else (trained, MFUBasis(facts["flops_per_token"], peak))


def _train(config: Config, plan, logger, device, mfu_basis: MFUBasis) -> Dict[str, Any]:
    """Train; a trainer follows hrlplan.runtime.preempt's contract: it checks the stop flag at
    every step boundary, checkpoints on all ranks and returns `preempted: True` (or raises
    preempt.Preempted)."""
    run_dir = str(config.run_dir)
    try:
        summary = train_family(config, run_dir, plan, logger, device, mfu_basis)
    except preempt.Preempted as p:
        summary = {"final_step": p.step, "history": [], "preempted": True, "checkpoint": p.checkpoint}
    total = int(summary.get("total_steps") or config.train.steps)
    if summary.get("preempted") and int(summary.get("final_step") or 0) >= total:
        summary["preempted"] = False  # the signal came with the last step: the run is complete
    if summary.get("preempted"):
        logger.note(f"stopped at step {summary.get('final_step')} for preemption/timeout or a stop request "
                    f"({preempt.stop_reason()}), after a checkpoint")
    return summary


