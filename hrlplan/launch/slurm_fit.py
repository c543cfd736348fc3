"""What a SLURM partition's nodes hold, a launcher request fitted to them, and pending reasons that never clear.

Pure functions on SLURM's own text (`scontrol show partition|node|job -o`), so they are tested on
recorded outputs; hrlplan.launch.slurm_launcher runs the commands and submits.

The rules (docs/slurm.md, "Requests fitted to the partition"):
- Values the user gave on the command line (`hydra.launcher.cpus_per_task=8`) are taken as they are;
  one no node of the partition can hold is refused before submission, naming the key.
- Values from the launcher yaml (conf/hydra/launcher/submitit_slurm.yaml or a site preset built on it)
  for CPUs and memory are preferences: lowered to what a node of the partition has, and said so.
- `gpus_per_node: null` from the yaml asks one GPU per task where the partition's nodes have GPUs.
- tasks_per_node, nodes and timeout_min are never changed (the plan and the run depend on them): a value
  the partition cannot take is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from hrlplan.errors import ConfigError, UserError

MEMORY_KEYS = ("mem_gb", "mem_per_cpu", "mem_per_gpu")
_UNLIMITED = ("UNLIMITED", "INFINITE", "NONE", "N/A", "(null)", "")


# ---------------------------------------------------------------- SLURM's text
def parse_records(text: str) -> List[Dict[str, str]]:
    """`scontrol show ... -o`: one record per line of `Key=value` words. A word without `=` continues
    the previous value (`OS=Linux 6.1 #1 SMP`, `Reason=ReqNodeNotAvail, UnavailableNodes:n3`)."""
    records = []
    for line in text.splitlines():
        record: Dict[str, str] = {}
        key = None
        for word in line.split():
            name, eq, value = word.partition("=")
            if eq and re.fullmatch(r"[A-Za-z][\w:/]*", name):
                key, record[name] = name, value
            elif key is not None:
                record[key] += " " + word
        if record:
            records.append(record)
    return records


def memory_mb(value) -> int:
    """SLURM's memory sizes in MB: 4096, "4096M", "4GB", "4G", "1T" (no unit: MB, as sbatch reads it)."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(value), flags=re.I)
    if not match:
        raise ValueError(f"not a memory size: {value!r}")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def gres_gpus(gres: str) -> int:
    """GPUs in a Gres string: "gpu:4", "gpu:a100:4(S:0-1)", "gpu:a100:2,gpu:v100:2,mps:100", "(null)"."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        parts = re.sub(r"\(.*\)", "", item).strip().split(":")
        if parts[0] != "gpu":
            continue
        total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def time_min(value: str) -> Optional[int]:
    """SLURM's time limits in minutes (None: unlimited): "30", "30:00" (min:s), "1:00:00", "2-00:00:00", "1-12"."""
    if value is None or str(value).upper() in _UNLIMITED:
        return None
    days, _, rest = str(value).rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, (parts + [0])[:2]
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def _limit(value: Optional[str], convert) -> Optional[int]:
    if value is None or value.upper() in _UNLIMITED:
        return None
    value = re.sub(r"^(\d+)\D*$", r"\1", value) if convert is int else value
    return convert(value)


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int            # what jobs may ask: RealMemory less MemSpecLimit
    gpus: int
    features: frozenset
    state: str


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple
    state: str = "UP"
    max_nodes: Optional[int] = None
    max_time_min: Optional[int] = None
    max_cpus_per_node: Optional[int] = None
    max_mem_per_node_mb: Optional[int] = None
    max_mem_per_cpu_mb: Optional[int] = None

    def describe(self) -> str:
        kinds = sorted({(n.cpus, n.mem_mb, n.gpus) for n in self.nodes}, reverse=True)
        shown = "; ".join(f"{c} CPUs, {m} MB" + (f", {g} GPUs" if g else "") for c, m, g in kinds[:3])
        return f"partition {self.name}: {len(self.nodes)} node(s) ({shown}{'; ...' if len(kinds) > 3 else ''})"


def parse_nodes(text: str) -> List[Node]:
    """`scontrol show node -o <nodes>`."""
    nodes = []
    for r in parse_records(text):
        if "NodeName" not in r:
            continue
        features = r.get("AvailableFeatures", "")
        nodes.append(Node(
            name=r["NodeName"], cpus=int(r.get("CPUTot") or r.get("CPUEfctv") or 1),
            mem_mb=int(r.get("RealMemory") or 0) - int(r.get("MemSpecLimit") or 0),
            gpus=gres_gpus(r.get("Gres", "")),
            features=frozenset() if features in _UNLIMITED else frozenset(features.split(",")),
            state=r.get("State", "")))
    return nodes


