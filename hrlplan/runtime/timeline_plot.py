"""A picture of one pipeline step: pipeline positions (stages) x time, one box per forward (F),
backward (B) and, for zero-bubble, weight-gradient (W) pass of each micro-batch.

Predicted: replayed from the cost model's event timeline (hrlplan.cost.timeline) with the chosen
plan's per-stage durations from plan_info.json. Measured: drawn when plan_info.json carries a
`measured` entry (written by the trainer) in this form:

    measured:
      step_time_s: 0.12              # optional: a measured step (e.g. the median)
      events:                        # optional: one step's operations, times from the step start
        - {rank: 0, kind: F, stage: 0, microbatch: 0, start_s: 0.0, end_s: 0.004}
        ...                          # one row per rank (or per `position`/stage without ranks)

(a top-level `measured_timeline` list of the same events is read too).

Only what exists is drawn; the predicted row set is always there.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from hrlplan.cost.simulator import zb_input_shares
from hrlplan.cost.timeline import simulate_shared_timeline, simulate_timeline

KIND_NAMES = {0: "F", 1: "B", 2: "W"}
COLORS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B"}


def predicted_events(plan: Dict[str, Any], info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The simulator's timeline (hrlplan.cost.timeline.simulate_timeline, or simulate_shared_timeline
    where ranks outnumbered cores) for `plan` (Plan.to_dict()) replayed with the per-stage durations
    in `info` (plan_info.json)."""
    stages = sorted((info.get("chosen") or {}).get("stages") or [], key=lambda s: s["stage"])
    schedule = str(plan.get("schedule", "1f1b"))
    v = int(plan.get("stages_per_rank", 1) or 1)
    pp = int(plan.get("pp") or max(1, len(stages) // v))
    m = int(plan.get("num_microbatches", 1))
    n = pp * v
    if len(stages) != n:
        return []
    fwd = [float(s["fwd_s"]) for s in stages]
    if all("bwd_input_s" in s and "bwd_weight_s" in s for s in stages):
        # the simulator's own split (calibrated zb_input_grad_share, B = 0 on the first stage)
        bwd = [float(s["bwd_input_s"]) for s in stages]
        wgt = [float(s["bwd_weight_s"]) for s in stages]
    elif schedule == "zero_bubble":   # an older plan_info.json: the share from the calibration, if given
        shares = zb_input_shares(n, _calibrated_zb_share(info))
        bwd = [float(s["bwd_s"]) * sh for s, sh in zip(stages, shares)]
        wgt = [float(s["bwd_s"]) * (1.0 - sh) for s, sh in zip(stages, shares)]
    else:
        bwd = [float(s["bwd_s"]) for s in stages]
        wgt = [0.0] * n
    send = [float(s.get("send_s", 0.0)) for s in stages]
    handshake = [float(s.get("recv_handshake_s", 0.0)) for s in stages]
    trace: List[tuple] = []
    extra = [float(s.get("first_fwd_extra_s", 0.0)) for s in stages]
    contention = float(stages[0].get("shared_cores_contention", 0.0))
    if contention > 0:   # ranks outnumbered cores: operations slowed by the ranks busy while they ran
        ranks = [len(s.get("devices") or [0]) for s in stages[:pp]]
        simulate_shared_timeline(schedule, pp, v, m, fwd, bwd, wgt, send, send, [0.0] * n, first_fwd_extra=extra,
                                 recv_handshake=handshake, ranks=ranks, contention=contention, trace=trace)
    else:
        simulate_timeline(schedule, pp, v, m, fwd, bwd, wgt, send, send, [0.0] * n, first_fwd_extra=extra,
                          recv_handshake=handshake, trace=trace)
    return [{"position": pos, "kind": KIND_NAMES[kind], "stage": k, "microbatch": j, "start_s": start, "end_s": end}
            for pos, kind, k, j, start, end in trace]


def _calibrated_zb_share(info: Dict[str, Any]) -> Optional[float]:
    """zb_input_grad_share from a cluster calibration recorded in plan_info.json, if any."""
    for where in (info.get("calibration"), (info.get("cluster") or {}).get("calibration")
                  if isinstance(info.get("cluster"), dict) else None):
        if isinstance(where, dict) and where.get("zb_input_grad_share") is not None:
            return float(where["zb_input_grad_share"])
    return None


def measured_events(info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Measured operations, one row per rank (a data-parallel stage has several) when ranks are given."""
    measured = info.get("measured") or {}
    raw = measured.get("events") or info.get("measured_timeline") or []
    out = []
    for e in raw:
        try:
            stage = int(e.get("stage", 0))
            rank = e.get("rank")
            out.append({"position": int(rank if rank is not None else e.get("position", stage)),
                        "label": f"rank {int(rank)} (stage {stage})" if rank is not None else f"stage {stage}",
                        "kind": str(e.get("kind", "F"))[:1], "stage": stage, "microbatch": int(e.get("microbatch", 0)),
                        "start_s": float(e["start_s"]), "end_s": float(e["end_s"])})
        except (KeyError, TypeError, ValueError):
            continue  # a malformed event is not worth failing the run for
    return out


def _draw(ax, events: Sequence[Dict[str, Any]], title: str, step_time_s: Optional[float]) -> None:
    positions = sorted({e["position"] for e in events}) or [0]
    span = max([e["end_s"] for e in events] + [step_time_s or 0.0]) * 1e3
    for e in events:
        width = (e["end_s"] - e["start_s"]) * 1e3
        ax.broken_barh([(e["start_s"] * 1e3, width)], (e["position"] - 0.4, 0.8),
                       facecolors=COLORS.get(e["kind"], "#999999"), edgecolors="white", linewidth=0.5)
        if width > 0.03 * span:  # label only boxes wide enough to hold it
            label = f"{e['kind']}{e['microbatch']}"
            ax.text(e["start_s"] * 1e3 + width / 2, e["position"], label, ha="center", va="center",
                    fontsize=7, color="white", clip_on=True)
    if step_time_s:
        ax.axvline(step_time_s * 1e3, color="black", linestyle="--", linewidth=1)
        ax.text(step_time_s * 1e3, positions[-1] + 0.45, f" step {step_time_s * 1e3:.3g} ms", fontsize=8, va="bottom")
    labels = {e["position"]: e.get("label", f"stage {e['position']}") for e in events}
    ax.set_yticks(positions)
    ax.set_yticklabels([labels.get(p, f"stage {p}") for p in positions])
    ax.set_ylim(positions[-1] + 0.8, positions[0] - 0.8)
    ax.set_xlabel("time in one step (ms)")
    ax.set_title(title, fontsize=10)


def timeline_figure(plan: Dict[str, Any], info: Dict[str, Any], measured_step_s: Optional[float] = None):
    """A matplotlib Figure: predicted schedule, and the measured one when it exists."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pred = predicted_events(plan, info)
    meas = measured_events(info)
    measured = info.get("measured") or {}
    measured_step_s = measured.get("step_time_s") or measured_step_s
    predicted_step_s = (info.get("chosen") or {}).get("step_time_s")
    rows = 2 if meas else 1
    pp = max([e["position"] for e in pred + meas] + [0]) + 1  # rows of the taller panel
    fig, axes = plt.subplots(rows, 1, figsize=(10, 1.2 + rows * (0.6 + 0.45 * pp)), squeeze=False)
    dp = ((plan.get("stages") or [{}])[0]).get("dp", 1)
    layout = (f"pp={plan.get('pp')} dp={dp} {plan.get('schedule')}, "
              f"{plan.get('num_microbatches')} micro-batches of {plan.get('microbatch_size')}")
    pred_title = f"predicted ({layout})"
    if measured_step_s and predicted_step_s:
        pred_title += f": step {predicted_step_s * 1e3:.3g} ms predicted vs {measured_step_s * 1e3:.3g} ms measured"
    _draw(axes[0][0], pred, pred_title, predicted_step_s)
    if meas:
        _draw(axes[1][0], meas, "measured", measured_step_s)
    kinds = sorted({e["kind"] for e in pred + meas}, key="FBW".index)
    names = {"F": "forward", "B": "backward", "W": "weight grad"}
    fig.legend(handles=[Patch(color=COLORS[k], label=names[k]) for k in kinds], loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def save_timeline(run_dir: str | Path, measured_step_s: Optional[float] = None) -> Optional[Path]:
    """Draw <run_dir>/timeline.png from plan.yaml + plan_info.json; None when they are missing."""
    run_dir = Path(run_dir)
    plan_file, info_file = run_dir / "plan.yaml", run_dir / "plan_info.json"
    if not plan_file.exists() or not info_file.exists():
        return None
    plan = yaml.safe_load(plan_file.read_text())
    info = json.loads(info_file.read_text())
    fig = timeline_figure(plan, info, measured_step_s)
    out = run_dir / "timeline.png"
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out
