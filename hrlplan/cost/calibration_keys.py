"""The keys of ClusterSpec.calibration the cost model reads (written by `hrlplan calibrate` or by hand)."""

# Keys read from ClusterSpec.calibration (written by `hrlplan calibrate` or by hand):
CALIBRATION_KEYS = {
    "compute_efficiency": "float, or {device name: float}: sustained fraction of the peak below, or of "
                          "the median probed peak_flops of the devices of that name (calibrated_peak_flops)",
    "peak_flops": "{device name: FLOP/s}: the peak compute_efficiency was fitted against (written by "
                  "calibration): a calibration reused with a fresh probe keeps the speeds it measured",
    "half_saturation_tokens": "float, or {device name: float}: tokens per micro-batch at which a "
                              "device reaches half its sustained throughput",
    "compile_speedup": "float: one block's forward + backward eager / regionally compiled (train.compile), "
                       "measured by runtime/compile.measure_compile_speedup; the blocks' compute is divided by it "
                       "when a run compiles and planner.cost.compile_speedup is null",
    "bandwidth_efficiency": "float: achieved fraction of the link bandwidths",
    "step_time_scale": "float: measured/predicted step time of a reference run (multiplies every time)",
    "workspace_bytes": "float, or {device name: float}: framework overhead per rank",
    # Fixed costs (seconds), fitted by `hrlplan calibrate` from its micro-benchmarks; absent = 0, so an
    # uncalibrated cluster is costed exactly as before.
    "op_overhead_s": "{fwd: s, bwd: s}: runtime overhead per forward / backward of one micro-batch on one "
                     "stage (the pipeline library's per-call work), beside the blocks' own time",
    "p2p_latency_s": "float: one-way time of a tiny point-to-point message (replaces the probed link "
                     "latency for pipeline sends)",
    "p2p_latency_by_schedule_s": "{schedule: s}: p2p_latency_s as fitted from that schedule's own real "
                                 "pipeline (GPipe's back-to-back forwards keep a sender busy, which delays its "
                                 "messages); schedules not named use p2p_latency_s, the handshake scales along",
    "p2p_handshake_s": "float: rendezvous of a point-to-point receive (gloo): a stage that gets to a receive "
                       "whose message was sent earlier still waits this long (its notice reaches the sender, "
                       "which then sends); fitted with p2p_latency_s from a real two-stage pipeline",
    "dp_collective_s": "{allgather: s, reduce: s}: exposed time of one FSDP/replicate collective per "
                       "parameter unit (a block, or a stage's own embedding/head); all-gathers delay the "
                       "unit's first forward, reduces its last backward",
    "dp_collective_fixed_s": "{allgather: s, reduce: s} (default 0): exposed time per stage and step of its "
                             "FSDP collectives beyond dp_collective_s per unit -- the last unit's tail, which no "
                             "later compute hides; fitted with dp_collective_s over stage depths",
    "dp_hook_s": "{fwd: s, bwd: s}: FSDP/replicate per-block per-micro-batch hook overhead",
    "tp_block_overhead_s": "[{tokens, fwd, bwd}]: each block of a stage sharded over tp=2 takes this much beyond half "
                           "the whole block's time (the slope over stage depths) per forward / backward of a "
                           "micro-batch of `tokens` tokens (its all-reduces and DTensor's dispatch); replaces the "
                           "analytic all-reduce time, x (tp-1) beyond tp=2",
    "allreduce_latency_s": "float: one small all-reduce (loss, gradient norm, heterogeneous cross-replica "
                           "gradient reduces) as a step pays it after the pipeline",
    "allreduce_by_ranks": "[{ranks, latency_s, s_per_byte}]: an all-reduce over a group of `ranks` ranks as a "
                          "step pays it (every group of the world at once, ranks arriving as their work ends): "
                          "latency + bytes x s_per_byte; when present it costs the step's all-reduces (loss, "
                          "gradient norms, tied embedding, heterogeneous cross-replica reduces) instead of "
                          "allreduce_latency_s / tied_allreduce_s",
    "tied_allreduce_s": "float (default: the head's gradient bytes over the slowest first/last-stage pair's link plus "
                        "allreduce_latency_s): the all-reduce of a tied embedding's gradient "
                        "between the first and the last stage, after the pipeline",
    "optimizer_s_per_block": "{plain: s, sharded: s, tp: s}: gradient clipping + optimizer step per block of "
                             "a rank's stages (sharded: FSDP/replicate DTensor parameters; tp: a stage sharded "
                             "over tp=2 without dp, default sharded; clipping's norm all-reduce over the shards "
                             "is one allreduce_latency_s per step, not per block)",
    "optimizer_fixed_s": "{plain: s, sharded: s, tp: s} (default 0): the optimizer's per-call cost (norms, foreach "
                         "launches, Python), paid once per rank and step beside optimizer_s_per_block",
    "optimizer_in_step_scale": "float (informational): how much longer clipping + AdamW took in a real "
                               "one-process step than in the optimizer micro-benchmark; the plain optimizer "
                               "figures above already include it",
    "optimizer_ends_blocks": "float: the embedding + final norm/head parameters' optimizer time, in blocks",
    "step_overhead_s": "float: per-step time the above leave out (Python, scheduler), from one reference step",
    "zb_input_grad_share": "float: zero-bubble's input-gradient (B) share of a backward; the rest is W "
                           "(used when zb_backward_factors is absent)",
    "zb_backward_factors": "[{tokens, input, weight}]: zero-bubble's B and W of a block (torch's "
                           "stage_backward_input / _weight) as multiples of its plain backward, per "
                           "micro-batch size in tokens (interpolated between)",
    "backward_forward_ratio": "[{tokens, ratio}] (default 2): a block's measured backward / forward time "
                              "per micro-batch size in tokens; splits the fitted forward + backward time",
    "pipeline_compute_factor": "float (default 1): how much longer a block computes inside a real two-stage "
                               "pipeline than alone, beyond contention_factor's compute; multiplies the compute "
                               "of every stage of a pipeline (pp > 1)",
    "steadiness": "{steady, threshold, worst, worst_spread, too_few_repeats, benchmarks: {name: {median_s, min_s, "
                  "max_s, spread, n}}} (informational; the cost model reads none of it): each benchmark's repeats and "
                  "their spread ((median - quickest) / quickest), and whether the machine held steady while measured "
                  "(hrlplan.runtime.calibrate.record.assess); an unsteady record plans one job and is never cached. "
                  "{steady: false, over_budget: why} alone: calibration stopped at planner.calibrate_budget_s and the "
                  "plan used peak figures",
    "quota_cpu_s": "{device name: {pipeline_per_microbatch: s, pipeline_hop_bytes: B, p2p_exchange: {cpu_s, "
                   "cpu_s_per_byte}, gradient_bucket_cpu_s_per_byte: s, allreduce: [{ranks, cpu_s, cpu_s_per_byte}], "
                   "step_overhead: s, optimizer_scale: f}} (CPU workers under a quota, cluster.cpu_shares; written "
                   "only where one is): process CPU time per micro-batch and stage of torch's pipeline schedule "
                   "beyond the forwards and backwards (sends, receives, their waits; its messages of "
                   "pipeline_hop_bytes), per send + receive exchange (a line over the message bytes), per byte "
                   "of gradients packed into a cross-replica bucket and back, per all-reduce over `ranks` "
                   "ranks, the reference step's overhead, and its clipping + optimizer over the optimizer figures' "
                   "prediction, each measured in CPU time on that device's ranks; a capped worker's step is bounded "
                   "by its CPU work over its share (cost/quota_cpu.py)",
    "contention_factor": "{compute: f, paired: f} (default 1): how much longer CPU work takes while every rank "
                         "of the job works at once -- more ranks than cores share them. compute: vs one rank "
                         "alone (multiplies compute, op_overhead_s, plain optimizer, step_overhead_s, which are "
                         "measured alone); paired: vs the two ranks of a pair (multiplies what the two-rank "
                         "micro-benchmarks measure: p2p, FSDP collectives/hooks/sharded optimizer, tp, all-reduces); "
                         "`hrlplan calibrate` runs those with every rank busy and sets paired to 1; ranks under a CPU "
                         "quota are left out where any rank is not, and the job's demand is the sum of its ranks' "
                         "shares",
}
