"""The Plan: what the planner decides and the runtime executes, written to plan.yaml.

Loading validates everything a launch depends on and rejects a bad plan with one message that
names the field and says what to do (PlanError). The runtime reads nothing but a Plan.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from hrlplan.errors import one_line
from hrlplan.validate import YamlBudgetError, parse_yaml_limited

SCHEMA_VERSION = 1
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
# Activation recomputation per stage: none keeps every activation for backward; selective
# recomputes attention's core (Korthikanti et al. 2022); full keeps each block's input only and
# reruns the block's forward in backward (torch.utils.checkpoint per block, as torchtitan does).
RECOMPUTE_MODES = ("none", "selective", "full")
# Heterogeneous pipelines (and stages of unequal tp) run on hrlplan's own executor, which offers these.
HETERO_SCHEDULES = ("gpipe", "1f1b")
# Keys a heterogeneous plan derives from its first pipeline (for tools that know one pipeline) and
# therefore does not write.
_DERIVED_IN_HETERO = ("pp", "microbatch_size", "num_microbatches", "stages", "device_groups", "stages_per_rank")

HEADER = """\
# hrlplan parallel plan. Layer spans are [start, end) block indices (end exclusive).
# A stage's ranks are ordered data-parallel major: rank of (dp d, tp t) = ranks[d * tp + t].
# Launch: torchrun --nnodes {nnodes} --nproc-per-node {nproc} ... (see meta.launch)
"""


def stage_to_group(stage_index: int, pp: int, stages_per_rank: int, schedule: str) -> int:
    """The device group that runs a (virtual) stage: looped for interleaved, V-shaped for ZBV."""
    if stages_per_rank == 1:
        return stage_index
    if schedule == "zero_bubble" and stages_per_rank == 2:
        return stage_index if stage_index < pp else 2 * pp - 1 - stage_index
    return stage_index % pp


class PlanError(ValueError):
    """A plan that cannot run; `field` is the dotted path of the offending entry."""

    def __init__(self, field_path: str, message: str, source: str = "plan.yaml"):
        self.field = field_path
        super().__init__(f"{source}: {field_path}: {message}")


@dataclass
class StagePlan:
    layers: List[int]                 # [start, end): the blocks this stage runs
    ranks: List[int]
    tp: int = 1
    dp: int = 1
    embedding: bool = False           # holds the input embeddings (first stage only)
    head: bool = False                # holds the final norm + output head (last stage only)
    recompute: str = "none"           # none | selective | full (RECOMPUTE_MODES)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def token(self) -> str:
        start, end = self.layers
        body = f"h{start}-h{end - 1}" if end - start > 1 else (f"h{start}" if end > start else "-")
        return ("E+" if self.embedding else "") + body + ("+H" if self.head else "")


@dataclass
class PipelinePlan:
    """One data-parallel replica of a heterogeneous plan: its own stages, micro-batches and rows."""
    stages: List[StagePlan]           # in model order; each stage's ranks are its tp ranks (dp is 1)
    num_microbatches: int
    batch_size: int                   # rows of the global batch this pipeline trains per step

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.num_microbatches

    @property
    def ranks(self) -> List[int]:
        return [r for s in self.stages for r in s.ranks]

    def layout(self) -> str:
        return " | ".join(s.token() for s in self.stages)


@dataclass
class Plan:
    model: str
    n_layer: int
    world_size: int
    pp: int                           # pipeline device groups
    microbatch_size: int
    num_microbatches: int
    global_batch_size: int
    schedule: str
    stages: List[StagePlan]           # in model order; pp * stages_per_rank of them
    device_groups: List[List[int]]    # one per pipeline position, equal size
    stages_per_rank: int = 1
    meta: Dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # Heterogeneous plans only (HSPMD-style): data-parallel replicas with their own stage templates,
    # micro-batch counts and batch shares, and ranks the plan leaves idle. Empty for the usual plan.
    pipelines: List[PipelinePlan] = field(default_factory=list)
    unused_ranks: List[int] = field(default_factory=list)

    # ------------------------------------------------------------ derived
    @property
    def heterogeneous(self) -> bool:
        return bool(self.pipelines)

    @property
    def dp(self) -> int:
        return len(self.pipelines) if self.pipelines else self.stages[0].dp

    @property
    def uniform_tp(self) -> bool:
        return len({s.tp for s in self.stages}) == 1

    def as_pipelines(self) -> List[PipelinePlan]:
        """Every plan as a list of replicas: a homogeneous plan's dp replicas share one template."""
        if self.pipelines:
            return self.pipelines
        rows = self.microbatch_size * self.num_microbatches
        return [PipelinePlan(stages=[StagePlan(layers=list(s.layers), ranks=s.ranks[d * s.tp:(d + 1) * s.tp], tp=s.tp,
                                               embedding=s.embedding, head=s.head, recompute=s.recompute)
                                     for s in self.stages],
                             num_microbatches=self.num_microbatches, batch_size=rows) for d in range(self.dp)]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_group(self, stage_index: int) -> int:
        return stage_to_group(stage_index, self.pp, self.stages_per_rank, self.schedule)

    def stages_of_rank(self, rank: int) -> List[int]:
        return [i for i, s in enumerate(self.stages) if rank in s.ranks]

    def layout(self) -> str:
        if self.pipelines:
            return " || ".join(f"[{p.layout()}]x{p.num_microbatches}mb/{p.batch_size}" for p in self.pipelines)
        return " | ".join(s.token() for s in self.stages)

    # ------------------------------------------------------------ YAML
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        # recompute: none is the default; leaving it out keeps plans without recomputation as they were
        for stage in d["stages"] + [s for p in d["pipelines"] for s in p["stages"]]:
            if stage.get("recompute") == "none":
                stage.pop("recompute")
        if not self.pipelines:   # the usual plan's YAML stays as short as it always was
            d.pop("pipelines")
            if not self.unused_ranks:
                d.pop("unused_ranks")
            return d
        for key in _DERIVED_IN_HETERO:
            d.pop(key)
        return d

    def to_yaml(self) -> str:
        launch = self.meta.get("launch", {})
        header = HEADER.format(nnodes=launch.get("nnodes", 1), nproc=launch.get("nproc_per_node", self.world_size))
        return header + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan.yaml") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("<top>", f"expected a mapping, got {type(d).__name__}", source)
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise PlanError("schema_version", f"{version} is not supported (this hrlplan reads {SCHEMA_VERSION})", source)
        hetero = bool(d.get("pipelines"))
        required = ["model", "n_layer", "world_size", "global_batch_size", "schedule"]
        required += ["pipelines"] if hetero else ["pp", "microbatch_size", "num_microbatches", "stages", "device_groups"]
        for key in required:
            if key not in d:
                raise PlanError(key, "missing (every plan names it)", source)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise PlanError(sorted(unknown)[0], f"unknown key; known keys: {', '.join(cls.__dataclass_fields__)}", source)
        if hetero:
            derived = sorted(set(d) & set(_DERIVED_IN_HETERO))
            if derived:
                raise PlanError(derived[0], "a plan with `pipelines` sets stages, micro-batches and groups per "
                                "pipeline; remove the top-level key", source)
        for key in ("n_layer", "world_size", "global_batch_size") + (() if hetero else
                                                                     ("pp", "microbatch_size", "num_microbatches")):
            if not isinstance(d[key], int) or isinstance(d[key], bool):
                raise PlanError(key, f"must be an integer, got {d[key]!r}", source)
        d = dict(d)
        d.setdefault("meta", {})
        if hetero:
            d["pipelines"] = _parse_pipelines(d["pipelines"], source)
            d.update(_derived_from_first_pipeline(d["pipelines"]))
        else:
            d["stages"] = _parse_stages(d["stages"], "stages", source)
        plan = cls(**d)
        validate(plan, source=source)
        return plan

    @classmethod
    def from_yaml(cls, text: str, source: str = "plan.yaml") -> "Plan":
        try:
            data = parse_yaml_limited(text)   # within a size and alias-expansion budget
        except YamlBudgetError as e:
            raise PlanError("<file>", str(e), source) from None
        except yaml.YAMLError as e:
            raise PlanError("<yaml>", f"not valid YAML: {one_line(e, 300)}", source) from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise PlanError("<file>", "does not exist; write one with `hrlplan plan-hrl` or planner=exact", str(path))
        return cls.from_yaml(path.read_text(), source=str(path))


