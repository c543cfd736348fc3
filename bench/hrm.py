"""HRM benchmark on CPU: steps per second, loss and exact accuracy after a fixed number of steps.

    python bench/hrm.py [--steps 300] [--sizes small,medium] [--data data/sudoku-extreme-small]
                        [--lr 1e-4] [--threads 2] [--out bench/results/hrm.json]

Sizes are the HRM guide's: small = hidden 32, 1+1 layers, 1 head, expansion 2, batch 4 (its
basic command); medium = hidden 64, 2+2 layers, 2 heads, expansion 2, batch 8 (its 5-10 GB row).
Training uses the guide's optimiser settings (lr = puzzle_emb_lr = 1e-4, weight decay 1.0, no
warm-up) in one gloo process; steps/s is measured over the training steps only (evaluation and
checkpoints excluded). Evaluation runs every test puzzle for halt_max_steps segments.
Not part of the tests; results go to bench/results/ (git-ignored).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hrlplan.data.sudoku import ensure_sudoku_dataset  # noqa: E402
from hrlplan.runtime.hrm_trainer import train_hrm  # noqa: E402

SIZES = {
    "small": dict(arch=dict(hidden_size=32, H_layers=1, L_layers=1, num_heads=1, expansion=2), global_batch_size=4),
    "medium": dict(arch=dict(hidden_size=64, H_layers=2, L_layers=2, num_heads=2, expansion=2), global_batch_size=8),
}


class _Collect:
    def __init__(self):
        self.records = []

    def log(self, metrics, step):
        self.records.append((step, dict(metrics)))


def bench_size(name: str, data: str, steps: int, lr: float, seed: int) -> dict:
    size = SIZES[name]
    arch = dict(name="hrm", family="hrm", H_cycles=2, L_cycles=2, halt_max_steps=16, halt_exploration_prob=0.1,
                puzzle_emb_ndim=size["arch"]["hidden_size"], **size["arch"])
    train = dict(epochs=None, steps=steps, eval_interval=None, global_batch_size=size["global_batch_size"], lr=lr,
                 puzzle_emb_lr=lr, weight_decay=1.0, puzzle_emb_weight_decay=1.0, warmup_steps=0, min_lr_ratio=1.0,
                 seed=seed, checkpoint_interval=0, resume="none", device="cpu", dp_mode="fsdp", grad_clip=0.0,
                 log_interval=max(1, steps // 20))
    logger = _Collect()
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.time()
        result = train_hrm({"arch": arch, "train": train, "data": {"path": data}}, run_dir, None, logger)
        wall = time.time() - started
    losses = [(s, m["train/lm_loss"]) for s, m in logger.records if "train/lm_loss" in m]
    return {
        "size": name, "hidden_size": arch["hidden_size"], "H_layers": arch["H_layers"], "L_layers": arch["L_layers"],
        "global_batch_size": train["global_batch_size"], "steps": result["step"],
        "params": next(m["num_params"] for _, m in logger.records if "num_params" in m),
        "steps_per_second": result["steps_per_second"], "wall_seconds": wall,
        "first_lm_loss": losses[0][1], "final_lm_loss": losses[-1][1],
        "eval_lm_loss": result.get("eval/lm_loss"), "eval_token_accuracy": result.get("eval/accuracy"),
        "eval_exact_accuracy": result.get("eval/exact_accuracy"), "loss_curve": losses,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--data", default="data/sudoku-extreme-small")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("DISABLE_COMPILE", "1")
    ensure_sudoku_dataset(args.data)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        rows = [bench_size(name, args.data, args.steps, args.lr, args.seed) for name in args.sizes.split(",")]
    finally:
        dist.destroy_process_group()
    header = f"{'size':<7} {'hidden':>6} {'H+L':>4} {'batch':>5} {'params':>8} {'steps':>6} {'steps/s':>8} " \
             f"{'loss0':>6} {'lossN':>6} {'eval loss':>9} {'cell acc':>8} {'exact acc':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['size']:<7} {r['hidden_size']:>6} {r['H_layers']}+{r['L_layers']:<2} {r['global_batch_size']:>5} "
              f"{r['params']:>8,} {r['steps']:>6} {r['steps_per_second']:>8.2f} {r['first_lm_loss']:>6.3f} "
              f"{r['final_lm_loss']:>6.3f} {r['eval_lm_loss']:>9.3f} {r['eval_token_accuracy']:>8.3f} "
              f"{r['eval_exact_accuracy']:>9.3f}")
    out = Path(args.out or f"bench/results/hrm-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpu_threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
               "load_average": os.getloadavg(), "processor": platform.processor() or platform.machine()}
    out.write_text(json.dumps({"settings": vars(args), "machine": machine, "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
