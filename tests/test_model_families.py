"""Introspection finds any common HF causal LM's blocks, embeddings and head by structure: each family
built on the meta device from a tiny config (saved as a local config.json, the user's path)."""
import ast
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import transformers as T
from hydra.core.config_store import ConfigStore

import hrlplan
from hrlplan import families as registry
from hrlplan.compose import compose
from hrlplan.conf_tree import load_shipped_arch
from hrlplan.config import HRMArchConfig, LlamaArchConfig, typed
from hrlplan.errors import ConfigError
from hrlplan.model_meta import ModelResolutionError, introspect, resolve_arch

H, L, V, P, SEQ = 64, 2, 128, 64, 32
GQA = dict(hidden_size=H, intermediate_size=176, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=V, max_position_embeddings=P)
MODEL = ["model.embed_tokens"], ["model.norm", "lm_head"]
TRANSFORMER = ["transformer.wte"], ["transformer.ln_f", "lm_head"]
FALCON = ["transformer.word_embeddings"], ["transformer.ln_f", "lm_head"]

# config, (first-stage modules, last-stage modules), block list, expected block shape:
# K/V width, MLP width, gated MLP, norms per block, attention and MLP read one tensor
FAMILIES = {
    "gpt2": (T.GPT2Config(n_embd=H, n_layer=L, n_head=4, vocab_size=V, n_positions=P, bos_token_id=V - 1,
                          eos_token_id=V - 1),
             (["transformer.wte", "transformer.wpe"], TRANSFORMER[1]), "transformer.h", (64, 256, False, 2, False)),
    "opt": (T.OPTConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=4, ffn_dim=192, vocab_size=V,
                        max_position_embeddings=P),
            (["model.decoder.embed_tokens", "model.decoder.embed_positions"],
             ["model.decoder.final_layer_norm", "lm_head"]), "model.decoder.layers", (64, 192, False, 2, False)),
    # opt-350m's shape: embeddings narrower than the model, post-norm, no final norm
    "opt-proj": (T.OPTConfig(hidden_size=H, word_embed_proj_dim=32, do_layer_norm_before=False, num_hidden_layers=L,
                             num_attention_heads=4, ffn_dim=192, vocab_size=V, max_position_embeddings=P),
                 (["model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.project_in"],
                  ["model.decoder.project_out", "lm_head"]), "model.decoder.layers", (64, 192, False, 2, False)),
    "llama": (T.LlamaConfig(**GQA), MODEL, "model.layers", (32, 176, True, 2, False)),
    "mistral": (T.MistralConfig(**GQA), MODEL, "model.layers", (32, 176, True, 2, False)),
    "qwen2": (T.Qwen2Config(**GQA), MODEL, "model.layers", (32, 176, True, 2, False)),
    # head_dim 32 x 4 heads is wider than hidden 64; multi-query; tied head
    "gemma": (T.GemmaConfig(**{**GQA, "num_key_value_heads": 1}, head_dim=32), MODEL, "model.layers",
              (32, 176, True, 2, False)),
    "phi": (T.PhiConfig(**{**GQA, "num_key_value_heads": 4}), (MODEL[0], ["model.final_layernorm", "lm_head"]),
            "model.layers", (64, 176, False, 1, True)),
    # parallel residual with two norms: attention and MLP read different tensors
    "gpt_neox": (T.GPTNeoXConfig(hidden_size=H, intermediate_size=176, num_hidden_layers=L, num_attention_heads=4,
                                 vocab_size=V, max_position_embeddings=P),
                 (["gpt_neox.embed_in"], ["gpt_neox.final_layer_norm", "lm_head"]), "gpt_neox.layers",
                 (64, 176, False, 2, False)),
    # falcon-7b: parallel attention, one norm, multi-query
    "falcon": (T.FalconConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=4, vocab_size=V,
                              max_position_embeddings=P), FALCON, "transformer.h", (16, 256, False, 1, True)),
    # falcon-40b: the new decoder architecture, a norm each for attention and MLP, grouped K/V
    "falcon-new": (T.FalconConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=4, num_kv_heads=2,
                                  new_decoder_architecture=True, vocab_size=V, max_position_embeddings=P),
                   FALCON, "transformer.h", (32, 256, False, 2, False)),
    # ALiBi: no position table, so no default sequence length
    "bloom": (T.BloomConfig(hidden_size=H, n_layer=L, n_head=4, vocab_size=V),
              (["transformer.word_embeddings", "transformer.word_embeddings_layernorm"], TRANSFORMER[1]),
              "transformer.h", (64, 256, False, 2, False)),
    "gptj": (T.GPTJConfig(n_embd=H, n_layer=L, n_head=4, rotary_dim=8, vocab_size=V, n_positions=P),
             TRANSFORMER, "transformer.h", (64, 256, False, 1, True)),
    # beyond the list: fused qkv and gate_up (Phi-3), q/k norms (Qwen3), four norms a block (Gemma 2),
    # norms without weights (OLMo), one norm feeding attention and MLP (Cohere), multi-query (StarCoder)
    "phi3": (T.Phi3Config(**GQA, pad_token_id=0), MODEL, "model.layers", (32, 176, True, 2, False)),
    "qwen3": (T.Qwen3Config(**GQA, head_dim=16), MODEL, "model.layers", (32, 176, True, 2, False)),
    "gemma2": (T.Gemma2Config(**GQA, head_dim=16), MODEL, "model.layers", (32, 176, True, 4, False)),
    "olmo": (T.OlmoConfig(**GQA), (MODEL[0], ["lm_head"]), "model.layers", (32, 176, True, 2, False)),
    "cohere": (T.CohereConfig(**GQA), MODEL, "model.layers", (32, 176, True, 1, True)),
    "gpt_bigcode": (T.GPTBigCodeConfig(n_embd=H, n_layer=L, n_head=4, vocab_size=V, n_positions=P),
                    (["transformer.wte", "transformer.wpe"], TRANSFORMER[1]), "transformer.h",
                    (16, 256, False, 2, False)),
}


