"""The simulator: step time with a breakdown and peak memory per device for a Layout, or the
reason it cannot run (naming the device)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hrlplan.cost import memory as mem
from hrlplan.cost.model import GiB, CostOptions, DeviceModel, Layout, StageCostModel
from hrlplan.cost.timeline import simulate_shared_timeline, simulate_timeline

ZB_INPUT_GRAD_SHARE = 0.5   # zero-bubble splits backward into input-gradient (B) and weight-gradient (W)


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
            if self.meta.tied_embeddings and layout.stage_group(0) != layout.stage_group(len(layout.spans) - 1):
                shards = layout.dp if self.opts.dp_mode == "fsdp" else 1
                tied = self.meta.head_matmul_params * 4.0 / shards / layout.tp
                t += ov.allreduce(2, tied, small if ov.tied_allreduce is None else ov.tied_allreduce)
        return t

    def evaluate(self, layout: Layout, detail: bool = False, contention: Optional[float] = None) -> SimResult:
        """`contention` sets one compute slowdown for the whole step (hetero plans pass the world's
        mean field). Default, where ranks outnumber cores: each operation slowed by the ranks busy
        while it runs (simulate_shared_timeline)."""
        self.evaluations += 1
        meta, o = self.meta, self.opts
        n = len(layout.spans)
        last = n - 1
        groups = [layout.groups[layout.stage_group(k)] for k in range(n)]
        msg = self.costs.activation_message(layout.microbatch_size)
        sends = [self.costs.p2p(groups[k], groups[k + 1], msg, layout.schedule) if k < last else 0.0 for k in range(n)]
        zb = layout.schedule == "zero_bubble"
        ov = self.devices.overheads
        hop_handshake = ov.hop(layout.schedule)[1]
        handshake = [hop_handshake] * n if hop_handshake else None

        def stage_costs_at(contention: Optional[float], shared_cores: bool = False):
            # each stage at its own tp degree and recompute mode (Layout.tp_of / recompute_of)
            return [self.costs.stage(start, end, k == 0, k == last, groups[k], layout.tp_of(k), layout.dp,
                                     layout.microbatch_size, layout.pp,
                                     links=self.links(groups[k], layout.tp_of(k), layout.dp),
                                     contention=contention, shared_cores=shared_cores,
                                     recompute=layout.recompute_of(k), microbatches=layout.num_microbatches)
                    for k, (start, end) in enumerate(layout.spans)]

        def durations(costs):
            fwd = [c.fwd for c in costs]
            factors = ov.zb_backward_factors(layout.microbatch_size * meta.seq_len) if zb else None
            if factors is not None:
                # as torch runs the split: B (d/dx, 0 on the first stage, whose input is token ids) and
                # W cost these multiples of a plain backward; the first stage's W is one plain backward
                fin, fw = factors
                return (fwd, [0.0 if k == 0 else c.bwd * fin for k, c in enumerate(costs)],
                        [c.bwd if k == 0 else c.bwd * fw for k, c in enumerate(costs)])
            if zb:
                shares = zb_input_shares(n, ov.zb_input_grad_share)
                return (fwd, [c.bwd * sh for c, sh in zip(costs, shares)],
                        [c.bwd * (1.0 - sh) for c, sh in zip(costs, shares)])
            return fwd, [c.bwd for c in costs], [0.0] * n

        def timeline(costs, durs):
            fwd, bwd, wgt = durs
            return simulate_timeline(layout.schedule, layout.pp, layout.stages_per_rank, layout.num_microbatches,
                                     fwd, bwd, wgt, sends, sends, [c.activation for c in costs],
                                     [c.first_fwd_extra for c in costs], [0.0] * n, handshake)

        shared_cores = contention is None and ov.contention > 1.0
        if shared_cores:
            # More ranks than cores (CPU): contention_factor is the slowdown with every rank busy, but
            # a pipeline's ranks idle in its bubbles. Operations are costed alone and slowed by the ranks
            # busy while they run (simulate_shared_timeline); the pipeline hop, a wake-up more than
            # work, by the mean field: the factor times the busy share, from the timeline at full speed.
            at_full_speed = stage_costs_at(1.0)
            alone = timeline(at_full_speed, durations(at_full_speed))
            busy_share = sum(alone.busy) / (alone.makespan * layout.pp) if alone.makespan > 0 else 1.0
            contention = max(1.0, ov.contention * min(busy_share, 1.0))
            stage_costs = stage_costs_at(1.0, shared_cores=True)
        else:
            stage_costs = stage_costs_at(contention)
        derate = ov.busy_derate(contention)
        if derate < 1.0:   # the pipeline hop, calibrated with every rank busy, shrinks with the busy share too
            sends = [x * derate for x in sends]
            handshake = [x * derate for x in handshake] if handshake else None
        fwd, bwd, wgt = durations(stage_costs)
        if shared_cores:
            tl = simulate_shared_timeline(layout.schedule, layout.pp, layout.stages_per_rank, layout.num_microbatches,
                                          fwd, bwd, wgt, sends, sends, [c.activation for c in stage_costs],
                                          [c.first_fwd_extra for c in stage_costs], handshake,
                                          ranks=[len(g) for g in layout.groups], contention=ov.contention,
                                          all_ranks=max(self.cluster.world_size, sum(len(g) for g in layout.groups)))
        else:
            tl = timeline(stage_costs, (fwd, bwd, wgt))

        # Gradient sync per position: after its last backward, partly hidden behind it when overlapped.
        # Calibrated FSDP/replicate reduces (last_bwd_extra) run as the pipeline schedule's REDUCE_GRAD:
        # after a stage's last backward has sent its gradient on, so they delay the position's own end,
        # not the earlier stages' remaining backward (which they overlap).
        pos_reduce = [0.0] * layout.pp
        for k, c in enumerate(stage_costs):
            pos_reduce[layout.stage_group(k)] += c.last_bwd_extra
        pos_sync = [0.0] * layout.pp
        pos_static = [0.0] * layout.pp
        pos_grads = [0.0] * layout.pp
        pos_reserve = [0.0] * layout.pp
        pos_transient = [0.0] * layout.pp   # one block rebuilt at a time per rank, whichever stage it is in
        pos_opt = [0.0] * layout.pp
        for k, c in enumerate(stage_costs):
            pos = layout.stage_group(k)
            pos_sync[pos] += c.dp_sync
            # the workspace reserve is the rank's, once, however many stages it runs
            reserve = c.memory["workspace"] if c.memory else 0.0
            pos_static[pos] += c.static_memory - reserve + max(reserve - pos_reserve[pos], 0.0)
            pos_reserve[pos] = max(pos_reserve[pos], reserve)
            pos_grads[pos] += c.memory["gradients"] if c.memory else 0.0
            pos_transient[pos] = max(pos_transient[pos], c.memory["transient"] if c.memory else 0.0)
            pos_opt[pos] += c.optimizer
        # the optimizer's per-call cost, once per rank: one optimizer steps all of a rank's stages
        fixed = ov.optimizer_fixed(layout.dp, layout.tp)
        pos_opt = [t + fixed for t in pos_opt]
        finish = []
        exposed = []
        for pos in range(layout.pp):
            hidden = min(pos_sync[pos], tl.last_backward[pos]) if o.dp_overlap else 0.0
            exposed.append(pos_sync[pos] - hidden)
            finish.append(tl.end[pos] + exposed[-1] + pos_reduce[pos])
        # Calibrated per-step costs after the pipeline: the small all-reduces every step makes (tied
        # embedding gradient, gradient norm over the pipeline, the loss), the optimizer, the rest.
        collectives = self.step_collectives(layout)
        scale = self.devices.time_scale
        step = (max(f + collectives + opt for f, opt in zip(finish, pos_opt)) + ov.step) * scale

        # Memory: static + activations the schedule holds + the largest transient (one block's forward);
        # gradients only from a position's first backward on (cost.memory.peak_bytes)
        pos_need = [mem.peak_bytes(pos_static[p], pos_grads[p], tl.peak_before_grads[p], tl.peak_with_grads[p],
                                   pos_transient[p]) for p in range(layout.pp)]
        memory: Dict[int, float] = {}
        worst: Optional[tuple] = None
        for pos, group in enumerate(layout.groups):
            need = pos_need[pos]
            for d in group:
                memory[d] = need
                limit = self.devices.memory_limit(d, o.memory_margin)
                if need > limit and (worst is None or need / limit > worst[0]):
                    worst = (need / limit, pos, d, need, limit)
        if worst is not None:
            _, pos, d, need, limit = worst
            dev = self.cluster.devices[d]
            stage_ids = [k for k in range(n) if layout.stage_group(k) == pos]
            reason = (f"out of memory on device {d} ({dev.name}, {dev.hostname} local {dev.local_rank}): "
                      f"stage(s) {stage_ids} need {need / GiB:.2f} GiB > {o.memory_margin:g} x "
                      f"{dev.memory_bytes / GiB:.2f} GiB")
            return SimResult(False, float("inf"), reason=reason, memory_bytes=memory)

        pipeline = tl.makespan
        bubble = 1.0 - sum(tl.busy) / (pipeline * layout.pp) if pipeline > 0 else 0.0
        res = SimResult(True, step, bubble_fraction=max(bubble, 0.0), memory_bytes=memory)
        if detail:
            m = layout.num_microbatches
            crit = max(range(layout.pp), key=lambda p: tl.busy[p])
            crit_stages = [k for k in range(n) if layout.stage_group(k) == crit]
            res.breakdown = {
                "step_time_s": step,
                "pipeline_s": pipeline * scale,
                "pipeline_end_s": max(finish) * scale,
                "compute_s": sum(3 * m * stage_costs[k].compute_fwd for k in crit_stages) * scale,
                "tp_comm_s": sum(m * (stage_costs[k].tp_comm_fwd + stage_costs[k].tp_comm_bwd) for k in crit_stages) * scale,
                "p2p_comm_s": 2 * sum(sends) * scale,
                "dp_comm_s": max(pos_sync) * scale,
                "dp_comm_exposed_s": max(exposed) * scale,
                "dp_collectives_s": max(sum(stage_costs[k].first_fwd_extra + stage_costs[k].last_bwd_extra
                                            for k in range(n) if layout.stage_group(k) == p)
                                        for p in range(layout.pp)) * scale,
                "optimizer_s": max(pos_opt) * scale,
                "step_collectives_s": collectives * scale,
                "step_overhead_s": ov.step * scale,
                "bubble_s": (pipeline - tl.busy[crit]) * scale,
                "bubble_fraction": res.bubble_fraction,
                "bottleneck_position": crit,
                "memory_bytes_per_device": {str(d): v for d, v in sorted(memory.items())},
            }
            for k, c in enumerate(stage_costs):
                res.stages.append({
                    "stage": k, "layers": list(layout.spans[k]), "position": layout.stage_group(k),
                    "devices": list(groups[k]), "device_type": self.cluster.devices[groups[k][0]].name,
                    "tp": layout.tp_of(k), "recompute": layout.recompute_of(k),
                    "fwd_s": c.fwd * scale, "bwd_s": c.bwd * scale, "send_s": sends[k] * scale,
                    # the backward as the timeline runs it: zero-bubble's input (B) and weight (W) parts
                    "bwd_input_s": bwd[k] * scale, "bwd_weight_s": wgt[k] * scale,
                    "recv_handshake_s": (handshake[k] if handshake else 0.0) * scale,
                    "first_fwd_extra_s": c.first_fwd_extra * scale,   # FSDP's all-gathers before the first forward
                    "dp_sync_s": c.dp_sync * scale, "params": c.params,
                    "activation_bytes_per_microbatch": c.activation, "static_bytes": c.static_memory,
                    "static_split_bytes": {key: float(v) for key, v in (c.memory or {}).items()},
                    "busy_s": tl.busy[layout.stage_group(k)] * scale,
                    # > 0: the durations above are alone, slowed by the ranks busy (simulate_shared_timeline)
                    "shared_cores_contention": ov.contention if shared_cores else 0.0,
                    "peak_memory_bytes": pos_need[layout.stage_group(k)],
                    # the position's activations held before its first backward and after it (beside gradients)
                    "activation_peak_before_grads": tl.peak_before_grads[layout.stage_group(k)],
                    "activation_peak_with_grads": tl.peak_with_grads[layout.stage_group(k)],
                })
        return res


def simulate(meta, cluster, layout: Layout, opts: Optional[CostOptions] = None) -> SimResult:
    """One-off evaluation with the full breakdown."""
    return Simulator(meta, cluster, opts).evaluate(layout, detail=True)
