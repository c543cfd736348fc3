"""hydra/launcher=submitit_slurm fits its request to the partition, refuses what no node can hold before
submitting, and fails a sweep whose jobs pend for a reason that never clears.

The pure parts run on recorded `scontrol ... -o` output (the local test node as start.sh configures it,
and a GPU cluster and a mixed partition as scontrol prints them); the end-to-end tests use the local
SLURM (launch/local_slurm/start.sh) and are skipped, saying why, where it cannot start."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hrlplan.errors import ConfigError
from hrlplan.launch import slurm_launcher
from hrlplan.launch.slurm_fit import (NeverStarts, array_indices, default_partition, fit_request, gres_gpus,
                                      memory_mb, never_starts, parse_jobs, parse_partition, parse_records, time_min)
from hrlplan.launch.slurm_launcher import JobWatch, explicit_launcher_keys

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- recorded outputs
# launch/local_slurm/start.sh's node (slurm 22.05): 2 CPUs, no GPUs, no limits.
LOCAL_PARTITION = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=vm PriorityJobFactor=1 PriorityTier=1 "
    "RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=2 "
    "TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=2,mem=21759M,node=1,billing=2")
LOCAL_NODE = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.00 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=21759 AllocMem=0 "
    "FreeMem=21534 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=debug  BootTime=2026-11-27T13:01:26 SlurmdStartTime=2026-11-27T13:05:56 "
    "CfgTRES=cpu=2,mem=21759M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0")
GPU_PARTITION = (
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL Default=NO MaxNodes=4 MaxTime=2-00:00:00 "
    "MaxCPUsPerNode=UNLIMITED Nodes=g[1-4] State=UP TotalCPUs=256 TotalNodes=4 DefMemPerCPU=1024 "
    "MaxMemPerNode=UNLIMITED")
GPU_NODES = "\n".join(
    f"NodeName=g{i} Arch=x86_64 CPUTot=64 AvailableFeatures=a100,ib ActiveFeatures=a100,ib "
    f"Gres=gpu:a100:4(S:0-1) RealMemory=515000 MemSpecLimit=2048 State=IDLE Partitions=gpu" for i in range(1, 5))
MIXED_PARTITION = "PartitionName=mixed Default=NO MaxNodes=UNLIMITED MaxTime=30:00 Nodes=b[1-2],s[1-2] State=UP"
MIXED_NODES = "\n".join(
    [f"NodeName=b{i} CPUTot=32 AvailableFeatures=big Gres=(null) RealMemory=128000 State=IDLE" for i in (1, 2)]
    + [f"NodeName=s{i} CPUTot=4 AvailableFeatures=small Gres=(null) RealMemory=16000 State=MIXED" for i in (1, 2)])
# `scontrol show job -o 1` right after `sbatch --array=0-1 --ntasks-per-node=2 --cpus-per-task=8 --mem-per-cpu=4GB`
# on the local node (the issue's sweep), abridged; then a 3-task array with one task done and one running.
PENDING_ARRAY = (
    "JobId=1 ArrayJobId=1 ArrayTaskId=0-1 JobName=wrap UserId=root(0) GroupId=root(0) Priority=4294901759 "
    "JobState=PENDING Reason=PartitionConfig Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "NumNodes=1 NumCPUs=16 NumTasks=2 CPUs/Task=8 ReqB:S:C:T=0:0:*:* TRES=cpu=16,mem=64G,node=1,billing=16 "
    "StdErr=/tmp/slurm-1_4294967294.out")
MIXED_ARRAY = "\n".join([
    "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobState=PENDING Reason=ReqNodeNotAvail, UnavailableNodes: Requeue=1 "
    "StdErr=/x/9_2.err",
    "JobId=10 ArrayJobId=9 ArrayTaskId=0 JobState=COMPLETED Reason=None StdErr=/x/9_0.err",
    "JobId=11 ArrayJobId=9 ArrayTaskId=1 JobState=RUNNING Reason=None StdErr=/x/9_1.err"])

LAUNCHER_YAML = dict(nodes=1, tasks_per_node=2, cpus_per_task=8, gpus_per_node=None, mem_gb=None,
                     mem_per_cpu="4GB", mem_per_gpu=None, cpus_per_gpu=None, gpus_per_task=None, gres=None,
                     timeout_min=60, partition=None, constraint=None)


def local():
    return parse_partition(LOCAL_PARTITION, LOCAL_NODE)


def gpu():
    return parse_partition(GPU_PARTITION, GPU_NODES)


def mixed():
    return parse_partition(MIXED_PARTITION, MIXED_NODES)


def fit(facts, **values):
    """The yaml's values, with `values` given on the command line."""
    return fit_request({**LAUNCHER_YAML, **values}, set(values), facts)


