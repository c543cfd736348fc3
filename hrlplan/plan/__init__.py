"""The Plan: what the planner decides and the runtime executes, written to plan.yaml.

Loading validates everything a launch depends on and rejects a bad plan with one message that
names the field and says what to do (PlanError; the checks are hrlplan.plan.checks, re-exported
here). The runtime reads nothing but a Plan.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from hrlplan import schedules
from hrlplan.errors import ConfigError, one_line
from hrlplan.plan.checks import (  # noqa: F401 (re-exported: hrlplan.plan names every plan fact)
    HETERO_SCHEDULES, MULTI_STAGE_SCHEDULES, RECOMPUTE_MODES, SCHEDULES, PlanError, check_fits, validate)
from hrlplan.yaml_budget import YamlBudgetError, parse_yaml_limited

SCHEMA_VERSION = 1
# Keys a heterogeneous plan derives from its first pipeline (for tools that know one pipeline) and
# therefore does not write.
_DERIVED_IN_HETERO = ("pp", "microbatch_size", "num_microbatches", "stages", "device_groups", "stages_per_rank")

HEADER = """\
# hrlplan parallel plan. Layer spans are [start, end) block indices (end exclusive).
# A stage's ranks are ordered data-parallel major: rank of (dp d, cp c, tp t) = ranks[(d * cp + c) * tp + t].
# Launch: torchrun --nnodes {nnodes} --nproc-per-node {nproc} ... (see meta.launch)
"""


def stage_to_group(stage_index: int, pp: int, stages_per_rank: int, schedule: str) -> int:
    """The device group that runs a (virtual) stage, as the schedule's registry entry places it
    (looped for interleaved, V-shaped for ZBV)."""
    if stages_per_rank == 1:
        return stage_index
    try:
        spec = schedules.get(schedule, stages_per_rank)
    except ConfigError:
        raise PlanError("schedule", f"unknown schedule '{schedule}'; choose one of {', '.join(schedules.names())}") \
            from None
    return spec.stage_rank(stage_index, pp, stages_per_rank)


@dataclass
class StagePlan:
    layers: List[int]                 # [start, end): the blocks this stage runs
    ranks: List[int]
    tp: int = 1
    dp: int = 1
    embedding: bool = False           # holds the input embeddings (first stage only)
    head: bool = False                # holds the final norm + output head (last stage only)
    recompute: str = "none"           # none | selective | full (RECOMPUTE_MODES)
    # Sequence parallelism (Korthikanti et al. 2022, torchtitan's): the norms and the block inputs
    # sharded over the tp ranks along the sequence; tp > 1 only, the same on every stage.
    sequence_parallel: bool = False
    # Context parallelism (torch's context_parallel, torchtitan's cp): each sequence sharded over cp
    # ranks holding the same weights; the stage's ranks are tp * dp * cp, the same cp on every stage.
    cp: int = 1

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
    # its own sequence length (HSPMD's SEQ_LEN_LIST): packed rows of this replica are filled up to it,
    # at most data.seq_len (data.packing=document|balanced only); None: data.seq_len
    seq_len: Optional[int] = None

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
    # FSDP2's reshard_after_forward: true frees each block's gathered weights after its forward and
    # gathers them again in backward; null (default): torchtitan's rule, true without pipelining and
    # false under it (resolved_reshard_after_forward). Only with dp > 1 under train.dp_mode=fsdp.
    reshard_after_forward: Optional[bool] = None

    # ------------------------------------------------------------ derived
    @property
    def heterogeneous(self) -> bool:
        return bool(self.pipelines)

    @property
    def dp(self) -> int:
        return len(self.pipelines) if self.pipelines else self.stages[0].dp

    @property
    def cp(self) -> int:
        """The context-parallel degree (validate keeps every stage alike; 1 for heterogeneous plans)."""
        return max((s.cp for s in self.stages), default=1)

    @property
    def uniform_tp(self) -> bool:
        return len({s.tp for s in self.stages}) == 1

    def as_pipelines(self) -> List[PipelinePlan]:
        """Every plan as a list of replicas: a homogeneous plan's dp replicas share one template."""
        if self.pipelines:
            return self.pipelines
        rows = self.microbatch_size * self.num_microbatches
        return [PipelinePlan(stages=[StagePlan(layers=list(s.layers), ranks=s.ranks[d * s.tp * s.cp:(d + 1) * s.tp * s.cp],
                                               tp=s.tp, embedding=s.embedding, head=s.head, recompute=s.recompute,
                                               sequence_parallel=s.sequence_parallel, cp=s.cp)
                                     for s in self.stages],
                             num_microbatches=self.num_microbatches, batch_size=rows) for d in range(self.dp)]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan's tp stages run sequence parallel (validate keeps every stage alike)."""
        return any(s.sequence_parallel and s.tp > 1 for s in self.stages)

    def resolved_reshard_after_forward(self) -> bool:
        """reshard_after_forward as written, or torchtitan's default: true when one stage runs per
        rank and no other (no pipeline schedule re-running forwards per micro-batch), else false."""
        if self.reshard_after_forward is not None:
            return bool(self.reshard_after_forward)
        return self.num_stages == 1

    def stage_group(self, stage_index: int) -> int:
        return stage_to_group(stage_index, self.pp, self.stages_per_rank, self.schedule)

    def stages_of_rank(self, rank: int) -> List[int]:
        return [i for i, s in enumerate(self.stages) if rank in s.ranks]

    def layout(self) -> str:
        if self.pipelines:
            # the one notation of micro-batching (search/plan_text.py): count first, in words
            return " || ".join(f"[{p.layout()}] ({p.num_microbatches} micro-batch{'es' if p.num_microbatches != 1 else ''}"
                               f" of {p.microbatch_size})" for p in self.pipelines)
        return " | ".join(s.token() for s in self.stages)

    # ------------------------------------------------------------ YAML
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        # defaults are left out: a plan without recomputation or sequence parallelism reads as it always did
        for stage in d["stages"] + [s for p in d["pipelines"] for s in p["stages"]]:
            if stage.get("recompute") == "none":
                stage.pop("recompute")
            if not stage.get("sequence_parallel"):
                stage.pop("sequence_parallel", None)
            if stage.get("cp") == 1:
                stage.pop("cp")
        if d.get("reshard_after_forward") is None:
            d.pop("reshard_after_forward", None)
        for pipe in d["pipelines"]:
            if pipe.get("seq_len") is None:
                pipe.pop("seq_len", None)
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
        groups = d.get("device_groups", [])
        if not isinstance(groups, list) or not all(isinstance(g, list) and all(_is_int(r) for r in g) for g in groups):
            raise PlanError("device_groups", f"must be a list of lists of integer ranks, got {groups!r}", source)
        if not isinstance(d.get("unused_ranks", []), list) or not all(_is_int(r) for r in d.get("unused_ranks", [])):
            raise PlanError("unused_ranks", f"must be a list of integer ranks, got {d['unused_ranks']!r}", source)
        if d.get("reshard_after_forward") is not None and not isinstance(d["reshard_after_forward"], bool):
            raise PlanError("reshard_after_forward", f"must be true, false or null (null: true without pipelining, "
                            f"false under it), got {d['reshard_after_forward']!r}", source)
        if not isinstance(d.get("meta", {}), dict):
            raise PlanError("meta", f"must be a mapping, got {type(d['meta']).__name__}", source)
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
        if path.is_dir():
            inside = " (it holds a plan.yaml: give that)" if (path / "plan.yaml").is_file() else ""
            raise PlanError("<file>", f"is a directory, not a plan file{inside}", str(path))
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError("<file>", f"cannot be read as a plan (YAML text): {one_line(e, 200)}", str(path)) from None
        return cls.from_yaml(text, source=str(path))


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
                            "recompute, sequence_parallel, cp", source)
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
    for key in ("tp", "dp", "cp"):
        if key in s and not _is_int(s[key]):
            raise PlanError(f"{where}.{key}", f"must be an integer, got {s[key]!r}", source)
    for key in ("embedding", "head", "sequence_parallel"):
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
            raise PlanError(f"{where}.{sorted(extra)[0]}", "unknown key; known: stages, num_microbatches, batch_size, "
                            "seq_len", source)
        seq_len = entry.get("seq_len")
        if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
            raise PlanError(f"{where}.seq_len", f"must be a positive integer or null, got {seq_len!r}", source)
        for key in ("stages", "num_microbatches", "batch_size"):
            if key not in entry:
                raise PlanError(f"{where}.{key}", "missing", source)
            if key != "stages" and (not isinstance(entry[key], int) or isinstance(entry[key], bool)):
                raise PlanError(f"{where}.{key}", f"must be an integer, got {entry[key]!r}", source)
        out.append(PipelinePlan(stages=_parse_stages(entry["stages"], f"{where}.stages", source),
                                num_microbatches=entry["num_microbatches"], batch_size=entry["batch_size"],
                                seq_len=seq_len))
    return out


