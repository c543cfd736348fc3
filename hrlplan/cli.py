"""`hrlplan` command line: train | doctor | probe-cluster | introspect-model | train-hrl | plan-hrl | show-plan | memory-guide | ...

Each subcommand is a thin shell over a library function; errors a user can fix print one line
(`hrlplan: error: ...`) and exit 2, without a traceback. Every file a subcommand reads is checked
first (it exists, is a file, parses), and a file that fails is named with what to do
(check_inputs), before anything slow starts; the files it writes must have an existing directory.
The entries' layer: it may import any module, and imports each one inside its subcommand, so
`hrlplan --help` starts without torch.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from hrlplan.errors import UserError, one_line

CLUSTER_HINT = "give a cluster.json written by `hrlplan probe-cluster`, or a preset name"
META_HINT = "give a model_meta.json written by `hrlplan introspect-model`, or a shipped arch name (gpt2, ...)"
MODEL_HINT = "give a shipped arch (gpt2, ...), a local model directory with a valid config.json, or a config file"
PLANNER_CFG_HINT = "give a YAML file of planner: and train: keys"


def _probe_cluster(args: argparse.Namespace) -> None:
    from hrlplan.launch.probe import probe_cluster_cli

    probe_cluster_cli(args)


def _introspect_model(args: argparse.Namespace) -> None:
    from hrlplan.model_meta import introspect, resolve_arch

    meta = _loaded("--model-id", args.model_id, MODEL_HINT,
                   lambda: introspect(resolve_arch(args.model_id), seq_len=args.seq_len))
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


# ---------------------------------------------------------------- the files a subcommand reads and writes
def _loaded(flag: str, value: str, hint: str, load: Callable[[], Any]) -> Any:
    """load(), its failure one line naming the argument: a hand-edited file can fail in any parser."""
    try:
        return load()
    except UserError as e:
        message = one_line(e)
        raise UserError(message if value in message else f"{flag} {value}: {message}") from None
    except Exception as e:
        raise UserError(f"{flag} {value} is not usable ({one_line(e, 300)}): {hint}") from None


def _path_like(value: str) -> bool:
    """A value meant as a path (not a preset, arch name or Hugging Face id such as org/model)."""
    return value.startswith((".", "/", "~")) or Path(value).suffix in (".json", ".yaml", ".yml", ".pth", ".pt")


def _existing(flag: str, value: str, hint: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"{flag} {value}".strip() + f" does not exist: {hint}")
    return path


def _text(label: str, path: Path, hint: str) -> str:
    if path.is_dir():
        raise UserError(f"{label} is a directory: {hint}")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"{label} is not a text file: {hint}") from None
    except OSError as e:
        raise UserError(f"{label} cannot be read ({e.strerror}): {hint}") from None


def _json_object(label: str, path: Path, hint: str) -> Dict[str, Any]:
    try:
        data = json.loads(_text(label, path, hint))
    except json.JSONDecodeError as e:
        raise UserError(f"{label} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {hint}") from None
    if not isinstance(data, dict):
        raise UserError(f"{label} holds a JSON {type(data).__name__}, not an object: {hint}")
    return data


def _cluster_arg(flag: str, value: str) -> None:
    from hrlplan.search.instances import load_cluster

    if Path(value).exists() or os.sep in value or _path_like(value):
        _json_object(f"{flag} {value}", _existing(flag, value, CLUSTER_HINT), CLUSTER_HINT)
    _loaded(flag, value, CLUSTER_HINT, lambda: load_cluster(value))


def _meta_arg(flag: str, value: str) -> None:
    from hrlplan.search.instances import load_meta

    path = Path(value)
    if path.suffix == ".json" or (_path_like(value) and not path.exists()):
        _json_object(f"{flag} {value}", _existing(flag, value, META_HINT), META_HINT)
    _loaded(flag, value, META_HINT, lambda: load_meta(value))


def _model_arg(flag: str, value: str) -> None:
    from hrlplan.model_meta import resolve_arch

    path = Path(value).expanduser()
    if _path_like(value):
        _existing(flag, value, MODEL_HINT)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UserError(f"{flag} {value} is a directory without config.json: {MODEL_HINT}")
        data = _json_object(f"{flag} {value}: {config}", config, "restore the model's config.json")
        if "model_type" not in data:
            raise UserError(f"{flag} {value}: {config} has no model_type (e.g. \"model_type\": \"gpt2\"); "
                            "restore the model's config.json")
    elif path.is_file() and path.suffix == ".json":
        _json_object(f"{flag} {value}", path, MODEL_HINT)
    _loaded(flag, value, MODEL_HINT, lambda: resolve_arch(value))


def _planner_cfg_arg(flag: str, value: str) -> None:
    from hrlplan.yaml_budget import parse_yaml_limited

    label = f"{flag} {value}"
    text = _text(label, _existing(flag, value, PLANNER_CFG_HINT), PLANNER_CFG_HINT)
    try:
        data = parse_yaml_limited(text)
    except (yaml.YAMLError, ValueError) as e:
        raise UserError(f"{label} is not valid YAML ({one_line(e, 200)}): {PLANNER_CFG_HINT}") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"{label} holds a YAML {type(data).__name__}, not a mapping: {PLANNER_CFG_HINT}")


def _existing_arg(hint: str) -> Callable[[str, str], None]:
    def check(flag: str, value: str) -> None:
        _existing(flag, value, hint)
    return check


def _directory_arg(hint: str) -> Callable[[str, str], None]:
    def check(flag: str, value: str) -> None:
        if not _existing(flag, value, hint).is_dir():
            raise UserError(f"{flag} {value} is not a directory: {hint}")
    return check


def _tokenizer_arg(flag: str, value: str) -> None:
    if _path_like(value):
        _existing(flag, value, "give a tokenizer.json file, or an id in the local Hugging Face cache")


def _output_file(flag: str, value: str) -> None:
    path = Path(value).expanduser()
    if path.is_dir():
        raise UserError(f"{flag} {value} is a directory: give the name of the file to write")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {value}: the directory {parent} does not exist; create it (mkdir -p {parent}) "
                        f"or choose another {flag}")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {value}: the directory {parent} is not writable; choose another {flag}")


def _output_dir(flag: str, value: str) -> None:
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {value} is a file, not a directory: choose another {flag}")


CHECKPOINT_HINT = "give a run's checkpoints directory (<run dir>/checkpoints), one step_<N> directory, or a run directory"
# subcommand -> (argument, as the user typed it, its check): every file read or written, checked in
# this order before the subcommand starts (reading a plan is show-plan's own first step).
ARGUMENT_CHECKS: Dict[str, List[Tuple[str, str, Callable[[str, str], None]]]] = {
    "probe-cluster": [("out", "--out", _output_file)],
    "introspect-model": [("model_id", "--model-id", _model_arg), ("out", "--out", _output_file)],
    "train-hrl": [("cluster", "--cluster", _cluster_arg), ("model_meta", "--model-meta", _meta_arg),
                  ("planner_cfg", "--planner-cfg", _planner_cfg_arg), ("out_dir", "--out-dir", _output_dir)],
    "plan-hrl": [("cluster", "--cluster", _cluster_arg), ("model_meta", "--model-meta", _meta_arg),
                 ("planner_cfg", "--planner-cfg", _planner_cfg_arg),
                 ("checkpoint_dir", "--checkpoint-dir", _existing_arg("train one with `hrlplan train-hrl`, or leave "
                                                                      "it out for the shipped generalist policy")),
                 ("out", "--out", _output_file), ("out_info", "--out-info", _output_file)],
    "calibrate": [("cluster", "--cluster", _cluster_arg), ("model_id", "--model-id", _model_arg),
                  ("out", "--out", _output_file)],
    "build-sudoku": [("out_dir", "--out-dir", _output_dir)],
    "build-code-corpus": [("source", "--source", _existing_arg("give a directory of .py / .jsonl(.gz) / .parquet "
                                                                "files")),
                          ("tokenizer", "--tokenizer", _tokenizer_arg), ("out_dir", "--out-dir", _output_dir)],
    "doctor": [("out", "--out", _output_file)],
    "evaluate": [("checkpoint", "", _existing_arg(CHECKPOINT_HINT)),
                 ("data_path", "--data-path", _directory_arg("give the data set's directory (as data.path)"))],
}


def check_inputs(args: argparse.Namespace) -> None:
    """Every file argument of the subcommand, before it starts: one UserError naming the first bad one."""
    for dest, flag, check in ARGUMENT_CHECKS.get(args.command, []):
        value = getattr(args, dest, None)
        if value is not None:
            check(flag, str(value))


def _file_arguments(args: argparse.Namespace) -> List[str]:
    return [f"{flag} {getattr(args, dest)}".strip() for dest, flag, _ in ARGUMENT_CHECKS.get(args.command, [])
            if getattr(args, dest, None) is not None]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hrlplan", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    _add_planning_commands(sub)
    _add_tool_commands(sub)
    return p


def _add_planning_commands(sub: "argparse._SubParsersAction") -> None:
    """train, probe-cluster, introspect-model, train-hrl, plan-hrl, show-plan, calibrate (in help order)."""
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
    s.add_argument("plan", help="plan.yaml, or a run directory holding one")
    s.add_argument("--info", default=None, help="plan_info.json (default: beside the plan)")
    s.set_defaults(func=_delegate("hrlplan.search.commands", "show_plan"))

    s = sub.add_parser("calibrate", help="measure per-block and p2p times on the devices; store them in cluster.json")
    s.add_argument("--cluster", required=True)
    s.add_argument("--model-id", required=True)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the train.dtype the calibration will predict (bf16 computes under autocast)")
    s.add_argument("--out", default=None, help="default: overwrite --cluster")
    s.set_defaults(func=_delegate("hrlplan.launch.calibrate", "calibrate_cli"))


def _add_tool_commands(sub: "argparse._SubParsersAction") -> None:
    """build-sudoku, build-code-corpus, doctor, memory-guide, evaluate (after the planning ones)."""
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

    s = sub.add_parser("evaluate", help="load a run's checkpoint: a language model's validation loss and "
                                        "perplexity, or HRM's exact accuracy on the test split")
    s.add_argument("checkpoint", help="<run dir>/checkpoints, one step_<N> directory, or a run directory")
    s.add_argument("--data-path", default=None, help="the data set (default: the one the run trained on)")
    s.add_argument("--batches", type=int, default=None,
                   help="language models: validation batches of the run's global batch size (default: 8)")
    s.set_defaults(func=_delegate("hrlplan.runtime.evaluate_run", "evaluate_cli"))


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
        check_inputs(args)
        args.func(args)
    except UserError as e:
        _refuse(one_line(e, 1000))
    except BrokenPipeError:   # `hrlplan ... | head`: the reader left; nothing to report (Python's advice)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (ValueError, OSError, yaml.YAMLError) as e:   # a parser's or the OS's word on an input file
        message = one_line(e, 600)
        parse_error = isinstance(e, (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError))
        named = [a for a in _file_arguments(args) if a.split(" ")[-1] in message]
        _refuse(f"{message} (reading {', '.join(_file_arguments(args))})" if parse_error and not named
                and _file_arguments(args) else message)


def _refuse(message: str) -> None:
    print(f"hrlplan: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
