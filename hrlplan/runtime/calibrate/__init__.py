"""Calibration: measure the real devices and store the figures the cost model reads.

What is measured, and which ClusterSpec.calibration key (hrlplan.cost.model.CALIBRATION_KEYS) it sets:
- one transformer block's forward + backward at several micro-batch sizes on every rank. The cost
  model's compute time is flops * (tokens + h) / (peak * eff) per forward, backward twice that, so a
  straight line through (tokens, measured (F+B)/3) gives the sustained efficiency `eff`
  (compute_efficiency, per device name) and the half-saturation point `h` (half_saturation_tokens);
- the same block's backward / forward ratio per micro-batch size (backward_forward_ratio), and its
  backward split as zero-bubble runs it, by torch's own functions (zb_backward_factors);
- per-op overhead of torch's pipeline stage, on rank 0 alone (op_overhead_s); clipping + AdamW of a
  1-block and a deeper stage and of the embedding + head (optimizer_s_per_block, optimizer_fixed_s,
  optimizer_ends_blocks);
- the communication micro-benchmarks (.comm, .collectives), every pair of ranks at once
  with a rank left over kept busy (a step has every rank working too): a ping-pong
  (bandwidth_efficiency); a real two-stage torch pipeline per schedule (p2p_latency_s,
  p2p_latency_by_schedule_s, p2p_handshake_s, and the small all-reduces after it:
  allreduce_latency_s, tied_allreduce_s; its blocks' time against the same block alone, beyond
  contention_factor, gives pipeline_compute_factor); FSDP2 over a pair (dp_collective_s,
  dp_collective_fixed_s, dp_hook_s, the sharded optimizer); stages of 1 and 6 blocks sharded over
  tp=2 beside the whole ones (tp_block_overhead_s, the slope per block) and their clipping + AdamW
  (the "tp" entries of optimizer_s_per_block / optimizer_fixed_s); all-reduces over groups of every
  size, every group at once (allreduce_by_ranks). All-reduces and pipeline hops run in three passes
  at different moments, pooled;
- with train.dtype=bfloat16, every forward under bf16 autocast, as the runtime computes;
- contention_factor: one block's forward + backward on every rank at once vs on one rank alone (means
  over a long run); with more ranks than cores compute is then costed at the speed measured alone
  times this factor (times the ranks' busy share: see the simulator);
- one whole one-process training step of the model, run as the runtime runs a stage, vs the
  simulator's prediction for it with the figures above: its clipping + optimizer time rescales the
  plain optimizer figures (optimizer_in_step_scale), the rest it takes beyond the prediction is
  step_overhead_s (Python, the scheduler).
Nothing is fitted from a benchmarked plan's own step time. Raw measurements are kept under
calibration["measurements"] for inspection.

The package, imports one way (each module imports only those above it in this list, plus
hrlplan.measure's timers and fits, the models, cost and the runtime's stages):
  blocks.py       the stages every micro-benchmark runs (block_stage) and REPEATS
  attention_curve.py  the per-document attention kernel timed by length (packed documents: cost/attention_curve.py)
  compute.py      blocks, the optimizer, the pipeline's per-op overhead, contention, the one-process step
  comm.py         the ping-pong, the real two-stage pipeline hop, tensor-parallel stages
  collectives.py  FSDP2 over a pair, all-reduces over groups of every size
  record.py       the fits into the record (fit_calibration, fit_reference_step): data the cost model reads;
                  the steadiness verdict (assess: each benchmark's repeats, median and spread; unsteady on a
                  busy node, and then never cached)
  worker.py       calibrate_in_job: every rank measures at once, rank 0 fits and broadcasts; the progress
                  lines (calibration k/n) and the time budget (planner.calibrate_budget_s)
Starting workers to calibrate (`hrlplan calibrate`) is the launch layer's: hrlplan.launch.calibrate.
"""
from hrlplan.runtime.calibrate.compute import measure_step
from hrlplan.runtime.calibrate.record import (fit_calibration, is_steady, predict_plan, unsteady_reason,
                                              unsteady_threshold)
from hrlplan.runtime.calibrate.worker import (BUDGET_KEY, CalibrationOverBudget, budget_seconds, calibrate_in_job,
                                              calibration_sizes, largest_microbatch, memory_cap)

__all__ = ["BUDGET_KEY", "CalibrationOverBudget", "budget_seconds", "calibrate_in_job", "calibration_sizes",
           "fit_calibration", "is_steady", "largest_microbatch", "measure_step", "memory_cap", "predict_plan",
           "unsteady_reason", "unsteady_threshold"]
