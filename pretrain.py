"""Entry point: `python pretrain.py [overrides]` probes, introspects, plans and trains.

The same Hydra app as the installed `hrlplan train [overrides]`; it lives in hrlplan/app.py.
"""
from hrlplan.app import run

if __name__ == "__main__":
    run()
