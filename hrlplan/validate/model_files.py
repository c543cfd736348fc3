"""A model's sizes before any worker builds it: the arch keys, or a local config.json (arch.model_id),
read and checked here (valid JSON with a model_type, heads dividing the width, positions covering
data.seq_len) so a bad file is one line naming it, not a traceback from transformers in a worker."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from hrlplan.errors import ConfigError
from hrlplan.families import family_of
from hrlplan.validate.files import read_file

# config.json spells a size in one of these (HF's attribute_map aliases), first found wins
LAYERS = ("n_layer", "num_hidden_layers", "num_layers")
WIDTH = ("n_embd", "hidden_size", "d_model")
HEADS = ("n_head", "num_attention_heads")
POSITIONS = ("n_positions", "max_position_embeddings")


def _first(config: Dict[str, Any], names) -> tuple:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None, None


def _config_path(arch: Dict[str, Any]) -> Optional[Path]:
    model_id = arch.get("model_id")
    if not model_id:
        return None
    path = Path(str(model_id))
    target = path / "config.json" if path.is_dir() else path if path.suffix == ".json" else None
    if target is None and str(model_id).startswith((".", "/", "~")) and not path.exists():
        raise ConfigError("arch.model_id", model_id, "a shipped arch, a local directory with config.json, "
                                                     "or a model id in the local HF cache")
    return target   # None: an HF-cache id, resolved offline by model_meta


def check_model_config(arch: Dict[str, Any], seq_len: int = 0) -> Optional[Dict[str, Any]]:
    """A local model's config.json (arch.model_id), checked: returned parsed, or None without one."""
    target = _config_path(arch)
    if target is None:
        return None
    model_id = arch["model_id"]
    text = read_file("arch.model_id", str(target))
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError("arch.model_id", model_id, message=f"arch.model_id={model_id}: {target} is not valid "
                          f"JSON ({err.msg} at line {err.lineno}); restore the model's config.json") from None
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise ConfigError("arch.model_id", model_id, message=f"arch.model_id={model_id}: {target} has no "
                          "model_type; restore the model's config.json")
    for names, what in ((LAYERS, "layers"), (WIDTH, "width"), (HEADS, "heads"), (POSITIONS, "positions")):
        name, value = _first(parsed, names)
        if name is not None and value <= 0:
            raise ConfigError("arch.model_id", model_id, message=f"arch.model_id={model_id}: {target} has "
                              f"{name}={value}; the model's {what} must be a positive integer: fix config.json")
    width_key, width = _first(parsed, WIDTH)
    heads_key, heads = _first(parsed, HEADS)
    if width and heads and width % heads:
        raise ConfigError("arch.model_id", model_id, message=f"arch.model_id={model_id}: {target} has "
                          f"{width_key}={width}, which {heads_key}={heads} heads do not divide: make {width_key} "
                          f"a multiple of {heads_key} in config.json")
    pos_key, positions = _first(parsed, POSITIONS)
    if positions and seq_len > positions:
        raise ConfigError("data.seq_len", seq_len, message=f"data.seq_len={seq_len} is longer than the model's "
                          f"{positions} positions ({pos_key} in {target}): set data.seq_len<={positions}")
    return parsed


def model_shape(arch: Dict[str, Any], model_config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """n_layer and vocab_size with the key (as a user would change it) each comes from; {} where unknown."""
    out: Dict[str, Any] = {}
    if model_config is not None:
        where = f"{arch.get('model_id')}/config.json"
        name, value = _first(model_config, LAYERS)
        if value:
            out.update(n_layer=value, n_layer_key=f"{name} in {where}")
        if isinstance(model_config.get("vocab_size"), int):
            out.update(vocab_size=model_config["vocab_size"], vocab_key=f"vocab_size in {where}")
        return out
    key = family_of(arch).layers_key
    if arch.get("model_id") or key is None:   # no pipeline-splittable depth in the arch's keys (HRM)
        return out
    if isinstance(arch.get(key), int):
        out.update(n_layer=arch[key], n_layer_key=f"arch.{key}")
    if isinstance(arch.get("vocab_size"), int):
        out.update(vocab_size=arch["vocab_size"], vocab_key="arch.vocab_size")
    return out
