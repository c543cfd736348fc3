"""A replica's optimizer state as the sharded optimizer across replicas keeps it, for the replica
template searches (search/hetero_exact.py).

At dp 1 a replica holds every parameter with 16 bytes (fp32 weights and gradients, AdamW's two fp32
moments: cost/memory.state_split). Sharded over the `members` replicas that hold a unit
(runtime/hetero_zero.py, cost/replica_optimizer.py), a rank keeps the moments and an fp32 master of
1/members of its values: 12/members bytes in place of the 8 of the moments. A llama-70b replica on 16
80 GB devices cannot hold 16 B/param at all; sharded over 8 replicas it holds 9.5.

`members` is what the search assumes (the replicas of one option, which all hold every unit); the
plan a template goes into is predicted in full by cost/plans.py, which prices the state each rank
really keeps (an in-node-first rank set shards over its rails only), so an assumption that does not
hold makes that plan over memory, never a wrong prediction.
"""
from __future__ import annotations

import dataclasses

from hrlplan.cost.memory import STATE_BYTES_PER_PARAM
from hrlplan.cost.replica_optimizer import MASTER_BYTES, MOMENT_BYTES
from hrlplan.cost.simulator import Simulator

WHOLE_STATE_BYTES = float(STATE_BYTES_PER_PARAM)   # per parameter at dp 1, replicated optimizer
# a relaxation, not a plan: the state of a set of so many members that its moments and masters
# vanish; no replica holds less, so a bound computed with it bounds every members count
UNBOUNDED_MEMBERS = 10 ** 9


def state_bytes_per_param(members: int) -> float:
    """Bytes per parameter a replica's ranks keep at dp 1: 16 replicated (members <= 1), else weights
    and gradients plus 12/members of moments and masters."""
    if members <= 1:
        return WHOLE_STATE_BYTES
    return WHOLE_STATE_BYTES - MOMENT_BYTES + (MOMENT_BYTES + MASTER_BYTES) / members


def optimizer_state_fraction(members: int) -> float:
    """The sharded optimizer's state over the replicated one's (the moments) on a rank."""
    return 1.0 if members <= 1 else (MOMENT_BYTES + MASTER_BYTES) / members / MOMENT_BYTES


class ShardedStateCosts:
    """The stage costs of `costs` with each rank's optimizer state at optimizer_state_fraction."""

    def __init__(self, costs, members: int):
        self._costs, self.fraction = costs, optimizer_state_fraction(members)

    def __getattr__(self, name):
        return getattr(self._costs, name)

    def stage(self, *args, **kwargs):
        c = self._costs.stage(*args, **kwargs)
        if not c.memory or "optimizer" not in c.memory:
            return c
        whole = c.memory["optimizer"]
        kept = whole * self.fraction
        return dataclasses.replace(c, memory=dict(c.memory, optimizer=kept), static_memory=c.static_memory - (whole - kept))


def sharded_state_simulator(sim, members: int) -> Simulator:
    """`sim`'s simulator (model, cluster, options, devices) whose replicas keep the sharded optimizer's
    state over `members` replicas; its own evaluation count (the caller adds it to sim's)."""
    out = Simulator(sim.meta, sim.cluster, sim.opts)
    out.costs = ShardedStateCosts(out.costs, members)
    return out
