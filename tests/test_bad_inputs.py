"""Bad inputs a user can type, each refused before work starts: a non-zero exit, one line naming the
key (and the value), no traceback. Table-driven; in-process through the functions pretrain.py
runs (its precheck of every override, then the host checks its main runs before launching), the
`hrlplan` CLI in-process, and a few end-to-end `python pretrain.py` runs."""
import io
import json
import os
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
SP_PLAN = """model: gpt2-tiny
n_layer: 2
world_size: 4
pp: 2
microbatch_size: 2
num_microbatches: 2
global_batch_size: 4
schedule: 1f1b
stages:
- {layers: [0, 1], ranks: [0, 1], tp: 2, dp: 1, embedding: true, head: false, sequence_parallel: true}
- {layers: [1, 2], ranks: [2, 3], tp: 2, dp: 1, embedding: false, head: true, sequence_parallel: true}
device_groups: [[0, 1], [2, 3]]
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
    (d / "good.yaml").write_text(PLAN.format(pp=2, tp=1))
    (d / "sp_tp2.yaml").write_text(SP_PLAN)
    (d / "rank_beyond.yaml").write_text(PLAN.format(pp=2, tp=1).replace("ranks: [1]", "ranks: [5]")
                                        .replace("[[0], [1]]", "[[0], [5]]"))
    device = {"rank": 0, "node": 0, "local_rank": 0, "hostname": "h", "kind": "cpu", "name": "cpu",
              "memory_bytes": 2**30, "peak_flops": 1e10}
    two = [device, dict(device, rank=1, local_rank=1)]
    spec = {"schema_version": 1, "name": "x", "source": "file", "intra_node_bw": [1e9]}
    (d / "cluster_empty.json").write_text(json.dumps(dict(spec, devices=[])))
    (d / "cluster_1x1.json").write_text(json.dumps(dict(spec, devices=two, bandwidth=[[0.0]])))
    (d / "cluster_negmem.json").write_text(json.dumps(dict(spec, devices=[dict(device, memory_bytes=-5)])))
    for name, cfg in (("model_heads", {"n_embd": 100, "n_head": 3}), ("model_short", {"n_positions": 32})):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(dict({"model_type": "gpt2", "n_layer": 2, "n_embd": 64,
                                                                "n_head": 4, "n_positions": 128}, **cfg)))
    (d / "ckpt_damaged").mkdir()
    (d / "ckpt_damaged" / ".metadata").write_bytes(b"\x80\x04")
    (d / "ckpt_file").write_text("not a checkpoint")
    (d / "code").mkdir()
    (d / "tokenizer_bad.json").write_text("{")
    return d


# Rank 0 of the leftover-rendezvous rows: a port nobody listens on.
def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SUBMITIT_EXECUTOR", "HRLPLAN_LOCAL_AGENT")


def outcome(kind, argv, files):
    """(exit code, what the user sees on stderr) for one input, as pretrain.py / hrlplan would end."""
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            if kind == "override":      # pretrain.py's check of the command line, before Hydra runs
                pretrain.precheck(argv)
            elif kind == "host":        # pretrain.py main's checks before it launches workers
                env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_MARKS}
                env.update(a[4:].replace("{port}", str(_free_port())).split("=", 1) for a in argv
                           if a.startswith("env:"))
                argv = [a for a in argv if not a.startswith("env:")]
                check_environment(compose(argv), launching=True, overrides=argv, env=env)
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
    # ---- issue 34: nothing wrong accepted silently
    ("hrm-keys-without-hrm", "override", ["data_path=x", "epochs=2", "lr=1e-4"], ["data_path", "epochs", "arch=hrm"]),
    ("hrm-train-key-without-hrm", "override", ["train.puzzle_emb_lr=0.1"], ["train.puzzle_emb_lr", "arch=hrm"]),
    ("vocab-one", "override", ["arch.vocab_size=1"], ["arch.vocab_size", "1", ">= 2"]),
    ("llama-vocab-one", "override", ["arch=llama-tiny", "arch.vocab_size=1"], ["arch.vocab_size", ">= 2"]),
    ("dropout-two", "override", ["arch.resid_pdrop=2.0"], ["arch.resid_pdrop", "2.0", "[0, 1)"]),
    ("dropout-one", "override", ["arch.attn_pdrop=1.0"], ["arch.attn_pdrop", "[0, 1)"]),
    ("collective-timeout-zero", "override", ["train.collective_timeout_min=0"], ["train.collective_timeout_min", "> 0"]),
    ("plan-timeout-negative", "override", ["train.plan_timeout_min=-1"], ["train.plan_timeout_min", "> 0"]),
    ("no-devices-to-plan-for", "override", ["cluster.probe=false"], ["cluster.probe=false", "cluster.node_groups"]),
    ("inter-node-zero", "override", ["cluster.inter_node_GBps=0"], ["cluster.inter_node_GBps", "> 0"]),
    ("node-group-count-zero", "override", ["cluster=a100x8-2n", "cluster.node_groups.0.count=0"],
     ["cluster.node_groups.0.count", "positive"]),
    ("node-group-memory-negative", "override", ["cluster=a100x8-2n", "cluster.node_groups.0.memory_gb=-1"],
     ["cluster.node_groups.0.memory_gb", "> 0"]),
    ("plus-unknown-train-key", "override", ["+train.foo=1"], ["train.foo", "unknown key"]),
    ("plus-unknown-arch-key", "override", ["+arch.n_layers=1"], ["arch.n_layers", "arch.n_layer"]),
    ("lr-inf", "override", ["train.lr=inf"], ["train.lr", "inf", "finite"]),
    ("weight-decay-inf", "override", ["train.weight_decay=inf"], ["train.weight_decay", "finite"]),
    ("calibrate-choice", "override", ["planner.calibrate=maybe"], ["planner.calibrate", "maybe", "refresh"]),
    ("recompute-choice", "override", ["planner.recompute=sometimes"], ["planner.recompute", "sometimes", "selective"]),
    # ---- a key of another option names that option
    ("hrl-key-without-hrl", "override", ["planner.train_steps=0"], ["planner.train_steps", "add planner=hrl"]),
    ("samples-without-a-sampler", "override", ["planner.samples=3"], ["planner.samples", "planner=hrl", "planner=random"]),
    ("samples-on-exact", "override", ["planner=exact", "planner.samples=3"], ["planner.samples", "planner=hrl"]),
    ("plan-file-without-manual", "override", ["planner.plan_file=p.yaml"], ["planner.plan_file", "add planner=manual"]),
    ("hrm-key-without-hrm", "override", ["arch.H_cycles=2"], ["arch.H_cycles", "add arch=hrm"]),
    ("gpt2-key-on-hrm", "override", ["arch=hrm", "arch.n_layer=2"], ["arch.n_layer", "arch=gpt2"]),
    # ---- values refused together
    ("stages-per-rank-1f1b", "override", ["train.stages_per_rank=2", "train.schedule=1f1b"],
     ["train.stages_per_rank=2", "train.schedule=1f1b", "interleaved_1f1b"]),
    ("microbatches-batch", "override", ["train.microbatches=3"],
     ["train.microbatches=3", "train.global_batch_size=8", "1, 2, 4, 8"]),
    ("seq-len-over-positions", "override", ["data.seq_len=5000"], ["data.seq_len=5000", "arch.n_positions=128"]),
    ("llama-seq-len-over-positions", "override", ["arch=llama-tiny", "data.seq_len=4096"],
     ["data.seq_len=4096", "arch.max_position_embeddings"]),
    ("hrm-seq-len", "override", ["arch=hrm", "data.seq_len=10"], ["data.seq_len=10", "arch=hrm"]),
    ("hrm-eval-interval", "override", ["arch=hrm", "epochs=10", "eval_interval=3"], ["eval_interval=3", "epochs=10"]),
    # ---- a manual plan against the run
    ("plan-batch-conflict", "host", ["planner=manual", "planner.plan_file={tmp}/good.yaml", "arch.n_layer=2",
                                     "train.global_batch_size=16"],
     ["train.global_batch_size=16", "planner.plan_file", "global_batch_size is 4"]),
    ("plan-schedule-conflict", "host", ["planner=manual", "planner.plan_file={tmp}/good.yaml", "arch.n_layer=2",
                                        "train.schedule=gpipe"], ["train.schedule=gpipe", "planner.plan_file", "1f1b"]),
    ("plan-microbatches-conflict", "host", ["planner=manual", "planner.plan_file={tmp}/good.yaml", "arch.n_layer=2",
                                            "train.microbatches=4"], ["train.microbatches=4", "num_microbatches is 2"]),
    ("plan-depth", "host", ["planner=manual", "planner.plan_file={tmp}/good.yaml"],
     ["planner.plan_file", "2 layers", "arch.n_layer=6"]),
    ("plan-world-size", "host", ["planner=manual", "planner.plan_file={tmp}/good.yaml", "arch.n_layer=2",
                                 "cluster.nproc_per_node=1"], ["planner.plan_file", "2 ranks", "cluster.nproc_per_node"]),
    ("plan-sp-seq-len", "host", ["planner=manual", "planner.plan_file={tmp}/sp_tp2.yaml", "arch.n_layer=2",
                                 "cluster.nproc_per_node=4", "data.seq_len=63"],
     ["data.seq_len=63", "not divisible by tp 2", "sequence_parallel"]),
    ("plan-rank-beyond-world", "host", ["planner=manual", "planner.plan_file={tmp}/rank_beyond.yaml"],
     ["planner.plan_file", "rank 5", "world_size 2"]),
    ("cli-show-plan-rank-beyond-world", "cli", ["show-plan", "{tmp}/rank_beyond.yaml"], ["rank_beyond.yaml", "rank 5"]),
    # ---- cluster spec files, model config.json, checkpoints, data, this process's environment
    ("cluster-no-devices", "host", ["cluster.spec_file={tmp}/cluster_empty.json"], ["cluster.spec_file", "no devices"]),
    ("cluster-1x1-bandwidth", "host", ["cluster.spec_file={tmp}/cluster_1x1.json"],
     ["cluster.spec_file", "bandwidth", "2x2"]),
    ("cluster-negative-memory", "host", ["cluster.spec_file={tmp}/cluster_negmem.json"],
     ["cluster.spec_file", "memory_bytes=-5"]),
    ("model-heads", "host", ["arch.model_id={tmp}/model_heads"], ["arch.model_id", "n_embd=100", "n_head=3"]),
    ("model-positions", "host", ["arch.model_id={tmp}/model_short"], ["data.seq_len=64", "32 positions"]),
    ("resume-damaged", "host", ["train.resume={tmp}/ckpt_damaged"], ["train.resume", "ckpt_damaged", "extra_rank0.pt"]),
    ("resume-a-file", "host", ["train.resume={tmp}/ckpt_file"], ["train.resume", "ckpt_file", "not a checkpoint"]),
    ("code-vocab", "host", ["data=code", "data.path={tmp}/code"], ["arch.vocab_size=128", "data.vocab_size=4096"]),
    ("code-tokenizer-damaged", "host", ["data=code", "data.path={tmp}/code", "data.tokenizer={tmp}/tokenizer_bad.json"],
     ["data.tokenizer", "tokenizer_bad.json", "not a readable tokenizer.json"]),
    ("code-tokenizer-missing", "host", ["data=code", "data.path={tmp}/code", "data.tokenizer=./no_tokenizer.json"],
     ["data.tokenizer", "no_tokenizer.json"]),
    ("leftover-rendezvous", "host", ["env:RANK=1", "env:WORLD_SIZE=2", "env:MASTER_ADDR=127.0.0.1",
                                     "env:MASTER_PORT={port}", "env:HRLPLAN_RENDEZVOUS_WAIT_S=0.3"],
     ["RANK=1", "WORLD_SIZE=2", "MASTER_ADDR", "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT"]),
    ("leftover-rank-beyond-world", "host", ["env:RANK=3", "env:WORLD_SIZE=2", "env:MASTER_ADDR=127.0.0.1",
                                            "env:MASTER_PORT=29500"], ["RANK=3", "WORLD_SIZE=2", "unset"]),
    ("train-timeout-env", "host", ["env:HRLPLAN_TRAIN_TIMEOUT_MIN=soon"], ["HRLPLAN_TRAIN_TIMEOUT_MIN", "soon"]),
    ("plan-timeout-env-zero", "host", ["env:HRLPLAN_PLAN_TIMEOUT_MIN=0"], ["HRLPLAN_PLAN_TIMEOUT_MIN", "> 0"]),
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
    (["data_path=x", "epochs=2", "lr=1e-4"], ["data_path", "epochs", "arch=hrm"]),
    # the explicit overrides of a run reach the plan check through Hydra's own record of them
    (["planner=manual", f"planner.plan_file={ROOT / 'tests' / 'data' / 'nowhere.yaml'}"], ["planner.plan_file"]),
    (["planner=manual", "planner.plan_file={plan}", "arch.n_layer=2", "train.global_batch_size=16"],
     ["train.global_batch_size=16", "planner.plan_file", "global_batch_size is 4"]),
    pytest.param(["env:RANK=1", "env:WORLD_SIZE=2", "env:MASTER_ADDR=127.0.0.1", "env:MASTER_PORT={port}",
                  "env:HRLPLAN_RENDEZVOUS_WAIT_S=0.5"], ["RANK=1", "unset RANK"]),
], ids=["override", "host", "flag", "hrm-keys", "plan-missing", "plan-conflict", "leftover-rendezvous"])
def test_pretrain_refuses_end_to_end(args, names, tmp_path):
    (tmp_path / "plan.yaml").write_text(PLAN.format(pp=2, tp=1))
    args = [a.replace("{plan}", str(tmp_path / "plan.yaml")).replace("{port}", str(_free_port())) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_MARKS}
    env.update(a[4:].split("=", 1) for a in args if a.startswith("env:"))
    args = [a for a in args if not a.startswith("env:")]
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), f"hydra.run.dir={tmp_path}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr
    for name in names:
        assert name in errors[0]


def test_ones_own_options_on_the_searchpath_are_honoured(tmp_path):
    """hydra.searchpath=[file://<dir>] adds <dir>/arch/mine.yaml as arch=mine: the choice check knows it."""
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "mine.yaml").write_text("defaults:\n  - gpt2_schema\n  - _self_\nname: mine\nn_layer: 2\n"
                                                 "n_embd: 32\nn_head: 2\nn_positions: 64\nvocab_size: 64\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"
    assert compose([searchpath, "arch=mine"])["arch"]["name"] == "mine"
    from hrlplan.validate import precheck_overrides

    assert precheck_overrides([searchpath, "arch=mine"], compose)[0]["arch"]["n_layer"] == 2
    with pytest.raises(UserError, match="arch=mine is not allowed"):
        precheck_overrides(["arch=mine"], compose)
    # end to end: the app passes the command line's hydra.searchpath to its own check
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), searchpath, "arch=mine", "--cfg", "job"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "name: mine" in proc.stdout, proc.stderr


