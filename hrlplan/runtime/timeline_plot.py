"""A picture of one training step: pipeline positions (stages) x time, one box per forward (F),
backward (B; a split-backward schedule's input-gradient half, or its whole backward BW, drawn as B) and,
for split-backward schedules, weight-gradient (W) pass of each micro-batch, then what the step
does after its pipeline work: the gradient all-reduce (R: data-parallel sync, drawn as a thin bar
under the backward it overlaps), the per-step all-reduces (C: tied embedding, gradient norm, loss),
the optimizer (O) and the rest of the step (X) -- so the predicted rows end at the predicted step.
Both panels share one time axis: a prediction far off the measurement shows as it is.

Predicted: replayed from the cost model's event timeline (hrlplan.cost.timeline) with the chosen
plan's per-stage durations from plan_info.json, and the step's tail from its breakdown
(Simulator.step_time's order). Measured: drawn when plan_info.json carries a
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from hrlplan.cost.simulator import zb_input_shares
from hrlplan.cost.timeline import TimelineResult, simulate_shared_timeline, simulate_timeline
from hrlplan.schedules import DEFAULT, ScheduleSpec, get
from hrlplan.search.plan_text import plan_dict_summary

KIND_NAMES = {0: "F", 1: "B", 2: "W", 3: "BW"}
COLORS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B", "R": "#B279A2", "C": "#9D755D", "O": "#72B7B2",
          "X": "#BAB0AC"}
NAMES = {"F": "forward", "B": "backward", "W": "weight grad", "R": "gradient all-reduce",
         "C": "per-step all-reduces", "O": "optimizer", "X": "rest of the step"}
ORDER = "FBWRCOX"
# the measured step's phases after its pipeline work (PipelineTrainer's phases_s_per_rank) as drawn
MEASURED_PHASES = (("sync_and_clip", "R"), ("loss_allreduce", "C"), ("optimizer", "O"))


def predicted_events(plan: Dict[str, Any], info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The simulator's timeline (hrlplan.cost.timeline.simulate_timeline, or simulate_shared_timeline
    where ranks outnumbered cores) for `plan` (Plan.to_dict()) replayed with the per-stage durations
    in `info` (plan_info.json): the pipeline's operations alone."""
    return _replay(plan, info)[0]


