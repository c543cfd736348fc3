"""data.packing=document|balanced at run time: the stage forward keeps documents apart, the loss is
token-weighted over the step, a balanced step holds the documents a document step holds, and pp-2
training through torch pipelining equals one process (and, at the first step, each document alone)."""
import pytest
import torch

from hrlplan.data.packed_stream import PackedLMStream, StepLayout, build_packed_stream, to_wire
from hrlplan.data.packing_options import packing_refusal
from hrlplan.data.packing import (IGNORE_INDEX, PackedDocuments, next_fit, pack_micro_batches, predictions)
from hrlplan.errors import UserError
from hrlplan.models.documents import DOCUMENT_ATTENTION, document_spans
from hrlplan.models.hf import build_stage_modules, causal_lm_loss

EOT = 1


def _documents(lengths, seed=0, vocab=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(2, vocab, (n - 1,), generator=g), torch.tensor([EOT])]) for n in lengths]


def _gpt2(seed=0, attention="sdpa"):
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch

    arch = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attention)
    torch.manual_seed(seed)
    return build_hf_model(hf_config_from_arch(arch)).double().eval()


def _alone(model, docs, total):
    """Each document through the whole model on its own, its summed token loss over `total` tokens."""
    return sum(torch.nn.functional.cross_entropy(model(input_ids=d[None, :-1].long()).logits[0], d[1:].long(),
                                                 reduction="sum") for d in docs) / total


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_staged_packed_loss_and_gradients_equal_each_document_alone(attention):
    """Two stages, micro-batch by micro-batch as a pipeline runs them: the wire loss (scaled by rows over
    micro-batch rows, as torch's schedule divides by the micro-batches) equals each document alone."""
    docs = _documents([5, 9, 3, 12, 7, 2, 16], seed=1)
    assignment, taken = next_fit([predictions(d) for d in docs], micro_batches=4, token_budget=16)
    assert taken == len(docs)
    step = pack_micro_batches(docs, assignment, 16, pad_id=7)
    inputs, targets = to_wire(step, step.useful_tokens, 4)
    staged, alone = _gpt2(attention=attention), _gpt2(attention=attention)
    stages = build_stage_modules(staged, [(0, 1), (1, 2)])
    loss = sum(causal_lm_loss(stages[1](*stages[0](inputs[j:j + 1])), targets[j:j + 1]) for j in range(4)) / 4
    loss.backward()
    expected = _alone(alone, docs, step.useful_tokens)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)   # the loss itself sums in float32
    grads = dict(alone.named_parameters())
    for name, param in staged.named_parameters():
        assert torch.allclose(param.grad, grads[name].grad, rtol=1e-4, atol=1e-7), name   # float32 loss
    kinds = {m.config._attn_implementation for m in staged.modules() if type(m).__name__ == "GPT2Attention"}
    assert kinds == ({DOCUMENT_ATTENTION} if attention == "sdpa" else {"eager"})
    assert staged.config._attn_implementation == attention   # the model's own config is left alone


def test_a_tokens_loss_through_the_stage_does_not_depend_on_another_document():
    docs = _documents([6, 5, 8], seed=2)
    step = pack_micro_batches(docs, [[0, 1, 2]], token_budget=20, pad_id=0)
    inputs, targets = to_wire(step, step.useful_tokens, 1)
    stage = build_stage_modules(_gpt2(), [(0, 2)])[0]
    held = {}
    stage.base.wte.register_forward_hook(lambda mod, args, out: held.setdefault("embeds", out))
    q = 8   # a token of document 1
    assert step.doc_ids[0, q] == 1
    logits = stage(inputs)
    loss = torch.nn.functional.cross_entropy(logits[0, q], step.targets[0, q])
    (grad,) = torch.autograd.grad(loss, held["embeds"])
    per_token = grad[0].abs().sum(-1)
    own = step.doc_ids[0] == 1
    assert (per_token[~own] == 0).all()
    assert (per_token[own][:4] > 0).all()