def parse_partition(partition_text: str, node_text: str) -> Partition:
    """`scontrol show partition -o <name>` and `scontrol show node -o <its Nodes=>`."""
    [p] = [r for r in parse_records(partition_text) if "PartitionName" in r][:1]
    return Partition(
        name=p["PartitionName"], nodes=tuple(parse_nodes(node_text)), state=p.get("State", "UP"),
        max_nodes=_limit(p.get("MaxNodes"), int), max_time_min=time_min(p.get("MaxTime")),
        max_cpus_per_node=_limit(p.get("MaxCPUsPerNode"), int),
        max_mem_per_node_mb=_limit(p.get("MaxMemPerNode"), memory_mb),
        max_mem_per_cpu_mb=_limit(p.get("MaxMemPerCPU"), memory_mb))


def default_partition(text: str) -> Optional[str]:
    """The partition marked Default=YES in `scontrol show partition -o`, if any."""
    return next((r["PartitionName"] for r in parse_records(text) if r.get("Default") == "YES"), None)


# ---------------------------------------------------------------- the request, fitted
def _shown(key: str, params: dict) -> str:
    value = params.get(key)
    return f"hydra.launcher.{key}={'null' if value is None else value}"


def _constraint_matches(constraint: Optional[str], features: frozenset) -> Optional[bool]:
    """Whether a node's features satisfy `a&b`, `a,b` (and) or `a|b` (or); None for forms not read here."""
    if not constraint:
        return True
    if re.search(r"[\[\]()*!]", constraint) or ("|" in constraint and re.search(r"[&,]", constraint)):
        return None
    if "|" in constraint:
        return any(f in features for f in constraint.split("|"))
    return all(f in features for f in re.split(r"[&,]", constraint))


def _gpus_asked(params: dict) -> int:
    """GPUs per node the request names, however it names them (0: none)."""
    tasks = int(params.get("tasks_per_node") or 1)
    if params.get("gpus_per_node") is not None:
        return int(params["gpus_per_node"])
    if params.get("gpus_per_task") is not None:
        return tasks * int(params["gpus_per_task"])
    return gres_gpus(params.get("gres") or "")


def _cpus_asked(params: dict) -> int:
    if params.get("cpus_per_gpu") is not None:
        return _gpus_asked(params) * int(params["cpus_per_gpu"])
    return int(params.get("tasks_per_node") or 1) * int(params.get("cpus_per_task") or 1)


def _memory_asked_mb(params: dict) -> int:
    if params.get("mem_gb") is not None:
        return int(float(params["mem_gb"]) * 1024)
    if params.get("mem_per_cpu") is not None:
        return _cpus_asked(params) * memory_mb(params["mem_per_cpu"])
    if params.get("mem_per_gpu") is not None:
        return _gpus_asked(params) * memory_mb(params["mem_per_gpu"])
    return 0


def _node_shortfall(params: dict, node: Node, part: Partition) -> Optional[Tuple[str, str]]:
    """(the launcher key, why) this node cannot hold the request as it stands; None: it can."""
    cpus = min(node.cpus, part.max_cpus_per_node or node.cpus)
    mem = min(node.mem_mb, part.max_mem_per_node_mb or node.mem_mb)
    tasks = int(params.get("tasks_per_node") or 1)
    gpus = _gpus_asked(params)
    if gpus > node.gpus:
        key = next(k for k in ("gpus_per_node", "gpus_per_task", "gres") if params.get(k) is not None)
        return key, f"{_shown(key, params)} but partition {part.name}'s nodes have {node.gpus} GPUs"
    if tasks > cpus:
        return "tasks_per_node", (f"{_shown('tasks_per_node', params)} but partition {part.name}'s nodes have "
                                  f"{cpus} CPUs (one per task at least)")
    if _cpus_asked(params) > cpus:
        key = "cpus_per_gpu" if params.get("cpus_per_gpu") is not None else "cpus_per_task"
        return key, (f"{_shown(key, params)} but partition {part.name}'s nodes have {cpus} CPUs "
                     f"({_cpus_asked(params)} CPUs asked per node for {tasks} task(s))")
    if _memory_asked_mb(params) > mem:
        key = next(k for k in MEMORY_KEYS if params.get(k) is not None)
        return key, (f"{_shown(key, params)} but partition {part.name}'s nodes have {mem} MB of memory "
                     f"({_memory_asked_mb(params)} MB asked per node)")
    return None


