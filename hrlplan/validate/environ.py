"""This process's environment, before it joins or starts anything: the documented HRLPLAN_* variables
hold what their docs say, and torch.distributed variables left over from another job (`RANK=1
WORLD_SIZE=2 MASTER_ADDR=...` exported in a shell, no rank 0 anywhere) are refused in one line before
the TCPStore rendezvous would wait its whole timeout for a rank 0 that never comes."""
from __future__ import annotations

import socket
import time
from typing import Mapping

from hrlplan.config import timeout_minutes
from hrlplan.errors import ConfigError

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OTHER_TORCH_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
# Set by whatever legitimately started this process with those variables: torchrun's elastic agent
# (our local launcher's too), SLURM, submitit.
LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SUBMITIT_EXECUTOR", "HRLPLAN_LOCAL_AGENT")
WAIT_ENV = "HRLPLAN_RENDEZVOUS_WAIT_S"
WAIT_S = 60.0   # how long a non-zero rank started by hand looks for its rank 0 before refusing


def launched(env: Mapping[str, str]) -> bool:
    """A launcher (torchrun, SLURM, submitit, our local agent) started this process."""
    return any(env.get(k) for k in LAUNCHER_MARKS)


def reports_errors(env: Mapping[str, str]) -> bool:
    """Whether this process says a refusal: under a launcher every rank checks and rank 0 speaks; a
    process nobody launched (leftover RANK=1) is alone, so it must speak for itself."""
    return env.get("RANK", "0") == "0" or not launched(env)


def check_environment_variables(env: Mapping[str, str]) -> None:
    timeout_minutes({}, dict(env))   # HRLPLAN_*_TIMEOUT_MIN: positive numbers where set
    check_leftover_rendezvous(env)


def check_leftover_rendezvous(env: Mapping[str, str]) -> None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set with no launcher behind them: a non-zero rank must
    reach its rank 0 at MASTER_ADDR:MASTER_PORT within HRLPLAN_RENDEZVOUS_WAIT_S (60 s), or it is
    refused naming the variables to unset. Rank 0 hosts the store itself, so only a bad value is
    refused there."""
    if not all(k in env for k in RENDEZVOUS_VARS) or launched(env):
        return
    shown = " ".join(f"{k}={env[k]}" for k in RENDEZVOUS_VARS + OTHER_TORCH_VARS if k in env)
    unset = "unset " + " ".join(k for k in RENDEZVOUS_VARS + OTHER_TORCH_VARS if k in env)
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError:
        raise ConfigError("RANK", env["RANK"], message=f"{shown}: not all of these are integers; `{unset}` "
                          "to train on this host (torchrun sets them itself)") from None
    if not (0 <= rank < world) or not (0 < port < 65536):
        raise ConfigError("RANK", rank, message=f"{shown}: RANK must be in 0..WORLD_SIZE-1 and MASTER_PORT a "
                          f"port; `{unset}` to train on this host (torchrun sets them itself)")
    if rank == 0:
        return
    wait = float(env.get(WAIT_ENV) or WAIT_S)
    host = env["MASTER_ADDR"]
    if _reachable(host, port, wait):
        return
    raise ConfigError("RANK", rank, message=f"{shown} are set, but no launcher (torchrun, SLURM) started this "
                      f"process and no rank 0 answers at {host}:{port} (waited {wait:g} s): they look left over "
                      f"from another job -- `{unset}` to train on this host, or start rank 0 first")


def _reachable(host: str, port: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, wait_s))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
