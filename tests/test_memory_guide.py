"""`hrlplan memory-guide` and the HRM memory model it rests on, checked against measured peaks on the CPU."""
import pytest
import torch

from hrlplan.memory_guide import GiB, hrm_fit, main
from hrlplan.models.hrm import build_hrm, estimate_hrm_memory, introspect_hrm
from hrlplan.optim import AdamATan2
from hrlplan.runtime.memory import LiveStorageTracker, saved_activation_bytes

SMALL = dict(hidden_size=64, H_layers=2, L_layers=2, num_heads=2, expansion=2, puzzle_emb_ndim=64,
             forward_dtype="float32", halt_max_steps=4)
WIDER = dict(hidden_size=128, H_layers=1, L_layers=2, num_heads=4, expansion=4, puzzle_emb_ndim=128,
             forward_dtype="float32", halt_max_steps=4)


def measured_hrm_peak(arch, batch, seq_len=32, vocab=11, ids=4):
    """HRM's training step (ACT segment, one-step gradient, AdamATan2) on the CPU: live tensor bytes."""
    torch.manual_seed(0)
    model = build_hrm(arch, seq_len=seq_len, vocab_size=vocab, num_puzzle_identifiers=ids)
    opt = AdamATan2(model.parameters(), lr=1e-4)
    data = {"inputs": torch.randint(0, vocab, (batch, seq_len)), "labels": torch.randint(0, vocab, (batch, seq_len)),
            "puzzle_identifiers": torch.randint(0, ids, (batch,))}
    tracker = LiveStorageTracker("cpu", lambda: ([model], [opt]))
    tracker.track_tensors([*model.parameters(), *model.buffers()])
    carry = model.initial_carry(data)
    for _ in range(2):
        with tracker:
            carry, loss, _, _, _ = model(carry, data)
            (loss / batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.result()


@pytest.mark.parametrize("arch,batch", [(SMALL, 8), (WIDER, 8)])
def test_hrm_predicted_peak_within_10_percent(arch, batch):
    measured = measured_hrm_peak(arch, batch)
    est = estimate_hrm_memory(arch, batch, 1, 32, cuda=False)
    assert est["tensors"] == pytest.approx(measured["peak"], rel=0.10)
    assert est["weights"] == pytest.approx(measured["weights"], rel=0.05)
    assert est["optimizer"] == pytest.approx(measured["optimizer"], rel=0.05)


def test_hrm_block_activations_are_what_autograd_saves():
    meta = introspect_hrm(SMALL, 81)
    model = build_hrm(SMALL, seq_len=81, vocab_size=11, num_puzzle_identifiers=4)
    inner = model.model.inner
    tokens = 4 * meta.seq_len
    x = torch.randn(4, meta.seq_len, 64, requires_grad=True)
    kept = saved_activation_bytes(lambda: inner.L_level(x, torch.randn_like(x), inner.rotary_emb()),
                                  exclude=[*model.parameters(), *model.buffers()])
    per_block = kept / tokens / SMALL["L_layers"]
    assert meta.block_activation_bytes_per_token[0] == pytest.approx(per_block, rel=0.01)


def test_hrm_fit_grows_with_memory():
    small, big = hrm_fit({"hidden_size": 512, "H_layers": 4, "L_layers": 4, "expansion": 4}, 2 * GiB), \
        hrm_fit({"hidden_size": 512, "H_layers": 4, "L_layers": 4, "expansion": 4}, 40 * GiB)
    assert small["peak_bytes"] <= 2 * GiB and big["peak_bytes"] <= 40 * GiB
    assert (big["hidden_size"], big["H_layers"], big["global_batch_size"]) == (512, 4, 768)   # HRM's recipe
    assert small["hidden_size"] * small["H_layers"] < 512 * 4 or small["global_batch_size"] < 768
    assert hrm_fit({"hidden_size": 512}, 0.1 * GiB) is None   # the CUDA context alone is more


def test_memory_guide_cli_prints_every_size(capsys):
    main(["arch=hrm", "--memory-gib", "2,80"])
    out = capsys.readouterr().out
    assert "2.0 GiB" in out and "80.0 GiB" in out and "768" in out


def test_memory_guide_for_a_language_model_plan(tmp_path, capsys):
    from hrlplan.plan import homogeneous_plan

    plan = homogeneous_plan("gpt2-tiny", 6, [(0, 3), (3, 6)], dp=1, tp=1, microbatch_size=2, num_microbatches=4,
                            schedule="1f1b")
    plan.save(tmp_path / "plan.yaml")
    main(["arch=gpt2-tiny", "cluster=a100x8-1n", "planner=manual", f"planner.plan_file={tmp_path / 'plan.yaml'}"])
    out = capsys.readouterr().out
    assert "stage 0" in out and "stage 1" in out and "full: 8" in out
