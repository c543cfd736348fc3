"""What-ifs on the Megatron-LM README H100 table: mechanisms checked against it and not adopted.

    python bench/published_whatif.py [--source megatron-h100] [--variant NAME ...]

Not the product's figure (bench/published.py is): each row runs once through `pretrain.py mode=plan`
(bench/published.predict_row) for its model record and cluster, then the simulator is evaluated
in-process on the row's layout, first as committed, then with one piece of the cost model replaced
by the variant's (a monkeypatch inside this process only). Nothing here is fitted: each variant is a
mechanism of the modelled runtime with its source below; the bench prints median / max error and
Spearman per variant and, per row, the predicted/measured ratio and the measured step over the
model's pipeline time (compute + bubble, without the exposed data-parallel time).

Variants:
- te_streams: Transformer Engine's userbuffers issue the split GEMM chunks on up to 3 compute streams
  (transformer_engine/pytorch/module/base.py `_NUM_MAX_UB_STREAMS = 3`; csrc/comm_gemm_overlap.h:
  chunk i on `_stream_compute[i % _stream_compute.size()]`), so consecutive chunks share their waves:
  priced as groups of 3 chunks whose tiles are quantised together, one launch per chunk.
- fp32_reduce_scatter: Megatron-LM forces fp32 gradient accumulation and reduce under bf16
  (megatron/training/arguments.py at f2e5db402c: "bfloat16 requires gradient accumulation and
  all-reduce to be done in fp32"; DistributedDataParallelConfig.grad_reduce_in_fp32): the
  distributed optimizer's reduce-scatter moves 4-byte gradients (its all-gather stays 2-byte).
- nic_spread: NCCL's rings cross nodes on every NIC of the communicator's GPUs: a data-parallel
  group with k members per node has k x a NIC's bandwidth between nodes.
- inter_node_efficiency: links between nodes at --inter-node-efficiency of their nominal bandwidth
  (default 0.9) where the model takes NCCL's sourced figure (device_model.NIC_EFFICIENCY: 0.94 for
  NDR, 0.96 for HDR), links in a node at theirs (NVLINK_EFFICIENCY). A sensitivity, not a mechanism.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import published  # noqa: E402
from published_sources import BY_KEY  # noqa: E402
from hrlplan.cluster import ClusterSpec  # noqa: E402
from hrlplan.cost import kernels  # noqa: E402
from hrlplan.cost import model as cost_model  # noqa: E402
from hrlplan.cost.model import CostOptions  # noqa: E402
from hrlplan.cost.simulator import Simulator  # noqa: E402
from hrlplan.model_record import ModelMeta  # noqa: E402

TE_UB_STREAMS = 3


def _te_streams_gemms(k, shapes, tp: int, bpv: int):
    """kernels.tp_overlap_gemms with each split GEMM's chunks in groups of TE_UB_STREAMS at once."""
    def chunked(m, n, kk, splits, sms):
        group = min(TE_UB_STREAMS, splits)
        full, rest = divmod(splits, group)
        rate = k.peak * k.gemm_fraction
        t = full * kernels.gemm_seconds(group * m / splits, n, kk, bpv, rate, k.hbm, sms)
        if rest:
            t += kernels.gemm_seconds(rest * m / splits, n, kk, bpv, rate, k.hbm, sms)
        return t + (splits - full - (1 if rest else 0)) * kernels.KERNEL_LAUNCH_S
    beside = max(k.sms - kernels.TE_COMM_SMS, 1)
    (qm, qn, qk), (om, on, ok), (um, un, uk), (dm, dn, dk) = shapes
    fwd = (chunked(qm, qn, qk, tp, k.sms) + chunked(om, on, ok, 4, beside)
           + chunked(um, un, uk, tp, k.sms) + chunked(dm, dn, dk, 4, beside))
    bwd = (chunked(qm, qk, qn, 1, beside) + chunked(qk, qn, qm, 1, beside)
           + chunked(om, ok, on, tp, k.sms) + k.gemm(ok, on, om, bpv)
           + chunked(um, uk, un, 1, beside) + chunked(uk, un, um, 1, beside)
           + chunked(dm, dk, dn, tp, k.sms) + k.gemm(dk, dn, dm, bpv))
    return fwd, bwd


def _patch(obj, name: str, value, undo: List):
    undo.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def te_streams(undo: List) -> None:
    _patch(kernels, "tp_overlap_gemms", _te_streams_gemms, undo)


def fp32_reduce_scatter(undo: List) -> None:
    plain = cost_model.StageCostModel.stage

    def stage(self, start, end, first, last, group, tp, dp, mb, pp, **kw):
        c = plain(self, start, end, first, last, group, tp, dp, mb, pp, **kw)
        if dp > 1 and c.dp_sync > 0:   # the reduce-scatter half again: 4-byte gradients where it priced 2
            _, (bw, lat) = self.group_links(group, tp, dp)
            per_rank = self.span_params(start, end, first, last, pp, tp)
            c.dp_sync += cost_model.all_reduce_time(per_rank * self.opts.bytes_per_value, dp, bw, lat) / 2
        return c
    _patch(cost_model.StageCostModel, "stage", stage, undo)


