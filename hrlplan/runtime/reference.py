"""The one-process baseline: the same model, data, optimizer and schedule without any parallelism.

Tests compare every plan against it, and bench/runtime.py measures the pipeline's overhead with it.
"""
from __future__ import annotations

import time
from typing import Dict, List

import torch

from hrlplan.config import Config, as_config
from hrlplan.data.lm import build_lm_data
from hrlplan.models.hf import causal_lm_loss
from hrlplan.runtime.trainer import build_full_model, grad_clip, lr_lambda, make_optimizer


def train_single_process(cfg: Config, steps: int) -> List[Dict[str, float]]:
    """`steps` steps of cfg's model (a Config, or compose()'s plain dict) in this one process."""
    cfg = as_config(cfg)
    train = cfg.train
    model = build_full_model(cfg.arch, int(train.seed))
    data = build_lm_data(cfg.data, model.config.vocab_size, int(train.seed))
    opt = make_optimizer(model, train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(train, int(train.steps)))
    out = []
    for step in range(steps):
        inputs, targets = data.batch(step, int(train.global_batch_size))
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = model(input_ids=inputs, use_cache=False).logits   # training keeps no KV cache
        loss = causal_lm_loss(logits, targets)
        loss.backward()
        if grad_clip(train) > 0:   # null or 0: no clipping (clip_grad_norm_ with 0 would zero every gradient)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip(train))
        opt.step()
        sched.step()
        out.append({"step": step + 1, "loss": loss.item(), "step_time_s": time.perf_counter() - t0})
    return out
