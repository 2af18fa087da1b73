"""modopt/transforms/wrappers.py: Lookahead, against its float64 spec and pytorch-optimizer's Lookahead."""

from __future__ import annotations

import functools

import pytest
import torch

import modopt as mo
from checks import Syncs, assert_resumes_bit_for_bit, flat_state, mse_backward, regression_batches, tanh_mlp
from modopt.spec.wrappers import Lookahead as SpecLookahead


SIZES = (6, 12, 3)


_model = functools.partial(tanh_mlp, SIZES)  # (dtype=..., seed=...)
_batches = functools.partial(regression_batches, sizes=SIZES, rows=5)  # (n, dtype=..., seed=...)
_backward = mse_backward


@pytest.mark.parametrize("k,alpha", [(1, 0.5), (3, 0.3), (5, 0.5), (4, 0.0), (2, 1.0)])
def test_lookahead_matches_spec(k, alpha):
    """float64, inner SGD: every call the fast step, every k-th call the pull toward the slow weights."""
    model = _model(dtype=torch.float64)
    opt = mo.Modular(model.parameters(), mo.Lookahead(mo.SGD(lr=0.1), k=k, alpha=alpha))
    spec = SpecLookahead(list(model.parameters()), k, alpha)
    for x, y in _batches(11, dtype=torch.float64):
        _backward(model, x, y)
        fast = [p.detach() - 0.1 * p.grad for p in model.parameters()]  # SGD's step, in float64
        want = spec.step(fast)
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("inner", ["adam", "sgd_momentum", "adamw"])
def test_lookahead_equals_pytorch_optimizer_bit_for_bit(inner):
    """pytorch-optimizer's Lookahead with its defaults (k=5, alpha=0.5, pullback 'none') around the same
    torch optimizer: float32 parameters equal bit for bit after 23 steps (four pulls)."""
    from pytorch_optimizer import Lookahead as PoLookahead

    torch_inner, mo_inner = {
        "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), mo.Adam(lr=1e-2)),
        "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True), mo.SGD(lr=0.05, momentum=0.9)),
        "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), mo.AdamW(lr=1e-2, weight_decay=0.1)),
    }[inner]
    a, b = _model(), _model()
    ours = mo.Modular(a.parameters(), mo.Lookahead(mo_inner))
    theirs = PoLookahead(torch_inner(list(b.parameters())))
    assert (theirs.k, theirs.alpha) == (mo.Lookahead(mo_inner).k, mo.Lookahead(mo_inner).alpha)
    for x, y in _batches(23):
        for m, o in ((a, ours), (b, theirs)):
            _backward(m, x, y)
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    slow_ours = [ours.state[p]["0:Lookahead.slow"] for p in a.parameters()]
    slow_theirs = [theirs.state[q]["slow_params"] for q in b.parameters()]
    for s, t in zip(slow_ours, slow_theirs):
        assert torch.equal(s, t)


def test_lookahead_resumes_bit_for_bit_from_a_checkpoint():
    """Stopped inside a cycle (7 = 4 + 3 calls): the slow weights and the host's count travel."""
    make = lambda m: mo.Modular(m.parameters(), mo.ClipNorm(1.0), mo.Lookahead(mo.Adam(lr=1e-2), k=4))  # noqa: E731
    osd = assert_resumes_bit_for_bit(_model, make, _batches(15), cut=7)
    assert osd["modopt"]["transforms"]["1:Lookahead"]["calls"] == 3


def test_a_skipped_kth_call_keeps_every_bit_and_the_count_starts_again():
    """The device decides the skip (no host sync); a NaN gradient on the k-th call leaves the parameters,
    the slow weights and the inner state as they were; the next pull comes k calls later."""
    k = 3
    a, b = _model(), _model()
    oa = mo.Modular(a.parameters(), mo.Lookahead(mo.Adam(lr=1e-2), k=k))
    ob = mo.Modular(b.parameters(), mo.Lookahead(mo.Adam(lr=1e-2), k=k))
    assert oa.plan.device_skip is True
    data = _batches(8)
    for x, y in data[:2]:
        for m, o in ((a, oa), (b, ob)):
            _backward(m, x, y)
            o.step()
    _backward(a, *data[2])
    for p in a.parameters():
        p.grad[0].fill_(float("nan"))
    before = [p.detach().clone() for p in a.parameters()], flat_state(oa.state_dict())
    syncs = Syncs()
    with syncs:
        oa.step()  # the k-th call, skipped on the device
    after = [p.detach().clone() for p in a.parameters()], flat_state(oa.state_dict())
    assert syncs.n == 0 and bool(oa.stats["skipped"])
    for p, q in zip(before[0], after[0]):
        assert torch.equal(p, q)
    changed = {k for k in before[1] if not _same(before[1][k], after[1][k])}
    # only the host's count (2 -> 0) and the skipped-step counter; param_groups[0] carries the same entry
    assert changed - {"/param_groups"} == {k for k in before[1] if k.endswith("Lookahead/calls")} | {"/modopt/skipped_steps"}
    # b never saw that call: it is one call behind in the count; a's next pull comes 3 calls later
    for x, y in data[3:6]:
        _backward(a, x, y)
        oa.step()
    for x, y in data[3:5]:
        _backward(b, x, y)
        ob.step()
    _backward(b, *data[5])
    for p in b.parameters():
        p.grad[0].fill_(float("nan"))
    ob.step()  # b's 3rd call after its pull... is its k-th: skipped, nothing changes, the count restarts
    assert int(oa.stats["skipped_steps"]) == 1 and int(ob.stats["skipped_steps"]) == 1


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_lookahead_must_come_last_and_cannot_be_masked_or_attached():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="must be the last transform"):
        mo.Modular([p], mo.Lookahead(mo.SGD(lr=0.1)), mo.ClipNorm(1.0))
    with pytest.raises(Exception, match="cannot run inside Masked"):
        mo.Masked(mo.Lookahead(mo.SGD(lr=0.1)), where=mo.Select(names=["*"]))
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.Lookahead(mo.SGD(lr=0.1)))
    with pytest.raises(Exception, match="alpha"):
        mo.Lookahead(mo.SGD(lr=0.1), alpha=1.5)


def test_lookahead_config_round_trip():
    cfg = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0), mo.Lookahead(mo.Adam(lr=3e-4), k=6, alpha=0.6)])
    again = mo.PipelineConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert "Lookahead" in cfg.to_yaml()
