"""HRM's Sudoku builder (dataset/build_sudoku_dataset.py) from local files, with its flags.

    python -m hrlplan.data.build_sudoku --source-repo ~/sudoku-extreme \\
        --output-dir data/sudoku-extreme-1k-aug-1000 --subsample-size 1000 --num-aug 1000

--source-repo takes what HRM's builder downloads, already on disk: a directory holding train.csv
and test.csv (a copy of the sapientinc/sudoku-extreme data set), or the CSV files themselves
(train*.csv / test*.csv), or the repository name when the Hugging Face cache already holds it
(nothing is downloaded). Each CSV has HRM's columns: a header, then source,question,answer,rating
with 81-character puzzles ('.' or '0' = blank) and solutions. The output is HRM's: the same
arrays, dataset.json and identifiers.json, built the same way (rating >= --min-difficulty,
--subsample-size train puzzles drawn without replacement, --num-aug symmetric variants after each
original). HRM draws from numpy's global generator unseeded; here one RandomState(--seed) makes the
same calls in the same order, so a run equals HRM's after `np.random.seed(seed)`: every file is
byte-identical but the augmented train inputs/labels, which hold the same values as uint8 where
HRM's happen to be int64 (its digit map is int64; 8x the disk, and both loaders read int32).

Without --source-repo the puzzles are generated on this machine (hrlplan/data/sudoku.py): a set
of the same shape and format, but not the paper's puzzles, so its scores are not comparable.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from hrlplan.data.publish import publish_build
from hrlplan.data.sudoku import SudokuPreset, build_sudoku_dataset, resolve_preset, write_split
from hrlplan.errors import UserError

HRM_SOURCE_REPO = "sapientinc/sudoku-extreme"
SPLITS = ("train", "test")


def _from_hf_cache(repo: str) -> Optional[Dict[str, str]]:
    """train/test CSVs of a data set repository already in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = {s: try_to_load_from_cache(repo, f"{s}.csv", repo_type="dataset") for s in SPLITS}
    return found if all(isinstance(p, str) for p in found.values()) else None


def find_csv_files(sources: Sequence[str]) -> Dict[str, str]:
    """{'train': path, 'test': path} from directories, CSV files or a cached repository name."""
    found: Dict[str, str] = {}
    for source in sources:
        path = os.path.expanduser(source)
        if os.path.isdir(path):
            for split in SPLITS:
                hits = sorted(glob.glob(os.path.join(path, f"{split}*.csv")))
                if hits:
                    found.setdefault(split, hits[0])
        elif os.path.isfile(path):
            split = next((s for s in SPLITS if os.path.basename(path).startswith(s)), None)
            if split is None:
                raise UserError(f"--source-repo {source}: name the CSV files train*.csv and test*.csv")
            found[split] = path
        elif "/" in source and not os.path.exists(os.path.dirname(path) or "."):
            cached = _from_hf_cache(source)
            if cached is None:
                raise UserError(f"--source-repo {source}: not a local directory or file, and not in the Hugging Face "
                                "cache; nothing is downloaded here. Copy train.csv and test.csv of the data set "
                                "(e.g. huggingface.co/datasets/sapientinc/sudoku-extreme) to a directory and pass it")
            found.update(cached)
        else:
            raise UserError(f"--source-repo {source}: no such directory or file")
    missing = [s for s in SPLITS if s not in found]
    if missing:
        raise UserError(f"--source-repo {' '.join(sources)}: no {' or '.join(f'{s}.csv' for s in missing)} found")
    return found


def read_sudoku_csv(path: str, min_difficulty: Optional[int] = None) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """HRM's reading: skip the header, keep rows rated >= min_difficulty, digits 0..9 as [9, 9]."""
    inputs, labels = [], []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        next(reader, None)
        for line, row in enumerate(reader, start=2):
            if len(row) != 4:
                raise UserError(f"{path}:{line}: expected HRM's 4 columns source,question,answer,rating; "
                                f"got {len(row)}")
            _, question, answer, rating = row
            if min_difficulty is not None and int(rating) < min_difficulty:
                continue
            if len(question) != 81 or len(answer) != 81:
                raise UserError(f"{path}:{line}: question and answer must be 81 characters "
                                f"(got {len(question)} and {len(answer)})")
            q = np.frombuffer(question.replace(".", "0").encode(), dtype=np.uint8) - ord("0")
            a = np.frombuffer(answer.encode(), dtype=np.uint8) - ord("0")
            if q.max() > 9 or a.max() > 9:
                raise UserError(f"{path}:{line}: cells must be digits 0-9 or '.'")
            inputs.append(q.reshape(9, 9))
            labels.append(a.reshape(9, 9))
    return inputs, labels


