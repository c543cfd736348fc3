"""Five layouts a torch-native trainer runs at scale, written as hrlplan plans and predicted through
the product's own command line (issue 32):

    python bench/torch_native/layouts.py [--write] [--json OUT]

--write regenerates the plan files beside this script from LAYOUTS; without it each committed
plan is predicted by

    python pretrain.py mode=plan planner=manual planner.plan_file=bench/torch_native/<name>.yaml
        cluster=h100x8-16n cluster.node_groups.0.count=<nodes> arch=llama-70b arch.<shape keys>...
        data.seq_len=8192 train.global_batch_size=<gbs> train.dtype=bfloat16 train.dp_mode=fsdp

and the figures (step time, tokens/s per GPU, peak memory per rank) are read from the run's
plan_info.json and plan.yaml. The models are Llama-3 shapes (8B, 70B, 405B: the architecture of
Meta's released configs, sequence 8192, vocabulary 128,256); the layouts are the kind torchtitan
documents for them (FSDP2 x TP with sequence parallelism, 1F1B and interleaved pipelines, op-level
selective or full activation checkpointing). Three also compile and train in Float8 where the
TorchTitan paper's (arXiv:2410.06511) runs of that size did: 8B on 8 GPUs (1D FSDP), 70B on 256 (FSDP
x TP) and 405B on 512 (FSDP x TP x PP), with torch.compile and Float8. A sixth is a 128k-context
405B layout with context parallelism (cp 8 beside tp 8 and pp 8, the long-context shape Meta's Llama 3
paper describes, at 512 GPUs). Nothing here is fitted to any measured figure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from hrlplan.cluster import spec_from_preset  # noqa: E402
from hrlplan.cost import Layout  # noqa: E402
from hrlplan.plan import homogeneous_plan  # noqa: E402
from hrlplan.search.space import launch_for  # noqa: E402

SEQ, VOCAB = 8192, 128256
PRESET = "h100x8-16n"
# Llama-3 shapes: hidden, intermediate, layers, attention heads, key-value heads
SHAPES = {"llama3-8b": (4096, 14336, 32, 32, 8), "llama3-70b": (8192, 28672, 80, 64, 8),
          "llama3-405b": (16384, 53248, 126, 128, 8)}
# name: model, nodes of 8 H100s, pp, tp, micro-batch size, micro-batches, schedule, virtual stages
# per rank, recompute, sequence parallel; optional: cp (context parallel, default 1), seq (default
# SEQ), compile and float8 (train.compile / train.float8, default off)
LAYOUTS: Dict[str, Dict] = {
    "llama3-8b-fsdp8-sac": dict(model="llama3-8b", nodes=1, pp=1, tp=1, mb=1, m=1, schedule="1f1b", v=1,
                                recompute="selective", sp=False, compile=True, float8=True),
    "llama3-8b-fsdp32-tp2-sp-sac": dict(model="llama3-8b", nodes=8, pp=1, tp=2, mb=2, m=1, schedule="1f1b", v=1,
                                        recompute="selective", sp=True),
    "llama3-70b-fsdp32-tp8-sp-full": dict(model="llama3-70b", nodes=32, pp=1, tp=8, mb=2, m=1, schedule="1f1b",
                                          v=1, recompute="full", sp=True, compile=True, float8=True),
    "llama3-70b-pp4-1f1b-tp8-sp-sac": dict(model="llama3-70b", nodes=64, pp=4, tp=8, mb=1, m=8, schedule="1f1b",
                                           v=1, recompute="selective", sp=True),
    "llama3-405b-pp8-interleaved-tp8-sp-full": dict(model="llama3-405b", nodes=64, pp=8, tp=8, mb=1, m=16,
                                                    schedule="interleaved_1f1b", v=2, recompute="full", sp=True,
                                                    compile=True, float8=True),
    "llama3-405b-128k-pp8-interleaved-tp8-cp8-sp-full": dict(model="llama3-405b", nodes=64, pp=8, tp=8, cp=8,
                                                             seq=131072, mb=1, m=16, schedule="interleaved_1f1b",
                                                             v=2, recompute="full", sp=True),
}


def _cluster(nodes: int):
    preset = yaml.safe_load((ROOT / "conf" / "cluster" / f"{PRESET}.yaml").read_text())
    return spec_from_preset(dict(preset, node_groups=[dict(preset["node_groups"][0], count=nodes)]))


def global_batch(spec: Dict) -> int:
    dp = spec["nodes"] * 8 // (spec["pp"] * spec["tp"] * spec.get("cp", 1))
    return spec["mb"] * spec["m"] * dp


def write_plan(name: str, path: Path) -> None:
    """The layout as a user writes it: even spans (the earlier stages one block more where they do
    not divide), the torchrun launch map, nothing predicted."""
    spec = LAYOUTS[name]
    layers = SHAPES[spec["model"]][2]
    gpus = spec["nodes"] * 8
    n = spec["pp"] * spec["v"]
    size = gpus // spec["pp"]
    bounds = [round(k * layers / n) for k in range(n + 1)]
    groups = tuple(tuple(range(g * size, (g + 1) * size)) for g in range(spec["pp"]))
    cp = spec.get("cp", 1)
    lay = Layout(spans=tuple(zip(bounds[:-1], bounds[1:])), groups=groups, tp=spec["tp"],
                 dp=size // (spec["tp"] * cp), microbatch_size=spec["mb"], num_microbatches=spec["m"],
                 schedule=spec["schedule"], stages_per_rank=spec["v"], cp=cp)
    launch, rank_of = launch_for(_cluster(spec["nodes"]), lay)
    plan = homogeneous_plan(spec["model"], layers, list(lay.spans), dp=lay.dp, tp=spec["tp"], microbatch_size=spec["mb"],
                            num_microbatches=spec["m"], schedule=spec["schedule"], stages_per_rank=spec["v"],
                            meta={"launch": launch}, rank_order=[rank_of[d] for g in lay.groups for d in g],
                            recompute=spec["recompute"], sequence_parallel=spec["sp"], cp=cp)
    plan.save(path)


def command(name: str, plan_file: Path, run_dir: Path) -> List[str]:
    """`pretrain.py mode=plan planner=manual` for the layout (argument list)."""
    spec = LAYOUTS[name]
    h, inter, layers, heads, kv = SHAPES[spec["model"]]
    seq = spec.get("seq", SEQ)
    options = [f"train.{key}=true" for key in ("compile", "float8") if spec.get(key)]
    return [sys.executable, str(ROOT / "pretrain.py"), "mode=plan", "planner=manual", f"planner.plan_file={plan_file}",
            f"cluster={PRESET}", f"cluster.node_groups.0.count={spec['nodes']}", "arch=llama-70b",
            f"arch.name={spec['model']}", f"arch.hidden_size={h}", f"arch.intermediate_size={inter}",
            f"arch.num_hidden_layers={layers}", f"arch.num_attention_heads={heads}",
            f"arch.num_key_value_heads={kv}", f"arch.vocab_size={VOCAB}", f"arch.max_position_embeddings={seq}",
            f"data.seq_len={seq}", f"train.global_batch_size={global_batch(spec)}", "train.dtype=bfloat16",
            "train.dp_mode=fsdp", *options, f"run_dir={run_dir}", "logger.mode=disabled"]


def predict(name: str, workdir: Path) -> Dict:
    """One layout through the command line: its figures, or the refusal it printed."""
    spec = LAYOUTS[name]
    run_dir = workdir / name
    done = subprocess.run(command(name, HERE / f"{name}.yaml", run_dir), cwd=ROOT, capture_output=True, text=True)
    out = {"layout": name, "gpus": spec["nodes"] * 8, "global_batch": global_batch(spec)}
    info_file = run_dir / "plan_info.json"
    if done.returncode != 0 or not info_file.exists():
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        return dict(out, fits=False, reason=lines[-1] if lines else f"exit {done.returncode}")
    chosen = json.loads(info_file.read_text())["chosen"]
    step = float(chosen["step_time_s"])
    memory = yaml.safe_load((run_dir / "plan.yaml").read_text())["meta"]["predicted"]["memory_bytes_per_rank"]
    return dict(out, fits=step != float("inf"), step_time_s=step,
                tokens_per_s_per_gpu=global_batch(spec) * spec.get("seq", SEQ) / step / out["gpus"],
                peak_memory_gib=max(memory) / 2 ** 30, bubble=float(chosen["breakdown"].get("bubble_fraction", 0.0)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate the plan files from LAYOUTS")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.write:
        for name in LAYOUTS:
            write_plan(name, HERE / f"{name}.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [predict(name, Path(tmp)) for name in LAYOUTS]
    for r in rows:
        figure = (f"step {r['step_time_s']:.2f} s, {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, peak "
                  f"{r['peak_memory_gib']:.1f} GiB, bubble {r['bubble']:.1%}" if r.get("fits") else r.get("reason"))
        print(f"{r['layout']:<42} {r['gpus']:>4} GPUs  {figure}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("fits") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
