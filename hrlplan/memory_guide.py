"""`hrlplan memory-guide`: what fits a device's memory, computed by the memory model.

    hrlplan memory-guide arch=hrm [global_batch_size=768] [--memory-gib 8,24] [--world-size 1]
    hrlplan memory-guide arch=gpt2 planner=manual planner.plan_file=plan.yaml [cluster=a100x8-1n | --cluster cluster.json]

HRM: for 2, 4, 8, 16, 24, 40 and 80 GiB (or the sizes given, and the probed GPU's free memory), the
largest arch.hidden_size with H_layers/L_layers (up to the arch's own) that trains with a global
batch of at least MIN_BATCH, the largest global_batch_size (up to HRM's 768) it then fits, and the predicted peak
(models.hrm.estimate_hrm_memory: its tensors are within 10% of the measured peak on the CPU).
Language models: for each stage of a plan and each recompute mode, the largest micro-batch size
that fits the stage's devices by the simulator (the plan's other stages as they are).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from hrlplan.cluster import ClusterSpec, spec_from_preset
from hrlplan.compose import compose
from hrlplan.config import Config, typed
from hrlplan.cost.memory import RECOMPUTE_MODES
from hrlplan.cost.plans import options_for_train, predict_any_plan
from hrlplan.errors import UserError
from hrlplan.families import LM_DATA, family_of
from hrlplan.model_meta import introspect
from hrlplan.models.hrm import estimate_hrm_memory
from hrlplan.plan import Plan

GiB = 2 ** 30
BUDGETS_GIB = (2, 4, 8, 16, 24, 40, 80)
HIDDEN_SIZES = (64, 128, 256, 384, 512, 768, 1024)   # 512: HRM's hrm_v1
LAYERS = (1, 2, 4, 6, 8)                              # H_layers = L_layers; 4: HRM's
BATCHES = (768, 512, 384, 256, 128, 64, 32, 16, 8, 4, 2, 1)   # 768: HRM's cfg_pretrain
MIN_BATCH = 64


def hrm_candidates(arch: Dict[str, Any]) -> List[Dict[str, Any]]:
    """HRM shapes from small to large (parameters grow along the list), up to the arch's own width
    and depth (HRM's 512 and 4 by default): 64-wide heads, the arch's expansion."""
    top_hidden = int(arch.get("hidden_size", 512))
    top_layers = int(max(arch.get("H_layers", 4), arch.get("L_layers", 4)))
    out = []
    for hidden in [h for h in HIDDEN_SIZES if h < top_hidden] + [top_hidden]:
        for layers in [n for n in LAYERS if n < top_layers] + [top_layers]:
            out.append(dict(arch, hidden_size=hidden, num_heads=max(1, hidden // 64), puzzle_emb_ndim=hidden,
                            H_layers=layers, L_layers=layers))
    return sorted(out, key=lambda a: (a["hidden_size"] ** 2 * a["H_layers"], a["hidden_size"]))


def hrm_fit(arch: Dict[str, Any], budget_bytes: float, world_size: int = 1, cuda: bool = True,
            seq_len: Optional[int] = None, max_batch: int = BATCHES[0]) -> Optional[Dict[str, Any]]:
    """The largest shape of hrm_candidates with a global batch >= MIN_BATCH that fits, and its largest
    batch; failing that, the smallest shape with the largest batch that fits; None if nothing does."""
    def largest_batch(candidate) -> Optional[tuple]:
        for batch in (b for b in BATCHES if b <= max_batch and b % world_size == 0):
            est = estimate_hrm_memory(candidate, batch, world_size, seq_len, cuda=cuda)
            if est["total"] <= budget_bytes:
                return batch, est
        return None

    candidates = hrm_candidates(arch)
    best = None
    for candidate in candidates:
        est = estimate_hrm_memory(candidate, max(MIN_BATCH, world_size), world_size, seq_len, cuda=cuda)
        if est["total"] > budget_bytes:
            continue   # larger shapes may still fit with fewer layers: keep looking
        best = candidate
    if best is None:
        best = candidates[0]
    found = largest_batch(best)
    if found is None:
        return None
    batch, est = found
    return dict(hidden_size=best["hidden_size"], H_layers=best["H_layers"], L_layers=best["L_layers"],
                num_heads=best["num_heads"], global_batch_size=batch, peak_bytes=est["total"],
                tensor_bytes=est["tensors"])


def probed_free_bytes() -> Optional[float]:
    """The current GPU's free memory (what a run started now could use), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return float(free)


def hrm_table(arch: Dict[str, Any], budgets_gib: Sequence[float], world_size: int = 1,
              seq_len: Optional[int] = None, max_batch: int = BATCHES[0]) -> List[Dict[str, Any]]:
    rows = []
    for gib in budgets_gib:
        fit = hrm_fit(arch, gib * GiB, world_size, True, seq_len, max_batch)
        rows.append(dict(budget_gib=gib, **(fit or {})))
    return rows


def format_hrm(rows: Iterable[Dict[str, Any]], world_size: int) -> str:
    lines = [f"HRM settings that fit per GPU ({world_size} data-parallel rank(s); bfloat16 forward, AdamATan2, "
             f"{100 * 0.2:.0f}% allocator slack and the CUDA context included):",
             f"{'memory':>9}  {'arch.hidden_size':>16}  {'H_layers/L_layers':>17}  {'num_heads':>9}  "
             f"{'global_batch_size':>17}  {'predicted peak':>14}"]
    for r in rows:
        if "hidden_size" not in r:
            lines.append(f"{r['budget_gib']:>6.1f} GiB  nothing fits")
            continue
        lines.append(f"{r['budget_gib']:>6.1f} GiB  {r['hidden_size']:>16}  {r['H_layers']:>8}/{r['L_layers']:<8}  "
                     f"{r['num_heads']:>9}  {r['global_batch_size']:>17}  {r['peak_bytes'] / GiB:>10.2f} GiB")
    return "\n".join(lines)


# ---------------------------------------------------------------- language models: a plan's stages
def lm_stage_limits(plan, meta, cluster, opts) -> List[Dict[str, Any]]:
    """Per stage and recompute mode: the largest micro-batch size (a divisor of the replica's rows)
    with which the plan fits, that stage switched to the mode and the others as they are."""
    rows_per_replica = plan.microbatch_size * plan.num_microbatches
    sizes = sorted((s for s in range(1, rows_per_replica + 1) if rows_per_replica % s == 0), reverse=True)
    out = []
    for k, stage in enumerate(plan.stages):
        row: Dict[str, Any] = {"stage": k, "layers": list(stage.layers), "now": stage.recompute}
        for mode in RECOMPUTE_MODES:
            stages = [dataclasses.replace(s, recompute=mode) if i == k else s for i, s in enumerate(plan.stages)]
            row[mode] = None
            for mbs in sizes:
                trial = dataclasses.replace(plan, stages=stages, microbatch_size=mbs,
                                            num_microbatches=rows_per_replica // mbs)
                result = predict_any_plan(trial, meta, cluster, opts)
                if result["feasible"]:
                    mem = result["memory_bytes_per_rank"]
                    row[mode] = {"microbatch_size": mbs, "peak_bytes": max(mem[r] for r in stage.ranks)}
                    break
        out.append(row)
    return out


def format_lm(rows: Iterable[Dict[str, Any]]) -> str:
    lines = ["largest micro-batch size per stage and recompute mode (predicted peak of the stage's ranks):"]
    for r in rows:
        cells = []
        for mode in ("none", "selective", "full"):
            fit = r.get(mode)
            fits = f"{fit['microbatch_size']} ({fit['peak_bytes'] / GiB:.2f} GiB)" if fit else "none fits"
            cells.append(f"{mode}: {fits}")
        lines.append(f"  stage {r['stage']} layers {r['layers'][0]}-{r['layers'][1] - 1} (now {r['now']}): "
                     + ", ".join(cells))
    return "\n".join(lines)


def _lm_guide(cfg: Config, cluster_file: Optional[str]) -> str:
    plan_file = (cfg.planner or {}).get("plan_file")
    if not plan_file:
        raise UserError("memory-guide for a language model needs a plan: planner.plan_file=<plan.yaml>")
    if cluster_file:
        cluster = ClusterSpec.load(cluster_file)
    elif cfg.cluster.node_groups:
        cluster = spec_from_preset(cfg.cluster)
    else:
        raise UserError("memory-guide needs the devices: cluster=<preset> or --cluster <cluster.json> "
                        "(hrlplan probe-cluster writes one)")
    meta = introspect(cfg.arch, seq_len=cfg.data.seq_len)
    plan = Plan.load(plan_file)
    return format_lm(lm_stage_limits(plan, meta, cluster, options_for_train(cfg.train, cfg.planner)))


def _sizes(text: str) -> List[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes in GiB separated by commas, e.g. 8,24") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive GiB")
    return sizes


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="hrlplan memory-guide", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*",
                   help="config overrides: arch=hrm, global_batch_size=..., planner=manual planner.plan_file=...")
    p.add_argument("--memory-gib", type=_sizes, default=None,
                   help=f"device sizes in GiB, comma-separated (default {','.join(map(str, BUDGETS_GIB))})")
    p.add_argument("--world-size", type=int, default=1, help="HRM: data-parallel ranks sharing the batch")
    p.add_argument("--cluster", default=None, help="language models: a cluster.json instead of cluster=<preset>")
    args = p.parse_args(argv)
    cfg = typed(compose(args.overrides))
    if family_of(cfg.arch).data_kind == LM_DATA:   # a language model's plan; HRM's guide below
        print(_lm_guide(cfg, args.cluster))
        return
    budgets = list(args.memory_gib or BUDGETS_GIB)
    free = probed_free_bytes()
    if free is not None and not args.memory_gib:
        budgets.append(round(free / GiB, 1))
        print(f"this GPU has {free / GiB:.1f} GiB free (the last row)")
    explicit = any(o.split("=")[0].lstrip("+") in ("global_batch_size", "train.global_batch_size")
                   for o in args.overrides)
    max_batch = int(cfg.train.global_batch_size) if explicit else BATCHES[0]
    print(format_hrm(hrm_table(cfg.arch, budgets, args.world_size, max_batch=max_batch), args.world_size))


if __name__ == "__main__":
    main()