def _parse_stages(raw: Any, where: str, source: str) -> List[StagePlan]:
    if not isinstance(raw, list) or not raw:
        raise PlanError(where, "must be a non-empty list of stages", source)
    stages = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise PlanError(f"{where}[{i}]", "must be a mapping with layers, ranks, tp, dp", source)
        extra = set(s) - set(StagePlan.__dataclass_fields__)
        if extra:
            raise PlanError(f"{where}[{i}].{sorted(extra)[0]}", "unknown key; known: layers, ranks, tp, dp, embedding, head, "
                            "recompute", source)
        for key in ("layers", "ranks"):
            if key not in s:
                raise PlanError(f"{where}[{i}].{key}", "missing", source)
        layers = s["layers"]
        if not (isinstance(layers, list) and len(layers) == 2 and all(_is_int(x) for x in layers)):
            raise PlanError(f"{where}[{i}].layers", f"must be [start, end) as two integers, got {layers!r}", source)
        _check_stage_types(s, f"{where}[{i}]", source)
        stages.append(StagePlan(**s))
    return stages


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_stage_types(s: Dict[str, Any], where: str, source: str) -> None:
    """Types before values: the later checks compare and multiply tp, dp and ranks (`tp: "2"` or
    `tp: two` would otherwise end in a TypeError instead of a message naming the field)."""
    ranks = s["ranks"]
    if not (isinstance(ranks, list) and all(_is_int(r) for r in ranks)):
        raise PlanError(f"{where}.ranks", f"must be a list of integer ranks, got {ranks!r}", source)
    for key in ("tp", "dp"):
        if key in s and not _is_int(s[key]):
            raise PlanError(f"{where}.{key}", f"must be an integer, got {s[key]!r}", source)
    for key in ("embedding", "head"):
        if key in s and not isinstance(s[key], bool):
            raise PlanError(f"{where}.{key}", f"must be true or false, got {s[key]!r}", source)
    if "recompute" in s and not isinstance(s["recompute"], str):
        raise PlanError(f"{where}.recompute", f"must be one of {', '.join(RECOMPUTE_MODES)}, got {s['recompute']!r}",
                        source)


