"""The shared assertions of tests/checks.py can fail: each is shown a case it must reject."""

from __future__ import annotations

import pytest

import modopt as mo
from checks import assert_resumes_bit_for_bit, regression_batches, tanh_mlp


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
