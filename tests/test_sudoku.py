"""Sudoku generation: unique valid solutions, hardness, validity-preserving augmentation, format."""
import json
import os

import numpy as np
import pytest

from hrlplan.data.sudoku import (PuzzleSplit, SudokuPreset, agrees_with, augment, build_sudoku_dataset, count_solutions,
                                 ensure_sudoku_dataset, generate_puzzle, generate_puzzles, is_valid_solution,
                                 resolve_preset, solvable_by_singles, solve)

SPEC = SudokuPreset(num_train=6, num_test=3, num_aug=3)


@pytest.fixture(scope="module")
def puzzles():
    return generate_puzzles(6, seed=0, split="train", preset=SPEC, progress=False)


def test_every_puzzle_has_exactly_one_valid_solution(puzzles):
    boards, solutions, ratings = puzzles
    for board, solution in zip(boards.tolist(), solutions.tolist()):
        assert count_solutions(board, limit=3) == 1
        assert is_valid_solution(solution) and agrees_with(board, solution)
        assert solve(board).solution == solution


def test_puzzles_are_hard(puzzles):
    boards, _, ratings = puzzles
    for board, rating in zip(boards.tolist(), ratings):
        assert sum(1 for v in board if v) <= SPEC.max_clues
        assert not solvable_by_singles(board)
        assert rating >= SPEC.min_guesses


def test_singles_solver_recognises_an_easy_puzzle(puzzles):
    _, solutions, _ = puzzles
    easy = list(solutions[0])
    for i in (0, 10, 20, 30, 40):
        easy[i] = 0
    assert solvable_by_singles(easy)
    assert not is_valid_solution([1] * 81)


def test_augmentation_preserves_validity(puzzles):
    boards, solutions, _ = puzzles
    aug_boards, aug_solutions = augment(boards[0], solutions[0], 20, np.random.default_rng(0))
    assert len({b.tobytes() for b in aug_boards}) > 1
    for board, solution in zip(aug_boards.tolist(), aug_solutions.tolist()):
        assert is_valid_solution(solution) and agrees_with(board, solution)
        assert sum(1 for v in board if v) == int(np.count_nonzero(boards[0]))
        assert count_solutions(board, limit=2) == 1


def test_generation_is_deterministic_per_seed():
    assert generate_puzzle(3, "train", 1, SPEC)[0] == generate_puzzle(3, "train", 1, SPEC)[0]
    assert generate_puzzle(3, "train", 1, SPEC)[0] != generate_puzzle(4, "train", 1, SPEC)[0]


def test_dataset_layout_matches_hrm_and_batches_cover_groups(tmp_path):
    out = build_sudoku_dataset(str(tmp_path / "tiny"), SPEC, seed=1, workers=1, progress=False, log=lambda _: None)
    meta = json.load(open(os.path.join(out, "train", "dataset.json")))
    assert meta["seq_len"] == 81 and meta["vocab_size"] == 11 and meta["total_groups"] == 6 and meta["sets"] == ["all"]
    inputs = np.load(os.path.join(out, "train", "all__inputs.npy"))
    labels = np.load(os.path.join(out, "train", "all__labels.npy"))
    assert inputs.shape == (24, 81) and inputs.dtype == np.uint8 and inputs.min() >= 1 and labels.min() >= 2
    assert np.load(os.path.join(out, "train", "all__group_indices.npy")).tolist() == [0, 4, 8, 12, 16, 20, 24]
    assert json.load(open(os.path.join(out, "identifiers.json"))) == ["<blank>"]
    train = PuzzleSplit(out, "train")
    batches = list(train.epoch_batches(epoch=0, seed=0, global_batch_size=4, rank=0, world_size=1))
    assert len(batches) == 2 and batches[1]["labels"][2:].eq(-100).all()   # 6 groups: the last batch is padded
    again = list(train.epoch_batches(epoch=0, seed=0, global_batch_size=4, rank=0, world_size=1, start_batch=1))
    assert again[0]["inputs"].equal(batches[1]["inputs"])
    halves = [list(train.epoch_batches(0, 0, 4, r, 2)) for r in (0, 1)]
    assert halves[0][0]["inputs"].shape == (2, 81)
    assert halves[0][0]["inputs"].equal(batches[0]["inputs"][:2]) and halves[1][0]["inputs"].equal(batches[0]["inputs"][2:])
    assert sum(b["labels"].ne(-100).any(1).sum().item() for b in PuzzleSplit(out, "test").test_batches(2, 0, 1)) == 3


def test_presets_and_missing_paths():
    assert resolve_preset("data/sudoku-extreme-small").num_train == 100
    custom = resolve_preset("sudoku-extreme-2k-aug-10")
    assert (custom.num_train, custom.num_aug) == (2000, 10)
    assert resolve_preset("my-puzzles") is None
    with pytest.raises(FileNotFoundError, match="not a Sudoku preset"):
        ensure_sudoku_dataset("/nonexistent/my-puzzles")
