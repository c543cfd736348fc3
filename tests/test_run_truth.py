"""What a run reports is true: a NaN/inf step stops the run with one line and keeps the last good
weights (language models and HRM), MFU is taken against a real peak (never above 1), the time to the
first step counts from the command, a step far off its prediction says why, times print plainly,
idle devices are said."""
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hrlplan.config import TrainConfig
from hrlplan.launch.report import idle_devices_line, off_prediction_line, process_start_time, rank_ranges
from hrlplan.runtime import checkpoint as ckpt
from hrlplan.runtime import mfu as mfu_module
from hrlplan.runtime.metrics import duration_text
from hrlplan.runtime.mfu import cpu_flops_per_cycle, cpu_peak_flops, job_peak_flops, mfu
from hrlplan.runtime.train_core import (LRSchedule, NonFiniteStep, TrainAdapter, TrainCore, likely_cause,
                                        nonfinite_line, warmup_cosine)
from tests._runs import pretrain


# ---------------------------------------------------------------- MFU
def test_mfu_is_model_flops_per_second_over_the_peak():
    assert mfu(3.9e6, 1.0e4, 1.0e11) == pytest.approx(0.39)
    assert mfu(3.9e6, 1.0e4, 0.0) is None and mfu(0.0, 1.0e4, 1e11) is None


def test_gpt2_training_flops_per_token_is_6n_plus_attention():
    """The code corpus' shape (vocab 4096, 128 tokens): 6 x matmul weights + 12 x layers x seq x width."""
    from hrlplan.model_meta import introspect

    arch = dict(name="gpt2-tiny", family="hf", model_type="gpt2", n_layer=6, n_embd=64, n_head=4, n_positions=128,
                vocab_size=4096)
    meta = introspect(arch, seq_len=128)
    d, layers, vocab, seq = 64, 6, 4096, 128
    assert meta.training_flops_per_token() == 6 * (layers * 12 * d * d + d * vocab) + 12 * layers * seq * d


CPUINFO = "model name\t: Some CPU @ 2.50GHz\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu sse avx avx2 fma avx512f {extra}\n"


def test_cpu_peak_is_cores_clock_and_vector_width():
    assert cpu_peak_flops("float32", 2, cpuinfo=CPUINFO.format(extra="")) == 2 * 2.5e9 * 64
    assert cpu_peak_flops("bfloat16", 1, cpuinfo=CPUINFO.format(extra="avx512_bf16")) == 2.5e9 * 128
    assert cpu_peak_flops("bfloat16", 1, cpuinfo=CPUINFO.format(extra="avx512_bf16 amx_bf16")) == 2.5e9 * 1024
    assert cpu_flops_per_cycle({"avx2", "fma"}, "tf32") == 32 and cpu_flops_per_cycle(set(), "fp32") == 8
    assert cpu_peak_flops("float32", 1, cpuinfo="flags : avx\n") is None   # no clock: unknown


def _cpu_spec(probed, threads=1):
    return SimpleNamespace(devices=[SimpleNamespace(kind="cpu", name="cpu", node=0, threads=threads, peak_flops=p)
                                    for p in probed])


def test_a_probe_taken_on_a_busy_node_no_longer_pushes_mfu_past_one(tmp_path, monkeypatch):
    """The probe's matmul read 30 GFLOP/s per worker on a busy node; training on a quiet one then ran
    at 1.5x that, which was MFU 1.50. The peak is the cores' now: 4 one-thread workers share 2 cores."""
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO.format(extra=""))
    monkeypatch.setattr(mfu_module, "CPUINFO", info)
    monkeypatch.setattr(mfu_module, "CPUFREQ", tmp_path / "no-cpufreq")
    spec = _cpu_spec([30e9] * 4)
    peak = job_peak_flops(spec, [0, 1, 2, 3], TrainConfig(), cores_per_node=2)
    assert peak == 2 * 2.5e9 * 64
    achieved = 1.5 * sum(d.peak_flops for d in spec.devices)
    assert mfu(1.0, achieved, peak) < 1.0
    # a probe above the cores x clock figure (a clock read below its turbo) is kept as the floor
    assert job_peak_flops(_cpu_spec([400e9]), [0], TrainConfig(), cores_per_node=2) == 400e9


