"""The non-finite policy of Modular, with the stateful module families in the pipeline."""

from __future__ import annotations

import pytest
import torch

import modopt as mo


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def pipeline():
    return [
        mo.Accumulate(2),
        mo.ClipNormByEMA(),
        mo.HistClip(warmup_steps=3),
        mo.ZClip(warmup_steps=3, max_grad_norm=None, scope="tensor"),
        mo.AutoClip(window=6),
        mo.ClipNormGrowth(),
        mo.ClipValueGrowth(),
        mo.ClipValueByEMA(ema_init="update"),
        mo.NormalizeByEMA(),
        mo.Adam(lr=1e-2),
    ]


def set_grads(m, k, poison=False):
    g = torch.Generator().manual_seed(k)
    for i, p in enumerate(m.parameters()):
        p.grad = torch.randn(p.shape, generator=g) * (1 + 10 * (k == 7))
        if poison and i == 2:
            p.grad.view(-1)[0] = float("inf")


def flat_state(opt):
    sd = opt.state_dict()
    out = {}
    for idx, s in sd["state"].items():
        for k, v in s.items():
            out[f"p{idx}.{k}"] = v
    for key, s in sd["modopt"]["transforms"].items():
        for k, v in s.items():
            out[f"{key}.{k}"] = v
    return out


def run(inject_at=None, policy="skip", calls=1):
    m = model()
    opt = mo.Modular(m.parameters(), *pipeline(), nonfinite=policy)
    for k in range(20):
        if k == inject_at:
            for _ in range(calls):
                set_grads(m, 999, poison=True)
                opt.step()
                assert bool(opt.stats["skipped"])
        set_grads(m, k)
        opt.step()
    return m, opt


def test_skip_leaves_params_and_every_state_as_without_the_step():
    """A whole Accumulate(2) cycle of skipped calls (every call counts in the cycle, skipped or not,
    so one skipped call alone would move the cycle) leaves everything as without it."""
    ma, oa = run()
    mb, ob = run(inject_at=10, calls=2)
    for x, y in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(x, y)
    sa, sb = flat_state(oa), flat_state(ob)
    assert sa.keys() == sb.keys() and len(sa) > 20
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
        else:
            assert sa[k] == sb[k], k
    assert int(oa.stats["skipped_steps"]) == 0 and int(ob.stats["skipped_steps"]) == 2
    assert int(ob.state_dict()["modopt"]["skipped_steps"]) == 2


def test_skip_counts_every_skipped_step():
    m = model()
    opt = mo.Modular(m.parameters(), mo.ClipNorm(1.0), mo.SGD(lr=0.1))
    for k in range(3):
        set_grads(m, k, poison=True)
        opt.step()
    assert int(opt.stats["skipped_steps"]) == 3


def test_raise_names_the_parameter():
    m = model()
    opt = mo.Modular(m.named_parameters(), mo.ClipNormByEMA(), mo.SGD(lr=0.1), nonfinite="raise")
    set_grads(m, 0, poison=True)
    with pytest.raises(FloatingPointError, match=r"2\.weight"):
        opt.step()


def test_zero_policy_equals_zeroing_the_gradient_first():
    ma, mb = model(), model()
    oa = mo.Modular(ma.parameters(), mo.HistClip(warmup_steps=2), mo.SGD(lr=0.1), nonfinite="zero")
    ob = mo.Modular(mb.parameters(), mo.HistClip(warmup_steps=2), mo.SGD(lr=0.1), nonfinite="ignore")
    for k in range(5):
        set_grads(ma, k, poison=True)
        set_grads(mb, k, poison=True)
        for p in mb.parameters():
            p.grad = torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        oa.step()
        ob.step()
    for x, y in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(x, y)
