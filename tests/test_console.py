"""What the user sees: one short line per step off a terminal (the tqdm bar alone on one), metric lines
with their prefixes, and one message naming the rank when a local worker fails or is killed."""
import logging
import os
import signal
import time
from types import SimpleNamespace

import pytest

from hrlplan.errors import UserError
from hrlplan.runtime import metrics
from hrlplan.runtime.metrics import MetricsLogger, Progress, metrics_line
from hrlplan.launch.local import describe_failure, launch_workers

STEP = {"train/lm_loss": 2.5, "train/step_time_s": 0.05, "train/tokens_per_s": 12345.0}


def test_metric_lines_keep_their_prefixes():
    line = metrics_line(3, {"stage0/compute_s": 0.01, "stage1/compute_s": 0.02})
    assert "stage0/compute_s=0.01" in line and "stage1/compute_s=0.02" in line


def test_off_a_terminal_progress_is_a_plain_line_with_eta():
    progress = Progress(50, tty=False)
    line = progress.update(10, STEP)
    assert line.startswith("10/50 (20%)") and "loss 2.5" in line and "50.0 ms/step" in line
    assert "12.3k tokens/s" in line and "eta" in line


def test_on_a_terminal_the_bar_shows_loss_speed_and_eta(capsys):
    progress = Progress(50, tty=True)
    progress.update(10, STEP)
    progress.close()
    bar = capsys.readouterr().err
    assert "10/50" in bar and "loss 2.5" in bar and "tokens/s" in bar and "<" in bar   # tqdm's [elapsed<eta]


def test_logger_prints_one_short_line_per_step_and_the_rest_goes_to_the_files(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(metrics, "_is_tty", lambda: False)
    config = {"train": {"steps": 4}, "arch": {"family": "hf"}}
    logger = MetricsLogger(tmp_path, config, {"mode": "disabled"})
    with caplog.at_level(logging.INFO, logger="hrlplan"):
        logger.log({**STEP, "train/grad_norm": 0.5, "stage/0/compute_s": 0.01, "memory/peak_gib": 0.1}, step=1)
        logger.log({"eval/lm_loss": 2.4}, step=1)
        logger.log({"memory/rank0/peak_gib": 0.1}, step=1)
        logger.note("plan: pp=2")
    logger.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 1/4 (25%) | loss 2.5 | 50.0 ms/step | 12.3k tokens/s | eta")
    assert len(lines[0]) < 100 and "grad_norm" not in caplog.text and "memory" not in caplog.text
    assert lines[1:] == ["step     1 | eval/lm_loss=2.4", "plan: pp=2"]
    record = metrics.read_metrics(tmp_path)[0]
    assert record["stage/0/compute_s"] == 0.01 and record["train/grad_norm"] == 0.5   # only in the files
    assert "loss 2.5" in (tmp_path / "train.log").read_text()


def test_on_a_terminal_the_bar_alone_stands_for_the_steps(tmp_path, caplog, capsys, monkeypatch):
    monkeypatch.setattr(metrics, "_is_tty", lambda: True)
    logger = MetricsLogger(tmp_path, {"train": {"steps": 4}, "arch": {"family": "hf"}}, {"mode": "disabled"})
    with caplog.at_level(logging.INFO, logger="hrlplan"):
        logger.log(STEP, step=1)
        logger.log({**STEP, "eval/lm_loss": 2.4}, step=2)
    logger.finish()
    assert [r.getMessage() for r in caplog.records] == ["step     2 | eval/lm_loss=2.4"]   # no per-step lines
    assert "2/4" in capsys.readouterr().err


def test_large_step_times_print_in_seconds():
    line = Progress(50, tty=False).update(10, {**STEP, "train/step_time_s": 4.16})
    assert "4.16 s/step" in line and "e+" not in line


# ---------------------------------------------------------------- local workers that fail
def _fail(mode):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("the data on rank 1 is bad")
    dist.barrier()   # rank 0 waits for a peer that is gone: it must be stopped, not left hanging
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("mode,expected", [("kill", "was killed by signal SIGKILL"),
                                           ("raise", "ValueError: the data on rank 1 is bad")])
def test_a_failing_rank_ends_the_job_with_one_message_naming_it(mode, expected, tmp_path):
    with pytest.raises(UserError) as err:
        launch_workers(_fail, (mode,), 2, log_dir=str(tmp_path))
    message = str(err.value)
    assert message.startswith("worker rank 1 ") and expected in message and "\n" not in message
    assert "stderr.log" in message   # where the rank's own output went


def _failure(exitcode, message="", timestamp=0):
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp, error_file="<N/A>",
                           signal_name=lambda: "SIGKILL")


def test_the_root_cause_is_reported_not_the_ranks_that_lost_their_peer():
    failures = {0: _failure(1, "RuntimeError: Connection closed by peer [127.0.0.1]:1234", timestamp=1),
                1: _failure(-9, "Signal 9 (SIGKILL) received by PID 7", timestamp=2)}
    rank, how, line, _ = describe_failure(failures)
    assert rank == 1 and how == "was killed by signal SIGKILL" and line == ""
    failures[1] = _failure(1, {"message": "ValueError: bad value\nTraceback ..."}, timestamp=2)
    failures[1].message = {"message": "ValueError: bad value\nTraceback ..."}
    assert describe_failure(failures)[:3] == (1, "exited with code 1", "ValueError: bad value")