# ---------------------------------------------------------------- parsing
def test_scontrol_records_keep_values_with_spaces():
    [node] = parse_records(LOCAL_NODE)
    assert node["OS"] == "Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0" and node["RealMemory"] == "21759"
    assert node["CfgTRES"] == "cpu=2,mem=21759M,billing=2"
    assert parse_records(MIXED_ARRAY)[0]["Reason"] == "ReqNodeNotAvail, UnavailableNodes:"


@pytest.mark.parametrize("text, mb", [("4GB", 4096), ("4G", 4096), ("4096M", 4096), ("4096MB", 4096),
                                      ("4096", 4096), (2048, 2048), ("1T", 1048576), ("512K", 0), ("1.5G", 1536)])
def test_memory_sizes(text, mb):
    assert memory_mb(text) == mb


@pytest.mark.parametrize("gres, gpus", [("(null)", 0), ("", 0), ("gpu:4", 4), ("gpu:a100:4(S:0-1)", 4),
                                        ("gpu:a100:2,gpu:v100:2,mps:100", 4), ("gpu", 1), ("mps:100", 0),
                                        ("gpu:a100:4(S:0,1)", 4)])
def test_gpus_in_gres(gres, gpus):
    assert gres_gpus(gres) == gpus


@pytest.mark.parametrize("text, minutes", [("UNLIMITED", None), ("INFINITE", None), ("30", 30), ("30:00", 30),
                                           ("1:00:00", 60), ("2-00:00:00", 2880), ("1-12", 2160), ("00:30:00", 30)])
def test_time_limits(text, minutes):
    assert time_min(text) == minutes


def test_partitions_and_nodes_from_scontrol():
    part = local()
    assert part.name == "debug" and part.max_time_min is None and part.max_nodes is None
    [node] = part.nodes
    assert (node.cpus, node.mem_mb, node.gpus, node.features) == (2, 21759, 0, frozenset())
    g = gpu()
    assert len(g.nodes) == 4 and g.max_nodes == 4 and g.max_time_min == 2880
    assert {(n.cpus, n.mem_mb, n.gpus) for n in g.nodes} == {(64, 515000 - 2048, 4)}
    assert g.nodes[0].features == {"a100", "ib"}
    assert default_partition(LOCAL_PARTITION + "\n" + GPU_PARTITION) == "debug"
    assert default_partition(GPU_PARTITION) is None
    assert "4 node(s) (64 CPUs, 512952 MB, 4 GPUs)" in g.describe()


def test_explicit_keys_from_hydra_overrides():
    assert explicit_launcher_keys(["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug",
                                   "++hydra.launcher.cpus_per_task=8", "hydra.launcher.additional_parameters.x=1",
                                   "hydra.sweep.dir=/tmp"]) == ["partition", "cpus_per_task", "additional_parameters"]


# ---------------------------------------------------------------- fitting
def test_the_issues_sweep_fits_the_two_cpu_node():
    """The defaults (8 CPUs and 4 GB per CPU per task) on the local 2-CPU, 21 GB node."""
    fitted = fit(local(), partition="debug")
    assert fitted.params["cpus_per_task"] == 1 and fitted.params["mem_per_cpu"] == "4GB"
    assert fitted.params["gpus_per_node"] is None and fitted.params["tasks_per_node"] == 2
    assert fitted.changes == ["cpus_per_task 8 -> 1 (2 CPUs per node for 2 task(s))"]


