"""The simulator: step time with a breakdown and peak memory per device for a Layout, or the
reason it cannot run (naming the device)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from hrlplan import schedules
from hrlplan.cost import memory as mem
from hrlplan.cost import quota_cpu
from hrlplan.cost.device_model import all_reduce_time
from hrlplan.cost.model import GiB, CostOptions, DeviceModel, Layout, StageCostModel
from hrlplan.cost.timeline import simulate_shared_timeline, simulate_timeline
from hrlplan.families import family_of_meta

ZB_INPUT_GRAD_SHARE = 0.5   # a split-backward schedule's input-gradient (B) share; the rest is weight-gradient (W)
# the gradients sequence parallelism leaves Partial are those of float32 parameters (bf16 runs autocast)
PARTIAL_GRAD_BYTES = 4.0


def zb_input_shares(n_stages: int, calibrated: Optional[float]) -> List[float]:
    """Per model stage, the input-gradient (B) share of a zero-bubble backward: the default split
    uncalibrated; calibrated, the measured share, and 0 on the first stage (its input is token ids,
    so its whole backward is weight gradients)."""
    if calibrated is None:
        return [ZB_INPUT_GRAD_SHARE] * n_stages
    return [0.0 if k == 0 else float(calibrated) for k in range(n_stages)]


@dataclass
class SimResult:
    feasible: bool
    step_time_s: float                       # inf when infeasible
    reason: str = ""
    bubble_fraction: float = 0.0
    memory_bytes: Dict[int, float] = field(default_factory=dict)   # cluster device id -> peak bytes
    breakdown: Dict[str, Any] = field(default_factory=dict)
    stages: List[Dict[str, Any]] = field(default_factory=list)
    over_memory: bool = False   # infeasible because a device's peak is over its memory (`reason` says which)


class Simulator:
    """Bound to one (model, cluster, options): planners call `evaluate` thousands of times."""

    def __init__(self, meta, cluster, opts: Optional[CostOptions] = None):
        self.meta = meta
        self.cluster = cluster
        self.opts = opts or CostOptions()
        self.devices = DeviceModel(cluster)
        self.costs = StageCostModel(meta, cluster, self.opts, self.devices)
        self.evaluations = 0
        self._links: Dict[tuple, Any] = {}

    def links(self, group, tp, dp):
        key = (tuple(group), tp, dp)
        if key not in self._links:
            self._links[key] = self.costs.group_links(group, tp, dp)
        return self._links[key]

    def step_collectives(self, layout: Layout) -> float:
        """Time of the small all-reduces every step makes after the pipeline: the loss (world > 1),
        the gradient norm over the pipeline (pp > 1) and over the shards of FSDP (dp > 1) and tensor
        parallel (tp > 1) -- a sharded gradient's norm is reduced once per step -- and a tied
        embedding's gradient when its first and last stage sit on different groups."""
        ov = self.devices.overheads
        world = layout.pp * len(layout.groups[0])
        small = ov.allreduce_latency
        t = ov.allreduce(world, 4, small)                                    # the loss
        shards = (layout.dp if self.opts.dp_mode == "fsdp" else 1) * layout.tp
        if shards > 1:
            t += ov.allreduce(shards, 4, small)                              # the norm over the shards
        if layout.pp > 1:
            t += ov.allreduce(layout.pp, 4, small)                           # the norm over the stages
            first, last = layout.stage_group(0), layout.stage_group(len(layout.spans) - 1)
            if self.meta.tied_embeddings and first != last:
                shards = layout.dp if self.opts.dp_mode == "fsdp" else 1
                tied = self.meta.head_matmul_params * 4.0 / shards / layout.tp
                default = ov.tied_allreduce
                if default is None:
                    default = self.tied_link_s(layout.groups[first], layout.groups[last], tied)
                t += ov.allreduce(2, tied, default)
        return t

    def tied_link_s(self, first: Sequence[int], last: Sequence[int], nbytes: float) -> float:
        """A tied embedding's gradient all-reduce (runtime/parallel.py TiedEmbeddingSync: device i of
        the first stage's group with device i of the last's, all pairs at once) over its slowest pair's
        link, as cost/plans.py charges a replica plan's rings: the bytes over the link plus the
        calibrated small all-reduce's latency, or two hops' latency uncalibrated."""
        lat = self.devices.overheads.allreduce_latency
        worst = 0.0
        for a, b in zip(first, last):
            bw, hop = self.devices.ring_bw_lat([a, b])
            worst = max(worst, nbytes / bw + (lat if lat else 2.0 * hop))
        return worst

    def pipeline_timing(self, layout: Layout, contention: Optional[float] = None):
        """(end, duration of the last backward) per pipeline position, as evaluate runs the step: what
        a heterogeneous plan's cross-replica reduce overlaps (cost/plans.py)."""
        run = _StepRun(self, layout)
        run.simulate_pipeline(contention)
        _, finish, _ = run.step_time(run.position_totals())
        return list(finish), list(run.tl.last_backward)

    def evaluate(self, layout: Layout, detail: bool = False, contention: Optional[float] = None,
                 micro_batch_work: Optional[Sequence[Sequence[float]]] = None,
                 backward_work: Optional[Sequence[Sequence[float]]] = None) -> SimResult:
        """`contention` sets one compute slowdown for the whole step (hetero plans pass the world's
        mean field). Default, where ranks outnumber cores: each operation slowed by the ranks busy
        while it runs (simulate_shared_timeline). micro_batch_work[k][j]: model stage k's compute for
        micro-batch j over the fixed-length micro-batch it costs (packed documents of mixed length:
        cost/lengths.py); None, every micro-batch alike. backward_work: the backward's, where it differs.
        """
        self.evaluations += 1
        run = _StepRun(self, layout, micro_batch_work, backward_work)
        run.simulate_pipeline(contention)
        totals = run.position_totals()
        step, finish, exposed = run.step_time(totals)
        pos_need = [mem.position_peak_bytes(totals.static[p], totals.grads[p], run.tl.peak_before_grads[p],
                                            run.tl.peak_with_grads[p], totals.transient[p], totals.rebuilt[p])
                    for p in range(layout.pp)]
        memory, reason = self._memory_check(layout, pos_need)
        if reason:
            return SimResult(False, float("inf"), reason=reason, memory_bytes=memory, over_memory=True)
        tl = run.tl
        bubble = 1.0 - sum(tl.busy) / (tl.makespan * layout.pp) if tl.makespan > 0 else 0.0
        res = SimResult(True, step, bubble_fraction=max(bubble, 0.0), memory_bytes=memory)
        if detail:
            res.breakdown = run.breakdown(step, finish, exposed, totals, memory, res.bubble_fraction)
            res.stages = run.stage_details(pos_need)
        return res

    def _memory_check(self, layout: Layout, pos_need: List[float]):
        """Peak bytes per device; the reason naming the most over-committed device, if any is."""
        o = self.opts
        memory: Dict[int, float] = {}
        worst: Optional[tuple] = None
        for pos, group in enumerate(layout.groups):
            need = pos_need[pos]
            for d in group:
                memory[d] = need
                limit = self.devices.memory_limit(d, o.memory_margin)
                if need > limit and (worst is None or need / limit > worst[0]):
                    worst = (need / limit, pos, d, need, limit)
        if worst is None:
            return memory, ""
        _, pos, d, need, limit = worst
        dev = self.cluster.devices[d]
        stage_ids = [k for k in range(len(layout.spans)) if layout.stage_group(k) == pos]
        return memory, (f"out of memory on device {d} ({dev.name}, {dev.hostname} local {dev.local_rank}): "
                        f"stage(s) {stage_ids} need {need / GiB:.2f} GiB > {o.memory_margin:g} x "
                        f"{dev.memory_bytes / GiB:.2f} GiB")


