"""What a stage's ranks hold: activations per micro-batch (by recompute mode and tp), the state of
mixed-precision AdamW, and FSDP2's unsharded parameters and gradients as the runtime uses them.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), per token of one block in 16-bit values, without sequence parallelism:
  - replicated over tp (every tp rank keeps them): the two norms' inputs, the attention and MLP
    inputs, dropout masks -- 10h;
  - sharded over tp: q, k, v, the attention output, the MLP's hidden activations -- the rest;
  - attention scores (5 a s): only an attention that materialises the s x s matrix stores them.
    torch's scaled_dot_product_attention (the runtime's attention) never does: its fused kernels
    keep q, k, v, the output and a log-sum-exp per row, so `fused_attention` (default) drops them.
ModelMeta's block_activation_bytes_per_token carries block 0's measured saved bytes plus 5as for
Hugging Face models (hrlplan.activations), or Korthikanti's figure where the measurement cannot run
(meta.extra['block_activations'] says which); other families (HRM) are taken as they are, all
sharded over tp.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

RECOMPUTE_MODES = ("none", "selective", "full")
# Mixed-precision AdamW keeps fp32 parameters, fp32 gradients and two fp32 moments per parameter.
STATE_BYTES_PER_PARAM = 16
# Gradients FSDP2 accumulates unsharded between micro-batches: in its reduce dtype (float32 here).
UNSHARDED_GRAD_BYTES = 4


def block_activation_terms(meta) -> Tuple[float, float, float]:
    """(replicated, sharded, scores) bytes per token of one block, 16-bit values, mean over blocks."""
    n = max(len(meta.block_activation_bytes_per_token), 1)
    total = sum(meta.block_activation_bytes_per_token) / n
    if meta.family != "hf":
        return 0.0, total, 0.0
    h = float(meta.hidden_size)
    scores = 5.0 * meta.num_heads * meta.seq_len
    replicated = min(10.0 * h, max(total - scores, 0.0))
    return replicated, max(total - scores - replicated, 0.0), scores


def held_per_token(meta, tp: int, recompute: str, fused_attention: bool = True) -> float:
    """Bytes per token (16-bit values) one block keeps for its backward between forward and backward.

    none: everything; selective: the attention core's own tensors are recomputed (the scores,
    Korthikanti's selective recomputation; with SDPA nothing of the core is stored anyway, so
    selective saves no memory over none there); full: only the block's input (torch.utils.checkpoint
    keeps the wrapped block's arguments), 2h replicated over tp."""
    if recompute == "full":
        return 2.0 * meta.hidden_size
    rep, shard, scores = block_activation_terms(meta)
    kept_scores = 0.0 if (fused_attention or recompute == "selective") else scores
    return rep + (shard + kept_scores) / tp


def live_per_token(meta, tp: int, fused_attention: bool = True) -> float:
    """Bytes per token of one block's full activations: what recomputation rebuilds for the one
    block whose backward runs (the transient a full-recompute stage adds at its peak)."""
    return held_per_token(meta, tp, "none", fused_attention)


def attention_core_flops_per_token(meta) -> float:
    """Forward FLOPs per token of one block's attention core (Q K^T and A V), as model_meta counts them."""
    return 4.0 * meta.seq_len * meta.hidden_size if meta.family == "hf" else 0.0


def state_split(params_per_rank, dp: int, dp_mode: str, bytes_per_value: int, microbatches: int) -> Dict[str, Any]:
    """static_state_bytes by kind: weights (fp32 master, plus FSDP2's unsharded compute copy),
    gradients (the most that exist at once) and optimizer (two fp32 moments). FSDP2 with more
    than one micro-batch accumulates unsharded fp32 gradients until the step's last backward and
    frees them as it reduce-scatters them into 4/dp-byte shards; with one micro-batch each block's
    gradient is reduce-scattered as it is made: only the shards accumulate."""
    p = params_per_rank
    if dp_mode == "fsdp" and dp > 1:
        grads = UNSHARDED_GRAD_BYTES if microbatches > 1 else 4.0 / dp
        return {"weights": p * (4.0 / dp + bytes_per_value), "gradients": p * grads, "optimizer": p * 8.0 / dp}
    return {"weights": p * 4.0, "gradients": p * 4.0, "optimizer": p * 8.0}


