"""Cost model: analytic bubbles, bottlenecks, micro-batch effects, memory per schedule, OOM reasons."""
import pytest

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.cost.model import CostOptions, Layout
from hrlplan.cost.simulator import Simulator
from hrlplan.cost.timeline import simulate_timeline
from hrlplan.model_meta import ModelMeta

GiB = 2 ** 30


def toy_meta(n_layer=8, hidden=256, seq=128, vocab=1000) -> ModelMeta:
    block = 12 * hidden * hidden
    return ModelMeta(
        name="toy", family="hf", model_type="gpt2", n_layer=n_layer, hidden_size=hidden, num_heads=4, seq_len=seq,
        vocab_size=vocab, total_params=n_layer * block + 2 * vocab * hidden, embedding_params=vocab * hidden,
        head_params=vocab * hidden, block_params=[block] * n_layer, block_matmul_params=[block] * n_layer,
        head_matmul_params=vocab * hidden, block_flops_fwd_per_token=[2.0 * block] * n_layer,
        head_flops_fwd_per_token=0.0, block_activation_bytes_per_token=[34.0 * hidden] * n_layer,
        head_activation_bytes_per_token=0.0, tied_embeddings=False, first_stage_modules=["wte"],
        last_stage_modules=["lm_head"], block_modules=[f"h.{i}" for i in range(n_layer)])


def toy_cluster(n=4, flops=None, memory=16 * GiB, names=None) -> ClusterSpec:
    flops = flops or [1e12] * n
    devs = [DeviceInfo(rank=i, node=0, local_rank=i, hostname="n0", kind="cuda", name=(names or ["g"] * n)[i],
                       memory_bytes=memory, peak_flops=flops[i]) for i in range(n)]
    return ClusterSpec(name="toy", devices=devs, backend="nccl", source="preset", intra_node_bw=[1e12],
                       intra_node_latency=0.0, inter_node_latency=0.0)


def pipeline(spans, m, schedule="1f1b", mb=1, n=None):
    n = n or len(spans)
    return Layout(spans=tuple(spans), groups=tuple((i,) for i in range(n)), tp=1, dp=1, microbatch_size=mb,
                  num_microbatches=m, schedule=schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (8, 32), (4, 5)])
def test_equal_stages_reproduce_analytic_bubble(schedule, p, m):
    r = simulate_timeline(schedule, p, 1, m, [1.0] * p, [2.0] * p, [0.0] * p, [0.0] * p, [0.0] * p, [1.0] * p)
    bubble = 1 - 3.0 * m / r.makespan
    assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_simulator_bubble_fraction_equal_stages():
    sim = Simulator(toy_meta(), toy_cluster(), CostOptions(memory_margin=1.0))
    res = sim.evaluate(pipeline([(0, 2), (2, 4), (4, 6), (6, 8)], m=8))
    assert res.feasible
    assert res.bubble_fraction == pytest.approx(3 / 11, rel=0.02)  # p2p delays add a little


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    base = simulate_timeline("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4, [1.0] * 4)
    inter = simulate_timeline("interleaved_1f1b", 4, 2, 8, [0.5] * 8, [1.0] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 8, [1.0] * 8)
    zb = simulate_timeline("zero_bubble", 4, 1, 8, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4, [1.0] * 4)
    assert inter.makespan < base.makespan and zb.makespan < base.makespan


def test_slower_device_makes_its_stage_the_bottleneck():
    meta = toy_meta()
    fast = Simulator(meta, toy_cluster()).evaluate(pipeline([(0, 2), (2, 4), (4, 6), (6, 8)], m=8), detail=True)
    slow = Simulator(meta, toy_cluster(flops=[1e12, 1e12, 2.5e11, 1e12])).evaluate(
        pipeline([(0, 2), (2, 4), (4, 6), (6, 8)], m=8), detail=True)
    assert slow.breakdown["bottleneck_position"] == 2
    assert slow.step_time_s > 2 * fast.step_time_s
    busiest = max(slow.stages, key=lambda s: s["fwd_s"])
    assert busiest["stage"] == 2


def test_more_microbatches_shrink_the_bubble():
    sim = Simulator(toy_meta(), toy_cluster())
    spans = [(0, 2), (2, 4), (4, 6), (6, 8)]
    bubbles = [sim.evaluate(pipeline(spans, m=m)).bubble_fraction for m in (4, 8, 16, 32)]
    assert all(a > b for a, b in zip(bubbles, bubbles[1:]))


def test_gpipe_memory_grows_with_microbatches_1f1b_does_not():
    # what the schedules hold (torch pipelining's receive buffers, one per micro-batch, grow with m too)
    sim = Simulator(toy_meta(), toy_cluster(memory=1000 * GiB), CostOptions(receive_buffers=False))
    spans = [(0, 2), (2, 4), (4, 6), (6, 8)]
    g = [sim.evaluate(pipeline(spans, m=m, schedule="gpipe")).memory_bytes[0] for m in (4, 8, 16)]
    o = [sim.evaluate(pipeline(spans, m=m, schedule="1f1b")).memory_bytes[0] for m in (4, 8, 16)]
    assert g[0] < g[1] < g[2]
    # m=4 on pp=4: every forward of position 0 runs before its first backward, when no gradient exists yet
    assert o[0] < o[1] == o[2]
    # 1F1B keeps p - i micro-batches on stage i (the last also holds the head's weights)
    mems = sim.evaluate(pipeline(spans, m=16)).memory_bytes
    assert mems[0] > mems[1] > mems[2] and mems[1] > mems[3]


def test_out_of_memory_names_the_device():
    cluster = toy_cluster(memory=16 * GiB, names=["big", "big", "tiny", "big"])
    cluster.devices[2].memory_bytes = int(0.05 * GiB)
    res = Simulator(toy_meta(), cluster).evaluate(pipeline([(0, 2), (2, 4), (4, 6), (6, 8)], m=8))
    assert not res.feasible
    assert "device 2" in res.reason and "tiny" in res.reason and "GiB" in res.reason


def test_calibration_scales_step_time():
    meta = toy_meta()
    lay = pipeline([(0, 4), (4, 8)], m=4)
    base = Simulator(meta, toy_cluster()).evaluate(lay).step_time_s
    cl = toy_cluster()
    cl.calibration = {"step_time_scale": 2.0}
    assert Simulator(meta, cl).evaluate(lay).step_time_s == pytest.approx(2 * base)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 16), (8, 32), (3, 5)])