def _meta_of(name, tmp_path, seq_len=SEQ):
    config = FAMILIES[name][0]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    return introspect(resolve_arch(str(tmp_path)), seq_len=seq_len), model


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_parts_add_up_and_are_found(name, tmp_path):
    meta, model = _meta_of(name, tmp_path)
    _, (first, last), blocks_path, (kv, ffn, gated, norms, shared) = FAMILIES[name]
    assert meta.total_params == sum(p.numel() for p in model.parameters())
    assert meta.total_params == meta.embedding_params + sum(meta.block_params) + meta.head_params
    blocks = model.get_submodule(blocks_path)
    assert meta.block_modules == [f"{blocks_path}.{i}" for i in range(L)] and meta.n_layer == L
    assert meta.block_params == [sum(p.numel() for p in b.parameters()) for b in blocks]
    assert (meta.first_stage_modules, meta.last_stage_modules) == (first, last)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embedding is model.get_submodule(first[0]) and head is model.get_submodule(last[-1])
    assert meta.tied_embeddings == (head.weight is embedding.weight)
    linear = sum(m.weight.numel() for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)) or \
        sum(p.numel() for p in blocks[0].parameters() if p.dim() == 2)   # GPT-2's Conv1D
    assert meta.block_matmul_params == [linear] * L
    assert meta.block_flops_fwd_per_token[0] == 2 * linear + 4 * SEQ * meta.extra["query_width"]
    got = meta.extra
    assert (got["kv_width"], got["ffn_size"], got["gated_mlp"], got["norms_per_block"],
            got["parallel_shared_input"]) == (kv, ffn, gated, norms, shared)


def test_blocks_differ_where_families_do(tmp_path):
    """Same widths: a parallel block with one norm (GPT-J) keeps less than GPT-2's (one norm input
    fewer, the MLP's input is the attention's); GQA keeps less than MHA (narrower K and V). The
    figures are measured (hrlplan.activations): GPT-2's composite GELU and Llama's rotary and fp32
    RMSNorm copies make them exceed Korthikanti's formula, which stays the fallback and keeps its
    shape: GPT-2's 34h + 5as, GPT-J 4h less, GQA 4*(h - kv) less."""
    from hrlplan.model_meta import block_activation_bytes

    gpt2, _ = _meta_of("gpt2", tmp_path / "a")
    gptj, _ = _meta_of("gptj", tmp_path / "b")
    assert gpt2.extra["block_activations"] == gptj.extra["block_activations"] == "measured"
    assert gpt2.block_activation_bytes_per_token[0] - gptj.block_activation_bytes_per_token[0] >= 4 * H
    assert gpt2.block_activation_bytes_per_token[0] > 34 * H + 5 * 4 * SEQ   # above Korthikanti's 34sbh + 5as^2b
    llama, _ = _meta_of("llama", tmp_path / "c")
    FAMILIES["llama-mha"] = (T.LlamaConfig(**{**GQA, "num_key_value_heads": 4}),) + FAMILIES["llama"][1:]
    try:
        mha, _ = _meta_of("llama-mha", tmp_path / "d")
    finally:
        del FAMILIES["llama-mha"]
    assert mha.block_activation_bytes_per_token[0] - llama.block_activation_bytes_per_token[0] >= 4 * (H - 32)
    assert mha.block_flops_fwd_per_token[0] - llama.block_flops_fwd_per_token[0] == 2 * 2 * H * (H - 32)

    def formula(meta, shape):
        return block_activation_bytes(H, meta.extra["query_width"], meta.extra["kv_width"], 4, SEQ, shape)
    from hrlplan.models.hf import BlockShape
    gpt2_shape, gptj_shape = BlockShape("attn", 0, 4 * H, 1, 2, False), BlockShape("attn", 0, 4 * H, 1, 1, True)
    assert formula(gpt2, gpt2_shape) == 34 * H + 5 * 4 * SEQ
    assert formula(gpt2, gpt2_shape) - formula(gptj, gptj_shape) == 4 * H