def test_document_spans_cover_each_row_in_runs():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 3, 3, 3, 3, 3]])
    assert document_spans(doc_ids) == [[(0, 2, False), (2, 5, False), (5, 6, True)], [(0, 1, False), (1, 6, False)]]


def _corpus(n_docs=60, seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n_docs,), generator=g).tolist()
    return torch.cat(_documents(lengths, seed=seed))


def _pairs(inputs, targets, budget):
    """The step's (document-local position, token, target) triples, padding left out."""
    out = []
    for row_in, row_t in zip(inputs, targets[:, :budget]):
        for tok, pos, t in zip(row_in[0].tolist(), row_in[1].tolist(), row_t.tolist()):
            if t != IGNORE_INDEX:
                out.append((pos, tok, t))
    return sorted(out)


@pytest.mark.parametrize("layout", [None, StepLayout(replicas=2, micro_batches=2, rows_per_micro_batch=1, stages=2)])
def test_a_balanced_step_holds_exactly_the_documents_of_the_document_step(layout):
    tokens = _corpus()
    streams = {p: build_packed_stream(p, tokens, tokens, EOT, 48, seed=5, layout=layout)
               for p in ("document", "balanced")}
    for step in range(3):
        (di, dt), (bi, bt) = (streams[p].batch(step, 4) for p in ("document", "balanced"))
        assert _pairs(di, dt, 48) == _pairs(bi, bt, 48)   # none dropped, none duplicated
        assert dt[0, 48].item() == bt[0, 48].item() == sum(t != IGNORE_INDEX for t in dt[:, :48].flatten().tolist())
        assert (bt[:, 49] == 4).all()
    # decided ahead: after step s, the next steps' dispatch is already under way off the calling thread
    assert set(streams["balanced"]._ahead) == {3, 4}
    assert all(d["seconds"] < 10.0 for d in streams["balanced"].dispatches)
    streams["balanced"].close()


def test_validation_batches_are_packed_in_arrival_order():
    tokens = _corpus()
    stream = build_packed_stream("balanced", tokens, tokens, EOT, 48, seed=5)
    documents = PackedDocuments(tokens, tokens, EOT, 48, 5, "document")
    inputs, _ = stream.batch(0, 4, split="val")
    assert torch.equal(inputs[:, 0], documents.batch(0, 4, split="val").inputs)
    assert not stream._ahead   # nothing dispatched for validation


def test_refusals_are_one_line():
    assert packing_refusal("concat", "synthetic") is None
    for args in [("document", "synthetic"), ("balanced", "code", True)]:
        line = packing_refusal(*args)
        assert line.startswith(f"data.packing={args[0]}") and "\n" not in line
    from hrlplan.data.lm import build_lm_data

    with pytest.raises(UserError, match="data=synthetic has no documents"):
        build_lm_data({"name": "synthetic", "seq_len": 16, "packing": "document"}, 64, 0)


# ---------------------------------------------------------------- pp 2 through torch pipelining
def _config(packing, steps=2):
    from hrlplan.compose import compose

    return compose(["arch=gpt2-tiny", "arch.n_layer=2", "arch.vocab_size=4096", "arch.n_positions=128", "data=code",
                    "data.seq_len=128", f"data.packing={packing}", f"train.steps={steps}", "train.global_batch_size=4",
                    "train.schedule=1f1b", "train.checkpoint_interval=0", "train.measure_memory=false",
                    "logger.mode=disabled", "train.grad_clip=0"])