def test_gpu_peak_is_the_datasheet_in_the_matmul_dtype():
    gpu = SimpleNamespace(devices=[SimpleNamespace(kind="cuda", name="NVIDIA H100 80GB HBM3", node=0, threads=1,
                                                   peak_flops=1e12)])
    bf16 = job_peak_flops(gpu, [0], TrainConfig(dtype="bfloat16"))
    assert bf16 > 900e12   # the table's dense bf16 figure, not the probe's 1 TFLOP/s


# ---------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("overrides,key", [({"lr": float("inf")}, "train.lr=inf"), ({"lr": 1e30}, "train.lr=1e+30"),
                                           ({"weight_decay": float("inf")}, "train.weight_decay=inf"),
                                           ({"dtype": "bfloat16"}, "train.dtype=bfloat16"),
                                           ({"grad_clip": None}, "train.grad_clip=1.0")])
def test_the_likely_key_of_a_nonfinite_step(overrides, key):
    assert key in likely_cause(TrainConfig(**overrides))


class _ToyAdapter(TrainAdapter):
    """One process, a Linear layer; update `bad_at` (1-based) comes out non-finite."""

    def __init__(self, root: Path, bad_at: int, what: str, steps: int = 6):
        torch.manual_seed(0)
        self.parts = {0: torch.nn.Linear(4, 1)}
        self.optimizers = {0: torch.optim.SGD(self.parts[0].parameters(), lr=0.1)}
        self.lr = LRSchedule({"w": self.optimizers[0]}, warmup_cosine(0, steps, 0.1))
        self.checkpoint_root, self.stop_at, self.checkpoint_interval = root, steps, 1
        self.bad_at, self.what, self.updates = bad_at, what, 0

    def batches(self, step):
        return iter(range(step, self.stop_at))

    def train_step(self, batch, step):
        if step + 1 == self.bad_at:
            raise NonFiniteStep(self.what, float("nan"))
        loss = self.parts[0](torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        self.optimizers[0].step()
        self.optimizers[0].zero_grad()
        self.updates += 1
        return {"loss": loss.item()}


def test_a_nonfinite_loss_stops_there_and_sets_its_weights_checkpoint_aside(tmp_path):
    adapter = _ToyAdapter(tmp_path / "checkpoints", bad_at=4, what="loss")
    summary = TrainCore(adapter).fit()
    assert summary["final_step"] == 3 and adapter.updates == 3
    bad = summary["nonfinite"]
    assert bad["step"] == 4 and bad["what"] == "loss" and math.isnan(bad["value"])
    # step 3's weights gave the NaN loss: set aside; step 2 is the last good one, and resume finds it
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert "nonfinite_step_000003" in names and "step_000003" not in names
    assert bad["checkpoint"].endswith("step_000002")
    assert ckpt.find_resume("auto", tmp_path / "checkpoints")[0].name == "step_000002"
    line = nonfinite_line(bad, TrainConfig(lr=1e30))
    assert line.startswith("step 4: the loss is nan") and "train.lr=1e+30" in line
    assert "train.resume=" in line and "step_000002" in line and "\n" not in line


def test_a_nonfinite_gradient_from_a_finite_loss_keeps_these_weights(tmp_path):
    adapter = _ToyAdapter(tmp_path / "checkpoints", bad_at=3, what="gradient norm")
    summary = TrainCore(adapter).fit()
    assert summary["nonfinite"]["checkpoint"].endswith("step_000002") and summary["final_step"] == 2
    assert "weights before it" in nonfinite_line(summary["nonfinite"], TrainConfig())


def test_nonfinite_at_the_first_step_says_no_checkpoint(tmp_path):
    summary = TrainCore(_ToyAdapter(tmp_path / "checkpoints", bad_at=1, what="loss")).fit()
    assert summary["nonfinite"]["checkpoint"] is None
    assert "no checkpoint of good weights" in nonfinite_line(summary["nonfinite"], TrainConfig())


ARCH = dict(name="hrm", family="hrm", hidden_size=16, H_layers=1, L_layers=1, num_heads=1, expansion=2,
            puzzle_emb_ndim=16, H_cycles=2, L_cycles=2, halt_max_steps=2, halt_exploration_prob=0.1)


def test_hrm_stops_at_a_nonfinite_step(tmp_path, free_port):
    from hrlplan.data.sudoku import SudokuPreset, build_sudoku_dataset
    from hrlplan.runtime.hrm_trainer import train_hrm

    data = build_sudoku_dataset(str(tmp_path / "sudoku"), SudokuPreset(num_train=8, num_test=4, num_aug=1), seed=0,
                                workers=1, progress=False, log=lambda _: None)
    train = dict(epochs=4, eval_interval=2, global_batch_size=4, lr=1e30, puzzle_emb_lr=1e-2, weight_decay=0.1,
                 puzzle_emb_weight_decay=0.1, seed=0, checkpoint_interval=0, resume="none", steps=None,
                 warmup_steps=0, min_lr_ratio=0.1, device="cpu", dp_mode="replicate")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=1)
    try:
        result = train_hrm({"arch": dict(ARCH), "train": train, "data": {"name": "sudoku", "path": data}},
                           str(tmp_path / "run"), None, SimpleNamespace(log=lambda *a, **k: None, note=lambda t: None))
    finally:
        dist.destroy_process_group()
    bad = result["nonfinite"]
    assert bad is not None and bad["step"] <= 3 and not math.isfinite(bad["value"])
    assert "train.lr=1e+30" in nonfinite_line(bad, TrainConfig(lr=1e30), hrm=True)


