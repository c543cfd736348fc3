"""What a user sees from the `hrlplan` CLI: bad file arguments refused in one line naming the file and
what to do (no traceback, before anything slow starts) -- a table, and a sweep of every subcommand's
file arguments given a missing file; show-plan's notation (pp, tp, dp always; `4 micro-batches of 2`)
and idle devices; timeline.png (one time axis, the gradient all-reduce drawn, the legend below the
panels); `hrlplan evaluate` of a language-model checkpoint."""
import io
import json
import math
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hrlplan.cli import ARGUMENT_CHECKS, build_parser, main  # noqa: E402
from hrlplan.plan import homogeneous_plan  # noqa: E402
from hrlplan.search.plan_text import idle_lines, microbatching, plan_summary, rewrite_old_notation  # noqa: E402

GOOD_CLUSTER = "a100x8-1n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "a_dir").mkdir()
    (d / "garbage.json").write_text("{not json")
    (d / "garbage.yaml").write_text("planner: [unclosed\n  - : :")
    (d / "list.json").write_text("[1, 2]")
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "binary.yaml").write_bytes(bytes(range(128, 256)) * 4)
    (d / "cluster_fields.json").write_text(json.dumps({"schema_version": 1, "devices": [{"rank": 0}]}))
    (d / "model_bad").mkdir()
    (d / "model_bad" / "config.json").write_text('{"model_type": "gpt2", "n_layer": ')
    (d / "model_untyped").mkdir()
    (d / "model_untyped" / "config.json").write_text('{"n_layer": 2}')
    (d / "model_empty").mkdir()
    (d / "a_file").write_text("x\n")
    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 6)], dp=2, tp=1, microbatch_size=2, num_microbatches=2,
                            schedule="1f1b")
    (d / "run").mkdir()
    plan.save(d / "run" / "plan.yaml")
    (d / "run" / "plan_info.json").write_text("{broken")
    return d


def outcome(argv, files):
    """(exit code, stdout, stderr) of `hrlplan <argv>` run in this process."""
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(argv)
            return 0, out.getvalue(), err.getvalue()
        except SystemExit as e:
            return e.code, out.getvalue(), err.getvalue()
        except Exception:   # what this test exists to catch
            return 99, out.getvalue(), err.getvalue() + traceback.format_exc()


def assert_one_line_refusal(argv, names, files):
    code, _, err = outcome(argv, files)
    assert code == 2, f"exit {code} for {argv}:\n{err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hrlplan: error: "), err
    for name in names:
        assert name.replace("{tmp}", str(files)) in lines[0], f"{name!r} not in: {lines[0]}"
    return lines[0]


