"""bench/torch_native: six layouts a torch-native trainer runs at scale (Llama-3 8B, 70B and 405B
on 8 to 512 H100s: FSDP2 x TP with sequence parallelism, 1F1B and interleaved pipelines, op-level
selective and full recomputation, compile and Float8, a 128k-context layout with context parallelism),
each a plan file that loads and that `pretrain.py mode=plan planner=manual` predicts as fitting, with
a step time."""
import importlib.util
from pathlib import Path

import pytest

from hrlplan.plan import Plan

HERE = Path(__file__).resolve().parent.parent / "bench" / "torch_native"


def _layouts():
    spec = importlib.util.spec_from_file_location("torch_native_layouts", HERE / "layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAYOUTS = _layouts()


def _runnable(name):
    """A cp layout loads once plan/checks.py counts a stage's ranks as tp*dp*cp (H3's diff to it)."""
    from test_context_parallel import _checks_know_cp

    if LAYOUTS.LAYOUTS[name].get("cp", 1) > 1 and not _checks_know_cp():
        pytest.skip("plan/checks.py without the cp rank count yet")


@pytest.mark.parametrize("name", list(LAYOUTS.LAYOUTS))
def test_plan_file_loads_as_written(name, tmp_path):
    _runnable(name)
    spec = LAYOUTS.LAYOUTS[name]
    plan = Plan.load(HERE / f"{name}.yaml")
    assert plan.world_size == spec["nodes"] * 8 and plan.pp == spec["pp"] and plan.stages[0].tp == spec["tp"]
    assert plan.cp == spec.get("cp", 1)
    assert {s.recompute for s in plan.stages} == {spec["recompute"]} and plan.sequence_parallel == spec["sp"]
    assert plan.schedule == spec["schedule"] and plan.stages_per_rank == spec["v"]
    assert plan.global_batch_size == LAYOUTS.global_batch(spec)
    # the committed file is what LAYOUTS writes
    LAYOUTS.write_plan(name, tmp_path / "again.yaml")
    assert Plan.load(tmp_path / "again.yaml") == plan


def test_the_layouts_span_the_torch_native_options():
    specs = LAYOUTS.LAYOUTS.values()
    assert {s["model"] for s in specs} == {"llama3-8b", "llama3-70b", "llama3-405b"}
    assert {s["recompute"] for s in specs} == {"selective", "full"}
    assert {s["schedule"] for s in specs} == {"1f1b", "interleaved_1f1b"}
    assert any(s["sp"] and s["pp"] == 1 for s in specs) and any(s["pp"] > 1 for s in specs)
    assert min(s["nodes"] for s in specs) * 8 == 8 and max(s["nodes"] for s in specs) * 8 == 512
    assert any(s.get("cp", 1) > 1 and s.get("seq", 0) >= 131072 for s in specs)
    assert any(s.get("compile") and s.get("float8") for s in specs)


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """LAYOUTS.predict's row of every layout that loads here: its `pretrain.py mode=plan planner=manual`
    command (LAYOUTS.command) run as written, the six in one process (tests/_plan_commands.py: a
    preset cluster starts no workers, and starting Python is most of each command's time), then read
    as LAYOUTS.predict reads it."""
    from types import SimpleNamespace

    from _plan_commands import run_commands
    from test_context_parallel import _checks_know_cp

    workdir = tmp_path_factory.mktemp("torch_native")
    names = [n for n, spec in LAYOUTS.LAYOUTS.items() if spec.get("cp", 1) == 1 or _checks_know_cp()]
    commands = [LAYOUTS.command(n, HERE / f"{n}.yaml", workdir / n) for n in names]
    done = {tuple(cmd): proc for cmd, proc in zip(commands, run_commands(commands, cwd=LAYOUTS.ROOT))}
    ran = SimpleNamespace(run=lambda cmd, **_: done[tuple(cmd)])   # predict's subprocess.run, already run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LAYOUTS, "subprocess", ran)
        return {n: LAYOUTS.predict(n, workdir) for n in names}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS.LAYOUTS))
def test_pretrain_predicts_each_layout_as_fitting(name, predicted):
    _runnable(name)
    row = predicted[name]
    print(row)
    assert row["fits"], row.get("reason")
    assert 0 < row["step_time_s"] < 600 and 0 < row["peak_memory_gib"] < 80 * 0.9
