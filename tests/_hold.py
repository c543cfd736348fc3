"""The test side of hrlplan/runtime/preempt.py's sync point: a job started with `StepHold(...).env`
waits at a step boundary until the test releases it, so a signal, a requeue or a kill lands at a step
the test chose, however fast or slow each process is.

    hold = StepHold(tmp_path / "hold", step=3)
    proc = start_job(env=hold.env)
    hold.wait_held(ranks=2, alive=lambda: proc.poll() is None)
    os.kill(proc.pid, signal.SIGINT)
    hold.wait_stopping(alive=...)   # the stop flag reached a rank while it was held
    hold.release()                  # the job goes on: it stops at step 3
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, List

from hrlplan.runtime.preempt import HOLD_AT_STEP_ENV, HOLD_FILE_ENV


class StepHold:
    def __init__(self, path: Path, step: int):
        self.path = Path(path)
        self.step = int(step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)

    @property
    def env(self) -> Dict[str, str]:
        """The environment variables that make a job hold (its workers and SLURM tasks inherit them)."""
        return {HOLD_AT_STEP_ENV: str(self.step), HOLD_FILE_ENV: str(self.path)}

    def _markers(self, kind: str) -> List[Path]:
        return sorted(self.path.parent.glob(f"{self.path.name}.{kind}.*"))

    def _wait(self, kind: str, count: int, alive: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> List[Path]:
        deadline = time.monotonic() + timeout_s
        while len(found := self._markers(kind)) < count:
            assert alive(), f"the job ended before {count} rank(s) were {kind} at step {self.step}: {why()}"
            assert time.monotonic() < deadline, f"{count} rank(s) not {kind} at step {self.step} in {timeout_s:.0f} s: {why()}"
            time.sleep(0.05)
        return found

    def wait_held(self, ranks: int = 1, alive: Callable[[], bool] = lambda: True, timeout_s: float = 300,
                  why: Callable[[], str] = lambda: "") -> List[Path]:
        """Until `ranks` ranks wait at the step (their markers); fails if alive() turns False first."""
        return self._wait("held", ranks, alive, timeout_s, why)

    def wait_stopping(self, ranks: int = 1, alive: Callable[[], bool] = lambda: True, timeout_s: float = 120,
                      why: Callable[[], str] = lambda: "") -> List[Path]:
        """Until `ranks` held ranks have seen a stop request (a signal's handler ran)."""
        return self._wait("stopping", ranks, alive, timeout_s, why)

    def held_pids(self) -> Dict[int, int]:
        """{rank: pid} of the held ranks (each marker holds `host pid`)."""
        return {int(p.name.rsplit(".", 1)[1]): int(p.read_text().split()[1]) for p in self._markers("held")}

    def held_hosts(self) -> Dict[int, str]:
        """{rank: host name} of the held ranks."""
        return {int(p.name.rsplit(".", 1)[1]): p.read_text().split()[0] for p in self._markers("held")}

    def release(self) -> None:
        self.path.touch()
