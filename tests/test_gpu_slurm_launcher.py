"""The sbatch script submitit generates for the README's GPU sweep: host memory and cores grow
with the GPUs asked for. Built by submitit's own generator from the composed Hydra launcher config,
fitted by the launcher (hrlplan.launch.slurm_fit) to a recorded GPU partition, no SLURM needed."""
import re

import pytest

# `scontrol show partition|node -o` of a GPU partition: 4 nodes of 64 CPUs, 4 A100s and 512 GB each.
GPU_PARTITION = "PartitionName=gpu Default=NO MaxNodes=UNLIMITED MaxTime=2-00:00:00 Nodes=g[1-4] State=UP"
GPU_NODES = "\n".join(f"NodeName=g{i} CPUTot=64 AvailableFeatures=gpu,a100 Gres=gpu:a100:4(S:0-1) "
                      f"RealMemory=515000 State=IDLE Partitions=gpu" for i in range(1, 5))
README_GPU_SWEEP = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=myproj",
                    "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=4", "hydra.launcher.tasks_per_node=4"]


def sbatch_text(overrides, tmp_path, monkeypatch) -> str:
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    from hrlplan.compose import register_configs
    from hrlplan.conf_tree import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"hydra.launcher.submitit_folder={tmp_path}/%j",
                                           "hydra.launcher.name=pretrain"], return_hydra_config=True)
    from hrlplan.launch.slurm_fit import fit_request, parse_partition
    from hrlplan.launch.slurm_launcher import explicit_launcher_keys

    params = fit_request(dict(instantiate(cfg.hydra.launcher).params), explicit_launcher_keys(overrides),
                         parse_partition(GPU_PARTITION, GPU_NODES)).params
    # hydra-submitit-launcher's launch(), up to the submission
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    executor = submitit.AutoExecutor(cluster="slurm", folder=params["submitit_folder"],
                                     slurm_max_num_timeout=params["max_num_timeout"])
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()
                                  if k not in ("submitit_folder", "max_num_timeout")})
    return executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")


def flags(text: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, flags=re.M))


def _gb(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)([MG])B?", value).groups()
    return float(number) / (1024 if unit == "M" else 1)


def test_readme_gpu_sweep_asks_for_host_resources_per_gpu(tmp_path, monkeypatch):
    f = flags(sbatch_text(README_GPU_SWEEP, tmp_path, monkeypatch))
    assert f["gpus-per-node"] == "4" and f["ntasks-per-node"] == "4" and f["nodes"] == "2"
    assert "mem" not in f, "--mem is per node: it does not grow with the GPUs"
    cpus = int(f["cpus-per-task"])
    per_rank_gb = cpus * _gb(f["mem-per-cpu"])
    assert cpus >= 4 and per_rank_gb >= 16          # per GPU
    assert 4 * per_rank_gb >= 64                     # per node of 4 GPUs (was 4 GB for the node)


def test_host_resources_stay_overridable(tmp_path, monkeypatch):
    f = flags(sbatch_text([*README_GPU_SWEEP, "hydra.launcher.mem_per_cpu=null", "hydra.launcher.mem_gb=400",
                           "hydra.launcher.cpus_per_task=12"], tmp_path, monkeypatch))
    assert f["mem"] == "400GB" and "mem-per-cpu" not in f and f["cpus-per-task"] == "12"


def test_memory_per_node_on_the_command_line_replaces_the_yamls_per_cpu(tmp_path, monkeypatch):
    f = flags(sbatch_text([*README_GPU_SWEEP, "hydra.launcher.mem_gb=400"], tmp_path, monkeypatch))
    assert f["mem"] == "400GB" and "mem-per-cpu" not in f


def test_gpus_asked_where_the_partition_has_them(tmp_path, monkeypatch):
    """gpus_per_node left null: one GPU per task on a GPU partition (no task left on the CPU by mistake)."""
    f = flags(sbatch_text(["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu"], tmp_path, monkeypatch))
    assert f["gpus-per-node"] == "2" and f["ntasks-per-node"] == "2" and f["cpus-per-task"] == "8"


@pytest.mark.parametrize("launcher", ["submitit_slurm", "slurm_site_example"])
def test_no_conflicting_memory_flags(launcher, tmp_path, monkeypatch):
    f = flags(sbatch_text([f"hydra/launcher={launcher}"], tmp_path, monkeypatch))
    assert sum(k in f for k in ("mem", "mem-per-cpu", "mem-per-gpu")) == 1   # SLURM refuses two


def test_block_placement_accepted_cyclic_refused():
    from hrlplan.cluster import check_block_placement
    from hrlplan.errors import UserError

    check_block_placement(["a", "a", "b", "b"])
    check_block_placement(["a"])
    with pytest.raises(UserError, match="rank 1 runs on b but the plan puts it on a.*--distribution=block"):
        check_block_placement(["a", "b", "a", "b"])          # srun --distribution=cyclic
    with pytest.raises(UserError, match="node-major"):
        check_block_placement(["a", "a", "a", "b"])          # uneven tasks per node


def test_slurm_distribution_checked_before_start():
    from hrlplan.errors import UserError
    from hrlplan.launch.slurm import check_distribution

    for ok in ({}, {"SLURM_DISTRIBUTION": "block"}, {"SLURM_DISTRIBUTION": "block:cyclic"},
               {"SLURM_DISTRIBUTION": "pack"}):
        check_distribution(ok)
    for bad in ("cyclic", "cyclic:block", "plane=2", "arbitrary"):
        with pytest.raises(UserError, match="--distribution=block"):
            check_distribution({"SLURM_DISTRIBUTION": bad})
