"""`hrlplan` command line: train | doctor | probe-cluster | introspect-model | train-hrl | plan-hrl | show-plan | memory-guide | ...

Each subcommand is a thin shell over a library function; errors a user can fix print one line
(`hrlplan: error: ...`) and exit 2, without a traceback. The entries' layer: it may import any
module, and imports each one inside its subcommand, so `hrlplan --help` starts without torch.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import List, Optional

from hrlplan.errors import UserError


def _probe_cluster(args: argparse.Namespace) -> None:
    from hrlplan.launch.probe import probe_cluster_cli

    probe_cluster_cli(args)


def _introspect_model(args: argparse.Namespace) -> None:
    from hrlplan.model_meta import introspect, resolve_arch

    meta = introspect(resolve_arch(args.model_id), seq_len=args.seq_len)
    meta.save(args.out)
    print(json.dumps({"name": meta.name, "total_params": meta.total_params, "n_layer": meta.n_layer,
                      "training_flops_per_token": meta.training_flops_per_token(), "out": args.out}, indent=1))


def _memory_guide(args: argparse.Namespace) -> None:
    from hrlplan.memory_guide import main

    main([a for a in args.rest if a != "--"])


def _delegate(module: str, func: str):
    def run(args: argparse.Namespace) -> None:
        getattr(importlib.import_module(module), func)(args)
    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hrlplan", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("train", help="probe, plan and train: the Hydra app of pretrain.py (hrlplan train [key=value ...])")
    s = sub.add_parser("probe-cluster", help="measure devices and the bandwidth matrix; write cluster.json")
    s.add_argument("--out", default="cluster.json")
    s.add_argument("--nproc-per-node", default="auto", help="workers to probe on this node (auto: GPUs or cores)")
    s.add_argument("--preset", help="write a conf/cluster/<preset>.yaml cluster instead of probing")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the device the workers will train on (train.device)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the training dtype the matmul peak is measured in (train.dtype)")
    s.add_argument("--wandb", default="disabled", choices=["disabled", "offline", "online"],
                   help="also log the probe as a W&B run (job_type=probe) beside --out")
    s.set_defaults(func=_probe_cluster)

    s = sub.add_parser("introspect-model", help="parameters, FLOPs, activations per block; write model_meta.json")
    s.add_argument("--model-id", required=True, help="a shipped arch (gpt2, llama-7b, ...), a local dir, a config file or an HF-cache id")
    s.add_argument("--out", default="model_meta.json")
    s.add_argument("--seq-len", type=int, default=None)
    s.set_defaults(func=_introspect_model)

    for name, helptext in (("train-hrl", "train the hierarchical-RL planner against the simulator"),
                           ("plan-hrl", "sample plans from a trained policy; export the best")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--cluster", required=True, help="cluster.json, or a conf/cluster preset name")
        s.add_argument("--model-meta", required=True, help="model_meta.json, or a shipped arch name")
        s.add_argument("--planner-cfg", default=None, help="YAML with planner.* and train.* keys")
        if name == "train-hrl":
            s.add_argument("--out-dir", required=True)
        else:
            s.add_argument("--checkpoint-dir", default=None, help="default: the shipped generalist policy")
            s.add_argument("--out", default="plan.yaml")
            s.add_argument("--out-info", default="plan_info.json")
        s.set_defaults(func=_delegate("hrlplan.search.commands", name.replace("-", "_")))

    s = sub.add_parser("show-plan", help="print a plan's layout, per-stage table and why it won")
    s.add_argument("plan")
    s.add_argument("--info", default=None, help="plan_info.json (default: beside the plan)")
    s.set_defaults(func=_delegate("hrlplan.search.commands", "show_plan"))

    s = sub.add_parser("calibrate", help="measure per-block and p2p times on the devices; store them in cluster.json")
    s.add_argument("--cluster", required=True)
    s.add_argument("--model-id", required=True)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the train.dtype the calibration will predict (bf16 computes under autocast)")
    s.add_argument("--out", default=None, help="default: overwrite --cluster")
    s.set_defaults(func=_delegate("hrlplan.launch.calibrate", "calibrate_cli"))

    s = sub.add_parser("build-sudoku", help="generate a Sudoku data set (presets: sudoku-extreme-small, sudoku-extreme-1k-aug-1000)")
    s.add_argument("preset_or_dir")
    s.add_argument("--out-dir", default=None)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_delegate("hrlplan.data.sudoku", "build_cli"))

    s = sub.add_parser("build-code-corpus", help="gather installed Python source, train a byte-level BPE tokenizer")
    s.add_argument("--out-dir", default="data/code")
    s.add_argument("--vocab-size", type=int, default=4096)
    s.add_argument("--max-files", type=int, default=2000)
    s.add_argument("--tokenizer", default=None, help="a local tokenizer.json / HF-cache tokenizer instead of training one")
    s.add_argument("--source", default=None, help="a directory of .py / CodeSearchNet .jsonl(.gz) / .parquet files")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_delegate("hrlplan.data.code_corpus", "build_cli"))

    s = sub.add_parser("doctor", help="first-day checks of this node (GPU or CPU): pass/fail/skip with figures")
    s.add_argument("--out", default=None, help="also write the results as a TSV file")
    s.set_defaults(func=_delegate("hrlplan.doctor", "doctor_cli"))

    s = sub.add_parser("memory-guide", help="what fits each memory size: HRM shapes and batch, or an LM plan's "
                                            "micro-batch and recompute per stage", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER, help="arch=hrm ... (see hrlplan memory-guide --help)")
    s.set_defaults(func=_memory_guide)

    s = sub.add_parser("evaluate", help="load an HRM checkpoint; report exact accuracy on the test split")
    s.add_argument("checkpoint")
    s.add_argument("--data-path", default=None)
    s.set_defaults(func=_delegate("hrlplan.runtime.hrm_trainer", "evaluate_cli"))
    return p


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-sc"], ["--shell-completion"]) or (argv and argv[0].startswith("--shell-completion=")):
        # `eval "$(hrlplan train -sc install=bash)"` makes bash call `hrlplan -sc query=bash`
        words = os.environ.get("COMP_LINE", "").split()
        if "query=" not in " ".join(argv) or words[1:2] == ["train"]:
            from hrlplan.app import run

            return run(argv)
        return   # other subcommands: the shell's own file completion
    if argv[:1] == ["train"]:   # the Hydra app itself: Hydra parses the overrides (and --help, -m)
        from hrlplan.app import run

        return run(argv[1:])
    if argv[:1] == ["memory-guide"]:   # its own parser: options (--help too) may come first
        argv = ["memory-guide", "--", *argv[1:]] if len(argv) > 1 else argv
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"hrlplan: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
