"""The optimizer transforms (modopt/transforms/optimizers.py) against torch itself: SGD, Adam, AdamW,
`TorchOptimizer`, schedulers, and `ClipNorm` + `Adam` bit for bit with torch's clip-then-fused-Adam loop.
(ClipNorm against `clip_grad_norm_`: tests/test_clipping.py.)"""

from __future__ import annotations


import pytest
import torch

import modopt as mo


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def two_groups(model, lr=(1e-2, 3e-2), wd=(0.0, 1e-2)):
    params = list(model.parameters())
    return [
        {"params": params[:2], "lr": lr[0], "weight_decay": wd[0]},
        {"params": params[2:], "lr": lr[1], "weight_decay": wd[1]},
    ]


def run(model, opt, data, scheduler=None):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


# --- clip_grad_norm_ ---------------------------------------------------------


# --- optimizers: trajectories ---------------------------------------------------

CASES = [
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05), lambda: mo.SGD(lr=0.05)),
    ("sgd_momentum", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
     lambda: mo.SGD(lr=0.05, momentum=0.9, dampening=0.1)),
    ("sgd_nesterov_wd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
     lambda: mo.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda: mo.Adam(lr=1e-2)),
    ("adam_wd_amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True),
     lambda: mo.Adam(lr=1e-2, weight_decay=1e-2, amsgrad=True)),
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99)), lambda: mo.AdamW(lr=1e-2, betas=(0.8, 0.99))),
    ("adamw_amsgrad", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
     lambda: mo.AdamW(lr=1e-2, weight_decay=0.1, amsgrad=True)),
]


@pytest.mark.parametrize("name,torch_opt,mo_opt", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("layout", ["one_group", "two_groups"])
@pytest.mark.parametrize("fused_path", [True, False], ids=["last", "followed"])
def test_optimizer_trajectory_matches_torch(name, torch_opt, mo_opt, layout, fused_path):
    """120 steps; with two param groups that differ in lr and weight decay; as the last
    transform (fused write) and followed by Identity (the update path)."""
    ma, mb = make_model(), make_model()
    data = batches(120)
    if layout == "one_group":
        pa, pb = ma.parameters(), mb.parameters()
    else:
        wd = (0.0, 1e-2) if "sgd" in name or "adam" in name else (0.0, 0.0)
        pa, pb = two_groups(ma, wd=wd), two_groups(mb, wd=wd)
    ta = torch_opt(pa)
    chain = [mo_opt()] if fused_path else [mo_opt(), mo.Identity()]
    tb = mo.Modular(pb, *chain)
    la = run(ma, ta, data)
    lb = run(mb, tb, data)
    assert_same_params(ma, mb, rtol=1e-5, atol=1e-5)  # float32 rounding accumulated over 120 steps
    assert abs(la[-1] - lb[-1]) <= 1e-5 * max(1.0, abs(la[-1]))


def test_torch_optimizer_transform_matches_torch():
    ma, mb = make_model(), make_model()
    data = batches(60)
    ta = torch.optim.RMSprop(ma.parameters(), lr=1e-2, alpha=0.9)
    tb = mo.Modular(mb.parameters(), mo.TorchOptimizer(torch.optim.RMSprop, lr=1e-2, alpha=0.9))
    run(ma, ta, data)
    run(mb, tb, data)
    assert_same_params(ma, mb, rtol=0, atol=0)


def test_clip_then_adam_matches_hand_written_torch():
    ma, mb = make_model(), make_model()
    data = batches(100)
    ta = torch.optim.Adam(ma.parameters(), lr=1e-2)
    tb = mo.Modular(mb.parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2))
    for x, y in data:
        ta.zero_grad()
        loss_fn(ma, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ma.parameters(), 0.5)
        ta.step()
        tb.zero_grad()
        loss_fn(mb, x, y).backward()
        tb.step()
    assert_same_params(ma, mb, rtol=2e-5, atol=2e-6)


# --- schedulers -------------------------------------------------------------------

SCHEDULERS = [
    ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5)),
    ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30)),
    ("onecycle", lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=60)),
]