# (id, argv, what the one line must name)
CASES = [
    ("show-plan-directory", ["show-plan", "{tmp}/a_dir"], ["a_dir", "plan.yaml"]),
    ("show-plan-binary", ["show-plan", "{tmp}/binary.yaml"], ["binary.yaml", "plan.yaml"]),
    ("show-plan-garbage", ["show-plan", "{tmp}/garbage.yaml"], ["garbage.yaml", "YAML"]),
    ("show-plan-json-list", ["show-plan", "{tmp}/list.json"], ["list.json"]),
    ("show-plan-garbage-info", ["show-plan", "{tmp}/run/plan.yaml", "--info", "{tmp}/garbage.json"],
     ["garbage.json", "plan_info.json"]),
    ("show-plan-run-dir-garbage-info", ["show-plan", "{tmp}/run"], ["run/plan_info.json", "move it away"]),
    ("plan-hrl-cluster-garbage", ["plan-hrl", "--cluster", "{tmp}/garbage.json", "--model-meta", "gpt2-tiny",
                                  "--out", "{tmp}/p.yaml"], ["--cluster", "garbage.json", "JSON", "probe-cluster"]),
    ("plan-hrl-cluster-list", ["plan-hrl", "--cluster", "{tmp}/list.json", "--model-meta", "gpt2-tiny",
                               "--out", "{tmp}/p.yaml"], ["--cluster", "list.json", "object"]),
    ("plan-hrl-cluster-yaml", ["plan-hrl", "--cluster", "{tmp}/garbage.yaml", "--model-meta", "gpt2-tiny",
                               "--out", "{tmp}/p.yaml"], ["--cluster", "garbage.yaml"]),
    ("plan-hrl-cluster-fields", ["plan-hrl", "--cluster", "{tmp}/cluster_fields.json", "--model-meta", "gpt2-tiny",
                                 "--out", "{tmp}/p.yaml"], ["cluster_fields.json"]),
    ("plan-hrl-cluster-dir", ["plan-hrl", "--cluster", "{tmp}/a_dir", "--model-meta", "gpt2-tiny"],
     ["--cluster", "a_dir", "directory"]),
    ("plan-hrl-cluster-unknown-preset", ["plan-hrl", "--cluster", "nosuchpreset", "--model-meta", "gpt2-tiny"],
     ["nosuchpreset", "a100x8-1n"]),
    ("plan-hrl-meta-garbage", ["plan-hrl", "--cluster", GOOD_CLUSTER, "--model-meta", "{tmp}/garbage.json"],
     ["--model-meta", "garbage.json", "introspect-model"]),
    ("plan-hrl-meta-list", ["plan-hrl", "--cluster", GOOD_CLUSTER, "--model-meta", "{tmp}/list.json"],
     ["--model-meta", "list.json"]),
    ("plan-hrl-planner-cfg-garbage", ["plan-hrl", "--cluster", GOOD_CLUSTER, "--model-meta", "gpt2-tiny",
                                      "--planner-cfg", "{tmp}/garbage.yaml"], ["--planner-cfg", "garbage.yaml", "YAML"]),
    ("plan-hrl-planner-cfg-list", ["plan-hrl", "--cluster", GOOD_CLUSTER, "--model-meta", "gpt2-tiny",
                                   "--planner-cfg", "{tmp}/list.yaml"], ["--planner-cfg", "list.yaml", "mapping"]),
    ("train-hrl-cluster-garbage", ["train-hrl", "--cluster", "{tmp}/garbage.json", "--model-meta", "gpt2-tiny",
                                   "--out-dir", "{tmp}/hrl"], ["--cluster", "garbage.json"]),
    ("train-hrl-out-dir-is-a-file", ["train-hrl", "--cluster", GOOD_CLUSTER, "--model-meta", "gpt2-tiny",
                                     "--out-dir", "{tmp}/a_file"], ["--out-dir", "a_file", "not a directory"]),
    ("calibrate-cluster-garbage", ["calibrate", "--cluster", "{tmp}/garbage.json", "--model-id", "gpt2-tiny"],
     ["--cluster", "garbage.json"]),
    ("calibrate-model-broken-config", ["calibrate", "--cluster", GOOD_CLUSTER, "--model-id", "{tmp}/model_bad"],
     ["--model-id", "model_bad/config.json", "JSON"]),
    ("introspect-broken-config", ["introspect-model", "--model-id", "{tmp}/model_bad"],
     ["--model-id", "model_bad/config.json", "not valid JSON", "restore"]),
    ("introspect-untyped-config", ["introspect-model", "--model-id", "{tmp}/model_untyped"],
     ["model_untyped/config.json", "model_type"]),
    ("introspect-dir-without-config", ["introspect-model", "--model-id", "{tmp}/model_empty"],
     ["model_empty", "config.json"]),
    ("introspect-config-file-garbage", ["introspect-model", "--model-id", "{tmp}/garbage.json"],
     ["--model-id", "garbage.json"]),
    ("introspect-out-is-a-dir", ["introspect-model", "--model-id", "gpt2-tiny", "--out", "{tmp}/a_dir"],
     ["--out", "a_dir", "directory"]),
    ("evaluate-no-checkpoint", ["evaluate", "{tmp}/a_dir"], ["a_dir", "no checkpoint"]),
    ("evaluate-data-path-a-file", ["evaluate", "{tmp}/a_dir", "--data-path", "{tmp}/a_file"],
     ["--data-path", "a_file", "directory"]),
    ("memory-guide-cluster-missing", ["memory-guide", "--cluster", "{tmp}/no_such_cluster.json", "planner=manual",
                                      "planner.plan_file={tmp}/run/plan.yaml"], ["no_such_cluster.json"]),
    ("memory-guide-cluster-garbage", ["memory-guide", "--cluster", "{tmp}/garbage.json", "planner=manual",
                                      "planner.plan_file={tmp}/run/plan.yaml"], ["garbage.json"]),
    ("memory-guide-plan-missing", ["memory-guide", f"cluster={GOOD_CLUSTER}", "planner=manual",
                                   "planner.plan_file={tmp}/no_such_plan.yaml"], ["no_such_plan.yaml"]),
    ("memory-guide-plan-directory", ["memory-guide", f"cluster={GOOD_CLUSTER}", "planner=manual",
                                     "planner.plan_file={tmp}/a_dir"], ["a_dir"]),
    ("build-sudoku-out-dir-is-a-file", ["build-sudoku", "sudoku-extreme-small", "--out-dir", "{tmp}/a_file"],
     ["--out-dir", "a_file"]),
]


