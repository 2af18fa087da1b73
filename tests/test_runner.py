"""The step's per-tensor norm memo (modopt/core/runner.py, `Step`): never serves a norm written through
``.data``, is kept only across transforms that did not write, and is fresh every step."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import modopt as mo
from modopt.core.transform import Transform


class _DataWriter(Transform):
    """A user transform that doubles the updates through ``.data`` (no version-counter bump)."""

    positional = None

    def apply(self, ctx, st, updates):
        for u in updates:
            u.data.mul_(2.0)
        return updates


class _NormSpy(Transform):
    """Records the per-tensor 2-norms it sees (through the step's memo, like a scoped transform)."""

    positional = None
    seen: ClassVar[list] = []
    update_access: ClassVar[str] = "read"

    def apply(self, ctx, st, updates):
        seg = mo.ClipNorm(1.0, scope="tensor").segments(ctx, st)
        _NormSpy.seen.append(seg.tensor_pnorms(updates, 2.0, torch.float32).clone())
        return updates


@pytest.mark.parametrize("first", [[], [_NormSpy()], [_NormSpy(), mo.Identity()]])
def test_norm_memo_never_serves_a_norm_written_through_data(first):
    """The memo is filled (by the non-finite check's 2-norms, or a transform reading norms); a custom
    transform writes through .data; a later ClipNorm(scope="tensor") must see the fresh norms."""
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(3))
    chain = [*first, _DataWriter(), mo.ClipNorm(1.0, scope="tensor", eps=0.0), mo.LR(1.0)]
    opt = mo.Modular([p, q], *chain)
    p.grad, q.grad = torch.tensor([0.3, 0.4]), torch.tensor([0.0, 0.0, 0.2])
    opt.step()
    norms = opt.stats[f"{len(first) + 1}:ClipNorm.norm"]
    # after doubling, the norms are 1.0 and 0.4 (the stale ones would be 0.5 and 0.2)
    assert torch.allclose(norms, torch.tensor([1.0, 0.4])), norms
    assert torch.allclose(p.detach(), -torch.tensor([0.6, 0.8]))
    assert torch.allclose(q.detach(), -torch.tensor([0.0, 0.0, 0.4]))


def test_norm_memo_is_kept_only_across_transforms_that_did_not_write():
    _NormSpy.seen.clear()
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], _NormSpy(), mo.Identity(), _NormSpy(), _DataWriter(), _NormSpy(), mo.LR(1.0))
    p.grad = torch.tensor([3.0, 4.0])
    opt.step()
    a, b, c = _NormSpy.seen
    assert a.item() == 5.0 and b.item() == 5.0 and c.item() == 10.0
    # the memo belongs to the step; the segments cached across steps still point at the last one,
    # which the step emptied when it ended (it holds no tensors between steps)
    layout = next(iter(opt._runtime["__layouts__"].values()))
    memos = [seg.memo for k, seg in layout.cache.items() if isinstance(k, tuple) and k[0] == "segments"]
    assert memos and all(m is not None and len(m) == 0 for m in memos)


def test_norm_memo_is_fresh_every_step():
    _NormSpy.seen.clear()
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], _NormSpy(), mo.LR(1.0))
    g = torch.tensor([3.0, 4.0])
    p.grad = g
    opt.step()
    g.data.mul_(3.0)  # same tensor object, same version counter, new values
    opt.step()
    assert [s.item() for s in _NormSpy.seen] == [5.0, 15.0]
