"""HRM's Sudoku builder from local CSVs in the real sudoku-extreme format (source,question,answer,rating)."""
import json
import os

import numpy as np
import pytest

from hrlplan.data.build_sudoku import build_from_csv, find_csv_files, generated_preset, main, shuffle_sudoku
from hrlplan.data.sudoku import PuzzleSplit, agrees_with, is_valid_solution
from hrlplan.errors import UserError

SOLUTION = "".join(str((r * 3 + r // 3 + c) % 9 + 1) for r in range(9) for c in range(9))


def _puzzle(seed: int) -> str:
    rng = np.random.default_rng(seed)
    cells = list(SOLUTION)
    for i in rng.choice(81, size=50, replace=False):
        cells[i] = "."
    return "".join(cells)


def _write_csv(path, ratings):
    rows = ["source,question,answer,rating"]
    rows += [f"puzzles{i % 3},{_puzzle(i)},{SOLUTION},{r}" for i, r in enumerate(ratings)]
    path.write_text("\n".join(rows) + "\n")


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "sudoku-extreme"
    src.mkdir()
    _write_csv(src / "train.csv", [0, 5, 12, 30, 2, 7])
    _write_csv(src / "test.csv", [1, 40, 3])
    return src


def test_builds_hrm_arrays_and_metadata_from_real_format_csv(source, tmp_path):
    out = tmp_path / "sudoku-1k"
    assert main(["--source-repo", str(source), "--output-dir", str(out), "--subsample-size", "4",
                 "--num-aug", "2", "--seed", "3"]) == 0
    meta_text = (out / "train" / "dataset.json").read_text()
    assert json.loads(meta_text) == {"pad_id": 0, "ignore_label_id": 0, "blank_identifier_id": 0, "vocab_size": 11,
                                     "seq_len": 81, "num_puzzle_identifiers": 1, "total_groups": 4,
                                     "mean_puzzle_examples": 1.0, "sets": ["all"]}
    assert list(json.loads(meta_text)) == ["pad_id", "ignore_label_id", "blank_identifier_id", "vocab_size", "seq_len",
                                           "num_puzzle_identifiers", "total_groups", "mean_puzzle_examples", "sets"]
    assert json.loads((out / "identifiers.json").read_text()) == ["<blank>"]
    load = lambda split, name: np.load(out / split / f"all__{name}.npy")  # noqa: E731
    inputs, labels = load("train", "inputs"), load("train", "labels")
    assert inputs.shape == labels.shape == (12, 81) and inputs.dtype == labels.dtype == np.uint8
    assert load("train", "group_indices").tolist() == [0, 3, 6, 9, 12]
    assert load("train", "group_indices").dtype == np.int32
    assert load("train", "puzzle_indices").tolist() == list(range(13))
    assert load("train", "puzzle_identifiers").tolist() == [0] * 12
    originals = {_puzzle(i) for i in range(6)}
    for g in range(4):
        row = inputs[g * 3]   # the first of each group is the CSV's puzzle, stored + 1 ('.' -> 1)
        assert "".join("." if v == 1 else str(v - 1) for v in row) in originals
        assert "".join(str(v - 1) for v in labels[g * 3]) == SOLUTION
    for puzzle, solution in zip(inputs - 1, labels - 1):   # every variant a valid puzzle of its solution
        assert is_valid_solution(solution) and agrees_with(puzzle, solution)
    assert load("test", "inputs").shape == (3, 81) and load("test", "group_indices").tolist() == [0, 1, 2, 3]
    assert PuzzleSplit(str(out), "train").steps_per_iteration(1, 2) == 2   # the trainer reads it


def test_min_difficulty_filters_and_seed_reproduces(source, tmp_path):
    a = build_from_csv([str(source)], str(tmp_path / "a"), min_difficulty=5, num_aug=1, seed=7)
    b = build_from_csv([str(source / "train.csv"), str(source / "test.csv")], str(tmp_path / "b"),
                       min_difficulty=5, num_aug=1, seed=7)
    for split, kept in (("train", 4), ("test", 1)):   # ratings >= 5: 5, 12, 30, 7 / 40
        x = np.load(os.path.join(a, split, "all__inputs.npy"))
        assert len(x) == kept * (2 if split == "train" else 1)
        assert np.array_equal(x, np.load(os.path.join(b, split, "all__inputs.npy")))


def test_shuffle_keeps_sudoku_structure():
    board = np.array([int(c) if c != "." else 0 for c in _puzzle(0)], dtype=np.uint8).reshape(9, 9)
    solution = np.array([int(c) for c in SOLUTION], dtype=np.uint8).reshape(9, 9)
    rs = np.random.RandomState(0)
    seen = set()
    for _ in range(20):
        b, s = shuffle_sudoku(board, solution, rs)
        assert is_valid_solution(s.reshape(-1)) and agrees_with(b.reshape(-1), s.reshape(-1))
        assert (b == 0).sum() == (board == 0).sum()
        seen.add(s.tobytes())
    assert len(seen) > 1


def test_sources_that_cannot_be_read_are_named(tmp_path, source):
    with pytest.raises(UserError, match="test.csv"):
        find_csv_files([str(source / "train.csv")])
    with pytest.raises(UserError, match="nothing is downloaded"):
        find_csv_files(["someone/not-cached-sudoku-set-xyz"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.csv").write_text("source,question,answer,rating\nx,123,456,1\n")
    (bad / "test.csv").write_text("source,question,answer,rating\n")
    assert main(["--source-repo", str(bad), "--output-dir", str(tmp_path / "o")]) == 2


def test_without_files_the_generated_set_is_the_default():
    assert generated_preset("data/sudoku-extreme-small", None, 0).num_train == 100
    spec = generated_preset("data/my-set", 200, 10)
    assert (spec.num_train, spec.num_aug) == (200, 10)
