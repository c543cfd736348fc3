"""The two policies and the learned baseline.

Both policies are scorers over a variable set of legal actions (a pointer-network style head):
the high-level one scores every legal Config -- (pp, tp, dp, micro-batch size and count, device
pool and group order) -- the low-level one scores each boundary offset of the next stage. Illegal
actions are never scored (masking), so the same weights serve any model and cluster.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
import torch.nn as nn

from hrlplan.errors import UserError, one_line
from hrlplan.search.hrl.features import CONFIG_DIM, EST_COL, INSTANCE_DIM, MEM_COL, OFFSET_DIM, STEP_DIM

CHECKPOINT_NAME = "hrl_policy.pth"      # in a train-hrl checkpoint directory
GENERALIST_NAME = "generalist.pth"      # the shipped generalist, in pretrained_dir()


def _mlp(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out))


class HierarchicalPolicy(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.hidden = hidden
        self.high = _mlp(INSTANCE_DIM + CONFIG_DIM, hidden, 1)
        self.low = _mlp(INSTANCE_DIM + STEP_DIM + OFFSET_DIM, hidden, 1)
        self.baseline = _mlp(INSTANCE_DIM + CONFIG_DIM, hidden, 1)
        # Learnable priors (residual policy): prefer configs whose step-time estimate is low and
        # whose memory estimate fits, and the boundary hint itself. Training adjusts both the scales
        # and the networks' corrections; an untrained policy is therefore already sensible.
        self.high_prior = nn.Parameter(torch.tensor([20.0, 2.0]))
        self.low_prior = nn.Parameter(torch.tensor(2.0))
        # The networks start as zero corrections: an untrained policy is exactly the priors, and
        # training (per instance, or the generalist over many) learns the residuals.
        for net in (self.high, self.low):
            nn.init.zeros_(net[-1].weight)
            nn.init.zeros_(net[-1].bias)

    def high_logits(self, inst: torch.Tensor, configs: torch.Tensor) -> torch.Tensor:
        """inst [I], configs [C, CONFIG_DIM] -> [C]"""
        x = torch.cat([inst.expand(configs.shape[0], -1), configs], dim=1)
        prior = (-self.high_prior[0] * configs[:, EST_COL]
                 - self.high_prior[1] * torch.relu(configs[:, MEM_COL] - 1.0))
        return self.high(x).squeeze(-1) + prior

    def low_logits(self, inst: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """steps [S, STEP_DIM], offsets [S, O, OFFSET_DIM], mask [S, O] -> masked logits [S, O]"""
        s, o = offsets.shape[:2]
        x = torch.cat([inst.expand(s, o, -1), steps[:, None, :].expand(s, o, -1), offsets], dim=2)
        logits = self.low(x).squeeze(-1) + self.low_prior * offsets[..., 3]
        return logits.masked_fill(~mask, float("-inf"))

    def value(self, inst: torch.Tensor, config_rows: torch.Tensor) -> torch.Tensor:
        x = torch.cat([inst.expand(config_rows.shape[0], -1), config_rows], dim=1)
        return self.baseline(x).squeeze(-1)


def save_policy(policy: HierarchicalPolicy, directory: str | Path, extra: Dict[str, Any] | None = None) -> Path:
    """Into directory/hrl_policy.pth, or into the file itself when given a *.pth path."""
    path = Path(directory)
    if path.suffix == ".pth":
        path.parent.mkdir(parents=True, exist_ok=True)
        target = path
    else:
        path.mkdir(parents=True, exist_ok=True)
        target = path / CHECKPOINT_NAME
    # fp16 weights keep the shipped generalist well under 1 MB; they are cast back on load
    state = {k: v.half() for k, v in policy.state_dict().items()}
    torch.save({"state": state, "hidden": policy.hidden, "extra": extra or {}}, target)
    return target


def _checkpoint_file(path: str | Path) -> Path:
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def _read_checkpoint(path: Path) -> Dict[str, Any]:
    """torch.load (weights only) of a policy checkpoint; a missing, truncated or foreign file is one
    UserError line naming it and what to do, not torch's multi-line unpickling error."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or not isinstance(blob.get("state"), dict) or "hidden" not in blob:
            raise ValueError("it holds no policy state")
        return blob
    except Exception as e:
        if isinstance(e, FileNotFoundError):
            reason = "no such file"
        elif isinstance(e, ValueError):
            reason = f"not an HRL policy checkpoint: {e}"
        else:   # torch's unpickling/zip errors are long and suggest weights_only=False: never that here
            reason = f"not a readable torch checkpoint, or a truncated one ({type(e).__name__})"
        raise UserError(f"{path}: {reason}; point --checkpoint-dir / planner.checkpoint_dir at a directory written "
                        "by `hrlplan train-hrl` (it holds hrl_policy.pth), or leave it out to plan with the shipped "
                        "generalist") from None


def load_policy(directory: str | Path) -> HierarchicalPolicy:
    path = _checkpoint_file(directory)
    blob = _read_checkpoint(path)
    policy = HierarchicalPolicy(int(blob["hidden"]))
    try:
        policy.load_state_dict({k: v.float() for k, v in blob["state"].items()})
    except (RuntimeError, AttributeError) as e:   # another architecture's weights
        raise UserError(f"{path}: its weights do not fit this hrlplan's HRL policy ({one_line(e, 120)}); retrain it "
                        "with `hrlplan train-hrl`") from None
    return policy


def pretrained_dir() -> Path:
    return Path(__file__).resolve().parent / "pretrained"


def generalist_path() -> Path:
    return pretrained_dir() / GENERALIST_NAME


def checkpoint_extra(path: str | Path) -> Dict[str, Any]:
    return dict(_read_checkpoint(_checkpoint_file(path)).get("extra") or {})
