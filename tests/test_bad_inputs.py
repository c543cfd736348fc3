"""Bad inputs a user can type, each refused before work starts: a non-zero exit, one line naming the
key (and the value), no traceback. Table-driven; in-process through the functions pretrain.py
runs (its precheck of every override, then the host checks its main runs before launching), the
`hrlplan` CLI in-process, and a few end-to-end `python pretrain.py` runs."""
import io
import json
import subprocess
import sys
import traceback
from contextlib import redirect_stderr
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hrlplan import app as pretrain  # noqa: E402  (the Hydra app behind pretrain.py)

from hrlplan.compose import compose  # noqa: E402
from hrlplan.errors import UserError  # noqa: E402
from hrlplan.validate import check_environment  # noqa: E402

PLAN = """model: gpt2-tiny
n_layer: 2
world_size: 2
pp: {pp}
microbatch_size: 2
num_microbatches: 2
global_batch_size: 4
schedule: 1f1b
stages:
- {{layers: [0, 1], ranks: [0], tp: {tp}, dp: 1, embedding: true, head: false}}
- {{layers: [1, 2], ranks: [1], tp: 1, dp: 1, embedding: false, head: true}}
device_groups: [[0], [1]]
"""
BOMB = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "string_tp.yaml").write_text(PLAN.format(pp=2, tp="two"))
    (d / "quoted_tp.yaml").write_text(PLAN.format(pp=2, tp='"2"'))
    (d / "string_pp.yaml").write_text(PLAN.format(pp="two", tp=1))
    (d / "not_yaml.yaml").write_text("model: [unclosed\n  - : :")
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "bomb.yaml").write_text('a: &a ["x", "x"]\n' + BOMB + f"{PLAN.format(pp=2, tp=1)}meta: {{x: *i}}\n")
    (d / "huge.yaml").write_text("# padding\n" * (600_000))
    (d / "plan_dir").mkdir()
    (d / "cluster_bad.json").write_text("{not json")
    (d / "cluster_list.json").write_text("[1, 2]")
    (d / "cluster_v9.json").write_text(json.dumps({"schema_version": 9, "devices": []}))
    (d / "cluster_fields.json").write_text(json.dumps({"schema_version": 1, "devices": [{"rank": 0}]}))
    (d / "model_bad").mkdir()
    (d / "model_bad" / "config.json").write_text('{"model_type": "gpt2", "n_layer": ')
    (d / "model_untyped").mkdir()
    (d / "model_untyped" / "config.json").write_text('{"n_layer": 2}')
    (d / "not_puzzles").mkdir()
    (d / "hrl_garbage").mkdir()
    (d / "hrl_garbage" / "hrl_policy.pth").write_text("garbage\n")
    (d / "hrl_empty").mkdir()
    from hrlplan.search.hrl.policy import generalist_path
    (d / "truncated.pth").write_bytes(generalist_path().read_bytes()[:300])
    return d


def outcome(kind, argv, files):
    """(exit code, what the user sees on stderr) for one input, as pretrain.py / hrlplan would end."""
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            if kind == "override":      # pretrain.py's check of the command line, before Hydra runs
                pretrain.precheck(argv)
            elif kind == "host":        # pretrain.py main's checks before it launches workers
                check_environment(compose(argv), launching=True)
            else:
                from hrlplan.cli import main

                main(argv)
            return 0, err.getvalue()
        except SystemExit as e:
            return e.code, err.getvalue()
        except UserError as e:
            return 2, err.getvalue() + f"hrlplan: error: {e}\n"
        except Exception:   # anything else is what this test exists to catch
            return 99, err.getvalue() + traceback.format_exc()