def predicted_step_events(plan: Dict[str, Any], info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """predicted_events and the step's tail after them (gradient all-reduce, per-step all-reduces,
    optimizer, the rest): the whole predicted step."""
    events, result = _replay(plan, info)
    if result is None:
        return events
    stages = sorted((info.get("chosen") or {}).get("stages") or [], key=lambda s: s["stage"])
    return events + _predicted_tail(plan, events, result, stages, (info.get("chosen") or {}).get("breakdown") or {})


def _plan_schedule(plan: Dict[str, Any]) -> Tuple[str, int, ScheduleSpec]:
    """(schedule name as the plan gives it, stages per rank, its registry entry)."""
    schedule, v = str(plan.get("schedule", DEFAULT)), int(plan.get("stages_per_rank", 1) or 1)
    return schedule, v, get(schedule, v)


def _replay(plan: Dict[str, Any], info: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], Optional[TimelineResult]]:
    stages = sorted((info.get("chosen") or {}).get("stages") or [], key=lambda s: s["stage"])
    schedule, v, spec = _plan_schedule(plan)
    pp = int(plan.get("pp") or max(1, len(stages) // v))
    m = int(plan.get("num_microbatches", 1))
    n = pp * v
    if len(stages) != n:
        return [], None
    fwd = [float(s["fwd_s"]) for s in stages]
    if all("bwd_input_s" in s and "bwd_weight_s" in s for s in stages):
        # the simulator's own split (calibrated zb_input_grad_share, B = 0 on the first stage)
        bwd = [float(s["bwd_input_s"]) for s in stages]
        wgt = [float(s["bwd_weight_s"]) for s in stages]
    elif spec.split_backward:   # an older plan_info.json: the share from the calibration, if given
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
        result = simulate_shared_timeline(schedule, pp, v, m, fwd, bwd, wgt, send, send, [0.0] * n,
                                          first_fwd_extra=extra, recv_handshake=handshake, ranks=ranks,
                                          contention=contention, trace=trace)
    else:
        result = simulate_timeline(schedule, pp, v, m, fwd, bwd, wgt, send, send, [0.0] * n, first_fwd_extra=extra,
                                   recv_handshake=handshake, trace=trace)
    events = [{"position": pos, "kind": KIND_NAMES[kind][:1], "stage": k, "microbatch": j, "start_s": start, "end_s": end}
              for pos, kind, k, j, start, end in trace]
    return events, result


def _tail_event(position: int, kind: str, start: float, end: float) -> Dict[str, Any]:
    return {"position": position, "kind": kind, "stage": None, "microbatch": None, "start_s": start, "end_s": end}


def _predicted_tail(plan: Dict[str, Any], events: List[Dict[str, Any]], result: TimelineResult,
                    stages: List[Dict[str, Any]], breakdown: Dict[str, Any]) -> List[Dict[str, Any]]:
    """After each position's pipeline work, in Simulator.step_time's order: its gradient all-reduce
    (hidden behind its last backward as far as the breakdown says it was), the calibrated FSDP/replicate
    reduces, the per-step all-reduces, the optimizer; then the step's overhead on every row."""
    _, v, spec = _plan_schedule(plan)
    pp = len(result.end)
    overlapped = float(breakdown.get("dp_comm_exposed_s", 0.0)) < float(breakdown.get("dp_comm_s", 0.0)) - 1e-15
    tail: List[Dict[str, Any]] = []
    finish = []
    for pos in range(pp):
        mine = [s for s in stages if int(s.get("position", spec.stage_rank(s["stage"], pp, v))) == pos]
        end = max((e["end_s"] for e in events if e["position"] == pos), default=0.0)
        sync = sum(float(s.get("dp_sync_s", 0.0)) for s in mine)
        # as Simulator.step_time: hidden behind the last backward, but never the stage root's tail
        tail_s = sum(float(s.get("dp_sync_tail_s", 0.0)) for s in mine)
        hidden = min(sync - tail_s, result.last_backward[pos]) if overlapped else 0.0
        if sync > 0:   # overlapped: a thin bar under the backward it runs beside
            tail.append({**_tail_event(pos, "R", end - hidden, end - hidden + sync), "thin": hidden > 0})
        at = end + sync - hidden
        if all("last_bwd_extra_s" in s for s in mine):
            reduce = sum(float(s["last_bwd_extra_s"]) for s in mine)
        else:   # older plan_info.json: the position's share of the FSDP collectives after its all-gathers
            reduce = max(0.0, float(breakdown.get("dp_collectives_s", 0.0))
                         - sum(float(s.get("first_fwd_extra_s", 0.0)) for s in mine))
        for kind, length in (("R", reduce), ("C", float(breakdown.get("step_collectives_s", 0.0))),
                             ("O", float(breakdown.get("optimizer_s", 0.0)))):
            if length > 0:
                tail.append(_tail_event(pos, kind, at, at + length))
                at += length
        finish.append(at)
    overhead = float(breakdown.get("step_overhead_s", 0.0))
    if overhead > 0:
        start = max(finish)
        tail += [_tail_event(pos, "X", start, start + overhead) for pos in range(pp)]
    return tail


def _calibrated_zb_share(info: Dict[str, Any]) -> Optional[float]:
    """zb_input_grad_share from a cluster calibration recorded in plan_info.json, if any."""
    for where in (info.get("calibration"), (info.get("cluster") or {}).get("calibration")
                  if isinstance(info.get("cluster"), dict) else None):
        if isinstance(where, dict) and where.get("zb_input_grad_share") is not None:
            return float(where["zb_input_grad_share"])
    return None


def measured_events(info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Measured operations, one row per rank (a data-parallel stage has several) when ranks are given;
    after each rank's pipeline work, its measured step phases (gradient sync and clipping, the loss
    all-reduce, the optimizer: medians over the measured steps) when plan_info.json has them."""
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
                        "start_s": float(e["start_s"]), "end_s": float(e["end_s"]), "rank": rank})
        except (KeyError, TypeError, ValueError):
            continue  # a malformed event is not worth failing the run for
    return out + _measured_tail(out, measured.get("phases_s_per_rank") or [])


def _measured_tail(events: List[Dict[str, Any]], phases_per_rank: List[Any]) -> List[Dict[str, Any]]:
    tail = []
    for position in sorted({e["position"] for e in events if e.get("rank") is not None}):
        row = [e for e in events if e["position"] == position]
        phases = phases_per_rank[position] if position < len(phases_per_rank) else None
        if not isinstance(phases, dict):
            continue
        at = max(e["end_s"] for e in row)
        for name, kind in MEASURED_PHASES:
            length = phases.get(name)
            if isinstance(length, (int, float)) and length > 0:
                tail.append({**_tail_event(position, kind, at, at + float(length)), "label": row[0]["label"]})
                at += float(length)
    return tail


def _draw(ax, events: Sequence[Dict[str, Any]], title: str, step_time_s: Optional[float], span_ms: float) -> None:
    positions = sorted({e["position"] for e in events}) or [0]
    for e in events:
        width = (e["end_s"] - e["start_s"]) * 1e3
        thin = bool(e.get("thin"))
        ax.broken_barh([(e["start_s"] * 1e3, width)], (e["position"] + 0.05, 0.35) if thin else (e["position"] - 0.4, 0.8),
                       facecolors=COLORS.get(e["kind"], "#999999"), edgecolors="white", linewidth=0.5,
                       hatch="////" if thin else None, zorder=3 if thin else 2)
        if width > 0.03 * span_ms:  # label only boxes wide enough to hold it
            label = e["kind"] if e["microbatch"] is None else f"{e['kind']}{e['microbatch']}"
            ax.text(e["start_s"] * 1e3 + width / 2, e["position"] + (0.22 if thin else 0.0), label, ha="center",
                    va="center", fontsize=7, color="white", clip_on=True, zorder=4)
    if step_time_s:
        ax.axvline(step_time_s * 1e3, color="black", linestyle="--", linewidth=1)
        ax.text(step_time_s * 1e3, positions[-1] + 0.45, f" step {step_time_s * 1e3:.3g} ms", fontsize=8, va="bottom")
    labels = {e["position"]: e.get("label", f"stage {e['position']}") for e in events}
    ax.set_yticks(positions)
    ax.set_yticklabels([labels.get(p, f"stage {p}") for p in positions])
    ax.set_ylim(positions[-1] + 0.8, positions[0] - 0.8)
    ax.set_title(title, fontsize=10)


def _span_ms(events: Sequence[Dict[str, Any]], *step_times: Optional[float]) -> float:
    return max([e["end_s"] for e in events] + [t or 0.0 for t in step_times] + [1e-9]) * 1e3


def timeline_figure(plan: Dict[str, Any], info: Dict[str, Any], measured_step_s: Optional[float] = None):
    """A matplotlib Figure: the predicted step, and the measured one when it exists, on one time axis."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pred = predicted_step_events(plan, info)
    meas = measured_events(info)
    measured = info.get("measured") or {}
    measured_step_s = measured.get("step_time_s") or measured_step_s
    predicted_step_s = (info.get("chosen") or {}).get("step_time_s")
    rows = 2 if meas else 1
    pp = max([e["position"] for e in pred + meas] + [0]) + 1  # rows of the taller panel
    fig, axes = plt.subplots(rows, 1, figsize=(10, 1.6 + rows * (0.7 + 0.45 * pp)), squeeze=False, sharex=True)
    pred_title = f"predicted ({plan_dict_summary(plan)})"
    if measured_step_s and predicted_step_s:
        pred_title += f": step {predicted_step_s * 1e3:.3g} ms predicted vs {measured_step_s * 1e3:.3g} ms measured"
    span = _span_ms(pred + meas, predicted_step_s, measured_step_s if meas else None)
    _draw(axes[0][0], pred, pred_title, predicted_step_s, span)
    if meas:
        _draw(axes[1][0], meas, "measured (after the pipeline: each rank's median step phases)", measured_step_s, span)
    axes[0][0].set_xlim(-0.01 * span, span * 1.08)   # shared: one time axis for both panels
    axes[-1][0].set_xlabel("time in one step (ms)")
    kinds = sorted({e["kind"] for e in pred + meas if e["kind"] in COLORS}, key=ORDER.index)
    # below the panels, never over a title
    fig.legend(handles=[Patch(color=COLORS[k], label=NAMES[k]) for k in kinds], loc="lower center",
               ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 * 3 / (3 + rows * pp), 1, 1))
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
