"""Sudoku puzzle sets for HRM, generated on this machine (no downloads), in HRM's on-disk format.

Build:  hrlplan build-sudoku sudoku-extreme-small --out-dir data/sudoku-extreme-small
Presets: sudoku-extreme-small (100 train puzzles x 10 variants, 100 test; seconds to build) and
sudoku-extreme-1k-aug-1000 (1000 train puzzles x 1001 variants, 1000 test). Any name of the form
sudoku-extreme-<N>[k]-aug-<M> works too. Training builds a missing preset directory by itself.

Generation: a random complete grid (randomised backtracking), then clues are removed in random
order while the solution stays unique, giving a minimal puzzle (~22-27 clues). The hardness
filter keeps a puzzle only if naked+hidden singles cannot solve it (it needs search) and its
rating -- branch points of a fewest-candidates-first backtracking solver that proves uniqueness
-- is at least `min_guesses`. Every puzzle is rebuilt from (seed, split, index) alone, so the
output is identical for any number of workers. Train puzzles are augmented by validity-
preserving symmetries: digit relabelling, transposition, shuffling the row bands / column stacks
and the rows / columns inside each; the first variant of each group is the original.

Layout (identical to HRM's dataset/build_sudoku_dataset.py, so HRM-built sets load here too):
    <out>/identifiers.json                ["<blank>"]
    <out>/build_info.json                 preset, seed, counts, clue and rating statistics, seconds
    <out>/{train,test}/dataset.json       {"seq_len": 81, "vocab_size": 11, "pad_id": 0,
                                           "ignore_label_id": 0, "blank_identifier_id": 0,
                                           "num_puzzle_identifiers": 1, "total_groups": G,
                                           "mean_puzzle_examples": 1, "sets": ["all"]}
    <out>/{split}/all__inputs.npy         uint8 [E, 81] row-major cells: 1 = blank, d+1 = digit d
    <out>/{split}/all__labels.npy         uint8 [E, 81] the solution, same encoding (0 = PAD)
    <out>/{split}/all__puzzle_identifiers.npy  int32 [P] (all 0: Sudoku has no per-puzzle id)
    <out>/{split}/all__puzzle_indices.npy int32 [P+1] first example of each puzzle
    <out>/{split}/all__group_indices.npy  int32 [G+1] first puzzle of each group (an original
                                          puzzle and its augmentations); test groups have one
One training epoch visits every group once and takes one random puzzle of it; batches run across
the epochs of one evaluation interval and only full batches train (HRM's sampler, PuzzleSplit).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from hrlplan.data.code_corpus import build_lock
from hrlplan.data.publish import publish_build

# ---------------------------------------------------------------- solver (bitmask backtracking)
_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_ALL_DIGITS = 0x3FE   # bits 1..9
_POPCOUNT = [bin(m).count("1") for m in range(1024)]
UNITS = ([[r * 9 + c for c in range(9)] for r in range(9)] + [[r * 9 + c for r in range(9)] for c in range(9)]
         + [[(b // 3) * 27 + (b % 3) * 3 + (k // 3) * 9 + k % 3 for k in range(9)] for b in range(9)])
_PEERS = [sorted({j for u in UNITS if i in u for j in u} - {i}) for i in range(81)]


@dataclass
class SolveResult:
    count: int                        # solutions found (stops at the limit)
    solution: Optional[List[int]]     # the first one
    branches: int                     # cells where the solver had to choose between >1 digits


def solve(grid: Sequence[int], limit: int = 2, forbid: Optional[Tuple[int, int]] = None,
          rng: Optional[random.Random] = None) -> SolveResult:
    """Backtracking over 81 cells (0 = blank), fewest candidates first; `forbid=(cell, digit)`
    excludes one digit from one cell; `rng` randomises digit order (to make random grids)."""
    grid = [int(v) for v in grid]   # numpy uint8 would overflow the bitmask arithmetic
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(grid):
        if v:
            bit = 1 << v
            if (rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]]) & bit:
                return SolveResult(0, None, 0)
            rows[_ROW[i]] |= bit
            cols[_COL[i]] |= bit
            boxes[_BOX[i]] |= bit
    banned = [0] * 81
    if forbid is not None:
        banned[forbid[0]] = 1 << forbid[1]
    cells = list(grid)
    result = SolveResult(0, None, 0)

    def search(empties: List[int]) -> bool:
        if not empties:
            result.count += 1
            if result.solution is None:
                result.solution = cells[:]
            return result.count >= limit
        best, best_n, best_mask = 0, 10, 0
        for k, i in enumerate(empties):
            mask = _ALL_DIGITS & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]] | banned[i])
            n = _POPCOUNT[mask]
            if n < best_n:
                best, best_n, best_mask = k, n, mask
                if n <= 1:
                    break
        if best_n == 0:
            return False
        i = empties[best]
        rest = empties[:best] + empties[best + 1:]
        r, c, b = _ROW[i], _COL[i], _BOX[i]
        if best_n > 1:
            result.branches += 1
        digits = [d for d in range(1, 10) if best_mask >> d & 1]
        if rng is not None:
            rng.shuffle(digits)
        for d in digits:
            bit = 1 << d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            cells[i] = d
            stop = search(rest)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
            cells[i] = 0
            if stop:
                return True
        return False

    search([i for i in range(81) if not cells[i]])
    return result


def count_solutions(grid: Sequence[int], limit: int = 2) -> int:
    return solve(grid, limit=limit).count


def solvable_by_singles(grid: Sequence[int]) -> bool:
    """True when naked and hidden singles alone fill the grid (no search needed)."""
    cand = [_ALL_DIGITS] * 81
    cells = [0] * 81

    def place(i: int, d: int) -> None:
        cells[i], cand[i] = d, 1 << d
        for p in _PEERS[i]:
            cand[p] &= ~(1 << d)

    for i, v in enumerate(grid):
        if v:
            place(i, int(v))
    progress = True
    while progress:
        progress = False
        for i in range(81):
            if not cells[i]:
                if cand[i] == 0:
                    return False
                if _POPCOUNT[cand[i]] == 1:
                    place(i, cand[i].bit_length() - 1)
                    progress = True
        for unit in UNITS:
            for d in range(1, 10):
                spots = [i for i in unit if cand[i] >> d & 1]
                if len(spots) == 1 and not cells[spots[0]]:
                    place(spots[0], d)
                    progress = True
    return all(cells)


def is_valid_solution(grid: Sequence[int]) -> bool:
    """Every row, column and box holds 1..9 exactly once."""
    return len(grid) == 81 and all(sorted(int(grid[i]) for i in unit) == list(range(1, 10)) for unit in UNITS)


def agrees_with(puzzle: Sequence[int], solution: Sequence[int]) -> bool:
    return all(p == 0 or p == s for p, s in zip(puzzle, solution))


# ---------------------------------------------------------------- generation
@dataclass
class SudokuPreset:
    num_train: int
    num_test: int
    num_aug: int
    min_guesses: int = 10      # rating threshold: solver branch points
    max_clues: int = 30
    require_search: bool = True


PRESETS: Dict[str, SudokuPreset] = {
    "sudoku-extreme-small": SudokuPreset(num_train=100, num_test=100, num_aug=9),
    "sudoku-extreme-1k-aug-1000": SudokuPreset(num_train=1000, num_test=1000, num_aug=1000),
}
_PRESET_PATTERN = re.compile(r"^sudoku-extreme-(\d+)(k?)-aug-(\d+)$")


def resolve_preset(name: str) -> Optional[SudokuPreset]:
    """A named preset, or one parsed from sudoku-extreme-<N>[k]-aug-<M>; None if neither."""
    name = os.path.basename(os.path.normpath(name))
    if name in PRESETS:
        return PRESETS[name]
    m = _PRESET_PATTERN.match(name)
    if m:
        return SudokuPreset(num_train=int(m.group(1)) * (1000 if m.group(2) else 1), num_test=1000, num_aug=int(m.group(3)))
    return None


def generate_puzzle(seed: int, split: str, index: int, preset: SudokuPreset) -> Tuple[List[int], List[int], int]:
    """(puzzle, solution, rating) for one slot; retries inside the slot until the filter passes."""
    rng = random.Random(f"hrlplan-sudoku/{seed}/{split}/{index}")
    while True:
        solution = solve([0] * 81, limit=1, rng=rng).solution
        puzzle = list(solution)
        order = list(range(81))
        rng.shuffle(order)
        for i in order:
            digit, puzzle[i] = puzzle[i], 0
            # Still unique iff no solution puts another digit here.
            if solve(puzzle, limit=1, forbid=(i, digit)).count:
                puzzle[i] = digit
        clues = sum(1 for v in puzzle if v)
        if clues > preset.max_clues or (preset.require_search and solvable_by_singles(puzzle)):
            continue
        rating = solve(puzzle, limit=2).branches
        if rating >= preset.min_guesses:
            return puzzle, solution, rating


def _generate_chunk(args: Tuple[int, str, Sequence[int], SudokuPreset]):
    seed, split, indices, preset = args
    return [generate_puzzle(seed, split, i, preset) for i in indices]


def generate_puzzles(count: int, seed: int, split: str, preset: SudokuPreset, workers: int = 1,
                     progress: bool = True) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(puzzles, solutions, ratings) as uint8 [count, 81] x2 and int32 [count]."""
    chunk = 8
    tasks = [(seed, split, range(s, min(count, s + chunk)), preset) for s in range(0, count, chunk)]
    bar = tqdm(total=count, desc=f"sudoku {split}", unit="puzzle", disable=not progress)
    results = []
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for part in pool.map(_generate_chunk, tasks):
                results.extend(part)
                bar.update(len(part))
    else:
        for task in tasks:
            part = _generate_chunk(task)
            results.extend(part)
            bar.update(len(part))
    bar.close()
    puzzles = np.array([r[0] for r in results], dtype=np.uint8).reshape(-1, 81)
    solutions = np.array([r[1] for r in results], dtype=np.uint8).reshape(-1, 81)
    return puzzles, solutions, np.array([r[2] for r in results], dtype=np.int32)


