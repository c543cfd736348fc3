"""`hrlplan train-hrl | plan-hrl | show-plan` (argparse namespaces from hrlplan/cli.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hrlplan.cost.simulator import Simulator
from hrlplan.errors import UserError
from hrlplan.plan import Plan
from hrlplan.search import make_plan
from hrlplan.search.common import Tracker, cost_options
from hrlplan.search.hrl.agent import PlanningEnv, initial_policy, train_on
from hrlplan.search.hrl.policy import save_policy
from hrlplan.search.instances import load_cluster, load_meta, planner_and_train_cfg
from hrlplan.search.plan_text import (cluster_device_count, idle_lines, layout_summary, plan_degrees,
                                      plan_micro_batching, plan_summary, rewrite_old_notation)
from hrlplan.search.space import SearchSpace

GiB = 2 ** 30
# show-plan's breakdown: (key in the simulator's breakdown, what it is called)
BREAKDOWN_NAMES = (("compute_s", "compute"), ("tp_comm_s", "tensor-parallel comm"), ("p2p_comm_s", "pipeline sends"),
                   ("dp_comm_s", "gradient all-reduce"), ("dp_comm_exposed_s", "of it exposed"),
                   ("dp_collectives_s", "FSDP collectives"), ("optimizer_s", "optimizer"),
                   ("step_collectives_s", "per-step all-reduces"), ("step_overhead_s", "step overhead"),
                   ("bubble_s", "bubble"))


def _inputs(args, name="hrl"):
    cluster = load_cluster(args.cluster)
    meta = load_meta(args.model_meta)
    planner_cfg, train_cfg = planner_and_train_cfg(args.planner_cfg, name)
    return cluster, meta, planner_cfg, train_cfg


def train_hrl(args) -> None:
    cluster, meta, cfg, train = _inputs(args)
    cfg = dict(cfg, checkpoint_dir=None)
    sim = Simulator(meta, cluster, cost_options(cfg, train))
    env = PlanningEnv(sim, SearchSpace(meta, cluster, cfg, train))
    seed = int(cfg["seed"])
    gen = torch.Generator().manual_seed(seed)
    policy, source = initial_policy(cfg)
    tracker = Tracker()
    t0 = time.perf_counter()
    train_on(env, policy, cfg, tracker, int(cfg["train_steps"]), gen, progress=bool(cfg.get("progress", True)))
    best = tracker.best
    summary = {"model": meta.name, "cluster": cluster.summary(), "started_from": source,
               "train_steps": cfg["train_steps"], "evaluations": sim.evaluations,
               "train_time_s": round(time.perf_counter() - t0, 3),
               "best_step_time_s": best.time if best else None, "best": layout_summary(best.layout) if best else None}
    path = save_policy(policy, args.out_dir, extra={"model": meta.name, "cluster": cluster.name})
    summary["checkpoint"] = str(path)
    print(json.dumps(summary, indent=1))


def plan_hrl(args) -> None:
    cluster, meta, cfg, train = _inputs(args)
    explicit = set()
    if args.planner_cfg:
        import yaml

        data = yaml.safe_load(Path(args.planner_cfg).read_text()) or {}
        explicit = set(data.get("planner", data))
    if args.checkpoint_dir:
        if not Path(args.checkpoint_dir).exists():
            raise UserError(f"--checkpoint-dir {args.checkpoint_dir} does not exist; train one with `hrlplan train-hrl`")
        cfg["checkpoint_dir"] = args.checkpoint_dir
        if "train_steps" not in explicit:
            cfg["train_steps"] = 0  # a trained policy plans directly
    cfg["name"] = "hrl"
    plan, info = make_plan(meta, cluster, cfg, train)
    plan.save(args.out)
    Path(args.out_info).write_text(json.dumps(info, indent=1))
    p = plan.meta["predicted"]
    print("\n".join([plan.layout(), plan_summary(plan), *idle_lines(plan, cluster.world_size),
                     f"predicted step {p['step_time_s'] * 1e3:.4g} ms, bubble {p['bubble_fraction']:.1%}; "
                     f"wrote {args.out} and {args.out_info}"]))


def plan_path(arg: str) -> Path:
    """show-plan's argument: a plan.yaml, or a run directory holding one."""
    path = Path(arg)
    if path.is_dir():
        if (path / "plan.yaml").is_file():
            return path / "plan.yaml"
        raise UserError(f"{arg} is a directory without a plan.yaml: give a plan file (a run directory's plan.yaml, "
                        "or one written by `hrlplan plan-hrl`)")
    if not path.exists():
        raise UserError(f"{arg} does not exist: give a plan.yaml (or a run directory holding one); write one with "
                        "`hrlplan plan-hrl` or `python pretrain.py mode=plan`")
    return path


