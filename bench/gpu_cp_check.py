"""Context parallelism on CUDA through the real engine (TorchPipelineEngine + PipelineTrainer).

    python bench/gpu_cp_check.py [--steps 4] [--seq 256] [--out cp_check.json]

What runs depends on the GPUs there are (NCCL, one rank per GPU, hrlplan's own process groups):
- any GPU count, one rank, a tiny Llama (GQA) in fp32 (TF32 off) and in bf16:
    cp1       the plain step (SDPA as usual)
    cp1_ring  the same plan with the engine's step inside torch's context_parallel over its cp
              sub-mesh of size 1: the sequence sharding, torch's DTensor dispatch of SDPA to its ring
              kernels (forward and backward), the GQA head repeat and the shape inference of torch's
              pipelining all run for real; with one rank the ring has one step, so the losses must
              equal cp1's
- 2+ GPUs: cp2 (one stage, FSDP over the 2 cp ranks); 4+ GPUs: pp2_cp2 (stage boundaries carry
  sequence shards). Their losses must equal cp1's (fp32).
Two ranks sharing ONE GPU cannot stand in for two GPUs: NCCL refuses it and gloo on CUDA tensors of
one device crashed (SIGSEGV) in the lead's probe (torch 2.11), so on one GPU the cp > 1 variants are
skipped and said. Each variant prints one JSON line: its losses; ring_fn and ring_calls, the function
the blocks called as the ring (torch's context_parallel patch of SDPA, `inner_fn`) and how often;
ring_kernel_calls, torch's ring kernels' calls where its release lets them be counted; or the error's
first line. The last line compares each with its baseline. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RING_KERNELS = ("_scaled_dot_product_ring_flash_attention", "_scaled_dot_product_ring_efficient_attention",
                "_scaled_dot_product_ring_cudnn_attention", "_scaled_dot_product_ring_flash_attention_backward",
                "_scaled_dot_product_ring_efficient_attention_backward",
                "_scaled_dot_product_ring_cudnn_attention_backward")


def _count_ring_kernels() -> Dict[str, int]:
    """Wrap torch's ring kernels (looked up by its SDPA handler at call time) to count their calls:
    proof that attention went through torch's context-parallel dispatch, not plain SDPA."""
    import importlib

    counts: Dict[str, int] = {}
    for path in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        for name in RING_KERNELS:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "_counted", False):
                continue

            def counted(*args, _fn=fn, _name=name, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*args, **kwargs)
            counted._counted = True
            setattr(module, name, counted)
        break
    return counts


def _watch_ring(seen: Dict[str, Any]) -> None:
    """Record which function the engine's blocks got as the ring (torch's context_parallel patch of
    SDPA: its `inner_fn`) and how often they called it."""
    from hrlplan.runtime import context_parallel

    torch_ring = context_parallel.ring_attention

    def watched(mesh, positions):
        ring = torch_ring(mesh, positions)
        seen["ring_fn"] = f"{getattr(ring, '__module__', '?')}.{getattr(ring, '__qualname__', '?')}"

        def attention(*args, **kwargs):
            seen["ring_calls"] = seen.get("ring_calls", 0) + 1
            return ring(*args, **kwargs)
        return attention
    context_parallel.ring_attention = watched


def _fit(plan, config, run_dir: Path, device, force_ring: bool) -> Dict[str, Any]:
    import torch

    from hrlplan.runtime.trainer import PipelineTrainer

    config = copy.deepcopy(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    config.run_dir = str(run_dir)
    torch.cuda.reset_peak_memory_stats()
    trainer = PipelineTrainer(plan, config, str(run_dir), device=device)
    if force_ring:   # a cp sub-mesh of one rank: the engine enters torch's context_parallel all the same
        trainer.engine.cp_mesh = trainer.engine.mesh["cp"]
    summary = trainer.fit()
    return {"losses": [h["train/lm_loss"] for h in summary["history"]],
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 4)}