def augment(puzzle: np.ndarray, solution: np.ndarray, count: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """`count` random symmetric variants of one puzzle/solution pair ([81] uint8 each, 0 = blank)."""
    digit_map = np.zeros((count, 10), dtype=np.uint8)   # 0 (blank) stays 0
    digit_map[:, 1:] = rng.permuted(np.tile(np.arange(1, 10, dtype=np.uint8), (count, 1)), axis=1)
    transpose = rng.random(count) < 0.5

    def line_permutation() -> np.ndarray:
        bands = rng.permuted(np.tile(np.arange(3), (count, 1)), axis=1)
        inside = rng.permuted(np.tile(np.arange(3), (count, 3, 1)), axis=2)
        return (bands[:, :, None] * 3 + inside).reshape(count, 9)

    rows, cols = line_permutation(), line_permutation()
    # New cell (r, c) takes old cell (rows[r], cols[c]) of the (maybe transposed) grid.
    source = (rows[:, :, None] * 9 + cols[:, None, :]).reshape(count, 81)

    def apply(grid: np.ndarray) -> np.ndarray:
        g = grid.reshape(9, 9)
        boards = np.where(transpose[:, None], g.T.reshape(1, 81), g.reshape(1, 81))
        moved = np.take_along_axis(boards, source, axis=1)
        return np.take_along_axis(digit_map, moved.astype(np.int64), axis=1)

    return apply(puzzle), apply(solution)


def write_split(out_dir: str, split: str, inputs: np.ndarray, labels: np.ndarray, group_sizes: Sequence[int]) -> None:
    """One split in HRM's files; inputs/labels are [E, 81] digits (0 = blank), stored + 1."""
    split_dir = os.path.join(out_dir, split)
    os.makedirs(split_dir, exist_ok=True)
    examples = len(inputs)
    # HRM's PuzzleDatasetMetadata.model_dump(): its field order, mean_puzzle_examples a float.
    metadata = dict(pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=11, seq_len=81,
                    num_puzzle_identifiers=1, total_groups=len(group_sizes), mean_puzzle_examples=1.0, sets=["all"])
    arrays = {
        "inputs": (inputs + 1).astype(np.uint8),
        "labels": (labels + 1).astype(np.uint8),
        "puzzle_identifiers": np.zeros(examples, dtype=np.int32),
        "puzzle_indices": np.arange(examples + 1, dtype=np.int32),
        "group_indices": np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int32),
    }
    for name, array in arrays.items():
        np.save(os.path.join(split_dir, f"all__{name}.npy"), array)
    with open(os.path.join(split_dir, "dataset.json"), "w") as f:
        json.dump(metadata, f)


