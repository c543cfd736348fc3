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
    plan = train.iteration_plan(0, seed=0, epochs_per_iter=3, global_batch_size=4)
    assert plan[0].shape == (4, 4)   # 3 epochs x 6 groups = 18 draws: 4 full batches, the last 2 dropped
    batches = list(train.iteration_batches(plan, rank=0, world_size=1))
    assert len(batches) == 4 and all(b["labels"].ne(-100).all() for b in batches)   # no padded row
    again = list(train.iteration_batches(plan, rank=0, world_size=1, start_batch=1))
    assert again[0]["inputs"].equal(batches[1]["inputs"])
    halves = [list(train.iteration_batches(plan, r, 2)) for r in (0, 1)]
    assert halves[0][0]["inputs"].shape == (2, 81)
    assert halves[0][0]["inputs"].equal(batches[0]["inputs"][:2])
    assert halves[1][0]["inputs"].equal(batches[0]["inputs"][2:])
    assert sum(b["labels"].ne(-100).any(1).sum().item() for b in PuzzleSplit(out, "test").test_batches(2, 0, 1)) == 3


def test_presets_and_missing_paths():
    assert resolve_preset("data/sudoku-extreme-small").num_train == 100
    custom = resolve_preset("sudoku-extreme-2k-aug-10")
    assert (custom.num_train, custom.num_aug) == (2000, 10)
    assert resolve_preset("my-puzzles") is None
    with pytest.raises(FileNotFoundError, match="not a Sudoku preset"):
        ensure_sudoku_dataset("/nonexistent/my-puzzles")


def _hrm_iteration(group_indices, seed, iteration, epochs_per_iter, gbs):
    """HRM's puzzle_dataset.py _iter_train for one-example puzzles, draw by draw."""
    rng = np.random.Generator(np.random.Philox(seed=seed + iteration + 1))
    order = np.concatenate([rng.permutation(len(group_indices) - 1) for _ in range(epochs_per_iter)])
    picks = [rng.integers(group_indices[g], group_indices[g + 1]) for g in order]
    return [picks[i:i + gbs] for i in range(0, len(picks) - gbs + 1, gbs)]


def test_training_batches_are_hrm_own_for_one_example_puzzles(tmp_path):
    out = build_sudoku_dataset(str(tmp_path / "tiny"), SPEC, seed=1, workers=1, progress=False, log=lambda _: None)
    train = PuzzleSplit(out, "train")
    for iteration in (0, 2):
        examples, puzzles = train.iteration_plan(iteration, seed=5, epochs_per_iter=2, global_batch_size=5)
        want = _hrm_iteration(train.group_indices, 5, iteration, 2, 5)
        assert examples.tolist() == [[int(x) for x in b] for b in want] and puzzles.tolist() == examples.tolist()
    assert train.steps_per_iteration(2, 5) == 2


def test_multi_example_puzzles_pack_and_cut_at_batch_end(tmp_path):
    # 3 groups of one puzzle each, with 3, 2 and 1 examples (as ARC's demonstration pairs).
    split = tmp_path / "train"
    split.mkdir()
    arrays = {"inputs": np.arange(6 * 4, dtype=np.uint8).reshape(6, 4) + 1, "labels": np.ones((6, 4), np.uint8) + 1,
              "puzzle_identifiers": np.array([1, 2, 3], np.int32), "puzzle_indices": np.array([0, 3, 5, 6], np.int32),
              "group_indices": np.array([0, 1, 2, 3], np.int32)}
    for name, array in arrays.items():
        np.save(split / f"all__{name}.npy", array)
    (split / "dataset.json").write_text(json.dumps(dict(seq_len=4, vocab_size=30, pad_id=0, ignore_label_id=0,
                                                        blank_identifier_id=0, num_puzzle_identifiers=4, total_groups=3,
                                                        mean_puzzle_examples=2, sets=["all"])))
    data = PuzzleSplit(str(tmp_path), "train")
    assert data.steps_per_iteration(4, 4) is None
    examples, puzzles = data.iteration_plan(0, seed=0, epochs_per_iter=4, global_batch_size=4)
    assert examples.shape[1] == 4 and len(examples) >= 4   # 24 examples drawn, cut at batch ends
    owner = np.searchsorted(arrays["puzzle_indices"], examples, side="right") - 1
    assert (owner == puzzles).all()
