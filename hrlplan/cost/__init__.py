"""Cost model: predicts a plan's step time (with a breakdown) and peak memory per device, or why
it cannot run. `Simulator(meta, cluster, CostOptions(...)).evaluate(Layout(...), detail=True)`.

cluster.calibration keys read here: see hrlplan.cost.model.CALIBRATION_KEYS.
"""
from hrlplan.cost.model import CALIBRATION_KEYS, CostOptions, Layout
from hrlplan.cost.simulator import SimResult, Simulator, simulate
from hrlplan.cost.plans import layout_of_plan, options_for_train, predict_any_plan

__all__ = ["CALIBRATION_KEYS", "CostOptions", "Layout", "SimResult", "Simulator", "simulate", "layout_of_plan",
           "options_for_train", "predict_any_plan"]