def build_sudoku_dataset(out_dir: str, preset: SudokuPreset | str, seed: int = 0, workers: Optional[int] = None,
                         progress: bool = True, log: Callable[[str], None] = print) -> str:
    """Generate, augment and write a data set; written to a temporary directory then renamed, so
    an interrupted build never leaves a half-written set behind. Returns out_dir."""
    name = preset if isinstance(preset, str) else "custom"
    spec = resolve_preset(preset) if isinstance(preset, str) else preset
    if spec is None:
        raise ValueError(f"unknown Sudoku preset '{preset}'; presets: {', '.join(PRESETS)} "
                         "(or sudoku-extreme-<N>[k]-aug-<M>)")
    workers = workers if workers is not None else max(1, min(2, os.cpu_count() or 1))
    start = time.time()
    log(f"building Sudoku set '{name}' in {out_dir}: {spec.num_train} train puzzles x {1 + spec.num_aug} variants, "
        f"{spec.num_test} test puzzles, seed {seed}, {workers} worker(s)")
    train_p, train_s, train_r = generate_puzzles(spec.num_train, seed, "train", spec, workers, progress)
    test_p, test_s, test_r = generate_puzzles(spec.num_test, seed, "test", spec, workers, progress)
    # Independent streams make a train/test collision astronomically unlikely; drop any anyway.
    seen = {p.tobytes() for p in train_p}
    keep = np.array([p.tobytes() not in seen for p in test_p], dtype=bool)
    test_p, test_s, test_r = test_p[keep], test_s[keep], test_r[keep]

    rng = np.random.default_rng([seed, 7919])
    inputs, labels = [], []
    for puzzle, solution in zip(train_p, train_s):
        inputs.append(puzzle[None])
        labels.append(solution[None])
        if spec.num_aug:
            aug_in, aug_out = augment(puzzle, solution, spec.num_aug, rng)
            inputs.append(aug_in)
            labels.append(aug_out)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_split(tmp, "train", np.concatenate(inputs), np.concatenate(labels), [1 + spec.num_aug] * len(train_p))
    write_split(tmp, "test", test_p, test_s, [1] * len(test_p))
    with open(os.path.join(tmp, "identifiers.json"), "w") as f:
        json.dump(["<blank>"], f)
    clues = np.count_nonzero(np.concatenate([train_p, test_p]), axis=1)
    ratings = np.concatenate([train_r, test_r])
    info = dict(preset=name, seed=seed, **asdict(spec), train_examples=int(sum(len(x) for x in inputs)),
                test_examples=int(len(test_p)), clues_mean=float(clues.mean()), clues_min=int(clues.min()),
                clues_max=int(clues.max()), rating_mean=float(ratings.mean()), rating_median=float(np.median(ratings)),
                build_seconds=round(time.time() - start, 2))
    publish_build(tmp, out_dir, "build_info.json", info)
    log(f"built {out_dir}: {info['train_examples']} train / {info['test_examples']} test examples, "
        f"{info['clues_mean']:.1f} clues on average, median rating {info['rating_median']:.0f}, {info['build_seconds']} s")
    return out_dir


