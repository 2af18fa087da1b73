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


@pytest.mark.parametrize("seed", range(4))
def test_small_tensors_are_cleaned_together_to_the_same_values(seed):
    """`Step.clean_`'s grouping (`runner._clean_small_together`): small plain tensors of one dtype and device
    are cleaned as one concatenation and copied back. Every tensor ends up as its own `nan_to_num_` would
    leave it (NaN, +inf, -inf to 0; -0.0 and every finite value kept, as bits), non-contiguous ones included;
    large tensors and groups of fewer than three are left to clean one by one."""
    from modopt.core import runner

    g = torch.Generator().manual_seed(seed)
    ts = []
    for i in range(12):
        n = [3, 40, 700, runner.SMALL_CLEAN, runner.SMALL_CLEAN + 1][i % 5]
        dt = [torch.float32, torch.bfloat16, torch.float64][i % 3] if i < 9 else torch.float16
        t = torch.randn(n, generator=g).to(dt)
        t[torch.randint(0, n, (3,), generator=g)] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dt)
        t[0] = -0.0
        ts.append(t)
    ts.append(torch.randn(6, 4, generator=g).T)  # non-contiguous, float32
    ts[-1][1, 2] = float("nan")
    want = [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in ts]
    rest = runner._clean_small_together(ts)
    for t in rest:
        torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
    for t, w in zip(ts, want):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        assert torch.equal(t.contiguous().view(bits), w.contiguous().view(bits))
    # grouped: the four small float32 tensors (the non-contiguous one among them) and the three small float64
    # ones; left: the large ones and the small bfloat16 and float16 pairs (two of a dtype: not worth a group)
    assert {id(t) for t in rest} == {id(t) for t in ts if t.numel() > runner.SMALL_CLEAN
                                     or t.dtype in (torch.bfloat16, torch.float16)}
