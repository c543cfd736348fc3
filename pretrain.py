"""Entry point: `python pretrain.py [overrides]` probes, introspects, plans and trains.

All logic lives in the hrlplan library and launch/; this file only composes the config with Hydra.
"""
import warnings

import hydra
from omegaconf import DictConfig

from hrlplan.config import register_configs

register_configs()
# conf/hydra/launcher/submitit_*.yaml share names with the plugin's own schemas, which Hydra 1.3
# reports as a deprecation; the plugin's schema still validates them.
warnings.filterwarnings("ignore", message=r"(?s).*validated against ConfigStore schema", category=UserWarning)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from launch.job import run_from_hydra

    return run_from_hydra(cfg)  # the submitit launcher hands rank 0's summary back to the sweep


if __name__ == "__main__":
    main()