def test_memory_preference_lowered_to_the_node():
    fitted = fit_request({**LAUNCHER_YAML, "mem_per_cpu": "16GB"}, set(), local())
    assert fitted.params["mem_per_cpu"] == "10879M"      # 21759 MB for 2 CPUs
    assert any(c.startswith("mem_per_cpu 16GB -> 10879M") for c in fitted.changes)
    site = fit_request({**LAUNCHER_YAML, "mem_per_cpu": None, "mem_gb": 400}, set(), local())
    assert site.params["mem_gb"] == 21 and site.params["mem_per_cpu"] is None


@pytest.mark.parametrize("values, message", [
    (dict(cpus_per_task=8), "hydra.launcher.cpus_per_task=8 but partition debug's nodes have 2 CPUs"),
    (dict(tasks_per_node=3), "hydra.launcher.tasks_per_node=3 but partition debug's nodes have 2 CPUs"),
    (dict(mem_per_cpu="20GB"), "hydra.launcher.mem_per_cpu=20GB but partition debug's nodes have 21759 MB"),
    (dict(mem_gb=64), "hydra.launcher.mem_gb=64 but partition debug's nodes have 21759 MB"),
    (dict(gpus_per_node=1), "hydra.launcher.gpus_per_node=1 but partition debug's nodes have 0 GPUs"),
    (dict(gres="gpu:2"), "hydra.launcher.gres=gpu:2 but partition debug's nodes have 0 GPUs"),
    (dict(nodes=2), "hydra.launcher.nodes=2 but partition debug has 1 node(s)"),
    (dict(constraint="a100"), "hydra.launcher.constraint=a100 but no node of partition debug has those features"),
    (dict(mem_gb=2, mem_per_cpu="1GB"), "hydra.launcher.mem_gb=2 and hydra.launcher.mem_per_cpu=1GB: SLURM takes one"),
    (dict(cpus_per_task=1, cpus_per_gpu=1), "hydra.launcher.cpus_per_task=1 and hydra.launcher.cpus_per_gpu=1: SLURM"),
])
def test_requests_no_node_can_hold_are_refused_naming_the_key(values, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        fit(local(), partition="debug", **values)
    assert "\n" not in str(err.value) and err.value.key == message.split("=")[0]


def test_explicit_values_that_fit_are_kept_and_replace_the_yaml_memory_form():
    fitted = fit(local(), partition="debug", tasks_per_node=1, cpus_per_task=2, mem_gb=2)
    assert (fitted.params["cpus_per_task"], fitted.params["mem_gb"], fitted.params["mem_per_cpu"]) == (2, 2, None)
    assert fitted.changes == []


def test_gpu_partition_asks_one_gpu_per_task():
    g = gpu()
    fitted = fit(g, partition="gpu")
    assert fitted.params["gpus_per_node"] == 2 and fitted.params["cpus_per_task"] == 8
    assert fitted.params["mem_per_cpu"] == "4GB"
    assert fit(g, partition="gpu", tasks_per_node=4).params["gpus_per_node"] == 4
    assert fit(g, partition="gpu", gpus_per_node=0).params["gpus_per_node"] == 0      # CPUs only, said so
    with pytest.raises(ConfigError, match=r"^hydra.launcher.tasks_per_node=8 but partition gpu's nodes have 4 GPUs"):
        fit(g, partition="gpu", tasks_per_node=8)
    with pytest.raises(ConfigError, match=r"^hydra.launcher.gpus_per_node=8 but partition gpu's nodes have 4 GPUs"):
        fit(g, partition="gpu", gpus_per_node=8, tasks_per_node=8)
    with pytest.raises(ConfigError, match=r"^hydra.launcher.nodes=5 but partition gpu allows 4 node\(s\) per job"):
        fit(g, partition="gpu", nodes=5)
    with pytest.raises(ConfigError, match=r"^hydra.launcher.timeout_min=3000 but partition gpu's time limit is 2880"):
        fit(g, partition="gpu", timeout_min=3000)
    assert fit(g, partition="gpu", constraint="a100&ib").params["constraint"] == "a100&ib"


def test_mixed_partition_sizes_for_the_roomiest_nodes_and_counts_them():
    m = mixed()
    fitted = fit(m, partition="mixed", timeout_min=30)
    assert fitted.params["cpus_per_task"] == 8            # the big nodes have room for the preference
    assert fit(m, partition="mixed", timeout_min=30, constraint="small").params["cpus_per_task"] == 2
    assert fit(m, partition="mixed", timeout_min=30, nodes=4).params["cpus_per_task"] == 2   # small ones too
    with pytest.raises(ConfigError, match=r"only 2 node\(s\) of partition mixed can hold"):
        fit(m, partition="mixed", timeout_min=30, nodes=3, cpus_per_task=8)
    with pytest.raises(ConfigError, match=r"^hydra.launcher.timeout_min=60 but partition mixed's time limit is 30"):
        fit(m, partition="mixed")


def test_a_list_of_partitions_fits_the_first_that_can_hold_it(monkeypatch):
    partitions = {"debug": local(), "gpu": gpu(), "mixed": mixed()}
    monkeypatch.setattr(slurm_launcher, "read_partition", lambda name: partitions[name])
    yaml = dict(LAUNCHER_YAML, timeout_min=30)
    part, fitted = slurm_launcher.fit_to_partitions({**yaml, "partition": "debug,gpu"}, [])
    assert part.name == "debug" and fitted.params["cpus_per_task"] == 1 and fitted.params["partition"] == "debug,gpu"
    part, fitted = slurm_launcher.fit_to_partitions({**yaml, "partition": "debug, mixed", "cpus_per_task": 4},
                                                    ["cpus_per_task"])
    assert part.name == "mixed" and fitted.params["cpus_per_task"] == 4
    with pytest.raises(ConfigError, match="^hydra.launcher.cpus_per_task=64 but partition debug's nodes"):
        slurm_launcher.fit_to_partitions({**yaml, "partition": "debug,mixed", "cpus_per_task": 64}, ["cpus_per_task"])


# ---------------------------------------------------------------- pending reasons
@pytest.mark.parametrize("reason, others, hopeless", [
    ("PartitionConfig", None, True), ("BadConstraints", None, True), ("PartitionNodeLimit", None, True),
    ("PartitionTimeLimit", None, True), ("ReqNodeNotAvail, UnavailableNodes:", None, True),
    ("ReqNodeNotAvail, UnavailableNodes:node[2-3]", None, False), ("QOSMaxCpuPerJobLimit", None, True),
    ("AssocMaxWallDurationPerJobLimit", None, True), ("AssocMaxJobsLimit", 0, True), ("AssocMaxJobsLimit", 3, False),
    ("AssocMaxJobsLimit", None, False), ("QOSMaxJobsPerUserLimit", 0, True), ("AssocGrpCpuLimit", 0, False),
    ("Resources", None, False), ("Priority", None, False), ("None", None, False), ("BeginTime", None, False),
    ("JobArrayTaskLimit", None, False), ("JobHeldUser", None, False), ("", None, False),
])
def test_pending_reasons_that_never_clear(reason, others, hopeless):
    assert bool(never_starts(reason, others)) is hopeless


def test_job_states_from_scontrol():
    [pending] = parse_jobs(PENDING_ARRAY)
    assert (pending.job_id, pending.state, pending.reason) == ("1_[0-1]", "PENDING", "PartitionConfig")
    assert array_indices(pending.job_id) == [0, 1]
    states = parse_jobs(MIXED_ARRAY)
    assert [s.job_id for s in states] == ["9_2", "9_0", "9_1"]
    assert array_indices("12_[1-3,5%2]") == [1, 2, 3, 5] and array_indices("12_4") == [4]


class FakeJob:
    """submitit's Job as the watch reads it: one task, its result file and its log."""
    num_tasks = 1

    def __init__(self, job_id, done=False):
        self.job_id = job_id
        self.paths = SimpleNamespace(stderr=Path(f"/sweep/.submitit/{job_id}/{job_id}_0_log.err"),
                                     result_pickle=SimpleNamespace(exists=lambda: done))

    def task(self, k):
        return self


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def watch(jobs, text, grace_s=10, others=lambda: None):
    clock = Clock()
    return JobWatch(jobs, grace_s, read=lambda array_id: text[0], others_running=others, clock=clock), clock


def test_watch_fails_the_sweep_after_the_grace_and_cancels_it(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(slurm_launcher, "_run", lambda *args, **kw: calls.append(args))
    text = [PENDING_ARRAY]
    w, clock = watch([FakeJob("1_0"), FakeJob("1_1")], text)
    assert w.poll() is False and calls == []
    assert "SLURM array 1: 2 pending (PartitionConfig)" in capsys.readouterr().err
    clock.now = 9
    assert w.poll() is False                       # a reason may be set before the scheduler's pass settles
    clock.now = 10
    with pytest.raises(NeverStarts, match=r"^SLURM job 1_0 cannot start: pending with Reason=PartitionConfig "
                                          r"\(the request exceeds .*\); cancelled the sweep's jobs \(array 1\)"):
        w.poll()
    assert calls == [("scancel", "1")]


def test_watch_waits_on_reasons_that_clear_and_says_when_they_change(monkeypatch, capsys):
    monkeypatch.setattr(slurm_launcher, "_run", lambda *a, **k: pytest.fail("nothing to cancel"))
    text = ["JobId=5 ArrayJobId=5 ArrayTaskId=0-1 JobState=PENDING Reason=Resources"]
    w, clock = watch([FakeJob("5_0"), FakeJob("5_1")], text)
    for clock.now in (0, 100, 1000):
        assert w.poll() is False
    text[0] = ("JobId=6 ArrayJobId=5 ArrayTaskId=0 JobState=RUNNING Reason=None\n"
               "JobId=5 ArrayJobId=5 ArrayTaskId=1 JobState=PENDING Reason=Priority")
    clock.now = 2000
    assert w.poll() is False
    err = capsys.readouterr().err.splitlines()
    assert err == ["[hrlplan] SLURM array 5: 2 pending (Resources)",
                   "[hrlplan] SLURM array 5: 1 pending (Priority), 1 running"]


def test_watch_job_count_limit_is_hopeless_only_when_nothing_of_the_user_runs(monkeypatch):
    monkeypatch.setattr(slurm_launcher, "_run", lambda *a, **k: None)
    text = ["JobId=7 ArrayJobId=7 ArrayTaskId=0 JobState=PENDING Reason=AssocMaxJobsLimit"]
    running = [2]
    w, clock = watch([FakeJob("7_0")], text, others=lambda: running[0])
    for clock.now in (0, 50):
        assert w.poll() is False
    running[0] = 0
    clock.now = 60
    assert w.poll() is False                       # the grace starts when it became hopeless
    clock.now = 70
    with pytest.raises(NeverStarts, match="AssocMaxJobsLimit"):
        w.poll()


def test_watch_reports_a_job_that_ended_without_a_result(monkeypatch):
    monkeypatch.setattr(slurm_launcher, "_run", lambda *a, **k: None)
    text = [MIXED_ARRAY.replace("JobState=RUNNING", "JobState=CANCELLED").replace(
        "Reason=ReqNodeNotAvail, UnavailableNodes:", "Reason=Priority")]
    w, clock = watch([FakeJob("9_0", done=True), FakeJob("9_1"), FakeJob("9_2")], text, grace_s=5)
    assert w.poll() is False
    clock.now = 29
    assert w.poll() is False                       # the result file may still be on its way
    clock.now = 30
    with pytest.raises(NeverStarts, match=r"^SLURM job 9_1 ended CANCELLED without a result; its log: "
                                          r"/sweep/.submitit/9_1/9_1_0_log.err"):
        w.poll()


def test_watch_done_when_every_job_has_a_result():
    w, _ = watch([FakeJob("3_0", done=True)], [None])
    assert w.poll() is True


def test_pending_grace_from_the_environment(monkeypatch):
    monkeypatch.setenv(slurm_launcher.GRACE_ENV, "7")
    assert slurm_launcher.pending_grace_s() == 7
    monkeypatch.setenv(slurm_launcher.GRACE_ENV, "soon")
    with pytest.raises(slurm_launcher.UserError, match="HRLPLAN_SLURM_PENDING_GRACE_S=soon"):
        slurm_launcher.pending_grace_s()
    monkeypatch.delenv(slurm_launcher.GRACE_ENV)
    assert slurm_launcher.pending_grace_s() == slurm_launcher.DEFAULT_GRACE_S


def test_launcher_yaml_names_a_class_hydra_accepts():
    """Hydra instantiates launchers only from the hydra_plugins package; the jobs unpickle the implementation."""
    import pickle

    import yaml
    from hydra.core.plugins import Plugins

    target = yaml.safe_load((ROOT / "conf/hydra/launcher/submitit_slurm.yaml").read_text())["_target_"]
    assert Plugins.is_in_toplevel_plugins_module(target)
    cls = Plugins.instance().class_name_to_class[target]
    launcher = cls(partition="debug")
    back = pickle.loads(pickle.dumps(launcher))
    assert type(back) is slurm_launcher.FittedSlurmLauncher and back.params == {"partition": "debug"}


# ---------------------------------------------------------------- end to end, on the local SLURM
SWEEP = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "train.schedule=gpipe,1f1b"]


@pytest.fixture(scope="module")
def local_slurm():
    from test_slurm import start_local_slurm, stop_local_slurm

    conf, started = start_local_slurm()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if started:
        stop_local_slurm()


def sweep(args, sweep_dir, timeout_s=420, **env):
    cmd = [sys.executable, str(ROOT / "pretrain.py"), "-m", *args, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, WANDB_SILENT="true", HF_HUB_OFFLINE="1", **env))


