"""Entry point: `python pretrain.py [overrides]` probes, introspects, plans and trains.

All logic lives in the hrlplan library; this file only composes the config with Hydra.
"""
import hydra
from omegaconf import DictConfig

from hrlplan.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from launch.job import run_from_hydra

    run_from_hydra(cfg)


if __name__ == "__main__":
    main()
