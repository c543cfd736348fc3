"""Random search: uniform configurations and uniform layer splits, for the benchmark's baseline."""
from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np

from hrlplan.search.common import Scored, Tracker


def random_split(rng: np.random.Generator, n_layer: int, n_stages: int):
    cuts = sorted(rng.choice(np.arange(1, n_layer), size=n_stages - 1, replace=False).tolist()) if n_stages > 1 else []
    bounds = [0] + cuts + [n_layer]
    return [(bounds[i], bounds[i + 1]) for i in range(n_stages)]


def search_random(sim, space, cfg: Dict[str, Any]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    rng = np.random.default_rng(int(cfg.get("seed", 0)))
    configs = list(space.configs())
    tracker = Tracker()
    budget = int(cfg.get("samples", 256))
    for _ in range(budget if configs else 0):
        c = configs[int(rng.integers(len(configs)))]
        layout = space.layout(c, random_split(rng, sim.meta.n_layer, c.n_stages))
        tracker.offer(Scored(layout, sim.evaluate(layout), c))
    return {"tracker": tracker, "evaluations": sim.evaluations, "configs": len(configs),
            "time_s": time.perf_counter() - t0}