@pytest.mark.slow
def test_packed_pp2_training_equals_one_process_and_each_document_alone(tmp_path):
    from hrlplan.config import as_config
    from hrlplan.data.lm import build_lm_data
    from hrlplan.launch.local_run import train_plan
    from hrlplan.plan import homogeneous_plan
    from hrlplan.runtime.trainer import build_full_model

    losses, norms = {}, {}
    for name, spans in (("pp2", [(0, 1), (1, 2)]), ("one", [(0, 2)])):
        plan = homogeneous_plan("gpt2-tiny", 2, spans, dp=1, tp=1, microbatch_size=1, num_microbatches=4,
                                schedule="1f1b")
        summary = train_plan(plan, _config("balanced"), tmp_path / name, metrics_file=False)
        losses[name] = [h["train/lm_loss"] for h in summary["history"]]
        norms[name] = [h["train/grad_norm"] for h in summary["history"]]
    assert losses["pp2"] == pytest.approx(losses["one"], rel=1e-5)
    assert norms["pp2"] == pytest.approx(norms["one"], rel=1e-4)
    # the first step's loss, before any update: every document of step 0 alone through the whole model
    cfg = as_config(_config("document"))
    stream = build_lm_data(cfg.data, 4096, int(cfg.train.seed))
    pieces, _ = stream.documents.step_pieces(0, 4)
    model = build_full_model(cfg.arch, int(cfg.train.seed))
    expected = _alone(model, pieces, sum(predictions(p) for p in pieces))
    expected.backward()
    assert losses["pp2"][0] == pytest.approx(expected.item(), rel=1e-5)
    # the gradient's scale too (Adam would hide a wrong one in the losses): its norm at the first step
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert norms["pp2"][0] == pytest.approx(norm.item(), rel=1e-4)


def test_concat_rows_take_the_stage_path_of_before():
    """data.packing=concat: token ids [rows, seq] go through the unchanged forward, HF's own attention."""
    model = _gpt2()
    stage = build_stage_modules(model, [(0, 2)])[0]
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(stage(ids), model(input_ids=ids).logits)
    assert stage.attention_kind is None
    assert {m.config._attn_implementation for m in model.modules() if type(m).__name__ == "GPT2Attention"} == {"sdpa"}


def test_llama_stages_restart_rotary_positions_per_document():
    """RoPE at each token's position inside its document, grouped-query attention per document."""
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch

    arch = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = build_hf_model(hf_config_from_arch(arch)).double().eval()
    docs = _documents([5, 9, 3, 12, 7, 2, 16], seed=1)
    assignment, _ = next_fit([predictions(d) for d in docs], micro_batches=4, token_budget=16)
    step = pack_micro_batches(docs, assignment, 16, pad_id=7)
    inputs, targets = to_wire(step, step.useful_tokens, 4)
    stages = build_stage_modules(model, [(0, 1), (1, 2)])
    with torch.no_grad():
        loss = sum(causal_lm_loss(stages[1](*stages[0](inputs[j:j + 1])), targets[j:j + 1]) for j in range(4)) / 4
        assert loss.item() == pytest.approx(_alone(model, docs, step.useful_tokens).item(), rel=1e-6)


def test_a_plans_layout_lays_a_balanced_step_over_its_replicas_and_refuses_what_cannot_run(tmp_path):
    """build_lm_data given the plan (the trainer's call): rows replica-major, each replica's own
    micro-batches; context parallelism refused in one line (tensor-parallel stages run: test_packing_tp.py)."""
    from hrlplan.data.lm import build_lm_data
    from hrlplan.plan import homogeneous_plan

    data = {"name": "code", "path": "data/code", "seq_len": 128, "packing": "balanced"}
    plan = homogeneous_plan("gpt2-tiny", 2, [(0, 1), (1, 2)], dp=2, tp=1, microbatch_size=1, num_microbatches=2,
                            schedule="1f1b")
    stream = build_lm_data(data, 4096, 0, plan=plan)
    assert stream.layout == StepLayout(replicas=2, micro_batches=2, rows_per_micro_batch=1, stages=2)
    inputs, targets = stream.batch(0, 4)
    assert inputs.shape == (4, 3, 128) and targets.shape == (4, 130)
    decided = stream.dispatches[0]
    assert decided["lower_bound"] <= decided["step_time"] * (1 + 1e-9)
    stream.close()
    tp = homogeneous_plan("gpt2-tiny", 2, [(0, 1), (1, 2)], dp=1, tp=2, microbatch_size=1, num_microbatches=2,
                          schedule="1f1b")
    build_lm_data(data, 4096, 0, plan=tp).close()   # tensor-parallel stages take packed documents (test_packing_tp.py)
    with pytest.raises(UserError, match="context parallelism"):
        build_lm_data(data, 4096, 0, plan=tp, train={"context_parallel": 2})
