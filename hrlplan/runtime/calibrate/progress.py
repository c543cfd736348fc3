"""Calibration's progress on the console and its time budget.

Rank 0 says which group of micro-benchmarks starts, k of n, and the seconds spent so far. Before each
group every rank learns rank 0's verdict on the budget (planner.calibrate_budget_s), so all of them
stop together: a calibration past its budget raises CalibrationOverBudget on every rank, and the job
plans from peak figures instead (hrlplan.launch.planning.calibrated). The budget is checked between
groups (and between the reference step's rounds), so a group that starts inside it runs to its end.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

from hrlplan.errors import ConfigError

DEFAULT_BUDGET_S = 300.0   # planner.calibrate_budget_s when unset: the default job calibrates in ~15 s here
BUDGET_KEY = "planner.calibrate_budget_s"


class CalibrationOverBudget(Exception):
    """Calibration ran past its budget at `stage` (`done` of `total` groups finished before it)."""

    def __init__(self, budget_s: float, elapsed_s: float, done: int, total: int, stage: str):
        super().__init__(budget_s, elapsed_s, done, total, stage)
        self.budget_s, self.elapsed_s, self.done, self.total, self.stage = budget_s, elapsed_s, done, total, stage

    def __str__(self) -> str:
        return (f"calibration stopped after {self.elapsed_s:.0f} s, over {BUDGET_KEY}={self.budget_s:g}, "
                f"at {self.stage} ({self.done} of {self.total} groups done)")


class Progress:
    """Collective use: every rank calls start() for the same stages in the same order (or none but
    rank 0 with collective=False). `agree` turns rank 0's over-budget verdict into every rank's (a
    broadcast); `say` prints rank 0's line."""

    def __init__(self, stages: Sequence[str], budget_s: float, rank: int,
                 agree: Callable[[bool], bool] = lambda over: over,
                 say: Callable[[str], None] = lambda line: print(line, flush=True),
                 clock: Callable[[], float] = time.monotonic, started: Optional[float] = None):
        self.stages, self.budget_s, self.rank = list(stages), float(budget_s), rank
        self.agree, self.say, self.clock = agree, say, clock
        self.started = clock() if started is None else started   # the budget counts the set-up before it too

    def elapsed(self) -> float:
        return self.clock() - self.started

    def check(self, stage: str, collective: bool = True) -> None:
        """Raise CalibrationOverBudget (on every rank, when collective) once the budget is spent."""
        over = self.rank == 0 and self.elapsed() > self.budget_s
        if collective:
            over = bool(self.agree(over))
        if over:
            raise CalibrationOverBudget(self.budget_s, self.elapsed(), self.stages.index(stage), len(self.stages),
                                        stage)

    def start(self, stage: str, collective: bool = True) -> None:
        """Group `stage` begins: check the budget, then rank 0 says k/n and the time so far."""
        self.check(stage, collective)
        if self.rank == 0:
            self.say(f"[hrlplan] calibration {self.stages.index(stage) + 1}/{len(self.stages)}: {stage} "
                     f"({self.elapsed():.1f} s so far)")


def budget_seconds(planner: Optional[dict]) -> float:
    """planner.calibrate_budget_s (DEFAULT_BUDGET_S when unset); a value that is not a positive number
    is refused naming the key."""
    value = (planner or {}).get("calibrate_budget_s")
    if value is None:
        return DEFAULT_BUDGET_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)) or isinstance(value, bool):
        raise ConfigError(BUDGET_KEY, value, message=f"{BUDGET_KEY}={value!r} is not allowed: it must be a "
                          f"positive number of seconds (default {DEFAULT_BUDGET_S:g}); planner.calibrate=false "
                          "skips calibration")
    return seconds
