"""A plan's checks: the structure a launch depends on (validate) and the fit on a cluster (check_fits).

Each names the offending field and says what to do (PlanError). They read a Plan's attributes only,
so hrlplan.plan (the dataclasses, YAML and builders) imports them, not the other way round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

from hrlplan import schedules
from hrlplan.errors import UserError

if TYPE_CHECKING:   # annotations only: hrlplan.plan imports this module
    from hrlplan.plan import Plan, StagePlan

# The schedule names a plan takes, from the registry (hrlplan.schedules), aliases included.
SCHEDULES = schedules.names()
MULTI_STAGE_SCHEDULES = schedules.multi_stage_names()
# Activation recomputation per stage: none keeps every activation for backward; selective is
# op-level selective activation checkpointing (torchtitan's `op` policy: the outputs of every other
# matmul and of the attention kernel are kept, the cheap ops recomputed); full keeps each block's
# input only and reruns the block's forward in backward (torch.utils.checkpoint per block).
RECOMPUTE_MODES = ("none", "selective", "full")
# Heterogeneous pipelines (and stages of unequal tp) run on hrlplan's own executor, which offers these.
HETERO_SCHEDULES = schedules.heterogeneous_names()
# How the replicas on hrlplan's own executor step their optimizer (meta.replica_optimizer): each its
# whole model, or sharded across the replicas (ZeRO-1; cost/replica_sync.py, runtime/hetero_zero.py).
SHARDED, REPLICATED = "sharded", "replicated"
REPLICA_OPTIMIZERS = (SHARDED, REPLICATED)
# Whether hrlplan's own executor runs sequence parallelism inside a replica whose stages all share
# one tp > 1 (runtime/hetero.py); the replica search reads it (search/hetero.py).
HETERO_SEQUENCE_PARALLEL = True


class PlanError(UserError, ValueError):
    """A plan that cannot run; `field` is the dotted path of the offending entry."""

    def __init__(self, field_path: str, message: str, source: str = "plan.yaml"):
        self.field = field_path
        super().__init__(f"{source}: {field_path}: {message}")


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
        if not isinstance(s.cp, int) or s.cp < 1:
            raise err(f"{where}[{i}].cp", f"must be an integer >= 1, got {s.cp!r}")
        if len(s.ranks) != s.tp * s.dp * s.cp:
            raise err(f"{where}[{i}].ranks", f"{len(s.ranks)} ranks listed but tp*dp*cp = {s.tp}*{s.dp}*{s.cp} = "
                      f"{s.tp * s.dp * s.cp}")
        if s.recompute not in RECOMPUTE_MODES:
            raise err(f"{where}[{i}].recompute", f"unknown mode {s.recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
        if s.sequence_parallel and s.tp < 2:
            raise err(f"{where}[{i}].sequence_parallel", f"shards over the tp ranks but the stage has tp {s.tp}; "
                      "set it false or give the stage tp > 1")


def _check_sequence_parallel(plan: Plan, err) -> None:
    """Stages hand each other sequence-sharded activations: every stage runs it or none does, at one
    tp (a heterogeneous plan's replicas: _check_replica_sequence_parallel)."""
    chosen = [s.sequence_parallel for s in plan.stages]
    if not any(chosen):
        return
    if not all(chosen):
        first_off = chosen.index(False)
        raise err(f"stages[{first_off}].sequence_parallel", "is false while another stage's is true; stages pass "
                  "sequence-sharded activations to each other, so set it on every stage or on none")
    if not plan.uniform_tp:
        raise err("stages", "sequence_parallel needs the same tp on every stage (stages pass each other the "
                  "sequence shard, tp rank j to tp rank j); set sequence_parallel false or make tp uniform")


def _check_replica_sequence_parallel(pipe, where: str, err) -> None:
    """A replica on hrlplan's own executor runs sequence parallelism on all its stages at one tp or
    not at all: its stages pass each other the sequence shard, rank j to rank j; its own seq_len
    must divide by that tp. (_check_stage_layers already refused it at tp 1.)"""
    chosen = [s.sequence_parallel for s in pipe.stages]
    if not any(chosen):
        return
    if not all(chosen):
        i = chosen.index(False)
        raise err(f"{where}.stages[{i}].sequence_parallel", "is false while another stage of this pipeline sets it; "
                  "its stages pass sequence-sharded activations to each other, so set it on every stage or on none")
    tps = [s.tp for s in pipe.stages]
    if len(set(tps)) != 1:
        i = next(k for k, tp in enumerate(tps) if tp != tps[0])
        raise err(f"{where}.stages[{i}].tp", f"is {tps[i]} but stage 0's is {tps[0]}: sequence parallelism in a "
                  "pipeline needs one tp on all its stages; give them one tp or set sequence_parallel false")
    if pipe.seq_len is not None and pipe.seq_len % tps[0]:
        raise err(f"{where}.seq_len", f"{pipe.seq_len} is not divisible by the pipeline's tp {tps[0]}, over which "
                  "sequence parallelism shards it; make it a multiple of the tp or set sequence_parallel false")


def sequence_parallel_divides(seq_len: int, tp: int, cp: int = 1) -> bool:
    """Whether sequence parallelism over `tp` can shard a sequence of `seq_len` positions: both runtimes
    give every tp rank an equal slice of the (cp-local, under context parallelism) sequence
    (models/hf.HFStage, runtime/hetero.py) and refuse an uneven one. The planners' spaces plan a
    layout without sequence parallelism where it does not divide (search/space.SearchSpace)."""
    return tp <= 1 or seq_len % (tp * max(1, cp)) == 0


def sequence_parallel_length_refusal(plan: Plan, seq_len: int) -> str:
    """Why data.seq_len cannot run `plan`'s sequence parallelism ("" where it can): each tp group shards
    the sequence (a heterogeneous replica its own seq_len where it sets one, checked by validate)."""
    pipes = plan.pipelines or [plan]
    for pipe in pipes:
        if getattr(pipe, "seq_len", None) is not None:
            continue
        sharded = [s for s in pipe.stages if s.sequence_parallel]
        tp = max((s.tp for s in sharded), default=1)
        cp = max((s.cp for s in sharded), default=1)
        if not sequence_parallel_divides(seq_len, tp, cp):
            by = f"tp {tp}" if cp == 1 else f"tp {tp} x cp {cp}"
            return (f"data.seq_len={seq_len} is not divisible by {by}, over which the plan's sequence parallelism "
                    f"shards it; set data.seq_len to a multiple of {tp * cp} or use a plan without sequence_parallel")
    return ""


def _check_rank_range(plan: Plan, err) -> None:
    """Every rank a plan names is one of 0..world_size-1, named where it is not."""
    lists = [(f"{where}[{i}].ranks", s.ranks) for where, stages in _stage_lists(plan) for i, s in enumerate(stages)]
    lists += [(f"device_groups[{g}]", group) for g, group in enumerate(plan.device_groups)]
    lists.append(("unused_ranks", plan.unused_ranks))
    for where, ranks in lists:
        beyond = [r for r in ranks if not 0 <= r < plan.world_size]
        if beyond:
            raise err(where, f"rank {beyond[0]} is beyond world_size {plan.world_size} (ranks 0..{plan.world_size - 1}); "
                      "use ranks below world_size, or raise world_size")


def _check_world(plan: Plan, used: List[int], err) -> None:
    all_ranks = used + list(plan.unused_ranks)
    if len(set(all_ranks)) != len(all_ranks):
        dup = sorted({r for r in all_ranks if all_ranks.count(r) > 1})
        where = "pipelines" if plan.pipelines else "device_groups"
        raise err(where, f"ranks {dup} appear in more than one group" + (" (or also in unused_ranks)" if plan.unused_ranks else ""))
    if sorted(all_ranks) != list(range(plan.world_size)):
        raise err("world_size", f"the plan's groups use {len(all_ranks)} ranks but world_size is {plan.world_size}; "
                  "the ranks must be exactly 0..world_size-1 (list idle ones in unused_ranks)")


def _stage_lists(plan: Plan):
    if plan.pipelines:
        return [(f"pipelines[{p}].stages", pipe.stages) for p, pipe in enumerate(plan.pipelines)]
    return [("stages", plan.stages)]


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
    if plan.world_size < 1:
        raise err("world_size", f"must be >= 1, got {plan.world_size}")
    _check_rank_range(plan, err)
    optimizer = (plan.meta or {}).get("replica_optimizer")
    if optimizer is not None and optimizer not in REPLICA_OPTIMIZERS:
        raise err("meta.replica_optimizer", f"{optimizer!r} is not one of {', '.join(REPLICA_OPTIMIZERS)}; fix it or "
                  "delete the key (replicas then step their whole model)")
    if plan.pipelines:
        _validate_heterogeneous(plan, err)
        _check_launch(plan, err)
        return
    if plan.reshard_after_forward is not None and not isinstance(plan.reshard_after_forward, bool):
        raise err("reshard_after_forward", f"must be true, false or null, got {plan.reshard_after_forward!r}")
    if plan.stages_per_rank < 1:
        raise err("stages_per_rank", "must be >= 1")
    spec = schedules.get(plan.schedule, plan.stages_per_rank)
    if not spec.takes(plan.stages_per_rank):
        takers = [n for n, s in schedules.SCHEDULES.items() if s.takes(plan.stages_per_rank)]
        raise err("stages_per_rank", f"schedule {plan.schedule} takes {spec.allowed_stages_per_rank()} stage(s) per "
                  f"rank, not {plan.stages_per_rank}; change it, or use schedule {' or '.join(takers) or 'none'}")
    if plan.pp < 1 or len(plan.device_groups) != plan.pp:
        raise err("device_groups", f"{len(plan.device_groups)} groups listed but pp is {plan.pp}; list one group per pipeline position")
    if len(plan.stages) != plan.pp * plan.stages_per_rank:
        raise err("stages", f"{len(plan.stages)} stages listed; pp={plan.pp} x stages_per_rank={plan.stages_per_rank} "
                  f"needs {plan.pp * plan.stages_per_rank}")
    # Groups may differ in size only where their stages' tp degrees differ (per-stage tensor parallel).
    expected = {plan.stage_group(i): s.tp * s.dp * s.cp for i, s in enumerate(plan.stages)}
    if any(len(g) != expected.get(i, len(g)) for i, g in enumerate(plan.device_groups)) \
            and len({len(g) for g in plan.device_groups}) != 1:
        raise err("device_groups", f"groups must have equal size (or tp*dp of their stages), got sizes "
                  f"{sorted({len(g) for g in plan.device_groups})}")
    _check_stage_layers(plan.stages, plan.n_layer, "stages", err)
    _check_sequence_parallel(plan, err)
    for i, s in enumerate(plan.stages):
        group = plan.device_groups[plan.stage_group(i)]
        if sorted(s.ranks) != sorted(group):
            raise err(f"stages[{i}].ranks", f"{s.ranks} differ from its device group {group}")
    _check_world(plan, [r for g in plan.device_groups for r in g], err)
    dps = {s.dp for s in plan.stages}
    if len(dps) != 1:
        raise err("stages", f"stages have different dp degrees {sorted(dps)}; use per-stage tp so tp*dp is equal")
    cps = [s.cp for s in plan.stages]
    if len(set(cps)) != 1:
        raise err(f"stages[{cps.index(max(cps))}].cp", f"stages have different cp degrees {sorted(set(cps))}; every "
                  "stage shards the same sequence, so give them all one cp")
    if cps[0] > 1 and not plan.uniform_tp:
        raise err("stages", "context parallelism needs the same tp on every stage (unequal tp runs on hrlplan's own "
                  "executor, which has no context parallelism); set cp 1 or make tp uniform")
    if not plan.uniform_tp and plan.stages_per_rank > 1:
        raise err("stages", "stages of unequal tp need one stage per rank (stages_per_rank: 1)")
    if not plan.uniform_tp and not spec.heterogeneous:
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
    refusal = spec.microbatch_refusal(plan.pp, plan.num_microbatches, plan.stages_per_rank)
    if refusal:
        raise err("num_microbatches", f"{refusal}; change num_microbatches (and microbatch_size with it)")
    _check_launch(plan, err)


def _validate_heterogeneous(plan: Plan, err) -> None:
    if plan.reshard_after_forward is not None:
        raise err("reshard_after_forward", "heterogeneous pipelines hold whole replicas (no FSDP sharding); remove the key")
    if not schedules.get(plan.schedule).heterogeneous:
        raise err("schedule", f"heterogeneous pipelines run on hrlplan's own executor, which offers "
                  f"{' and '.join(HETERO_SCHEDULES)}, not {plan.schedule}")
    used: List[int] = []
    for p, pipe in enumerate(plan.pipelines):
        where = f"pipelines[{p}]"
        for i, s in enumerate(pipe.stages):
            if s.dp != 1:
                raise err(f"{where}.stages[{i}].dp", "a pipeline is one replica (dp 1); list more pipelines for more replicas")
            if s.cp != 1:
                raise err(f"{where}.stages[{i}].cp", "heterogeneous pipelines run on hrlplan's own executor, which "
                          "has no context parallelism; remove the key")
        _check_stage_layers(pipe.stages, plan.n_layer, f"{where}.stages", err)
        _check_replica_sequence_parallel(pipe, where, err)
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