def dataset_exists(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, split, "dataset.json")) for split in ("train", "test"))


def ensure_sudoku_dataset(path: str, seed: int = 0, log: Callable[[str], None] = print) -> str:
    """Return `path`, building it first when it is missing and its name is a preset."""
    if dataset_exists(path):
        return path
    with build_lock(path):   # a concurrent job building the same preset finishes first
        if dataset_exists(path):
            return path
        return _build_missing(path, seed, log)


def _build_missing(path: str, seed: int, log: Callable[[str], None]) -> str:
    if resolve_preset(path) is None:
        raise FileNotFoundError(f"data_path '{path}' has no train/dataset.json and test/dataset.json, and its name is "
                                f"not a Sudoku preset ({', '.join(PRESETS)}); build one with "
                                f"`hrlplan build-sudoku sudoku-extreme-small --out-dir {path}`")
    log(f"data_path '{path}' does not exist yet: building preset '{os.path.basename(os.path.normpath(path))}' (seed {seed})")
    return build_sudoku_dataset(path, os.path.basename(os.path.normpath(path)), seed=seed, log=log)


def build_cli(args) -> None:
    """`hrlplan build-sudoku <preset | out dir named after a preset> [--out-dir D] [--seed S]`."""
    name = os.path.basename(os.path.normpath(args.preset_or_dir))
    out_dir = args.out_dir or (args.preset_or_dir if os.sep in args.preset_or_dir else os.path.join("data", name))
    build_sudoku_dataset(out_dir, name, seed=args.seed)


