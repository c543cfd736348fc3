"""The planner's view of data.packing=document|balanced: the chosen plan's step costed from the corpus's
length distribution (issue 37, item 3), for plan_info.json's `packing`.

The search still ranks plans by the fixed-length micro-batch (search/ is not told the lengths); this
costs the plan it chose on steps sampled from the corpus, packed as each packing packs them, through
the simulator's timeline with each micro-batch's own work (Simulator.evaluate's micro_batch_work;
cost/lengths.py), attention's share of a micro-batch from the same cost model (compute_parts).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.cost.lengths import LengthDistribution, packed_step_times, simulator_attention_shares, simulator_step_of
from hrlplan.cost.plans import layout_of_plan
from hrlplan.cost.simulator import Simulator
from hrlplan.data.code_corpus import CodeCorpus
from hrlplan.search.common import cost_options

SAMPLED_STEPS = 12


def packed_step_prediction(config, meta, cluster, plan, planner: Dict[str, Any],
                           steps: int = SAMPLED_STEPS) -> Optional[Dict[str, Any]]:
    """{packing, lengths, fixed_length_step_s, per packing the sampled steps' predicted step (each
    replica's pipeline costed with its own micro-batches, the step the slowest's)}, or {packing,
    skipped: why}; None when data.packing is concat."""
    data = config.data
    packing = str(getattr(data.packing, "value", data.packing))
    if packing == "concat":
        return None
    why = _why_not_costed(data, plan)
    if why:
        return {"packing": packing, "skipped": why}
    corpus = CodeCorpus.load(str(data.path or "data/code"))
    if corpus.eot_id is None:
        return {"packing": packing, "skipped": "the corpus has no end-of-text token to cut documents at"}
    distribution = LengthDistribution.from_tokens(corpus.train_tokens, int(corpus.eot_id), int(data.seq_len))
    sim = Simulator(meta, cluster, cost_options(planner, config.train))
    layout = layout_of_plan(plan)
    shares = simulator_attention_shares(sim, layout)
    step_of = simulator_step_of(sim, layout)
    out: Dict[str, Any] = {"packing": packing, "lengths": distribution.summary(), "sampled_steps": steps,
                           "fixed_length_step_s": sim.evaluate(layout).step_time_s,
                           "attention_share_per_stage": [s.attention for s in shares]}
    for name in ("document", "balanced"):
        times = packed_step_times(step_of, meta, layout.spans, distribution, layout.num_microbatches, name, steps,
                                  seed=int(config.train.seed), shares=shares, replicas=int(plan.dp))
        out[name] = {"step_s_median": statistics.median(times), "step_s_mean": statistics.fmean(times),
                     "step_s_min": min(times), "step_s_max": max(times)}
    out["balanced_over_document"] = out["document"]["step_s_mean"] / out["balanced"]["step_s_mean"]
    return out


def _why_not_costed(data, plan) -> str:
    """Why this run's packed steps are not costed ("" when they are)."""
    if str(data.name) != "code":
        return f"data={data.name} has no documents to measure"
    path = Path(str(data.path or "data/code"))
    if not (path / "meta.json").exists():
        return f"the corpus at {path} is not built yet (training builds it); its lengths are costed on the next plan"
    if plan.heterogeneous or plan.microbatch_size != 1:
        return "costed for homogeneous plans of one-row micro-batches only (microbatch_size 1)"
    return ""
