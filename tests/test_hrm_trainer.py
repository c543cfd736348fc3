"""HRM training loop in one process (gloo, world size 1): loss, checkpoints, resume, evaluation."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hrlplan.data.sudoku import SudokuPreset, build_sudoku_dataset
from hrlplan.runtime.hrm_trainer import evaluate_cli, find_checkpoint, train_hrm
from hrlplan.runtime.train_core import warmup_cosine

ARCH = dict(name="hrm", family="hrm", hidden_size=16, H_layers=1, L_layers=1, num_heads=1, expansion=2,
            puzzle_emb_ndim=16, H_cycles=2, L_cycles=2, halt_max_steps=2, halt_exploration_prob=0.1)


class RecordingLogger:
    def __init__(self):
        self.records = []
        self.notes = []

    def log(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def note(self, text):
        self.notes.append(text)


@pytest.fixture(scope="module")
def sudoku_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "tiny-sudoku"
    return build_sudoku_dataset(str(out), SudokuPreset(num_train=8, num_test=4, num_aug=1), seed=0, workers=1,
                                progress=False, log=lambda _: None)


@pytest.fixture
def process_group(free_port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cfg(data_path, **train):
    base = dict(epochs=4, eval_interval=2, global_batch_size=4, lr=3e-3, puzzle_emb_lr=1e-2, weight_decay=0.1,
                puzzle_emb_weight_decay=0.1, seed=0, checkpoint_interval=0, resume="none", steps=None,
                warmup_steps=1, min_lr_ratio=0.1, device="cpu", dp_mode="fsdp")
    base.update(train)
    return {"arch": dict(ARCH), "train": base, "data": {"name": "sudoku", "path": data_path}}


def test_train_hrm_few_steps_writes_a_checkpoint(sudoku_dir, tmp_path, process_group, capsys):
    logger = RecordingLogger()
    result = train_hrm(_cfg(sudoku_dir, stop_after=6), str(tmp_path), None, logger)
    assert result["step"] == 6 and result["total_steps"] == 8   # 4 epochs x 2 batches, capped at 6
    losses = [m["train/lm_loss"] for _, m in logger.records if "train/lm_loss" in m]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert "train/lr" in logger.records[-2][1] or "train/lr" in logger.records[-1][1]
    evals = [m for _, m in logger.records if "eval/exact_accuracy" in m]
    assert evals and 0.0 <= evals[-1]["eval/exact_accuracy"] <= 1.0
    ckpt = result["checkpoint"]
    assert os.path.basename(ckpt) == "step_000006" and find_checkpoint(str(tmp_path)) == ckpt
    # the training core's format: DCP shards (model and optimizer by name), per-rank extra state
    for name in (".metadata", "extra_rank0.pt", "all_config.yaml", "hrm.py"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    keys = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert "model.model.inner.puzzle_emb.weights" in keys
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg") for k in keys)
    extra = torch.load(os.path.join(ckpt, "extra_rank0.pt"), weights_only=True)
    assert extra["position"]["iteration"] == 1 and extra["position"]["batch"] == 2   # 4 batches per iteration
    assert os.path.isfile(os.path.join(tmp_path, "checkpoints", "all_config.yaml"))
    assert not any(n.endswith(".tmp") for n in os.listdir(os.path.join(tmp_path, "checkpoints")))

    # resume continues from step 6 to the end of the 4 epochs
    logger2 = RecordingLogger()
    result2 = train_hrm(_cfg(sudoku_dir, resume="auto", dp_mode="replicate"), str(tmp_path), None, logger2)
    assert result2["step"] == 8 and [s for s, m in logger2.records if "train/lm_loss" in m] == [7, 8]

    class Args:
        checkpoint = str(tmp_path / "checkpoints")
        data_path = None

    evaluate_cli(Args())
    assert "exact_accuracy" in capsys.readouterr().out


def test_training_lowers_the_loss(sudoku_dir, tmp_path, process_group):
    logger = RecordingLogger()
    train_hrm(_cfg(sudoku_dir, epochs=6, eval_interval=6, lr=1e-2, warmup_steps=0), str(tmp_path), None, logger)
    losses = [m["train/lm_loss"] for _, m in logger.records if "train/lm_loss" in m]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])


def test_missing_data_and_bad_batch_are_user_errors(sudoku_dir, tmp_path, process_group):
    from hrlplan.errors import UserError

    with pytest.raises(FileNotFoundError, match="build-sudoku"):
        train_hrm(_cfg(str(tmp_path / "nope")), str(tmp_path), None, RecordingLogger())
    with pytest.raises(UserError, match="epochs"):
        train_hrm(_cfg(sudoku_dir, epochs=None), str(tmp_path), None, RecordingLogger())


def test_lr_schedule_warms_up_then_decays_to_min_ratio():
    """HRM's counting (the update being taken from 1) on the core's one warm-up + cosine lambda."""
    f = warmup_cosine(10, 100, 0.1, hrm_counting=True)   # f(n): the n-th update, 0-based
    assert f(4) == 0.5                                   # update 5 of a 10-update warm-up
    assert f(9) == pytest.approx(1.0)
    assert f(99) == pytest.approx(0.1)
    assert warmup_cosine(0, 100, 1.0, hrm_counting=True)(49) == 1.0   # HRM's lr_min_ratio=1.0: constant
    lm = warmup_cosine(10, 100, 0.1)   # language models hold the peak one update longer
    assert lm(9) == lm(10) == 1.0 and f(10) < 1.0


def test_preemption_flag_checkpoints_and_stops(sudoku_dir, tmp_path, process_group):
    from hrlplan.runtime import preempt

    preempt.request_stop("test")
    try:
        result = train_hrm(_cfg(sudoku_dir), str(tmp_path), None, RecordingLogger())
    finally:
        preempt.clear()
    assert result["preempted"] and result["step"] == 1
    assert os.path.basename(result["checkpoint"]) == "step_000001"


def test_hrm_1k_recipe_step_count_follows_the_reference():
    from hrlplan.runtime.hrm_trainer import hrm_schedule

    # README's Sudoku 1k recipe: 1000 groups, batch 768, epochs=20000 eval_interval=2000.
    meta = {"total_groups": 1000, "mean_puzzle_examples": 1}
    sched = hrm_schedule({"epochs": 20000, "eval_interval": 2000}, meta, 768, 2000 * 1000 // 768)
    assert sched.total_steps == 26041          # HRM's schedule length (its progress bar's total)
    assert sched.iterations == 10 and sched.steps_per_iter == 2604
    assert sched.run_steps == sched.stop_at == 26040   # 10 iterations, one partial batch dropped in each
    assert 20000 * -(-1000 // 768) == 40000    # what padding every epoch's last batch used to take
    with pytest.raises(Exception, match="must divide"):
        hrm_schedule({"epochs": 10, "eval_interval": 3}, meta, 768, 1)


def test_padded_rows_contribute_nothing(sudoku_dir, tmp_path, process_group):
    from hrlplan.data.sudoku import PuzzleSplit
    from hrlplan.models.hrm import build_hrm
    from hrlplan.runtime.hrm_trainer import evaluate

    train, test = PuzzleSplit(sudoku_dir, "train"), PuzzleSplit(sudoku_dir, "test")
    # Training never sees a padded row: only full batches are built.
    plan = train.iteration_plan(0, seed=0, epochs_per_iter=3, global_batch_size=5)
    assert all(b["labels"].ne(-100).all() for b in train.iteration_batches(plan, 0, 1))
    # Evaluation pads its last batch; the padded rows change no metric (4 test puzzles, batch 3 vs 4).
    torch.manual_seed(0)
    model = build_hrm(dict(ARCH), num_puzzle_identifiers=train.metadata["num_puzzle_identifiers"])
    padded = evaluate(model, test, 3, torch.device("cpu"))
    full = evaluate(model, test, 4, torch.device("cpu"))
    assert padded.keys() == full.keys()
    for key in full:
        assert padded[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key


def test_iterations_checkpoint_path_and_nested_loss(sudoku_dir, tmp_path, process_group):
    arch = dict(ARCH, loss={"name": "losses@ACTLossHead", "loss_type": "softmax_cross_entropy"},
                forward_dtype="bfloat16")
    cfg = _cfg(sudoku_dir, epochs=2, eval_interval=1, global_batch_size=3, grad_clip=None,
               checkpoint_every_eval=False, checkpoint_path=str(tmp_path / "ckpts"))
    cfg["arch"] = arch
    logger = RecordingLogger()
    result = train_hrm(cfg, str(tmp_path / "run"), None, logger)
    # 8 groups per epoch, batch 3: 2 full batches per iteration (2 rows dropped), 2 iterations.
    assert result["step"] == 4 and result["total_steps"] == 5
    assert [s for s, m in logger.records if "eval/exact_accuracy" in m] == [2, 4]
    assert sorted(os.listdir(tmp_path / "ckpts")).count("step_000004") == 1
    assert not (tmp_path / "ckpts" / "step_000002").exists()   # checkpoint_every_eval=False: the last one only
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert any("forward in float32 (arch.forward_dtype=bfloat16 on cpu)" in n for n in logger.notes)


def test_nested_loss_type_and_forward_dtype_resolve():
    from hrlplan.models.hrm import build_hrm, resolve_forward_dtype, softmax_cross_entropy
    from hrlplan.runtime.hrm_trainer import _forward_dtype

    model = build_hrm(dict(ARCH, loss={"name": "losses@ACTLossHead", "loss_type": "softmax_cross_entropy"},
                           loss_type="stablemax_cross_entropy"))
    assert model.loss_fn is softmax_cross_entropy   # HRM's arch.loss.loss_type wins over the flat key
    assert resolve_forward_dtype("auto", "cuda") == "bfloat16" and resolve_forward_dtype("auto", "cpu") == "float32"
    assert _forward_dtype({"forward_dtype": "bfloat16"}, torch.device("cpu")) == "float32"
    assert _forward_dtype({"forward_dtype": "bfloat16"}, torch.device("cuda", 0)) == "bfloat16"


@pytest.mark.parametrize("stop", [3, 4])   # inside an iteration, and at its end (before its evaluation's checkpoint)
def test_resume_continues_the_same_loss_curve(sudoku_dir, tmp_path, process_group, stop):
    """Weights, AdamATan2 state, LR schedules, RNG, data position and the ACT carry are all in the
    checkpoint: a stopped and resumed run repeats the uninterrupted run's losses exactly."""
    def losses(logger):
        return {s: m["train/lm_loss"] for s, m in logger.records if "train/lm_loss" in m}

    whole = RecordingLogger()
    train_hrm(_cfg(sudoku_dir), str(tmp_path / "whole"), None, whole)
    first, second = RecordingLogger(), RecordingLogger()
    train_hrm(_cfg(sudoku_dir, stop_after=stop), str(tmp_path / "split"), None, first)
    result = train_hrm(_cfg(sudoku_dir, resume="auto"), str(tmp_path / "split"), None, second)
    assert result["step"] == 8 and sorted(losses(second)) == list(range(stop + 1, 9))
    assert {**losses(first), **losses(second)} == losses(whole)
    evals = [s for s, m in whole.records + first.records + second.records if "eval/exact_accuracy" in m]
    assert evals.count(4) == 2 and evals.count(8) == 2   # iteration 0's evaluation ran once in the split run