def test_opt_directory_through_the_cli(tmp_path, capsys):
    """The reported crash: `hrlplan introspect-model --model-id <dir with an OPT config.json>`."""
    from hrlplan.cli import main
    from hrlplan.model_meta import ModelMeta

    FAMILIES["opt"][0].save_pretrained(tmp_path / "opt")
    main(["introspect-model", "--model-id", str(tmp_path / "opt"), "--out", str(tmp_path / "meta.json")])
    meta = ModelMeta.load(tmp_path / "meta.json")
    assert meta.model_type == "opt" and meta.n_layer == L and meta.seq_len == P


def test_alibi_model_needs_a_sequence_length(tmp_path):
    with pytest.raises(ModelResolutionError, match="BloomConfig has no max_position_embeddings .*--seq-len"):
        _meta_of("bloom", tmp_path, seq_len=None)


def _one_line_error(model) -> str:
    from hrlplan.models.hf import hf_layout

    with pytest.raises(ModelResolutionError) as info:
        hf_layout(model)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("config,error", [
    (T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=V),
     "MambaForCausalLM is not a supported causal LM structure: no attention module"),
    (T.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2),
     r"MixtralForCausalLM is not a supported causal LM structure: .* mixture of experts \(mlp.experts\)"),
    (T.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=V), "T5Config: no causal LM to build"),
])
def test_other_structures_are_one_line_errors_through_the_cli(config, error, tmp_path, capsys):
    from hrlplan.cli import main

    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="2"):
        main(["introspect-model", "--model-id", str(tmp_path), "--out", str(tmp_path / "meta.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hrlplan: error: ") and re.search(error, err[0]), err
    assert not (tmp_path / "meta.json").exists()


def test_unsupported_structures_name_the_class_and_what_is_missing():
    assert "Sequential" in _one_line_error(torch.nn.Sequential(torch.nn.Linear(2, 2))) and \
        "no list of decoder blocks" in _one_line_error(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with torch.device("meta"):
        base = T.AutoModel.from_config(T.LlamaConfig(**GQA))   # a base model: no head
    assert _one_line_error(base).startswith("LlamaModel is not a supported causal LM structure: no output head")


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "gemma", "opt"])
def test_pipeline_stages_equal_the_whole_model_or_say_they_cannot(name):
    from hrlplan.models.hf import build_stage_modules

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(FAMILIES[name][0]).eval()
    x = torch.randint(0, V, (2, 8))
    if name == "opt":
        with pytest.raises(NotImplementedError, match="pipeline stages of OPTForCausalLM are not implemented"):
            build_stage_modules(model, [(0, 1), (1, L)])
        return
    first, last = build_stage_modules(model, [(0, 1), (1, L)])
    with torch.no_grad():
        torch.testing.assert_close(last(first(x)), model(x).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- the registry (hrlplan/families.py)
def test_each_family_states_its_facts_once():
    from dataclasses import fields as schema_fields

    from hrlplan.runtime.family_trainers import TRAINERS
    from hrlplan.runtime.tensor_parallel import BLOCK_PLANS

    for family in registry.FAMILIES + [registry.GENERIC_HF]:
        assert family.trainer in TRAINERS, family.name
        assert family.tp_plan is None or family.tp_plan in BLOCK_PLANS, family.name
        assert family.data_kind in (registry.LM_DATA, registry.PUZZLE_DATA)
        assert not family.sequence_parallel or family.tp_plan, f"{family.name}: sequence parallel is a tp plan's"
        assert family.pipeline or family.data_kind == registry.PUZZLE_DATA
        if family.schema is None:
            assert not (family.value_rules or family.layers_key or family.schema_option), family.name
            continue
        names = {f.name for f in schema_fields(family.schema)}
        default = family.schema()
        assert default.family == family.arch_family and family.covers(default.model_type), family.name
        used = set(family.value_rules) | {k for pair in family.head_splits for k in pair} | \
            {family.layers_key, family.positions_key} - {None}
        assert used <= names, f"{family.name}: {sorted(used - names)} are no keys of {family.schema.__name__}"
        assert family.schema_option.endswith("_schema")


def test_the_registry_answers_what_the_code_used_to_spell_out():
    facts = {name: registry.family_of({"family": arch, "model_type": model_type})
             for name, arch, model_type in [("gpt2", "hf", "gpt2"), ("llama", "hf", "llama"), ("qwen3", "hf", "qwen3"),
                                            ("opt", "hf", "opt"), ("hrm", "hrm", "hrm_act_v1"), ("hrm-file", None,
                                                                                              "hrm_act_v1")]}
    assert [facts[n].name for n in facts] == ["gpt2", "llama", "llama_style", "hf", "hrm", "hrm"]
    assert {n for n, f in facts.items() if f.tp_plan} == {"gpt2", "llama", "qwen3"}
    assert {n for n, f in facts.items() if f.llama_blocks} == {"llama", "qwen3"}
    assert {n for n, f in facts.items() if not f.pipeline} == {"hrm", "hrm-file"}
    assert {n for n, f in facts.items() if f.tp_layout_per_degree} == {"gpt2"}
    assert facts["hrm"].schema is HRMArchConfig and facts["opt"].schema is None
    assert registry.arch_family_for_model_type("hrm_act_v1") == "hrm"
    assert registry.arch_family_for_model_type("mistral") == "hf"


@pytest.mark.parametrize("name", ["gpt2", "gpt2-tiny", "llama-tiny", "hrm"])
def test_every_shipped_arch_has_its_family(name):
    arch = load_shipped_arch(name)
    family = registry.family_of(arch)
    assert family.schema is not None and set(arch) >= {f for f in family.value_rules}


def test_launch_validate_and_the_trainers_never_compare_a_family_name():
    """The LM/HRM switch is the registry's: no `x == "hrm"` (nor "hf", "gpt2", "llama") outside the
    families' own modules."""
    names = {"hrm", "hf", "gpt2", "llama", "mistral", "qwen2", "qwen3"}
    root = Path(hrlplan.__file__).parent
    paths = [*(root / "launch").glob("*.py"), *(root / "validate").glob("*.py"), root / "compose.py",
             root / "memory_guide.py", root / "model_meta.py", root / "app.py", root / "cli.py",
             *(root / "runtime" / m for m in ("trainer.py", "hrm_trainer.py", "family_trainers.py", "metrics.py",
                                              "evaluate_run.py", "tensor_parallel.py"))]
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in names
                    for side in [node.left, *node.comparators] for c in ast.walk(side)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "ask hrlplan.families instead:\n" + "\n".join(found)


@dataclass
class _Qwen3ArchConfig(LlamaArchConfig):
    name: str = "qwen3"
    model_type: str = "qwen3"
    head_dim: int = 128


def test_a_new_family_is_one_entry():
    """Qwen3 as a shipped arch with a schema of its own: one Family in FAMILIES, and composing, the
    checks, the planner's limits, the tensor-parallel plan and the trainer all know it."""
    qwen3 = registry.Family("qwen3", "hf", ("qwen3",), registry.PIPELINE_TRAINER, schema=_Qwen3ArchConfig,
                            schema_option="qwen3_schema", tp_plan="llama", llama_blocks=True, sequence_parallel=True,
                            layers_key="num_hidden_layers", positions_key="max_position_embeddings",
                            value_rules={**registry.LLAMA_RULES, "head_dim": "pos_int"})
    registry.FAMILIES.insert(0, qwen3)   # the entry: before llama_style, which lists qwen3 among its types
    try:
        _every_layer_knows(qwen3)
    finally:
        registry.FAMILIES.remove(qwen3)
        ConfigStore.instance().repo["arch"].pop("qwen3_schema.yaml", None)


def _every_layer_knows(qwen3) -> None:
    from hrlplan.compose import register_configs
    from hrlplan.launch.planning import planner_settings
    from hrlplan.runtime.family_trainers import TRAINERS
    from hrlplan.runtime.tensor_parallel import BLOCK_PLANS
    from hrlplan.validate import check_values

    arch = {**asdict(_Qwen3ArchConfig()), "num_hidden_layers": 4}
    assert registry.family_of(arch) is qwen3 and registry.by_schema_option()["qwen3_schema"] is qwen3
    register_configs()
    assert ConfigStore.instance().load("arch/qwen3_schema.yaml").node.model_type == "qwen3"
    config = compose(["arch=llama-tiny"])
    with pytest.raises(ConfigError, match="arch.head_dim"):
        check_values({**config, "arch": {**arch, "head_dim": 0}})
    with pytest.raises(ConfigError, match="unknown key arch.rope_scaling"):
        check_values({**config, "arch": {**arch, "rope_scaling": 2.0}})
    check_values({**config, "arch": arch})
    settings = planner_settings(typed({**config, "arch": arch}), qwen3)
    assert settings["max_tp"] == config["planner"]["max_tp"] and qwen3.tp_plan in BLOCK_PLANS
    assert qwen3.trainer in TRAINERS
