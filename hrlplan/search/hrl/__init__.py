"""Hierarchical-RL planner: a high-level policy over configurations, a low-level policy over
stage boundaries, trained with REINFORCE and a learned baseline against the simulator."""
from hrlplan.search.hrl.agent import search_hrl

__all__ = ["search_hrl"]
