"""The CPU work of a worker under a CPU quota (cost/quota_cpu.py): what calibration measures of it on
each rank in CPU time -- torch's pipeline schedule beyond the forwards and backwards, each all-reduce,
the reference step's overhead -- and how the bound on a capped position's step counts it. No timed
asserts: the fits read synthetic measurements, the one real run checks what is recorded, not how fast."""
import inspect
from types import SimpleNamespace

import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.cost import quota_cpu
from hrlplan.cost import simulator as simulator_module
from hrlplan.cost.model import Layout
from hrlplan.cost.simulator import Simulator, _StepRun
from hrlplan.model_meta import introspect, resolve_arch

ALLREDUCE = [{"ranks": 2, "cpu_s": 1e-4, "cpu_s_per_byte": 1e-9}, {"ranks": 3, "cpu_s": 2e-4, "cpu_s_per_byte": 2e-9}]


def _cluster(names, quota=None, **extra):
    devs = [DeviceInfo(rank=i, node=0, local_rank=i, hostname="n0", kind="cpu", name=n, memory_bytes=64 * 2 ** 30,
                       peak_flops=1e11, peak_dtype="fp32") for i, n in enumerate(names)]
    cal = {"compute_efficiency": {n: 0.5 for n in names}, "peak_flops": {n: 1e11 for n in names},
           "half_saturation_tokens": {n: 8.0 for n in names}, "step_overhead_s": 2e-3,
           "optimizer_s_per_block": {"plain": 1e-4, "sharded": 1e-4}, **extra}
    if quota is not None:
        cal[quota_cpu.QUOTA_CPU_KEY] = {n: quota for n in set(names)}
    return ClusterSpec(name="t", devices=devs, backend="gloo", source="probe", intra_node_bw=[1e10], calibration=cal)


def _pp3(m=4):
    return Layout(spans=((0, 4), (4, 5), (5, 6)), groups=((0,), (1,), (2,)), tp=1, dp=1, microbatch_size=1,
                  num_microbatches=m, schedule="1f1b")


def _run(cluster, layout):
    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    run = _StepRun(Simulator(meta, cluster), layout)
    run.simulate_pipeline(None)
    return run, run.position_totals(), meta


NAMES = ["cpu", "cpu@0.33", "cpu@0.33"]


def test_without_quota_figures_a_capped_position_counts_compute_optimizer_and_overhead_as_before():
    run, t, _ = _run(_cluster(NAMES), _pp3())
    work = quota_cpu.position_work(run, t)
    assert set(work) == {1, 2} and all(share == pytest.approx(0.33) for _, share in work.values())
    alone = run.durations(run.stage_costs_at(1.0))
    for pos in (1, 2):
        before = 4 * (alone[0][pos] + alone[1][pos] + alone[2][pos]) + (t.optimizer[pos] + run.ov.step) / max(
            run.ov.contention, 1.0)
        assert work[pos][0] == pytest.approx(before)
    assert quota_cpu.position_bounds(run, t) == pytest.approx([w / 0.33 for w, _ in work.values()])


def test_the_schedules_machinery_and_the_steps_collectives_count_per_micro_batch_and_per_call():
    plain, t0, _ = _run(_cluster(NAMES), _pp3())
    base = quota_cpu.position_work(plain, t0)
    figures = {"pipeline_per_microbatch": 5e-4, "allreduce": ALLREDUCE}
    run, t, meta = _run(_cluster(NAMES, figures), _pp3())
    work = quota_cpu.position_work(run, t)
    loss, norm = 2 * (2e-4 + 4 * 2e-9), 2e-4 + 4 * 2e-9            # the loss and the step's barrier over the world's
    # 3 ranks, the gradient norm over the 3 stages
    tied = 1e-4 + meta.head_matmul_params * 4.0 * 1e-9            # the last stage and the first: tied embedding
    assert work[1][0] - base[1][0] == pytest.approx(4 * 5e-4 + loss + norm)
    assert work[2][0] - base[2][0] == pytest.approx(4 * 5e-4 + loss + norm + tied)
    more = quota_cpu.position_work(*_run(_cluster(NAMES, figures), _pp3(m=8))[:2])
    assert more[1][0] - work[1][0] > 4 * 5e-4   # four more micro-batches: their compute and machinery


