"""AdamATan2 against the reference kernel's update written out by hand, element by element."""
import copy
import math

import pytest
import torch

from hrlplan.optim import AdamATan2


def _reference_steps(p0, grads, lr, betas, wd):
    """The adam-atan2 CUDA kernel's math (csrc/adam_atan2.cu), in Python floats."""
    b1, b2 = betas
    p, m, v = list(p0), [0.0] * len(p0), [0.0] * len(p0)
    for t, g in enumerate(grads, start=1):
        step_size, bc2_sqrt = lr / (1 - b1 ** t), math.sqrt(1 - b2 ** t)
        for i, gi in enumerate(g):
            p[i] *= 1 - lr * wd
            m[i] += (1 - b1) * (gi - m[i])
            v[i] += (1 - b2) * (gi * gi - v[i])
            p[i] -= step_size * math.atan2(m[i], math.sqrt(v[i]) / bc2_sqrt)
    return p, m, v


GRADS = [[0.5, -2.0, 0.0, 1e-8], [0.25, 3.0, 0.0, -1e-8], [-1.0, 0.5, 0.0, 2e-8]]
P0 = [1.0, -0.5, 0.25, 2.0]


@pytest.mark.parametrize("lr,wd", [(1e-4, 1.0), (1e-2, 0.1), (0.0, 0.1)])
def test_matches_the_reference_update_exactly_in_float64(lr, wd):
    p = torch.nn.Parameter(torch.tensor(P0, dtype=torch.float64))
    opt = AdamATan2([p], lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    for g in GRADS:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    want_p, want_m, want_v = _reference_steps(P0, GRADS, lr, (0.9, 0.95), wd)
    torch.testing.assert_close(p.detach(), torch.tensor(want_p, dtype=torch.float64), rtol=1e-14, atol=1e-15)
    state = opt.state[p]
    torch.testing.assert_close(state["exp_avg"], torch.tensor(want_m, dtype=torch.float64), rtol=1e-14, atol=1e-20)
    torch.testing.assert_close(state["exp_avg_sq"], torch.tensor(want_v, dtype=torch.float64), rtol=1e-14, atol=1e-30)
    assert state["step"].item() == len(GRADS)


def test_first_step_by_hand_and_no_epsilon():
    # Step 1: m = 0.1 g, sqrt(v)/sqrt(1 - b2) = |g|, so the move is lr / 0.1 * atan2(0.1 g, |g|)
    # whatever the gradient's scale (a 1e-8 gradient moves as far as a 0.5 one: no epsilon).
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = AdamATan2([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    p.grad = torch.tensor([0.5, 1e-8, 0.0], dtype=torch.float64)
    opt.step()
    move = 1e-3 / 0.1 * math.atan(0.1)
    assert p.detach().tolist() == pytest.approx([-move, -move, 0.0], rel=1e-15, abs=0)


def test_differs_from_adamw_and_from_the_scaled_variant():
    torch.manual_seed(0)
    w = torch.randn(64, dtype=torch.float64)
    grads = [torch.randn(64, dtype=torch.float64) for _ in range(3)]
    ours, adamw = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opts = [AdamATan2([ours], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
            torch.optim.AdamW([adamw], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)]
    for g in grads:
        for param, opt in zip((ours, adamw), opts):
            param.grad = g.clone()
            opt.step()
    assert (ours - adamw).abs().max() > 1e-4
    # adam-atan2-pytorch's default (1.27 * atan2(m_hat, sqrt(v_hat))) moves 1.27x further on step 1.
    g = grads[0]
    theirs_first = 1e-2 * 1.27 * torch.atan2(g, g.abs())
    ours_first = 1e-2 / 0.1 * torch.atan2(0.1 * g, g.abs())
    assert not torch.allclose(theirs_first, ours_first)


def test_bfloat16_params_update_through_float32():
    p32 = torch.nn.Parameter(torch.tensor(P0, dtype=torch.float32))
    p16 = torch.nn.Parameter(torch.tensor(P0, dtype=torch.bfloat16))
    opts = [AdamATan2([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1) for p in (p32, p16)]
    for g in GRADS:
        for p, opt in zip((p32, p16), opts):
            p.grad = torch.tensor(g, dtype=p.dtype)
            opt.step()
    want = torch.tensor(_reference_steps(P0, GRADS, 1e-2, (0.9, 0.95), 0.1)[0])
    torch.testing.assert_close(p32.detach().double(), want.double(), rtol=1e-6, atol=1e-7)
    assert p16.dtype == torch.bfloat16 and opts[1].state[p16]["exp_avg"].dtype == torch.bfloat16
    torch.testing.assert_close(p16.detach().double(), want.double(), rtol=1e-2, atol=1e-2)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.randn(5))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a = AdamATan2([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    grads = [torch.randn(5) for _ in range(4)]
    for g in grads[:2]:
        a.grad = g.clone()
        opt_a.step()
    b.data.copy_(a.detach())
    opt_b = AdamATan2([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))   # else both share buffers
    for g in grads[2:]:
        for p, opt in ((a, opt_a), (b, opt_b)):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(a, b)
