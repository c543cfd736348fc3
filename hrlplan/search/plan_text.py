"""How a plan is written for people: one notation everywhere (show-plan, plan summaries, the console,
timeline.png).

- parallel degrees: always all three, `pp=2 tp=4 dp=2` (tp per stage when stages differ: `tp=4/2/2`);
- micro-batching: count first, in words, `4 micro-batches of 2` (rows each), `1 micro-batch of 8`:
  never `4x2` or `2 x 4`, which read either way round;
- idle devices: the cluster's devices the plan leaves out and the launched ranks it leaves idle;
- options beyond the degrees, in brackets after them, only where the plan sets them:
  `pp=1 tp=8 dp=4 [sequence parallel, FSDP reshards after forward]` (plan_options).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Union

from hrlplan import schedules
from hrlplan.plan import Plan

# The older summaries' `mb=<size>x<count>` (search/common.describe before this notation).
_OLD_MB = re.compile(r" mb=(\d+)x(\d+)(?: (\w+) (?=layers/stage=))?")
_CLUSTER_WORKERS = re.compile(r"(\d+) workers? on ")


def microbatching(count: int, size: int) -> str:
    """`4 micro-batches of 2`: how many micro-batches a replica runs per step, and their rows."""
    return f"{count} micro-batch{'' if int(count) == 1 else 'es'} of {size}"


def degrees(pp: int, tp: Union[int, Sequence[int]], dp: int) -> str:
    """`pp=2 tp=4 dp=2`; a tp that differs between stages is listed per stage (`tp=4/2`)."""
    if isinstance(tp, (list, tuple)):
        tp = tp[0] if len(set(tp)) == 1 else "/".join(str(t) for t in tp)
    return f"pp={pp} tp={tp} dp={dp}"


def layout_text(pp: int, tp: Union[int, Sequence[int]], dp: int, count: int, size: int, schedule: str) -> str:
    """`pp=2 tp=4 dp=2, 4 micro-batches of 2, 1f1b`: the summary of a layout or a plan."""
    return f"{degrees(pp, tp, dp)}, {microbatching(count, size)}, {schedule}"


def layout_summary(layout: Any) -> str:
    """A search Layout (hrlplan.cost.model.Layout) as `pp=2 tp=1 dp=2, 4 micro-batches of 2, 1f1b,
    layers/stage=[3,3]`: the planners' summaries (plan_info.json's chosen/runner_up, the why text);
    recomputation, sequence parallelism and resharding appended where a layout uses them."""
    spans = ",".join(str(b - a) for a, b in layout.spans)
    extras = []
    modes = getattr(layout, "recompute", ())
    if any(m != "none" for m in modes):
        extras.append("recompute=" + ("/".join(modes) if len(set(modes)) > 1 else modes[0]))
    if getattr(layout, "sequence_parallel", False):
        extras.append("sequence parallel")
    if getattr(layout, "reshard_after_forward", False) and layout.dp > 1:
        extras.append("FSDP reshards after forward")
    if getattr(layout, "cp", 1) > 1:
        extras.append(f"context parallel {layout.cp}")
    return (f"{layout_text(layout.pp, layout.tp, layout.dp, layout.num_microbatches, layout.microbatch_size, layout.schedule)}"
            f", layers/stage=[{spans}]" + "".join(f", {e}" for e in extras))


def plan_micro_batching(plan: Plan) -> str:
    """A plan's micro-batching; a heterogeneous plan's per replica (`replica 0: 4 micro-batches of 2; ...`)."""
    if not plan.heterogeneous:
        return microbatching(plan.num_microbatches, plan.microbatch_size)
    return "; ".join(f"replica {i}: {microbatching(p.num_microbatches, p.microbatch_size)}"
                     for i, p in enumerate(plan.pipelines))


def plan_degrees(plan: Plan) -> str:
    """`pp=2 tp=4 dp=2`, then what plan_options lists in brackets."""
    stages = plan.pipelines[0].stages if plan.heterogeneous else plan.stages
    options = plan_options(plan)
    return degrees(plan.pp, [s.tp for s in stages], plan.dp) + (f" [{', '.join(options)}]" if options else "")


def plan_options(plan: Plan) -> List[str]:
    """The plan's sequence parallelism and FSDP resharding where it states them: `sequence parallel`;
    `FSDP reshards after forward` / `FSDP keeps weights gathered` where reshard_after_forward is
    written (unwritten: torchtitan's default, true without pipelining, false under it)."""
    out = ["sequence parallel"] if not plan.heterogeneous and plan.sequence_parallel else []
    if plan.cp > 1:
        out.append(f"context parallel {plan.cp}")
    if plan.reshard_after_forward is not None:
        out.append("FSDP reshards after forward" if plan.reshard_after_forward else "FSDP keeps weights gathered")
    return out


def plan_summary(plan: Plan) -> str:
    """`pp=1 tp=4 dp=2, 4 micro-batches of 2 (global batch 16), 1f1b`."""
    return (f"{plan_degrees(plan)}, {plan_micro_batching(plan)} (global batch {plan.global_batch_size}), "
            f"{plan.schedule}")


def plan_dict_summary(plan: Dict[str, Any]) -> str:
    """plan_summary for a plan.yaml read as a plain mapping (timeline.png), without validating it."""
    stages = plan.get("stages") or [{}]
    pipelines = plan.get("pipelines") or []
    if pipelines:
        first = pipelines[0]
        count = int(first.get("num_microbatches", 1))
        size = int(first.get("batch_size", count)) // max(count, 1)
        stages = first.get("stages") or [{}]
        dp = len(pipelines)
    else:
        count, size, dp = plan.get("num_microbatches", 1), plan.get("microbatch_size", "?"), stages[0].get("dp", 1)
    pp = plan.get("pp") or len(stages)
    return layout_text(pp, [s.get("tp", 1) for s in stages], dp, count, size, plan.get("schedule", schedules.DEFAULT))


def rewrite_old_notation(text: str) -> str:
    """A summary written before this notation (`mb=4x2`: size x count) in words."""
    def words(m: "re.Match[str]") -> str:
        schedule = f", {m.group(3)}, " if m.group(3) else ""
        return f", {microbatching(int(m.group(2)), int(m.group(1)))}{schedule}"
    return _OLD_MB.sub(words, text)


def cluster_device_count(info: Optional[Dict[str, Any]]) -> Optional[int]:
    """The devices of the cluster a plan was made for, from plan_info.json (its `cluster_devices`,
    else the cluster summary's `N workers on ...`); None when it does not say."""
    if not info:
        return None
    if isinstance(info.get("cluster_devices"), int):
        return info["cluster_devices"]
    match = _CLUSTER_WORKERS.search(str(info.get("cluster") or ""))
    return int(match.group(1)) if match else None


def idle_lines(plan: Plan, cluster_devices: Optional[int] = None) -> List[str]:
    """What the plan leaves idle, one line each: the cluster's devices it does not launch, and the
    launched ranks that do not train. Empty when every device trains."""
    lines = []
    if cluster_devices is not None and cluster_devices > plan.world_size:
        idle = cluster_devices - plan.world_size
        lines.append(f"idle devices: the plan uses {plan.world_size} of the cluster's {cluster_devices} devices; "
                     f"{idle} stay idle (not launched)")
    if plan.unused_ranks:
        lines.append(f"idle ranks: {len(plan.unused_ranks)} of the {plan.world_size} launched ranks do not train "
                     f"(ranks {_ranges(plan.unused_ranks)}): the plan predicts a faster step without them")
    return lines


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> `0-2, 5`."""
    out, ranks = [], sorted(ranks)
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