# (id, how it is run, argv, what the one line must name)
CASES = [
    # ---- config values: closed choices
    ("dtype-bf16", "override", ["train.dtype=bf16"], ["train.dtype", "bf16", "bfloat16"]),
    ("dtype-float8", "override", ["train.dtype=float8"], ["train.dtype", "float8", "float32"]),
    ("logger-mode-typo", "override", ["logger.mode=ofline"], ["logger.mode", "ofline", "offline"]),
    ("mode-bogus", "override", ["mode=bogus"], ["mode=bogus", "train", "plan"]),
    ("dp-mode-ddp", "override", ["train.dp_mode=ddp"], ["train.dp_mode", "ddp", "fsdp", "replicate"]),
    ("schedule", "override", ["train.schedule=2f2b"], ["train.schedule", "2f2b", "1f1b"]),
    ("device", "override", ["train.device=tpu"], ["train.device", "tpu", "cuda"]),
    ("planner-schedules", "override", ["planner.schedules=[gpipe,2f2b]"], ["planner.schedules", "2f2b", "gpipe"]),
    ("hrm-loss", "override", ["arch=hrm", "arch.loss.loss_type=mse"], ["arch.loss.loss_type", "mse", "stablemax"]),
    ("hrm-pos", "override", ["arch=hrm", "arch.pos_encodings=alibi"], ["arch.pos_encodings", "alibi", "rope"]),
    # ---- config values: ranges and types
    ("steps-negative", "override", ["train.steps=-1"], ["train.steps", "-1", "positive"]),
    ("steps-zero", "override", ["train.steps=0"], ["train.steps", "positive"]),
    ("steps-word", "override", ["train.steps=many"], ["train.steps", "many", "integer"]),
    ("seq-len-zero", "override", ["data.seq_len=0"], ["data.seq_len", "positive"]),
    ("lr-negative", "override", ["train.lr=-1"], ["train.lr", "> 0"]),
    ("lr-zero", "override", ["train.lr=0"], ["train.lr", "> 0"]),
    ("batch-zero", "override", ["train.global_batch_size=0"], ["train.global_batch_size", "positive"]),
    ("microbatches-zero", "override", ["train.microbatches=0"], ["train.microbatches", "auto"]),
    ("beta2", "override", ["train.beta2=1.5"], ["train.beta2", "[0, 1)"]),
    ("min-lr-ratio", "override", ["train.min_lr_ratio=2"], ["train.min_lr_ratio", "[0, 1]"]),
    ("grad-clip", "override", ["train.grad_clip=-1"], ["train.grad_clip", "null"]),
    ("warmup", "override", ["train.warmup_steps=-5"], ["train.warmup_steps", "-5"]),
    ("stop-after", "override", ["train.stop_after=0"], ["train.stop_after", "null or"]),
    ("memory-margin", "override", ["planner.memory_margin=0"], ["planner.memory_margin", "(0, 1]"]),
    ("hrl-samples", "override", ["planner=hrl", "planner.samples=0"], ["planner.samples", "positive"]),
    ("hrm-heads", "override", ["arch=hrm", "arch.hidden_size=30"], ["arch.hidden_size", "30", "arch.num_heads"]),
    ("gpt2-heads", "override", ["arch.n_head=5"], ["arch.n_embd", "arch.n_head=5"]),
    ("hrm-halt-prob", "override", ["arch=hrm", "arch.halt_exploration_prob=1.5"], ["arch.halt_exploration_prob"]),
    ("nproc-zero", "override", ["cluster.nproc_per_node=0"], ["cluster.nproc_per_node", "auto"]),
    ("hrm-alias-batch", "override", ["arch=hrm", "global_batch_size=-4"], ["train.global_batch_size", "-4"]),
    ("hrm-alias-type", "override", ["lr=abc"], ["lr", "abc", "number"]),
    # ---- config keys and groups
    ("top-level-typo", "override", ["lr_min_rati=1.0"], ["lr_min_rati", "lr_min_ratio"]),
    ("nested-typo", "override", ["train.stepz=3"], ["train.stepz", "train.steps"]),
    ("group-key-at-top", "override", ["steps=3"], ["steps", "train.steps"]),
    ("arch-option", "override", ["arch=gpt3"], ["arch", "gpt3", "gpt2"]),
    ("planner-option", "override", ["planner=genetic"], ["planner", "genetic", "exact"]),
    ("experiment-option", "override", ["experiment=nope"], ["experiment", "nope", "hrm-sudoku"]),
    # ---- command-line syntax
    ("no-equals", "override", ["train.steps"], ["train.steps"]),
    ("sweep-without-m", "override", ["train.steps=1,2"], ["train.steps=1,2", "-m"]),
    ("sweep-bad-point", "override", ["-m", "train.steps=2,-3"], ["train.steps", "-3"]),
    ("flags-multirun-and-cfg", "override", ["-m", "--cfg", "job", "train.lr=1e-3,2e-3"], ["--multirun", "--cfg"]),
    ("cli-command", "cli", ["nosuch"], ["nosuch", "show-plan"]),
    ("cli-show-plan-missing", "cli", ["show-plan", "{tmp}/nowhere.yaml"], ["nowhere.yaml"]),
    ("cli-show-plan-string-tp", "cli", ["show-plan", "{tmp}/string_tp.yaml"], ["stages[0].tp", "'two'"]),
    ("cli-show-plan-quoted-tp", "cli", ["show-plan", "{tmp}/quoted_tp.yaml"], ["stages[0].tp", "'2'"]),
    ("cli-show-plan-alias-bomb", "cli", ["show-plan", "{tmp}/bomb.yaml"], ["bomb.yaml", "aliases"]),
    ("cli-plan-hrl-garbage-checkpoint", "cli", ["plan-hrl", "--cluster", "a100x8-1n", "--model-meta", "gpt2-tiny",
                                                "--checkpoint-dir", "{tmp}/hrl_garbage", "--out", "{tmp}/p.yaml"],
     ["hrl_garbage/hrl_policy.pth", "not a readable torch checkpoint", "hrlplan train-hrl"]),
    ("cli-plan-hrl-truncated-checkpoint", "cli", ["plan-hrl", "--cluster", "a100x8-1n", "--model-meta", "gpt2-tiny",
                                                  "--checkpoint-dir", "{tmp}/truncated.pth", "--out", "{tmp}/p.yaml"],
     ["truncated.pth", "truncated"]),
    ("cli-plan-hrl-empty-checkpoint-dir", "cli", ["plan-hrl", "--cluster", "a100x8-1n", "--model-meta", "gpt2-tiny",
                                                  "--checkpoint-dir", "{tmp}/hrl_empty", "--out", "{tmp}/p.yaml"],
     ["hrl_empty/hrl_policy.pth", "no such file"]),
    ("cli-build-sudoku-preset", "cli", ["build-sudoku", "sudoku-nonexistent", "--out-dir", "{tmp}/s"],
     ["sudoku-nonexistent"]),
    # ---- plan files (planner=manual)
    ("plan-missing", "host", ["planner=manual", "planner.plan_file={tmp}/nowhere.yaml"], ["planner.plan_file"]),
    ("plan-unset", "host", ["planner=manual"], ["planner.plan_file"]),
    ("plan-a-directory", "host", ["planner=manual", "planner.plan_file={tmp}/plan_dir"], ["planner.plan_file"]),
    ("plan-not-yaml", "host", ["planner=manual", "planner.plan_file={tmp}/not_yaml.yaml"],
     ["planner.plan_file", "YAML"]),
    ("plan-a-list", "host", ["planner=manual", "planner.plan_file={tmp}/list.yaml"], ["planner.plan_file"]),
    ("plan-string-tp", "host", ["planner=manual", "planner.plan_file={tmp}/string_tp.yaml"],
     ["planner.plan_file", "stages[0].tp"]),
    ("plan-string-pp", "host", ["planner=manual", "planner.plan_file={tmp}/string_pp.yaml"],
     ["planner.plan_file", "pp"]),
    ("plan-alias-bomb", "host", ["planner=manual", "planner.plan_file={tmp}/bomb.yaml"],
     ["planner.plan_file", "aliases"]),
    ("plan-huge", "host", ["planner=manual", "planner.plan_file={tmp}/huge.yaml"], ["planner.plan_file", "MiB"]),
    # ---- cluster files
    ("cluster-missing", "host", ["cluster.spec_file={tmp}/nowhere.json"], ["cluster.spec_file"]),
    ("cluster-not-json", "host", ["cluster.spec_file={tmp}/cluster_bad.json"], ["cluster.spec_file"]),
    ("cluster-a-list", "host", ["cluster.spec_file={tmp}/cluster_list.json"], ["cluster.spec_file"]),
    ("cluster-version", "host", ["cluster.spec_file={tmp}/cluster_v9.json"], ["cluster.spec_file", "schema_version"]),
    ("cluster-fields", "host", ["cluster.spec_file={tmp}/cluster_fields.json"], ["cluster.spec_file"]),
    # ---- data, checkpoints, models, this host
    ("hrm-data-path", "host", ["arch=hrm", "data_path={tmp}/no_such_data"], ["data_path", "no_such_data"]),
    ("hrm-data-dir-empty", "host", ["arch=hrm", "data.path={tmp}/not_puzzles"], ["data.path", "not_puzzles"]),
    ("code-source", "host", ["data=code", "data.source={tmp}/no_sources"], ["data.source", "no_sources"]),
    ("lm-on-sudoku", "host", ["data=sudoku"], ["data=sudoku", "synthetic"]),
    ("resume-missing", "host", ["train.resume={tmp}/no_checkpoint"], ["train.resume", "no_checkpoint"]),
    ("model-config-corrupt", "host", ["arch.model_id={tmp}/model_bad"], ["arch.model_id", "config.json"]),
    ("model-config-untyped", "host", ["arch.model_id={tmp}/model_untyped"], ["arch.model_id", "model_type"]),
    ("model-path-missing", "host", ["arch.model_id=./no_such_model"], ["arch.model_id", "no_such_model"]),
    ("world-size", "host", ["cluster.nproc_per_node=1000"], ["cluster.nproc_per_node", "1000", "oversubscribe"]),
]


