"""What the launcher checks on this host before it starts workers: the files a run names (a checkpoint
to resume, data, a model's config.json, a plan, a cluster spec) exist and hold what the run needs, a
manual plan agrees with the model, the job and the keys the user typed, the world size fits the host,
the environment holds no leftover rendezvous (environ.py). A manual plan is checked against the run by
manual_plan.py."""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from hrlplan import config as c
from hrlplan.data.sudoku import dataset_exists, resolve_preset
from hrlplan.errors import ConfigError, UserError, one_line
from hrlplan.families import LM_DATA, Family, family_of
from hrlplan.plan.checks import sequence_parallel_length_refusal
from hrlplan.validate.consistency import override_keys
from hrlplan.validate.environ import check_environment_variables
from hrlplan.validate.files import read_file, refuse_on
from hrlplan.validate.manual_plan import check_manual_plan
from hrlplan.validate.model_files import check_model_config, model_shape
from hrlplan.validate.train_options import context_parallel_length_refusal, train_options_refusal

LM_DATA_SETS = ("synthetic", "code")
CHECKPOINT_METADATA = ".metadata"   # torch.distributed.checkpoint's index beside its shards

def check_environment(config: Any, launching: bool = True, overrides: Optional[Sequence[str]] = None,
                      env: Optional[Mapping[str, str]] = None) -> None:
    """Everything the launcher can check before it starts workers; launching=False inside a job
    someone else launched (torchrun, SLURM), where the world size is theirs. config: the run's Config
    or its plain form (checked as plain values, the keys as users type them). overrides: the command
    line's (default: Hydra's, inside the app), to tell what the user typed from a default."""
    config = c.as_dict(config)
    check_environment_variables(os.environ if env is None else env)
    train, data, arch = config["train"], config.get("data") or {}, config.get("arch") or {}
    family = family_of(arch)
    lm = family.data_kind == LM_DATA
    _check_resume(str(train.get("resume", "none")))
    _check_data(config, family, data)
    model = check_model_config(arch, int(data.get("seq_len") or 0) if lm else 0)
    shape = model_shape(arch, model)
    if data.get("name") == "code" and lm:
        _check_code_vocab(data, shape.get("vocab_size"), shape.get("vocab_key", "arch.vocab_size"))
    planner, cluster = config.get("planner") or {}, config.get("cluster") or {}
    spec = None
    if cluster.get("spec_file"):
        path = str(cluster["spec_file"])
        spec = refuse_on("cluster.spec_file", path, lambda: _load_cluster_spec(path))
    if str(planner.get("name")) == "manual":
        plan = check_manual_plan(config, _explicit(config, overrides), shape, spec, launching)
        train = dict(train, context_parallel=plan.cp)   # the plan decides cp: the device check below refuses it
        short = context_parallel_length_refusal(plan.cp, int(data.get("seq_len") or 0)) if lm and plan.cp > 1 else None
        if short:
            raise ConfigError("data.seq_len", data.get("seq_len"), message=short)
        short = sequence_parallel_length_refusal(plan, int(data.get("seq_len") or 0)) if lm else ""
        if short:
            raise ConfigError("data.seq_len", data.get("seq_len"), message=short)
    if train.get("device") == "cuda":
        import torch   # why: composing and checking a config never needs torch (`--help`, completion)

        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", message="train.device=cuda but this host has no CUDA device: "
                                                              "use train.device=auto or cpu")
    if str(config.get("mode", "train")) == "train":
        _check_train_options(train, family)
    local = cluster.get("probe", True) and not cluster.get("spec_file")   # mode=plan probes these too
    if launching and local:
        check_world_size(cluster, str(train.get("device", "auto")))


