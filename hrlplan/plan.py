"""The Plan: what the planner decides and the runtime executes, written to plan.yaml.

Loading validates everything a launch depends on and rejects a bad plan with one message that
names the field and says what to do (PlanError). The runtime reads nothing but a Plan.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

SCHEMA_VERSION = 1
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")

HEADER = """\
# hrlplan parallel plan. Layer spans are [start, end) block indices (end exclusive).
# A stage's ranks are ordered data-parallel major: rank of (dp d, tp t) = ranks[d * tp + t].
# Launch: torchrun --nnodes {nnodes} --nproc-per-node {nproc} ... (see meta.launch)
"""


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

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def token(self) -> str:
        start, end = self.layers
        body = f"h{start}-h{end - 1}" if end - start > 1 else (f"h{start}" if end > start else "-")
        return ("E+" if self.embedding else "") + body + ("+H" if self.head else "")


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

    # ------------------------------------------------------------ derived
    @property
    def dp(self) -> int:
        return self.stages[0].dp

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_group(self, stage_index: int) -> int:
        """The device group that runs a (virtual) stage: looped for interleaved, V-shaped for ZBV."""
        if self.stages_per_rank == 1:
            return stage_index
        if self.schedule == "zero_bubble" and self.stages_per_rank == 2:
            return stage_index if stage_index < self.pp else 2 * self.pp - 1 - stage_index
        return stage_index % self.pp

    def stages_of_rank(self, rank: int) -> List[int]:
        return [i for i, s in enumerate(self.stages) if rank in s.ranks]

    def layout(self) -> str:
        return " | ".join(s.token() for s in self.stages)

    # ------------------------------------------------------------ YAML
    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

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
        required = ["model", "n_layer", "world_size", "pp", "microbatch_size", "num_microbatches",
                    "global_batch_size", "schedule", "stages", "device_groups"]
        for key in required:
            if key not in d:
                raise PlanError(key, "missing (every plan names it)", source)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise PlanError(sorted(unknown)[0], f"unknown key; known keys: {', '.join(cls.__dataclass_fields__)}", source)
        for key in ("n_layer", "world_size", "pp", "microbatch_size", "num_microbatches", "global_batch_size"):
            if not isinstance(d[key], int) or isinstance(d[key], bool):
                raise PlanError(key, f"must be an integer, got {d[key]!r}", source)
        if not isinstance(d["stages"], list) or not d["stages"]:
            raise PlanError("stages", "must be a non-empty list of stages", source)
        stages = []
        for i, s in enumerate(d["stages"]):
            if not isinstance(s, dict):
                raise PlanError(f"stages[{i}]", "must be a mapping with layers, ranks, tp, dp", source)
            extra = set(s) - set(StagePlan.__dataclass_fields__)
            if extra:
                raise PlanError(f"stages[{i}].{sorted(extra)[0]}", "unknown key; known: layers, ranks, tp, dp, embedding, head", source)
            for key in ("layers", "ranks"):
                if key not in s:
                    raise PlanError(f"stages[{i}].{key}", "missing", source)
            layers = s["layers"]
            if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int) for x in layers)):
                raise PlanError(f"stages[{i}].layers", f"must be [start, end) as two integers, got {layers!r}", source)
            stages.append(StagePlan(**s))
        d = dict(d)
        d["stages"] = stages
        d.setdefault("meta", {})
        plan = cls(**d)
        validate(plan, source=source)
        return plan

    @classmethod
    def from_yaml(cls, text: str, source: str = "plan.yaml") -> "Plan":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PlanError("<yaml>", f"not valid YAML: {e}", source) from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise PlanError("<file>", "does not exist; write one with `hrlplan plan-hrl` or planner=exact", str(path))
        return cls.from_yaml(path.read_text(), source=str(path))


def validate(plan: Plan, source: str = "plan.yaml") -> None:
    """Structural checks that need nothing but the plan."""
    err = lambda f, m: PlanError(f, m, source)  # noqa: E731
    if plan.schedule not in SCHEDULES:
        raise err("schedule", f"unknown schedule '{plan.schedule}'; choose one of {', '.join(SCHEDULES)}")
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
    sizes = {len(g) for g in plan.device_groups}
    if len(sizes) != 1:
        raise err("device_groups", f"groups must have equal size, got sizes {sorted(sizes)}")

    # layers: every block exactly once, in order
    owner: Dict[int, int] = {}
    for i, s in enumerate(plan.stages):
        start, end = s.layers
        if not (0 <= start <= end <= plan.n_layer):
            raise err(f"stages[{i}].layers", f"[{start}, {end}) lies outside the model's blocks [0, {plan.n_layer})")
        for layer in range(start, end):
            if layer in owner:
                raise err(f"stages[{i}].layers", f"block {layer} is also in stages[{owner[layer]}]; "
                          "each block must belong to exactly one stage")
            owner[layer] = i
        if i > 0 and start < plan.stages[i - 1].layers[1]:
            raise err(f"stages[{i}].layers", "stages must follow the model's block order")
    missing = [layer for layer in range(plan.n_layer) if layer not in owner]
    if missing:
        raise err("stages", f"blocks {_ranges(missing)} are not covered by any stage; every block must be in one stage")
    for i, s in enumerate(plan.stages):
        if s.embedding and i != 0:
            raise err(f"stages[{i}].embedding", "the embedding must be on the first stage (stages[0])")
        if s.head and i != len(plan.stages) - 1:
            raise err(f"stages[{i}].head", f"the output head must be on the last stage (stages[{len(plan.stages) - 1}])")
    if not plan.stages[0].embedding:
        raise err("stages[0].embedding", "the first stage must hold the embedding (embedding: true)")
    if not plan.stages[-1].head:
        raise err(f"stages[{len(plan.stages) - 1}].head", "the last stage must hold the output head (head: true)")

    # ranks: tp x dp per stage, groups disjoint and covering the world
    for i, s in enumerate(plan.stages):
        if s.tp < 1 or s.dp < 1:
            raise err(f"stages[{i}]", f"tp and dp must be >= 1, got tp={s.tp} dp={s.dp}")
        if len(s.ranks) != s.tp * s.dp:
            raise err(f"stages[{i}].ranks", f"{len(s.ranks)} ranks listed but tp*dp = {s.tp}*{s.dp} = {s.tp * s.dp}")
        group = plan.device_groups[plan.stage_group(i)]
        if sorted(s.ranks) != sorted(group):
            raise err(f"stages[{i}].ranks", f"{s.ranks} differ from its device group {group}")
    all_ranks = [r for g in plan.device_groups for r in g]
    if len(set(all_ranks)) != len(all_ranks):
        dup = sorted({r for r in all_ranks if all_ranks.count(r) > 1})
        raise err("device_groups", f"ranks {dup} appear in more than one group")
    if sorted(all_ranks) != list(range(plan.world_size)):
        raise err("world_size", f"the plan's groups use {len(all_ranks)} ranks but world_size is {plan.world_size}; "
                  "the ranks must be exactly 0..world_size-1")
    dps = {s.dp for s in plan.stages}
    if len(dps) != 1:
        raise err("stages", f"stages have different dp degrees {sorted(dps)}; use per-stage tp so tp*dp is equal")

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

    # launch: one uniform --nproc-per-node on every node
    launch = plan.meta.get("launch") or {}
    if launch:
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


def check_fits(plan: Plan, cluster, source: str = "plan.yaml") -> None:
    """Checks against the cluster the plan will run on: world size and predicted memory."""
    if plan.world_size != cluster.world_size:
        raise PlanError("world_size", f"the plan needs {plan.world_size} ranks but the job has {cluster.world_size}; "
                        "re-plan for this allocation or change the number of tasks/processes", source)
    predicted = (plan.meta.get("predicted") or {}).get("memory_bytes_per_rank")
    if predicted:
        for rank, need in enumerate(predicted):
            dev = cluster.devices[rank]
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
                     meta: Optional[Dict[str, Any]] = None, rank_order: Optional[List[int]] = None) -> Plan:
    """Build (and validate) a plan with equal groups of tp*dp ranks, one per pipeline position.

    `rank_order` lists the world's ranks in the order groups take them (default 0..N-1), which is
    how a planner assigns device groups to stages on a heterogeneous cluster.
    """
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
                                     embedding=(i == 0), head=(i == len(spans) - 1)))
    plan.meta.setdefault("launch", launch_meta(world))
    validate(plan)
    return plan
