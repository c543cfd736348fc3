"""The replica search's second sub-space: the single-template optimum's own replicas plus replicas on
the devices it leaves idle.

The single template that wins on a mixed cluster is often a pipeline whose stages sit on different
device types, replicated dp times; the by-type sub-space (hetero_exact.py) holds replicas of one type
each, so it cannot express "that plan, plus replicas on the nodes it leaves idle". This sub-space
does:

- the anchor: the single-template optimum's template -- its stages, layer split, tp per stage -- on
  each of its dp data-parallel slices (slice i holds, at every pipeline position, the i-th tp group
  of that position's devices) as a replica at dp 1, all with r rows of the global batch (any r whose
  slices leave the other replicas a multiple of the share grid's unit: anchor_rows), at the
  micro-batch size (a divisor of r up to the template's) and recomputation (the template's, or full
  where the template's does not fit at dp 1) that give the replica the least step time;
- per device type, k >= 0 replicas of one shape on the whole nodes the single template leaves idle,
  each template the exact planner's optimum for its rows (as in the by-type sub-space), under the
  single template's nproc-per-node.

The shares are balanced by the same integer program (hetero_exact.ShareProgram, the anchor an option
group that must be chosen) and every selection is predicted in full, cross-replica reduce included.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hrlplan.cost.model import Layout
from hrlplan.search.common import describe
from hrlplan.search.hetero import HeteroSpace, Shape, sharding_saves_at_most_s, single_template_of
from hrlplan.search.hetero_exact import TP_ANY, Option, ShareSearch, enumerate_options, row_grid

ANCHOR_SHARE_OF_BUDGET = 0.6   # of what is left: the by-type sub-space keeps the rest


def anchor_slices(layout: Layout) -> List[Tuple[Tuple[int, ...], ...]]:
    """The template's dp replicas: at each position, the i-th of its dp groups (groups are dp-major)."""
    out = []
    for i in range(layout.dp):
        out.append(tuple(tuple(g[i * (len(g) // layout.dp):(i + 1) * (len(g) // layout.dp)])
                         for g in layout.groups))
    return out


def slice_signature(cluster, groups: Sequence[Sequence[int]]) -> tuple:
    """What a slice's step depends on, on a preset: each position's device type, how many nodes it
    spans, and whether it shares a node with the previous position (the link between them)."""
    out, previous = [], set()
    for g in groups:
        nodes = {cluster.devices[d].node for d in g}
        out.append((cluster.devices[g[0]].name, len(nodes), bool(nodes & previous)))
        previous = nodes
    return tuple(out)


def idle_nodes(cluster, layout: Layout, nproc: int) -> List[int]:
    """Nodes none of whose devices the layout uses and that can launch `nproc` workers."""
    used = {cluster.devices[d].node for g in layout.groups for d in g}
    sizes: Dict[int, int] = {}
    for d in cluster.devices:
        sizes[d.node] = sizes.get(d.node, 0) + 1
    return sorted(n for n, size in sizes.items() if n not in used and size >= nproc)


def why_no_anchor(meta, layout: Optional[Layout], one_tp: bool) -> str:
    if layout is None:   # none fits, or the caller ran no single-template search with this simulator
        return "no single-template optimum to anchor on"
    if layout.cp != 1 or layout.stages_per_rank != 1:
        return "the single template uses context parallelism or several stages per rank"
    if one_tp and len({layout.tp_of(k) for k in range(len(layout.spans))}) > 1:
        return "the single template holds GPT-2 blocks at different tp degrees"
    return ""


class AnchorTemplates:
    """The anchor replicas' layouts and step time per row count (the simulator on one slice of each
    distinct signature; the time is the slowest's)."""

    def __init__(self, sim, single: Layout):
        self.sim, self.single = sim, single
        self.slices = anchor_slices(single)
        seen: Dict[tuple, int] = {}
        for i, groups in enumerate(self.slices):
            seen.setdefault(slice_signature(sim.cluster, groups), i)
        self.distinct = sorted(seen.values())

    def layout(self, groups, rows: int, microbatch: int, recompute: tuple) -> Layout:
        s = self.single
        return Layout(spans=s.spans, groups=groups, tp=s.tp, dp=1, microbatch_size=microbatch,
                      num_microbatches=rows // microbatch, schedule=s.schedule, stage_tp=s.stage_tp,
                      recompute=recompute)

    def variants(self, rows: int):
        n = len(self.single.spans)
        recomputes = [self.single.recompute]
        if tuple(self.single.recompute) != ("full",) * n:
            recomputes.append(("full",) * n)
        sizes = [b for b in range(min(self.single.microbatch_size, rows), 0, -1) if rows % b == 0]
        return [(b, rc) for rc in recomputes for b in sizes]

    def best(self, rows: int, deadline: float) -> Optional[Tuple[float, int, tuple, float]]:
        """(step time, micro-batch size, recomputation, the most the sharded optimizer can save on
        a slice: hetero.sharding_saves_at_most_s) of the fastest variant that fits, or None."""
        best = None
        for b, rc in self.variants(rows):
            if time.perf_counter() > deadline:
                break
            worst, saving = 0.0, 0.0
            for i in self.distinct:
                layout = self.layout(self.slices[i], rows, b, rc)
                r = self.sim.evaluate(layout, detail=True)
                worst = max(worst, r.step_time_s if r.feasible else float("inf"))
                if worst == float("inf"):
                    break
                saving = max(saving, sharding_saves_at_most_s(self.sim, layout, r))
            if worst < float("inf") and (best is None or worst < best[0]):
                best = (worst, b, rc, saving)
            if best is not None and rc != self.single.recompute:
                break   # full recomputation only where the template's own does not fit
        return best

    def option(self, rows: int, nproc: int, tp: int, label: str, deadline: float) -> Optional[Option]:
        found = self.best(rows, deadline)
        if found is None:
            return None
        step, b, rc, saving = found
        layouts = tuple(self.layout(g, rows, b, rc) for g in self.slices)
        # the program's coefficient: a lower bound under either optimizer (hetero_exact.py)
        return Option(label, Shape(0, len(self.slices)), len(self.slices), rows, tp, step - saving, nproc, layouts)


MAX_ANCHOR_ROWS = 48


def anchor_rows(global_batch: int, unit: int, slices: int) -> List[int]:
    """The anchor's rows per slice: every r whose slices leave the other replicas a multiple of the
    grid's unit (slices x r a multiple of it) -- finer than the grid, which would leave nothing to a
    template of 16 slices on a 16-step grid; evenly thinned to MAX_ANCHOR_ROWS, the largest kept."""
    step = unit // math.gcd(unit, slices)
    rows = list(range(step, global_batch // slices + 1, step))
    if len(rows) > MAX_ANCHOR_ROWS:
        stride = math.ceil(len(rows) / MAX_ANCHOR_ROWS)
        rows = sorted(set(rows[::-1][::stride]))
    return rows


def anchor_label(cluster, layout: Layout) -> str:
    types = []
    for g in layout.groups:
        name = cluster.devices[g[0]].name
        if name not in types:
            types.append(name)
    return f"single-template ({'+'.join(types)})"


def describe_anchored(single: Layout, slices: int, idle: int, nproc: int, grid: List[int]) -> str:
    return (f"the single-template optimum's template ({describe(single)}: its stages, layer split and tp) on "
            f"each of its {slices} data-parallel slices as a replica at dp 1, r rows each (anchor_rows: slices x r a "
            f"multiple of {grid[0]}, at most {MAX_ANCHOR_ROWS} values of r), at the micro-batch size (a divisor of "
            f"its rows up to the template's) and recomputation (the template's, or full) fastest for its rows, plus "
            f"per device type k replicas of one shape on the {idle} whole nodes it leaves idle at nproc-per-node "
            f"{nproc}, each template the exact planner's optimum for its rows")


def search_anchored(search: ShareSearch, single, steps: int, tps: List[int]) -> Dict[str, Any]:
    """The anchored sub-space's best plan into `search` (its best_s / best); returns {options,
    gave_up, sub_space ('' where the sub-space is empty, with info's why), info}."""
    sim, cluster = search.sim, search.cluster
    single = single if single is not None else single_template_of(sim)
    layout = single.layout if single is not None else None
    one_tp = tps != [TP_ANY]
    why = why_no_anchor(search.meta, layout, one_tp)
    if why:
        return {"options": 0, "gave_up": "", "sub_space": "", "info": {"ran": False, "why": why}}
    first_node = cluster.devices[layout.groups[0][0]].node   # a launch has one nproc-per-node: the first's
    nproc = len({d for g in layout.groups for d in g if cluster.devices[d].node == first_node})
    idle = idle_nodes(cluster, layout, nproc)
    if not idle:
        return {"options": 0, "gave_up": "", "sub_space": "",
                "info": {"ran": False, "why": "the single template leaves no whole node idle"}}
    t0 = time.perf_counter()
    own_deadline = search.deadline
    deadline = t0 + max(0.0, own_deadline - t0) * ANCHOR_SHARE_OF_BUDGET
    grid = row_grid(search.global_batch, steps)
    anchors = AnchorTemplates(sim, layout)
    tp = layout.tp if one_tp else TP_ANY
    label = anchor_label(cluster, layout)
    options = [o for rows in anchor_rows(search.global_batch, grid[0], len(anchors.slices))
               for o in [anchors.option(rows, nproc, tp, label, deadline)] if o is not None]
    for o in options:   # the anchor's bounds are final already: no template search refines them
        search.table.table[o.key] = (o.time_s, o.layouts[0])
    idle_space = HeteroSpace(cluster, nproc, nodes=idle)
    table = search.table
    if nproc not in table._spaces:   # the templates are searched on a whole-cluster space of this nproc
        table.bind(dict(table._spaces, **{nproc: HeteroSpace(cluster, nproc)}))
    options += enumerate_options(table, idle_space, search.global_batch, steps, [tp] if one_tp else tps)
    gave_up = ""
    if time.perf_counter() > deadline:
        gave_up = f"{search.time_limit} x {ANCHOR_SHARE_OF_BUDGET} ran out while the anchor's times were found"
    before = search.best_s
    search.deadline = deadline
    try:
        if any(o.layouts for o in options):
            gave_up = search.assess(options, required=(label,), placement={nproc: idle_space}) or gave_up
    finally:
        search.deadline = own_deadline
    info = {"ran": True, "single_template": describe(layout), "slices": len(anchors.slices), "idle_nodes": len(idle),
            "nproc_per_node": nproc, "anchor_options": sum(bool(o.layouts) for o in options),
            "options": len(options), "time_s": time.perf_counter() - t0, "improved": search.best_s < before,
            "best_s": search.best_s if search.best_s < before else None, "had_incumbent": before < float("inf"),
            "gave_up": gave_up}
    return {"options": len(options), "gave_up": gave_up, "info": info,
            "sub_space": describe_anchored(layout, len(anchors.slices), len(idle), nproc, grid)}


def anchored_note(info: Dict[str, Any]) -> str:
    """plan_info's word on the anchored sub-space: why it did not run, or what it found."""
    if not info["ran"]:
        return f"no anchored sub-space ({info['why']})"
    if info["improved"]:
        found = f"its best plan {info['best_s'] * 1e3:.4g} ms"
    else:
        found = "none faster than the incumbent" if info["had_incumbent"] else "no plan that fits"
    cut = f", cut short at {info['gave_up']}" if info["gave_up"] else ""
    return (f"anchored on the single template's {info['slices']} slices and {info['idle_nodes']} idle nodes: "
            f"{info['anchor_options']} of its row counts fit at dp 1, {found}{cut}")
