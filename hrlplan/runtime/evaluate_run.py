"""`hrlplan evaluate <run dir>/checkpoints`: a run's checkpoint, whichever model trained it.

- a language model (the LM runs of pretrain.py): the whole model rebuilt in this one process from
  the run's own config (<run dir>/.hydra/config.yaml), its weights loaded from the checkpoint
  (keyed by parameter name, whatever stage split, tp or dp wrote it), then the validation loss and
  perplexity over the run's validation batches -- the batches its `eval/lm_loss` used, so the figure
  of the last checkpoint equals the run's last one; --batches takes more;
- HRM (all_config.yaml beside the checkpoint, an older step_<N>/model.pt, or HRM's own step file):
  exact accuracy on the test split (runtime/hrm_io.py).

Refused in one line: a path with no checkpoint, a damaged checkpoint (naming its file), a language-
model checkpoint without its run's config, data the run trained on that is not here.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
import yaml

from hrlplan.data.lm import build_lm_data
from hrlplan.errors import UserError, one_line
from hrlplan.families import PUZZLE_DATA, family_of
from hrlplan.models.hf import causal_lm_loss
from hrlplan.runtime import hrm_io
from hrlplan.runtime.checkpoint import TIED_NAMES, checkpoint_problem
from hrlplan.runtime.trainer import build_full_model, full_vocab

RUN_CONFIG = Path(".hydra") / "config.yaml"   # the run's resolved config, as Hydra writes it
# The run's own evaluation (PipelineTrainer.evaluate) averages this many validation batches.
RUN_EVAL_BATCHES = 2


def evaluate_cli(args) -> None:
    """`hrlplan evaluate <checkpoint> [--data-path D] [--batches N]`."""
    target = str(args.checkpoint)
    if os.path.isfile(target):   # HRM's own step_<N> file, all_config.yaml beside it
        return hrm_io.evaluate_cli(args)
    found = hrm_io.find_checkpoint(target)
    if found is None:
        raise UserError(f"{target}: no checkpoint here (no step_<N>/ directory with a {hrm_io.DCP_METADATA} or "
                        "model.pt, no `latest`); give <run dir>/checkpoints of a run that saved one "
                        "(train.checkpoint_interval > 0, or a run that reached its last step)")
    if hrm_io.is_hrm_checkpoint(found):
        return hrm_io.evaluate_cli(args)
    problem = checkpoint_problem(found)
    if problem:
        raise UserError(f"{found} cannot be evaluated: {problem}; give an earlier step_<N> directory")
    config_file = run_config_file(Path(found))
    if config_file is None:
        raise UserError(f"{found}: no run config ({RUN_CONFIG}) in the run directory above it; evaluate a checkpoint "
                        "inside its run directory (<run dir>/checkpoints)")
    config = _read_config(config_file)
    if family_of(config.get("arch")).data_kind == PUZZLE_DATA:   # exact accuracy on the puzzles' test split
        return hrm_io.evaluate_cli(args)
    batches = int(args.batches or RUN_EVAL_BATCHES)
    if batches < 1:
        raise UserError(f"--batches {batches}: give a positive number of validation batches")
    metrics = evaluate_lm_checkpoint(found, config, batches=batches, data_path=args.data_path)
    data = config.get("data") or {}
    print(f"{Path(found).name}: validation loss {metrics['eval/lm_loss']:.4f}, perplexity "
          f"{metrics['eval/perplexity']:.4g} over {metrics['eval/tokens']:,} tokens ({batches} batches of "
          f"{metrics['eval/batch_size']} x {metrics['eval/seq_len']}, data={data.get('name', 'synthetic')})")
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}, indent=1))


def run_config_file(checkpoint: Path) -> Optional[Path]:
    """<run dir>/.hydra/config.yaml for <run dir>/checkpoints/step_<N> (or a step dir in the run dir)."""
    for run_dir in (checkpoint.parent.parent, checkpoint.parent):
        if (run_dir / RUN_CONFIG).is_file():
            return run_dir / RUN_CONFIG
    return None


def _read_config(path: Path) -> Dict[str, Any]:
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"{path} cannot be read ({one_line(e, 200)}): the run's config is needed to rebuild "
                        "the model") from None
    if not isinstance(config, dict) or not isinstance(config.get("arch"), dict):
        raise UserError(f"{path} has no arch section: it is not a hrlplan run's config")
    return config


def evaluate_lm_checkpoint(checkpoint: str | os.PathLike, config: Dict[str, Any], batches: int = RUN_EVAL_BATCHES,
                           data_path: Optional[str] = None) -> Dict[str, Any]:
    """Validation loss and perplexity of a language-model checkpoint (the run's `eval/lm_loss` batches)."""
    arch, train = dict(config["arch"]), dict(config.get("train") or {})
    data = dict(config.get("data") or {})
    if data_path:
        data["path"] = data_path
    if data.get("name") == "code":
        where = data.get("path") or "data/code"
        if not Path(where).is_dir():   # the corpus would otherwise be built anew, silently
            raise UserError(f"the run trained on data=code from {where}, which is not here (relative to "
                            f"{os.getcwd()}); pass --data-path <the corpus directory>")
    seed = int(train.get("seed", 0))
    batch_size = int(train.get("global_batch_size", 8))
    model = build_full_model(arch, seed)
    load_weights(model, checkpoint)
    stream = build_lm_data(data, full_vocab(arch), seed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device).eval()
    total, tokens, seq_len = 0.0, 0, 0
    with torch.no_grad():
        for k in range(batches):
            inputs, targets = stream.batch(k, batch_size, split="val")
            logits = model(input_ids=inputs.to(device), use_cache=False).logits
            total += causal_lm_loss(logits, targets.to(device)).item()
            tokens, seq_len = tokens + targets.numel(), targets.shape[1]
    loss = total / batches
    return {"eval/lm_loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), "eval/tokens": tokens,
            "eval/batch_size": batch_size, "eval/seq_len": seq_len, "checkpoint": str(checkpoint)}


def load_weights(model: torch.nn.Module, checkpoint: str | os.PathLike) -> None:
    """The whole model's weights from a training checkpoint (DCP, keyed `model.<parameter name>`), in
    this one process; a tied head and embedding stored under one name fill both."""
    stored = set(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    state = model.state_dict()
    request: Dict[str, torch.Tensor] = {}
    missing = []
    for name, tensor in state.items():
        key = _stored_name(f"model.{name}", stored)
        if key is None:
            missing.append(name)
        elif key not in request:
            request[key] = tensor
    if missing:
        raise UserError(f"{checkpoint} does not hold this model's weights (missing {', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''}): was the run's config changed after it was written?")
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(request, checkpoint_id=str(checkpoint), no_dist=True)
    loaded = {name: request[_stored_name(f"model.{name}", stored)] for name in state}
    model.load_state_dict(loaded)


def _stored_name(key: str, stored: set) -> Optional[str]:
    if key in stored:
        return key
    for a, b in TIED_NAMES:
        for x, y in ((a, b), (b, a)):
            if x in key and key.replace(x, y) in stored:
                return key.replace(x, y)
    return None
