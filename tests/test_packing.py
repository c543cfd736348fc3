"""Document packing keeps documents apart, and the cost-aware dispatch never drops or duplicates one.

The model tests run a small GPT-2 built by hrlplan's construction path, called directly with the 4-D
block-diagonal mask and restarting positions (the stage forward's own packed path, which carries them
through a pipeline, is tested in tests/test_packed_training.py).
"""
import dataclasses
import functools
import itertools
import random

import pytest
import torch

from hrlplan.data import dispatch as D
from hrlplan.data.packing import (IGNORE_INDEX, PAD_DOCUMENT, PackedDocuments, additive_attention_mask,
                                  block_causal_mask, document_lengths, document_pieces, next_fit, pack_micro_batches,
                                  predictions, split_documents, token_weighted_loss)

EOT = 1


def _documents(lengths, seed=0, vocab=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(2, vocab, (n - 1,), generator=g), torch.tensor([EOT])]) for n in lengths]


# ---------------------------------------------------------------- packing
def test_split_documents_keeps_every_token_and_ends_after_each_eot():
    stream = torch.tensor([5, 6, EOT, 7, EOT, EOT, 8, 9, 10, EOT, 11, 12])
    docs = split_documents(stream, EOT)
    # the lone EOT (one token, no prediction) is left out; the tail without one is a document
    assert [d.tolist() for d in docs] == [[5, 6, EOT], [7, EOT], [8, 9, 10, EOT], [11, 12]]


def test_long_document_pieces_make_each_prediction_once():
    doc = torch.arange(23)
    pieces = document_pieces(doc, token_budget=8)
    assert [predictions(p) for p in pieces] == [8, 8, 6]
    pairs = [(int(a), int(b)) for p in pieces for a, b in zip(p[:-1], p[1:])]
    assert pairs == [(i, i + 1) for i in range(22)]


def test_pack_marks_padding_restarts_positions_and_refuses_bad_assignments():
    docs = _documents([4, 3, 6])
    batch = pack_micro_batches(docs, [[0, 1], [2]], token_budget=6, pad_id=0)
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]
    assert batch.doc_ids.tolist() == [[0, 0, 0, 1, 1, PAD_DOCUMENT], [2, 2, 2, 2, 2, PAD_DOCUMENT]]
    assert batch.targets[:, -1].tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    assert batch.useful_tokens == 3 + 2 + 5
    assert document_lengths(batch.doc_ids) == [[3, 2], [5]]
    with pytest.raises(ValueError, match="exactly once"):
        pack_micro_batches(docs, [[0, 1], [1, 2]], token_budget=6)
    with pytest.raises(ValueError, match="exactly once"):
        pack_micro_batches(docs, [[0], [2]], token_budget=6)
    with pytest.raises(ValueError, match="overflows"):
        pack_micro_batches(docs, [[0, 2], [1]], token_budget=6)


def test_mask_keeps_documents_apart():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, PAD_DOCUMENT]])
    mask = block_causal_mask(doc_ids)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_next_fit_takes_arrival_order_until_the_step_is_full():
    assignment, taken = next_fit([3, 4, 2, 5, 6, 1], micro_batches=2, token_budget=8)
    assert (assignment, taken) == ([[0, 1], [2, 3]], 4)
    with pytest.raises(ValueError, match="more than the 8-token budget"):
        next_fit([9], micro_batches=1, token_budget=8)


def test_document_and_balanced_packing_hold_the_same_documents():
    lengths = [random.Random(1).choice([3, 5, 9, 17, 30]) for _ in range(200)]
    stream = torch.cat(_documents(lengths))
    common = dict(train=stream, val=stream, eot_id=EOT, token_budget=32, seed=3)
    document = PackedDocuments(**common, packing="document")
    balanced = PackedDocuments(**common, packing="balanced",
                               dispatcher=functools.partial(D.dispatch, linear=1.0, quadratic=0.1, fixed_shapes=True))
    for step in range(3):
        a, b = document.batch(step, micro_batches=4), balanced.batch(step, micro_batches=4)
        assert a.inputs.shape == b.inputs.shape == (4, 32)
        assert a.useful_tokens == b.useful_tokens

        def pairs(batch):
            keep = batch.targets != IGNORE_INDEX
            return sorted(zip(batch.inputs[keep].tolist(), batch.targets[keep].tolist()))
        assert pairs(a) == pairs(b)
    with pytest.raises(ValueError, match="needs a dispatcher"):
        PackedDocuments(**common, packing="balanced")
    with pytest.raises(ValueError, match="concat"):
        PackedDocuments(**common, packing="concat")


