"""train.compile's speed-up on this CPU: one process, the runtime's own stage module (the whole
model as one HFStage) trained eagerly and with every block compiled (runtime/compile.apply_compile),
in alternating rounds so both see the same machine load.

    python bench/compile.py [--models gpt2-tiny,llama-small] [--steps 10] [--rounds 5] [--threads 1]
                            [--out bench/results/compile.json]

Per model and recompute mode: the compile time (first step minus a steady one), each variant's
median step time (forward + backward + AdamW) with its min-max over all measured steps, and the
speed-up eager/compiled -- the median of each round's ratio, with its min-max. That figure is what
the cost model's configured compile speed-up (proposed: planner.cost.compile_speedup) should come
from on a given machine; on GPUs it must be measured there (inductor's Triton kernels differ).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hrlplan.compose import compose  # noqa: E402
from hrlplan.models.hf import build_stage_modules, causal_lm_loss  # noqa: E402
from hrlplan.runtime.compile import apply_compile  # noqa: E402
from hrlplan.runtime.recompute import apply_recompute  # noqa: E402
from hrlplan.runtime.trainer import build_full_model  # noqa: E402

MODELS = {
    "gpt2-tiny": ["arch=gpt2-tiny", "arch.n_layer=4"],
    "gpt2-small-ish": ["arch=gpt2-tiny", "arch.n_layer=4", "arch.n_embd=256", "arch.n_head=4",
                       "arch.vocab_size=2048", "arch.n_positions=256"],
    "llama-small": ["arch=llama-tiny", "arch.num_hidden_layers=4", "arch.hidden_size=256",
                    "arch.intermediate_size=688", "arch.num_attention_heads=4", "arch.num_key_value_heads=2",
                    "arch.vocab_size=2048", "arch.max_position_embeddings=256"],
}


def build(overrides: List[str], compiled: bool, recompute: str):
    cfg = compose(overrides)
    model = build_full_model(cfg["arch"], 0)
    [part] = build_stage_modules(model, [(0, model.config.num_hidden_layers)])
    apply_recompute(part, recompute)
    if compiled:
        apply_compile(part)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-4, foreach=True)
    return part, opt, int(cfg["arch"].get("vocab_size"))


def step(part, opt, inputs, targets) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    causal_lm_loss(part(inputs), targets).backward()
    opt.step()
    return time.perf_counter() - t0


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(name: str, recompute: str, batch: int, seq: int, steps: int, rounds: int) -> Dict[str, object]:
    overrides = MODELS[name]
    variants = {flag: build(overrides, flag, recompute) for flag in (False, True)}
    vocab = variants[False][2]
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    first = {flag: step(p, o, inputs, targets) for flag, (p, o, _) in variants.items()}   # compiles
    for p, o, _ in variants.values():
        step(p, o, inputs, targets)   # the optimizer's state exists from here on
    times: Dict[bool, List[float]] = {False: [], True: []}
    ratios = []
    for r in range(rounds):
        medians = {}
        for flag in ((False, True) if r % 2 == 0 else (True, False)):
            p, o, _ = variants[flag]
            run = [step(p, o, inputs, targets) for _ in range(steps)]
            times[flag] += run
            medians[flag] = statistics.median(run)
        ratios.append(medians[False] / medians[True])
    return {"model": name, "recompute": recompute, "batch": batch, "seq_len": seq,
            "compile_s": first[True] - statistics.median(times[True]),
            "eager_step_s": spread(times[False]), "compiled_step_s": spread(times[True]),
            "speedup": spread(ratios), "rounds": rounds, "steps_per_round": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-tiny,gpt2-small-ish,llama-small")
    ap.add_argument("--recompute", default="none,selective")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        for recompute in args.recompute.split(","):
            row = measure(name, recompute, args.batch, args.seq, args.steps, args.rounds)
            rows.append(row)
            e, c, s = row["eager_step_s"], row["compiled_step_s"], row["speedup"]
            print(f"{name:15s} recompute={recompute:9s} eager {e['median'] * 1e3:7.1f} ms "
                  f"[{e['min'] * 1e3:.1f}-{e['max'] * 1e3:.1f}]  compiled {c['median'] * 1e3:7.1f} ms "
                  f"[{c['min'] * 1e3:.1f}-{c['max'] * 1e3:.1f}]  speed-up {s['median']:.2f}x "
                  f"[{s['min']:.2f}-{s['max']:.2f}]  compile {row['compile_s']:.1f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
