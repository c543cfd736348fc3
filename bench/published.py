"""The simulator against published GPU measurements: Megatron-LM's SC'21 weak-scaling table.

    python bench/published.py [--json OUT]

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC'21, arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters on 32 to 3072 A100-80GB
GPUs (Selene: DGX A100 nodes, NVLink inside, 8x 200 Gb/s InfiniBand between), sequence 2048,
vocabulary 51,200, fp16, full activation recomputation on every row, achieved teraFLOP/s per GPU.
Layouts (tp, pp, micro-batch, global batch, layers per virtual stage, DDP implementation) are the
authors' script: NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh with
CONFIG.sh (formerly examples/sc21/). Each row is simulated as a manual plan on the a100x8-384n
preset with the node count it used, and converted to teraFLOP/s per GPU with the paper's formula
96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (it counts the recomputed forward). No row is special-cased:
the settings below describe Megatron-LM (vocabulary-parallel head, replicated data parallel,
gradients all-reduced after the backward unless torch DDP overlaps them), not a row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import sys
from pathlib import Path
from typing import Dict, List

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.cost import CostOptions, Layout, Simulator  # noqa: E402
from hrlplan.model_meta import ModelMeta  # noqa: E402

SEQ, VOCAB = 2048, 51200
SOURCE = ("Narayanan et al. SC'21 (arXiv:2104.04473) Table 1 (measured TFLOP/s per GPU); layouts: "
          "NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh + CONFIG.sh")
# name, heads, hidden, layers, tp, pp, micro-batch, global batch, nodes, layers per virtual stage
# (0: no interleaving), DDP implementation, measured teraFLOP/s per GPU (Table 1)
ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 16, 512, 4, 0, "torch", 137),
    ("3.6B", 32, 3072, 30, 2, 1, 16, 512, 8, 0, "torch", 138),
    ("7.5B", 32, 4096, 36, 4, 1, 16, 512, 16, 0, "torch", 142),
    ("18.4B", 48, 6144, 40, 8, 1, 8, 1024, 32, 0, "torch", 135),
    ("39.1B", 64, 8192, 48, 8, 2, 4, 1536, 64, 0, "local", 138),
    ("76.1B", 80, 10240, 60, 8, 4, 2, 1792, 128, 5, "local", 140),
    ("145.6B", 96, 12288, 80, 8, 8, 2, 2304, 192, 5, "local", 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1, 2160, 240, 3, "local", 155),
    ("529.6B", 128, 20480, 105, 8, 35, 1, 2520, 315, 1, "local", 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 1, 3072, 384, 0, "local", 163),
]
PRESET = Path(__file__).resolve().parent.parent / "conf" / "cluster" / "a100x8-384n.yaml"


def gpt_meta(name: str, heads: int, h: int, layers: int) -> ModelMeta:
    """Megatron's GPT (learned positions, 4h MLP, tied embedding/head) in model_meta's terms."""
    block = 12 * h * h + 13 * h
    mm = 12 * h * h
    return ModelMeta(
        name=name, family="hf", model_type="gpt2", n_layer=layers, hidden_size=h, num_heads=heads, seq_len=SEQ,
        vocab_size=VOCAB, total_params=layers * block + (VOCAB + SEQ) * h + 2 * h,
        embedding_params=(VOCAB + SEQ) * h, head_params=2 * h, block_params=[block] * layers,
        block_matmul_params=[mm] * layers, head_matmul_params=VOCAB * h,
        block_flops_fwd_per_token=[2.0 * mm + 4.0 * SEQ * h] * layers, head_flops_fwd_per_token=2.0 * VOCAB * h,
        block_activation_bytes_per_token=[float(34 * h + 5 * heads * SEQ)] * layers,
        head_activation_bytes_per_token=float(2 * h + 4 * VOCAB), tied_embeddings=True,
        first_stage_modules=["wte", "wpe"], last_stage_modules=["ln_f", "lm_head"],
        block_modules=[f"h.{i}" for i in range(layers)])


def paper_flops(batch: int, layers: int, h: int) -> float:
    """FLOPs of one iteration, the paper's formula (with recomputation)."""
    return 96.0 * batch * SEQ * layers * h * h * (1 + SEQ / (6.0 * h) + VOCAB / (16.0 * layers * h))


def layout_of(tp: int, pp: int, mb: int, gbs: int, nodes: int, layers: int, per_virtual: int) -> Layout:
    """Megatron's rank order: tp fastest, then dp, then pp (a pipeline position's group is dp-major)."""
    gpus = nodes * 8
    dp = gpus // (tp * pp)
    size = tp * dp
    groups = tuple(tuple(range(g * size, (g + 1) * size)) for g in range(pp))
    v = layers // pp // per_virtual if per_virtual else 1
    n = pp * v
    per = layers // n
    spans = tuple((k * per, (k + 1) * per) for k in range(n))
    return Layout(spans=spans, groups=groups, tp=tp, dp=dp, microbatch_size=mb, num_microbatches=gbs // (mb * dp),
                  schedule="interleaved_1f1b" if v > 1 else "1f1b", stages_per_rank=v, recompute=("full",) * n)