# ---------------------------------------------------------------- dispatch
def _brute_force(lengths, bins, linear, quadratic, stages=None):
    """Every assignment tried: the slowest micro-batch, or the slowest replica's pipeline step
    (sum + (stages - 1) * slowest) / stages of its micro-batches' times."""
    works = [D.document_cost(n, linear, quadratic) for n in lengths]
    best = float("inf")
    for choice in itertools.product(range(len(bins)), repeat=len(lengths)):
        used, load = [0] * len(bins), [0.0] * len(bins)
        for i, b in enumerate(choice):
            used[b] += lengths[i]
            load[b] += works[i]
        if not all(u <= b.capacity for u, b in zip(used, bins)):
            continue
        times = [(b.base_work + x) / b.speed for x, b in zip(load, bins)]
        if stages is None:
            value = max(times)
        else:
            value = max((sum(t for t, b in zip(times, bins) if b.replica == r)
                         + (stages - 1) * max(t for t, b in zip(times, bins) if b.replica == r)) / stages
                        for r in {b.replica for b in bins})
        best = min(best, value)
    return best


def _tiny_instances(count=25):
    rng = random.Random(7)
    for _ in range(count):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
        speeds = [rng.choice([1.0, 1.0, 2.0]) for _ in range(rng.randint(1, 2))]
        capacities = [rng.randint(max(lengths), 2 * max(lengths) + 20) for _ in speeds]
        bins = D.replica_bins(rng.randint(1, 2), capacities, speeds)
        yield lengths, bins


def _held_once(assignment, n):
    return sorted(i for group in assignment for i in group) == list(range(n))


@pytest.mark.parametrize("stages,fixed_shapes", [(None, False), (1, False), (2, False), (4, False), (None, True),
                                                 (2, True)])
def test_ilp_finds_the_brute_force_optimum_on_tiny_instances(stages, fixed_shapes):
    solved = 0
    for lengths, bins in _tiny_instances():
        if fixed_shapes:   # the reference: each bin's budget costs its linear work, pieces their attention
            reference = [dataclasses.replace(b, base_work=1.0 * b.capacity) for b in bins]
            optimum = _brute_force(lengths, reference, 0.0, 0.05, stages)
        else:
            optimum = _brute_force(lengths, bins, 1.0, 0.05, stages)
        if optimum == float("inf"):
            continue
        # a generous budget: these solve in milliseconds
        result = D.dispatch_bins(lengths, bins, 1.0, 0.05, time_budget_s=30.0, stages=stages,
                                 fallback=_some_feasible(lengths, bins), fixed_shapes=fixed_shapes)
        assert _held_once(result.assignment, len(lengths))
        assert result.step_time == pytest.approx(optimum, rel=1e-9)
        assert result.lower_bound <= optimum * (1 + 1e-9)
        solved += 1
    assert solved >= 15


def _some_feasible(lengths, bins):
    for choice in itertools.product(range(len(bins)), repeat=len(lengths)):
        used = [0] * len(bins)
        for i, b in enumerate(choice):
            used[b] += lengths[i]
        if all(u <= b.capacity for u, b in zip(used, bins)):
            return [[i for i, c in enumerate(choice) if c == b] for b in range(len(bins))]
    return None


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_within_grahams_bound(seed):
    rng = random.Random(seed)
    for _ in range(10):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(2, 8))]
        m = rng.randint(2, 3)
        bins = D.micro_batch_bins(m, sum(lengths))   # capacity that never binds
        works = [D.document_cost(n, 1.0, 0.02) for n in lengths]
        assignment = D.lpt(lengths, works, bins)
        assert _held_once(assignment, len(lengths))
        greedy = max(D.bin_times(assignment, works, bins))
        assert greedy <= (4 / 3 - 1 / (3 * m)) * _brute_force(lengths, bins, 1.0, 0.02) + 1e-9