def test_a_rank_whose_rank_0_answers_or_that_torchrun_started_is_not_refused():
    import socket

    from hrlplan.validate.environ import check_leftover_rendezvous

    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "HRLPLAN_RENDEZVOUS_WAIT_S": "5"}
    with socket.socket() as rank0:
        rank0.bind(("127.0.0.1", 0))
        rank0.listen(1)
        check_leftover_rendezvous(dict(base, MASTER_PORT=str(rank0.getsockname()[1])))
    check_leftover_rendezvous(dict(base, MASTER_PORT=str(_free_port()), TORCHELASTIC_RUN_ID="x"))
    check_leftover_rendezvous(dict(base, RANK="0", MASTER_PORT=str(_free_port())))   # rank 0 hosts the store


def test_documented_timeout_variables_are_read():
    from hrlplan.config import TrainConfig, timeout_minutes

    env = {"HRLPLAN_TRAIN_TIMEOUT_MIN": "3", "HRLPLAN_PLAN_TIMEOUT_MIN": "90"}
    assert timeout_minutes(TrainConfig(), env) == {"plan_timeout_min": 90.0, "collective_timeout_min": 3.0}
    assert timeout_minutes(TrainConfig(), {}) == {"plan_timeout_min": 60.0, "collective_timeout_min": 10.0}
    # a value the config sets wins over the environment
    assert timeout_minutes(TrainConfig(collective_timeout_min=7), env)["collective_timeout_min"] == 7.0
    assert compose(["train.collective_timeout_min=7"])["train"]["collective_timeout_min"] == 7.0
