"""Device choice under the SLURM/torchrun bindings users meet, the datasheet peak table, TF32 and
optimizer switches: pure functions, so the GPU logic is pinned on CPU."""
import pytest
import torch

from hrlplan import devices
from hrlplan.devices import DeviceChoice, choose_device, peak_flops
from hrlplan.errors import UserError


def cuda(i, phys):
    return DeviceChoice(torch.device("cuda", i), phys)


@pytest.mark.parametrize("env,count,expected", [
    # torchrun / srun --gpus-per-node=4 without binding: every task sees all four
    ({"LOCAL_RANK": "2"}, 4, cuda(2, "2")),
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, cuda(3, "3")),
    # a job given GPUs 4-7 of an 8-GPU node: ordinal 1 is physical 5
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4, cuda(1, "5")),
    # --gpus-per-task=1 / --gpu-bind=single:1: one GPU per task, LOCAL_RANK 0..3
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, cuda(0, "3")),
    ({"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "2"}, 1, cuda(0, "2")),
    # cgroup-constrained gres: each task's only GPU is renumbered 0
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}, 1, cuda(0, "0")),
    # --gpus-per-task=2: the task's own two GPUs
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "6,7"}, 2, cuda(1, "7")),
    # UUIDs
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, 2, cuda(1, "GPU-bb")),
    # LOCAL_RANK wins over SLURM_LOCALID (torchrun inside srun)
    ({"LOCAL_RANK": "0", "SLURM_LOCALID": "0"}, 2, cuda(0, "0")),
])
def test_choose_device_under_slurm_bindings(env, count, expected):
    got = choose_device("auto", env, count)
    assert got == expected
    assert got.device.index < count  # never an invalid ordinal
    assert choose_device("cuda", env, count) == expected


def test_cpu_and_missing_gpu():
    assert choose_device("cpu", {"LOCAL_RANK": "3"}, 4) == DeviceChoice(torch.device("cpu"), None)
    assert choose_device("auto", {"LOCAL_RANK": "3"}, 0).device.type == "cpu"
    with pytest.raises(UserError, match="train.device=cuda"):
        choose_device("cuda", {"CUDA_VISIBLE_DEVICES": ""}, 0)
    with pytest.raises(UserError, match="train.device="):
        choose_device("gpu", {}, 1)
    with pytest.raises(UserError, match="LOCAL_RANK"):
        choose_device("auto", {"LOCAL_RANK": "x"}, 1)


def test_every_task_of_a_node_gets_its_own_gpu():
    """Four tasks of one node under each binding: four distinct physical GPUs, all valid ordinals."""
    bindings = {
        "shared": lambda r: ({"LOCAL_RANK": str(r)}, 4),
        "per-task": lambda r: ({"LOCAL_RANK": str(r), "CUDA_VISIBLE_DEVICES": str(r)}, 1),
        "two-per-task": lambda r: ({"LOCAL_RANK": str(r), "CUDA_VISIBLE_DEVICES": f"{2 * r},{2 * r + 1}"}, 2),
    }
    for name, make in bindings.items():
        records = []
        for r in range(4):
            env, count = make(r)
            c = choose_device("auto", env, count)
            assert c.device.index < count, name
            records.append({"rank": r, "hostname": "n0", "physical_id": c.physical_id})
        devices.check_unique_devices(records)


def test_oversubscribed_node_is_refused():
    records = [{"rank": r, "hostname": "n0", "physical_id": choose_device("auto", {"LOCAL_RANK": str(r)}, 2)
                .physical_id} for r in range(4)]
    with pytest.raises(UserError, match="ranks 0 and 2 both chose GPU 0 on n0"):
        devices.check_unique_devices(records)
    # same ids on different hosts, and CPU ranks, are fine
    devices.check_unique_devices([{"rank": 0, "hostname": "a", "physical_id": "0"},
                                  {"rank": 1, "hostname": "b", "physical_id": "0"},
                                  {"rank": 2, "hostname": "a", "physical_id": None},
                                  {"rank": 3, "hostname": "a", "physical_id": None}])


@pytest.mark.parametrize("name,table_name,bf16_tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200", 989.4),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100-SXM4-40GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA A10", "A10", 125.0),
    ("AMD Instinct MI300X", "MI300X", 1307.4),
    ("AMD Instinct MI250X / MI250", "MI250X GCD", 191.5),
])
def test_peak_table_matches_device_names(name, table_name, bf16_tflops):
    assert devices.match_device(name) == table_name
    assert peak_flops(name, torch.bfloat16) == pytest.approx(bf16_tflops * 1e12)
    assert peak_flops(name, "bfloat16") == peak_flops(name, torch.bfloat16)


def test_peak_dtypes():
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_flops(h100, "float32") == pytest.approx(66.9e12)
    assert peak_flops(h100, "tf32") == pytest.approx(494.7e12)
    # V100: fp16 tensor cores, no bf16, no TF32
    assert peak_flops("Tesla V100-SXM2-32GB", "float16") == pytest.approx(125e12)
    assert peak_flops("Tesla V100-SXM2-32GB", "bfloat16") is None
    assert peak_flops("Tesla V100-PCIE-16GB", "float16") == pytest.approx(112e12)
    assert peak_flops("cpu", "float32") is None
    assert peak_flops("NVIDIA A10G", "bfloat16") is None  # not in the table: not guessed from A10
    with pytest.raises(UserError, match="int8"):
        peak_flops(h100, "int8")


def test_fp32_plan_priced_at_tf32_or_fp32_peak_never_bf16():
    h100 = "NVIDIA H100 80GB HBM3"
    assert devices.matmul_dtype("float32", tf32=True) == "tf32"
    assert devices.matmul_dtype("float32", tf32=False) == "fp32"
    assert devices.matmul_dtype("bfloat16", tf32=False) == "bf16"
    bf16 = peak_flops(h100, "bfloat16")
    assert peak_flops(h100, devices.matmul_dtype("float32", True)) == pytest.approx(bf16 / 2)
    assert peak_flops(h100, devices.matmul_dtype("float32", False)) < bf16 / 10


def test_tf32_switch(monkeypatch):
    before = torch.get_float32_matmul_precision()
    try:
        devices.set_tf32(True)
        assert torch.get_float32_matmul_precision() == "high"
        devices.set_tf32(False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
    monkeypatch.delenv("HRLPLAN_TF32", raising=False)
    assert devices.tf32_setting({}) is True
    assert devices.tf32_setting({"tf32": False}) is False
    monkeypatch.setenv("HRLPLAN_TF32", "0")
    assert devices.tf32_setting({"tf32": True}) is False


def test_optimizer_and_compile_switches():
    assert devices.optimizer_impl(torch.device("cuda", 0)) == {"fused": True}
    assert devices.optimizer_impl(torch.device("cpu")) == {"foreach": False}
    assert devices.compile_disabled({"DISABLE_COMPILE": "1"})
    assert not devices.compile_disabled({"DISABLE_COMPILE": "0"})
    assert not devices.compile_disabled({})