def _check_train_options(train: Dict[str, Any], family: Family) -> None:
    """train.compile / float8 / context_parallel against this host's device (the workers check theirs
    again: a SLURM node may differ from the submitting host) and the family's trainer (HRM's runs none)."""
    asked = [k for k in ("compile", "float8") if train.get(k)] + \
        (["context_parallel"] if int(train.get("context_parallel") or 1) > 1 else [])
    if not asked:
        return
    foreign = [k for k in asked if k not in family.runtime_options]
    if foreign:
        key, value = foreign[0], train.get(foreign[0])
        off, shown = ("1", value) if key == "context_parallel" else ("false", "true")
        raise ConfigError(f"train.{key}", value, message=f"train.{key}={shown} "
                          f"is for the language models' pipeline runtime; {family.name.upper()}'s trainer does not "
                          f"run it: set train.{key}={off}")
    import torch   # why: only these options need to know the device

    device = str(train.get("device", "auto"))
    cuda = device != "cpu" and torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(0) if cuda else None
    name = torch.cuda.get_device_name(0) if cuda else ""
    refused = train_options_refusal(train, "cuda" if cuda else "cpu", capability, name)
    if refused:
        key, why = refused
        raise ConfigError(key, train.get(key.split(".", 1)[1]), message=why)


