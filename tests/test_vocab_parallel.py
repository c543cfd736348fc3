"""A vocabulary-parallel embedding and head (tp=2, DTensor) train what the whole stage trains.

One launch of two gloo workers runs every case: GPT-2 (head tied to the embedding) and Llama,
each as a tp=2 stage holding embedding, blocks and head beside the same stage unsharded on the
same batches, three AdamW steps with clipping; then the fallbacks (an odd vocabulary, the switch).
"""
from typing import Any, Dict, List

import pytest

STEPS = 3
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=2", "train.lr=3e-3"]
LLAMA = ["arch=llama-tiny", "arch.num_hidden_layers=2", "train.lr=3e-3"]


def _stage(overrides: List[str]):
    from hrlplan.compose import compose
    from hrlplan.models.hf import HFStage
    from hrlplan.runtime.trainer import build_full_model

    cfg = compose(overrides)
    model = build_full_model(cfg["arch"], int(cfg["train"]["seed"]))
    return HFStage(model, 0, model.config.num_hidden_layers, first=True, last=True), cfg["train"]


def _train(part, train, loss_fn, context) -> List[float]:
    import torch

    from hrlplan.runtime.parallel import clip_grad_norm
    from hrlplan.runtime.trainer import make_optimizer

    opt = make_optimizer(part, train)
    params = [p for p in part.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    vocab = 128
    losses = []
    for _ in range(STEPS):
        x, y = torch.randint(0, vocab, (2, 16), generator=gen), torch.randint(0, vocab, (2, 16), generator=gen)
        opt.zero_grad(set_to_none=True)
        with context():
            loss = loss_fn(part(x), y)
            loss.backward()
        clip_grad_norm(params, 1.0, None, [])
        opt.step()
        losses.append(loss.item())
    return losses


def _layout(part) -> Dict[str, Any]:
    emb = part.base.wte if part.model_type == "gpt2" else part.base.embed_tokens
    return {"embedding": [repr(p) for p in getattr(emb.weight, "placements", ())],
            "embedding_rows": tuple(getattr(emb.weight, "_local_tensor", emb.weight).shape),
            "embedding_grad": [repr(p) for p in getattr(emb.weight.grad, "placements", ())],
            "head": [repr(p) for p in getattr(part.lm_head.weight, "placements", ())],
            "tied": part.lm_head.weight is emb.weight, "loss_mesh": part.loss_mesh is not None}


def _worker() -> Dict[str, Any]:
    import logging
    from contextlib import nullcontext

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hrlplan.models.hf import causal_lm_loss
    from hrlplan.runtime.distributed import init_distributed, shutdown
    from hrlplan.runtime.tensor_parallel import loss_context, parallelize_stage, stage_loss

    init_distributed("cpu", {"collective_timeout_min": 5})
    try:
        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=("tp",))
        out: Dict[str, Any] = {}
        for name, overrides in (("gpt2", GPT2), ("llama", LLAMA)):
            whole, train = _stage(overrides)
            sharded, _ = _stage(overrides)
            parallelize_stage(sharded, mesh)
            out[name] = {"whole": _train(whole, train, causal_lm_loss, nullcontext),
                         "sharded": _train(sharded, train, stage_loss([sharded]), lambda: loss_context([sharded])),
                         **_layout(sharded)}
        said: List[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("hrlplan.runtime.tensor_parallel").addHandler(handler)
        for _ in range(2):   # an odd vocabulary: whole, said once per process
            odd, _ = _stage([*GPT2, "arch.vocab_size=127"])
            parallelize_stage(odd, mesh)
        out["odd"] = {**_layout(odd), "said": said if dist.get_rank() == 0 else None}
        off, _ = _stage(GPT2)
        parallelize_stage(off, mesh, vocab_parallel=False)
        out["off"] = _layout(off)
        return out
    finally:
        shutdown()


@pytest.mark.slow
def test_sharded_embedding_and_head_train_as_the_whole_stage(tmp_path):
    from hrlplan.launch.local import launch_workers

    out = launch_workers(_worker, (), 2, name="vocab-parallel", log_dir=str(tmp_path))[0]
    for name in ("gpt2", "llama"):
        case = out[name]
        assert case["sharded"] == pytest.approx(case["whole"], abs=1e-5), name
        assert case["embedding"] == case["head"] == ["Shard(dim=0)"], name
        assert case["embedding_rows"][0] == 64, name   # 128 / tp
        assert case["embedding_grad"] == ["Shard(dim=0)"], name   # sliced as the weight: the tie sync needs it
        assert case["loss_mesh"], name
    assert out["gpt2"]["tied"] and not out["llama"]["tied"]
    odd = out["odd"]
    assert odd["embedding"] == [] and odd["head"] == [] and odd["tied"] and not odd["loss_mesh"]
    assert len(odd["said"]) == 1 and "127 is not divisible by tp=2" in odd["said"][0]
    assert out["off"]["embedding"] == [] and out["off"]["tied"] and not out["off"]["loss_mesh"]


def test_hetero_units_name_a_recomputed_block_as_a_plain_one():
    """The heterogeneous executor recomputes as the plan asks (checkpoint_wrapper renames a block's
    parameters); replicas that recompute differently still pack one block's gradients in one order."""
    import torch

    from hrlplan.compose import compose
    from hrlplan.models.hf import build_hf_model, build_stage_modules, hf_config_from_arch
    from hrlplan.runtime.hetero import _param_units, embedding_units
    from hrlplan.runtime.recompute import apply_recompute

    with torch.device("meta"):
        model = build_hf_model(hf_config_from_arch(compose(GPT2)["arch"]))
    embed, tied = embedding_units(model)
    plain = _param_units(build_stage_modules(model, [(0, 2)])[0], embed, tied)
    wrapped = _param_units(apply_recompute(build_stage_modules(model, [(0, 2)])[0], "full"), embed, tied)
    assert sorted(plain.values()) == sorted(wrapped.values())
    assert any("_checkpoint_wrapped_module" in name for name in wrapped)
