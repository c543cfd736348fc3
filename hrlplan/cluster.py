"""Cluster spec and probe.

The probe runs inside a process group (gloo on CPU, NCCL on GPU): every rank measures its own
device, pairs of ranks measure point-to-point bandwidth with send/recv, and the results are gathered
over the process group to rank 0 (no shared file system needed). Presets describe clusters that
are planned for without being probed.

A facts module: the probe runs on a process group its caller has initialised (hrlplan.launch.probe,
the job's workers), with the timers of hrlplan.measure; it imports nothing above itself.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hrlplan import devices
from hrlplan.config import ClusterConfig, section
from hrlplan.errors import UserError, one_line
from hrlplan.measure import collective_device, ping_pong, sync_device, timed

SCHEMA_VERSION = 1
GB = 1e9


class ClusterSpecError(UserError, ValueError):
    """A cluster.json that cannot be used: the message names the file (load) or the field (from_dict)."""


@dataclass
class DeviceInfo:
    rank: int
    node: int
    local_rank: int
    hostname: str
    kind: str             # cuda | cpu
    name: str             # e.g. "NVIDIA H100 80GB HBM3", "cpu"
    memory_bytes: int
    peak_flops: float     # measured (probe, in the training dtype) or nominal (preset) dense matmul FLOP/s
    threads: int = 1
    physical_id: Optional[str] = None   # the CUDA_VISIBLE_DEVICES entry this rank trains on
    peak_dtype: str = "bf16"            # the matmul dtype peak_flops is in (hrlplan.devices.dtype_key)


@dataclass
class ClusterSpec:
    name: str
    devices: List[DeviceInfo]
    backend: str = "gloo"
    source: str = "probe"         # probe | preset | file
    # Measured matrices (bytes/s, seconds), rank x rank; None for presets, which give per-link values.
    bandwidth: Optional[List[List[float]]] = None
    latency: Optional[List[List[float]]] = None
    intra_node_bw: List[float] = field(default_factory=list)   # per node, bytes/s
    inter_node_bw: float = 25 * GB
    intra_node_latency: float = 2e-6
    inter_node_latency: float = 5e-6
    calibration: Dict[str, Any] = field(default_factory=dict)  # filled by `hrlplan calibrate`
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def nnodes(self) -> int:
        return len({d.node for d in self.devices})

    def node_sizes(self) -> List[int]:
        sizes: Dict[int, int] = {}
        for d in self.devices:
            sizes[d.node] = sizes.get(d.node, 0) + 1
        return [sizes[n] for n in sorted(sizes)]

    def device_types(self) -> List[str]:
        return sorted({d.name for d in self.devices})

    def bw(self, i: int, j: int) -> float:
        """Point-to-point bandwidth between ranks i and j, bytes/s."""
        if i == j:
            return float("inf")
        if self.bandwidth is not None:
            return self.bandwidth[i][j]
        di, dj = self.devices[i], self.devices[j]
        if di.node == dj.node:
            return self.intra_node_bw[di.node]
        return self.inter_node_bw

    def lat(self, i: int, j: int) -> float:
        if i == j:
            return 0.0
        if self.latency is not None:
            return self.latency[i][j]
        same = self.devices[i].node == self.devices[j].node
        return self.intra_node_latency if same else self.inter_node_latency

    def group_bw(self, ranks: List[int]) -> float:
        """Slowest link inside a group: the bandwidth a ring collective over it runs at."""
        if len(ranks) < 2:
            return float("inf")
        return min(self.bw(a, b) for a in ranks for b in ranks if a != b)

    # ------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ClusterSpec":
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ClusterSpecError(f"cluster.json schema_version {version} is not supported (expected {SCHEMA_VERSION}); "
                             "re-run `hrlplan probe-cluster`")
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ClusterSpecError(f"unknown key {unknown[0]!r}; a cluster.json has {', '.join(sorted(known))}")
        if not isinstance(d.get("devices"), list) or not d["devices"]:
            raise ClusterSpecError("devices: the cluster has no devices; a cluster.json lists at least one "
                            "(write one with `hrlplan probe-cluster`)")
        d["devices"] = [_device_from_dict(i, x) for i, x in enumerate(d["devices"])]
        spec = cls(**d)
        _check_spec(spec)
        return spec

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ClusterSpec":
        """A cluster.json; anything wrong with it is a UserError naming the file."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise ClusterSpecError(f"expected a JSON object, got {type(data).__name__}")
            spec = cls.from_dict(data)
        except (OSError, UnicodeDecodeError, ValueError, TypeError, UserError) as err:
            raise ClusterSpecError(f"{path}: not a usable cluster.json: {one_line(err, 300)}") from None
        spec.source = "file"
        return spec

    def summary(self) -> str:
        types = ", ".join(f"{sum(d.name == t for d in self.devices)}x {t}" for t in self.device_types())
        return f"{self.name}: {self.world_size} workers on {self.nnodes} node(s) ({types}), backend {self.backend}"