def peak_bytes(static, gradients, activations_before_grads, activations_with_grads, transient=0.0):
    """A rank's peak. `static` includes its `gradients` and its stages' summed recomputation
    `transient`s, of which one block runs at a time (`transient`: the largest). Without
    recomputation: the larger of the activations held before the first backward (the step's
    zero_grad(set_to_none) left no gradient: GPipe's and warm-up's peak) and the gradients beside
    what is held after it (1F1B's steady state, or the step's end). With it, the peak is in a
    backward, where a block is rebuilt beside the gradients and the inputs still held."""
    base = static - gradients
    if transient:
        return base + gradients + activations_before_grads   # static holds the transients already
    return base + max(activations_before_grads, gradients + activations_with_grads)


def static_state_bytes(params_per_rank, dp: int, dp_mode: str, bytes_per_value: int, microbatches: int):
    """Weights, gradients and AdamW state per rank (params_per_rank: what a rank computes with,
    before dp sharding; may be an array): the sum of state_split. FSDP2 as the runtime applies it
    under torch pipelining: weights and moments sharded over dp, the unsharded compute weights held
    all step (reshard_after_forward=False: pipelining runs many forwards), gradients as
    state_split says. Replicate / no dp: 16 bytes/param whole."""
    return sum(state_split(params_per_rank, dp, dp_mode, bytes_per_value, microbatches).values())


MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "transient", "workspace")


def _stage_lists(plan):
    """(stages, ranks of each stage, dp, micro-batches, micro-batch size) per pipeline the cost model sees:
    the plan's one template (all its replicas' ranks per stage), or each heterogeneous replica."""
    if not plan.heterogeneous:
        yield (plan.stages, [plan.device_groups[plan.stage_group(k)] for k in range(plan.num_stages)],
               plan.dp, plan.num_microbatches, plan.microbatch_size)
        return
    for pipe in plan.as_pipelines():
        yield pipe.stages, [s.ranks for s in pipe.stages], 1, pipe.num_microbatches, pipe.microbatch_size


def plan_memory(plan, meta, cluster, opts=None) -> List[Dict[str, float]]:
    """Per rank of a plan: the simulator's peak (`total`, what plan.meta.predicted.memory_bytes_per_rank
    holds), its split at that moment (MEMORY_KEYS: gradients 0 when the peak comes before the first
    backward; activations what the schedule holds then) and `tensors`, the
    total less the workspace reserve: what torch allocates, comparable with a measured peak
    (torch.cuda.max_memory_allocated, or live tensor storages on the CPU)."""
    from hrlplan.cost.model import CostOptions
    from hrlplan.cost.plans import predict_any_plan, rank_devices
    from hrlplan.cost.simulator import Simulator

    sim = Simulator(meta, cluster, opts or CostOptions())
    predicted = predict_any_plan(plan, meta, cluster, sim=sim)
    totals = predicted["memory_bytes_per_rank"]
    devices = rank_devices(plan)
    held = {d: (st.get("activation_peak_before_grads", 0.0), st.get("activation_peak_with_grads", 0.0))
            for st in predicted.get("stages") or [] for d in st["devices"]}
    out = [dict.fromkeys(MEMORY_KEYS, 0.0) for _ in range(plan.world_size)]
    for stages, ranks, dp, m, mbs in _stage_lists(plan):
        n = len(stages)
        for k, (stage, group) in enumerate(zip(stages, ranks)):
            c = sim.costs.stage(stage.layers[0], stage.layers[1], k == 0, k == n - 1, [devices[r] for r in group],
                                stage.tp, dp, mbs, len(set(map(tuple, ranks))), recompute=stage.recompute,
                                microbatches=m)
            for r in group:
                for key, value in c.memory.items():
                    if key == "workspace":   # the rank's reserve, once (as the simulator counts it)
                        out[r][key] = max(out[r][key], float(value))
                    else:
                        out[r][key] += float(value)
    for r, row in enumerate(out):
        row["total"] = float(totals[r])
        before, after = held.get(devices[r], (0.0, 0.0))
        if not row["transient"] and before >= row["gradients"] + after:
            row["gradients"] = 0.0   # the peak comes before the first backward: no gradient exists yet
        rest = sum(row[k] for k in MEMORY_KEYS if k != "activations")
        row["activations"] = max(row["total"] - rest, 0.0)
        row["tensors"] = row["total"] - row["workspace"]
    return out