def _parse_pipelines(raw: Any, source: str) -> List[PipelinePlan]:
    if not isinstance(raw, list):
        raise PlanError("pipelines", "must be a list of pipelines (stages, num_microbatches, batch_size)", source)
    out = []
    for p, entry in enumerate(raw):
        where = f"pipelines[{p}]"
        if not isinstance(entry, dict):
            raise PlanError(where, "must be a mapping with stages, num_microbatches, batch_size", source)
        extra = set(entry) - set(PipelinePlan.__dataclass_fields__)
        if extra:
            raise PlanError(f"{where}.{sorted(extra)[0]}", "unknown key; known: stages, num_microbatches, batch_size", source)
        for key in ("stages", "num_microbatches", "batch_size"):
            if key not in entry:
                raise PlanError(f"{where}.{key}", "missing", source)
            if key != "stages" and (not isinstance(entry[key], int) or isinstance(entry[key], bool)):
                raise PlanError(f"{where}.{key}", f"must be an integer, got {entry[key]!r}", source)
        out.append(PipelinePlan(stages=_parse_stages(entry["stages"], f"{where}.stages", source),
                                num_microbatches=entry["num_microbatches"], batch_size=entry["batch_size"]))
    return out


def _derived_from_first_pipeline(pipelines: List[PipelinePlan]) -> Dict[str, Any]:
    """Top-level fields of a heterogeneous plan, taken from its first pipeline, so that tools which
    read one pipeline (show-plan, the simulator's manual path) still see a coherent plan."""
    first = pipelines[0]
    return {"pp": len(first.stages), "microbatch_size": max(first.microbatch_size, 1),
            "num_microbatches": first.num_microbatches, "stages": first.stages,
            "device_groups": [list(s.ranks) for s in first.stages], "stages_per_rank": 1}