def _values(case):
    return case.values if hasattr(case, "values") else case


def test_the_table_is_large_enough():
    ids = [_values(c)[0] for c in CASES]
    assert len(CASES) >= 40 and len(set(ids)) == len(ids)


def _params():
    for c in CASES:
        v = _values(c)
        yield pytest.param(*v[1:], id=v[0], marks=getattr(c, "marks", ()))


@pytest.mark.parametrize("kind,argv,names", list(_params()))
def test_bad_input_is_refused_in_one_line(kind, argv, names, files):
    code, err = outcome(kind, argv, files)
    assert code not in (0, None), f"accepted: {argv}\n{err}"
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if "error" in ln.lower()]
    assert lines, err
    message = lines[-1]
    for name in names:
        assert name in message, f"{name!r} not in: {message}"
    assert "+lr_min_rati" not in message and "To append" not in message   # Hydra's hint is wrong advice here


def test_oversubscription_is_allowed_when_asked(files):
    check_environment(compose(["cluster.nproc_per_node=1000", "cluster.oversubscribe=true"]), launching=True)
    # inside torchrun/SLURM the world size is the launcher's: not checked again
    check_environment(compose(["cluster.nproc_per_node=1000"]), launching=False)


def test_a_good_plan_file_passes(files):
    good = files / "good.yaml"
    good.write_text(PLAN.format(pp=2, tp=1))
    check_environment(compose(["planner=manual", f"planner.plan_file={good}", "arch.n_layer=2"]), launching=False)


# ---- end to end: `python pretrain.py ...` as a user types it
@pytest.mark.parametrize("args,names", [
    (["train.dtype=bf16"], ["train.dtype", "bf16"]),
    (["cluster.nproc_per_node=1000"], ["cluster.nproc_per_node", "oversubscribe"]),
    (["--bogus-flag"], ["--bogus-flag"]),
], ids=["override", "host", "flag"])
def test_pretrain_refuses_end_to_end(args, names, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), f"hydra.run.dir={tmp_path}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr
    for name in names:
        assert name in errors[0]
