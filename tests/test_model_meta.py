"""Introspection on the meta device: parameter counts, per-block sums, FLOPs, clear errors."""
import pytest

from hrlplan.model_meta import ModelMeta, ModelResolutionError, introspect, resolve_arch

PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "llama-7b": 6_738_415_616}


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "llama-7b", "llama-tiny", "gpt2-tiny"])
def test_parts_add_up_to_total(name):
    meta = introspect(resolve_arch(name))
    assert meta.total_params == meta.embedding_params + sum(meta.block_params) + meta.head_params
    assert len(meta.block_params) == meta.n_layer == len(meta.block_modules)
    if name in PUBLISHED:
        assert meta.total_params == PUBLISHED[name]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_total_equals_sum_of_numel_of_a_real_model(name):
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch

    arch = resolve_arch(name)
    model = build_hf_model(hf_config_from_arch(arch))
    assert introspect(arch).total_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,seq", [("gpt2", 1024), ("gpt2-medium", 512), ("llama-7b", 4096), ("llama-tiny", 64)])
def test_training_flops_formula(name, seq):
    meta = introspect(resolve_arch(name), seq_len=seq)
    expected = 6 * meta.matmul_params + 12 * meta.n_layer * seq * meta.hidden_size
    assert meta.training_flops_per_token() == pytest.approx(expected, rel=0.01)
    # N_matmul: blocks and output head, not the embedding lookups
    assert meta.matmul_params < meta.total_params + meta.head_matmul_params


def test_gpt2_pins_embeddings_and_head():
    meta = introspect(resolve_arch("gpt2"))
    assert meta.first_stage_modules == ["transformer.wte", "transformer.wpe"]
    assert meta.last_stage_modules == ["transformer.ln_f", "lm_head"]
    assert meta.tied_embeddings and meta.head_params == 2 * 768  # tied head weight counted once


def test_meta_round_trips(tmp_path):
    meta = introspect(resolve_arch("gpt2-tiny"))
    meta.save(tmp_path / "m.json")
    assert ModelMeta.load(tmp_path / "m.json") == meta


def test_unknown_model_lists_shipped_archs():
    with pytest.raises(ModelResolutionError, match="gpt2-medium"):
        resolve_arch("no-such-model-xyz")


def test_local_directory_with_config_json(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=64).save_pretrained(tmp_path)
    meta = introspect(resolve_arch(str(tmp_path)))
    assert meta.n_layer == 3


def test_cli_writes_model_meta(tmp_path):
    from hrlplan.cli import main

    main(["introspect-model", "--model-id", "gpt2", "--out", str(tmp_path / "meta.json")])
    assert ModelMeta.load(tmp_path / "meta.json").total_params == PUBLISHED["gpt2"]


def test_sequence_longer_than_positions_is_a_clear_error():
    with pytest.raises(ModelResolutionError, match=r"data.seq_len=256 .* arch.n_positions=256"):
        introspect(resolve_arch("gpt2-tiny"), seq_len=256)


def test_block_activations_measured_at_reduced_width_scale_to_full_width():
    """A wide model is measured at two reduced widths and extrapolated (hrlplan.activations): the
    line equals a measurement at its own width, and a short row equals a long one per token."""
    from transformers import LlamaConfig

    from hrlplan import activations as A

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
    matmul = 2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816
    assert A._divisors(config) == [4, 2]   # widths 256 and 512
    scaled, scores = A.hf_block_saved_bytes_per_token(config, "model.layers", 256, matmul)
    assert scores == 0.0   # SDPA keeps no scores
    full = A._reduced_config(config, 1, 64)
    (short, long), _ = A._measure(full, "model.layers", (8, 64))
    assert short == long
    assert scaled == pytest.approx(long, rel=0.005)


def test_block_activations_fall_back_on_the_formula(monkeypatch):
    """A block that cannot run on the CPU gets Korthikanti's figure (block_activation_bytes), not an error."""
    from hrlplan import activations as A

    measured = introspect(resolve_arch("gpt2-tiny"))
    assert measured.extra["block_activations"] == "measured"

    def fail(*a, **k):
        raise RuntimeError("needs a GPU kernel")
    monkeypatch.setattr(A, "hf_block_saved_bytes_per_token", fail)
    meta = introspect(resolve_arch("gpt2-tiny"))
    h, s = meta.hidden_size, meta.seq_len
    assert meta.extra["block_activations"] == "formula"
    assert meta.block_activation_bytes_per_token == [34.0 * h + 5 * meta.num_heads * s] * meta.n_layer
    # the measured figure: GPT-2's composite GELU (four tensors kept) and q/k/v copies, 1.65x the formula
    assert measured.block_activation_bytes_per_token[0] - 5 * meta.num_heads * s == pytest.approx(56.25 * h)


def test_introspection_leaves_the_rng_alone():
    import torch

    torch.manual_seed(3)
    a = torch.rand(1)
    torch.manual_seed(3)
    introspect(resolve_arch("llama-tiny"))
    assert torch.rand(1) == a


def test_a_broken_model_config_is_one_user_error_naming_it(tmp_path):
    from hrlplan.errors import UserError
    from hrlplan.model_meta import ModelMeta, introspect, resolve_arch

    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": ')
    with pytest.raises(UserError, match=str(tmp_path)):
        introspect(resolve_arch(str(tmp_path)))
    (tmp_path / "arch.yaml").write_text("model_type: [unclosed\n  - : :")
    with pytest.raises(UserError, match="arch.yaml: not a readable model config"):
        resolve_arch(str(tmp_path / "arch.yaml"))
    (tmp_path / "meta.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="meta.json: not a usable model_meta.json"):
        ModelMeta.load(tmp_path / "meta.json")


def test_model_meta_and_what_it_reads_stay_torch_free():
    """ModelMeta.load, resolve_arch and the conf/ tree serve `--help`, completion and the planners' CLI:
    importing them brings no torch; the models (which build with torch) import the record, not the
    introspection, so neither imports the other back."""
    import subprocess
    import sys

    code = ("import sys, hrlplan.model_meta, hrlplan.model_record, hrlplan.conf_tree, hrlplan.compose; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert hrlplan.model_meta.ModelMeta is hrlplan.model_record.ModelMeta")
    subprocess.run([sys.executable, "-c", code], check=True)