def test_the_reference_steps_overhead_and_optimizer_in_cpu_time_replace_the_wall_time_ones():
    figures = {"allreduce": [], "step_overhead": 1e-4, "optimizer_scale": 0.25}
    run, t, _ = _run(_cluster(NAMES, figures), _pp3())
    plain, t0, _ = _run(_cluster(NAMES, {"allreduce": []}), _pp3())
    gained = quota_cpu.position_work(plain, t0)[1][0] - quota_cpu.position_work(run, t)[1][0]
    contention = max(plain.ov.contention, 1.0)
    assert gained == pytest.approx(plain.ov.step / contention - 1e-4 + 0.75 * t0.optimizer[1] / contention)


def test_an_allreduce_beyond_the_largest_group_measured_grows_with_the_rings_steps_and_buckets_cut_calls():
    fig = {"allreduce": ALLREDUCE}
    assert quota_cpu.allreduce_cpu_s(fig, 1, 1e6) == 0.0
    assert quota_cpu.allreduce_cpu_s(fig, 2, 1000) == pytest.approx(1e-4 + 1e-6)
    assert quota_cpu.allreduce_cpu_s(fig, 5, 1000) == pytest.approx(2.0 * (2e-4 + 2e-6))
    assert quota_cpu.allreduce_cpu_s({}, 3, 1000) == 0.0
    one = quota_cpu.gradient_sync_cpu_s(fig, 2, 1000, bucket_bytes=1000)
    three = quota_cpu.gradient_sync_cpu_s(fig, 2, 2500, bucket_bytes=1000)
    assert one == pytest.approx(1e-4 + 1e-6) and three == pytest.approx(3 * 1e-4 + 2500 * 1e-9)


def test_a_capped_replicas_cross_replica_reduce_joins_its_bound():
    cluster = _cluster(NAMES, {"allreduce": ALLREDUCE})
    results = [SimpleNamespace(breakdown={"quota_cpu_work": []}),
               SimpleNamespace(breakdown={"quota_cpu_work": [{"position": 0, "devices": [1], "work_s": 3e-3,
                                                              "share": 0.33}]}),
               SimpleNamespace(breakdown={"quota_cpu_work": [{"position": 0, "devices": [2], "work_s": 2e-3,
                                                              "share": 0.33}]})]
    buckets = [((0, 1, 2), 1e6), ((0, 1), 1e5)]   # (plan ranks, bytes) per all-reduce, as sync_buckets cuts them
    bounds = quota_cpu.replica_bounds(cluster, results, buckets, [0, 1, 2])
    assert bounds == pytest.approx([(3e-3 + 2e-4 + 2e-3 + 1e-4 + 1e-4) / 0.33, (2e-3 + 2e-4 + 2e-3) / 0.33])
    assert quota_cpu.replica_bounds(cluster, results[:1], buckets[1:], [0, 1, 2]) == []
    # packing the gradients into the buckets and back: per byte of each bucket the rank takes part in
    packed = _cluster(NAMES, {"allreduce": ALLREDUCE, "gradient_bucket_cpu_s_per_byte": 1e-9})
    more = quota_cpu.replica_bounds(packed, results, buckets, [0, 1, 2])
    assert [m - b for m, b in zip(more, bounds)] == pytest.approx([(1e6 + 1e5) * 1e-9 / 0.33, 1e6 * 1e-9 / 0.33])


def _call_site_applied() -> bool:
    return "quota_cpu.position_work" in inspect.getsource(simulator_module)


@pytest.mark.skipif(not _call_site_applied(), reason="simulator.cpu_quota_bounds does not call cost/quota_cpu yet "
                                                    "(H3's call-site diff)")
