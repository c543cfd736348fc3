"""Plans that leave ranks idle: where the used ranks sit in the job, and back.

A probed job launches every worker (torchrun's uniform nproc-per-node); a plan may still train on
fewer of them when that is faster (communication or shared cores cost more than the compute
gained). The planner builds such a plan on compact ranks 0..k-1 and `place_on_ranks` moves it
onto the job's ranks, the rest listed in `unused_ranks`. At start-up the job does the reverse
(`compact`): idle workers leave, the used ones form their own process group, and the trainer
sees an ordinary plan on ranks 0..k-1.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Sequence, Tuple

from hrlplan.plan import Plan, validate


def _renumber(plan: Plan, mapping: Dict[int, int], world_size: int, unused: Sequence[int]) -> Plan:
    if plan.heterogeneous:
        # its stages and device groups derive from the pipelines (stages *is* the first pipeline's list):
        # renumber the pipelines alone and rebuild the rest, checked, from the dict
        d = plan.to_dict()
        for pipe in d["pipelines"]:
            for stage in pipe["stages"]:
                stage["ranks"] = [mapping[r] for r in stage["ranks"]]
        launch = d.get("meta", {}).pop("launch", None)   # the callers set the launch of the new rank count
        d.update(world_size=world_size, unused_ranks=sorted(unused))
        out = Plan.from_dict(d, source="the plan renumbered onto the job's ranks")
        if launch is not None:
            out.meta["launch"] = launch
        return out
    out = copy.deepcopy(plan)
    for s in out.stages:
        s.ranks = [mapping[r] for r in s.ranks]
    for p in out.pipelines:
        for s in p.stages:
            s.ranks = [mapping[r] for r in s.ranks]
    out.device_groups = [[mapping[r] for r in g] for g in out.device_groups]
    out.world_size = world_size
    out.unused_ranks = sorted(unused)
    return out


def place_on_ranks(plan: Plan, job_ranks: Sequence[int], world_size: int, launch: Dict) -> Plan:
    """A plan on compact ranks 0..k-1 moved onto `job_ranks` (compact rank i -> job_ranks[i]) of
    a job of `world_size` ranks launched as `launch`; the ranks it does not use become unused_ranks.
    Per-rank predictions (memory) follow their ranks; idle ranks predict 0."""
    mapping = {i: int(r) for i, r in enumerate(job_ranks)}
    unused = [r for r in range(world_size) if r not in set(mapping.values())]
    if mapping == {r: r for r in range(world_size)}:
        return plan
    out = _renumber(plan, mapping, world_size, unused)
    predicted = out.meta.get("predicted") or {}
    memory = predicted.get("memory_bytes_per_rank")
    if memory:
        placed = [0] * world_size
        for i, m in enumerate(memory):
            placed[mapping[i]] = m
        predicted["memory_bytes_per_rank"] = placed
    out.meta["launch"] = launch
    validate(out)
    return out


def compact(plan: Plan) -> Tuple[Plan, List[int]]:
    """The plan on ranks 0..k-1 of its used ranks (in job order), and those job ranks."""
    if not plan.unused_ranks:
        return plan, list(range(plan.world_size))
    used = sorted({r for pipe in plan.as_pipelines() for s in pipe.stages for r in s.ranks})
    mapping = {r: i for i, r in enumerate(used)}
    out = _renumber(plan, mapping, len(used), [])
    launch = dict(out.meta.get("launch") or {})
    if launch.get("rank_to_device"):
        launch["rank_to_device"] = [launch["rank_to_device"][r] for r in used]
    memory = (out.meta.get("predicted") or {}).get("memory_bytes_per_rank")
    if memory and len(memory) == plan.world_size:
        out.meta["predicted"]["memory_bytes_per_rank"] = [memory[r] for r in used]
    launch.update(nnodes=1, nproc_per_node=len(used))   # the ranks as the trainer sees them
    launch.pop("per_node_visible_devices", None)
    out.meta["launch"] = launch
    return out, used
