"""SLURM through submitit: the task environment, preemption/requeue, a node lost mid-step. The submitit
entry point (SubmititTask, submit), which runs hrlplan.launch.job, is hrlplan/launch/submitit_job.py.

One task per device: submitit starts `tasks_per_node` tasks on every node and each becomes one
rank; the torch.distributed environment comes from submitit's TorchDistributedEnvironment (no
torchrun inside a SLURM task).

Preemption and timeouts. SLURM sends USR2 (submitit's `--signal=USR2@signal_delay_s`; a
preemption or `job._interrupt()` too). submitit's own handler would call `checkpoint()` and
requeue at once, in the middle of a training step, where no consistent checkpoint can be written.
So inside a task we replace it with one that only raises the stop flag (hrlplan.runtime.preempt).
The trainer sees the flag at its next step boundary, all ranks write a checkpoint together, and
then `finish_preempted()` does what submitit's handler would have done: rank 0 calls the entry's
`checkpoint()` (which returns the same job with train.resume=auto), dumps it as the job's pickle
and `scontrol requeue`s the job; every rank learns that decision before it exits, so no rank
leaves a result (or an error) that the requeued job would contradict.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from submitit.core import utils as submitit_utils
from submitit.core.job_environment import _checkpoint
from submitit.helpers import TorchDistributedEnvironment
from submitit.slurm.slurm import _parse_node_list

from hrlplan.errors import UserError
from hrlplan.runtime import preempt

_SUBMITIT_HANDLER: list = [None]  # submitit's SignalHandler method we replaced (None outside a task)


def in_submitit_task() -> bool:
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and "RANK" not in os.environ


def in_srun_task() -> bool:
    """A task of a plain `srun python pretrain.py` with several tasks (launch/sbatch/ examples):
    each task is one rank, as under submitit, but SLURM's variables are all there is."""
    return ("SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ and "RANK" not in os.environ
            and not os.environ.get("SUBMITIT_EXECUTOR") and int(os.environ.get("SLURM_STEP_NUM_TASKS",
                                                                                os.environ.get("SLURM_NTASKS", "1"))) > 1)


def check_distribution(env: Optional[Dict[str, str]] = None) -> None:
    """Refuse a non-block task distribution before anything starts: plans number ranks node-major
    (hrlplan.cluster.check_block_placement checks the probed hostnames too)."""
    env = os.environ if env is None else env
    dist = (env.get("SLURM_DISTRIBUTION") or "").split(":")[0].split(",")[0].lower()
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if tasks and tasks == nodes:
        return  # one task per node: SLURM says cyclic (its default then), which is the same placement
    if dist and dist not in ("block", "pack", "nopack", "*"):
        raise UserError(f"SLURM_DISTRIBUTION={env['SLURM_DISTRIBUTION']}: hrlplan places plan ranks node-major "
                        "(rank r on node r // tasks-per-node); submit with --distribution=block")