def test_the_simulator_bounds_a_capped_step_by_its_cpu_work_over_its_share():
    figures = {"pipeline_per_microbatch": 2e-3, "allreduce": ALLREDUCE}
    meta = introspect(resolve_arch("gpt2-tiny"), seq_len=64)
    capped = Simulator(meta, _cluster(NAMES, figures)).evaluate(_pp3(), detail=True)
    free = Simulator(meta, _cluster(["cpu"] * 3)).evaluate(_pp3(), detail=True)
    run, t, _ = _run(_cluster(NAMES, figures), _pp3())
    assert capped.step_time_s == pytest.approx(max([free.step_time_s] + quota_cpu.position_bounds(run, t)), rel=1e-6)
    assert capped.step_time_s > free.step_time_s
    assert [e["devices"] for e in capped.breakdown["quota_cpu_work"]] == [[1], [2]]


# ---------------------------------------------------------------- what calibration measures and fits
def _capped_spec(names):
    devices = [DeviceInfo(rank=r, node=0, local_rank=r, hostname="h", kind="cpu", name=n, memory_bytes=2**33,
                          peak_flops=1e10) for r, n in enumerate(names)]
    return ClusterSpec(name="t", devices=devices, source="probe", intra_node_bw=[1e9])


def test_a_pipeline_steps_cpu_beyond_its_recorded_actions_is_the_schedules():
    from hrlplan.runtime.calibrate.comm import cpu_beyond_actions

    events = [{"kind": "F", "cpu_s": 1e-3}, {"kind": "B", "cpu_s": 2e-3}, {"kind": "F"}]
    assert cpu_beyond_actions(4.5e-3, events) == pytest.approx(1.5e-3)
    assert cpu_beyond_actions(1e-3, events) == 0.0


def test_passes_pool_the_schedules_cpu_as_its_mean_bursts_included():
    from hrlplan.runtime.calibrate.comm import pool_hop_passes

    def hop(beyond):
        return {"stage": 0, "schedule": "1f1b", "m": 4, "microbatch_size": 1, "n_blocks": 1, "events": [],
                "fwd_all": [1.0], "bwd_all": [2.0], "spans_s": [3.0], "steps_all": [3.0], "tail_all": [0.1],
                "tail_tied_all": None, "cpu_beyond_actions_per_microbatch_all": beyond}
    pooled = pool_hop_passes([hop([1e-4, 1e-4]), hop([1e-4, 2.5e-3])])   # gloo's thread spun in one step
    assert pooled["cpu_beyond_actions_per_microbatch_s"] == pytest.approx(7e-4)   # what the quota meters
    assert pool_hop_passes([dict(hop([]), cpu_beyond_actions_per_microbatch_all=None)])[
        "cpu_beyond_actions_per_microbatch_s"] is None   # measured on a GPU: no CPU figure


def test_the_allreduce_cpu_fit_is_a_line_over_the_payloads_per_group_size():
    from hrlplan.runtime.calibrate.collectives import ALLREDUCE_PAYLOAD_VALUES, CPU_PREFIX, fit_allreduce_cpu

    def cpu(k, nbytes):
        return [k * 1e-4 + nbytes * 1e-9] * 5
    measured = {f"{CPU_PREFIX}{k}/{v * 4}": cpu(k, v * 4) for k in (2, 3) for v in ALLREDUCE_PAYLOAD_VALUES}
    measured["2/4"] = [(0.0, 1.0)]   # the wall-time keys are fit_allreduce's
    fits = fit_allreduce_cpu(measured)
    assert [f["ranks"] for f in fits] == [2, 3]
    assert fits[1]["cpu_s"] == pytest.approx(3e-4) and fits[1]["cpu_s_per_byte"] == pytest.approx(1e-9)
    assert fit_allreduce_cpu({"2/4": [(0.0, 1.0)]}) == []


