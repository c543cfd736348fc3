"""A plain (non-editable) install works from any directory: build the wheel offline, install it into a
fresh venv, and run the main job there (`hrlplan train ...`) from a directory that is not the checkout.

The wheel is built from a copy of the working tree (pyproject.toml, hrlplan/, conf/), so the checkout
gets no build/ folder; the venv sees the system site-packages (torch, hydra, ...) but its own hrlplan
shadows the editable one. Part of CI: .ci/run runs every test, this one included."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("arch", "cluster", "data", "experiment", "logger", "planner", "train", "hydra/launcher")


def _run(argv, **kw):
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{argv} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "hrlplan", src / "hrlplan", symlinks=True, ignore=ignore)   # keeps the conf link
    shutil.copytree(ROOT / "conf", src / "conf", ignore=ignore)
    shutil.copytree(ROOT / "hydra_plugins", src / "hydra_plugins", ignore=ignore)
    # offline: the installed setuptools builds it (no isolated build env, no index)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", tmp / "dist", src])
    wheels = list((tmp / "dist").glob("hrlplan-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_carries_the_configs_and_the_policy_and_no_top_level_launch(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    # no `launch`, `conf`, `tests`; hydra_plugins only carries the alias Hydra needs to name our SLURM launcher
    assert {t for t in tops if not t.endswith(".dist-info")} == {"hrlplan", "hydra_plugins"}, tops
    assert "hydra_plugins/hrlplan_launcher/submitit_launcher.py" in names
    assert "hrlplan/launch/job.py" in names   # the launcher travels inside the package
    assert "hrlplan/conf/config.yaml" in names
    for group in GROUPS:
        shipped = {p.name for p in (ROOT / "conf" / group).glob("*.yaml")}
        packed = {Path(n).name for n in names if n.startswith(f"hrlplan/conf/{group}/") and n.endswith(".yaml")}
        assert shipped and packed == shipped, (group, shipped ^ packed)
    pretrained = {p.name for p in (ROOT / "hrlplan/search/hrl/pretrained").iterdir() if p.is_file()}
    assert pretrained and all(f"hrlplan/search/hrl/pretrained/{p}" in names for p in pretrained)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hrlplan = hrlplan.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_hrlplan_train_runs_from_a_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    python = venv / "bin" / "python"
    # the system's pip, run by the venv's interpreter, installs into the venv
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HRLPLAN_CONF", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    run = tmp_path / "elsewhere"
    run.mkdir()
    where = _run([python, "-c", "import hrlplan; print(hrlplan.__file__)"], cwd=run, env=env).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), f"the editable checkout shadows the wheel: {where}"

    out = _run([venv / "bin" / "hrlplan", "train", "train.steps=2", "logger.mode=disabled"], cwd=run, env=env)
    plans = list((run / "outputs").glob("*/*/plan.yaml"))
    assert len(plans) == 1, out.stderr[-3000:]
    assert yaml.safe_load(plans[0].read_text())["model"] == "gpt2-tiny"
    metrics = (plans[0].parent / "metrics.jsonl").read_text().splitlines()
    assert any('"step": 2' in line for line in metrics), metrics[-3:]