def setup_srun_env() -> None:
    """torch.distributed's env:// variables from SLURM's (what TorchDistributedEnvironment derives)."""
    check_distribution()

    nodes = _parse_node_list(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", ""))
    world = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ["SLURM_NTASKS"])
    n_nodes = max(1, len(nodes))
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    os.environ.update({
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        # Same rule as submitit: a port derived from the job id, unless the user exported one.
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(random.Random(job_id).randint(20000, 60000)),
        "RANK": os.environ["SLURM_PROCID"],
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(world // n_nodes),
    })
    if "OMP_NUM_THREADS" not in os.environ:
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        os.environ["OMP_NUM_THREADS"] = cpus if cpus and cpus.isdigit() else "1"


def restart_count() -> int:
    """How often SLURM restarted this job (a requeue, or a node failure); 0 on the first run."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def setup_submitit_env() -> None:
    """Export MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK from the SLURM job (env:// init)."""
    check_distribution()
    env = TorchDistributedEnvironment()  # MASTER_PORT: the user's, else one derived from the job id
    # overwrite=True: a setup line may have exported MASTER_ADDR/MASTER_PORT already (the values
    # computed here honour MASTER_PORT); the rank variables must be this task's in any case.
    env.export(set_cuda_visible_devices=False, overwrite=True)
    # Without this every task's torch uses all of the node's cores (torchrun sets it too).
    if "OMP_NUM_THREADS" not in os.environ:
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        os.environ["OMP_NUM_THREADS"] = cpus if cpus and cpus.isdigit() else "1"


def install_preemption_handler(sigterm: bool = False) -> None:
    """In a SLURM task: USR2 (submitit's signal; SUBMITIT_PREEMPT_SIGNAL changes it) only raises
    the stop flag (see the module docstring). sigterm: SIGTERM too (plain srun tasks: SLURM sends
    it on preemption; under submitit, submitit already ignores SIGTERM and waits for USR2)."""
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    current = signal.getsignal(sig)
    if current is _flag_handler:
        return
    if hasattr(current, "__self__") and hasattr(current.__self__, "_delayed"):
        _SUBMITIT_HANDLER[0] = current
    signal.signal(sig, _flag_handler)
    if sigterm:
        signal.signal(signal.SIGTERM, _flag_handler)


def _flag_handler(signum, frame) -> None:
    preempt.request_stop(f"signal {signal.Signals(signum).name}")
    print(f"[hrlplan] caught {signal.Signals(signum).name}: checkpoint at the next step boundary, then requeue",
          file=sys.stderr, flush=True)


def finish_preempted(broadcast: Callable[[Any], Any], rank: int) -> None:
    """Collective, after all ranks wrote the preemption checkpoint: requeue (rank 0) and exit.

    Outside SLURM it returns at once (the run just ends after its checkpoint). In SLURM it never
    returns: SystemExit when the job is requeued (no result file, the requeued job writes
    it), an exception naming the reason when it is not (e.g. `max_num_timeout` used up), so the
    submitter sees why instead of waiting for a result that never comes.
    """
    handler = _SUBMITIT_HANDLER[0]
    if handler is None and not (os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID")):
        return  # torchrun or a plain process: stop here; `train.resume=auto` continues
    decision: Dict[str, Any] = {}
    if rank == 0:
        if handler is None:  # a plain srun task (launch/sbatch/): requeue the batch job itself
            proc = subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], capture_output=True,
                                  text=True, timeout=60)
            decision = {"reason": proc.stderr.strip() or f"scontrol requeue exited {proc.returncode}"
                        if proc.returncode else "", "requeued": True}
        else:
            obj = handler.__self__
            timed_out = obj.has_timed_out()
            countdown = obj._delayed._timeout_countdown - timed_out
            reason = _checkpoint(obj._delayed, obj._job_paths.submitted_pickle, countdown)
            if countdown < 0:
                reason = "timed-out too many times (raise hydra.launcher.max_num_timeout)"
            decision = {"reason": reason, "countdown": countdown}
    decision = broadcast(decision)
    if decision.get("reason"):
        raise submitit_utils.UncompletedJobError(
            f"stopped for preemption/timeout after a checkpoint, but the job was not requeued: "
            f"{decision['reason']}; resume it with train.resume=auto")
    if rank == 0 and not decision.get("requeued"):
        handler.__self__.env._requeue(decision["countdown"])
    print(f"[hrlplan] rank {rank}: checkpoint written, job requeued; exiting", file=sys.stderr, flush=True)
    raise SystemExit(0)


# ---------------------------------------------------------------- a node lost mid-step (launch/sbatch/elastic.sbatch)
# elastic.sbatch runs every task under a wrapper that writes "<exit code>" to <records>/<procid>.<node> when
# its task ends. When the step fails, `python -m hrlplan.launch.slurm step-failed` decides: a node whose
# task was killed by SIGKILL (the node going away, the OOM killer, kill -9), or whose task left no record
# and whose slurmd no longer answers, is lost; the job is requeued without it and re-plans for the nodes
# it gets. Any other failure (an exception, a crash) fails the job as before: a requeue would repeat it.
LOST_SIGNAL = signal.SIGKILL
_BAD_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "*")
MAX_NODE_LOSSES = 3    # requeues after a lost node per run directory (HRLPLAN_MAX_NODE_LOSSES)


def task_exits(records: Path) -> Dict[str, int]:
    """{node: exit status} from the wrapper's records (the highest status when a node ran several tasks)."""
    exits: Dict[str, int] = {}
    for path in Path(records).glob("*.*"):
        node = path.name.split(".", 1)[1]
        try:
            rc = int(path.read_text().split()[0])
        except (ValueError, IndexError):
            continue
        exits[node] = max(rc, exits.get(node, rc))
    return exits


def lost_nodes(nodes: List[str], exits: Dict[str, int], responds: Callable[[str], Optional[str]]
               ) -> Dict[str, str]:
    """{node: why} for the nodes of a failed step that are gone. A task killed by srun because another
    one failed (--kill-on-bad-exit) leaves no record (its wrapper dies with it), so a node without a
    record is asked about: responds(node) is None when it still runs a step, else why not."""
    lost = {}
    for node in nodes:
        rc = exits.get(node)
        if rc is not None and rc == 128 + LOST_SIGNAL:
            lost[node] = f"its task was killed by {LOST_SIGNAL.name}"
        elif rc is None:
            why = responds(node)
            if why:
                lost[node] = why
    return lost