@pytest.mark.parametrize("argv,names", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_cli_input_is_one_line_naming_the_file(argv, names, files):
    assert_one_line_refusal(argv, names, files)


# Every file argument of every subcommand, given a path that does not exist (outputs: in a
# directory that does not exist); the other arguments are good ones.
GOOD = {"--cluster": GOOD_CLUSTER, "--model-meta": "gpt2-tiny", "--model-id": "gpt2-tiny", "--out-dir": "{tmp}/out"}
REQUIRED = {"train-hrl": ["--cluster", "--model-meta", "--out-dir"], "plan-hrl": ["--cluster", "--model-meta"],
            "calibrate": ["--cluster", "--model-id"], "introspect-model": ["--model-id"]}
POSITIONAL = {"build-sudoku": "sudoku-extreme-small", "evaluate": "{tmp}/a_dir", "show-plan": "{tmp}/run/plan.yaml"}
OUTPUTS = {"--out", "--out-info"}


def _missing_file_sweep():
    for command, checks in sorted(ARGUMENT_CHECKS.items()):
        for dest, flag, _ in checks:
            missing = "{tmp}/no_such_dir/file.json" if flag in OUTPUTS else "{tmp}/no_such_file.json"
            if flag == "--out-dir":
                continue   # a directory to create: a missing one is fine (its being a file is in CASES)
            argv = [command] + ([missing] if not flag else [POSITIONAL[command]] if command in POSITIONAL else [])
            for other in REQUIRED.get(command, []):
                if other != flag:
                    argv += [other, GOOD[other]]
            if flag:
                argv += [flag, missing]
            yield pytest.param(argv, [missing.replace("/file.json", "") if flag in OUTPUTS else missing],
                               id=f"{command}{flag or '-positional'}")
    yield pytest.param(["show-plan", "{tmp}/no_such_file.json"], ["no_such_file.json"], id="show-plan-positional")
    yield pytest.param(["show-plan", "{tmp}/run/plan.yaml", "--info", "{tmp}/no_such_file.json"],
                       ["--info", "no_such_file.json"], id="show-plan--info")


@pytest.mark.parametrize("argv,names", list(_missing_file_sweep()))
def test_every_subcommand_names_a_missing_file(argv, names, files):
    line = assert_one_line_refusal(argv, names, files)
    assert "does not exist" in line or "no such" in line.lower(), line


def test_the_sweep_covers_every_subcommand_that_reads_or_writes_a_file():
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    file_flags = {"--cluster", "--model-meta", "--model-id", "--planner-cfg", "--out", "--out-info", "--out-dir",
                  "--checkpoint-dir", "--data-path", "--source", "--tokenizer", "--info"}
    for command in commands - {"train", "memory-guide", "show-plan"}:   # Hydra's / its own parser / its own checks
        sub = parser._subparsers._group_actions[0].choices[command]
        flags = {f for a in sub._actions for f in a.option_strings if f in file_flags}
        checked = {flag for _, flag, _ in ARGUMENT_CHECKS.get(command, [])}
        assert flags <= checked, f"hrlplan {command}: {flags - checked} not in cli.ARGUMENT_CHECKS"


# ---------------------------------------------------------------- show-plan: notation, idle devices
def test_micro_batching_reads_one_way():
    assert microbatching(4, 2) == "4 micro-batches of 2"
    assert microbatching(1, 8) == "1 micro-batch of 8"
    old = "pp=2 tp=1 dp=1 mb=2x4 1f1b layers/stage=[3,3] takes 5 ms"
    assert rewrite_old_notation(old) == "pp=2 tp=1 dp=1, 4 micro-batches of 2, 1f1b, layers/stage=[3,3] takes 5 ms"


def test_show_plan_names_pp_tp_dp_and_micro_batches_one_way(files, tmp_path):
    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 6)], dp=2, tp=4, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    assert plan_summary(plan) == "pp=1 tp=4 dp=2, 4 micro-batches of 2 (global batch 16), 1f1b"
    plan.save(tmp_path / "plan.yaml")
    code, out, err = outcome(["show-plan", str(tmp_path)], files)   # a run directory holding plan.yaml
    assert code == 0, err
    assert "pp=1 tp=4 dp=2, 4 micro-batches of 2 (global batch 16)" in out
    assert " x 4" not in out.splitlines()[1] and "mb=" not in out and "idle" not in out