def _worker(configs: Dict[str, Any], plan_yamls: Dict[str, str], variants: List[str], root: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from hrlplan.plan import Plan
    from hrlplan.runtime.distributed import init_distributed, shutdown

    device = init_distributed("cuda", {"collective_timeout_min": 3}).device
    counts = _count_ring_kernels()
    seen: Dict[str, Any] = {}
    _watch_ring(seen)
    out: Dict[str, Any] = {}
    try:
        for variant in variants:
            name, dtype = variant.rsplit("@", 1)
            before = dict(counts)
            seen.clear()
            start = time.perf_counter()
            try:
                row = _fit(Plan.from_yaml(plan_yamls[name]), configs[dtype], Path(root) / variant, device,
                           force_ring=name == "cp1_ring")
                row["ring_kernel_calls"] = {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
                row.update(seen)   # ring_fn, ring_calls: what the blocks called inside the context
                row["ok"] = True
            except Exception as err:   # said, and the next variant still runs
                traceback.print_exc()
                row = {"ok": False, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}
            row["wall_s"] = round(time.perf_counter() - start, 1)
            out[variant] = row
            if dist.get_world_size() > 1:
                dist.barrier()
    finally:
        shutdown()
    return out


def _plans() -> Dict[str, Any]:
    from hrlplan.plan import homogeneous_plan

    one = dict(dp=1, tp=1, microbatch_size=2, num_microbatches=2, schedule="1f1b")
    return {"cp1": homogeneous_plan("llama-tiny", 2, [(0, 2)], cp=1, **one),
            "cp1_ring": homogeneous_plan("llama-tiny", 2, [(0, 2)], cp=1, **one),
            "cp2": homogeneous_plan("llama-tiny", 2, [(0, 2)], cp=2, **one),
            "pp2_cp2": homogeneous_plan("llama-tiny", 2, [(0, 1), (1, 2)], dp=1, tp=1, cp=2, microbatch_size=1,
                                        num_microbatches=4, schedule="1f1b")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256, help="data.seq_len (a multiple of 2*cp)")
    parser.add_argument("--out", default=None, help="also write the rows here (JSON)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: context parallelism needs torch's CUDA SDPA kernels"}))
        return 0
    from hrlplan.compose import compose
    from hrlplan.config import as_config
    from hrlplan.launch.local import launch_workers

    base = ["arch=llama-tiny", "arch.num_hidden_layers=2", "arch.max_position_embeddings=4096",
            f"data.seq_len={args.seq}", "train.global_batch_size=4", f"train.steps={args.steps}", "train.lr=3e-3",
            "train.tf32=false", "train.checkpoint_interval=0", "logger.mode=disabled"]
    configs = {dtype: as_config(compose([*base, f"train.dtype={dtype}"])) for dtype in ("float32", "bfloat16")}
    plans = {name: plan.to_yaml() for name, plan in _plans().items()}
    gpus = torch.cuda.device_count()
    rows: Dict[str, Any] = {}
    groups = [(1, ["cp1@float32", "cp1_ring@float32", "cp1@bfloat16", "cp1_ring@bfloat16"]),
              (2, ["cp2@float32"]), (4, ["pp2_cp2@float32"])]
    with tempfile.TemporaryDirectory(prefix="cp-check-") as tmp:
        for world, variants in groups:
            if world > gpus:
                for v in variants:
                    rows[v] = {"ok": False, "skipped": f"needs {world} GPUs (one rank per GPU, NCCL); {gpus} here"}
                continue
            start = time.perf_counter()
            try:
                result = launch_workers(_worker, (configs, plans, variants, tmp), world, name=f"cp-check-{world}",
                                        log_dir=str(Path(tmp) / f"logs{world}"))[0]
            except Exception as err:
                result = {v: {"ok": False, "error": " ".join(str(err).split())[:500]} for v in variants}
            for v in variants:
                rows[v] = result[v]
            print(json.dumps({"launch": world, "wall_s": round(time.perf_counter() - start, 1)}), flush=True)
    for variant, row in rows.items():
        print(json.dumps({"variant": variant, **row}), flush=True)
    verdict: Dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "gpus": gpus}
    for variant, baseline in (("cp1_ring@float32", "cp1@float32"), ("cp1_ring@bfloat16", "cp1@bfloat16"),
                              ("cp2@float32", "cp1@float32"), ("pp2_cp2@float32", "cp1@float32")):
        a, b = rows.get(variant, {}), rows.get(baseline, {})
        if a.get("ok") and b.get("ok"):
            diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
            verdict[variant] = {"max_abs_loss_diff": diff, "vs": baseline, "ring_calls": a.get("ring_calls", 0),
                                "ring_fn": a.get("ring_fn"), "torch_ring_kernels_counted": bool(a.get("ring_kernel_calls"))}
    print(json.dumps({"verdict": verdict}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "verdict": verdict}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
