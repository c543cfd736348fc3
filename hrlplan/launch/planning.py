"""Rank 0's planning: what the job measures (probe, calibration through the cache), the planner's
settings for the model, introspection and the plan with its artifacts in the run directory, and the
checks a plan must pass before anyone trains it. Also planning without workers (a preset cluster)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from hrlplan.cluster import ClusterSpec, spec_from_preset
from hrlplan.config import ClusterConfig, Config, calibration_mode
from hrlplan.cost.lengths import LengthDistribution
from hrlplan.cost.memory import packed_meta
from hrlplan.errors import UserError
from hrlplan.families import LM_DATA, Family, family_of, family_of_meta
from hrlplan.launch import plan_cache
from hrlplan.launch.packing_prediction import packed_step_prediction
from hrlplan.launch.ranks import broadcast
from hrlplan.launch.report import log_timeline, make_logger, predicted_step
from hrlplan.model_meta import introspect
from hrlplan.plan import Plan, PlanError
from hrlplan.runtime.family_trainers import fit_check
from hrlplan.runtime.metrics import duration_text
from hrlplan.runtime.calibrate import (BUDGET_KEY, CalibrationOverBudget, budget_seconds, calibrate_in_job, is_steady,
                                       unsteady_reason, unsteady_threshold)
from hrlplan.search import make_plan
from hrlplan.search.hetero import wants_hetero
from hrlplan.search.plan_text import plan_summary

HRM_CHECKED_ENV = "HRLPLAN_HRM_CHECKED"  # set once the HRM memory warning was considered


def probes_here(cluster: ClusterConfig) -> bool:
    """The job measures its own devices (cluster=local, in-job on SLURM) rather than planning for a
    preset or a cluster.json."""
    return bool(cluster.probe) and not cluster.spec_file


def wants_calibration(config: Config) -> bool:
    """planner.calibrate: auto calibrates where a planner searches over real devices (a manual plan
    is only predicted, so it keeps peak figures unless asked); a family that is never calibrated (HRM,
    data parallel only) keeps them too."""
    mode = calibration_mode(config.planner)
    if mode == "false" or not family_of(config.arch).calibrates:
        return False
    return mode != "auto" or str(config.planner.get("name")) != "manual"


def local_device_memory(nproc: int) -> float:
    if torch.cuda.is_available():
        return float(torch.cuda.mem_get_info()[0])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(nproc, 1)


def warn_hrm_memory(config: Config, device_memory_bytes: float, world_size: int) -> Optional[str]:
    """The family's memory guide (HRM's), before anything starts: a warning (not an error) when it will not fit."""
    check = fit_check(config)
    if check is None or os.environ.get(HRM_CHECKED_ENV):
        return None
    os.environ[HRM_CHECKED_ENV] = "1"  # the workers inherit it: one warning per job
    warning = check(config, device_memory_bytes, world_size)
    if warning:
        print(f"[hrlplan] warning: {warning}", file=sys.stderr, flush=True)
    return warning


def check_world(plan, world: int) -> None:
    """The plan must use exactly the ranks this job has: a clear error before any training."""
    if plan.world_size == world:
        return
    where = f"this job has {world}"
    if os.environ.get("SLURM_JOB_ID"):
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES", "?")
        per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "?")
        where += f" (SLURM job {os.environ['SLURM_JOB_ID']}: {nodes} node(s) x {per_node} task(s) per node)"
    raise UserError(f"the plan needs {plan.world_size} ranks but {where}; re-plan for this allocation, or "
                    f"allocate {plan.world_size} ranks (hydra.launcher.nodes x hydra.launcher.tasks_per_node, or "
                    "torchrun --nnodes x --nproc-per-node)")


# ---------------------------------------------------------------- planning
def planner_settings(config: Config, family: Family) -> Dict[str, Any]:
    """The planner's settings (plain, as the search layer takes them) with the model family's limits."""
    planner = dict(config.planner)
    if not family.pipeline:
        planner["max_pp"] = 1  # HRM's recurrent H/L core runs every block many times: data parallel only
    if not family.idle_ranks:
        # a family planned from peak figures (HRM, not calibrated): a job given N ranks (its users'
        # `torchrun --nproc-per-node 8`) trains on all of them rather than on a rough guess
        planner["allow_idle_ranks"] = False
    if family.tp_plan is None:
        planner["max_tp"] = 1  # runtime/tensor_parallel.py has no plan for its blocks
    return planner


def introspect_and_plan(config: Config, spec, use_cache: bool = False):
    """Rank 0 (or a plain process): model meta and plan, with their artifacts in the run dir.

    With use_cache, a plan made earlier for the same cluster shape, model, planner and training
    settings is reused (see hrlplan/launch/plan_cache.py): a requeued job trains the plan it started with."""
    run_dir = Path(config.run_dir)
    seq_len = config.data.seq_len if family_of(config.arch).data_kind == LM_DATA else None
    meta = introspect(config.arch, seq_len=seq_len)
    meta.save(run_dir / "model_meta.json")
    planner = config.planner
    if str(planner.get("name")) == "manual" and planner.get("plan_file") and spec.source in ("probe", "file"):
        try:
            check_world(Plan.load(planner["plan_file"]), spec.world_size)  # before simulating it on this cluster
        except (OSError, PlanError):
            pass  # make_plan reports a missing or invalid file in its own words
    key = plan_cache.cache_key(config, spec) if use_cache and plan_cache.cacheable(config) else None
    cached = plan_cache.load(config, key) if key else None
    if cached is not None:
        plan, info = cached
        info.setdefault("planner", {})["reused_from_cache"] = key
    else:
        try:
            # a packed-documents run holds one more tensor per block (cost/memory.packed_meta); the saved
            # model_meta.json stays plain: the trainer adds the same term to its own prediction
            packed = seq_len is not None and plan_cache.packs_documents(config)
            search_meta = packed_meta(meta) if packed else meta
            settings = planner_settings(config, family_of_meta(meta))
            if packed and str(config.data.name) == "code" and not wants_hetero(settings, spec):
                # exact re-ranks its fastest candidates by the corpus's packed step (the replica-template
                # searches reuse these settings, and re-ranking each template would be slow)
                lengths = LengthDistribution.of_corpus(str(config.data.path or "data/code"), int(seq_len))
                if lengths is not None:
                    settings["packed_lengths"] = dict(lengths.to_dict(), packing=str(config.data.packing.value))
            plan, info = make_plan(search_meta, spec, settings, config.train)
        except PlanError as e:
            raise UserError(str(e)) from None
        if key and (is_steady(spec.calibration) or not plan_cache.shared()):
            # a plan from an unsteady calibration stays in this run's own cache (a requeued job trains
            # the plan it started with), out of a cache that other runs share
            plan_cache.store(config, key, plan, info)
    facts = calibration_facts(spec)
    if facts is not None:
        info["calibration"] = facts
    if seq_len is not None:   # data.packing=document|balanced: the plan's step from the corpus's lengths
        packed = packed_step_prediction(config, meta, spec, plan, planner_settings(config, family_of_meta(meta)))
        if packed is not None:
            info["packing"] = packed
    plan.save(run_dir / "plan.yaml")
    (run_dir / "plan_info.json").write_text(json.dumps(info, indent=1, default=str))
    return plan, info, meta


def calibrated(config: Config, spec):
    """Collective: the spec with its calibration, the cached one for this cluster shape, model and
    settings when there is one (a requeued job, a sweep: see hrlplan/launch/plan_cache.py), else measured
    now on every rank -- within planner.calibrate_budget_s, its progress on the console -- and cached
    when the machine held steady (hrlplan.runtime.calibrate.record.assess). An unsteady calibration plans
    this job only; one past its budget leaves peak figures. Both say so on the console and in plan_info.json."""
    rank = dist.get_rank()
    refresh = calibration_mode(config.planner) == "refresh"
    budget = check_calibration_settings(config)   # a bad value: the same one-line error on every rank
    key = plan_cache.calibration_key(config, spec) if rank == 0 else None
    cached = plan_cache.load_calibration(config, key) if rank == 0 and not refresh else None
    if broadcast(cached is not None):
        if rank == 0:   # only rank 0 plans; the others hold no spec, as without calibration
            print(reuse_calibration(config, key, spec, cached), flush=True)
        return spec
    if rank == 0:
        print(f"[hrlplan] calibrating: timing blocks, pipeline hops and collectives on the {spec.world_size} "
              f"workers, at most {budget:g} s ({BUDGET_KEY}); once per cluster shape and model, cached when the "
              "machine holds steady", flush=True)
    t0 = time.time()
    try:
        measured = calibrate_in_job(spec, config.arch, config.train, config.data, planner=config.planner)
    except CalibrationOverBudget as over:
        if rank == 0:
            plan_cache.release_calibration(config, key)
            spec.calibration = {"steadiness": {"steady": False, "over_budget": str(over)}}
            print(f"[hrlplan] warning: {over}; planning from peak FLOP/s and probed links, nothing cached: raise "
                  f"{BUDGET_KEY} to let it finish, or planner.calibrate=false to skip it", flush=True)
        return spec
    if rank == 0:
        _keep_calibration(config, key, measured.calibration, time.time() - t0, refresh, plan_cache.probe_links(spec))
    return measured


def reuse_calibration(config: Config, key: str, spec, cached: Dict[str, Any]) -> str:
    """Rank 0: spec takes the cached calibration and the links probed with it (this run's own probe
    of them is noise against the cached bandwidth_efficiency: see plan_cache); the console line."""
    spec.calibration = cached
    links = plan_cache.load_calibration_links(config, key)
    probed = _median_bandwidth(spec) if spec.world_size > 1 else None
    if probed is None:
        how = ""
    elif links is not None and plan_cache.adopt_links(spec, links):
        how = (f" and the links probed with it (this run's probe: bandwidth {probed / _median_bandwidth(spec):.2g}x "
               "theirs, not used)")
    else:   # an entry stored without them, or measured on other hosts (another allocation of the nodes)
        how = " with this run's probed links"
    return (f"[hrlplan] planning from the cached calibration {plan_cache.calibration_dir(config) / key}{how} "
            "(planner.calibrate=refresh measures again, false plans from peak figures)")


def _median_bandwidth(spec) -> float:
    ranks = range(spec.world_size)
    return statistics.median(spec.bw(a, b) for a in ranks for b in ranks if a != b)


def check_calibration_settings(config: Config) -> float:
    """planner.calibrate_budget_s (returned) and $HRLPLAN_CALIBRATION_MAX_SPREAD, each refused in one line
    naming it when it is not a number calibration can use. Cheap, no worker needed: the launcher may
    call it before any starts."""
    unsteady_threshold()
    return budget_seconds(config.planner)


def _keep_calibration(config: Config, key: str, calibration: Dict[str, Any], took_s: float, refresh: bool,
                      links: Optional[Dict[str, Any]] = None) -> None:
    """Rank 0: cache a steady calibration with the probe's links it was fitted against and say where
    (or why it could not); an unsteady one is used for this plan only, and the console says why."""
    where = plan_cache.calibration_dir(config) / key
    if not is_steady(calibration):
        plan_cache.release_calibration(config, key, drop=refresh)
        print(f"[hrlplan] warning: calibrated in {took_s:.1f} s, but unsteady -- "
              f"{unsteady_reason(calibration['steadiness'])}; a busy node? This plan uses it, nothing is cached"
              + (" (and the entry refresh was to replace is removed)" if refresh else "")
              + ": the next run measures again (planner.calibrate=false plans from peak figures)", flush=True)
        return
    why = plan_cache.store_calibration(config, key, calibration, replace=refresh, links=links)
    print(f"[hrlplan] calibrated in {took_s:.1f} s; " + (f"cached in {where}" if why is None else
          f"could not cache it in {where} ({why}); the next run measures again "
          f"(${plan_cache.CALIBRATION_CACHE_ENV} names a writable cache)"), flush=True)


def calibration_facts(spec) -> Optional[Dict[str, Any]]:
    """plan_info.json's "calibration": what the plan was costed from -- steady measurements, an
    unsteady one (used once, not cached), a calibration stopped at its budget (peak figures) -- or
    None without calibration."""
    cal = getattr(spec, "calibration", None) or {}
    if not cal:
        return None
    verdict = cal.get("steadiness")
    if verdict is None:
        return {"steady": None, "note": "a calibration without a steadiness verdict (written by hand or by an "
                                        "older version): taken as it is"}
    facts = {k: verdict.get(k) for k in ("steady", "worst", "worst_spread", "threshold") if k in verdict}
    if verdict.get("over_budget"):
        facts["note"] = f"{verdict['over_budget']}: planned from peak FLOP/s and probed links"
    elif not verdict.get("steady"):
        facts["note"] = f"planned from an unsteady measurement ({unsteady_reason(verdict)}); not cached"
    return facts


def announce_workers(config: Config, nproc: int) -> str:
    """The parent's line before its workers start: their imports and rendezvous take 3-5 s on a quiet
    2-core machine and 17 s on a busy one, before the first of them can say anything."""
    first = "probe this machine" + (", then calibrate or reuse the cached calibration" if wants_calibration(config)
                                    else "")
    line = f"[hrlplan] starting {nproc} worker{'s' if nproc != 1 else ''}: they {first}, then plan"
    print(line, flush=True)
    return line


def plan_only(config: Config) -> Dict[str, Any]:
    """mode=plan or a preset cluster: plan in this process and stop (nothing to train here)."""
    run_dir = Path(config.run_dir)
    c = config.cluster
    spec = ClusterSpec.load(c.spec_file) if c.spec_file else spec_from_preset(c)
    spec.save(run_dir / "cluster.json")
    plan, info, meta = introspect_and_plan(config, spec)
    print(f"[hrlplan] planned for {spec.summary()}: {plan.layout()}, {plan_summary(plan)} "
          f"(predicted step {duration_text(info.get('chosen', {}).get('step_time_s'))}); "
          f"wrote {run_dir / 'plan.yaml'}. Nothing is trained for a preset cluster: run on the cluster itself.",
          file=sys.stderr)
    if str(config.logger.mode) != "disabled":
        logger = make_logger(config, 0, spec, plan, job_type="plan")
        log_timeline(logger, run_dir, None)
        logger.summary({"plan/predicted_step_time_s": predicted_step(plan)})
        logger.finish()
    return {"plan": plan.to_dict()}