def test_quota_cpu_figures_are_fitted_per_device_name_only_where_a_worker_is_capped():
    from hrlplan.runtime.calibrate.collectives import CPU_PREFIX
    from hrlplan.runtime.calibrate.record import fit_quota_cpu

    def rank(beyond, cpu):
        hop = {"1f1b": {"cpu_beyond_actions_per_microbatch_s": beyond}, "gpipe": None}
        return {"pipeline_hop": hop if beyond is not None else None,
                "allreduce": {f"{CPU_PREFIX}2/{b}": [cpu + b * 1e-9] * 3 for b in (4, 32768, 524288)}}
    gathered = [rank(1e-3, 1e-4), rank(3e-3, 3e-4), rank(None, 5e-4)]   # rank 2 was left out of the pairs
    assert fit_quota_cpu(_capped_spec(["cpu"] * 3), gathered) == {}
    fits = fit_quota_cpu(_capped_spec(["cpu", "cpu@0.33", "cpu@0.5"]), gathered)
    assert fits["cpu"]["pipeline_per_microbatch"] == pytest.approx(1e-3)
    assert fits["cpu@0.33"]["pipeline_per_microbatch"] == pytest.approx(3e-3)
    assert fits["cpu@0.5"]["pipeline_per_microbatch"] == pytest.approx(2e-3)   # the median over those that ran it
    assert fits["cpu@0.5"]["allreduce"][0]["cpu_s"] == pytest.approx(5e-4)       # its own all-reduces
    assert fits["cpu@0.5"]["allreduce"][0]["cpu_s_per_byte"] == pytest.approx(1e-9)


def test_the_reference_steps_cpu_overhead_is_what_its_cpu_time_leaves_beyond_the_predicted_compute():
    from hrlplan.runtime.calibrate.compute import predict_one_process_step
    from hrlplan.runtime.calibrate.record import fit_reference_step_cpu
    from tests.test_cost import toy_meta

    meta = toy_meta()
    spec = _capped_spec(["cpu", "cpu@0.33"])
    cal = {"compute_efficiency": {"cpu": 0.5, "cpu@0.33": 0.5}, "peak_flops": {"cpu": 1e10, "cpu@0.33": 1e10},
           "half_saturation_tokens": {"cpu": 0.0, "cpu@0.33": 0.0}, "step_time_scale": 1.0,
           "optimizer_s_per_block": {"plain": 0.0, "sharded": 0.0}, "step_overhead_s": 0.05,
           quota_cpu.QUOTA_CPU_KEY: {"cpu": {"allreduce": []}, "cpu@0.33": {"allreduce": []}}}
    flops = meta.block_flops_fwd_per_token[0] * meta.block_repeats
    blocks = [{"tokens": t, "fwd_s": flops * t / (0.5 * 1e10), "bwd_s": 2 * flops * t / (0.5 * 1e10)}
              for t in (64, 256)]   # in CPU time: the fit recovers efficiency 0.5, no half-saturation
    spec.calibration = dict(cal, step_overhead_s=0.0)
    train = {"global_batch_size": 4}
    compute = predict_one_process_step(meta, spec, train)["step_time_s"]
    rounds = [({"step_s": 9.0, "optimizer_s": 1.0, "step_cpu_s": compute + 2e-3 + 1e-3, "optimizer_cpu_s": 1e-3},
               [], blocks)] * 3
    fit_reference_step_cpu(cal, spec, meta, train, rounds)
    assert [fig["step_overhead"] for fig in cal[quota_cpu.QUOTA_CPU_KEY].values()] == pytest.approx([2e-3, 2e-3])
    assert "optimizer_scale" not in cal[quota_cpu.QUOTA_CPU_KEY]["cpu"]   # no optimizer predicted to scale
    # an optimizer the wall-time figures predict at twice what the reference step's CPU time says
    slow = dict(cal, optimizer_s_per_block={"plain": 1e-3, "sharded": 1e-3})
    spec.calibration = dict(slow, step_overhead_s=0.0)
    predicted = predict_one_process_step(meta, spec, train)
    timed = {"step_s": 9.0, "optimizer_s": 1.0, "optimizer_cpu_s": predicted["optimizer_s"] / 2,
             "step_cpu_s": predicted["step_time_s"] - predicted["optimizer_s"] / 2}
    fit_reference_step_cpu(slow, spec, meta, train, [(timed, [], blocks)] * 3)
    assert slow[quota_cpu.QUOTA_CPU_KEY]["cpu@0.33"]["optimizer_scale"] == pytest.approx(0.5)
    assert slow[quota_cpu.QUOTA_CPU_KEY]["cpu@0.33"]["step_overhead"] == pytest.approx(0.0, abs=1e-9)
    assert cal["step_overhead_s"] == 0.05   # the wall-time figure is left as it was
    untouched = dict(cal, **{quota_cpu.QUOTA_CPU_KEY: {"cpu": {}}})
    fit_reference_step_cpu(untouched, spec, meta, train, [(r[0], r[1]) for r in rounds])   # rounds without CPU blocks
    assert untouched[quota_cpu.QUOTA_CPU_KEY] == {"cpu": {}}


