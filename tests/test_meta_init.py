"""A rank builds its stage on the meta device and allocates only that: the weights equal the same
modules of a whole model of the same seed, and nothing else is allocated."""
import math

import pytest
import torch

from hrlplan.compose import compose
from hrlplan.models.hf import build_stage_modules, hf_config_from_arch, build_hf_model, materialize
from hrlplan.runtime.trainer import build_full_model


def _arch(name):
    return compose([f"arch={name}"])["arch"]


@pytest.mark.parametrize("arch_name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_stage_materialized_alone_equals_the_whole_models_modules(arch_name, stage):
    arch = _arch(arch_name)
    whole = build_full_model(arch, seed=3)
    n = whole.config.num_hidden_layers
    spans = [(0, 1), (1, n - 1), (n - 1, n)]
    reference = dict(build_stage_modules(whole, spans)[stage].state_dict())

    meta = build_full_model(arch, seed=3, materialized=False)
    parts = build_stage_modules(meta, spans)
    materialize(meta, parts[stage].modules(), seed=3)
    mine = parts[stage].state_dict()
    assert mine.keys() == reference.keys()
    for name, tensor in mine.items():
        assert not tensor.is_meta, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    held = {id(p) for p in parts[stage].parameters()}   # a tied head is the embedding's tensor
    others = [p for i, part in enumerate(parts) if i != stage for p in part.parameters() if id(p) not in held]
    assert others and all(p.is_meta for p in others)   # never allocated


def test_materialized_buffers_equal_an_eagerly_built_models():
    """Rotary frequencies are no parameters: HF's _init_weights fills them, as in its meta loading."""
    arch = _arch("llama-tiny")
    eager = build_hf_model(hf_config_from_arch(arch))
    whole = build_full_model(arch, seed=0)
    buffers = dict(whole.named_buffers())
    assert buffers
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(buffers[name], buf, msg=name)


def test_gpt2_keeps_its_init_scheme_and_its_tie():
    arch = _arch("gpt2-tiny")
    whole = build_full_model(arch, seed=0)
    n = whole.config.n_layer
    assert whole.lm_head.weight is whole.transformer.wte.weight
    c_attn = whole.transformer.h[0].attn.c_attn.weight
    c_proj = torch.cat([whole.transformer.h[i].attn.c_proj.weight.flatten() for i in range(n)])
    assert c_attn.std().item() == pytest.approx(0.02, rel=0.1)
    # the parent's depth-scaled re-initialisation runs after the child's own (GPT-2 paper scheme)
    assert c_proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * n), rel=0.1)
    assert torch.all(whole.transformer.h[0].ln_1.weight == 1)
    # a different seed gives different weights; the same seed the same
    assert not torch.equal(build_full_model(arch, seed=1).transformer.wte.weight, whole.transformer.wte.weight)
    assert torch.equal(build_full_model(arch, seed=0).transformer.wte.weight, whole.transformer.wte.weight)


def test_a_tied_head_alone_holds_the_embeddings_initial_weight():
    """The last stage's head copy starts equal to the first stage's embedding."""
    arch = _arch("gpt2-tiny")
    first, last = [], []
    for out, stage in ((first, 0), (last, 1)):
        meta = build_full_model(arch, seed=5, materialized=False)
        parts = build_stage_modules(meta, [(0, 1), (1, meta.config.n_layer)])
        materialize(meta, parts[stage].modules(), seed=5)
        out.append(parts[0].transformer.wte.weight if stage == 0 else parts[1].lm_head.weight)
    torch.testing.assert_close(first[0], last[0], rtol=0, atol=0)


def test_a_model_not_on_meta_is_left_alone():
    whole = build_full_model(_arch("gpt2-tiny"), seed=0)
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    materialize(whole, whole.modules(), seed=99)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, before[k]), k
