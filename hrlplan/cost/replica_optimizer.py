"""What the sharded optimizer across heterogeneous replicas (runtime/hetero_zero.py) changes per rank:
the parameters it steps and the state it keeps. cost/plans.py prices a plan with it.

Per rank and unit (cost/replica_sync: a unit over its rank set of n members), the rank holds
`held` parameters of it (the unit over its stage's tp). Replicated, it steps and keeps AdamW's two
fp32 moments for all of them. Sharded over n >= 2, it steps its slice of the set's flat values --
a same-tp set's values are the unit over tp, a whole (mixed-tp) set's the whole unit --, 1/n of
them in a flat set, 1/rails in an in-node-first one (none off the rails), and keeps the moments
and an fp32 master for those alone; a set of one steps its units in place. The optimizer's
time per rank scales with the parameters it steps (the step is one pass over them, memory-bound on
GPUs, per parameter on CPUs); its per-call cost stays.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

from hrlplan.cost.replica_sync import embedding_unit_params, node_hierarchy, unit_holders, unit_order, unit_rank_sets

MOMENT_BYTES = 8   # AdamW's two fp32 moments (memory.state_split's "optimizer")
MASTER_BYTES = 4   # the sharded optimizer's fp32 master of each value it steps


class RankParams(NamedTuple):
    held: float       # parameters of the rank's stage (each unit over its tp)
    stepped: float    # parameters its optimizer steps
    mastered: float   # of those, the values it keeps a master copy of (sharded units)


def unit_params(meta) -> Dict[str, float]:
    """Parameters per unit as the runtime cuts them (a tied head's weight is the embedding's)."""
    out = dict(embedding_unit_params(meta), final=float(meta.head_params))
    out.update({f"block{i}": float(p) for i, p in enumerate(meta.block_params)})
    return out


def rank_params(plan, meta, sharded: bool, node_of=None) -> Dict[int, RankParams]:
    """Per plan rank holding a stage: what it holds, steps and keeps masters of (module docstring).
    node_of: plan rank -> its node (None: one node)."""
    pipes = plan.as_pipelines()
    embed = list(embedding_unit_params(meta))   # the runtime's embedding units
    order = unit_order(plan.n_layer, embed)
    unit_sets, _ = unit_rank_sets(pipes, unit_holders(pipes, plan.n_layer, embed,
                                                      "embed" if meta.tied_embeddings else None), order)
    tp_of = {r: st.tp for pipe in pipes for st in pipe.stages for r in st.ranks}
    sizes = unit_params(meta)
    held: Dict[int, float] = {}
    stepped: Dict[int, float] = {}
    mastered: Dict[int, float] = {}
    for unit in order:
        for ranks, whole in unit_sets.get(unit, []):
            for r in ranks:
                mine = sizes.get(unit, 0.0) / tp_of[r]
                held[r] = held.get(r, 0.0) + mine
                if sharded and len(ranks) > 1:
                    hier = node_hierarchy(ranks, node_of) if node_of is not None else None
                    on_rail = hier is None or any(r in rail for rail in hier.rails)
                    split = len(ranks) if hier is None else len(hier.rails)
                    share = (sizes.get(unit, 0.0) if whole else mine) / split if on_rail else 0.0
                    stepped[r] = stepped.get(r, 0.0) + share
                    mastered[r] = mastered.get(r, 0.0) + share
                else:
                    stepped[r] = stepped.get(r, 0.0) + mine
    return {r: RankParams(h, stepped.get(r, 0.0), mastered.get(r, 0.0)) for r, h in held.items()}


def stepped_fraction(p: RankParams) -> float:
    """The share of its stage's parameters a rank's optimizer steps."""
    return p.stepped / p.held if p.held > 0 else 1.0


def state_bytes(p: RankParams) -> float:
    """The optimizer's state on a rank: the moments of what it steps and its masters."""
    return MOMENT_BYTES * p.stepped + MASTER_BYTES * p.mastered


def state_saving_bytes(p: RankParams) -> float:
    """What a rank keeps less than a replicated optimizer's moments for its whole stage (negative
    where it keeps more: never, for sets of two or more)."""
    return MOMENT_BYTES * p.held - state_bytes(p)
