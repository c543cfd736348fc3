"""`hrlplan doctor` on CPU: the checks it can run pass, the GPU ones are skipped with a reason."""
import pytest

from hrlplan import doctor
from hrlplan.cli import build_parser


def test_doctor_command_and_device_check():
    args = build_parser().parse_args(["doctor", "--out", "x.tsv"])
    assert args.out == "x.tsv"
    name, status, detail = doctor.check_device_choice()
    assert status == "pass" and "LOCAL_RANK" in detail


@pytest.mark.slow
def test_gloo_collectives_check():
    results = doctor.check_collectives("cpu", 2, 1 << 20)
    assert [r[1] for r in results] == ["pass"] * 3
    assert "GB/s" in results[2][2]


def test_gpu_checks_skipped_with_reasons_on_cpu(monkeypatch):
    ran = []
    for fn in ("check_collectives", "check_pipeline", "check_hetero_1f1b", "check_gpt2_step"):
        monkeypatch.setattr(doctor, fn, lambda *a, _f=fn, **k: ran.append((_f, a)) or (_f, "pass", ""))
    results = doctor.run_checks(0)
    assert ("check_gpt2_step", ()) not in ran
    assert [a for f, a in ran if f == "check_hetero_1f1b"] == [("cpu",)]
    skipped = {r[0]: r[2] for r in results if r[1] == "skip"}
    assert "no GPU visible" in skipped["GPT-2 124M bf16 step, 1 GPU"]
    assert "2 needed" in skipped["nccl all-reduce / p2p, 2-GPU pipelines"]
    assert [a[0] for f, a in ran if f == "check_pipeline"] == [doctor.DEFAULT]   # the CPU pipeline


def test_two_gpu_pipelines_are_every_registry_schedule(monkeypatch):
    """With 2 GPUs the doctor checks each schedule of the registry, at the stages per rank it takes."""
    from hrlplan.schedules import SCHEDULES

    ran = []
    monkeypatch.setattr(doctor, "check_pipeline", lambda s, d, a, v=1: ran.append((s, d, v)) or (s, "pass", ""))
    for fn in ("check_collectives", "check_hetero_1f1b", "check_gpt2_step"):
        monkeypatch.setattr(doctor, fn, lambda *a, _f=fn, **k: (_f, "pass", ""))
    doctor.run_checks(2)
    assert [s for s, _, _ in ran] == list(SCHEDULES)
    assert all(d == "cuda" and SCHEDULES[s].takes(v) for s, d, v in ran)
    assert {v for _, _, v in ran} == {1, 2}
