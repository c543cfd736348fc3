"""Per-stage costs: compute, tensor-parallel and point-to-point communication, data-parallel
gradient synchronisation, and the memory a stage's ranks hold.

Compute is FLOPs divided by (peak FLOP/s x efficiency). The efficiency is the device's sustained
fraction of peak -- nominal preset figures are discounted more than measured ones -- times a
saturation factor that penalises small micro-batches (kernels are latency-bound below a few
hundred tokens). `cluster.calibration` overrides the figures (see CALIBRATION_KEYS). The devices,
their links and the calibrated overheads are hrlplan.cost.device_model's (re-exported here).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from hrlplan.cost import context_parallel as cpc, float8_time, kernels, memory as mem
from hrlplan.cost.calibration_keys import CALIBRATION_KEYS  # noqa: F401 (documented keys, re-exported)
from hrlplan.cost.device_model import (  # noqa: F401 (re-exported: the planners and tests import them here)
    GiB, DeviceModel, Overheads, all_reduce_time, calibrated_peak_flops, fp8_speedup, guessed_device_facts,
    interpolate_by_tokens, matmul_peak, unknown_peak_ratio)
from hrlplan.cost.memory import STATE_BYTES_PER_PARAM  # noqa: F401 (re-exported for the planners)
from hrlplan.plan import stage_to_group
from hrlplan.families import is_language_model


@dataclass(frozen=True)
class Layout:
    """A plan in the simulator's terms: cluster device ids, not launch ranks.

    groups[g] lists the devices of pipeline position g, data-parallel major (d * tp + t).
    spans[k] is virtual stage k's [start, end) of blocks; stage k runs on group stage_group(k).
    """
    spans: Tuple[Tuple[int, int], ...]
    groups: Tuple[Tuple[int, ...], ...]
    tp: int
    dp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    stages_per_rank: int = 1
    # Per virtual stage, empty = uniform: each stage's own tp degree (its group holds tp_of(k) * dp
    # devices; `tp` is then the largest) and its activation recomputation (RECOMPUTE_MODES).
    stage_tp: Tuple[int, ...] = ()
    recompute: Tuple[str, ...] = ()
    # sequence parallelism on every tp stage (the plan's stages agree), and FSDP2's
    # reshard_after_forward as the plan resolves it (Plan.resolved_reshard_after_forward)
    sequence_parallel: bool = False
    reshard_after_forward: bool = False
    # context parallelism: each group holds tp * dp * cp devices (hrlplan.cost.context_parallel)
    cp: int = 1

    @property
    def pp(self) -> int:
        return len(self.groups)

    def stage_group(self, k: int) -> int:
        return stage_to_group(k, self.pp, self.stages_per_rank, self.schedule)

    def tp_of(self, k: int) -> int:
        return self.stage_tp[k] if self.stage_tp else self.tp

    def recompute_of(self, k: int) -> str:
        return self.recompute[k] if self.recompute else "none"


@dataclass
class CostOptions:
    bytes_per_value: int = 4           # 4 float32, 2 bfloat16 (activations, messages, TP/DP payloads)
    dp_mode: str = "fsdp"              # fsdp | replicate
    dp_overlap: bool = True
    memory_margin: float = 0.9
    # The memory model's assumptions (see hrlplan.cost.memory): attention through SDPA's fused kernels
    # (no s x s scores stored); an output head and embedding sharded over tp (vocabulary-parallel,
    # Megatron's; False: whole on every tp rank, as the runtime's tensor_parallel.py keeps them).
    fused_attention: bool = True
    vocab_parallel: bool = False
    # torch.distributed.pipelining keeps one receive buffer per micro-batch per stage, from step to step
    # (memory.receive_buffer_bytes); False: a runtime that frees each message once used (Megatron-LM)
    receive_buffers: bool = True
    # The runtime priced (planner.cost.runtime: torch | megatron), recorded with the figure; the options
    # above that it sets are resolved by hrlplan.cost.plans.options_for_train.
    runtime: str = "torch"
    # float32 matmuls on TF32 tensor cores (train.tf32) where the device has them; else at the fp32 peak
    tf32: bool = True
    # train.compile: the blocks' compute divided by compile_speedup (planner.cost.compile_speedup; None:
    # the calibration's measured `compile_speedup`, else 1.0)
    compile: bool = False
    compile_speedup: Optional[float] = None
    # train.float8: the blocks' linears at the device's fp8 peak (devices.PEAKS), their casts in memory
    float8: bool = False
    # planner.cost.tp_comm_overlap: a sequence-parallel stage's tp all-gathers and reduce-scatters run
    # under the block's GEMMs (Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers);
    # only what exceeds them is exposed
    tp_comm_overlap: bool = False


@dataclass
class StageCost:
    fwd: float            # one micro-batch's forward on the stage's slowest rank (incl. TP comm)
    bwd: float            # backward (input + weight gradients)
    compute_fwd: float    # forward compute alone
    tp_comm_fwd: float    # forward TP all-reduces alone
    send: float           # activation to the next stage (the gradient back costs the same)
    activation: float     # bytes one micro-batch leaves on each rank until its backward
    static_memory: float  # weights, grads, optimizer states, workspace per rank
    dp_sync: float        # gradient synchronisation after the step's last backward
    params: int           # parameters the stage holds (all its ranks together)
    first_fwd_extra: float = 0.0   # calibrated: FSDP all-gathers before the step's first forward
    last_bwd_extra: float = 0.0    # calibrated: FSDP/replicate reduces in the step's last backward
    optimizer: float = 0.0         # calibrated: clipping + optimizer step for the stage's parameters
    tp_comm_bwd: float = 0.0       # backward TP all-reduces alone
    # static_memory by kind (weights, gradients, optimizer, workspace, transient: memory.state_split)
    memory: Optional[Dict[str, float]] = None


class StageCostModel:
    """Costs of (virtual stage k, layer span, device group) for one model and cluster."""

    def __init__(self, meta, cluster, opts: CostOptions, devices: Optional[DeviceModel] = None):
        self.meta = meta
        self.opts = opts
        self.dev = devices or DeviceModel(cluster)
        rep = meta.block_repeats
        self._pf = [0.0]  # prefix sums over blocks: flops, activations, params, largest block
        self._pa = [0.0]
        self._pp = [0]
        for fl, act, par in zip(meta.block_flops_fwd_per_token, meta.block_activation_bytes_per_token, meta.block_params):
            self._pf.append(self._pf[-1] + fl * rep)
            self._pa.append(self._pa[-1] + act * rep)
            self._pp.append(self._pp[-1] + par)
        # numpy copies: `stage` accepts arrays of starts/ends and costs every span in one call
        self._pf_arr, self._pa_arr, self._pp_arr = (np.array(x, dtype=float) for x in (self._pf, self._pa, self._pp))
        # shape-aware kernels for uncalibrated GPUs of a model whose blocks are alike (kernels.py)
        uniform = len(set(meta.block_matmul_params)) <= 1 and is_language_model(meta)
        self.kernels = [None if self.dev.flat_compute or not uniform else
                        kernels.kernels_for(d, matmul_peak(d, opts.bytes_per_value, opts.tf32), self.dev.measured)
                        for d in cluster.devices]
        self._kernel_cache: Dict[tuple, Tuple[float, float, float]] = {}
        self.guessed = guessed_device_facts(cluster, any(k is not None for k in self.kernels), opts.bytes_per_value > 2,
                                            opts.fused_attention)
        # the flat model's FLOP/s are a device's 16-bit figure: float32 runs at its datasheet ratio
        # (a calibration measured in the run's dtype already)
        self.dtype_scale = [1.0 if self.dev.flat_compute or d.kind != "cuda" else
                            matmul_peak(d, opts.bytes_per_value, opts.tf32) / d.peak_flops for d in cluster.devices]

    def options_record(self) -> Dict[str, object]:
        """The options this model prices under (plan_info.json, with every prediction's breakdown),
        and the devices whose facts it had to guess."""
        return dict(asdict(self.opts), **{k: v for k, v in self.guessed.items() if v})

    # ------------------------------------------------------------ pieces shared with the planners
    def _prefix(self, which: str, index):
        arr = getattr(self, which + ("_arr" if isinstance(index, np.ndarray) else ""))
        return arr[index]

    def vocab_tp(self, tp: int) -> int:
        """The tp degree the embedding and head are sharded over: tp where vocabulary-parallel and
        the vocabulary divides (the runtime's rule: else whole on every rank), else 1."""
        return tp if self.opts.vocab_parallel and tp > 1 and self.meta.vocab_size % tp == 0 else 1

    def span_flops(self, start, end, first: bool, last: bool, tp: int = 1):
        """Forward FLOPs per token on each rank of a stage: the blocks sharded over tp; the head
        too where it is vocabulary-parallel (CostOptions.vocab_parallel), else whole on every rank."""
        head_tp = self.vocab_tp(tp)
        return (self._prefix("_pf", end) - self._prefix("_pf", start)) / tp + (self.meta.head_flops_fwd_per_token / head_tp if last else 0.0)

    def span_params(self, start, end, first: bool, last: bool, pp: int, tp: int = 1):
        """Parameters on each rank of a stage: blocks sharded over tp; the embedding and the head's
        matrix too when vocabulary-parallel; norms whole."""
        meta = self.meta
        vocab_tp = self.vocab_tp(tp)
        p = (self._prefix("_pp", end) - self._prefix("_pp", start)) / tp
        if first:
            p += meta.embedding_params / vocab_tp
        if last:
            own_head = meta.head_params - (0 if meta.tied_embeddings else meta.head_matmul_params)   # the final norm
            p += own_head + (0 if meta.tied_embeddings else meta.head_matmul_params / vocab_tp)
            if meta.tied_embeddings and not first:
                p += meta.head_matmul_params / vocab_tp  # the tied head needs its own copy on another stage
        return p

    def head_activation_per_token(self, tp: int) -> float:
        """Bytes per token (16-bit scale) the head keeps: the final norm's input (2h) and the fp32
        logits for the loss, sharded over tp when vocabulary-parallel (a loss over sharded logits)."""
        meta = self.meta
        act = meta.head_activation_bytes_per_token
        if self.vocab_tp(tp) == 1 or not is_language_model(meta):
            return act
        norm_in = 2.0 * meta.hidden_size
        return norm_in + max(act - norm_in, 0.0) / tp

    def group_links(self, group: Sequence[int], tp: int, dp: int):
        """(tp ring bw, lat), (dp ring bw, lat) for a group laid out dp-major."""
        tp_ring = [self.dev.ring_bw_lat(group[d * tp:(d + 1) * tp]) for d in range(dp)]
        dp_ring = [self.dev.ring_bw_lat(group[t::tp]) for t in range(tp)]
        tp_bw = min(b for b, _ in tp_ring)
        tp_lat = max(la for _, la in tp_ring)
        dp_bw = min(b for b, _ in dp_ring)
        dp_lat = max(la for _, la in dp_ring)
        return (tp_bw, tp_lat), (dp_bw, dp_lat)

    def p2p(self, group_a: Sequence[int], group_b: Sequence[int], nbytes: float, schedule: str = "") -> float:
        """Every rank of group a sends its copy to the same-index rank of group b, in parallel."""
        worst = 0.0
        lat = self.dev.overheads.hop(schedule)[0]
        for a, b in zip(group_a, group_b):
            if a == b:
                continue
            t = nbytes / self.dev.bw(a, b) + (self.dev.cluster.lat(a, b) if lat is None else lat)
            worst = max(worst, t)
        return worst

    def compute_parts(self, start, end, last: bool, group: Sequence[int], tp: int, tokens: float,
                      sequence_parallel: bool = False):
        """Forward-equivalent compute seconds (a third of forward + backward) of one micro-batch on
        the group's slowest rank: (the blocks, the head, one block's attention core), before contention."""
        meta = self.meta
        if all(self.kernels[d] is not None for d in group):
            sp = sequence_parallel and tp > 1
            per_block, head, core = max((self._kernel_parts(d, tokens, tp, last, sp) for d in group), key=lambda x: x[0])
            return (end - start) * meta.block_repeats * per_block, head, core
        block_flops = tokens * (self._prefix("_pf", end) - self._prefix("_pf", start)) / tp
        head_flops = tokens * (self.span_flops(0, 0, False, True, tp) if last else 0.0)
        core = tokens * mem.attention_core_flops_per_token(meta) / tp
        slowest = min(self.dev.throughput(d, tokens) * self.dtype_scale[d] for d in group)
        return block_flops / slowest, head_flops / slowest, core / slowest

    def _kernel_parts(self, dev: int, tokens: float, tp: int, last: bool, sp: bool = False) -> Tuple[float, float, float]:
        """(one block, the head if `last`, one attention core) in forward-equivalent seconds on `dev`."""
        k = self.kernels[dev]
        key = (k, tokens, tp, last, sp)
        hit = self._kernel_cache.get(key)
        if hit is None:
            meta, bpv = self.meta, self.opts.bytes_per_value
            mm = float(meta.block_matmul_params[0]) if meta.block_matmul_params else 0.0
            f, b, core = kernels.block_times(k, meta, mm, tokens, tp, bpv, mem.attention_core_flops_per_token(meta),
                                             self.opts.fused_attention, self.opts.runtime, sp,
                                             self.opts.tp_comm_overlap and sp)
            head = sum(kernels.head_times(k, meta, tokens, self.vocab_tp(tp), bpv, self.opts.runtime)) if last else 0.0
            # in the flat model's unit: a third of forward + backward (stage() splits it 1:2 again)
            hit = self._kernel_cache[key] = ((f + b) / 3.0, head / 3.0, core)
        return hit

    def stage(self, start, end, first: bool, last: bool, group: Sequence[int], tp: int, dp: int,
              microbatch_size: int, pp: int, links=None, contention: Optional[float] = None,
              shared_cores: bool = False, recompute: str = "none", microbatches: int = 2,
              sequence_parallel: bool = False, reshard_after_forward: bool = False,
              cp: Optional[int] = None) -> StageCost:
        """`contention` (default: the calibrated factor for every rank busy) multiplies compute; the
        per-op overhead, calibrated as every rank busy pays it, shrinks in the same proportion when
        it is below that factor. FSDP's hooks and collectives and tensor parallel's overhead do not:
        data-parallel replicas run one schedule in lockstep, and a stage's tp ranks each op, so when a
        rank's collective runs its peers' run too. `shared_cores` (with contention 1): every cost
        at its ranks-alone level, these too, for simulate_shared_timeline to slow by the ranks busy.
        `recompute` (none | selective | full) is the stage's activation recomputation: full reruns
        its blocks' forward (their tp all-reduces included) in backward and keeps each block's input
        only; selective (op-level) reruns every other matmul (memory.op_sac_recomputed_fraction)
        and the tp collectives it did not keep. `microbatches` per step decides whether FSDP keeps
        unsharded gradients between them (see memory.static_state_bytes). `sequence_parallel`
        (tp > 1): the same communication volume (all-gather + reduce-scatter for each all-reduce),
        less activation memory. `reshard_after_forward` (FSDP, dp > 1): fewer unsharded weights, one
        all-gather of the blocks more per micro-batch's backward (and forward after the first).
        `cp` (default: what the group's size implies, tp * dp * cp devices): each rank computes and
        keeps tokens / cp, pays the ring attention's exposed K/V passes (cost.context_parallel), and
        FSDP shards over dp * cp. train.compile and train.float8 scale the blocks' compute
        (_option_scaled)."""
        meta, o = self.meta, self.opts
        cp = cp or cpc.cp_of_group(len(group), tp, dp)
        shards = dp * cp   # FSDP's and the gradient reduce's ranks (torchtitan's dp_shard_cp)
        if recompute not in mem.RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r}: choose one of {', '.join(mem.RECOMPUTE_MODES)}")
        derate = self.dev.overheads.busy_derate(contention)
        lockstep = derate if shared_cores else 1.0   # FSDP's and tp's figures, measured every rank busy
        tokens = microbatch_size * meta.seq_len / cp
        factor = self.dev.overheads.contention if contention is None else contention
        if pp > 1:
            factor *= self.dev.overheads.pipeline_compute
        blocks_c, head_c, core_c = (x * factor for x in self.compute_parts(start, end, last, group, tp, tokens,
                                                                            sequence_parallel))
        blocks_c = blocks_c * self._option_scale(group)
        compute_fwd = blocks_c + head_c
        (tp_bw, tp_lat), (dp_bw, dp_lat) = links or self.group_links(group, tp, shards)
        act_msg = tokens * meta.hidden_size * o.bytes_per_value
        n_blocks = (end - start) * meta.block_repeats
        ov = self.dev.overheads
        tp_comm, tp_comm_bwd = self._tp_comm(n_blocks, tp, act_msg, tokens, tp_bw, tp_lat, lockstep)
        # compute_fwd is a third of forward + backward (the fit's unit); split as measured (default 1:2)
        ratio = ov.backward_forward_ratio(tokens)
        fwd_share = 3.0 / (1.0 + ratio)
        sp = sequence_parallel and tp > 1
        if o.tp_comm_overlap and sp:   # hidden under the blocks' GEMMs (their compute less the attention cores)
            gemms = fwd_share * (blocks_c - n_blocks * core_c)
            tp_comm, tp_comm_bwd = _beyond(tp_comm, gemms), _beyond(tp_comm_bwd, ratio * gemms)
        ring_f, ring_b = self._ring(group, tp, cp, tokens, n_blocks, fwd_share * core_c, fwd_share * ratio * core_c)
        fwd = fwd_share * compute_fwd + tp_comm + ring_f + ov.op_fwd * derate
        bwd = fwd_share * ratio * compute_fwd + tp_comm_bwd + ring_b + ov.op_bwd * derate
        if recompute == "full":
            bwd = bwd + fwd_share * blocks_c + tp_comm + ring_f
        elif recompute == "selective" and o.runtime == "megatron":
            # Megatron's selective (Korthikanti et al. 2022): the attention core alone runs again, no collective
            bwd = bwd + n_blocks * fwd_share * core_c
        elif recompute == "selective":
            # kept reduce-scatters under SP: only the all-gathers (half the volume) run again
            bwd = bwd + fwd_share * blocks_c * mem.op_sac_recomputed_fraction(meta) + (tp_comm / 2 if sp else tp_comm)
        if o.float8:   # the dynamic-scaling casts beside the fp8 matmuls (cost/float8_time.py)
            cast_f, cast_b = float8_time.stage_cast_seconds(meta, [self.dev.cluster.devices[d] for d in group], tokens,
                                                            tp, o.bytes_per_value, o.compile, recompute)
            fwd, bwd = fwd + n_blocks * cast_f, bwd + n_blocks * cast_b
        activation, transient = self._activation(start, end, last, tp, tokens, recompute, n_blocks, sp)
        transient = transient + self._option_transient(tp, cp, shards, tokens, n_blocks, recompute)
        params = self.span_params(start, end, first, last, pp)
        per_rank = self.span_params(start, end, first, last, pp, tp)
        reshard = reshard_after_forward and shards > 1 and o.dp_mode == "fsdp"
        memory = self._static_memory(start, first, last, group, tp, shards, pp, per_rank, n_blocks, microbatches,
                                     reshard, act_msg / tp if sp else act_msg, transient)
        static = sum(memory.values())
        # FSDP: all-gather of weights before the step + reduce-scatter of grads: one all-reduce's volume
        sync_bytes = per_rank * o.bytes_per_value
        dp_sync = all_reduce_time(sync_bytes, shards, dp_bw, dp_lat) if shards > 1 else 0.0
        if o.dp_overlap and o.dp_mode == "fsdp" and not reshard:
            # the weights' all-gather (half that volume) runs under the step's first forward (FSDP2's
            # prefetch; Megatron's --overlap-param-gather), the reduce-scatter under the last backward
            dp_sync = dp_sync / 2 + _beyond(dp_sync / 2, fwd)
        if ov.dp_reduce or ov.dp_allgather or ov.dp_reduce_fixed or ov.dp_allgather_fixed:
            dp_sync = 0.0   # calibrated: the measured per-unit collectives below include their payload
        own_units = (1 if first else 0) + (1 if last else 0)   # embedding / final norm + head
        opt_units = n_blocks + own_units * ov.opt_ends_blocks / 2.0
        # DTensor parameters (FSDP's shards, tp's sharded linears) step as the sharded figure measured
        optimizer = opt_units * ov.optimizer_per_block(shards, tp)
        if all(self.kernels[d] is not None for d in group):   # uncalibrated GPUs: the step's bytes at HBM speed
            stepped = per_rank / shards if o.dp_mode == "fsdp" else per_rank
            dtensor = tp > 1 or (o.dp_mode == "fsdp" and shards > 1)
            optimizer = kernels.optimizer_step_s(min((self.kernels[d] for d in group), key=lambda k: k.hbm), stepped,
                                                 kernels.optimizer_bytes_per_param(o.runtime, dtensor))
        fwd_dp, bwd_dp, first_extra, last_extra = self._data_parallel_time(
            shards, n_blocks, own_units, reshard, per_rank, (dp_bw, dp_lat), microbatches, lockstep)
        fwd, bwd = fwd + fwd_dp, bwd + bwd_dp
        return StageCost(fwd=fwd, bwd=bwd, compute_fwd=compute_fwd, tp_comm_fwd=tp_comm, send=0.0,
                         activation=activation, static_memory=static, dp_sync=dp_sync, params=params,
                         first_fwd_extra=first_extra, last_bwd_extra=last_extra, optimizer=optimizer,
                         tp_comm_bwd=tp_comm_bwd, memory=memory)

    def _data_parallel_time(self, shards: int, n_blocks, own_units: int, reshard: bool, per_rank, dp_link,
                            microbatches: int, lockstep: float):
        """(forward, backward, before the first forward, in the last backward) seconds of FSDP's or
        replicate's per-block hooks and collectives over `shards` ranks (dp x cp)."""
        o, ov = self.opts, self.dev.overheads
        if shards <= 1:
            return 0.0, 0.0, 0.0, 0.0
        # FSDP2: one collective per block and one for the stage root when it holds parameters of its
        # own; replicate: one for the whole stage. Fixed costs measured by calibration, plus bandwidth.
        units = n_blocks + (1 if own_units else 0) if o.dp_mode == "fsdp" else 1
        fwd, bwd = n_blocks * ov.dp_hook_fwd * lockstep, n_blocks * ov.dp_hook_bwd * lockstep
        first = (units * ov.dp_allgather + ov.dp_allgather_fixed) * lockstep if o.dp_mode == "fsdp" else 0.0
        last = (units * ov.dp_reduce + ov.dp_reduce_fixed) * lockstep
        if reshard:
            regather = self._regather_time(per_rank, n_blocks, shards, *dp_link) * lockstep
            bwd = bwd + regather
            fwd = fwd + regather * (microbatches - 1) / microbatches
        return fwd, bwd, first, last

    def _option_scale(self, group: Sequence[int]):
        """What train.compile and train.float8 make of the blocks' compute on the group's devices:
        compile divides it by its speed-up (configured, else calibrated, else 1); float8 runs the
        share of it in the linears torchao swaps (memory.float8_flops_share) at the fp8 peak."""
        o, meta = self.opts, self.meta
        scale = 1.0
        if o.compile:
            speedup = o.compile_speedup if o.compile_speedup is not None else self.dev.overheads.compile_speedup
            scale /= max(float(speedup), 1e-6)
        linear = mem.float8_flops_share(meta) if o.float8 else 0.0
        if linear > 0:
            gain = min(fp8_speedup(self.dev.cluster.devices[d], o.bytes_per_value, o.tf32) for d in group)
            scale *= 1.0 - linear + linear / gain
        return scale

    def _ring(self, group, tp: int, cp: int, tokens, n_blocks, core_fwd, core_bwd):
        """(forward, backward) exposed ring-attention passes of a stage's blocks (cost.context_parallel):
        each block's K/V ring beyond the attention core it overlaps with."""
        if cp <= 1:
            return 0.0, 0.0
        bw, lat = self.dev.ring_bw_lat(cpc.cp_ring_group(group, tp, cp))
        ring_f, ring_b = cpc.ring_exchange_s(self.meta, tokens, tp, cp, self.opts.bytes_per_value, bw, lat)
        return n_blocks * cpc.exposed(ring_f, core_fwd), n_blocks * cpc.exposed(ring_b, core_bwd)

    def _option_transient(self, tp: int, cp: int, shards: int, tokens, n_blocks, recompute: str):
        """What the options add to a block's backward working set: the ring's in-flight K/V shards
        (cp), the fp8 casts of the widest linear's weight and operands (float8), and FSDP's
        reduce-scatter buffers beside a full-recomputation block (memory.reduce_scatter_buffer_bytes)."""
        meta = self.meta
        extra = cpc.ring_buffer_bytes(meta, tokens, tp, cp, self.opts.bytes_per_value)
        if self.opts.float8:
            extra += mem.float8_cast_bytes(meta, tp, tokens)
        if recompute == "full" and self.opts.dp_mode == "fsdp":
            extra += mem.reduce_scatter_buffer_bytes(max(meta.block_params or [0]) / tp, shards)
        return np.where(n_blocks > 0, extra, 0.0) if isinstance(n_blocks, np.ndarray) else (extra if n_blocks else 0.0)

    def _tp_comm(self, n_blocks, tp: int, act_msg, tokens, tp_bw: float, tp_lat: float, lockstep: float):
        """(forward, backward) tensor-parallel communication of a stage's blocks. Megatron TP: two
        all-reduces of the activations per block in forward, two in backward; calibrated: what a tp=2
        block measured beyond half its compute, more ring steps beyond 2."""
        if tp <= 1:
            return 0.0, 0.0
        ov = self.dev.overheads
        if not ov.tp_block:
            both = 2 * n_blocks * all_reduce_time(act_msg, tp, tp_bw, tp_lat)
            return both, both
        # under the mean field not shrunk with the busy share (see stage): measured -8..-19% on
        # pp2 x tp2 as it is, +13..+26% shrunk; on shared cores, alone and slowed as it runs
        return (n_blocks * (tp - 1) * interpolate_by_tokens(ov.tp_block, tokens, 1) * lockstep,
                n_blocks * (tp - 1) * interpolate_by_tokens(ov.tp_block, tokens, 2) * lockstep)

    def _static_memory(self, start, first: bool, last: bool, group, tp: int, dp: int, pp: int, per_rank,
                       n_blocks, microbatches: int, reshard: bool, message, transient) -> Dict[str, float]:
        """A stage's memory per rank beside its activations, by kind: weights, gradients and optimizer
        state (memory.state_split; under FSDP resharding only the root's and the last block's weights
        stay gathered), the workspace, the backward's transient, the receive buffers of `message`
        (under SP the sequence-sharded activation, tp rank to tp rank)."""
        o = self.opts
        gathered = None
        if reshard:
            root = self.span_params(start, start, first, last, pp, tp)
            gathered = mem.gathered_under_reshard(root, max(self.meta.block_params or [0]) / tp, n_blocks)
        state = mem.state_split(per_rank, dp, o.dp_mode, o.bytes_per_value, microbatches, gathered)
        workspace = max(self.dev.workspace[d] for d in group)
        buffers = mem.receive_buffer_bytes(message, microbatches, first, last) if o.receive_buffers else 0.0
        return dict(state, workspace=workspace, transient=transient, buffers=buffers)

    def _regather_time(self, per_rank, n_blocks, dp: int, dp_bw: float, dp_lat: float):
        """One more all-gather of a resharded stage's blocks (all but its last, which stays gathered):
        the calibrated per-block all-gather, else half an all-reduce of their bytes (the existing
        collective model: an all-reduce is a reduce-scatter and an all-gather)."""
        ov = self.dev.overheads
        units = np.maximum(n_blocks - 1, 0) if isinstance(n_blocks, np.ndarray) else max(n_blocks - 1, 0)
        if ov.dp_allgather or ov.dp_allgather_fixed:
            return units * ov.dp_allgather
        share = units / np.maximum(n_blocks, 1) if isinstance(n_blocks, np.ndarray) else units / max(n_blocks, 1)
        return all_reduce_time(per_rank * share * self.opts.bytes_per_value, dp, dp_bw, dp_lat) / 2.0

    def _activation(self, start, end, last: bool, tp: int, tokens: float, recompute: str, n_blocks, sp: bool = False):
        """(bytes one micro-batch keeps on each rank until its backward, the transient of a block being
        recomputed): see hrlplan.cost.memory. Blocks keep their share of meta's per-block figures."""
        meta, o = self.meta, self.opts
        scale = o.bytes_per_value / 2.0   # meta activation figures are for 16-bit values
        mean = sum(meta.block_activation_bytes_per_token) / max(len(meta.block_activation_bytes_per_token), 1)
        span = self._prefix("_pa", end) - self._prefix("_pa", start)
        recompute, fused = self._memory_recompute(recompute)
        held = self._held_per_token(tp, recompute, fused, sp) / mean if mean > 0 else 0.0
        head = self.head_activation_per_token(tp) if last else 0.0
        activation = tokens * (span * held + head) * scale
        # the largest working set one of its backwards adds (a block's gradients, a rebuilt block, the loss's)
        def transient_of(blocks, with_loss: bool):
            return mem.stage_transient(meta, tp, self.vocab_tp(tp), tokens, scale, recompute, blocks, with_loss,
                                       fused, sp, compiled=o.compile and o.runtime != "megatron")
        if recompute != "full":
            return activation, transient_of(n_blocks, last)
        # a rebuilt block peaks once the micro-batch has freed all but its first block's input; the
        # loss's backward comes before that, beside everything held
        one_input = tokens * self._held_per_token(tp, "full", fused, sp) * scale
        rebuilt = mem.rebuilt_beyond_held(transient_of(n_blocks, False), activation, one_input)
        loss = transient_of(0, last)
        return activation, (np.maximum(rebuilt, loss) if isinstance(rebuilt, np.ndarray) else max(rebuilt, loss))

    def _held_per_token(self, tp: int, recompute: str, fused: bool, sp: bool) -> float:
        """Bytes per token (16-bit) one block keeps for its backward. runtime=megatron: Korthikanti et
        al. 2022's count of Megatron's fused block (Table 2: 10h replicated + 24h/tp, all of 34h/tp
        under sequence parallelism, + 5as/tp of scores unless fused; full recomputation 2h, /tp under
        SP); torch: memory.held_per_token (what this package's blocks were measured to keep, compiled
        or eager as train.compile says)."""
        meta = self.meta
        if self.opts.runtime != "megatron" or not is_language_model(meta):
            return mem.held_per_token(meta, tp, recompute, fused, sp, compiled=self.opts.compile)
        h = float(meta.hidden_size)
        if recompute == "full":
            return 2.0 * h / (tp if sp else 1)
        scores = 0.0 if fused else 5.0 * meta.num_heads * meta.seq_len / tp
        return (34.0 * h / tp if sp else 10.0 * h + 24.0 * h / tp) + scores

    def _memory_recompute(self, recompute: str) -> Tuple[str, bool]:
        """(recompute mode, fused attention) as the memory model counts a block: Megatron's selective
        keeps everything but the attention core's s x s tensors (Korthikanti et al. 2022: the 5as/h
        term goes, 34sbh/t stays) -- what an unrecomputed block with a fused attention keeps."""
        if recompute == "selective" and self.opts.runtime == "megatron":
            return "none", True
        return recompute, self.opts.fused_attention

    def activation_message(self, microbatch_size: int, sequence_shards: int = 1) -> float:
        """Bytes one tp rank sends the next stage per micro-batch (sequence_shards: tp under SP)."""
        return microbatch_size * self.meta.seq_len * self.meta.hidden_size * self.opts.bytes_per_value / sequence_shards


def _beyond(comm, window):
    """The part of a collective's time that a window of compute it overlaps does not hide."""
    exposed = np.maximum(comm - window, 0.0)
    return exposed if isinstance(exposed, np.ndarray) else float(exposed)
