"""What bench/runtime.py and bench/local_pick.py both report: each rank's measured peak memory against
the memory model's (with both splits), each plan's measured step time over interleaved rounds
against the prediction, and how well the predictions rank the plans (issue 19).

Memory is measured as the trainer measures it (hrlplan/runtime/memory.py: live tensor storages on
the CPU, torch.cuda.max_memory_allocated on a GPU) and compared with the predicted tensor bytes
(hrlplan.cost.plans.plan_memory: the simulator's peak less its workspace reserve). The predicted
split's `other` is a backward's working set plus the pipeline's receive buffers; the measured
one's is whatever was alive and made outside a forward (backward's gradients of activations,
messages, the optimizer's temporaries).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published import spearman  # noqa: E402  (bench/published.py: rank correlation with ties)

SPLIT = ("weights", "gradients", "optimizer", "activations", "other")
MiB = 2 ** 20


def predicted_split(row: Dict[str, float]) -> Dict[str, float]:
    """A plan_memory row in the measurement's categories (workspace left out: torch does not allocate it)."""
    out = {k: float(row.get(k, 0.0)) for k in ("weights", "gradients", "optimizer", "activations")}
    out["other"] = float(row.get("transient", 0.0)) + float(row.get("buffers", 0.0))
    return out


def memory_per_rank(plan, summary: Dict[str, Any], meta, cluster, train_cfg: Dict[str, Any],
                    used: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
    """Per rank of `plan` that trained (`used`: the plan's ranks in the order the trained ranks report,
    default all): measured peak and split, predicted tensor bytes and split, (measured - predicted) /
    predicted. [] when the run measured nothing."""
    from hrlplan.cost.plans import plan_memory
    from hrlplan.cost.plans import options_for_train

    measured = (summary.get("measured") or {}).get("memory_split_per_rank") or []
    if not measured:
        return []
    predicted = plan_memory(plan, meta, cluster, options_for_train(train_cfg))
    used = list(range(plan.world_size)) if used is None else list(used)
    rows = []
    for r, m in zip(used, measured):
        if not m or not m.get("peak"):
            continue
        p = predicted[r]["tensors"]
        rows.append({"rank": r, "measured": float(m["peak"]), "predicted": float(p),
                     "error": (m["peak"] - p) / p if p else None,
                     "measured_split": {k: float(m.get(k) or 0.0) for k in SPLIT},
                     "predicted_split": predicted_split(predicted[r])})
    return rows


def memory_lines(name: str, rows: Sequence[Dict[str, Any]]) -> List[str]:
    """One line per rank: measured, predicted, error, and the two splits (MiB)."""
    out = []
    for x in rows:
        ms, ps = x["measured_split"], x["predicted_split"]
        split = " ".join(f"{k[:3]} {ms[k] / MiB:.2f}/{ps[k] / MiB:.2f}" for k in SPLIT)
        out.append(f"  {name:20s} rank {x['rank']}: measured {x['measured'] / MiB:7.2f} MiB, predicted "
                   f"{x['predicted'] / MiB:7.2f} MiB ({x['error']:+6.1%}) | measured/predicted: {split}")
    return out


def memory_summary(per_plan: Dict[str, Sequence[Dict[str, Any]]]) -> Dict[str, Any]:
    errors = [x["error"] for rows in per_plan.values() for x in rows if x["error"] is not None]
    return {"memory_ranks": len(errors), "memory_ranks_within_10pct": sum(abs(e) <= 0.10 for e in errors),
            "memory_max_abs_error": max(map(abs, errors), default=None),
            "memory_median_abs_error": statistics.median(map(abs, errors)) if errors else None}


def timing_row(measured: Sequence[float], predicted: Sequence[float]) -> Dict[str, Any]:
    """A plan's measured median step time over its rounds, its min-max, the median prediction and
    whether it falls inside the measured range."""
    med, pred = statistics.median(measured), statistics.median(predicted)
    return {"measured_median_s": med, "measured_min_s": min(measured), "measured_max_s": max(measured),
            "spread": (max(measured) - min(measured)) / med if med else float("nan"),
            "predicted_median_s": pred, "prediction_inside_measured_range": min(measured) <= pred <= max(measured),
            "measured_runs_s": list(measured), "predicted_runs_s": list(predicted)}


def ranking(rows: Dict[str, Dict[str, Any]], pick: Optional[str] = None) -> Dict[str, Any]:
    """Spearman between predicted and measured medians over the plans, the measured order, and the
    measured rank of `pick` (default: the plan predicted fastest) and whether it is within the
    fastest plan's measured range."""
    names = sorted(rows, key=lambda n: rows[n]["measured_median_s"])
    if not names:
        return {}
    if pick is None:
        pick = min(rows, key=lambda n: rows[n]["predicted_median_s"])
    rho = spearman([rows[n]["predicted_median_s"] for n in names], [rows[n]["measured_median_s"] for n in names]) \
        if len(names) > 1 else float("nan")
    fastest = rows[names[0]]
    return {"spearman_predicted_vs_measured": rho, "measured_order": names, "pick": pick,
            "pick_measured_rank": names.index(pick) + 1 if pick in rows else None,
            "pick_within_fastest_spread": pick in rows and rows[pick]["measured_median_s"] <= fastest["measured_max_s"]}


def timing_lines(rows: Dict[str, Dict[str, Any]], rank: Dict[str, Any], label: str = "plan") -> List[str]:
    out = [f"{label:22s} {'measured ms (min-max)':>26s} {'predicted':>10s} in-range"]
    for n in rank.get("measured_order", []):
        x = rows[n]
        out.append(f"{n:22s} {x['measured_median_s'] * 1e3:8.2f} ({x['measured_min_s'] * 1e3:6.2f}-"
                   f"{x['measured_max_s'] * 1e3:6.2f}) {x['predicted_median_s'] * 1e3:10.2f} "
                   f"{'yes' if x['prediction_inside_measured_range'] else 'no':>8s}"
                   + ("   <- pick" if n == rank.get("pick") else ""))
    if rank:
        out.append(f"Spearman(predicted, measured) = {rank['spearman_predicted_vs_measured']:.2f}; the pick "
                   f"{rank['pick']} is measured #{rank['pick_measured_rank']} of {len(rows)} "
                   f"({'within' if rank['pick_within_fastest_spread'] else 'outside'} the fastest's range)")
    return out
