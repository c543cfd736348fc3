"""What the user sees: metric lines with their prefixes, a progress bar (or plain progress lines off a
terminal), and one message naming the rank when a local worker fails or is killed."""
import logging
import os
import signal
import time
from types import SimpleNamespace

import pytest

from hrlplan.errors import UserError
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


def test_logger_prints_training_steps_with_progress_and_keeps_prefixes(tmp_path, caplog):
    config = {"train": {"steps": 4}, "arch": {"family": "hf"}}
    logger = MetricsLogger(tmp_path, config, {"mode": "disabled"})
    with caplog.at_level(logging.INFO, logger="hrlplan"):
        logger.log(STEP, step=1)
        logger.log({"stage0/compute_s": 0.01}, step=1)
        logger.note("plan: pp=2")
    logger.finish()
    text = caplog.text
    assert "1/4 (25%)" in text and "train/lm_loss=2.5" in text and "stage0/compute_s=0.01" in text
    assert "plan: pp=2" in text
    assert "train/lm_loss=2.5" in (tmp_path / "train.log").read_text()


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