def _device_from_dict(i: int, x: Any) -> DeviceInfo:
    if not isinstance(x, dict):
        raise ClusterSpecError(f"devices[{i}]: expected a mapping of device fields, got {type(x).__name__}")
    known = set(DeviceInfo.__dataclass_fields__)
    required = {f.name for f in fields(DeviceInfo) if f.default is MISSING}
    if set(x) - known:
        raise ClusterSpecError(f"devices[{i}].{sorted(set(x) - known)[0]}: unknown key; known: {', '.join(sorted(known))}")
    if required - set(x):
        raise ClusterSpecError(f"devices[{i}]: missing {', '.join(sorted(required - set(x)))}")
    return DeviceInfo(**x)


def _check_spec(spec: "ClusterSpec") -> None:
    """Values a planner would divide by or trust: each refused naming its field."""
    n = spec.world_size
    for i, dev in enumerate(spec.devices):
        for name in ("rank", "node", "local_rank", "memory_bytes"):
            value = getattr(dev, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ClusterSpecError(f"devices[{i}].{name}={value!r}: must be an integer >= 0")
        if dev.memory_bytes == 0:
            raise ClusterSpecError(f"devices[{i}].memory_bytes=0: a device needs memory (bytes)")
        if not isinstance(dev.peak_flops, (int, float)) or not 0 < dev.peak_flops < float("inf"):
            raise ClusterSpecError(f"devices[{i}].peak_flops={dev.peak_flops!r}: must be a finite number > 0 (FLOP/s)")
    ranks = sorted(d.rank for d in spec.devices)
    if ranks != list(range(n)):
        raise ClusterSpecError(f"devices: ranks {ranks} are not 0..{n - 1}, one per device")
    for name in ("bandwidth", "latency"):
        matrix = getattr(spec, name)
        if matrix is None:
            continue
        if not isinstance(matrix, list) or len(matrix) != n or any(not isinstance(r, list) or len(r) != n
                                                                    for r in matrix):
            rows = len(matrix) if isinstance(matrix, list) else type(matrix).__name__
            raise ClusterSpecError(f"{name}: must be a {n}x{n} matrix (one row and column per device), got {rows} rows "
                            f"of {[len(r) if isinstance(r, list) else r for r in matrix][:4] if isinstance(matrix, list) else '?'}")
        low = 0 if name == "latency" else 1e-300
        for a, row in enumerate(matrix):
            for b, v in enumerate(row):
                if a != b and (not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v < float("inf")):
                    raise ClusterSpecError(f"{name}[{a}][{b}]={v!r}: must be a finite number "
                                    f"{'>= 0 (seconds)' if name == 'latency' else '> 0 (bytes/s)'}")
    nodes = spec.nnodes
    if spec.bandwidth is None and len(spec.intra_node_bw) < nodes:
        raise ClusterSpecError(f"intra_node_bw: {len(spec.intra_node_bw)} values for {nodes} nodes (or give a bandwidth matrix)")
    for name in ("inter_node_bw",):
        v = getattr(spec, name)
        if not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ClusterSpecError(f"{name}={v!r}: must be a finite number > 0 (bytes/s)")


# ---------------------------------------------------------------- node-level links
def node_bandwidth(spec: ClusterSpec) -> List[List[float]]:
    """nodes x nodes: the slowest measured (or preset) link between any two of their devices,
    bytes/s; the diagonal is the node's own slowest intra-node link (inf for one device)."""
    n = spec.nnodes
    out = [[float("inf")] * n for _ in range(n)]
    for a in spec.devices:
        for b in spec.devices:
            if a.rank != b.rank:
                out[a.node][b.node] = min(out[a.node][b.node], spec.bw(a.rank, b.rank))
    return out


def node_orders(spec: ClusterSpec, limit: int = 4) -> List[List[int]]:
    """Up to `limit` orders of the nodes for a pipeline chain, best first: the slowest link between
    neighbours as high as possible, then the sum of the neighbours' bandwidths. The node order comes
    first among equals, so a cluster with uniform links keeps it. A planner that lays stages out
    in node order crosses a slow link (a shaped or oversubscribed uplink) needlessly when another
    order avoids it. Exhaustive up to 8 nodes; beyond, a greedy chain along the fastest links."""
    n = spec.nnodes
    bw = node_bandwidth(spec)
    if n <= 2:
        return [list(range(n))]

    def score(order):
        links = [bw[a][b] for a, b in zip(order, order[1:])]
        return (-min(links), -sum(links))

    if n <= 8:
        # the reversed chain is the same pipeline run backwards: keep the first of each pair
        orders = [list(p) for p in itertools.permutations(range(n)) if p[0] < p[-1]]
        orders.sort(key=score)      # stable: node order wins ties
        return orders[:limit]
    order, left = [0], set(range(1, n))
    while left:
        nxt = max(sorted(left), key=lambda b: bw[order[-1]][b])
        order.append(nxt)
        left.remove(nxt)
    return [order, list(range(n))][:limit] if order != list(range(n)) else [order]


# ---------------------------------------------------------------- presets
def spec_from_preset(cfg: ClusterConfig) -> ClusterSpec:
    """A ClusterSpec from cluster.node_groups (conf/cluster/*.yaml presets); cfg typed or plain."""
    cfg = section(ClusterConfig, cfg)
    groups = list(cfg.node_groups)
    if not groups:
        raise ClusterSpecError(f"cluster '{cfg.name}': cluster.probe=false needs cluster.node_groups (a preset such "
                               "as cluster=a100x8-1n) or cluster.spec_file")
    devices: List[DeviceInfo] = []
    intra: List[float] = []
    node = 0
    for g in groups:
        for _ in range(int(g.count)):
            for local in range(int(g.devices_per_node)):
                devices.append(DeviceInfo(
                    rank=len(devices), node=node, local_rank=local, hostname=f"node{node:04d}", kind="cuda",
                    name=str(g.device), memory_bytes=int(float(g.memory_gb) * 2**30),
                    peak_flops=float(g.tflops) * 1e12))
            intra.append(float(g.intra_node_GBps) * GB)
            node += 1
    return ClusterSpec(
        name=str(cfg.name), devices=devices, backend="nccl", source="preset", intra_node_bw=intra,
        inter_node_bw=float(cfg.inter_node_GBps) * GB,
        intra_node_latency=float(cfg.intra_node_latency_us) * 1e-6,
        inter_node_latency=float(cfg.inter_node_latency_us) * 1e-6)


# ---------------------------------------------------------------- probing
def default_nproc_per_node(setting: Any = "auto", device: str = "auto") -> int:
    """One worker per GPU, or per CPU core without GPUs or with train.device=cpu."""
    if setting not in (None, "auto"):
        return int(setting)
    if torch.cuda.is_available() and device != "cpu":
        return torch.cuda.device_count()
    return max(1, len(os.sched_getaffinity(0)))


GPU_MATMUL_N = 8192
GPU_P2P_SIZES_MB = (1.0, 16.0, 64.0)    # latency + bandwidth fitted over these (NVLink: 64 MiB saturates)
GPU_P2P_REPEATS = 10


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", cpu_root: str = "/sys/fs/cgroup/cpu") -> Optional[Tuple[float, float]]:
    """(CFS period in seconds, share of one core) when this process runs under a cgroup v1 CPU quota (a
    worker capped by cluster.cpu_shares, or a container's limit), else None."""
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                group = Path(cpu_root) / path.lstrip("/")
                quota = int((group / "cpu.cfs_quota_us").read_text())
                period = int((group / "cpu.cfs_period_us").read_text())
                return (period / 1e6, quota / period) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        pass
    return None


def cpu_quota_period(proc_cgroup: str = "/proc/self/cgroup", cpu_root: str = "/sys/fs/cgroup/cpu") -> Optional[float]:
    """The CFS period in seconds under a cgroup v1 CPU quota, else None."""
    found = cpu_quota(proc_cgroup, cpu_root)
    return found[0] if found else None


def cpu_device_name(quota: Optional[Tuple[float, float]]) -> str:
    """'cpu', or 'cpu@0.33' under a third of a core: calibration fits compute per device name, so capped
    and uncapped workers must not share one (the planner would take them for equals)."""
    return "cpu" if quota is None else f"cpu@{quota[1]:.2g}"


def cpu_quota_share(device_name: str) -> Optional[float]:
    """The share of one core a device name from cpu_device_name carries ('cpu@0.33' -> 0.33), else None
    (the cost model bounds such a worker's step by its CPU work over the share: simulator.cpu_quota_bounds)."""
    if not device_name.startswith("cpu@"):
        return None
    try:
        return float(device_name[len("cpu@"):])
    except ValueError:
        return None


def _measure_device(device, matmul_n: int, repeats: int, dtype: str = "float32") -> Dict[str, Any]:
    """This rank's device: name, free memory, matmul FLOP/s in the training dtype (fp32 as the
    trainer runs it: on TF32 unless switched off)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, _total = torch.cuda.mem_get_info(device)   # before this probe allocates anything
        key = devices.matmul_dtype(dtype, devices.tf32_setting({}))
        if dtype == "float32":
            devices.set_tf32(key == "tf32")
        n, tdtype = GPU_MATMUL_N, getattr(torch, dtype)
        a = torch.randn(n, n, device=device, dtype=tdtype)
        b = torch.randn(n, n, device=device, dtype=tdtype)
        reps = max(repeats, 10)
        dt = timed(lambda: [a @ b for _ in range(reps)], device, warmup=1) / reps
        del a, b
        torch.cuda.empty_cache()
        return dict(kind="cuda", name=props.name, memory_bytes=int(free), peak_flops=2 * n**3 / dt, threads=1,
                    peak_dtype=key)
    n = matmul_n
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):  # best of: the machine is shared and noisy
        t0 = time.perf_counter()
        a @ b
        sync_device(device)
        best = min(best, time.perf_counter() - t0)
    quota = cpu_quota()
    period = quota[0] if quota else None
    if period is not None:
        # Under a CPU quota (cluster.cpu_shares) a burst runs at full speed until the period's quota
        # is spent: only the rate over several periods shows the cap the worker trains at.
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 4 * period or count < repeats:
            a @ b
            count += 1
        best = max(best, (time.perf_counter() - t0) / count)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_world, 1)
    return dict(kind="cpu", name=cpu_device_name(quota), memory_bytes=int(mem), peak_flops=2 * n**3 / best,
                threads=torch.get_num_threads(), peak_dtype="fp32")


def p2p_sizes(device_type: str, cfg: ClusterConfig) -> tuple:
    """(message sizes in bytes, repeats) the pair probe times. GPU: 1-64 MiB, >= 10 repeats (4 MiB x 3
    under-reported NVLink 2-3x); CPU: a small and the configured size, the configured repeats
    (tests probe on CPU: keep it cheap)."""
    cfg = section(ClusterConfig, cfg)
    if device_type == "cuda":
        sizes = sorted({int(mb * 2**20) for mb in GPU_P2P_SIZES_MB} | {int(float(cfg.probe_p2p_mb) * 2**20)})
        return tuple(sizes), max(int(cfg.probe_repeats), GPU_P2P_REPEATS)
    big = int(float(cfg.probe_p2p_mb) * 2**20)
    return (max(big // 16, 1), big), int(cfg.probe_repeats)


def _round_robin(n: int) -> List[List[tuple]]:
    """Circle-method rounds: every pair once, each rank in at most one pair per round."""
    ids = list(range(n)) + ([None] if n % 2 else [])
    m = len(ids)
    rounds = []
    for _ in range(m - 1):
        rounds.append([(ids[i], ids[m - 1 - i]) for i in range(m // 2)
                       if ids[i] is not None and ids[m - 1 - i] is not None])
        ids = [ids[0]] + [ids[-1]] + ids[1:-1]
    return rounds


def check_block_placement(hostnames: List[str]) -> None:
    """Plans number ranks node-major (ranks 0..k-1 on the first node, k..2k-1 on the next): a stage
    the planner put on one node's NVLink must really be there. Refuse any other placement (srun
    --distribution=cyclic, uneven tasks per node) with the ranks and hosts concerned. hostnames:
    every rank's, in rank order."""
    nodes = list(dict.fromkeys(hostnames))
    per_node = len(hostnames) // max(len(nodes), 1)
    for rank, host in enumerate(hostnames):
        expected = nodes[min(rank // max(per_node, 1), len(nodes) - 1)]
        if host != expected or len(hostnames) % len(nodes):
            raise UserError(
                f"rank {rank} runs on {host} but the plan puts it on {expected}: ranks are not placed node-major "
                f"({len(hostnames)} ranks on {len(nodes)} nodes). Start the tasks in blocks: srun "
                "--distribution=block (SLURM_DISTRIBUTION=block) with the same --ntasks-per-node on every node")


def _gather(obj: Any, group=None) -> List[Any]:
    """Every rank's `obj`, over `group` (default: the default group; object collectives run on its
    CPU backend)."""
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _device_infos(cfg: ClusterConfig, device, dtype: str, group) -> List[Dict[str, Any]]:
    """Collective: every rank's measured device, host and node, checked (one device per rank, ranks
    placed node-major)."""
    info = _measure_device(device, int(cfg.probe_matmul_n), int(cfg.probe_repeats), dtype)
    physical = None
    if device.type == "cuda":
        visible = devices.visible_devices(os.environ)
        physical = visible[device.index] if visible and device.index < len(visible) else str(device.index)
    info.update(rank=dist.get_rank(), local_rank=devices.local_rank_of(os.environ), hostname=socket.gethostname(),
                physical_id=physical)
    infos = _gather(info, group)
    devices.check_unique_devices(infos)
    check_block_placement([i["hostname"] for i in infos])
    hosts = list(dict.fromkeys(i["hostname"] for i in infos))
    for i in infos:
        i["node"] = hosts.index(i["hostname"])
    return infos


def _measure_pairs(cfg: ClusterConfig, infos: List[Dict[str, Any]], device) -> Dict[tuple, tuple]:
    """Collective: {(a, b): (bandwidth, latency)} of the pairs this rank measured. Pairs on one node
    are all measured; across nodes only the nodes' first ranks, whose figure then stands for every
    pair of those two nodes (a full matrix on 1000 GPUs would take hours)."""
    rank = dist.get_rank()
    leaders = {i["node"]: i["rank"] for i in sorted(infos, key=lambda x: -x["rank"])}
    sizes, repeats = p2p_sizes(device.type, cfg)
    measured: Dict[tuple, tuple] = {}
    for pairs in _round_robin(dist.get_world_size()):
        for a, b in pairs:
            same = infos[a]["node"] == infos[b]["node"]
            if rank in (a, b) and (same or (leaders[infos[a]["node"]] == a and leaders[infos[b]["node"]] == b)):
                peer = b if rank == a else a
                measured[(min(a, b), max(a, b))] = ping_pong(rank, peer, sizes, repeats, device)
        dist.barrier()
    return measured


def _spec_from_measurements(name: str, infos: List[Dict[str, Any]], gathered: List[Dict[tuple, tuple]],
                            backend: str) -> ClusterSpec:
    """The probed ClusterSpec: every pair's slowest bandwidth and largest latency over the ranks that
    measured it; pairs across nodes not measured take their nodes' leaders' figure."""
    world = len(infos)
    pair_values: Dict[tuple, tuple] = {}
    for part in gathered:
        for (a, b), (bw, lat) in part.items():
            old = pair_values.get((a, b))
            pair_values[(a, b)] = (min(bw, old[0]), max(lat, old[1])) if old else (bw, lat)
    node_pair = {(infos[a]["node"], infos[b]["node"]): v for (a, b), v in pair_values.items()
                 if infos[a]["node"] != infos[b]["node"]}
    bw = [[0.0] * world for _ in range(world)]  # diagonal unused (bw() says inf)
    lat = [[0.0] * world for _ in range(world)]
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            key = (min(a, b), max(a, b))
            na, nb = infos[key[0]]["node"], infos[key[1]]["node"]
            v = pair_values.get(key) or node_pair.get((na, nb)) or node_pair.get((nb, na))
            bw[a][b], lat[a][b] = v
    device_list = [DeviceInfo(**{k: i[k] for k in DeviceInfo.__dataclass_fields__}) for i in infos]
    intra = []
    for node in range(len({i["node"] for i in infos})):
        vals = [bw[a.rank][b.rank] for a in device_list for b in device_list
                if a.node == b.node == node and a.rank != b.rank]
        intra.append(min(vals) if vals else 0.0)  # 0: a one-worker node has no intra link
    inter = [v[0] for v in node_pair.values()]
    return ClusterSpec(name=name, devices=device_list, backend=backend, source="probe", bandwidth=bw, latency=lat,
                       intra_node_bw=intra, inter_node_bw=min(inter) if inter else 25 * GB)


def probe_distributed(cfg: ClusterConfig, name: str = "local", device=None, dtype: str = "float32",
                      group=None) -> Optional[ClusterSpec]:
    """Collective: call on every rank of an initialised process group; rank 0 gets the spec.

    device: the one this rank trains on (default: its current GPU under NCCL, else the CPU), so a
    train.device=cpu job on a GPU node probes the CPUs it will use; dtype: train.dtype; group: the
    group the probe's object collectives run on (default: the default group; a job passes its
    long-timeout gloo group, hrlplan.runtime.distributed.cpu_group())."""
    cfg = section(ClusterConfig, cfg)
    device = device if device is not None else collective_device()
    infos = _device_infos(cfg, device, dtype, group)
    gathered = _gather(_measure_pairs(cfg, infos, device), group)
    if dist.get_rank() != 0:
        return None
    return _spec_from_measurements(name, infos, gathered, "nccl" if device.type == "cuda" else "gloo")


def load_or_probe_in_job(cfg: ClusterConfig, device=None, dtype: str = "float32", group=None) -> Optional[ClusterSpec]:
    """Inside a running job (every rank calls this): a preset, a spec file, or a collective probe on
    the training device in the training dtype (see probe_distributed)."""
    cfg = section(ClusterConfig, cfg)
    if cfg.spec_file:
        return ClusterSpec.load(cfg.spec_file)
    if not cfg.probe:
        return spec_from_preset(cfg)
    return probe_distributed(cfg, name=str(cfg.name), device=device, dtype=dtype, group=group)