def node_state(node: str) -> str:
    out = _scontrol("show", "node", "-o", node).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("State=")), "")


def node_responds(node: str, timeout_s: float = 20) -> Optional[str]:
    """None when SLURM still sees the node up and it runs a trivial step, else why not."""
    state = node_state(node)
    if any(bad in state for bad in _BAD_STATES):
        return f"SLURM reports it {state}"
    try:
        proc = subprocess.run(["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--time=1", "true"],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"a test step on it did not finish in {timeout_s:.0f} s"
    if proc.returncode:
        return f"a test step on it failed: {one_line_of(proc.stderr) or f'exit {proc.returncode}'}"
    return None


def one_line_of(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _job_field(job_id: str, field: str) -> str:
    out = _scontrol("show", "job", "-o", job_id).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(f"{field}=")), "")


def _scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)


def requeue_without(job_id: str, lost: List[str]) -> Optional[str]:
    """Requeue the job held, add the lost nodes to its excluded nodes, release it; None when done,
    else why not. The requeue ends this batch script: SIGTERM is ignored here, and SLURM's KillWait
    leaves seconds for the two calls after it. SLURM may have requeued the job already (a node that
    stopped answering: its own node-failure requeue); the exclusion is still added then."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    excluded = _job_field(job_id, "ExcNodeList")
    nodes = ([] if excluded in ("", "(null)") else [excluded]) + lost
    hold = _scontrol("requeuehold", job_id)
    if hold.returncode:
        if _job_field(job_id, "JobState") != "PENDING":
            return f"scontrol requeuehold failed: {one_line_of(hold.stderr)}"
        print(f"[sbatch] SLURM requeued job {job_id} itself (node failure)", file=sys.stderr, flush=True)
    update = _scontrol("update", f"jobid={job_id}", f"ExcNodeList={','.join(nodes)}")
    if update.returncode:   # it then may land on the lost node again
        print(f"[sbatch] warning: could not exclude {','.join(lost)}: {one_line_of(update.stderr)}",
              file=sys.stderr, flush=True)
    if not hold.returncode:
        release = _scontrol("release", job_id)
        if release.returncode:
            return f"requeued held, but scontrol release failed (release it by hand): {one_line_of(release.stderr)}"
    return None


def step_failed(records: Path, exit_code: int, run_dir: Path) -> int:
    """After a failed step of elastic.sbatch: requeue the job without its lost nodes (returns 0; the
    requeue ends the script meanwhile) or return the step's exit code (the job fails as it would have)."""
    job_id = os.environ["SLURM_JOB_ID"]
    nodes = _parse_node_list(os.environ["SLURM_JOB_NODELIST"])
    lost = lost_nodes(nodes, task_exits(records), node_responds)
    if not lost:
        print(f"[sbatch] step failed (exit {exit_code}) and no node was lost: not requeued", file=sys.stderr,
              flush=True)
        return exit_code
    told = "; ".join(f"{n}: {why}" for n, why in lost.items())
    history = Path(run_dir) / "node_losses.jsonl"
    limit = int(os.environ.get("HRLPLAN_MAX_NODE_LOSSES", MAX_NODE_LOSSES))
    seen = len(history.read_text().splitlines()) if history.exists() else 0
    if len(lost) == len(nodes) or seen >= limit:
        why = "every node of the job" if len(lost) == len(nodes) else f"{seen} node loss(es) already"
        print(f"[sbatch] lost {told}; not requeued: {why} (HRLPLAN_MAX_NODE_LOSSES={limit})",
              file=sys.stderr, flush=True)
        return exit_code
    with history.open("a") as f:
        f.write(json.dumps({"time": time.time(), "job": job_id, "restart": restart_count(), "lost": lost}) + "\n")
    print(f"[sbatch] lost {told}: requeue job {job_id} without {','.join(lost)}", file=sys.stderr, flush=True)
    failure = requeue_without(job_id, sorted(lost))
    if failure:
        print(f"[sbatch] not requeued: {failure}", file=sys.stderr, flush=True)
        return exit_code
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hrlplan.launch.slurm")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("step-failed", help="after a failed srun step: requeue without the lost nodes, if any")
    p.add_argument("--records", required=True, type=Path, help="the task wrappers' exit records")
    p.add_argument("--exit-code", required=True, type=int, help="srun's exit status")
    p.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    return step_failed(args.records, args.exit_code, args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
