"""Finishing a data build: write its description, then swap the whole directory into place at once."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict


def publish_build(tmp_dir: str, out_dir: str, info_name: str, info: Dict[str, Any]) -> None:
    """A reader sees either the old complete set or the new complete one, never a half-written one."""
    with open(os.path.join(tmp_dir, info_name), "w") as f:
        json.dump(info, f, indent=1)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp_dir, out_dir)
