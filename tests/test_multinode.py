"""hrlplan on a real 3-node SLURM cluster in network namespaces (launch/local_slurm/start-multinode.sh,
node2<->node3 shaped to 1 Gbit/s; skipped with the reason where namespaces or SLURM cannot start).

- A 3-node job through hydra-submitit-launcher (one task per node): the in-job probe ran on every
  node and merged over torch.distributed; cluster.json's slowest bandwidth entry is the shaped pair;
  training ran across the nodes into one W&B run.
- Elastic re-plan: a job on 3 nodes is preempted (USR2) while node3 is drained; it checkpoints,
  requeues, restarts on node[1-2], re-plans for 2 ranks and resumes from the checkpoint resharded
  onto the new layout; the losses equal the one-process reference (tolerance: tests/test_elastic.py)
  and the W&B run id stays.
- A node lost mid-step: node3's rank is killed (SIGKILL) while the job trains on 3 nodes; the step ends
  within 60 s, elastic.sbatch requeues the job without node3, it restarts on node[1-2], re-plans and
  resumes from the last periodic checkpoint with the losses of the uninterrupted reference.
Every SLURM client runs in the box's login namespace through launch/local_slurm/mn-run. A job starts
only once all three nodes are idle, and the preemption and the kill land while the job holds at a
step (tests/_hold.py): nothing depends on how fast a node trains or frees itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _hold import StepHold
from hrlplan.compose import compose
from hrlplan.runtime.metrics import read_metrics
from hrlplan.runtime.reference import train_single_process


ROOT = Path(__file__).resolve().parent.parent
LOCAL_SLURM = ROOT / "launch" / "local_slurm"
MN_RUN = str(LOCAL_SLURM / "mn-run")
BOX_DIR = "/tmp/hrlplan-mn-test"
SHAPE = "node2-node3:rate=1gbit,delay=0.5ms"
# Own namespace names and /24: a box started by hand (or by bench/multinode.py) may run beside it.
ENV = dict(os.environ, SLURM_MN_DIR=BOX_DIR, MN_PREFIX="hrlt-", MN_SUBNET="10.213.58", LINK_SHAPE=SHAPE,
           WANDB_SILENT="true", HF_HUB_OFFLINE="1",
           HRLPLAN_PYTHON=sys.executable)
RTOL = 1e-5   # a changed reduction order, as in tests/test_elastic.py


@pytest.fixture(scope="module")
def box():
    if os.environ.get("HRLPLAN_SKIP_SLURM"):
        pytest.skip("HRLPLAN_SKIP_SLURM is set")
    if os.geteuid() != 0:
        pytest.skip("the multi-node box needs root (network namespaces, slurmd, munged)")
    try:
        proc = subprocess.run(["bash", str(LOCAL_SLURM / "start-multinode.sh"), "3"], env=ENV, capture_output=True,
                              text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("start-multinode.sh did not finish in 10 min (apt or daemons hang)")
    if proc.returncode != 0:
        pytest.skip(f"the multi-node SLURM box could not start: {proc.stderr.strip()[-800:]}")
    yield proc.stderr
    subprocess.run(["bash", str(LOCAL_SLURM / "stop-multinode.sh")], env=ENV, capture_output=True, timeout=120)


def mn(*cmd: str, timeout: float = 60, check: bool = True, env: dict = None) -> subprocess.CompletedProcess:
    """A command in the box's login namespace (where SLURM clients reach slurmctld); env: more variables."""
    proc = subprocess.run([MN_RUN, *cmd], env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def job_state(job_id: str) -> dict:
    out = mn("scontrol", "show", "job", "-o", job_id, check=False).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def wait_nodes_idle(timeout_s: float = 120) -> None:
    """Until node[1-3] are all idle: the job before may still be completing on a node, or a node just
    resumed from a drain; elastic.sbatch would take the 2 nodes it can get."""
    deadline = time.time() + timeout_s
    while True:
        states = dict(line.split() for line in mn("sinfo", "-h", "-N", "-o", "%N %t").stdout.splitlines())
        if all(states.get(n) == "idle" for n in ("node1", "node2", "node3")):
            return
        assert time.time() < deadline, f"nodes not idle after {timeout_s:.0f} s: {states}"
        time.sleep(0.5)


def submit_elastic(run: Path, out: Path, steps: int, *overrides: str, hold: StepHold) -> str:
    """launch/sbatch/elastic.sbatch on the box once its 3 nodes are idle, training into run and holding
    at hold.step (--export=ALL passes the hold's variables, a requeued job keeps them); its job id."""
    wait_nodes_idle()
    env_args = [f"--export=ALL,HRLPLAN_RUN_DIR={run},HRLPLAN_DIR={ROOT}"]
    return mn("sbatch", "--parsable", *env_args, "--partition=debug", f"--output={out}", "--time=20",
              str(ROOT / "launch" / "sbatch" / "elastic.sbatch"), f"train.steps={steps}", *overrides,
              "planner.calibrate=false", "logger.mode=offline", "train.log_interval=1",
              env=hold.env).stdout.strip().split(";")[0]


def job_log(out: Path) -> str:
    return out.read_text()[-4000:] if out.exists() else "no job output"


def wait_held(hold: StepHold, out: Path, job_id: str, ranks: int = 3, timeout_s: float = 180) -> None:
    """Until `ranks` ranks wait at hold.step; fails if the job ends first."""
    def running() -> bool:
        return job_state(job_id).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")

    hold.wait_held(ranks, alive=running, timeout_s=timeout_s, why=lambda: f"{job_state(job_id)}\n{job_log(out)}")


def wait_completed(out: Path, job_id: str, timeout_s: float = 240) -> dict:
    deadline = time.time() + timeout_s
    while (state := job_state(job_id)).get("JobState") != "COMPLETED":
        assert state.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), (state, job_log(out))
        assert time.time() < deadline, job_log(out)
        time.sleep(1)
    return state