def _check_stage_layers(stages: List[StagePlan], n_layer: int, where: str, err) -> None:
    """Every block exactly once and in order; embedding on the first stage, head on the last."""
    owner: Dict[int, int] = {}
    for i, s in enumerate(stages):
        start, end = s.layers
        if not (0 <= start <= end <= n_layer):
            raise err(f"{where}[{i}].layers", f"[{start}, {end}) lies outside the model's blocks [0, {n_layer})")
        for layer in range(start, end):
            if layer in owner:
                raise err(f"{where}[{i}].layers", f"block {layer} is also in {where}[{owner[layer]}]; "
                          "each block must belong to exactly one stage")
            owner[layer] = i
        if i > 0 and start < stages[i - 1].layers[1]:
            raise err(f"{where}[{i}].layers", "stages must follow the model's block order")
    missing = [layer for layer in range(n_layer) if layer not in owner]
    if missing:
        raise err(where, f"blocks {_ranges(missing)} are not covered by any stage; every block must be in one stage")
    last = len(stages) - 1
    for i, s in enumerate(stages):
        if s.embedding and i != 0:
            raise err(f"{where}[{i}].embedding", f"the embedding must be on the first stage ({where}[0])")
        if s.head and i != last:
            raise err(f"{where}[{i}].head", f"the output head must be on the last stage ({where}[{last}])")
    if not stages[0].embedding:
        raise err(f"{where}[0].embedding", "the first stage must hold the embedding (embedding: true)")
    if not stages[-1].head:
        raise err(f"{where}[{last}].head", "the last stage must hold the output head (head: true)")
    for i, s in enumerate(stages):
        if s.tp < 1 or s.dp < 1:
            raise err(f"{where}[{i}]", f"tp and dp must be >= 1, got tp={s.tp} dp={s.dp}")
        if len(s.ranks) != s.tp * s.dp:
            raise err(f"{where}[{i}].ranks", f"{len(s.ranks)} ranks listed but tp*dp = {s.tp}*{s.dp} = {s.tp * s.dp}")
        if s.recompute not in RECOMPUTE_MODES:
            raise err(f"{where}[{i}].recompute", f"unknown mode {s.recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")


def _check_world(plan: Plan, used: List[int], err) -> None:
    all_ranks = used + list(plan.unused_ranks)
    if len(set(all_ranks)) != len(all_ranks):
        dup = sorted({r for r in all_ranks if all_ranks.count(r) > 1})
        where = "pipelines" if plan.pipelines else "device_groups"
        raise err(where, f"ranks {dup} appear in more than one group" + (" (or also in unused_ranks)" if plan.unused_ranks else ""))
    if sorted(all_ranks) != list(range(plan.world_size)):
        raise err("world_size", f"the plan's groups use {len(all_ranks)} ranks but world_size is {plan.world_size}; "
                  "the ranks must be exactly 0..world_size-1 (list idle ones in unused_ranks)")


def _check_launch(plan: Plan, err) -> None:
    """One uniform --nproc-per-node on every node, and a rank -> device map that is a permutation."""
    launch = plan.meta.get("launch") or {}
    if not launch:
        return
    nnodes, nproc = launch.get("nnodes", 1), launch.get("nproc_per_node", plan.world_size)
    visible = launch.get("per_node_visible_devices")
    if visible:
        counts = [len(str(v).split(",")) for v in visible]
        if len(set(counts)) != 1:
            raise err("meta.launch.per_node_visible_devices", f"nodes list {counts} devices; torchrun starts the "
                      "same --nproc-per-node on every node, so every node must list the same number")
        if len(visible) != nnodes:
            raise err("meta.launch.per_node_visible_devices", f"{len(visible)} entries for {nnodes} nodes")
    if nnodes * nproc != plan.world_size:
        raise err("meta.launch.nproc_per_node", f"nnodes {nnodes} x nproc_per_node {nproc} = {nnodes * nproc} "
                  f"!= world_size {plan.world_size}; the launch must start one process per plan rank")
    mapping = launch.get("rank_to_device")
    if mapping is not None and sorted(mapping) != sorted(set(mapping)):
        raise err("meta.launch.rank_to_device", "two ranks map to the same device; give every rank its own device")
    if mapping is not None and len(mapping) != plan.world_size:
        raise err("meta.launch.rank_to_device", f"{len(mapping)} entries for world_size {plan.world_size}")