def _measure_cpu_pair(run_dir: str):
    import torch
    import torch.distributed as dist

    from hrlplan.compose import compose
    from hrlplan.config import typed
    from hrlplan.runtime.calibrate.collectives import (CPU_PREFIX, allreduce_partitions, fit_allreduce_cpu,
                                                       measure_allreduce)
    from hrlplan.runtime.calibrate.comm import measure_pipeline_hop, pool_hop_passes
    from hrlplan.runtime.distributed import init_distributed, shutdown

    cfg = typed(compose(["data.seq_len=16", "arch.n_layer=2"]))
    init_distributed("cpu", cfg.train)
    try:
        torch.set_num_threads(1)
        cpu = torch.device("cpu")
        partitions = [(k, lists, [dist.new_group(r) for r in lists]) for k, lists in allreduce_partitions(2)]
        measured = measure_allreduce(cpu, partitions, repeats=3, before_s=(0.0, 1e-4), after_s=(0.0, 1e-4))
        pair = dist.new_group([0, 1])
        hop = pool_hop_passes([measure_pipeline_hop(cfg.arch, 16, cpu, pair, [0, 1], repeats=2)])
        return {"cpu_keys": sorted(k for k in measured if k.startswith(CPU_PREFIX)),
                "fits": fit_allreduce_cpu(measured), "beyond": hop["cpu_beyond_actions_per_microbatch_s"]}
    finally:
        shutdown()


@pytest.mark.slow
def test_every_rank_measures_the_cpu_of_its_all_reduces_and_of_the_pipelines_schedule(tmp_path):
    from hrlplan.launch.local import launch_workers

    results = launch_workers(_measure_cpu_pair, (str(tmp_path),), 2, log_dir=str(tmp_path / "logs"))
    for rank, out in results.items():
        assert out["cpu_keys"] == sorted(["cpu/2/4", "cpu/2/32768", "cpu/2/524288"]), (rank, out)
        assert len(out["fits"]) == 1 and out["fits"][0]["cpu_s"] >= 0 and out["fits"][0]["cpu_s_per_byte"] >= 0
        assert out["beyond"] is not None and out["beyond"] >= 0.0