def test_dispatch_never_drops_or_duplicates_and_balances_better_than_arrival_order():
    rng = random.Random(11)
    lengths = [rng.choice([8, 16, 40, 200, 600, 1000]) for _ in range(300)]
    arrival, taken = next_fit(lengths, micro_batches=16, token_budget=2048)
    lengths = lengths[:taken]
    for linear, quadratic, budget in ((1.0, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.5, 5.0)):
        result = D.dispatch_bins(lengths, D.micro_batch_bins(16, 2048), linear, quadratic, time_budget_s=budget,
                                 fallback=arrival)
        assert _held_once(result.assignment, len(lengths))
        D.check_assignment(result.assignment, lengths, D.micro_batch_bins(16, 2048))
        works = [D.document_cost(n, linear, quadratic) for n in lengths]
        assert result.slowest <= max(D.bin_times(arrival, works, D.micro_batch_bins(16, 2048)))
    # two replicas of a 2-stage pipeline, the second twice as fast with twice the sequence length
    bins = D.replica_bins(8, [2048, 4096], [1.0, 2.0])
    replicas = D.dispatch_bins(lengths, bins, 1.0, 0.5, time_budget_s=0.0, stages=2, fallback=arrival)
    D.check_assignment(replicas.assignment, lengths, bins)
    assert replicas.step_time >= replicas.lower_bound


def test_dispatch_uses_the_fallback_when_capacity_defeats_the_greedy():
    # LPT puts the 3s apart, then the 2s leave one token in each bin for the last 2; {3, 3} {2, 2, 2} fits
    lengths, bins = [3, 3, 2, 2, 2], D.micro_batch_bins(2, 6)
    assert D.lpt(lengths, [float(n) for n in lengths], bins) is None
    result = D.dispatch_bins(lengths, bins, 1.0, 0.0, time_budget_s=0.0, fallback=[[0, 1], [2, 3, 4]])
    assert result.method == "fallback" and result.assignment == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="no fallback"):
        D.dispatch_bins(lengths, bins, 1.0, 0.0, time_budget_s=0.0)


def test_a_steps_dispatch_finishes_within_its_budget():
    """A step large enough for the integer program and hard for it (many similar pieces): HiGHS stops
    at the time budget with a valid assignment. The bound checked is generous (the budget plus a
    fixed allowance for building the model), not a race between processes."""
    rng = random.Random(5)
    lengths = [rng.randint(20, 200) for _ in range(120)]
    bins = D.micro_batch_bins(8, 4096)
    budget = 1.0
    result = D.dispatch_bins(lengths, bins, 1.0, 0.01, time_budget_s=budget, max_ilp_variables=10_000)
    assert result.method in ("ilp-optimal", "ilp-time-limit", "greedy", "greedy-optimal")
    assert _held_once(result.assignment, len(lengths))
    assert result.seconds < budget + 10.0
    # too large for the integer program: the greedy alone, no solver
    big = D.dispatch_bins(lengths * 10, D.micro_batch_bins(64, 4096), 1.0, 0.01, time_budget_s=budget,
                          max_ilp_variables=4000)
    assert big.method == "greedy" and _held_once(big.assignment, len(lengths) * 10)


def test_replica_bins_take_each_replicas_length_and_speed():
    bins = D.replica_bins(2, capacities=[64, 128], speeds=[1.0, 2.0])
    assert [(b.capacity, b.speed, b.replica) for b in bins] == [(64, 1.0, 0), (64, 1.0, 0), (128, 2.0, 1),
                                                                (128, 2.0, 1)]
    with pytest.raises(ValueError, match="positive"):
        D.replica_bins(1, [64], [0.0])
    lengths = [100, 90, 30, 20, 10]
    result = D.dispatch_bins(lengths, bins, 1.0, 0.0, time_budget_s=10.0)
    assert all(lengths[i] <= 64 for b, group in zip(bins, result.assignment) if b.replica == 0 for i in group)
    assert result.slowest == pytest.approx(_brute_force(lengths, bins, 1.0, 0.0))
    # the pipeline objective balances the replicas' sums too
    piped = D.dispatch_bins(lengths, bins, 1.0, 0.0, time_budget_s=10.0, stages=2)
    assert piped.step_time == pytest.approx(_brute_force(lengths, bins, 1.0, 0.0, stages=2))


# ---------------------------------------------------------------- the model: packed equals on its own
def _gpt2(seed=0, **extra):
    from hrlplan.models.hf import build_hf_model, hf_config_from_arch

    arch = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **extra)
    torch.manual_seed(seed)
    model = build_hf_model(hf_config_from_arch(arch)).double()
    return model.eval()


def _packed_loss(model, batch, step_tokens):
    out = model(input_ids=batch.inputs, attention_mask=batch.attention_mask(), position_ids=batch.positions)
    return token_weighted_loss(out.logits, batch.targets, step_tokens)