def test_show_plan_says_which_devices_the_plan_leaves_idle(tmp_path, files):
    from hrlplan.search.placement import place_on_ranks

    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 3), (3, 6)], dp=1, tp=2, microbatch_size=2, num_microbatches=2,
                            schedule="1f1b")
    placed = place_on_ranks(plan, [0, 1, 2, 3], 6, {"nnodes": 1, "nproc_per_node": 6})
    lines = idle_lines(placed, cluster_devices=48)
    assert lines[0].startswith("idle devices: the plan uses 6 of the cluster's 48 devices; 42 stay idle")
    assert "idle ranks: 2 of the 6 launched ranks do not train (ranks 4-5)" in lines[1]
    placed.save(tmp_path / "plan.yaml")
    (tmp_path / "plan_info.json").write_text(json.dumps(
        {"cluster": "h100x8-16n: 48 workers on 6 node(s) (48x H100), backend nccl", "chosen": {"stages": []}}))
    code, out, err = outcome(["show-plan", str(tmp_path / "plan.yaml")], files)
    assert code == 0, err
    assert "42 stay idle" in out and "ranks 4-5" in out


# ---------------------------------------------------------------- timeline.png
def _dp_prediction(**calibration):
    from hrlplan.cost.model import CostOptions, Layout
    from hrlplan.cost.simulator import Simulator
    from tests.test_cost import toy_cluster, toy_meta

    lay = Layout(spans=((0, 4), (4, 8)), groups=((0, 1), (2, 3)), tp=1, dp=2, microbatch_size=1, num_microbatches=1,
                 schedule="1f1b")
    cluster = toy_cluster(n=4)
    if calibration:
        cluster.calibration = calibration
    result = Simulator(toy_meta(), cluster, CostOptions(dp_mode="fsdp", dp_overlap=not calibration)).evaluate(
        lay, detail=True)
    plan = {"schedule": "1f1b", "pp": 2, "num_microbatches": 1, "microbatch_size": 1,
            "stages": [{"dp": 2, "tp": 1}, {"dp": 2, "tp": 1}]}
    return plan, {"chosen": {"stages": result.stages, "breakdown": result.breakdown, "step_time_s": result.step_time_s}}


@pytest.mark.parametrize("calibrated", [False, True], ids=["analytic", "calibrated"])
def test_predicted_timeline_fills_the_predicted_step_with_the_all_reduce(calibrated):
    from hrlplan.runtime.timeline_plot import predicted_events, predicted_step_events

    cal = {"optimizer_s_per_block": {"plain": 1e-3, "sharded": 1e-3, "tp": 1e-3}, "optimizer_fixed_s": 2e-3,
           "step_overhead_s": 5e-3, "dp_collective_s": {"allgather": 1e-3, "reduce": 2e-3}} if calibrated else {}
    plan, info = _dp_prediction(**cal)
    step = info["chosen"]["step_time_s"]
    events = predicted_step_events(plan, info)
    assert max(e["end_s"] for e in events) == pytest.approx(step, rel=1e-9)   # nothing of the step is blank
    assert any(e["kind"] == "R" for e in events)
    if calibrated:
        assert {"O", "X"} <= {e["kind"] for e in events}
        assert max(e["end_s"] for e in predicted_events(plan, info)) < 0.99 * step   # what was blank before