def test_zero_bubble_v_shape_holds_no_more_than_1f1b_and_fills_the_bubble(pp, m):
    n = 2 * pp
    zbv = simulate_timeline("zero_bubble", pp, 2, m, [1.0] * n, [1.0] * n, [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)
    ref = simulate_timeline("1f1b", pp, 1, m, [2.0] * pp, [4.0] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp, [2.0] * pp)
    # Activations: at most what 1F1B's first stage holds (pp micro-batches of a whole stage), not all m.
    assert max(zbv.peak_activation) <= max(ref.peak_activation) + 1e-9
    assert max(zbv.peak_activation) < 2.0 * m or m <= pp
    # And most of 1F1B's bubble is gone.
    assert zbv.makespan - 6 * m < 0.5 * (ref.makespan - 6 * m)


def test_rendezvous_receive_waits_a_handshake_after_its_position_gets_to_it():
    # GPipe, 2 stages x 2 micro-batches, unit ops, a 0.1 send and a 0.5 handshake, by hand: stage 1's
    # second forward is sent at 2.0 but its receive is posted at 2.1 (stage 1 free), so it starts at 2.6;
    # stage 0's second backward likewise waits 0.5 after stage 0 gets to it (5.7).
    args = ("gpipe", 2, 1, 2, [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.1, 0.0], [0.1, 0.0], [1.0, 1.0])
    assert simulate_timeline(*args).makespan == pytest.approx(6.2)
    assert simulate_timeline(*args, recv_handshake=[0.5, 0.5]).makespan == pytest.approx(7.2)
    assert simulate_timeline(*args, recv_handshake=[0.0, 0.0]).makespan == pytest.approx(6.2)


def test_uncalibrated_costs_have_no_handshake_and_calibrated_ones_do():
    meta, lay = toy_meta(), pipeline([(0, 4), (4, 8)], m=4)
    base = Simulator(meta, toy_cluster()).evaluate(lay, detail=True)
    assert all(s["recv_handshake_s"] == 0.0 for s in base.stages)
    cl = toy_cluster()
    cl.calibration = {"p2p_latency_s": 1e-3, "p2p_handshake_s": 2e-3}
    cal = Simulator(meta, cl).evaluate(lay)
    cl.calibration = {"p2p_latency_s": 1e-3}
    no_hs = Simulator(meta, cl).evaluate(lay)
    assert cal.step_time_s > no_hs.step_time_s > base.step_time_s


@pytest.mark.parametrize("schedule,v", [("zero_bubble", 2), ("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_timeline_plot_replays_the_simulators_timeline(schedule, v):
    """The drawn prediction is the simulator's own: calibrated zero-bubble split (B = 0 on the first
    stage), handshakes and sends included."""
    from hrlplan.runtime.timeline_plot import predicted_events

    meta = toy_meta()
    spans = [(0, 2), (2, 4), (4, 6), (6, 8)] if v == 2 else [(0, 4), (4, 8)]
    lay = Layout(spans=tuple(spans), groups=((0,), (1,)), tp=1, dp=1, microbatch_size=1, num_microbatches=4,
                 schedule=schedule, stages_per_rank=v)
    cl = toy_cluster(flops=[1e9] * 4)
    cl.calibration = {"zb_input_grad_share": 0.3, "p2p_latency_s": 1e-3, "p2p_handshake_s": 2e-3,
                      "op_overhead_s": {"fwd": 1e-4, "bwd": 2e-4}}
    res = Simulator(meta, cl).evaluate(lay, detail=True)
    if schedule == "zero_bubble":
        assert res.stages[0]["bwd_input_s"] == 0.0
        assert res.stages[1]["bwd_input_s"] == pytest.approx(0.3 * res.stages[1]["bwd_s"])
    plan = {"schedule": schedule, "stages_per_rank": v, "pp": 2, "num_microbatches": 4}
    events = predicted_events(plan, {"chosen": {"stages": res.stages}})
    assert len(events) == (3 if schedule == "zero_bubble" else 2) * 4 * len(spans)
    assert max(e["end_s"] for e in events) == pytest.approx(res.breakdown["pipeline_s"], rel=1e-9)


def test_timeline_plot_replays_contention_and_fsdp_all_gathers():
    """More ranks than cores and FSDP: the drawn prediction still ends where the simulator's does
    (the stage durations carry the mean-field contention, the first forward FSDP's all-gathers)."""
    from hrlplan.runtime.timeline_plot import predicted_events

    meta = toy_meta()
    lay = Layout(spans=((0, 4), (4, 8)), groups=((0, 1), (2, 3)), tp=1, dp=2, microbatch_size=1, num_microbatches=4,
                 schedule="1f1b")
    cl = toy_cluster(n=4, flops=[1e9] * 4)
    cl.calibration = {"p2p_latency_s": 1e-3, "p2p_handshake_s": 2e-3, "contention_factor": {"compute": 2.0, "paired": 1.0},
                      "dp_collective_s": {"allgather": 1e-3, "reduce": 2e-3}, "op_overhead_s": {"fwd": 1e-4, "bwd": 2e-4}}
    res = Simulator(meta, cl, CostOptions(dp_mode="fsdp")).evaluate(lay, detail=True)
    assert res.stages[0]["first_fwd_extra_s"] > 0
    events = predicted_events({"schedule": "1f1b", "pp": 2, "num_microbatches": 4}, {"chosen": {"stages": res.stages}})
    assert max(e["end_s"] for e in events) == pytest.approx(res.breakdown["pipeline_s"], rel=1e-9)


def test_zero_bubble_v_runs_torch_zbv_order():
    """The runtime runs torch's ScheduleZBVZeroBubble: the simulator uses its order (as recorded in a
    real pp=2, m=4 step: W right after its B until the cool-down)."""
    from hrlplan.cost.timeline import structure

    st = structure("zero_bubble", 2, 2, 4)
    got = [" ".join("FBW"[k] + f"{s}.{j}" for k, s, j in ops) for ops in st.position_ops]
    assert got[0] == ("F0.0 F0.1 F0.2 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 F0.3 B0.0 W0.0 F3.2 B3.2 W3.2 B0.1 W0.1 "
                      "F3.3 B3.3 W3.3 B0.2 W0.2 B0.3 W0.3")
    assert got[1] == ("F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 F1.2 B1.0 W1.0 F2.2 B2.1 W2.1 F1.3 B1.1 W1.1 F2.3 B2.2 W2.2 "
                      "B1.2 B2.3 B1.3 W1.2 W2.3 W1.3")


def test_calibrated_backward_ratio_and_zero_bubble_factors():
    """Calibration's measured backward/forward ratio splits a stage's compute; zero-bubble's B and W
    are the measured multiples of the plain backward (interpolated at the micro-batch's tokens), the
    first stage's W one plain backward and its B nothing."""
    meta = toy_meta()
    lay = Layout(spans=((0, 2), (2, 4), (4, 6), (6, 8)), groups=((0,), (1,)), tp=1, dp=1, microbatch_size=1,
                 num_microbatches=4, schedule="zero_bubble", stages_per_rank=2)
    cl = toy_cluster(flops=[1e9] * 4)
    base = Simulator(meta, cl).evaluate(lay, detail=True).stages[1]
    tokens = meta.seq_len
    cl.calibration = {"backward_forward_ratio": [{"tokens": tokens / 2, "ratio": 1.0}, {"tokens": tokens * 2, "ratio": 1.5}],
                      "zb_backward_factors": [{"tokens": tokens, "input": 1.2, "weight": 0.8}]}
    st = Simulator(meta, cl).evaluate(lay, detail=True).stages
    ratio = 1.0 + 0.5 * (tokens - tokens / 2) / (tokens * 2 - tokens / 2)
    total = base["fwd_s"] + base["bwd_s"]
    assert st[1]["fwd_s"] == pytest.approx(total / (1 + ratio))
    assert st[1]["bwd_s"] == pytest.approx(total * ratio / (1 + ratio))
    assert st[1]["bwd_input_s"] == pytest.approx(1.2 * st[1]["bwd_s"])
    assert st[1]["bwd_weight_s"] == pytest.approx(0.8 * st[1]["bwd_s"])
    assert st[0]["bwd_input_s"] == 0.0 and st[0]["bwd_weight_s"] == pytest.approx(st[0]["bwd_s"])


def test_tensor_parallel_shards_the_blocks_not_the_head():
    """tensor_parallel.py keeps the head (and embeddings, norms) whole on every tp rank: its FLOPs
    and parameters are not divided by tp, the blocks' are."""
    from hrlplan.cost.model import StageCostModel

    meta = toy_meta(vocab=4096)
    meta.head_flops_fwd_per_token = 2.0 * 4096 * 256
    cluster = toy_cluster()
    cluster.calibration = {"compute_efficiency": 0.5}   # the flat FLOPs model: speed proportional to FLOPs
    blocks = sum(meta.block_flops_fwd_per_token)
    for vocab_parallel, head_tp in ((False, 1), (True, 2)):
        costs = StageCostModel(meta, cluster, CostOptions(vocab_parallel=vocab_parallel))
        one = costs.stage(0, 8, True, True, [0], tp=1, dp=1, microbatch_size=1, pp=1)
        two = costs.stage(0, 8, True, True, [0, 1], tp=2, dp=1, microbatch_size=1, pp=1)
        head = meta.head_flops_fwd_per_token
        share = (blocks / 2 + head / head_tp) / (blocks + head)
        assert two.compute_fwd == pytest.approx(one.compute_fwd * share, rel=1e-9)
        assert costs.span_params(0, 8, True, True, 1, tp=2) == pytest.approx(
            sum(meta.block_params) / 2 + (meta.embedding_params + meta.head_params) / head_tp)


def test_vocab_parallel_head_shards_the_logits_and_unloads_the_last_stage():
    """Megatron's vocabulary-parallel embedding and column-parallel head with a loss over sharded
    logits: the last stage's head FLOPs, weights and fp32 logits divide by tp."""
    meta, cluster = llama7b_meta(), a100_node()
    whole = Simulator(meta, cluster, CostOptions(bytes_per_value=2))
    sharded = Simulator(meta, cluster, CostOptions(bytes_per_value=2, vocab_parallel=True))
    lay = Layout(spans=((0, 16), (16, 32)), groups=((0, 1, 2, 3), (4, 5, 6, 7)), tp=4, dp=1, microbatch_size=1,
                 num_microbatches=8, schedule="1f1b")
    a, b = whole.evaluate(lay, detail=True), sharded.evaluate(lay, detail=True)
    assert b.stages[1]["fwd_s"] < a.stages[1]["fwd_s"]
    assert b.stages[0]["fwd_s"] == pytest.approx(a.stages[0]["fwd_s"])
    logits = 2048 * 4 * meta.vocab_size          # fp32 logits per micro-batch, whole
    assert a.stages[1]["activation_bytes_per_microbatch"] - b.stages[1]["activation_bytes_per_microbatch"] == \
        pytest.approx(logits * 3 / 4)
    assert b.step_time_s < a.step_time_s


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)])
def test_shared_cores_timeline_equals_the_list_schedule_when_nothing_is_slowed(schedule, v):
    """The shared-cores timeline runs the same operations, orders, inputs and handshakes: with no
    slowdown it reproduces simulate_timeline (ends, busy time, peak activations, trace)."""
    import random

    from hrlplan.cost.timeline import simulate_shared_timeline, simulate_timeline

    rng = random.Random(0)
    for pp, m in ((2, 2), (3, 4), (4, 8)):
        n = pp * v
        draw = lambda lo, hi: [rng.uniform(lo, hi) for _ in range(n)]   # noqa: E731
        f, b, send, extra, hs, act = draw(0.5, 2), draw(0.5, 2), draw(0, 0.2), draw(0, 1), draw(0, 0.1), draw(0, 1)
        w = draw(0.5, 2) if schedule == "zero_bubble" else [0.0] * n
        t1, t2 = [], []
        a = simulate_timeline(schedule, pp, v, m, f, b, w, send, send, act, extra, None, hs, trace=t1)
        c = simulate_shared_timeline(schedule, pp, v, m, f, b, w, send, send, act, extra, hs, trace=t2)
        for x, y in ((a.end, c.end), (a.busy, c.busy), (a.peak_activation, c.peak_activation),
                     (a.last_backward, c.last_backward)):
            assert y == pytest.approx(x, abs=1e-9)
        t1, t2 = sorted(t1), sorted(t2)
        assert [op[:4] for op in t2] == [op[:4] for op in t1]
        assert [x for op in t2 for x in op[4:]] == pytest.approx([x for op in t1 for x in op[4:]], abs=1e-9)


# ---------------------------------------------------------------- per-stage tp (issue 19, item 1)
def llama7b_meta(seq=2048) -> ModelMeta:
    """Llama-2-7B's figures as model_meta.introspect gives them (built by hand: no transformers import)."""
    h, inter, heads, vocab, n = 4096, 11008, 32, 32000, 32
    mm = 4 * h * h + 3 * h * inter
    return ModelMeta(
        name="llama-7b", family="hf", model_type="llama", n_layer=n, hidden_size=h, num_heads=heads, seq_len=seq,
        vocab_size=vocab, total_params=n * (mm + 2 * h) + 2 * vocab * h + h, embedding_params=vocab * h,
        head_params=vocab * h + h, block_params=[mm + 2 * h] * n, block_matmul_params=[mm] * n,
        head_matmul_params=vocab * h, block_flops_fwd_per_token=[2.0 * mm + 4.0 * seq * h] * n,
        head_flops_fwd_per_token=2.0 * vocab * h,
        block_activation_bytes_per_token=[float(11 * h + 5 * heads * seq + 4 * h + 3 * h + 6 * inter)] * n,
        head_activation_bytes_per_token=float(2 * h + 4 * vocab), tied_embeddings=False,
        first_stage_modules=["model.embed_tokens"], last_stage_modules=["model.norm", "lm_head"],
        block_modules=[f"model.layers.{i}" for i in range(n)])


def a100_node():
    from pathlib import Path

    import yaml

    from hrlplan.cluster import spec_from_preset

    conf = Path(__file__).resolve().parents[1] / "conf" / "cluster" / "a100x8-1n.yaml"
    return spec_from_preset(yaml.safe_load(conf.read_text()))


def test_each_stage_is_costed_at_its_own_tp():
    """llama-7b on a100x8-1n, stages tp=2 then tp=1: the 1-GPU stage was costed at tp=2 (~40 ms and
    32 GiB where its own tp gives ~141 ms and 110 GiB)."""
    from hrlplan.cost import predict_any_plan
    from hrlplan.cost.model import StageCostModel
    from hrlplan.plan import Plan, StagePlan

    meta, cluster = llama7b_meta(), a100_node()
    opts = CostOptions(bytes_per_value=2, memory_margin=1.0)
    stages = [StagePlan(layers=[0, 16], ranks=[0, 1], tp=2, embedding=True),
              StagePlan(layers=[16, 32], ranks=[2], tp=1, head=True)]
    plan = Plan(model="llama-7b", n_layer=32, world_size=3, pp=2, microbatch_size=1, num_microbatches=4,
                global_batch_size=4, schedule="1f1b", stages=stages, device_groups=[[0, 1], [2]])
    pred = predict_any_plan(plan, meta, cluster, opts)
    costs = StageCostModel(meta, cluster, opts)
    own = [costs.stage(0, 16, True, False, [0, 1], 2, 1, 1, 2, microbatches=4),
           costs.stage(16, 32, False, True, [2], 1, 1, 1, 2, microbatches=4)]
    assert [s["tp"] for s in pred["stages"]] == [2, 1]
    for shown, c in zip(pred["stages"], own):
        assert shown["fwd_s"] == pytest.approx(c.fwd)
        assert shown["bwd_s"] == pytest.approx(c.bwd)
        assert shown["static_bytes"] == pytest.approx(c.static_memory)
    # the tp=1 stage does twice the per-rank work of the tp=2 one but its norms and residual adds, which
    # the tp=2 stage (no sequence parallelism) runs whole too (kernels.ELEMENTWISE_H_REPLICATED), and holds
    # twice the weights (it keeps one micro-batch in flight where the first keeps two)
    assert pred["stages"][1]["fwd_s"] > 1.6 * pred["stages"][0]["fwd_s"]
    assert pred["memory_bytes_per_rank"][2] > 1.5 * pred["memory_bytes_per_rank"][0]


def test_layout_stage_tp_defaults_to_the_uniform_tp():
    lay = Layout(spans=((0, 4), (4, 8)), groups=((0, 1), (2, 3)), tp=2, dp=1, microbatch_size=1,
                 num_microbatches=2, schedule="1f1b")
    assert [lay.tp_of(k) for k in range(2)] == [2, 2] and lay.recompute_of(1) == "none"
    sim = Simulator(toy_meta(), toy_cluster())
    same = Layout(spans=lay.spans, groups=lay.groups, tp=2, dp=1, microbatch_size=1, num_microbatches=2,
                  schedule="1f1b", stage_tp=(2, 2), recompute=("none", "none"))
    assert sim.evaluate(same).step_time_s == pytest.approx(sim.evaluate(lay).step_time_s)


def test_a_preset_saved_to_a_spec_file_is_costed_as_the_preset(tmp_path):
    """Loading a cluster through spec_file no longer switches the nominal 0.5 efficiency to a probe's 0.7."""
    from hrlplan.cluster import ClusterSpec

    cluster = toy_cluster()
    cluster.save(tmp_path / "cluster.json")
    again = ClusterSpec.load(tmp_path / "cluster.json")
    lay = pipeline([(0, 4), (4, 8)], m=4)
    assert Simulator(toy_meta(), again).evaluate(lay).step_time_s == pytest.approx(
        Simulator(toy_meta(), cluster).evaluate(lay).step_time_s)


def _preset(name):
    from pathlib import Path

    import yaml

    from hrlplan.cluster import spec_from_preset

    return spec_from_preset(yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "cluster"
                                            / f"{name}.yaml").read_text()))