@dataclass
class _PositionTotals:
    """Per pipeline position (a rank's group), summed over the virtual stages it runs."""
    sync: List[float]        # data-parallel gradient sync
    reduce: List[float]      # calibrated FSDP/replicate reduces after the last backward
    static: List[float]      # weights, optimizer state, receive buffers, the workspace reserve (once per rank)
    grads: List[float]
    transient: List[float]   # one backward's working set at a time per rank (memory.stage_transient)
    rebuilt: List[float]     # the same of its full-recomputation stages (beside the gradients too)
    optimizer: List[float]   # the optimizer step, its per-call cost once per rank
    tail: List[float]        # the part of sync that waits for the rank's whole backward (root_sync_tail)


class _StepRun:
    """One evaluation's working state: stage costs, the durations the timeline runs, the timeline."""

    def __init__(self, sim: Simulator, layout: Layout, micro_batch_work: Optional[Sequence[Sequence[float]]] = None,
                 backward_work: Optional[Sequence[Sequence[float]]] = None):
        self.sim, self.layout, self.work, self.back = sim, layout, micro_batch_work, backward_work
        self.ov = sim.devices.overheads
        self.n = len(layout.spans)
        self.groups = [layout.groups[layout.stage_group(k)] for k in range(self.n)]
        msg = sim.costs.activation_message(layout.microbatch_size,
                                           (layout.tp if layout.sequence_parallel else 1) * layout.cp)
        last = self.n - 1
        self.sends = [sim.costs.p2p(self.groups[k], self.groups[k + 1], msg, layout.schedule) if k < last else 0.0
                      for k in range(self.n)]
        hop_handshake = self.ov.hop(layout.schedule)[1]
        self.handshake = [hop_handshake] * self.n if hop_handshake else None
        self.shared_cores = False
        self.quota_work: Dict[int, tuple] = {}

    def stage_costs_at(self, contention: Optional[float], shared_cores: bool = False):
        # each stage at its own tp degree and recompute mode (Layout.tp_of / recompute_of)
        lay, sim, last = self.layout, self.sim, self.n - 1
        return [sim.costs.stage(start, end, k == 0, k == last, self.groups[k], lay.tp_of(k), lay.dp,
                                lay.microbatch_size, lay.pp, links=sim.links(self.groups[k], lay.tp_of(k), lay.dp),
                                contention=contention, shared_cores=shared_cores,
                                recompute=lay.recompute_of(k), microbatches=lay.num_microbatches,
                                sequence_parallel=lay.sequence_parallel, reshard_after_forward=lay.reshard_after_forward,
                                cp=lay.cp)
                for k, (start, end) in enumerate(lay.spans)]

    def durations(self, costs):
        """(forward, backward, weight-gradient) per stage as the schedule runs them."""
        fwd, n = [c.fwd for c in costs], self.n
        if not schedules.get(self.layout.schedule, self.layout.stages_per_rank).split_backward:
            return fwd, [c.bwd for c in costs], [0.0] * n
        factors = self.ov.zb_backward_factors(self.layout.microbatch_size * self.sim.meta.seq_len)
        if factors is not None:
            # as torch runs the split: B (d/dx, 0 on the first stage, whose input is token ids) and
            # W cost these multiples of a plain backward; the first stage's W is one plain backward
            fin, fw = factors
            return (fwd, [0.0 if k == 0 else c.bwd * fin for k, c in enumerate(costs)],
                    [c.bwd if k == 0 else c.bwd * fw for k, c in enumerate(costs)])
        shares = zb_input_shares(n, self.ov.zb_input_grad_share)
        return (fwd, [c.bwd * sh for c, sh in zip(costs, shares)],
                [c.bwd * (1.0 - sh) for c, sh in zip(costs, shares)])

    def _timeline(self, costs, durs):
        fwd, bwd, wgt = durs
        lay = self.layout
        return simulate_timeline(lay.schedule, lay.pp, lay.stages_per_rank, lay.num_microbatches,
                                 fwd, bwd, wgt, self.sends, self.sends, [c.activation for c in costs],
                                 [c.first_fwd_extra for c in costs], [0.0] * self.n, self.handshake,
                                 micro_batch_work=self.work, backward_work=self.back)

    def simulate_pipeline(self, contention: Optional[float]) -> None:
        """Sets stage_costs, the (fwd, bwd, wgt) durations and the timeline tl."""
        lay, ov = self.layout, self.ov
        self.shared_cores = contention is None and ov.contention > 1.0
        if self.shared_cores:
            # More ranks than cores (CPU): contention_factor is the slowdown with every rank busy, but
            # a pipeline's ranks idle in its bubbles. Operations are costed alone and slowed by the ranks
            # busy while they run (simulate_shared_timeline); the pipeline hop, a wake-up more than
            # work, by the mean field: the factor times the busy share, from the timeline at full speed.
            at_full_speed = self.stage_costs_at(1.0)
            alone = self._timeline(at_full_speed, self.durations(at_full_speed))
            busy_share = sum(alone.busy) / (alone.makespan * lay.pp) if alone.makespan > 0 else 1.0
            contention = max(1.0, ov.contention * min(busy_share, 1.0))
            self.stage_costs = self.stage_costs_at(1.0, shared_cores=True)
        else:
            self.stage_costs = self.stage_costs_at(contention)
        derate = ov.busy_derate(contention)
        if derate < 1.0:   # the pipeline hop, calibrated with every rank busy, shrinks with the busy share too
            self.sends = [x * derate for x in self.sends]
            self.handshake = [x * derate for x in self.handshake] if self.handshake else None
        self.fwd, self.bwd, self.wgt = self.durations(self.stage_costs)
        if not self.shared_cores:
            self.tl = self._timeline(self.stage_costs, (self.fwd, self.bwd, self.wgt))
            return
        costs = self.stage_costs
        self.tl = simulate_shared_timeline(
            lay.schedule, lay.pp, lay.stages_per_rank, lay.num_microbatches, self.fwd, self.bwd, self.wgt,
            self.sends, self.sends, [c.activation for c in costs], [c.first_fwd_extra for c in costs],
            self.handshake, ranks=[len(g) for g in lay.groups], contention=ov.contention,
            all_ranks=max(self.sim.cluster.world_size, sum(len(g) for g in lay.groups)), micro_batch_work=self.work,
            backward_work=self.back)

    def position_totals(self) -> _PositionTotals:
        lay = self.layout
        t = _PositionTotals(*([0.0] * lay.pp for _ in range(8)))
        meta, zb = self.sim.meta, schedules.get(lay.schedule, lay.stages_per_rank).split_backward
        reserved = [0.0] * lay.pp
        for k, c in enumerate(self.stage_costs):
            pos = lay.stage_group(k)
            t.reduce[pos] += c.last_bwd_extra + self.partial_grad_reduces(k)
            t.sync[pos] += c.dp_sync
            if k == min(j for j in range(self.n) if lay.stage_group(j) == pos):   # its backward ends the rank's
                t.tail[pos] = self.root_sync_tail(k, c.dp_sync)
            # the workspace reserve is the rank's, once, however many stages it runs
            reserve = c.memory["workspace"] if c.memory else 0.0
            transient = c.memory["transient"] if c.memory else 0.0   # one backward at a time: the largest
            t.static[pos] += c.static_memory - reserve - transient + max(reserve - reserved[pos], 0.0)
            reserved[pos] = max(reserved[pos], reserve)
            t.grads[pos] += c.memory["gradients"] if c.memory else 0.0
            if zb and k > 0:   # the input-gradient pass keeps the weights' input gradients (the first stage has none)
                lo, hi = lay.spans[k]
                transient += mem.zero_bubble_transient(meta, lay.tp_of(k), lay.microbatch_size * meta.seq_len,
                                                       self.sim.opts.bytes_per_value, (hi - lo) * meta.block_repeats)
            full = lay.recompute_of(k) == "full"
            (t.rebuilt if full else t.transient)[pos] = max((t.rebuilt if full else t.transient)[pos], transient)
            t.optimizer[pos] += c.optimizer
        # the optimizer's per-call cost, once per rank: one optimizer steps all of a rank's stages
        fixed = self.ov.optimizer_fixed(lay.dp, lay.tp)
        t.optimizer = [x + fixed for x in t.optimizer]
        return t

    def partial_grad_reduces(self, k: int) -> float:
        """Stage k's all-reduces over its tp ranks of the gradients sequence parallelism leaves Partial
        (each tp rank's sum over its own positions): its norms' weights and LayerNorm biases -- two norms
        a block, the final one on the last stage -- one all-reduce each per step
        (tensor_parallel.replicate_partial_grads at the step's last backward on hrlplan's executor;
        torch's engine as its optimizer first touches them). Hidden-size vectors, so mostly latency;
        charged where the calibrated reduces of the last backward are (t.reduce: the position's end)."""
        lay, meta = self.layout, self.sim.meta
        tp = lay.tp_of(k)
        if not lay.sequence_parallel or tp < 2:
            return 0.0
        start, end = lay.spans[k]
        norms = 2 * (end - start) + (1 if k == self.n - 1 else 0)
        params = norms * (1 if family_of_meta(meta).llama_blocks else 2)   # RMSNorm: a weight; LayerNorm: and a bias
        nbytes = float(meta.hidden_size) * PARTIAL_GRAD_BYTES
        (bw, lat), _ = self.sim.links(self.groups[k], tp, lay.dp)
        return params * self.ov.allreduce(tp, nbytes, all_reduce_time(nbytes, tp, bw, lat))

    def root_sync_tail(self, k: int, dp_sync: float) -> float:
        """The gradient sync of stage k's own parameters (embedding; final norm, head, a tied head's
        copy), which FSDP2 reduce-scatters as the stage root after the stage's whole backward (replicate
        and Megatron's DDP: the last bucket, all-reduced): exposed however long the last backward,
        as a replica plan's embedding bucket is (cost/replica_sync_cost.py). Within dp_sync."""
        lay, meta, o = self.layout, self.sim.meta, self.sim.opts
        last = k == self.n - 1
        root = (meta.embedding_params if k == 0 else 0.0) + (meta.head_params if last else 0.0)
        if meta.tied_embeddings and last and k != 0:
            root += meta.head_matmul_params
        if dp_sync <= 0.0 or lay.dp < 2 or root <= 0.0:
            return 0.0
        _, (bw, lat) = self.sim.links(self.groups[k], lay.tp, lay.dp)
        reduce = all_reduce_time(root / lay.tp_of(k) * o.bytes_per_value, lay.dp, bw, lat)
        return min(reduce / 2 if o.dp_mode == "fsdp" else reduce, dp_sync)

    def step_time(self, t: _PositionTotals):
        """(step time, each position's end, its exposed gradient sync).

        Gradient sync per position: after its last backward, partly hidden behind it when overlapped,
        never its stage root's (root_sync_tail), which waits for the whole backward.
        Calibrated FSDP/replicate reduces (last_bwd_extra) run as the pipeline schedule's REDUCE_GRAD:
        after a stage's last backward has sent its gradient on, so they delay the position's own end,
        not the earlier stages' remaining backward (which they overlap). Then the per-step costs after
        the pipeline: the small all-reduces every step makes (tied embedding gradient, gradient norm
        over the pipeline, the loss), the optimizer, the rest."""
        finish, exposed = [], []
        for pos in range(self.layout.pp):
            hidden = min(t.sync[pos], self.tl.last_backward[pos]) if self.sim.opts.dp_overlap else 0.0
            exposed.append(max(t.sync[pos] - hidden, t.tail[pos]))
            finish.append(self.tl.end[pos] + exposed[-1] + t.reduce[pos])
        self.collectives = self.sim.step_collectives(self.layout)
        step = (max(f + self.collectives + opt for f, opt in zip(finish, t.optimizer)) + self.ov.step)
        step = max([step] + self.cpu_quota_bounds(t))
        return step * self.sim.devices.time_scale, finish, exposed

    def cpu_quota_bounds(self, t: _PositionTotals) -> List[float]:
        """Per position on CPU workers under a quota (cluster.cpu_shares: a device named cpu@<share>),
        its CPU work per step over its share of a core: compute, the pipeline's machinery, the step's
        collectives, optimizer and overhead, in CPU time (cost/quota_cpu.py)."""
        self.quota_work = quota_cpu.position_work(self, t)
        return [work / share for work, share in self.quota_work.values()]

    def breakdown(self, step, finish, exposed, t: _PositionTotals, memory, bubble_fraction) -> Dict[str, Any]:
        lay, tl, costs, scale = self.layout, self.tl, self.stage_costs, self.sim.devices.time_scale
        m = lay.num_microbatches
        crit = max(range(lay.pp), key=lambda p: tl.busy[p])
        crit_stages = [k for k in range(self.n) if lay.stage_group(k) == crit]
        return {
            "step_time_s": step,
            "pipeline_s": tl.makespan * scale,
            "pipeline_end_s": max(finish) * scale,
            # with per-micro-batch work, its sum over the micro-batches stands for m
            "compute_s": sum(3 * (m if self.work is None else sum(self.work[k])) * costs[k].compute_fwd
                             for k in crit_stages) * scale,
            "tp_comm_s": sum(m * (costs[k].tp_comm_fwd + costs[k].tp_comm_bwd) for k in crit_stages) * scale,
            "p2p_comm_s": 2 * sum(self.sends) * scale,
            "dp_comm_s": max(t.sync) * scale,
            "dp_comm_exposed_s": max(exposed) * scale,
            "dp_collectives_s": max(sum(costs[k].first_fwd_extra + costs[k].last_bwd_extra
                                        for k in range(self.n) if lay.stage_group(k) == p)
                                    for p in range(lay.pp)) * scale,
            "optimizer_s": max(t.optimizer) * scale,
            "step_collectives_s": self.collectives * scale,
            "step_overhead_s": self.ov.step * scale,
            "bubble_s": (tl.makespan - tl.busy[crit]) * scale,
            "bubble_fraction": bubble_fraction,
            "bottleneck_position": crit,
            "memory_bytes_per_device": {str(d): v for d, v in sorted(memory.items())},
            "cost_options": self.sim.costs.options_record(),
            "quota_cpu_work": quota_cpu.breakdown_entries(self, self.quota_work),
        }

    def stage_details(self, pos_need: List[float]) -> List[Dict[str, Any]]:
        lay, tl, scale = self.layout, self.tl, self.sim.devices.time_scale
        out = []
        for k, c in enumerate(self.stage_costs):
            pos = lay.stage_group(k)
            out.append({
                "stage": k, "layers": list(lay.spans[k]), "position": pos,
                "devices": list(self.groups[k]), "device_type": self.sim.cluster.devices[self.groups[k][0]].name,
                "tp": lay.tp_of(k), "recompute": lay.recompute_of(k),
                "sequence_parallel": lay.sequence_parallel and lay.tp_of(k) > 1,
                "reshard_after_forward": lay.reshard_after_forward and lay.dp * lay.cp > 1,
                "cp": lay.cp,
                "fwd_s": c.fwd * scale, "bwd_s": c.bwd * scale, "send_s": self.sends[k] * scale,
                # the backward as the timeline runs it: zero-bubble's input (B) and weight (W) parts
                "bwd_input_s": self.bwd[k] * scale, "bwd_weight_s": self.wgt[k] * scale,
                "recv_handshake_s": (self.handshake[k] if self.handshake else 0.0) * scale,
                "first_fwd_extra_s": c.first_fwd_extra * scale,   # FSDP's all-gathers before the first forward
                "last_bwd_extra_s": c.last_bwd_extra * scale,     # its reduces in the step's last backward
                "dp_sync_s": c.dp_sync * scale, "params": c.params,
                "partial_grad_reduce_s": self.partial_grad_reduces(k) * scale,   # sequence parallelism's norms
                # the part of it exposed after the rank's whole backward however long that is (root_sync_tail)
                "dp_sync_tail_s": (self.root_sync_tail(k, c.dp_sync) if k == min(
                    j for j in range(self.n) if lay.stage_group(j) == pos) else 0.0) * scale,
                "activation_bytes_per_microbatch": c.activation, "static_bytes": c.static_memory,
                "static_split_bytes": {key: float(v) for key, v in (c.memory or {}).items()},
                "busy_s": tl.busy[pos] * scale,
                # > 0: the durations above are alone, slowed by the ranks busy (simulate_shared_timeline)
                "shared_cores_contention": self.ov.contention if self.shared_cores else 0.0,
                "peak_memory_bytes": pos_need[pos],
                # the position's activations held before its first backward and after it (beside gradients)
                "activation_peak_before_grads": tl.peak_before_grads[pos],
                "activation_peak_with_grads": tl.peak_with_grads[pos],
            })
        return out


def simulate(meta, cluster, layout: Layout, opts: Optional[CostOptions] = None) -> SimResult:
    """One-off evaluation with the full breakdown."""
    return Simulator(meta, cluster, opts).evaluate(layout, detail=True)