def spearman(a: List[float], b: List[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / ((sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5)


def run() -> Dict:
    preset = yaml.safe_load(PRESET.read_text())
    rows = []
    for name, heads, h, layers, tp, pp, mb, gbs, nodes, per_virtual, ddp, measured in ROWS:
        cfg = dict(preset, node_groups=[dict(preset["node_groups"][0], count=nodes)])
        cluster = spec_from_preset(cfg)
        opts = CostOptions(bytes_per_value=2, dp_mode="replicate", dp_overlap=(ddp == "torch"), vocab_parallel=True,
                           fused_attention=False, receive_buffers=False)   # Megatron frees each message
        lay = layout_of(tp, pp, mb, gbs, nodes, layers, per_virtual)
        res = Simulator(gpt_meta(name, heads, h, layers), cluster, opts).evaluate(lay, detail=True)
        row = {"model": name, "tp": tp, "pp": pp, "dp": lay.dp, "gpus": nodes * 8, "microbatch": mb,
               "microbatches": lay.num_microbatches, "virtual_stages": lay.stages_per_rank, "measured_tflops": measured,
               "feasible": res.feasible, "reason": res.reason,
               "peak_memory_gib": max(res.memory_bytes.values()) / 2 ** 30}
        if res.feasible:
            pred = paper_flops(gbs, layers, h) / res.step_time_s / (nodes * 8) / 1e12
            row.update(predicted_tflops=pred, ratio=pred / measured, step_time_s=res.step_time_s,
                       bubble=res.bubble_fraction)
        rows.append(row)
    ok = [r for r in rows if r["feasible"]]
    errors = [abs(r["ratio"] - 1.0) for r in ok]
    summary = {"rows": rows, "source": SOURCE, "feasible": len(ok), "median_abs_error": statistics.median(errors) if errors else None,
               "max_abs_error": max(errors) if errors else None,
               "spearman": spearman([r["predicted_tflops"] for r in ok], [r["measured_tflops"] for r in ok])
               if len(ok) > 2 else None}
    return summary


def plan_exact(names=("3.6B", "7.5B", "18.4B", "39.1B")) -> List[Dict]:
    """What `planner=exact` picks for a row's model, GPUs and global batch, recomputation searched
    (bf16, replicate as the paper's data parallel, our runtime's fused attention), against the
    paper's measured figure for its own layout."""
    from dataclasses import asdict

    from hrlplan.cost.plans import options_for_train
    from hrlplan.search import make_plan
    from hrlplan.search.config import ExactPlannerConfig

    preset = yaml.safe_load(PRESET.read_text())
    out = []
    for name, heads, h, layers, tp, pp, mb, gbs, nodes, per_virtual, ddp, measured in ROWS:
        if name not in names:
            continue
        cluster = spec_from_preset(dict(preset, node_groups=[dict(preset["node_groups"][0], count=nodes)]))
        train = dict(global_batch_size=gbs, schedule="1f1b", stages_per_rank=1, microbatches="auto",
                     dtype="bfloat16", dp_mode="replicate")
        t0 = time.perf_counter()
        plan, info = make_plan(gpt_meta(name, heads, h, layers), cluster, asdict(ExactPlannerConfig()), train)
        step = plan.meta["predicted"]["step_time_s"]
        # the paper's own layout under the same options (the runtime's fused attention, recompute as it ran)
        paper = Simulator(gpt_meta(name, heads, h, layers), cluster, options_for_train(train)).evaluate(
            layout_of(tp, pp, mb, gbs, nodes, layers, per_virtual))
        out.append({"model": name, "paper_layout_step_s": paper.step_time_s, "pick_step_s": step,
                    "predicted_speedup_over_paper_layout": paper.step_time_s / step, "gpus": nodes * 8, "paper_layout": f"tp{tp} pp{pp} mb{mb}",
                     "pick": f"tp{plan.stages[0].tp} pp{plan.pp} dp{plan.dp} mb{plan.microbatch_size}x"
                             f"{plan.num_microbatches} recompute {sorted({s.recompute for s in plan.stages})}",
                     "predicted_tflops": paper_flops(gbs, layers, h) / step / (nodes * 8) / 1e12,
                     "measured_tflops_paper_layout": measured, "proven_optimal": plan.meta["planner"]["proven_optimal"],
                     "plan_time_s": time.perf_counter() - t0})
        r = out[-1]
        print(f"{name:>7} on {r['gpus']:>4} GPUs: exact picks {r['pick']} -> {r['predicted_tflops']:.0f} TFLOP/s "
              f"by the paper's formula (paper's {r['paper_layout']}: {measured} measured; predicted "
              f"{r['predicted_speedup_over_paper_layout']:.2f}x its step); proven {r['proven_optimal']}, "
              f"{r['plan_time_s']:.0f} s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows and the summary here")
    ap.add_argument("--plan-exact", action="store_true",
                    help="also run planner=exact on the 3.6B-39.1B rows' model, GPUs and batch")
    args = ap.parse_args(argv)
    s = run()
    print(f"{'model':>8} {'tp':>2} {'pp':>3} {'dp':>3} {'gpus':>5} {'mb':>3} {'m':>4} {'v':>2} {'mem GiB':>8} "
          f"{'bubble':>6} {'pred TF':>7} {'meas TF':>7} {'ratio':>6}")
    for r in s["rows"]:
        if not r["feasible"]:
            print(f"{r['model']:>8} infeasible: {r['reason']}")
            continue
        print(f"{r['model']:>8} {r['tp']:>2} {r['pp']:>3} {r['dp']:>3} {r['gpus']:>5} {r['microbatch']:>3} "
              f"{r['microbatches']:>4} {r['virtual_stages']:>2} {r['peak_memory_gib']:>8.1f} {r['bubble']:>6.3f} "
              f"{r['predicted_tflops']:>7.1f} {r['measured_tflops']:>7d} {r['ratio']:>6.3f}")
    if s["median_abs_error"] is not None:
        print(f"rows simulated {s['feasible']}/{len(s['rows'])}; median |error| {100 * s['median_abs_error']:.1f}%, "
              f"max |error| {100 * s['max_abs_error']:.1f}%, Spearman {s['spearman']:.2f}")
    print(f"source: {s['source']}")
    if args.plan_exact:
        s["exact"] = plan_exact()
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
