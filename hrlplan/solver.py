"""HiGHS (highspy), the integer-program solver of the heterogeneous planner (search/hetero_exact.py)
and the document dispatch (data/dispatch.py), made quiet."""
from __future__ import annotations

import os
import sys


def quiet_highs():
    """A highspy.Highs with its output off. Its C++ constructor prints a two-line banner to fd 1 (once
    per process) before any option can be set, so fd 1 points at /dev/null while it runs."""
    import highspy   # why here: callers without it (an old install) say so in their own words

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    highs.setOptionValue("output_flag", False)
    return highs
