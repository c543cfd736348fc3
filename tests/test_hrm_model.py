"""HRM model: ACT halting, one-step gradient, HRM-compatible names, introspection, memory guide."""
import math

import pytest
import torch

from hrlplan.models.hrm import (GiB, build_hrm, check_hrm_fits, compile_enabled, introspect_hrm, recommend_hrm_size,
                                stablemax_cross_entropy)

TINY = dict(hidden_size=16, H_layers=1, L_layers=1, num_heads=2, expansion=2, puzzle_emb_ndim=16,
            H_cycles=2, L_cycles=2, halt_max_steps=4, halt_exploration_prob=0.5)


def _batch(size=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"inputs": torch.randint(1, 11, (size, 81), generator=g),
            "labels": torch.randint(1, 11, (size, 81), generator=g),
            "puzzle_identifiers": torch.zeros(size, dtype=torch.int32)}


def test_act_halts_within_halt_max_steps_in_training():
    torch.manual_seed(0)
    model = build_hrm(TINY).train()
    with torch.no_grad():   # make the Q-head want to continue forever: only the cap can halt
        model.model.inner.q_head.bias.copy_(torch.tensor([-10.0, 10.0]))
    carry = model.initial_carry(_batch())
    for _ in range(12):
        carry, loss, metrics, _, _ = model(carry, _batch())
        assert torch.isfinite(loss)
        assert int(carry.steps.max()) <= TINY["halt_max_steps"]
        assert bool(carry.halted[carry.steps >= TINY["halt_max_steps"]].all())


def test_q_head_can_halt_early_and_eval_runs_exactly_max_steps():
    torch.manual_seed(0)
    model = build_hrm(dict(TINY, halt_exploration_prob=0.0)).train()
    with torch.no_grad():   # halting preferred: every sequence stops after one segment in training
        model.model.inner.q_head.bias.copy_(torch.tensor([10.0, -10.0]))
    carry, _, _, _, all_halted = model(model.initial_carry(_batch()), _batch())
    assert bool(all_halted) and int(carry.steps.max()) == 1
    model.eval()
    with torch.no_grad():
        carry = model.initial_carry(_batch())
        for segment in range(1, TINY["halt_max_steps"] + 1):
            carry, _, metrics, _, all_halted = model(carry, _batch())
            assert bool(all_halted) == (segment == TINY["halt_max_steps"])
    assert metrics["count"] == 6 and 0 <= metrics["exact_accuracy"] <= 6


def test_one_step_gradient_detaches_the_carry():
    torch.manual_seed(0)
    model = build_hrm(TINY).train()
    carry, loss, _, _, _ = model(model.initial_carry(_batch()), _batch())
    assert not carry.inner_carry.z_H.requires_grad and not carry.inner_carry.z_L.requires_grad
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert model.model.puzzle_emb.local_weights.grad is not None   # sparse rows got their gradient


def test_state_dict_names_match_hrm():
    keys = set(build_hrm(TINY).state_dict())
    for key in ("model.inner.embed_tokens.embedding_weight", "model.inner.puzzle_emb.weights",
                "model.inner.H_level.layers.0.self_attn.qkv_proj.weight", "model.inner.L_level.layers.0.mlp.gate_up_proj.weight",
                "model.inner.q_head.bias", "model.inner.H_init", "model.inner.L_init"):
        assert key in keys
    assert not any("rotary" in k for k in keys)


def test_stablemax_cross_entropy_ignores_masked_labels():
    logits = torch.tensor([[[2.0, -1.0, 0.5], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, -100]])
    loss = stablemax_cross_entropy(logits, labels)
    s = torch.tensor([3.0, 0.5, 1.5])
    assert loss[0, 1] == 0 and math.isclose(float(loss[0, 0]), -math.log(3.0 / float(s.sum())), rel_tol=1e-9)


def test_introspect_counts_blocks_and_cycles():
    arch = dict(TINY, name="hrm", family="hrm")
    meta = introspect_hrm(arch, None)
    assert meta.family == "hrm" and meta.n_layer == 2 and meta.block_repeats == 4
    assert meta.seq_len == 82 and meta.block_modules[0].startswith("model.inner.L_level")
    model = build_hrm(arch)
    assert meta.total_params == sum(p.numel() for p in model.parameters()) + 16   # + the puzzle table
    runs = meta.extra["block_runs_per_forward"]
    assert runs == [4, 2]
    # block_repeats * sum(per-block FLOPs) is one ACT forward: L runs 4x, H 2x per segment.
    single = [f * meta.block_repeats / r for f, r in zip(meta.block_flops_fwd_per_token, runs)]
    assert math.isclose(single[0], single[1])
    assert meta.extra["train_flops_per_token"] < meta.training_flops_per_token() * 1.5


def test_memory_guide_table_and_fit_check():
    assert recommend_hrm_size(1 * GiB)["hidden_size"] == 16
    assert recommend_hrm_size(3 * GiB)["global_batch_size"] == 4
    mid = recommend_hrm_size(8 * GiB)
    assert (mid["hidden_size"], mid["H_layers"], mid["L_layers"], mid["global_batch_size"]) == (64, 2, 2, 8)
    top = recommend_hrm_size(80 * GiB)
    assert top["hidden_size"] == 512 and top["global_batch_size"] == 768
    small = dict(hidden_size=32, H_layers=1, L_layers=1, num_heads=1, expansion=2, puzzle_emb_ndim=32)
    assert check_hrm_fits(small, 4, 4 * GiB) is None
    full = dict(hidden_size=512, H_layers=4, L_layers=4, num_heads=8, expansion=4, puzzle_emb_ndim=512)
    warning = check_hrm_fits(full, 768, 8 * GiB)
    assert warning and "global_batch_size=768" in warning and "arch.hidden_size=64" in warning


def test_compile_only_on_cuda_without_disable_compile(monkeypatch):
    monkeypatch.delenv("DISABLE_COMPILE", raising=False)
    assert not compile_enabled(torch.device("cpu"))
    assert compile_enabled(torch.device("cuda"))
    monkeypatch.setenv("DISABLE_COMPILE", "1")
    assert not compile_enabled(torch.device("cuda"))


def test_bad_head_count_is_a_clear_error():
    with pytest.raises(ValueError, match="num_heads"):
        build_hrm(dict(TINY, hidden_size=30, num_heads=4))


def test_shipped_arch_yaml_introspects_without_hydra():
    from hrlplan.model_meta import load_shipped_arch

    meta = introspect_hrm(load_shipped_arch("hrm"), None)   # puzzle_emb_ndim: ${.hidden_size}
    assert meta.n_layer == 8 and meta.hidden_size == 512 and 26e6 < meta.total_params < 29e6
    assert introspect_hrm(load_shipped_arch("hrm"), 900).seq_len == 901
