"""Several `python pretrain.py mode=plan ...` commands that start no workers (a preset cluster: planned
and predicted in the command's own process) run one after another in ONE Python process, each through
what pretrain.py runs (hrlplan.app.run) with its own argument list, output and exit status. Starting
Python, torch and the app is most of such a command's time; the process is a child of the test, so
Hydra's global state, the logging it configures and sys.argv never reach pytest's own.

    run_commands([[sys.executable, "pretrain.py", "mode=plan", ...], ...], cwd=ROOT)
        -> [subprocess.CompletedProcess, ...]   (in the same order)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import List, Sequence

ROOT = Path(__file__).resolve().parent.parent


def run_commands(commands: Sequence[Sequence[str]], cwd: Path = ROOT, timeout: float = 600
                 ) -> List[subprocess.CompletedProcess]:
    """Each command is `[python, <path to pretrain.py>, *overrides]`; run in one child process."""
    for cmd in commands:
        if Path(cmd[1]).name != "pretrain.py":
            raise ValueError(f"not a pretrain.py command: {cmd[:2]}")
    job = json.dumps([[str(a) for a in cmd[1:]] for cmd in commands])
    done = subprocess.run([sys.executable, __file__], input=job, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_SILENT="true"))
    if done.returncode != 0:
        raise AssertionError(f"the commands' process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    results = json.loads(done.stdout.splitlines()[-1])
    return [subprocess.CompletedProcess(cmd, r["returncode"], r["stdout"], r["stderr"])
            for cmd, r in zip(commands, results)]


def _run_one(script: str, argv: List[str]) -> dict:
    from hrlplan.app import run

    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = [script]   # as `python pretrain.py` sets it; run() puts the checked overrides after it
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except Exception:   # what Python prints and exits with for a command that raises
            traceback.print_exc()
            code = 1
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    argvs = json.loads(sys.stdin.read())
    results = [_run_one(script, argv) for script, *argv in argvs]
    sys.stdout.write(json.dumps(results) + "\n")