def test_packed_loss_and_gradients_equal_each_document_on_its_own():
    docs = _documents([5, 9, 3, 12, 7, 2, 16], seed=1)
    lengths = [predictions(d) for d in docs]
    assignment, taken = next_fit(lengths, micro_batches=4, token_budget=16)
    assert taken == len(docs)
    packed_model, alone_model = _gpt2(), _gpt2()
    step = pack_micro_batches(docs, assignment, token_budget=16, pad_id=7)
    # micro-batch by micro-batch, as a pipeline runs them, each scaled by the step's useful tokens
    loss = sum(_packed_loss(packed_model, pack_micro_batches(
        [docs[i] for i in group], [list(range(len(group)))], 16, pad_id=7), step.useful_tokens)
        for group in assignment)
    loss.backward()
    total = sum(lengths)
    assert step.useful_tokens == total
    alone = sum(token_weighted_loss(alone_model(input_ids=d[None, :-1]).logits, d[None, 1:], total) for d in docs)
    alone.backward()
    assert loss.item() == pytest.approx(alone.item(), rel=1e-10)
    for (name, a), (_, b) in zip(packed_model.named_parameters(), alone_model.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-8, atol=1e-12), name
    # the padding's token ids do not matter
    repadded = pack_micro_batches(docs, assignment, token_budget=16, pad_id=3)
    with torch.no_grad():
        assert _packed_loss(packed_model, repadded, total).item() == pytest.approx(
            _packed_loss(packed_model, step, total).item(), rel=1e-12)


def test_a_tokens_loss_does_not_depend_on_another_documents_tokens():
    docs = _documents([6, 5, 8], seed=2)
    batch = pack_micro_batches(docs, [[0, 1, 2]], token_budget=20, pad_id=0)
    model = _gpt2()
    embeds = model.get_input_embeddings()(batch.inputs).detach().requires_grad_(True)

    def token_loss_grad(mask):
        out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=batch.positions)
        q = 8   # a token of document 1 (positions 5..8)
        assert batch.doc_ids[0, q] == 1
        loss = torch.nn.functional.cross_entropy(out.logits[0, q], batch.targets[0, q])
        (grad,) = torch.autograd.grad(loss, embeds)
        return grad[0].abs().sum(-1)

    per_token = token_loss_grad(batch.attention_mask())
    own = batch.doc_ids[0] == 1
    assert (per_token[~own] == 0).all()              # no other document, no padding
    assert (per_token[own][:4] > 0).all()            # its own earlier tokens do matter
    # the same check without the mask fails: the test can tell
    unmasked = token_loss_grad(None)
    assert (unmasked[batch.doc_ids[0] == 0] > 0).all()


def _stage_forward(stage, x, positions, doc_ids, mask_of):
    """What HFStage._forward needs to become for packed documents: positions and the document ids come
    in as keyword arguments (torch pipelining hands a step's kwargs, split by micro-batch, to every
    stage), the first stage embeds at the restarting positions, every block gets the mask."""
    base = stage.base
    h = base.drop(base.wte(x) + base.wpe(positions)) if stage.first else x
    mask = mask_of(doc_ids)
    for block in getattr(base, stage.blocks_attr).values():
        out = block(h, attention_mask=mask)
        h = out[0] if isinstance(out, tuple) else out
    return stage.lm_head(base.ln_f(h)) if stage.last else h


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_pipeline_stages_given_the_document_ids_equal_the_whole_model(attention):
    from hrlplan.models.hf import build_stage_modules

    docs = _documents([5, 9, 3, 12, 7], seed=3)
    batch = pack_micro_batches(docs, [[0, 1, 2], [3, 4]], token_budget=20, pad_id=0)
    whole = _gpt2(attn_implementation=attention)
    staged = _gpt2(attn_implementation=attention)
    stages = build_stage_modules(staged, [(0, 1), (1, 2)])
    # SDPA takes the boolean mask, eager attention adds it to the scores
    mask_of = block_causal_mask if attention == "sdpa" else functools.partial(additive_attention_mask,
                                                                              dtype=torch.float64)
    h = batch.inputs
    for stage in stages:
        h = _stage_forward(stage, h, batch.positions, batch.doc_ids, mask_of)
    staged_loss = token_weighted_loss(h, batch.targets)
    staged_loss.backward()
    # HF passes a 4-D mask through as it is: eager attention given the boolean one would add 1 / 0
    out = whole(input_ids=batch.inputs, attention_mask=mask_of(batch.doc_ids), position_ids=batch.positions)
    whole_loss = token_weighted_loss(out.logits, batch.targets)
    whole_loss.backward()
    assert staged_loss.item() == pytest.approx(whole_loss.item(), rel=1e-10)
    grads = dict(whole.named_parameters())
    for name, param in staged.named_parameters():
        assert torch.allclose(param.grad, grads[name].grad, rtol=1e-8, atol=1e-12), name