def test_the_machinery_charges_each_stage_its_own_exchanges_at_its_message_size():
    exchange = {"cpu_s": 5e-5, "cpu_s_per_byte": 2e-9}
    hop_bytes = 16384.0
    figures = {"pipeline_per_microbatch": 5e-4, "pipeline_hop_bytes": hop_bytes, "p2p_exchange": exchange}
    schedule = 5e-4 - (5e-5 + hop_bytes * 2e-9)
    # the calibration's own pipeline (one neighbour, its message): the hop's figure as it is
    assert quota_cpu.machinery_cpu_s(figures, 1, hop_bytes) == pytest.approx(5e-4)
    assert quota_cpu.machinery_cpu_s(figures, 2, 4 * hop_bytes) == pytest.approx(schedule + 2 * (5e-5 + 4 * hop_bytes * 2e-9))
    assert quota_cpu.machinery_cpu_s(figures, 0, 4 * hop_bytes) == pytest.approx(schedule)   # no neighbour
    assert quota_cpu.machinery_cpu_s({"pipeline_per_microbatch": 5e-4}, 2, 1e6) == pytest.approx(5e-4)   # old record

    plain, t0, _ = _run(_cluster(NAMES, {"pipeline_per_microbatch": 5e-4}), _pp3())
    run, t, meta = _run(_cluster(NAMES, figures), _pp3())
    message = run.sim.costs.activation_message(1)
    before, after = quota_cpu.position_work(plain, t0), quota_cpu.position_work(run, t)
    assert after[1][0] - before[1][0] == pytest.approx(4 * (quota_cpu.machinery_cpu_s(figures, 2, message) - 5e-4))
    assert after[2][0] - before[2][0] == pytest.approx(4 * (quota_cpu.machinery_cpu_s(figures, 1, message) - 5e-4))
    assert run.quota_parts[1]["machinery"] == pytest.approx(4 * quota_cpu.machinery_cpu_s(figures, 2, message))


def test_the_exchange_line_is_fitted_per_rank_and_pooled_with_the_hops_message_bytes():
    from hrlplan.runtime.calibrate.record import fit_quota_cpu

    def rank(per_byte):
        return {"pipeline_hop": {"1f1b": {"cpu_beyond_actions_per_microbatch_s": 1e-3, "message_bytes": 32768}},
                "gradient_bucket_cpu": {"bytes": 2e5, "tensors": 12, "cpu_s": per_byte * 1e5},
                "p2p_exchange_cpu": [{"bytes": b, "cpu_s": 4e-5 + b * per_byte} for b in (32768.0, 131072.0, 393216.0)]}
    fits = fit_quota_cpu(_capped_spec(["cpu", "cpu@0.33", "cpu@0.33"]), [rank(1e-9), rank(3e-9), {}])
    assert fits["cpu@0.33"]["pipeline_hop_bytes"] == 32768
    assert fits["cpu@0.33"]["p2p_exchange"]["cpu_s"] == pytest.approx(4e-5)
    assert fits["cpu@0.33"]["p2p_exchange"]["cpu_s_per_byte"] == pytest.approx(3e-9)   # its own rank's line
    assert fits["cpu"]["p2p_exchange"]["cpu_s_per_byte"] == pytest.approx(1e-9)
    assert fits["cpu@0.33"]["gradient_bucket_cpu_s_per_byte"] == pytest.approx(1.5e-9)


def test_capped_ranks_loops_are_their_quotas_not_contention_and_their_shares_are_the_jobs_demand():
    from hrlplan.runtime.calibrate.compute import CONTENTION_SLACK
    from hrlplan.runtime.calibrate.record import _fit_contention

    def loops(together, cores):
        return [{"contention": {"alone_s": 1.0 if r == 0 else None, "together_s": t, "cpu_cores": cores}}
                for r, t in enumerate(together)]
    cal = {}
    _fit_contention(cal, _capped_spec(["cpu", "cpu@0.33", "cpu@0.33"]), loops([1.1, 2.4, 2.5], 2))
    assert cal["contention_factor"]["compute"] == pytest.approx(1.1)   # the uncapped rank's own slowdown
    # 1 + 1/3 + 1/3 of a core's demand on 2 cores: no more than the slack
    _fit_contention(cal, _capped_spec(["cpu", "cpu@0.33", "cpu@0.33"]), loops([1.6, 2.4, 2.5], 2))
    assert cal["contention_factor"]["compute"] == pytest.approx(CONTENTION_SLACK)
    _fit_contention(cal, _capped_spec(["cpu"] * 3), loops([1.1, 2.4, 2.5], 2))   # uncapped: every rank, as before
    assert cal["contention_factor"]["compute"] == pytest.approx(min(2.4, 1.5 * CONTENTION_SLACK))