def nic_spread(undo: List) -> None:
    plain = cost_model.StageCostModel.group_links

    def group_links(self, group, tp, dp):
        (tb, tl), (db, dl) = plain(self, group, tp, dp)
        nodes: Dict[int, int] = {}
        for d in group[0::tp]:
            node = self.dev.cluster.devices[d].node
            nodes[node] = nodes.get(node, 0) + 1
        if dp > 1 and len(nodes) > 1:
            db *= min(nodes.values())
        return (tb, tl), (db, dl)
    _patch(cost_model.StageCostModel, "group_links", group_links, undo)


INTER_NODE_EFFICIENCY = [0.9]   # --inter-node-efficiency


def inter_node_efficiency(undo: List) -> None:
    from hrlplan.cost import device_model

    def bw(self, a: int, b: int) -> float:
        key = (a, b)
        if key not in self._bw_cache:
            devices = self.cluster.devices
            across = devices[a].node != devices[b].node
            inside = device_model.link_efficiency(self.cluster, a, b) if self.sourced_links else self.bw_eff
            self._bw_cache[key] = self.cluster.bw(a, b) * (INTER_NODE_EFFICIENCY[0] if across else inside)
        return self._bw_cache[key]
    _patch(device_model.DeviceModel, "bw", bw, undo)


VARIANTS: Dict[str, Callable[[List], None]] = {"te_streams": te_streams, "fp32_reduce_scatter": fp32_reduce_scatter,
                                               "nic_spread": nic_spread, "inter_node_efficiency": inter_node_efficiency}


def records(source, workdir: Path) -> List:
    """(row, model record, cluster, cost options) of every row, through the command line once."""
    out = []
    for row in source.rows:
        r = published.predict_row(row, workdir, source)
        run_dir = workdir / f"{source.key}-{row.name}.run"
        fields = {f.name for f in dataclasses.fields(CostOptions)}
        opts = CostOptions(**{k: v for k, v in (r.get("cost_options") or {}).items() if k in fields})
        out.append((row, ModelMeta.load(run_dir / "model_meta.json"), ClusterSpec.load(run_dir / "cluster.json"), opts))
    return out


def evaluate(source, recs) -> Dict:
    rows = []
    for row, meta, cluster, opts in recs:
        lay = dataclasses.replace(published.layout_of(row), sequence_parallel=row.sequence_parallel and row.tp > 1)
        res = Simulator(meta, cluster, opts).evaluate(lay, detail=True)   # the authors ran it: time only
        flops = source.flops(row, source.seq, source.vocab)
        pred = flops / res.step_time_s / row.gpus / 1e12
        b = res.breakdown
        pipeline = (b["pipeline_end_s"] - b["dp_comm_exposed_s"]) if b else float("nan")
        measured_step = flops / row.gpus / (row.measured_tflops * 1e12)
        rows.append({"model": row.name, "ratio": pred / row.measured_tflops, "predicted_tflops": pred,
                     "dp_exposed_share": b["dp_comm_exposed_s"] / res.step_time_s if b else float("nan"),
                     "measured_over_pipeline": measured_step / pipeline})
    errors = [abs(r["ratio"] - 1) for r in rows]
    return {"rows": rows, "median": statistics.median(errors), "max": max(errors),
            "spearman": published.spearman([r["predicted_tflops"] for r in rows],
                                            [row.measured_tflops for row, *_ in recs])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="megatron-h100", choices=sorted(BY_KEY))
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                    help="evaluate this variant (repeatable; each alone, then all named together)")
    ap.add_argument("--inter-node-efficiency", type=float, default=INTER_NODE_EFFICIENCY[0],
                    help="the inter_node_efficiency variant's fraction of a link between nodes")
    args = ap.parse_args(argv)
    INTER_NODE_EFFICIENCY[0] = args.inter_node_efficiency
    source = BY_KEY[args.source]
    names = args.variant or sorted(VARIANTS)
    combos = [()] + [(n,) for n in names] + ([tuple(names)] if len(names) > 1 else [])
    # a row over memory is still asked for its time (the authors ran it): skip the memory refusal
    plain_check = Simulator._memory_check
    Simulator._memory_check = lambda self, layout, need: (plain_check(self, layout, need)[0], "")
    with tempfile.TemporaryDirectory(prefix="whatif-") as tmp:
        recs = records(source, Path(tmp))
        for combo in combos:
            undo: List = []
            for n in combo:
                VARIANTS[n](undo)
            try:
                s = evaluate(source, recs)
            finally:
                for obj, name, value in reversed(undo):
                    setattr(obj, name, value)
            print(f"{'+'.join(combo) or 'as committed'}: median {100 * s['median']:.1f}%, max {100 * s['max']:.1f}%, "
                  f"Spearman {s['spearman']:.2f}")
            print("   " + " ".join(f"{r['model']} {r['ratio']:.3f} (dp {r['dp_exposed_share']:.2f}, "
                                   f"meas/pipe {r['measured_over_pipeline']:.2f})" for r in s["rows"]), flush=True)
    Simulator._memory_check = plain_check
    return 0


if __name__ == "__main__":
    sys.exit(main())