def _check_job_shape(params: dict, part: Partition) -> None:
    """What no node choice can fix: nodes, time limit, feature constraint."""
    nodes = int(params.get("nodes") or 1)
    if part.max_nodes is not None and nodes > part.max_nodes:
        raise ConfigError("hydra.launcher.nodes", message=f"{_shown('nodes', params)} but partition {part.name} "
                          f"allows {part.max_nodes} node(s) per job (MaxNodes)")
    if nodes > len(part.nodes):
        raise ConfigError("hydra.launcher.nodes", message=f"{_shown('nodes', params)} but partition {part.name} "
                          f"has {len(part.nodes)} node(s)")
    timeout = params.get("timeout_min")
    if part.max_time_min is not None and timeout is not None and int(timeout) > part.max_time_min:
        raise ConfigError("hydra.launcher.timeout_min", message=f"{_shown('timeout_min', params)} but partition "
                          f"{part.name}'s time limit is {part.max_time_min} min (MaxTime): lower it")
    constraint = params.get("constraint")
    if constraint and not any(_constraint_matches(constraint, n.features) is not False for n in part.nodes):
        have = sorted(set().union(*(n.features for n in part.nodes))) or ["none"]
        raise ConfigError("hydra.launcher.constraint", message=f"{_shown('constraint', params)} but no node of "
                          f"partition {part.name} has those features (features: {', '.join(have)})")


def _exclusive_forms(params: dict, explicit: Set[str]) -> dict:
    """SLURM takes one memory form and one of cpus_per_task/cpus_per_gpu: a form set on the command line
    replaces the yaml's; two set on the command line are refused."""
    params = dict(params)
    for group in (MEMORY_KEYS, ("cpus_per_task", "cpus_per_gpu")):
        given = [k for k in group if k in explicit and params.get(k) is not None]
        if len(given) > 1:
            raise ConfigError(f"hydra.launcher.{given[0]}", message=f"{' and '.join(_shown(k, params) for k in given)}"
                              f": SLURM takes one of them; set the other to null")
        if given:
            params.update({k: None for k in group if k not in given})
    return params


@dataclass
class Fitted:
    params: dict
    changes: List[str]      # "cpus_per_task 8 -> 1", one per value lowered or filled in