def test_preset_links_run_at_nccls_sourced_efficiency_and_a_calibration_overrides_it():
    """NVLink by GPU generation, InfiniBand by the NIC's line rate (device_model.NVLINK_EFFICIENCY,
    NIC_EFFICIENCY: the NCCL team's stated bus bandwidths); links neither table knows keep 0.8."""
    from hrlplan.cost.device_model import UNSOURCED_LINK_EFFICIENCY, DeviceModel

    def ratios(cluster, pairs):
        dev = DeviceModel(cluster)
        return [dev.bw(a, b) / cluster.bw(a, b) for a, b in pairs]

    a100, h100, mix = _preset("a100x8-4n"), _preset("h100x8-4n"), _preset("a100-v100-mix")
    assert ratios(a100, [(0, 1), (0, 8)]) == pytest.approx([230 / 300, 24 / 25])
    assert ratios(h100, [(0, 1), (0, 8)]) == pytest.approx([370 / 450, 47 / 50])
    assert ratios(mix, [(31, 30), (0, 31)]) == pytest.approx([20 / 25, 12 / 12.5])   # V100's NVLink, 100 Gb/s
    assert ratios(toy_cluster(), [(0, 1)]) == pytest.approx([UNSOURCED_LINK_EFFICIENCY])   # a GPU no table has
    a100.calibration = {"bandwidth_efficiency": 0.5}
    assert ratios(a100, [(0, 1), (0, 8)]) == pytest.approx([0.5, 0.5])
