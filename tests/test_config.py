"""Every config option composes; a typo or a mistyped value fails at compose time; the library gets
plain values; HRM's keys and recipe work as HRM users type them."""

import pickle
import subprocess
import sys
from enum import Enum
from pathlib import Path

import pytest
import yaml

from hrlplan.compose import compose
from hrlplan.config import HRM_RECIPE, TOP_LEVEL_ALIASES, DType, Schedule
from hrlplan.errors import ConfigError
from hrlplan.conf_tree import conf_dir

GROUPS = ["arch", "cluster", "planner", "train", "data", "logger", "experiment"]
ROOT = Path(__file__).resolve().parent.parent


def options(group):
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    assert cfg["arch"] and cfg["train"]


def test_defaults_are_the_tiny_local_job():
    cfg = compose([])
    assert cfg["arch"]["name"] == "gpt2-tiny"
    assert cfg["cluster"]["probe"] is True
    assert cfg["logger"]["mode"] == "offline"
    assert cfg["train"]["schedule"] in ("gpipe", "1f1b")


@pytest.mark.parametrize("override", ["arch.n_layr=3", "train.stepz=3", "train.steps=many", "planner.samplez=3",
                                      "logger.mode_=offline", "cluster.nproc=2"])
def test_typo_fails_at_compose(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        compose([override])


def _walk(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _walk(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _walk(v)
    else:
        yield tree


@pytest.mark.parametrize("overrides", [[], ["arch=hrm"], ["planner=hrl", "planner.schedules=[gpipe,1f1b]"],
                                       ["train.dtype=bfloat16", "train.schedule=zero_bubble", "logger=disabled"]])
def test_the_library_gets_plain_strings_not_enums(overrides):
    cfg = compose(overrides)
    assert not any(isinstance(v, Enum) for v in _walk(cfg))
    yaml.safe_dump(cfg)   # what the W&B config copy and plan cache write
    if "train.dtype=bfloat16" in overrides:
        assert type(cfg["train"]["dtype"]) is str and cfg["train"]["dtype"] == "bfloat16"
        assert cfg["train"]["schedule"] == "zero_bubble" and cfg["logger"]["mode"] == "disabled"


def test_enum_members_read_as_their_strings_and_survive_spawn():
    assert DType["bfloat16"] == "bfloat16" and f"{Schedule['1f1b']}" == "1f1b" and str(Schedule["gpipe"]) == "gpipe"
    assert pickle.loads(pickle.dumps(Schedule["1f1b"])) is Schedule["1f1b"]


def test_hrm_overrides_users_know_compose():
    cfg = compose(["arch=hrm", "data_path=data/sudoku-extreme-small", "epochs=500", "eval_interval=100",
                   "global_batch_size=4", "lr=1e-4", "puzzle_emb_lr=1e-4", "weight_decay=1.0",
                   "puzzle_emb_weight_decay=1.0", "arch.hidden_size=32", "arch.H_layers=1", "arch.L_layers=1",
                   "arch.num_heads=1", "arch.expansion=2"])
    assert cfg["train"]["global_batch_size"] == 4 and cfg["train"]["lr"] == 1e-4
    assert cfg["train"]["epochs"] == 500 and cfg["data"]["path"] == "data/sudoku-extreme-small"
    assert cfg["arch"]["hidden_size"] == 32 and cfg["arch"]["puzzle_emb_ndim"] == 32


ALIAS_VALUES = {"data_path": "x/y", "epochs": 6, "eval_interval": 3, "checkpoint_every_eval": True,
                "global_batch_size": 12, "lr": 2e-4, "lr_min_ratio": 0.5, "lr_warmup_steps": 11, "beta1": 0.8,
                "beta2": 0.9, "weight_decay": 0.5, "puzzle_emb_lr": 3e-4, "puzzle_emb_weight_decay": 0.25,
                "seed": 5, "project_name": "Sudoku-extreme-1k-aug-1000", "run_name": "my-run",
                "checkpoint_path": "checkpoints/mine"}


def test_every_hrm_top_level_key_reaches_its_group():
    assert set(ALIAS_VALUES) == set(TOP_LEVEL_ALIASES)
    overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ALIAS_VALUES.items()]
    cfg = compose(["arch=hrm", *overrides])
    for key, (group, sub) in TOP_LEVEL_ALIASES.items():
        assert cfg[group][sub] == ALIAS_VALUES[key], key


def test_hrm_recipe_defaults_apply_to_hrm_only():
    hrm = compose(["arch=hrm"])["train"]
    assert {k: hrm[k] for k in HRM_RECIPE} == HRM_RECIPE
    assert hrm["grad_clip"] is None and hrm["warmup_steps"] == 2000 and hrm["min_lr_ratio"] == 1.0
    lm = compose([])["train"]
    assert lm["grad_clip"] == 1.0 and lm["warmup_steps"] == 3 and lm["seed"] == 1234


@pytest.mark.parametrize("override,key,value", [
    ("lr_warmup_steps=5", "warmup_steps", 5), ("train.warmup_steps=3", "warmup_steps", 3),  # 3: the LM default
    ("train.seed=1234", "seed", 1234), ("seed=1234", "seed", 1234), ("train.grad_clip=1.0", "grad_clip", 1.0),
    ("lr_min_ratio=0.1", "min_lr_ratio", 0.1), ("++train.seed=1234", "seed", 1234)])
def test_the_users_explicit_value_beats_the_hrm_recipe(override, key, value):
    train = compose(["arch=hrm", override])["train"]
    assert train[key] == value
    others = {k: v for k, v in HRM_RECIPE.items() if k != key}
    assert {k: train[k] for k in others} == others   # the rest of the recipe still applies


def test_a_config_files_value_beats_the_hrm_recipe():
    from hrlplan.compose import apply_family_recipe

    # an experiment file moved warmup_steps off the language-model default: it stays
    cfg = {"arch": {"family": "hrm"}, "train": {"warmup_steps": 100, "min_lr_ratio": 0.1, "seed": 1234,
                                                "grad_clip": 1.0}}
    train = apply_family_recipe(cfg, explicit=[])["train"]
    assert train == {"warmup_steps": 100, "min_lr_ratio": 1.0, "seed": 0, "grad_clip": None}
    assert compose(["experiment=hrm-sudoku"])["train"]["warmup_steps"] == 2000


def test_grad_clip_accepts_null():
    assert compose(["train.grad_clip=null"])["train"]["grad_clip"] is None


@pytest.mark.parametrize("overrides,expected", [
    ([], "stablemax_cross_entropy"),
    (["arch.loss.loss_type=softmax_cross_entropy"], "softmax_cross_entropy"),
    (["arch.loss_type=softmax_cross_entropy"], "softmax_cross_entropy")])
def test_hrm_loss_type_both_spellings_agree(overrides, expected):
    arch = compose(["arch=hrm", *overrides])["arch"]
    assert arch["loss"]["loss_type"] == arch["loss_type"] == expected
    assert arch["loss"]["name"] == "losses@ACTLossHead"


def test_experiment_needs_no_plus_and_the_old_plus_still_works():
    plain = compose(["experiment=hrm-sudoku"])
    assert plain["arch"]["family"] == "hrm" and plain["train"]["global_batch_size"] == 768
    assert compose(["+experiment=hrm-sudoku"]) == plain


# HRM's README (sapientinc/HRM), its commands' keys verbatim after `arch=hrm`.
HRM_README = {
    "sudoku-1k": "data_path=data/sudoku-extreme-1k-aug-1000 epochs=20000 eval_interval=2000 global_batch_size=384 "
                 "lr=7e-5 puzzle_emb_lr=7e-5 weight_decay=1.0 puzzle_emb_weight_decay=1.0",
    "arc-2": "data_path=data/arc-2-aug-1000",
    "maze": "data_path=data/maze-30x30-hard-1k epochs=20000 eval_interval=2000 lr=1e-4 puzzle_emb_lr=1e-4 "
            "weight_decay=1.0 puzzle_emb_weight_decay=1.0",
    "eval-keys": "arch.loss.loss_type=stablemax_cross_entropy arch.loss.name=losses@ACTLossHead "
                 "arch.halt_max_steps=16 arch.halt_exploration_prob=0.1 arch.H_cycles=2 arch.L_cycles=2 "
                 "arch.puzzle_emb_ndim=512 arch.pos_encodings=rope lr_min_ratio=1.0 lr_warmup_steps=2000 "
                 "beta1=0.9 beta2=0.95 seed=0 checkpoint_every_eval=true project_name=p run_name=r",
}


@pytest.mark.parametrize("name", sorted(HRM_README))
def test_hrm_readme_commands_compose_verbatim(name):
    cfg = compose(["arch=hrm", *HRM_README[name].split()])
    assert cfg["arch"]["family"] == "hrm"
    assert cfg["data"]["path"] == next((o.split("=")[1] for o in HRM_README[name].split() if "data_path" in o), None)
    if name == "sudoku-1k":
        assert cfg["train"]["global_batch_size"] == 384 and cfg["train"]["lr"] == 7e-5


def test_help_lists_options_without_internal_schemas():
    out = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "_schema" not in out.stdout and "base_config" not in out.stdout
    assert "arch: gpt2" in out.stdout and "experiment: hrm-sudoku" in out.stdout


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

    packaged = Path(hrlplan.__file__).resolve().parent / "conf"
    assert (packaged / "config.yaml").resolve() == (ROOT / "conf" / "config.yaml").resolve()
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hrlplan"]
    # every config file is matched by the wheel's package data (setuptools' ** spans folders)
    for f in (ROOT / "conf").rglob("*.yaml"):
        rel = f"conf/{f.relative_to(ROOT / 'conf').as_posix()}"
        assert any(fnmatch(rel, g) for g in globs), rel


def test_hrlplan_conf_is_the_tree_train_and_the_commands_read(tmp_path):
    """A copy of conf/ with changed defaults, named by $HRLPLAN_CONF, is what `hrlplan train` composes
    (here: gpt2 on the a100x8-1n preset instead of gpt2-tiny on this machine) and what the commands
    resolve names in (an arch that exists only in the copy)."""
    import os
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    text = (conf / "config.yaml").read_text()
    assert "  - arch: gpt2-tiny\n" in text and "  - cluster: local\n" in text
    (conf / "config.yaml").write_text(text.replace("  - arch: gpt2-tiny\n", "  - arch: gpt2\n")
                                      .replace("  - cluster: local\n", "  - cluster: a100x8-1n\n"))
    (conf / "arch" / "only-in-copy.yaml").write_text((conf / "arch" / "gpt2-tiny.yaml").read_text()
                                                     .replace("name: gpt2-tiny", "name: only-in-copy")
                                                     .replace("n_layer: 6", "n_layer: 3"))
    run = tmp_path / "elsewhere"
    run.mkdir()
    env = dict(os.environ, HRLPLAN_CONF=str(conf))
    hrlplan = [sys.executable, "-m", "hrlplan.cli"]
    out = subprocess.run([*hrlplan, "train", "mode=plan", "logger.mode=disabled"], cwd=run, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plans = list((run / "outputs").glob("*/*/plan.yaml"))
    assert len(plans) == 1, out.stderr
    plan = yaml.safe_load(plans[0].read_text())
    assert (plan["model"], plan["n_layer"], plan["world_size"]) == ("gpt2", 12, 8)

    out = subprocess.run([*hrlplan, "introspect-model", "--model-id", "only-in-copy", "--out", "meta.json"],
                         cwd=run, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"n_layer": 3' in out.stdout


def _complete(line, entry):
    import os

    env = dict(os.environ, COMP_LINE=line, COMP_POINT=str(len(line)))
    out = subprocess.run([*entry, "-sc", "query=bash"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("line,entry,group", [
    ("python pretrain.py arch=", "pretrain", "arch"),
    ("python pretrain.py planner=", "pretrain", "planner"),
    ("hrlplan train cluster=", "train", "cluster"),   # the installed command: `train` is not an override
    # what bash runs after `eval "$(hrlplan train -sc install=bash)"`: `hrlplan -sc query=bash`
    ("hrlplan train planner=", "hrlplan", "planner"),
], ids=["pretrain-arch", "pretrain-planner", "hrlplan-train-cluster", "installed-hook"])
def test_tab_completion_offers_the_options_without_internal_schemas(line, entry, group):
    entry = {"pretrain": [sys.executable, str(ROOT / "pretrain.py")],
             "train": [sys.executable, "-m", "hrlplan.cli", "train"],
             "hrlplan": [sys.executable, "-m", "hrlplan.cli"]}[entry]
    offered = _complete(line, entry)
    assert offered == [f"{group}={o}" for o in options(group)], offered
    assert not [o for o in offered if "schema" in o or "base_config" in o]


def test_completion_of_other_subcommands_is_left_to_the_shell():
    assert _complete("hrlplan show-plan ", [sys.executable, "-m", "hrlplan.cli"]) == []


def test_glob_sweeps_and_hydra_listings_skip_the_schemas(tmp_path):
    from hrlplan.validate import precheck_overrides

    points = precheck_overrides(["planner=glob(*,exclude=[exact,hrl])", "cluster=a100x8-1n"], lambda o: o)
    assert points == [["cluster=a100x8-1n", "planner=manual"], ["cluster=a100x8-1n", "planner=random"]]
    # Hydra's own sweep expands the glob through the same listing: one job, not one per *_schema config
    out = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "-m", "planner=glob(*,exclude=[exact,hrl,manual])",
                          "cluster=a100x8-1n", "mode=plan", "logger.mode=disabled", f"hydra.sweep.dir={tmp_path}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Launching 1 jobs" in out.stdout + out.stderr, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0"]


def test_sections_pass_down_typed_and_take_a_scripts_plain_dict():
    """The library takes its sections typed; a script's plain dict becomes the same dataclass (missing
    keys at their defaults, choices as Enums), and a bad choice is one line naming the key."""
    from hrlplan.config import ClusterConfig, NodeGroupConfig, TrainConfig, as_config, as_dict, section, typed
    from hrlplan.errors import UserError

    plain = compose(["train.dtype=bfloat16"])
    config = typed(plain)
    assert config.train.dtype is DType["bfloat16"] and config.train.dtype == "bfloat16"
    assert as_config(plain) == config and as_config(config) is config
    assert section(TrainConfig, config.train) is config.train
    assert section(TrainConfig, plain["train"]) == config.train
    assert as_dict(config)["train"] == plain["train"]
    partial = section(TrainConfig, {"schedule": "gpipe", "not_a_key": 1})
    assert partial.schedule is Schedule["gpipe"] and partial.steps == TrainConfig().steps
    groups = section(ClusterConfig, {"node_groups": [{"count": 2}]}).node_groups
    assert groups == [NodeGroupConfig(count=2)]
    with pytest.raises(UserError, match=r"^dtype='bf16' is not one of float32, bfloat16$"):
        section(TrainConfig, {"dtype": "bf16"})


def test_the_documented_timeout_variables_reach_the_process_groups():
    """docs/runtime.md: train.collective_timeout_min / plan_timeout_min, or HRLPLAN_TRAIN_TIMEOUT_MIN /
    HRLPLAN_PLAN_TIMEOUT_MIN: the composed default (null) leaves the choice to the environment."""
    from datetime import timedelta

    from hrlplan.config import TrainConfig, typed
    from hrlplan.runtime.distributed import timeouts

    env = {"HRLPLAN_TRAIN_TIMEOUT_MIN": "3", "HRLPLAN_PLAN_TIMEOUT_MIN": "45"}
    assert timeouts(TrainConfig(), env) == timeouts(typed(compose([])).train, env)
    assert timeouts(TrainConfig(), env).train == timedelta(minutes=3)
    assert timeouts(TrainConfig(), env).plan == timedelta(minutes=45)
    assert timeouts(TrainConfig(), {}).train == timedelta(minutes=10)
    assert timeouts(typed(compose(["train.collective_timeout_min=2"])).train, env).train == timedelta(minutes=2)