def test_timeline_shares_one_time_axis_and_keeps_the_legend_off_the_titles(tmp_path):
    from hrlplan.runtime.timeline_plot import save_timeline, timeline_figure

    plan, info = _dp_prediction()
    events = [{"rank": r, "stage": 0, "kind": k, "microbatch": 0, "start_s": t, "end_s": t + 0.01}
              for r in range(2) for k, t in (("F", 0.0), ("B", 0.01))]
    info["measured"] = {"step_time_s": 0.05, "events": events,
                        "phases_s_per_rank": [{"sync_and_clip": 0.004, "optimizer": 0.003, "loss_allreduce": 0.001}] * 2}
    fig = timeline_figure(plan, info)
    top, bottom = fig.axes[0], fig.axes[1]
    assert top.get_shared_x_axes().joined(top, bottom) and top.get_xlim() == bottom.get_xlim()
    assert "1 micro-batch of 1" in top.get_title() and "micro-batches" not in top.get_title()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert not legend.overlaps(ax.title.get_window_extent(renderer))
        assert legend.y1 <= ax.get_window_extent(renderer).y0 + 1   # below every panel
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "gradient all-reduce" in labels and "optimizer" in labels
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    (tmp_path / "plan_info.json").write_text(json.dumps(info))
    assert save_timeline(tmp_path).stat().st_size > 5000


# ---------------------------------------------------------------- hrlplan evaluate: language models
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # a one-process save, as intended
def test_evaluate_a_language_model_checkpoint(tmp_path, files):
    import torch

    from hrlplan.compose import compose
    from hrlplan.data.lm import build_lm_data
    from hrlplan.models.hf import causal_lm_loss
    from hrlplan.runtime.checkpoint import save_checkpoint
    from hrlplan.runtime.trainer import build_full_model, make_optimizer

    config = compose(["arch=gpt2-tiny", "train.global_batch_size=4"])
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    model = build_full_model(config["arch"], int(config["train"]["seed"]))
    with torch.no_grad():   # weights that differ from a fresh model's: the load must really happen
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_checkpoint(run / "checkpoints", 3, {0: model}, {0: make_optimizer(model, config["train"])}, extra={})

    data = build_lm_data(config["data"], model.config.vocab_size, int(config["train"]["seed"]))
    with torch.no_grad():
        expected = sum(causal_lm_loss(model(input_ids=x, use_cache=False).logits, y).item()
                       for x, y in (data.batch(k, 4, split="val") for k in range(3))) / 3
    code, out, err = outcome(["evaluate", str(run / "checkpoints"), "--batches", "3"], files)
    assert code == 0, err
    first, report = out.splitlines()[0], json.loads(out[out.index("{"):])
    assert first.startswith("step_000003: validation loss") and "perplexity" in first
    assert report["eval/lm_loss"] == pytest.approx(expected, abs=1e-5)
    assert report["eval/perplexity"] == pytest.approx(math.exp(expected), rel=1e-4)

    # the run directory itself, and a checkpoint whose run config is gone
    assert outcome(["evaluate", str(run)], files)[0] == 0
    (run / ".hydra" / "config.yaml").unlink()
    assert_one_line_refusal(["evaluate", str(run / "checkpoints")], ["step_000003", ".hydra/config.yaml"], files)


def test_evaluate_tells_an_hrm_checkpoint_by_its_config(tmp_path):
    from hrlplan.runtime.hrm_io import is_hrm_checkpoint

    step = tmp_path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    assert not is_hrm_checkpoint(str(step))
    (tmp_path / "checkpoints" / "all_config.yaml").write_text("arch: {name: hrm}\n")
    assert is_hrm_checkpoint(str(step))

