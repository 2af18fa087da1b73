"""Shared assertions of the test suite."""

from __future__ import annotations

import math

import torch


def assert_same(a, b, path: str = "") -> None:
    """Two state trees (dicts, lists, tensors, numbers) are identical: same keys, dtypes and bits
    (NaNs in the same places count as equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        same = torch.equal(a, b)
        if not same and a.is_floating_point():
            same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert same, path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def train(model, opt, n, seed=0):
    """``n`` steps of a squared-output loss on seeded (5, 3) batches."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=g)).pow(2).sum().backward()
        opt.step()


def needs_the_host():
    """A transform that changes nothing and does not declare `skips_on_device()`: a pipeline holding
    it decides the non-finite skip on the host (one sync a step), the way to test that path."""
    return _NeedsTheHost()


def _make_needs_the_host():
    import modopt as mo

    class _NeedsTheHost(mo.Transform):  # (a leading underscore: the registry's checks pass it by)
        """Changes nothing; does not declare `skips_on_device()` (tests only)."""

        positional = None
        update_access = "none"  # it neither reads nor writes them: the norm memo passes by it

        def apply(self, ctx, st, updates):
            return updates

    return _NeedsTheHost


_NeedsTheHost = _make_needs_the_host()
