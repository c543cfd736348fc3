"""A manual plan (planner=manual planner.plan_file=...) against the run, before anything starts: the file
is a plan, it decides the batch, schedule and micro-batching (a different value typed for one of them is
refused, naming both), its depth is the model's and its world size the job's."""
from __future__ import annotations

from typing import Any, Dict

from hrlplan.errors import ConfigError
from hrlplan.plan import Plan
from hrlplan.validate.files import load_yaml_text, read_file, refuse_on

# plan field -> the train key that means the same; a manual plan decides these, so a different value
# typed on the command line would be silently ignored
PLAN_TRAIN_KEYS = {"global_batch_size": "train.global_batch_size", "schedule": "train.schedule",
                   "stages_per_rank": "train.stages_per_rank", "num_microbatches": "train.microbatches",
                   "cp": "train.context_parallel"}


def check_manual_plan(config: Dict[str, Any], explicit: set, shape: Dict[str, Any], spec: Any,
                      launching: bool) -> Any:
    """config: plain; explicit: the keys the user set; shape: the model's n_layer (model_files.model_shape);
    spec: the cluster.spec_file's ClusterSpec or None; launching: this job starts its own workers. Returns
    the plan."""
    plan = _check_plan_file(config["planner"].get("plan_file"))
    _check_plan_against_run(plan, config, explicit, shape, spec, launching)
    return plan


def _check_plan_file(plan_file: Any) -> Any:
    if not plan_file:
        raise ConfigError("planner.plan_file", None, "the path of a plan.yaml (planner=manual trains that plan)")
    path = str(plan_file)
    text = read_file("planner.plan_file", path)
    data = load_yaml_text(text, path, "planner.plan_file")
    return refuse_on("planner.plan_file", path, lambda: Plan.from_dict(data, source=path))


def _check_plan_against_run(plan: Any, config: Dict[str, Any], explicit: set, shape: Dict[str, Any],
                            spec: Any, launching: bool) -> None:
    """A manual plan decides the batch, schedule and micro-batching: a different value typed for one of
    them is refused, naming both; its depth must be the model's and its world size the job's."""
    path = config["planner"].get("plan_file")
    train = config.get("train") or {}
    for field, key in PLAN_TRAIN_KEYS.items():
        ours, theirs = train.get(key.split(".")[1]), getattr(plan, field)
        if key in explicit and ours != "auto" and str(ours) != str(theirs):
            raise ConfigError(key, ours, message=f"{key}={ours} conflicts with planner.plan_file={path}, whose "
                              f"{field} is {theirs}: the plan decides it; leave {key} out, or write a plan "
                              f"with {field}: {ours}")
    n_layer = shape.get("n_layer")
    if n_layer and plan.n_layer != n_layer:
        raise ConfigError("planner.plan_file", path, message=f"planner.plan_file={path} is a plan for {plan.n_layer} "
                          f"layers (n_layer: {plan.n_layer}, model {plan.model}) but the model has {n_layer} "
                          f"({shape['n_layer_key']}={n_layer}): re-plan for this model, or choose the plan's model")
    world, where = None, ""
    if spec is not None:
        world = spec.world_size
        where = f"cluster.spec_file={config['cluster']['spec_file']} has {world} devices"
    elif launching and (config.get("cluster") or {}).get("probe", True):
        from hrlplan.cluster import default_nproc_per_node   # why: it brings torch, as in _load_cluster_spec

        setting = config["cluster"].get("nproc_per_node", "auto")
        world = default_nproc_per_node(setting, str(train.get("device", "auto")))
        where = f"this job starts {world} worker(s) (cluster.nproc_per_node={setting})"
    if world is not None and plan.world_size != world:
        raise ConfigError("planner.plan_file", path, message=f"planner.plan_file={path} needs {plan.world_size} "
                          f"ranks but {where}: set cluster.nproc_per_node={plan.world_size} "
                          "(cluster.oversubscribe=true beyond this host's devices), or re-plan for this job")
