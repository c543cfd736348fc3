"""Retrain the heterogeneous-replica high-level policy (hrlplan/search/hrl_replicas.py), one command:

    python -m hrlplan.search.train_replicas [--minutes 4] [--instances 24] [--max-gpus 256] [--out FILE]

REINFORCE over generated heterogeneous clusters (hrl_replicas.training_instance), rewarded by the
low level's screening estimate (no simulator call), so four minutes on two cores suffice; the
default --out replaces the shipped weights (hrlplan/search/hrl/pretrained/replicas.pth) that the
planner uses zero-shot.
"""
from __future__ import annotations

import argparse

import torch

from hrlplan.search.hrl_replicas import POLICY_FILE, train_policy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="train the heterogeneous-replica high-level policy")
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock training time")
    ap.add_argument("--instances", type=int, default=24, help="generated clusters trained on, in turn")
    ap.add_argument("--max-gpus", type=int, default=256, help="largest generated cluster")
    ap.add_argument("--out", default=str(POLICY_FILE))
    args = ap.parse_args(argv)
    policy = train_policy(args.minutes, args.instances, max_gpus=args.max_gpus)
    torch.save(policy.state_dict(), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