def _derived_from_first_pipeline(pipelines: List[PipelinePlan]) -> Dict[str, Any]:
    """Top-level fields of a heterogeneous plan, taken from its first pipeline, so that tools which
    read one pipeline (show-plan, the simulator's manual path) still see a coherent plan."""
    first = pipelines[0]
    return {"pp": len(first.stages), "microbatch_size": max(first.microbatch_size, 1),
            "num_microbatches": first.num_microbatches, "stages": first.stages,
            "device_groups": [list(s.ranks) for s in first.stages], "stages_per_rank": 1}


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
                     recompute: Union[str, Sequence[str], None] = None, sequence_parallel: bool = False,
                     reshard_after_forward: Optional[bool] = None, cp: int = 1) -> Plan:
    """Build (and validate) a plan with equal groups of tp*dp*cp ranks, one per pipeline position.

    `rank_order` lists the world's ranks in the order groups take them (default 0..N-1), which is
    how a planner assigns device groups to stages on a heterogeneous cluster. `recompute`: one mode
    for every stage or one per stage (RECOMPUTE_MODES; default none).
    """
    modes = [recompute or "none"] * len(spans) if recompute is None or isinstance(recompute, str) else list(recompute)
    if len(modes) != len(spans):
        raise PlanError("stages", f"{len(modes)} recompute modes for {len(spans)} stages; give one per stage")
    group_size = tp * dp * cp
    pp = len(spans) // stages_per_rank
    world = pp * group_size
    order = rank_order or list(range(world))
    groups = [order[g * group_size:(g + 1) * group_size] for g in range(pp)]
    plan = Plan(model=model, n_layer=n_layer, world_size=world, pp=pp, microbatch_size=microbatch_size,
                num_microbatches=num_microbatches, global_batch_size=microbatch_size * num_microbatches * dp,
                schedule=schedule, stages=[], device_groups=groups, stages_per_rank=stages_per_rank,
                meta=dict(meta or {}), reshard_after_forward=reshard_after_forward)
    for i, (start, end) in enumerate(spans):
        plan.stages.append(StagePlan(layers=[start, end], ranks=list(groups[plan.stage_group(i)]), tp=tp, dp=dp,
                                     embedding=(i == 0), head=(i == len(spans) - 1), recompute=modes[i],
                                     sequence_parallel=bool(sequence_parallel) and tp > 1, cp=cp))
    plan.meta.setdefault("launch", launch_meta(world))
    validate(plan)
    return plan
