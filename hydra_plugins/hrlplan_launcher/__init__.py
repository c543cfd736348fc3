"""hrlplan's Hydra launcher plugin (see submitit_launcher.py)."""
