"""A code corpus for the language models, built from Python source already on this machine.

Like CodeSearchNet, documents are functions that carry a docstring (the code includes it),
extracted with `ast` from the standard library and site-packages (or from a directory / JSONL
source you point at). A byte-level BPE tokenizer is trained here with `tokenizers` (or a local
tokenizer you name is used), every function is tokenised and followed by an end-of-text token,
and files are split between train and validation, so no function leaks across the split.

Build:  hrlplan build-code-corpus --out-dir data/code --vocab-size 4096 --max-files 2000
Use:    corpus = CodeCorpus.load("data/code"); corpus.train_tokens  # 1-D torch.long

Layout of <out_dir>:
    meta.json         vocab_size, eot_id, token dtype, token/function/file counts, build settings
    tokenizer.json    the tokenizer (tokenizers.Tokenizer.from_file)
    train.bin         train token ids, little-endian uint16 (uint32 when vocab > 65535), flat
    val.bin           validation token ids, same dtype
    functions.jsonl   one {"path", "func_name", "docstring", "code", "split"} per function
"""
from __future__ import annotations

import ast
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import random
import shutil
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hrlplan.data.publish import publish_build

EOT = "<|endoftext|>"
_EOT_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_CODE_FIELDS = ("whole_func_string", "original_string", "code", "func_code_string", "content", "text")
MAX_FILE_BYTES = 300_000      # generated tables and vendored bundles are not representative code
MAX_FUNCTION_LINES = 200
FORMAT_VERSION = 1


# ---------------------------------------------------------------- gathering source
def installed_python_roots() -> List[str]:
    """The standard library and site-packages directories of this interpreter."""
    paths = sysconfig.get_paths()
    return sorted({paths[k] for k in ("stdlib", "purelib", "platlib") if os.path.isdir(paths.get(k, ""))})


