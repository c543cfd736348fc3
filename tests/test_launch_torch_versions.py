"""The local launcher on older torch builds (CUDA wheels often lag the CPU one)."""
import dataclasses

from hrlplan.launch import local


def test_launch_config_drops_options_this_torch_lacks(monkeypatch):
    @dataclasses.dataclass
    class OlderLaunchConfig:   # torch 2.11's has no shutdown_timeout
        min_nodes: int
        max_nodes: int
        nproc_per_node: int

    monkeypatch.setattr(local, "LaunchConfig", OlderLaunchConfig)
    config = local._launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=15)
    assert config == OlderLaunchConfig(1, 1, 2)


def test_launch_config_keeps_options_this_torch_has():
    config = local._launch_config(min_nodes=1, max_nodes=1, nproc_per_node=1, shutdown_timeout=15)
    assert config.shutdown_timeout == 15
