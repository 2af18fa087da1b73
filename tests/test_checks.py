"""The shared assertions of tests/checks.py can fail: each is shown a case it must reject."""

from __future__ import annotations

import pytest

import modopt as mo
from checks import (assert_bad_steps_change_nothing, assert_resumes_bit_for_bit, mse_backward, needs_the_host,
                    regression_batches, tanh_mlp)


def _make(m):
    return mo.Modular(m.parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2))


class _Forgets(mo.Modular):
    """Loads nothing: the resumed run starts with fresh moments."""

    def load_state_dict(self, state_dict):
        pass


def test_the_resume_check_passes_a_true_resume():
    assert_resumes_bit_for_bit(tanh_mlp, _make, regression_batches(6), cut=3)


@pytest.mark.filterwarnings("ignore:load_state_dict")  # (the differing max_norm is reported, then kept)
@pytest.mark.parametrize("resumed", [
    lambda m: mo.Modular(m.parameters(), mo.ClipNorm(0.05), mo.Adam(lr=1e-2)),  # not a group key: the load keeps it
    lambda m: _Forgets(m.parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2)),
], ids=["other-max_norm", "forgets-the-state"])
def test_the_resume_check_fails_when_the_resumed_optimizer_differs(resumed):
    with pytest.raises(AssertionError, match="parameter 0"):
        assert_resumes_bit_for_bit(tanh_mlp, _make, regression_batches(6), cut=3, make_resumed=resumed)


def _bad_steps(*transforms, **kw):
    """`assert_bad_steps_change_nothing` over 5 steps of `transforms`, two bad steps before step 3."""
    data = regression_batches(5)

    def make():
        m = tanh_mlp()
        return m, mo.Modular(m.parameters(), *transforms, **kw)

    return assert_bad_steps_change_nothing(make, lambda m, k: mse_backward(m, *data[k]), steps=5, at=(3,))


def test_the_bad_steps_check_passes_skipped_steps():
    _bad_steps(mo.ClipNorm(0.5), mo.Adam(lr=1e-2))


@pytest.mark.parametrize("transforms,kw,says", [
    ([mo.ClipNorm(0.5), mo.Adam(lr=1e-2)], {"nonfinite": "ignore"}, "0.weight"),  # the bad step goes ahead: NaN weights
    ([needs_the_host(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2)], {}, "the host decides"),  # one sync a step
], ids=["not-skipped", "host-sync"])
def test_the_bad_steps_check_fails_on_a_step_that_goes_ahead_or_a_host_sync(transforms, kw, says):
    with pytest.raises(AssertionError, match=says):
        _bad_steps(*transforms, **kw)