@pytest.mark.slow
@pytest.mark.slurm
def test_three_node_job_probes_the_shaped_link(box, tmp_path):
    sweep = tmp_path / "sweep"
    wait_nodes_idle()
    mn(sys.executable, "pretrain.py", "-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={sweep}",
       "hydra.launcher.partition=debug", "hydra.launcher.nodes=3", "hydra.launcher.tasks_per_node=1",
       "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_per_cpu=null", "hydra.launcher.mem_gb=2",
       "train.steps=6", "planner.calibrate=false", "logger.mode=offline", timeout=400)
    run = sweep / "0"
    cluster = json.loads((run / "cluster.json").read_text())
    assert [d["hostname"] for d in cluster["devices"]] == ["node1", "node2", "node3"]
    assert [d["node"] for d in cluster["devices"]] == [0, 1, 2]
    bw = cluster["bandwidth"]
    pairs = {(a, b): bw[a][b] for a in range(3) for b in range(3) if a < b}
    slowest = min(pairs, key=pairs.get)
    assert slowest == (1, 2), pairs                      # node2 <-> node3, the shaped link
    assert pairs[(1, 2)] < 1.1e9 / 8                    # at most the configured 1 Gbit/s (+10 %)
    assert min(pairs[(0, 1)], pairs[(0, 2)]) > 2 * pairs[(1, 2)]
    assert cluster["inter_node_bw"] == pytest.approx(pairs[(1, 2)])
    plan = yaml.safe_load((run / "plan.yaml").read_text())
    assert plan["world_size"] == 3
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 7))
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
@pytest.mark.slurm
def test_preempted_on_three_nodes_resumes_on_two_with_a_new_plan(box, tmp_path):
    steps, preempt_at = 16, 6
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    hold = StepHold(tmp_path / "hold", preempt_at)
    # every node trains (the hold waits for 3 ranks): on a busy host the peak-figure plan may
    # otherwise leave two workers idle (a probed-link near tie; a fresh clone's CI run did)
    job_id = submit_elastic(run, out, steps, "train.checkpoint_interval=0", "planner.allow_idle_ranks=false",
                            hold=hold)
    try:
        wait_held(hold, out, job_id)
        assert job_state(job_id)["NumNodes"] == "3"
        first_plan = yaml.safe_load((run / "plan.yaml").read_text())
        mn("scontrol", "update", "nodename=node3", "state=drain", "reason=hrlplan-elastic-test")
        mn("scancel", "--signal=USR2", job_id)       # what a preemption sends
        hold.wait_stopping(1, why=lambda: job_log(out))
        hold.release()                                # the stop vote of step preempt_at sees it
        final = wait_completed(out, job_id)
    finally:
        mn("scancel", job_id, check=False)
        mn("scontrol", "update", "nodename=node3", "state=resume", check=False)
    log = out.read_text()
    assert final["Restarts"] == "1" and final["NumNodes"] == "2", final
    assert first_plan["world_size"] == 3
    assert yaml.safe_load((run / "plan.yaml").read_text())["world_size"] == 2
    cluster = json.loads((run / "cluster.json").read_text())
    assert [d["hostname"] for d in cluster["devices"]] == ["node1", "node2"]
    assert "re-plan on resume" in log and "now runs on 2 node(s) ['node1', 'node2']" in log, log[-4000:]
    replan = [json.loads(x) for x in (run / "checkpoints" / "replans.jsonl").read_text().splitlines()][-1]
    assert replan["old"].startswith("3 rank(s) on 3 node(s)") and replan["new"].startswith("2 rank(s) on 2 node(s)")
    losses = {}
    for m in read_metrics(run):    # a step trained twice (after the checkpoint) keeps its last loss
        losses[m["step"]] = m["train/lm_loss"]
    assert sorted(losses) == list(range(1, steps + 1))
    resumed_at = replan["step"]
    assert resumed_at == preempt_at
    # one process, the same LR schedule (train.steps)
    ref = [h["loss"] for h in train_single_process(compose([f"train.steps={steps}"]), steps)]
    for step in (1, resumed_at, resumed_at + 1, steps):
        assert losses[step] == pytest.approx(ref[step - 1], rel=RTOL), (step, losses[step], ref[step - 1])
    run_id = (run / "wandb_run_id.txt").read_text().strip()
    folders = list((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(run_id) for f in folders)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.slurm
def test_node_lost_mid_step_requeues_onto_the_rest_with_a_new_plan(box, tmp_path):
    """node3's rank is killed without warning (SIGKILL: a node going away, the OOM killer). The other
    ranks end within 60 s (their gloo connections close; srun's --kill-on-bad-exit), elastic.sbatch
    finds node3 lost and requeues the job excluding it; the job restarts on node[1-2], re-plans and
    resumes from the last periodic checkpoint (every 4 steps): the kill lands while the job holds at
    step 6, between two checkpoints."""
    steps, interval, kill_at = 16, 4, 6
    run, out = tmp_path / "run", tmp_path / "job.out"
    hold = StepHold(tmp_path / "hold", kill_at)
    job_id = submit_elastic(run, out, steps, f"train.checkpoint_interval={interval}", hold=hold)
    try:
        wait_held(hold, out, job_id)
        assert job_state(job_id)["NumNodes"] == "3"
        first_plan = yaml.safe_load((run / "plan.yaml").read_text())
        # one rank per node, each named by the rank itself (its hold marker: host and pid); looking
        # the ranks up by network namespace (`ip netns pids`) once found none on node2 and node3
        assert hold.held_hosts() == {0: "node1", 1: "node2", 2: "node3"}
        ranks = {hold.held_hosts()[rank]: [pid] for rank, pid in hold.held_pids().items()}
        assert all(alive(p) for pids in ranks.values() for p in pids), ranks
        os.kill(ranks["node3"][0], 9)
        killed = time.time()
        hold.release()   # node1's and node2's ranks go on to the stop vote and find node3's gone
        while any(alive(p) for n in ("node1", "node2") for p in ranks[n]) or \
                (job_state(job_id).get("JobState") == "RUNNING" and job_state(job_id).get("Restarts") == "0"):
            assert time.time() - killed < 60, (job_state(job_id), job_log(out))
            time.sleep(0.5)
        ended_s = time.time() - killed
        final = wait_completed(out, job_id)
    finally:
        mn("scancel", job_id, check=False)
    log = out.read_text()
    print(f"node3's rank killed: the job's ranks ended and it was requeued {ended_s:.1f} s later")
    assert "[sbatch] lost node3: its task was killed by SIGKILL" in log, log[-4000:]
    assert final["Restarts"] == "1" and final["NumNodes"] == "2" and final["ExcNodeList"] == "node3", final
    assert first_plan["world_size"] == 3
    assert yaml.safe_load((run / "plan.yaml").read_text())["world_size"] == 2
    replan = [json.loads(x) for x in (run / "checkpoints" / "replans.jsonl").read_text().splitlines()][-1]
    assert replan["old"].startswith("3 rank(s) on 3 node(s)") and replan["new"].startswith("2 rank(s) on 2 node(s)")
    assert replan["old"].split(": ", 1)[1] != replan["new"].split(": ", 1)[1]       # another layout
    resumed_at = replan["step"]
    assert resumed_at == interval
    # The loss continues from the checkpoint: the steps trained before the kill and again after the
    # resume (on another layout) have the same loss (tolerance: a changed reduction order).
    # tests/test_elastic.py and the preemption test above compare with a one-process reference.
    seen: dict = {}
    for m in read_metrics(run):
        seen.setdefault(m["step"], []).append(m["train/lm_loss"])
    assert sorted(seen) == list(range(1, steps + 1))
    twice = {step: losses for step, losses in seen.items() if len(losses) > 1}
    assert sorted(twice) == list(range(interval + 1, kill_at + 1)), seen
    for step, (before, after) in twice.items():
        assert after == pytest.approx(before, rel=RTOL), (step, before, after)
    run_id = (run / "wandb_run_id.txt").read_text().strip()
    assert all(f.name.endswith(run_id) for f in (run / "wandb").glob("offline-run-*"))


# ---------------------------------------------------------------- no SLURM needed
def test_task_exits_and_lost_nodes(tmp_path):
    from hrlplan.launch.slurm import lost_nodes, task_exits

    (tmp_path / "0.node1").write_text("1\n")     # lost its peer: an exception
    (tmp_path / "2.node3").write_text("137\n")   # SIGKILL
    (tmp_path / "3.node3").write_text("0\n")
    exits = task_exits(tmp_path)
    assert exits == {"node1": 1, "node3": 137}
    asked = []

    def responds(node):   # node2 left no record: killed by srun, or gone with its slurmd
        asked.append(node)
        return None if node == "node2" else "SLURM reports it DOWN*"

    assert lost_nodes(["node1", "node2", "node3"], exits, responds) == {"node3": "its task was killed by SIGKILL"}
    assert asked == ["node2"]
    assert lost_nodes(["node1", "node2", "node4"], exits, responds) == {"node4": "SLURM reports it DOWN*"}
    assert lost_nodes(["node1"], {"node1": 139}, responds) == {}    # a crash (SIGSEGV) is no lost node
