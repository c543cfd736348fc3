"""The heterogeneous executor's parameter units (runtime/hetero.py) under recomputation. The
vocabulary-parallel embedding and head are tested with the other tp stage cases in
tests/test_sequence_parallel.py (one launch of workers for both)."""
GPT2 = ["arch=gpt2-tiny", "arch.n_layer=2", "train.lr=3e-3"]


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