def _load_info(path: Path, explicit: bool):
    """plan_info.json: --info's, or the one beside the plan (None when there is none)."""
    if not path.exists():
        if explicit:
            raise UserError(f"--info {path} does not exist: give the plan_info.json written beside the plan")
        return None
    if path.is_dir():
        raise UserError(f"--info {path} is a directory: give the plan_info.json file written beside the plan")
    try:
        info = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
        raise UserError(f"{path} is not valid JSON ({' '.join(str(e).split())[:120]}): it should be the "
                        "plan_info.json written with the plan; replace it, or move it away to show the plan "
                        "alone") from None
    if not isinstance(info, dict):
        raise UserError(f"{path}: expected a JSON object (a plan_info.json), got {type(info).__name__}")
    return info


def show_plan(args) -> None:
    path = plan_path(args.plan)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path} cannot be read as a plan ({' '.join(str(e).split())[:120]}): give a plan.yaml") from None
    plan = Plan.from_yaml(text, source=str(path))
    info = _load_info(Path(args.info) if args.info else path.with_name("plan_info.json"), explicit=bool(args.info))
    print(render(plan, info))


def breakdown_text(breakdown) -> str:
    """`compute 7.98 ms, gradient all-reduce 3.17 ms, of it exposed 0 ms, ...` (zero terms left out,
    except the exposed share of an all-reduce, which says it is hidden)."""
    shown = [(name, breakdown[key]) for key, name in BREAKDOWN_NAMES if key in breakdown
             and (breakdown[key] or (key == "dp_comm_exposed_s" and breakdown.get("dp_comm_s")))]
    return ", ".join(f"{name} {value * 1e3:.3g} ms" for name, value in shown)


def render(plan: Plan, info=None) -> str:
    launch = plan.meta.get("launch", {})
    pred = plan.meta.get("predicted", {})
    lines = [plan.layout(),
             f"{plan.model}: {plan_degrees(plan)}, {plan_micro_batching(plan)} (global batch {plan.global_batch_size}), "
             f"{plan.schedule}, {plan.stages_per_rank} stage(s)/rank; launch "
             f"{launch.get('nnodes', 1)} node(s) x {launch.get('nproc_per_node', plan.world_size)} procs"]
    if pred:
        lines.append(f"predicted step {pred.get('step_time_s', 0) * 1e3:.4g} ms, bubble {pred.get('bubble_fraction', 0):.1%}")
    stage_info = {s["stage"]: s for s in (info or {}).get("chosen", {}).get("stages", [])}
    mem = pred.get("memory_bytes_per_rank") or []
    lines += idle_lines(plan, cluster_device_count(info))
    header = f"{'stage':>5} {'blocks':>10} {'n':>3} {'tp':>3} {'dp':>3} {'recompute':>9} {'ranks':>14} " \
             f"{'device':>12} {'fwd ms':>9} {'bwd ms':>9} {'mem GiB':>8}  memory split GiB"
    lines += ["", header, "-" * len(header)]
    for i, s in enumerate(plan.stages):
        si = stage_info.get(i, {})
        ranks = f"{min(s.ranks)}-{max(s.ranks)}" if len(s.ranks) > 1 else str(s.ranks[0])
        peak = max((mem[r] for r in s.ranks if r < len(mem)), default=0) / GiB
        split = dict(si.get("static_split_bytes") or {})
        if "activation_peak_with_grads" in si or "activation_bytes_per_microbatch" in si:
            split["activations"] = si.get("peak_memory_bytes", 0) - si.get("static_bytes", 0)
        split_text = " ".join(f"{k} {v / GiB:.2f}" for k, v in split.items() if v)
        lines.append(f"{i:>5} {s.token():>10} {s.num_layers:>3} {s.tp:>3} {s.dp:>3} {s.recompute:>9} {ranks:>14} "
                     f"{str(si.get('device_type', '?'))[:12]:>12} {si.get('fwd_s', float('nan')) * 1e3:>9.3f} "
                     f"{si.get('bwd_s', float('nan')) * 1e3:>9.3f} {peak:>8.2f}  {split_text}")
    if info:
        b = info.get("chosen", {}).get("breakdown", {})
        if b:
            lines.append("")
            lines.append("breakdown: " + breakdown_text(b))
        why = (info.get("why") or {}).get("text")
        if why:
            lines += ["", "why: " + rewrite_old_notation(why)]
    else:
        lines += ["", "(no plan_info.json beside the plan: no breakdown or runner-up to show)"]
    return "\n".join(lines)