def fit_request(params: dict, explicit: Iterable[str], part: Partition) -> Fitted:
    """The launcher's params, fitted to the partition (see the module docstring); ConfigError naming the
    launcher key when no node can hold what was asked explicitly."""
    explicit = set(explicit)
    params = _exclusive_forms(params, explicit)
    _check_job_shape(params, part)
    nodes_needed = int(params.get("nodes") or 1)
    candidates = [n for n in part.nodes if _constraint_matches(params.get("constraint"), n.features) is not False]
    # Against the explicit values only: the yaml's preferences are lowered below instead.
    fixed = {k: v for k, v in params.items()
             if k in explicit or k in ("tasks_per_node", "gpus_per_node", "gpus_per_task", "gres")}
    why = {n.name: _node_shortfall(fixed, n, part) for n in candidates}
    able = [n for n in candidates if why[n.name] is None]
    if len(able) < nodes_needed:
        biggest = max(candidates, key=lambda n: (n.gpus, n.cpus, n.mem_mb))
        key, reason = why[biggest.name] or ("nodes", f"{_shown('nodes', params)} but only {len(able)} node(s) "
                                            f"of partition {part.name} can hold the request")
        raise ConfigError(f"hydra.launcher.{key}", message=f"{reason}: lower it, or pick another partition")
    # Size the preferences for the `nodes` roomiest nodes that can hold the explicit part.
    chosen = sorted(able, key=lambda n: (n.gpus, n.cpus, n.mem_mb), reverse=True)[:nodes_needed]
    cpus = min(min(n.cpus for n in chosen), part.max_cpus_per_node or 10 ** 9)
    mem = min(min(n.mem_mb for n in chosen), part.max_mem_per_node_mb or 10 ** 12)
    gpus = min(n.gpus for n in chosen)
    changes: List[str] = []
    fitted = dict(params)
    tasks = int(params.get("tasks_per_node") or 1)

    def change(key, value, why_text):
        if value != fitted.get(key):
            changes.append(f"{key} {fitted.get(key)} -> {value} ({why_text})")
            fitted[key] = value

    if "gpus_per_node" not in explicit and _gpus_asked(params) == 0 and gpus and params.get("gpus_per_node") is None:
        if tasks > gpus:
            raise ConfigError("hydra.launcher.tasks_per_node", message=f"{_shown('tasks_per_node', params)} but "
                              f"partition {part.name}'s nodes have {gpus} GPUs (one task per GPU); lower it, or set "
                              "hydra.launcher.gpus_per_node=0 to train on CPUs")
        change("gpus_per_node", tasks, f"one per task; the nodes have {gpus}")
    if "cpus_per_task" not in explicit and fitted.get("cpus_per_task") is not None:
        change("cpus_per_task", min(int(fitted["cpus_per_task"]), cpus // tasks),
               f"{cpus} CPUs per node for {tasks} task(s)")
    for key in MEMORY_KEYS:
        if key in explicit or fitted.get(key) is None:
            continue
        units = {"mem_gb": 1, "mem_per_cpu": _cpus_asked(fitted), "mem_per_gpu": _gpus_asked(fitted)}[key]
        room_mb = mem // max(1, units)
        if key == "mem_per_cpu" and part.max_mem_per_cpu_mb:
            room_mb = min(room_mb, part.max_mem_per_cpu_mb)
        asked_mb = int(float(fitted[key]) * 1024) if key == "mem_gb" else memory_mb(fitted[key])
        if asked_mb > room_mb:
            change(key, room_mb // 1024 if key == "mem_gb" else f"{room_mb}M",
                   f"{mem} MB per node" + (f" for {units} {key[8:].upper()}s" if units > 1 else ""))
    left = next(filter(None, (_node_shortfall(fitted, n, part) for n in chosen)), None)
    if left:   # a preference could not be lowered far enough
        raise ConfigError(f"hydra.launcher.{left[0]}", message=f"{left[1]}: lower it, or pick another partition")
    return Fitted(fitted, changes)


# ---------------------------------------------------------------- pending jobs that never start
# Reasons about the job itself: no scheduling pass will change them (an administrator might).
_NEVER = {
    "PartitionConfig": "the request exceeds what the partition's nodes or limits allow",
    "BadConstraints": "no node has the features and resources asked together",
    "PartitionNodeLimit": "the partition cannot give the job that many nodes",
    "PartitionTimeLimit": "the time limit is above the partition's MaxTime",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "AccountNotAllowed": "the account may not use the partition",
    "QOSNotAllowed": "the QOS may not use the partition",
    "DependencyNeverSatisfied": "a dependency can never be satisfied",
    "JobLaunchFailure": "SLURM could not launch it",
}
# Limits on one job (QOSMaxCpuPerJobLimit, AssocMaxWallDurationPerJobLimit, QOSMinGRES, ...).
_PER_JOB = re.compile(r"^(Assoc|QOS)\w*PerJob\w*$|^QOSMin\w*$")
# Limits on how many jobs a user runs at once: clear when one of them ends, never when none runs.
_JOB_COUNT = re.compile(r"^(AssocMaxJobsLimit|QOSMaxJobsPerUserLimit)$")


def never_starts(reason: str, others_running: Optional[int] = None) -> Optional[str]:
    """Why a job pending for `reason` will never start (None: it may still start). others_running: how
    many jobs of this user run now (None: not known), for the job-count limits."""
    head = (reason or "").split(",")[0].strip()
    if head in _NEVER:
        return _NEVER[head]
    if head == "ReqNodeNotAvail":
        unavailable = reason.partition("UnavailableNodes:")[2].strip()
        return None if unavailable else "no node of the request is available, and none is down or drained to return"
    if _PER_JOB.match(head):
        return "a per-job limit of the account or QOS is below the request"
    if _JOB_COUNT.match(head) and others_running == 0:
        return "a limit on running jobs that none of your running jobs will free"
    return None


@dataclass(frozen=True)
class JobState:
    job_id: str     # "12_0", "12_[1-3]" for array tasks not yet split off, "12" for a plain job
    state: str
    reason: str
    stderr: str


def parse_jobs(text: str) -> List[JobState]:
    """`scontrol show job -o <array job id>`: one record per array task (pending ones may share one)."""
    jobs = []
    for r in parse_records(text):
        if "JobId" not in r:
            continue
        array, task = r.get("ArrayJobId"), r.get("ArrayTaskId")
        job_id = f"{array}_{task}" if array and task and task.isdigit() else (
            f"{array}_[{task}]" if array and task else r["JobId"])
        jobs.append(JobState(job_id, r.get("JobState", ""), r.get("Reason", ""), r.get("StdErr", "")))
    return jobs


def array_indices(job_id: str) -> List[int]:
    """The array task indices a JobState stands for ("12_3" -> [3], "12_[1-3,5%2]" -> [1, 2, 3, 5])."""
    spec = job_id.partition("_")[2].strip("[]").split("%")[0]
    out: List[int] = []
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class NeverStarts(UserError):
    """A submitted job pends for a reason that never clears."""
