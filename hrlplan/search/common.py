"""What every planner shares: scored candidates, the best-and-runner-up record, explanations."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hrlplan.config import TrainConfig
from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.plans import options_for_train
from hrlplan.cost.simulator import SimResult, Simulator
from hrlplan.search.plan_text import layout_summary


def cost_options(planner_cfg: Dict[str, Any], train_cfg: TrainConfig) -> CostOptions:
    return options_for_train(train_cfg, planner_cfg)


@dataclass
class Scored:
    layout: Layout
    result: SimResult
    config: Any = None

    @property
    def time(self) -> float:
        return self.result.step_time_s


@dataclass
class Tracker:
    """Keeps the best candidate and the best one with a different high-level shape (the runner-up
    a user would otherwise have picked), plus the first infeasibility reason seen; with keep > 0 also
    the `keep` fastest feasible candidates (`top`, fastest first, one per layout: what a second
    objective, such as a packed run's step, re-ranks)."""
    best: Optional[Scored] = None
    runner_up: Optional[Scored] = None
    infeasible: int = 0
    first_reason: str = ""
    history: List[float] = field(default_factory=list)
    keep: int = 0
    top: List[Scored] = field(default_factory=list)

    @staticmethod
    def shape(s: Scored):
        lay = s.layout
        return (lay.pp, lay.tp, lay.dp, lay.microbatch_size, lay.schedule, lay.groups)

    def offer(self, s: Scored) -> None:
        if not s.result.feasible:
            self.infeasible += 1
            self.first_reason = self.first_reason or s.result.reason
            return
        if self.best is None or s.time < self.best.time:
            if self.best is not None and self.shape(self.best) != self.shape(s):
                self.runner_up = self.best
            self.best = s
        elif self.shape(s) != self.shape(self.best) and (self.runner_up is None or s.time < self.runner_up.time):
            self.runner_up = s
        self.history.append(self.best.time)
        if self.keep > 0 and all(t.layout != s.layout for t in self.top):
            self.top = sorted(self.top + [s], key=lambda t: t.time)[:self.keep]


def describe(layout: Layout) -> str:
    """The one notation for a layout (hrlplan.search.plan_text): plan_info.json's summaries and the why text."""
    return layout_summary(layout)


def why_better(sim: Simulator, best: Scored, other: Optional[Scored]) -> Dict[str, Any]:
    if other is None:
        return {"text": "no other feasible layout shape exists for this model and cluster"}
    b = sim.evaluate(best.layout, detail=True)
    o = sim.evaluate(other.layout, detail=True)
    keys = ["compute_s", "tp_comm_s", "p2p_comm_s", "dp_comm_exposed_s", "bubble_s"]
    diffs = {k: o.breakdown[k] - b.breakdown[k] for k in keys}
    ranked = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))
    parts = [f"{k[:-2].replace('_', ' ')} {'-' if d > 0 else '+'}{abs(d) * 1e3:.3g} ms" for k, d in ranked[:3] if abs(d) > 0]
    gain = o.step_time_s / b.step_time_s - 1 if b.step_time_s > 0 else 0.0
    text = (f"{describe(best.layout)} takes {b.step_time_s * 1e3:.4g} ms per step vs the runner-up "
            f"{describe(other.layout)} at {o.step_time_s * 1e3:.4g} ms ({gain:+.1%} slower); against it the chosen "
            f"plan has " + ", ".join(parts))
    return {"text": text, "component_savings_s": diffs, "runner_up_step_time_s": o.step_time_s}