def validate(plan: Plan, source: str = "plan.yaml") -> None:
    """Structural checks that need nothing but the plan."""
    err = lambda f, m: PlanError(f, m, source)  # noqa: E731
    if plan.schedule not in SCHEDULES:
        raise err("schedule", f"unknown schedule '{plan.schedule}'; choose one of {', '.join(SCHEDULES)}")
    if plan.pipelines:
        _validate_heterogeneous(plan, err)
        _check_launch(plan, err)
        return
    if plan.stages_per_rank < 1:
        raise err("stages_per_rank", "must be >= 1")
    if plan.stages_per_rank > 1 and plan.schedule not in MULTI_STAGE_SCHEDULES:
        raise err("stages_per_rank", f"{plan.stages_per_rank} stages per rank need schedule "
                  f"{' or '.join(MULTI_STAGE_SCHEDULES)}, not {plan.schedule}")
    if plan.pp < 1 or len(plan.device_groups) != plan.pp:
        raise err("device_groups", f"{len(plan.device_groups)} groups listed but pp is {plan.pp}; list one group per pipeline position")
    if len(plan.stages) != plan.pp * plan.stages_per_rank:
        raise err("stages", f"{len(plan.stages)} stages listed; pp={plan.pp} x stages_per_rank={plan.stages_per_rank} "
                  f"needs {plan.pp * plan.stages_per_rank}")
    # Groups may differ in size only where their stages' tp degrees differ (per-stage tensor parallel).
    expected = {plan.stage_group(i): s.tp * s.dp for i, s in enumerate(plan.stages)}
    if any(len(g) != expected.get(i, len(g)) for i, g in enumerate(plan.device_groups)) \
            and len({len(g) for g in plan.device_groups}) != 1:
        raise err("device_groups", f"groups must have equal size (or tp*dp of their stages), got sizes "
                  f"{sorted({len(g) for g in plan.device_groups})}")
    _check_stage_layers(plan.stages, plan.n_layer, "stages", err)
    for i, s in enumerate(plan.stages):
        group = plan.device_groups[plan.stage_group(i)]
        if sorted(s.ranks) != sorted(group):
            raise err(f"stages[{i}].ranks", f"{s.ranks} differ from its device group {group}")
    _check_world(plan, [r for g in plan.device_groups for r in g], err)
    dps = {s.dp for s in plan.stages}
    if len(dps) != 1:
        raise err("stages", f"stages have different dp degrees {sorted(dps)}; use per-stage tp so tp*dp is equal")
    if not plan.uniform_tp and plan.stages_per_rank > 1:
        raise err("stages", "stages of unequal tp need one stage per rank (stages_per_rank: 1)")
    if not plan.uniform_tp and plan.schedule not in HETERO_SCHEDULES:
        raise err("schedule", f"stages of unequal tp run on hrlplan's own executor, which offers "
                  f"{' and '.join(HETERO_SCHEDULES)}, not {plan.schedule}")

    # batch
    if plan.microbatch_size < 1 or plan.num_microbatches < 1:
        raise err("num_microbatches", "microbatch_size and num_microbatches must be >= 1")
    if plan.microbatch_size * plan.num_microbatches * plan.dp != plan.global_batch_size:
        raise err("num_microbatches", f"microbatch_size {plan.microbatch_size} x num_microbatches "
                  f"{plan.num_microbatches} x dp {plan.dp} = {plan.microbatch_size * plan.num_microbatches * plan.dp} "
                  f"does not divide the global batch {plan.global_batch_size} evenly; choose micro-batches so that "
                  "their product equals global_batch_size")
    if plan.pp > 1 and plan.num_microbatches < plan.pp:
        raise err("num_microbatches", f"{plan.num_microbatches} micro-batches are fewer than the {plan.pp} pipeline "
                  "stages; torch pipelining needs at least one micro-batch per stage")
    _check_launch(plan, err)


def _validate_heterogeneous(plan: Plan, err) -> None:
    if plan.schedule not in HETERO_SCHEDULES:
        raise err("schedule", f"heterogeneous pipelines run on hrlplan's own executor, which offers "
                  f"{' and '.join(HETERO_SCHEDULES)}, not {plan.schedule}")
    used: List[int] = []
    for p, pipe in enumerate(plan.pipelines):
        where = f"pipelines[{p}]"
        for i, s in enumerate(pipe.stages):
            if s.dp != 1:
                raise err(f"{where}.stages[{i}].dp", "a pipeline is one replica (dp 1); list more pipelines for more replicas")
        _check_stage_layers(pipe.stages, plan.n_layer, f"{where}.stages", err)
        if pipe.num_microbatches < 1 or pipe.batch_size < 1:
            raise err(f"{where}.num_microbatches", "num_microbatches and batch_size must be >= 1")
        if pipe.batch_size % pipe.num_microbatches:
            raise err(f"{where}.num_microbatches", f"{pipe.num_microbatches} micro-batches do not divide the "
                      f"pipeline's batch_size {pipe.batch_size} evenly")
        used += pipe.ranks
    _check_world(plan, used, err)
    total = sum(p.batch_size for p in plan.pipelines)
    if total != plan.global_batch_size:
        raise err("pipelines", f"the pipelines' batch_size values sum to {total}, not the global batch "
                  f"{plan.global_batch_size}; every row of the global batch must go to exactly one pipeline")


