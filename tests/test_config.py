"""Every config option composes; a typo or a mistyped value fails at compose time."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from hrlplan.config import compose
from hrlplan.model_meta import conf_dir

GROUPS = ["arch", "cluster", "planner", "train", "data", "logger"]


def options(group):
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    assert cfg[group]


def test_defaults_are_the_tiny_local_job():
    cfg = compose([])
    assert cfg["arch"]["name"] == "gpt2-tiny"
    assert cfg["cluster"]["probe"] is True
    assert cfg["logger"]["mode"] == "offline"
    assert cfg["train"]["schedule"] in ("gpipe", "1f1b")


@pytest.mark.parametrize("override", ["arch.n_layr=3", "train.stepz=3", "train.steps=many", "planner.samplez=3",
                                      "logger.mode_=offline", "cluster.nproc=2"])
def test_typo_fails_at_compose(override):
    with pytest.raises(ConfigCompositionException):
        compose([override])


def test_hrm_overrides_users_know_compose():
    cfg = compose(["arch=hrm", "data_path=data/sudoku-extreme-small", "epochs=500", "eval_interval=100",
                   "global_batch_size=4", "lr=1e-4", "puzzle_emb_lr=1e-4", "weight_decay=1.0",
                   "puzzle_emb_weight_decay=1.0", "arch.hidden_size=32", "arch.H_layers=1", "arch.L_layers=1",
                   "arch.num_heads=1", "arch.expansion=2"])
    assert cfg["train"]["global_batch_size"] == 4 and cfg["train"]["lr"] == 1e-4
    assert cfg["train"]["epochs"] == 500 and cfg["data"]["path"] == "data/sudoku-extreme-small"
    assert cfg["arch"]["hidden_size"] == 32 and cfg["arch"]["puzzle_emb_ndim"] == 32


def test_arch_overrides_reach_the_model():
    cfg = compose(["arch=gpt2", "arch.n_layer=24"])
    assert cfg["arch"]["n_layer"] == 24


def test_a_missing_config_tree_names_where_it_looked_and_the_fix(tmp_path, monkeypatch):
    from hrlplan.errors import UserError

    monkeypatch.setenv("HRLPLAN_CONF", str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"nowhere.*\$HRLPLAN_CONF.*pip install -e \."):
        conf_dir()


def test_the_config_tree_ships_inside_the_package():
    from fnmatch import fnmatch

    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11

    import hrlplan

    root = Path(__file__).resolve().parent.parent
    packaged = Path(hrlplan.__file__).resolve().parent / "conf"
    assert (packaged / "config.yaml").resolve() == (root / "conf" / "config.yaml").resolve()
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hrlplan"]
    # every config file is matched by the wheel's package data (setuptools' ** spans folders)
    for f in (root / "conf").rglob("*.yaml"):
        rel = f"conf/{f.relative_to(root / 'conf').as_posix()}"
        assert any(fnmatch(rel, g) for g in globs), rel