class _DocumentStage(torch.nn.Module):
    """A stage whose forward takes the step's positions and document ids as keyword arguments."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x, positions, doc_ids):
        return _stage_forward(self.stage, x, positions, doc_ids, block_causal_mask)


def _pipeline_worker(rank, port, out, docs, assignment, budget):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hrlplan.models.hf import build_stage_modules

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _gpt2(tie_word_embeddings=False)
        stage = build_stage_modules(model, [(0, 1), (1, 2)])[rank]
        # every rank builds the step's batch (the data are a pure function of the step); the first stage
        # takes the tokens, every stage the positions and document ids of the micro-batch it runs
        batch = pack_micro_batches(docs, assignment, budget, pad_id=0)
        step_tokens = batch.useful_tokens
        pipe = PipelineStage(_DocumentStage(stage), rank, 2, torch.device("cpu"))
        # each micro-batch's loss is already divided by the step's useful tokens: the schedule must not
        # divide the gradients by the number of micro-batches as well (its default)
        schedule = Schedule1F1B(pipe, n_microbatches=len(assignment), scale_grads=False,
                                loss_fn=lambda logits, targets: token_weighted_loss(logits, targets, step_tokens))
        sides = dict(positions=batch.positions, doc_ids=batch.doc_ids)
        losses = []
        if rank == 0:
            schedule.step(batch.inputs, **sides)
        else:
            schedule.step(target=batch.targets, losses=losses, **sides)
        torch.save({"grads": {n: p.grad for n, p in stage.named_parameters()},
                    "loss": float(sum(loss.detach() for loss in losses)) if losses else None}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_two_stage_pipeline_carrying_document_ids_equals_one_process(tmp_path, free_port):
    """torch.distributed.pipelining (1F1B, 4 micro-batches, gloo): the document ids and positions go to
    every stage as the schedule's keyword arguments; loss and gradients equal the whole model's."""
    import torch.multiprocessing as mp

    docs = _documents([5, 9, 3, 12, 7, 2, 14, 4], seed=4)
    assignment, taken = next_fit([predictions(d) for d in docs], micro_batches=4, token_budget=16)
    assert taken == len(docs)
    # spawn, not fork: this process has run OpenMP (the model tests above), and a forked child's first
    # parallel region can hang on the copied thread pool
    mp.start_processes(_pipeline_worker, args=(free_port, str(tmp_path), docs, assignment, 16), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    model = _gpt2(tie_word_embeddings=False)
    batch = pack_micro_batches(docs, assignment, 16, pad_id=0)
    loss = _packed_loss(model, batch, batch.useful_tokens)
    loss.backward()
    assert ranks[1]["loss"] == pytest.approx(loss.item(), rel=1e-10)
    grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-8, atol=1e-12), name


def test_the_pipeline_refinement_checks_its_deadline_before_every_move(monkeypatch):
    """A step_of call may be a whole simulated step and a pass makes O(n^2) moves: the local search
    stops at the deadline between moves, not only between passes (one step's dispatch took 626 ms
    against a 0.5 s budget). A fake clock advanced by each step_of call: no timing in the test."""
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(D, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    def step_of(times, bins):
        calls.append(1)
        clock[0] += 0.01
        return 3.0 * max(times) + sum(times)

    rng = random.Random(7)
    lengths = [rng.randint(10, 400) for _ in range(40)]
    bins = D.micro_batch_bins(6, 4096)
    works = [D.document_cost(n, 1.0, 0.01) for n in lengths]
    start = D.lpt(lengths, works, bins, None)
    out = D.refine_for_step(lengths, works, bins, start, step_of, deadline=0.1)
    assert len(calls) <= 11   # the first evaluation, then one move per 0.01 s until 0.1
    D.check_assignment(out, lengths, bins)
    assert _held_once(out, len(lengths))
