import os
import socket

import pytest

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Runs that expect a second run to reuse the first's calibration must not depend on how busy the box was
# during the first: the steadiness threshold is off unless a test sets it (test_calibration_steadiness).
os.environ.setdefault("HRLPLAN_CALIBRATION_MAX_SPREAD", "inf")


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Calibration (on by default for probed clusters) is cached per user; the tests share one cache of
# their own, so the first job of a cluster shape and model measures and the rest reuse it.
if "HRLPLAN_CALIBRATION_CACHE" not in os.environ:
    import tempfile

    os.environ["HRLPLAN_CALIBRATION_CACHE"] = tempfile.mkdtemp(prefix="hrlplan-test-calibration-")