@pytest.mark.parametrize("name,make_sched", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_schedulers_drive_modular_like_torch_adam(name, make_sched):
    ma, mb = make_model(), make_model()
    data = batches(60)
    ta = torch.optim.Adam(ma.parameters(), lr=1e-2)
    tb = mo.Modular(mb.parameters(), mo.ClipNorm(10.0, eps=1e-6), mo.Adam(lr=1e-2))
    sa, sb = make_sched(ta), make_sched(tb)
    lrs_a, lrs_b, betas_a, betas_b = [], [], [], []
    for x, y in data:
        for opt, model in ((ta, ma), (tb, mb)):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            if opt is ta:
                torch.nn.utils.clip_grad_norm_(ma.parameters(), 10.0)
            opt.step()
        sa.step()
        sb.step()
        lrs_a.append(ta.param_groups[0]["lr"])
        lrs_b.append(tb.param_groups[0]["lr"])
        betas_a.append(ta.param_groups[0]["betas"][0])
        betas_b.append(tb.param_groups[0]["betas"][0])
    assert lrs_a == lrs_b
    assert betas_a == betas_b
    if name == "onecycle":
        assert len(set(betas_b)) > 1  # momentum cycling really happened
    assert_same_params(ma, mb, rtol=2e-5, atol=2e-6)


def test_onecycle_momentum_cycling_with_sgd():
    ma, mb = make_model(), make_model()
    ta = torch.optim.SGD(ma.parameters(), lr=0.01, momentum=0.9)
    tb = mo.Modular(mb.parameters(), mo.SGD(lr=0.01, momentum=0.9))
    sa = torch.optim.lr_scheduler.OneCycleLR(ta, max_lr=0.1, total_steps=30)
    sb = torch.optim.lr_scheduler.OneCycleLR(tb, max_lr=0.1, total_steps=30)
    for x, y in batches(30):
        for opt, model, s in ((ta, ma, sa), (tb, mb, sb)):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
            s.step()
        assert ta.param_groups[0]["momentum"] == tb.param_groups[0]["momentum"]
    assert_same_params(ma, mb, rtol=2e-5, atol=2e-6)


def test_per_group_override_of_optimizer_hyperparameters():
    ma, mb = make_model(), make_model()
    pa = [{"params": list(ma.parameters())[:2], "betas": (0.5, 0.9)}, {"params": list(ma.parameters())[2:]}]
    pb = [{"params": list(mb.parameters())[:2], "betas": (0.5, 0.9)}, {"params": list(mb.parameters())[2:]}]
    ta = torch.optim.Adam(pa, lr=1e-2)
    tb = mo.Modular(pb, mo.Adam(lr=1e-2))
    data = batches(40)
    run(ma, ta, data)
    run(mb, tb, data)
    assert_same_params(ma, mb, rtol=2e-5, atol=2e-6)


def test_default_clipnorm_adam_follows_torch_bit_for_bit():
    """The default pipeline users write equals the careful torch loop exactly, over a run:
    `clip_grad_norm_(ps, 1.0, foreach=True)` + `if n.isfinite(): adam_fused.step()` (the clip scale is
    multiplied into the gradients as torch does, not folded into the fused kernel's grad_scale)."""
    import copy

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    m1 = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.nn.Linear(32, 4))
    m2 = copy.deepcopy(m1)
    opt = mo.Modular(m1.parameters(), mo.ClipNorm(1.0), mo.Adam())
    ref = torch.optim.Adam(m2.parameters(), fused=True)
    g = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(30):
        x = torch.randn(4, 8, 32, generator=g) * 3.0
        for model, o in ((m1, opt), (m2, ref)):
            o.zero_grad()
            model(x).square().mean().mul(50.0).backward()
        opt.step()
        n = torch.nn.utils.clip_grad_norm_(list(m2.parameters()), 1.0, foreach=True)
        clipped += int(n > 1.0)
        if n.isfinite():
            ref.step()
    assert clipped > 10  # the clip bites on most steps
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