@pytest.mark.slow
def test_lr_1e30_stops_the_job_with_one_line_and_no_traceback(tmp_path):
    proc = pretrain(tmp_path / "run", "train.lr=1e30", "train.steps=6", "train.checkpoint_interval=1",
                    "logger.mode=disabled", "planner.calibrate=false", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hrlplan: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert "step 2: the loss is nan" in errors[0] and "train.lr=1e+30" in errors[0]
    names = os.listdir(tmp_path / "run" / "checkpoints")
    assert "nonfinite_step_000001" in names and not [n for n in names if n.startswith("step_")]


# ---------------------------------------------------------------- reports
def test_time_to_first_step_counts_from_the_command():
    """A command that spends 1 s before the job starts (imports, Hydra, checks) counts it."""
    code = ("import time; time.sleep(1.0); from hrlplan.launch.report import JobInfo; "
            "print(time.time() - JobInfo().started_at)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert 1.0 <= float(out.stdout) < 60
    assert process_start_time() <= time.time()


def test_a_step_far_off_its_prediction_says_why():
    assert off_prediction_line(1.5, calibrated=False, manual=True, steps_measured=50) is None
    manual = off_prediction_line(6.27, calibrated=False, manual=True, steps_measured=50, load=0.5)
    assert "planner=manual" in manual and "planner.calibrate=true" in manual and "busy" not in manual
    cached = off_prediction_line(0.01, calibrated=True, manual=False, steps_measured=3, load=3.0)
    assert "faster" in cached and "planner.calibrate=refresh" in cached and "busy" in cached and "warm up" in cached
    assert "\n" not in cached


@pytest.mark.parametrize("seconds,text", [(4.16, "4.16 s"), (0.0431, "43.1 ms"), (0.0004, "0.400 ms"),
                                          (611.0, "611 s"), (float("nan"), "?"), (None, "?")])
def test_times_print_in_plain_ms_or_s(seconds, text):
    assert duration_text(seconds) == text and "e+" not in duration_text(seconds)


def test_idle_devices_are_said():
    preset = SimpleNamespace(unused_ranks=[], world_size=16)
    line = idle_devices_line(preset, 48)
    assert "16 of 48 devices" in line and "32 stay idle (ranks 16-47)" in line
    local = idle_devices_line(SimpleNamespace(unused_ranks=[1], world_size=2), 2, unit="workers")
    assert local.startswith("the plan trains on 1 of 2 workers") and "allow_idle_ranks=false" in local
    assert idle_devices_line(SimpleNamespace(unused_ranks=[], world_size=4), 4) is None
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