def _explicit(config: Dict[str, Any], overrides: Optional[Sequence[str]]) -> set:
    """The keys the user set: from the overrides, Hydra's inside the app, else those of the train
    section that differ from the schema's defaults."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig   # why: only inside the Hydra app is there one

        if HydraConfig.initialized():
            overrides = list(HydraConfig.get().overrides.task)
    if overrides is not None:
        return override_keys(overrides)
    defaults = c.as_dict(c.TrainConfig())
    return {f"train.{k}" for k, v in (config.get("train") or {}).items() if k in defaults and defaults[k] != v}


def _check_resume(resume: str) -> None:
    """A named checkpoint must be there and look whole (its index, rank 0's state): the full check,
    shard sizes included, runs when it loads (runtime/checkpoint.py checkpoint_problem)."""
    if resume in ("none", "auto"):
        return
    path = Path(resume)
    if not path.exists():
        raise ConfigError("train.resume", resume, "none, auto or an existing checkpoint directory")
    if not path.is_dir():
        raise ConfigError("train.resume", resume, message=f"train.resume={resume} is a file, not a checkpoint "
                          "directory: name a step_N directory (or the checkpoints/ directory holding them), or auto")
    steps = sorted(p for p in path.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    if steps or (path / "latest").exists():
        if not steps:
            raise ConfigError("train.resume", resume, message=f"train.resume={resume} names a checkpoints "
                              "directory with no complete step_N checkpoint in it: use train.resume=none")
        return   # the newest complete one is chosen when it loads, damaged newer ones skipped (and told)
    problem = _checkpoint_problem(path)
    if problem:
        raise ConfigError("train.resume", resume, message=f"train.resume={resume}: the checkpoint cannot be "
                          f"loaded: {problem}; name an earlier one, use train.resume=auto (the newest complete "
                          "one) or start fresh with train.resume=none")


def _checkpoint_problem(path: Path) -> Optional[str]:
    meta = path / CHECKPOINT_METADATA
    if not meta.is_file() or meta.stat().st_size == 0:
        older = " (a checkpoint of an older hrlplan: it can be evaluated, not resumed)" \
            if (path / "model.pt").exists() else ""
        return f"{meta} is missing or empty{older}"
    extra = path / "extra_rank0.pt"
    if not extra.is_file():
        return f"{extra} is missing"
    try:
        with zipfile.ZipFile(extra):   # torch.save's format: a file cut short has no directory
            pass
    except (OSError, zipfile.BadZipFile) as err:
        return f"{extra} is truncated or damaged ({one_line(err, 120)})"
    return None


def _check_data(config: Dict[str, Any], family: Family, data: Dict[str, Any]) -> None:
    if family.data_kind != LM_DATA:
        path = data.get("path") or config.get("data_path")
        if not path:
            return   # the trainer's default preset, built on first use
        if not dataset_exists(str(path)) and resolve_preset(str(path)) is None:
            key = "data_path" if config.get("data_path") else "data.path"
            raise ConfigError(key, path, message=f"{key}={path} has no train/dataset.json and test/dataset.json, "
                              "and its name is not a preset to build (sudoku-extreme-small, "
                              "sudoku-extreme-1k-aug-1000): give HRM's data directory, or build one with "
                              f"`hrlplan build-sudoku sudoku-extreme-small --out-dir {path}`")
    elif data.get("name") not in LM_DATA_SETS:
        raise ConfigError("data", data.get("name"), message=f"data={data.get('name')} is not a language-model "
                          f"data set: choose data=synthetic or data=code (or arch=hrm for puzzle data)")
    elif data.get("name") == "code" and data.get("source") and not Path(str(data["source"])).exists():
        raise ConfigError("data.source", data["source"], "an existing directory of .py/.jsonl(.gz)/.parquet files")


def _code_vocab(data: Dict[str, Any]) -> tuple:
    """(the code corpus's vocabulary size, where it comes from): a corpus already built with these
    settings, else the tokenizer to be trained (data.vocab_size); (None, ...) for a tokenizer named
    by data.tokenizer that is not built yet (its size is known once loaded)."""
    path = Path(str(data.get("path") or "data/code"))
    try:
        meta = json.loads((path / "meta.json").read_text())
        settings = meta.get("settings") or {}
        if settings.get("vocab_size_requested") == data.get("vocab_size") \
                and settings.get("tokenizer") == data.get("tokenizer"):
            return int(meta["vocab_size"]), f"the tokenizer of the code corpus in {path} ({meta['vocab_size']} tokens)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    spec = data.get("tokenizer")
    if spec:
        local = Path(str(spec))
        local = local / "tokenizer.json" if local.is_dir() else local
        if not local.is_file():
            if str(spec).startswith((".", "/", "~")) or str(spec).endswith(".json"):
                raise ConfigError("data.tokenizer", spec, "a tokenizer.json, a directory holding one, or a "
                                                          "tokenizer id in the local HF cache")
            return None, ""   # an HF-cache tokenizer: its size is known once loaded
        from hrlplan.data.code_corpus import load_tokenizer   # why: tokenizers, for a data=code run only

        try:
            size = load_tokenizer(str(local)).get_vocab_size(with_added_tokens=True)
        except Exception as err:   # the tokenizers library's own error for a damaged file
            raise ConfigError("data.tokenizer", spec, message=f"data.tokenizer={spec}: {local} is not a readable "
                              f"tokenizer.json ({one_line(err, 200)})") from None
        return size, f"the tokenizer data.tokenizer={spec} ({size} tokens)"
    return int(data.get("vocab_size") or 0), f"the tokenizer data=code trains (data.vocab_size={data.get('vocab_size')})"


def _check_code_vocab(data: Dict[str, Any], model_vocab: Optional[int], vocab_key: str) -> None:
    """The tokenizer's ids must fit the model's embedding: refused here, not after building the corpus."""
    vocab, where = _code_vocab(data)
    if vocab and model_vocab and vocab > model_vocab:
        raise ConfigError(vocab_key, model_vocab, message=f"the model's vocabulary ({vocab_key}={model_vocab}) is "
                          f"smaller than {where}: set {vocab_key}={vocab} (or larger)")


def _load_cluster_spec(path: str) -> Any:
    from hrlplan.cluster import ClusterSpec   # why: it brings torch; composing a config never needs it

    data = json.loads(read_file("cluster.spec_file", path))
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    try:
        return ClusterSpec.from_dict(data)
    except UserError as err:
        raise ValueError(str(err)) from None


def host_capacity(device: str = "auto") -> tuple:
    """(workers this host runs without sharing, what they are): GPUs, else CPU cores."""
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "GPU(s)"
    return len(os.sched_getaffinity(0)), "CPU core(s)"


def check_world_size(cluster: Dict[str, Any], device: str = "auto") -> None:
    """More local workers than GPUs (or CPU cores) would share devices, or hang a CPU host for
    minutes in rendezvous and probing: refused unless cluster.oversubscribe=true."""
    n = cluster.get("nproc_per_node", "auto")
    if n in (None, "auto") or cluster.get("oversubscribe"):
        return
    capacity, what = host_capacity(device)
    if int(n) > capacity:
        raise ConfigError("cluster.nproc_per_node", n, message=f"cluster.nproc_per_node={n} is more workers than "
                          f"this host has {what} ({capacity}): use at most {capacity} (or auto), or set "
                          "cluster.oversubscribe=true to start them anyway")