# ---------------------------------------------------------------- reading (for the trainer)
class PuzzleSplit:
    """One split of an HRM-format puzzle set, with HRM's batching (train: one random puzzle per
    group per epoch; test: every example in order), sliced per data-parallel rank."""

    def __init__(self, path: str, split: str):
        with open(os.path.join(path, split, "dataset.json")) as f:
            self.metadata = json.load(f)
        if len(self.metadata.get("sets", ["all"])) != 1:
            raise ValueError(f"{path}/{split}: only single-set puzzle data is supported (sets={self.metadata['sets']})")
        set_name = self.metadata.get("sets", ["all"])[0]
        load = lambda field, mmap: np.load(os.path.join(path, split, f"{set_name}__{field}.npy"), mmap_mode=mmap)  # noqa: E731
        self.inputs, self.labels = load("inputs", "r"), load("labels", "r")
        self.puzzle_identifiers = load("puzzle_identifiers", None)
        self.puzzle_indices = load("puzzle_indices", None)
        self.group_indices = load("group_indices", None)

    @property
    def num_groups(self) -> int:
        return len(self.group_indices) - 1

    @property
    def one_example_per_puzzle(self) -> bool:
        return bool(np.all(np.diff(self.puzzle_indices) == 1))

    def iteration_plan(self, iteration: int, seed: int, epochs_per_iter: int,
                       global_batch_size: int) -> Tuple[np.ndarray, np.ndarray]:
        """(example ids, puzzle ids), each [batches, global_batch_size], of one training iteration
        (eval_interval epochs between two evaluations), batched as HRM's puzzle_dataset.py does:
        the groups of every epoch in a fresh random order, one random puzzle per group, a puzzle's
        examples packed in (cut at the batch's end), and the one partial batch at the end dropped,
        so no row is ever padding. HRM's generator (Philox(seed + iteration + 1)) draws the order
        and the puzzles, so with one example per puzzle (Sudoku) the batches are HRM's own."""
        rng = np.random.Generator(np.random.Philox(seed=seed + iteration + 1))
        order = np.concatenate([rng.permutation(self.num_groups) for _ in range(epochs_per_iter)])
        # One vectorised draw consumes the generator as HRM's draw per group does (same bounds, in order).
        puzzles = rng.integers(self.group_indices[order], self.group_indices[order + 1])
        first = self.puzzle_indices[puzzles].astype(np.int64)
        sizes = self.puzzle_indices[puzzles + 1] - first
        gbs = global_batch_size
        if np.all(sizes == 1):
            full = len(puzzles) // gbs * gbs
            return first[:full].reshape(-1, gbs), puzzles[:full].reshape(-1, gbs)
        # HRM draws a puzzle's examples with the global numpy generator; a seeded one keeps resume exact.
        pick = np.random.default_rng([seed, iteration])
        examples, owners, filled = [], [], 0
        for puzzle, start, size in zip(puzzles.tolist(), first.tolist(), sizes.tolist()):
            take = min(size, gbs - filled % gbs)
            examples.append(start + pick.choice(size, take, replace=False))
            owners.append(np.full(take, puzzle))
            filled += take
        full = filled // gbs * gbs
        return (np.concatenate(examples)[:full].reshape(-1, gbs), np.concatenate(owners)[:full].reshape(-1, gbs))

    def iteration_batches(self, plan: Tuple[np.ndarray, np.ndarray], rank: int, world_size: int,
                          start_batch: int = 0) -> Iterator[Dict]:
        """This rank's share of each global batch of an iteration_plan, from batch start_batch on
        (a resumed run sees exactly the batches it would have seen)."""
        examples, puzzles = plan
        local = examples.shape[1] // world_size
        part = slice(rank * local, (rank + 1) * local)
        for b in range(start_batch, len(examples)):
            yield self._collate(examples[b, part], puzzles[b, part], local)

    def steps_per_iteration(self, epochs_per_iter: int, global_batch_size: int) -> Optional[int]:
        """Full batches in one iteration when it is known without drawing (one example per puzzle)."""
        if not self.one_example_per_puzzle:
            return None
        return epochs_per_iter * self.num_groups // global_batch_size

    def _collate(self, example_ids: np.ndarray, puzzle_ids: np.ndarray, size: int):
        import torch   # why: building a data set (build_sudoku, its process pool) never needs torch

        from hrlplan.models.hrm import IGNORE_LABEL_ID

        inputs = np.asarray(self.inputs[example_ids], dtype=np.int32)
        labels = np.asarray(self.labels[example_ids], dtype=np.int32)
        ids = np.asarray(self.puzzle_identifiers[puzzle_ids], dtype=np.int32)
        ignore = self.metadata.get("ignore_label_id")
        if ignore is not None:
            labels[labels == ignore] = IGNORE_LABEL_ID
        pad = size - len(example_ids)
        if pad > 0:   # ACT keeps a fixed-size carry; padded rows have no labels and count nowhere
            inputs = np.pad(inputs, ((0, pad), (0, 0)), constant_values=self.metadata["pad_id"])
            labels = np.pad(labels, ((0, pad), (0, 0)), constant_values=IGNORE_LABEL_ID)
            ids = np.pad(ids, (0, pad), constant_values=self.metadata["blank_identifier_id"])
        return {"inputs": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                "puzzle_identifiers": torch.from_numpy(ids)}

    def epoch_batches(self, epoch: int, seed: int, global_batch_size: int, rank: int, world_size: int,
                      start_batch: int = 0) -> Iterator[Dict]:
        """This rank's share of every global batch of one epoch; a pure function of (seed, epoch),
        so a resumed run sees exactly the batches it would have seen."""
        local = global_batch_size // world_size
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(self.num_groups)
        # Draw every group's puzzle and example up front so skipped batches consume the same randomness.
        lo, hi = self.group_indices[order], self.group_indices[order + 1]
        puzzles = lo + (rng.random(len(order)) * (hi - lo)).astype(np.int64)
        first, last = self.puzzle_indices[puzzles], self.puzzle_indices[puzzles + 1]
        examples = first + (rng.random(len(order)) * (last - first)).astype(np.int64)
        for b in range(start_batch, self.steps_per_epoch(global_batch_size)):
            part = slice(b * global_batch_size + rank * local, min(b * global_batch_size + (rank + 1) * local, len(order)))
            yield self._collate(examples[part], puzzles[part], local)

    def test_batches(self, global_batch_size: int, rank: int, world_size: int,
                     max_examples: Optional[int] = None) -> Iterator[Dict]:
        """Every example once; every rank yields the same number of (padded) batches."""
        local = global_batch_size // world_size
        total = len(self.inputs) if max_examples is None else min(max_examples, len(self.inputs))
        puzzle_of = np.searchsorted(self.puzzle_indices, np.arange(total), side="right") - 1
        for start in range(0, total, global_batch_size):
            part = np.arange(start + rank * local, min(start + (rank + 1) * local, total))
            yield self._collate(part, puzzle_of[part], local)