def list_python_files(roots: List[str]) -> List[str]:
    files = set()
    roots = [os.path.abspath(r) for r in roots]
    for root in roots:
        for directory, dirs, names in os.walk(root):
            # site-packages sits inside the stdlib directory: walk it once, as its own root.
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith(".")
                             and os.path.join(directory, d) not in roots)
            files.update(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(files)


def extract_functions(source: str, path: str = "") -> List[Dict[str, str]]:
    """Functions and methods with a docstring: CodeSearchNet-style records, code dedented."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = source.splitlines(keepends=True)
    records = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        if not docstring or node.end_lineno is None or node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
            continue
        code = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno]))
        records.append({"path": path, "func_name": node.name, "docstring": docstring, "code": code})
    return records


def _read_text(path: str) -> Optional[str]:
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _jsonl_records(path: str) -> Iterator[Dict[str, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _parquet_records(path: str) -> Iterator[Dict[str, str]]:
    try:   # only parquet sources (e.g. an HF-cache data set) need pyarrow, so it is an optional extra
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"data source {path} is a parquet file, which needs pyarrow: "
                          "pip install 'hrlplan[parquet]'") from exc

    yield from pq.read_table(path).to_pylist()


def _source_units(source: Optional[str], max_files: int, seed: int) -> List[Tuple[str, List[Dict[str, str]]]]:
    """(unit name, function records) per file; a unit is the train/validation split granule."""
    if source is None:
        candidates = list_python_files(installed_python_roots())
    elif os.path.isfile(source):
        candidates = [source]
    elif os.path.isdir(source):
        candidates = sorted(os.path.join(d, n) for d, _, names in os.walk(source) for n in names
                            if n.endswith((".py", ".jsonl", ".jsonl.gz", ".parquet")))
    else:
        raise FileNotFoundError(f"code corpus source '{source}' is neither a file nor a directory")
    random.Random(seed).shuffle(candidates)
    units = []
    for path in candidates:
        if len(units) >= max_files:   # max_files counts files that contribute functions
            break
        if path.endswith(".py"):
            text = _read_text(path)
            records = extract_functions(text, path) if text else []
        else:
            rows = _parquet_records(path) if path.endswith(".parquet") else _jsonl_records(path)
            records = []
            for row in rows:
                code = next((row[k] for k in _CODE_FIELDS if isinstance(row.get(k), str)), None)
                if code:
                    records.append({"path": row.get("path", path), "func_name": row.get("func_name", ""),
                                    "docstring": row.get("docstring", row.get("func_documentation_string", "")), "code": code})
        if records:
            units.append((path, records))
    if not units:
        raise ValueError(f"no functions with docstrings found in {source or 'the installed Python sources'}")
    return units


# ---------------------------------------------------------------- tokenizer
def train_bpe_tokenizer(texts: List[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style: any byte sequence encodes; decode(encode(x)) == x)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def load_tokenizer(spec: str):
    """A tokenizer.json file, a directory holding one, or a model id already in the local HF cache
    (never downloads)."""
    if os.path.isfile(spec):
        return Tokenizer.from_file(spec)
    if os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return Tokenizer.from_file(os.path.join(spec, "tokenizer.json"))
    try:
        from huggingface_hub import hf_hub_download

        return Tokenizer.from_file(hf_hub_download(spec, "tokenizer.json", local_files_only=True))
    except Exception:
        pass
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(spec, local_files_only=True, use_fast=True)
        return fast.backend_tokenizer
    except Exception as e:
        raise FileNotFoundError(f"tokenizer '{spec}' is not a tokenizer.json, a directory with one, or a fast tokenizer "
                                f"in the local Hugging Face cache (no downloads here): {e}") from None


def _eot_id(tokenizer) -> Optional[int]:
    return next((tokenizer.token_to_id(t) for t in _EOT_CANDIDATES if tokenizer.token_to_id(t) is not None), None)


# ---------------------------------------------------------------- build / load
def _settings(vocab_size: int, max_files: int, seed: int, tokenizer: Optional[str], source: Optional[str],
              val_fraction: float) -> Dict[str, object]:
    return {"format_version": FORMAT_VERSION, "vocab_size_requested": vocab_size, "max_files": max_files, "seed": seed,
            "tokenizer_source": tokenizer, "source": source, "val_fraction": val_fraction}


def _in_validation(unit: str, seed: int, val_fraction: float) -> bool:
    digest = hashlib.sha1(f"{seed}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2 ** 64 < val_fraction


def prepare_code_corpus(out_dir: str = "data/code", vocab_size: int = 4096, max_files: int = 2000, seed: int = 0,
                        tokenizer: Optional[str] = None, source: Optional[str] = None, val_fraction: float = 0.05,
                        log=print) -> str:
    """Build the corpus in out_dir unless one with the same settings is already there; returns
    out_dir. `tokenizer` uses a local tokenizer instead of training one; `source` reads a
    directory of .py / CodeSearchNet-style .jsonl(.gz) / .parquet files instead of site-packages."""
    settings = _settings(vocab_size, max_files, seed, tokenizer, source, val_fraction)
    # Every rank of a job may call this at once: one builds, the others wait and reuse it.
    with build_lock(out_dir):
        if _existing_settings(out_dir) == settings:
            return out_dir
        return _build(out_dir, settings, vocab_size, max_files, seed, tokenizer, source, val_fraction, log)


def _existing_settings(out_dir: str) -> Optional[Dict[str, object]]:
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            return json.load(f).get("settings")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def build_lock(out_dir: str):
    """An exclusive lock file beside out_dir (flock: released even if the holder dies)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(out_dir: str, settings: Dict[str, object], vocab_size: int, max_files: int, seed: int,
           tokenizer: Optional[str], source: Optional[str], val_fraction: float, log) -> str:
    start = time.time()
    units = _source_units(source, max_files, seed)
    val_units = {u for u, _ in units if _in_validation(u, seed, val_fraction)}
    if not val_units or len(val_units) == len(units):   # both splits must be non-empty
        val_units = {units[-1][0]} if len(units) > 1 else set()
    train_texts = [r["code"] for u, rs in units if u not in val_units for r in rs]
    val_texts = [r["code"] for u, rs in units if u in val_units for r in rs]
    if not val_texts:   # a single source file: hold out its last functions
        cut = max(1, len(train_texts) // 20)
        train_texts, val_texts = train_texts[:-cut], train_texts[-cut:]
    log(f"code corpus: {len(units)} files, {len(train_texts)} train / {len(val_texts)} validation functions")
    tok = load_tokenizer(tokenizer) if tokenizer else train_bpe_tokenizer(train_texts, vocab_size)
    eot = _eot_id(tok)
    real_vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if real_vocab <= 2 ** 16 else np.uint32

    def flatten(texts: List[str]) -> np.ndarray:
        ids: List[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            if eot is not None:
                ids.append(eot)
        return np.asarray(ids, dtype=dtype)

    train_ids, val_ids = flatten(train_texts), flatten(val_texts)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok.save(os.path.join(tmp, "tokenizer.json"))
    train_ids.tofile(os.path.join(tmp, "train.bin"))
    val_ids.tofile(os.path.join(tmp, "val.bin"))
    with open(os.path.join(tmp, "functions.jsonl"), "w", encoding="utf-8") as f:
        for unit, records in units:
            split = "val" if unit in val_units else "train"
            for r in records:
                f.write(json.dumps(dict(r, split=split)) + "\n")
    meta = {"vocab_size": real_vocab, "eot_id": eot, "dtype": np.dtype(dtype).name, "train_tokens": int(train_ids.size),
            "val_tokens": int(val_ids.size), "files": len(units), "train_functions": len(train_texts),
            "val_functions": len(val_texts), "build_seconds": round(time.time() - start, 2), "settings": settings}
    publish_build(tmp, out_dir, "meta.json", meta)
    log(f"code corpus in {out_dir}: vocab {real_vocab}, {train_ids.size:,} train / {val_ids.size:,} validation tokens, "
        f"{meta['build_seconds']} s")
    return out_dir


@dataclass
class CodeCorpus:
    train_tokens: "torch.Tensor"   # noqa: F821 -- 1-D torch.long
    val_tokens: "torch.Tensor"     # noqa: F821
    vocab_size: int
    tokenizer: object              # tokenizers.Tokenizer
    eot_id: Optional[int]
    meta: Dict[str, object]

    @classmethod
    def load(cls, path: str) -> "CodeCorpus":
        import torch   # why: as in sudoku.py, building the corpus never needs torch

        meta_path = os.path.join(path, "meta.json")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"{path} holds no code corpus (meta.json); build one with "
                                    f"`hrlplan build-code-corpus --out-dir {path}`")
        with open(meta_path) as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"])
        tokens = {s: torch.from_numpy(np.fromfile(os.path.join(path, f"{s}.bin"), dtype=dtype).astype(np.int64))
                  for s in ("train", "val")}
        return cls(tokens["train"], tokens["val"], int(meta["vocab_size"]),
                   Tokenizer.from_file(os.path.join(path, "tokenizer.json")), meta.get("eot_id"), meta)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def build_cli(args) -> None:
    """`hrlplan build-code-corpus [--out-dir D] [--vocab-size V] [--max-files N]` (optional
    --tokenizer / --source / --seed are honoured when the parser provides them)."""
    prepare_code_corpus(args.out_dir, vocab_size=args.vocab_size, max_files=args.max_files,
                        seed=getattr(args, "seed", 0) or 0, tokenizer=getattr(args, "tokenizer", None),
                        source=getattr(args, "source", None))