def shuffle_sudoku(board: np.ndarray, solution: np.ndarray, rs: np.random.RandomState) -> Tuple[np.ndarray, np.ndarray]:
    """HRM's shuffle_sudoku (same draws, same order): digits relabelled, maybe transposed, bands
    and stacks shuffled and the rows / columns inside each."""
    digit_map = np.pad(rs.permutation(np.arange(1, 10)), (1, 0))
    transpose = rs.rand() < 0.5
    bands = rs.permutation(3)
    row_perm = np.concatenate([b * 3 + rs.permutation(3) for b in bands])
    stacks = rs.permutation(3)
    col_perm = np.concatenate([s * 3 + rs.permutation(3) for s in stacks])
    mapping = (row_perm[:, None] * 9 + col_perm[None, :]).reshape(-1)

    def apply(x: np.ndarray) -> np.ndarray:
        x = x.T if transpose else x
        return digit_map[x.flatten()[mapping].reshape(9, 9)]

    return apply(board), apply(solution)


def convert_subset(path: str, split: str, out_dir: str, rs: np.random.RandomState, subsample_size: Optional[int],
                   min_difficulty: Optional[int], num_aug: int) -> int:
    """One split, as HRM's convert_subset; returns the number of puzzles kept."""
    inputs, labels = read_sudoku_csv(path, min_difficulty)
    if split == "train" and subsample_size is not None and subsample_size < len(inputs):
        indices = rs.choice(len(inputs), size=subsample_size, replace=False)
        inputs, labels = [inputs[i] for i in indices], [labels[i] for i in indices]
    augments = num_aug if split == "train" else 0
    all_in, all_out = [], []
    for board, solution in zip(tqdm(inputs, desc=f"sudoku {split}", unit="puzzle"), labels):
        all_in.append(board)
        all_out.append(solution)
        for _ in range(augments):
            aug_in, aug_out = shuffle_sudoku(board, solution, rs)
            all_in.append(aug_in)
            all_out.append(aug_out)
    if not all_in:
        raise UserError(f"{path}: no puzzle left (min_difficulty={min_difficulty})")
    write_split(out_dir, split, np.stack(all_in).reshape(-1, 81), np.stack(all_out).reshape(-1, 81),
                [1 + augments] * len(inputs))
    return len(inputs)


def build_from_csv(sources: Sequence[str], output_dir: str, subsample_size: Optional[int] = None,
                   min_difficulty: Optional[int] = None, num_aug: int = 0, seed: int = 0) -> str:
    """HRM's data set from local CSVs, written to a temporary directory then swapped into place."""
    files = find_csv_files(sources)
    start = time.time()
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(output_dir))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    rs = np.random.RandomState(seed)
    kept = {split: convert_subset(files[split], split, tmp, rs, subsample_size, min_difficulty, num_aug)
            for split in SPLITS}
    with open(os.path.join(tmp, "identifiers.json"), "w") as f:
        f.write('["<blank>"]')
    info = dict(source="csv", files=files, seed=seed, subsample_size=subsample_size, min_difficulty=min_difficulty,
                num_aug=num_aug, train_puzzles=kept["train"], test_puzzles=kept["test"],
                build_seconds=round(time.time() - start, 2))
    publish_build(tmp, output_dir, "build_info.json", info)
    print(f"built {output_dir} from {files['train']} and {files['test']}: {kept['train']} train puzzles x "
          f"{1 + num_aug} variants, {kept['test']} test puzzles")
    return output_dir


def generated_preset(output_dir: str, subsample_size: Optional[int], num_aug: int) -> SudokuPreset:
    """The generated stand-in for a run without files: the output directory's preset name if it
    is one, else --subsample-size (default 1000) puzzles with --num-aug variants."""
    named = resolve_preset(output_dir)
    if named is not None and subsample_size is None:
        return named
    return SudokuPreset(num_train=subsample_size or 1000, num_test=1000, num_aug=num_aug)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hrlplan.data.build_sudoku", description=__doc__.split("\n")[0])
    p.add_argument("--source-repo", nargs="+", default=None,
                   help="directory with train.csv/test.csv, the CSV files, or a repository already in the HF cache; "
                        "without it the puzzles are generated here (not the paper's set)")
    p.add_argument("--output-dir", default="data/sudoku-extreme-full")
    p.add_argument("--subsample-size", type=int, default=None)
    p.add_argument("--min-difficulty", type=int, default=None)
    p.add_argument("--num-aug", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="numpy seed for the subsample and the augmentations")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.source_repo:
            build_from_csv(args.source_repo, args.output_dir, args.subsample_size, args.min_difficulty,
                           args.num_aug, args.seed)
        else:
            print("no --source-repo: generating puzzles on this machine (same format, not the paper's "
                  "sudoku-extreme puzzles: scores on this set are not comparable with the paper's)")
            preset = generated_preset(args.output_dir, args.subsample_size, args.num_aug)
            build_sudoku_dataset(args.output_dir, preset, seed=args.seed)
    except UserError as e:
        print(f"build_sudoku: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