def array_state(job_id: str) -> set:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return {s.state for s in parse_jobs(out)}


@pytest.mark.slow
@pytest.mark.slurm
def test_the_issues_sweep_runs_on_the_two_cpu_node(local_slurm, tmp_path):
    """The issue's command (shortened to 3 steps): the request is fitted, both points train."""
    proc = sweep([*SWEEP, "train.steps=3", "logger.mode=disabled"], tmp_path / "sweep")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cpus_per_task 8 -> 1 (2 CPUs per node for 2 task(s))" in proc.stderr
    [script] = (tmp_path / "sweep" / ".submitit").glob(".submission_file_*.sh")   # what sbatch was given
    text = script.read_text()
    assert "#SBATCH --cpus-per-task=1" in text and "#SBATCH --ntasks-per-node=2" in text
    assert "#SBATCH --mem-per-cpu=4GB" in text and "--gpus-per-node" not in text
    for num in (0, 1):
        metrics = (tmp_path / "sweep" / str(num) / "metrics.jsonl").read_text().splitlines()
        assert len(metrics) == 3


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("args, line", [
    (["hydra.launcher.cpus_per_task=8"], "hydra.launcher.cpus_per_task=8 but partition debug's nodes have 2 CPUs "
                                         "(16 CPUs asked per node for 2 task(s)): lower it, or pick another partition"),
    (["hydra.launcher.partition=nosuch"], "hydra.launcher.partition=nosuch: SLURM has no such partition "
                                          "(partitions: debug)"),
    (["hydra.launcher.mem_gb=64"], "hydra.launcher.mem_gb=64 but partition debug's nodes have 21759 MB of memory"),
    (["+hydra.launcher.additional_parameters.tmp=10G"], "sbatch refused the sweep: sbatch: error: Temporary disk "
                                                        "specification can not be satisfied"),
])
def test_impossible_requests_refused_before_submission(local_slurm, tmp_path, args, line):
    proc = sweep([*SWEEP, *args], tmp_path / "sweep", timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("hrlplan: error: " + line), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "sweep").rglob("*_submitted.pkl"))     # nothing reached SLURM's queue


@pytest.mark.slow
@pytest.mark.slurm
def test_sweep_pending_for_ever_fails_and_is_cancelled(local_slurm, tmp_path):
    """A request the launcher cannot see (sbatch options passed through additional_parameters) that SLURM
    leaves pending with Reason=PartitionConfig: the sweep fails in one line and its array is cancelled."""
    start = time.monotonic()
    proc = sweep([*SWEEP, "+hydra.launcher.additional_parameters.cpus_per_task=8"], tmp_path / "sweep",
                 timeout_s=180, HRLPLAN_SLURM_PENDING_GRACE_S="2")
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hrlplan: error: SLURM job ") and "Reason=PartitionConfig" in last, proc.stderr[-3000:]
    assert "cancelled the sweep's jobs" in last and "Traceback" not in proc.stderr
    array = last.split("(array ")[1].split(")")[0]
    assert array_state(array) <= {"CANCELLED"}
    assert took < 120
