"""The step's loss door (`check_loss` in modopt/core/step.py, the author's step API, which `Stepping.step` in modopt/core/runner.py calls): what `opt.step(loss=...)` and a closure
may hand SkipStep, with refusals that change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import modopt as mo
from checks import assert_same, everything


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, mo.Modular(model.parameters(), mo.SkipStep(window=4, min_steps=2), mo.Adam(lr=1e-2))


def grads(model, k):
    model.zero_grad()
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(k))).pow(2).mean().backward()


@pytest.mark.parametrize("loss", [np.float32(1.0), np.float16(1.0), np.int64(1), np.uint8(1), np.array(1.0),
                                  np.array([[1.0]], dtype=np.float32)],
                         ids=["float32", "float16", "int64", "uint8", "0-d array", "1x1 array"])
def test_a_real_numpy_loss_is_the_same_loss_as_a_float(loss):
    ma, oa = model_and_opt()
    mb, ob = model_and_opt()
    for k in range(3):
        grads(ma, k)
        oa.step(loss=loss)
        grads(mb, k)
        ob.step(loss=1.0)
    assert_same(everything(ma, oa), everything(mb, ob))
    assert float(oa.stats["0:SkipStep.loss"]) == 1.0


@pytest.mark.parametrize("loss, error, match", [
    (torch.tensor(1.0 + 1j), TypeError, "a tensor of shape \\(\\) and dtype torch.complex64"),
    (1 + 2j, TypeError, "got complex"),
    (np.complex64(1.0), TypeError, "got a NumPy complex64"),
    (True, TypeError, "got a bool"),
    (np.bool_(False), TypeError, "got a NumPy bool"),
    (torch.tensor(True), TypeError, "dtype torch.bool"),
    (10**400, ValueError, "an int of 401 digits, which cannot be represented as a finite float64"),
    (2**64, ValueError, "an int of 20 digits, which is beyond 64 bits"),
    (np.longdouble("1e400"), ValueError, "cannot be represented as a finite float64"),
    (np.uint64(1), TypeError, "NumPy dtype uint64, which torch does not hold"),
    (np.array([1.0, 2.0]), TypeError, "a NumPy array of shape \\(2,\\)"),
    ("1.0", TypeError, "got str"),
], ids=["complex tensor", "complex", "numpy complex", "bool", "numpy bool", "bool tensor", "10**400", "2**64",
        "longdouble 1e400", "uint64", "two elements", "str"])
def test_a_loss_that_is_not_one_real_number_is_refused_by_the_door_with_nothing_changed(loss, error, match):
    model, opt = model_and_opt()
    for k in range(2):
        grads(model, k)
        opt.step(loss=1.0)
    grads(model, 2)
    before = everything(model, opt)
    with pytest.raises(error, match=r"opt.step\(loss=...\): the loss .*" + match):
        opt.step(loss=loss)
    assert_same(before, everything(model, opt))
    with pytest.raises(error, match=r"SkipStep \(the closure's return value\): the loss .*" + match):
        opt.step(lambda: loss)
    assert_same(before, everything(model, opt))


def test_a_non_finite_loss_is_a_loss_not_a_refusal():
    """NaN and inf are what SkipStep acts on, as a float, a NumPy scalar or a tensor: the step is skipped."""
    for loss in (float("nan"), np.float32("inf"), torch.tensor(float("nan"))):
        model, opt = model_and_opt()
        for k in range(3):  # (the window holds min_steps values: the test is on)
            grads(model, k)
            opt.step(loss=1.0)
        grads(model, 3)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step(loss=loss)
        assert bool(opt.stats["skipped"]) and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