def check_fits(plan: Plan, cluster, source: str = "plan.yaml") -> None:
    """Checks against the cluster the plan will run on: world size and predicted memory.

    A job (a probed cluster or its cluster.json) must run exactly the plan's ranks; a plan for a
    preset may use a subset of its devices, through meta.launch.rank_to_device."""
    live = cluster.source in ("probe", "file")
    if live and plan.world_size != cluster.world_size:
        raise PlanError("world_size", f"the plan needs {plan.world_size} ranks but the job has {cluster.world_size}; "
                        "re-plan for this allocation or change the number of tasks/processes", source)
    device_of = (plan.meta.get("launch") or {}).get("rank_to_device") or list(range(plan.world_size))
    if len(device_of) != plan.world_size or max(device_of) >= cluster.world_size:
        raise PlanError("meta.launch.rank_to_device", f"maps {plan.world_size} ranks onto devices the cluster "
                        f"'{cluster.name}' ({cluster.world_size} devices) does not have; re-plan for this cluster", source)
    predicted = (plan.meta.get("predicted") or {}).get("memory_bytes_per_rank")
    if predicted:
        for rank, need in enumerate(predicted):
            dev = cluster.devices[device_of[rank]]
            if need > dev.memory_bytes:
                raise PlanError("meta.predicted.memory_bytes_per_rank",
                                f"rank {rank} ({dev.name}) is predicted to need {need / 2**30:.2f} GiB but has "
                                f"{dev.memory_bytes / 2**30:.2f} GiB; use more pipeline stages, a smaller "
                                "microbatch_size, 1f1b instead of gpipe, or more data-parallel sharding", source)


def _ranges(xs: List[int]) -> str:
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def launch_meta(world_size: int, cluster=None) -> Dict[str, Any]:
    """meta.launch for a plan using ranks 0..world_size-1 with one uniform nproc-per-node."""
    if cluster is None:
        return {"nnodes": 1, "nproc_per_node": world_size,
                "per_node_visible_devices": [",".join(str(i) for i in range(world_size))]}
    sizes = cluster.node_sizes()
    nproc = min(sizes)
    nnodes = world_size // nproc if world_size % nproc == 0 else len(sizes)
    return {"nnodes": nnodes, "nproc_per_node": nproc,
            "per_node_visible_devices": [",".join(str(i) for i in range(nproc)) for _ in range(nnodes)]}


def homogeneous_plan(model: str, n_layer: int, spans: List[tuple], dp: int, tp: int, microbatch_size: int,
                     num_microbatches: int, schedule: str, stages_per_rank: int = 1,
                     meta: Optional[Dict[str, Any]] = None, rank_order: Optional[List[int]] = None,
                     recompute: Union[str, Sequence[str], None] = None) -> Plan:
    """Build (and validate) a plan with equal groups of tp*dp ranks, one per pipeline position.

    `rank_order` lists the world's ranks in the order groups take them (default 0..N-1), which is
    how a planner assigns device groups to stages on a heterogeneous cluster. `recompute`: one mode
    for every stage or one per stage (RECOMPUTE_MODES; default none).
    """
    modes = [recompute or "none"] * len(spans) if recompute is None or isinstance(recompute, str) else list(recompute)
    if len(modes) != len(spans):
        raise PlanError("stages", f"{len(modes)} recompute modes for {len(spans)} stages; give one per stage")
    group_size = tp * dp
    pp = len(spans) // stages_per_rank
    world = pp * group_size
    order = rank_order or list(range(world))
    groups = [order[g * group_size:(g + 1) * group_size] for g in range(pp)]
    plan = Plan(model=model, n_layer=n_layer, world_size=world, pp=pp, microbatch_size=microbatch_size,
                num_microbatches=num_microbatches, global_batch_size=microbatch_size * num_microbatches * dp,
                schedule=schedule, stages=[], device_groups=groups, stages_per_rank=stages_per_rank,
                meta=dict(meta or {}))
    for i, (start, end) in enumerate(spans):
        plan.stages.append(StagePlan(layers=[start, end], ranks=list(groups[plan.stage_group(i)]), tp=tp, dp=dp,
                                     embedding=(i == 0), head=(i == len(spans) - 1), recompute=modes[i]))
    plan.meta.setdefault("launch", launch_meta(world))
    validate(plan)
    return plan
