"""modopt/core/hyper.py: every value that enters an optimizer is checked before anything changes.

The doors through which a hyperparameter enters (constructor keywords, group dicts,
`add_param_group`, a config's `defaults`, `TorchOptimizer`'s kwargs, a checkpoint's
groups, a scheduler, a group value written between steps) and the one rule for group keys.
Every refusal is checked to leave parameters, every state tensor and the groups as
they were. (`load_state_dict` as all or nothing for state: tests/test_checkpoint.py.)
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import modopt as mo
from checks import refused, train

NAN, INF = float("nan"), float("inf")


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


# --- one gate for hyperparameters ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [NAN, INF, -1.0, "fast"])
def test_every_door_refuses_a_bad_learning_rate_naming_the_group_and_key(bad):
    model = make_model()
    with pytest.raises(ValueError, match=r"param group 0.*'lr'"):
        mo.Modular(model.parameters(), mo.Adam(), lr=bad)  # keyword default
    with pytest.raises(ValueError, match=r"param group 1.*'lr'"):
        mo.Modular([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": bad}], mo.Adam())
    cfg = {"defaults": {"lr": bad}, "transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "Adam"}]}
    with pytest.raises(ValueError, match=r"param group 0.*'lr'"):
        mo.load_config(cfg).build(model.parameters())
    with pytest.raises(ValueError, match=r"param group 0.*'lr'"):
        mo.Modular(model.parameters(), mo.TorchOptimizer(torch.optim.RMSprop), lr=bad)
    # add_param_group: refused, and the optimizer keeps its groups
    opt = mo.Modular(model[0].parameters(), mo.Adam())
    refused(model, opt, lambda: opt.add_param_group({"params": model[2].parameters(), "lr": bad}), r"param group 1.*'lr'")
    assert len(opt.param_groups) == 1
    # torch refuses the same values in its own constructor
    if not (isinstance(bad, float) and math.isinf(bad)):  # (torch's check is `0.0 <= lr`: inf passes it)
        with pytest.raises((ValueError, TypeError)):
            torch.optim.Adam(model.parameters(), lr=bad)


@pytest.mark.parametrize("kwargs", [{"lr": NAN}, {"lr": INF}, {"alpha": NAN}, {"lr": -1.0}])
def test_torch_optimizer_kwargs_are_checked_when_built(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        mo.TorchOptimizer(torch.optim.RMSprop, **kwargs)


def test_torch_optimizer_that_cannot_be_built_is_refused_at_once():
    with pytest.raises(ValueError, match="missing 1 required positional argument: 'defaults'"):
        mo.TorchOptimizer("torch.optim.Optimizer")


def test_group_values_are_checked_as_the_transforms_own_fields():
    model = make_model()
    cases = [
        ({"betas": (0.9, 1.5)}, mo.Adam(), r"'betas' = \(0.9, 1.5\): betas\[1\] must be in \[0, 1\)"),
        ({"eps": -1e-8}, mo.Adam(), r"'eps' = -1e-08"),
        ({"weight_decay": NAN}, mo.AdamW(), r"'weight_decay' = nan"),
        ({"momentum": 0.0, "nesterov": True}, mo.SGD(0.1), "nesterov requires momentum > 0"),
        ({"lr": "0.1"}, mo.Adam(), "'lr' = '0.1': a number is needed, got the string '0.1'"),  # the kernels would get the string
    ]
    for group, t, match in cases:
        with pytest.raises(ValueError, match=r"param group 0, as read by 0:\w+: " + match):
            mo.Modular([{"params": model.parameters(), **group}], t)
    # a tensor learning rate is checked by its value, and is kept as given
    opt = mo.Modular([{"params": model.parameters(), "lr": torch.tensor(0.01)}], mo.Adam())
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    with pytest.raises(ValueError, match="'lr'"):
        mo.Modular([{"params": model.parameters(), "lr": torch.tensor(NAN)}], mo.Adam())


def test_a_scheduler_writing_nan_is_refused_before_the_step_changes_anything():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ZClip(), mo.Adam(lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 2 else NAN)
    for _ in range(2):
        train(model, opt, 1)
        sched.step()
    model.zero_grad()
    model(torch.randn(5, 3)).pow(2).sum().backward()
    refused(model, opt, opt.step, r"param group 0: 'lr' is nan; a hyperparameter must be finite")


def test_a_checkpoint_with_bad_group_values_is_refused_and_changes_nothing():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    train(model, opt, 2)
    for key, value, match in [("lr", NAN, "'lr' = nan"), ("lr", "fast", "'lr' = 'fast'"), ("eps", -1.0, "'eps'"),
                              ("betas", (0.9,), "betas"), ("max_norm", 2.0, "'max_norm' is a field of 0:ClipNorm")]:
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][0][key] = value
        refused(model, opt, lambda: opt.load_state_dict(sd), match)


# --- group keys have one rule ------------------------------------------------------------------------
def test_a_group_key_that_names_an_unread_field_is_refused_pointing_to_masked():
    model = make_model()
    with pytest.raises(ValueError, match=r"'max_norm' is a field of 0:ClipNorm, which does not read it per param "
                                         r"group.*mo\.Masked"):
        mo.Modular([{"params": model.parameters(), "max_norm": 2.0}], mo.ClipNorm(1.0), mo.Adam())
    with pytest.raises(ValueError, match=r"no transform of this pipeline reads 'momentum' \(a group key of Muon, SGD and ScheduleFreeSGD\)"):
        mo.Modular([{"params": model.parameters(), "momentum": 0.9}], mo.Adam())
    with pytest.raises(ValueError, match="no transform of this pipeline reads 'weight_decay'"):
        mo.Modular([{"params": model.parameters(), "weight_decay": 0.1}], mo.ClipNorm(1.0), mo.LR(0.1))


def test_keys_modopt_does_not_know_ride_along_and_are_saved():
    model = make_model()
    opt = mo.Modular([{"params": model.parameters(), "swa_lr": 0.05, "lr_scale": 0.5, "name": "all"}], mo.Adam())
    train(model, opt, 1)
    sd = opt.state_dict()
    assert (sd["param_groups"][0]["swa_lr"], sd["param_groups"][0]["lr_scale"]) == (0.05, 0.5)
    opt2 = mo.Modular(make_model().parameters(), mo.Adam())
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["name"] == "all"


def test_per_parameter_settings_go_through_masked():
    """What the refusal message recommends works: a second ClipNorm for the group that needs another max_norm."""
    model = make_model()
    opt = mo.Modular(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        mo.Masked(mo.ClipNorm(1.0), where=mo.Select(groups=[0])),
        mo.Masked(mo.ClipNorm(2.0), where=mo.Select(groups=[1])),
        mo.SGD(0.1),
    )
    train(model, opt, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("bad", [torch.tensor(float("nan")), "0.1", None, [0.1], 1j, float("inf")],
                         ids=["tensor-nan", "string", "none", "list", "complex", "inf"])
@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
def test_a_group_value_written_between_steps_is_refused_before_anything_changes(bad, key):
    p = torch.nn.Parameter(torch.randn(3))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.Adam())
    p.grad = torch.randn(3)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0][key] = bad
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match=f"param group 0.*'{key}'.*nothing was changed by this step|"
                                         f"param group 0: '{key}' is .*Nothing was changed"):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(v, opt.state[p][k]) for k, v in before[1].items())


def test_a_changed_group_value_is_checked_with_the_groups_other_values():
    # a group's own momentum makes its nesterov=True right (the transform's momentum is 0): found by
    # tests/test_torch_optim_suite.py (torch's param-group tests); the rule still holds for the group's values
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = mo.Modular([{"params": [p], "momentum": 0.9, "nesterov": True}], mo.SGD())
    opt.step()
    opt = mo.Modular([{"params": [p], "momentum": 0.0}], mo.SGD())
    opt.param_groups[0]["nesterov"] = True
    before = p.detach().clone()
    with pytest.raises(ValueError, match="nesterov requires momentum > 0"):
        opt.step()
    assert torch.equal(p, before)


def test_an_unchanged_group_value_is_not_checked_again_and_a_good_tensor_lr_passes(monkeypatch):
    p = torch.nn.Parameter(torch.randn(3))
    opt = mo.Modular([p], mo.Adam(amsgrad=False))
    calls = []
    real = mo.Adam.check_group_values
    monkeypatch.setattr(mo.Adam, "check_group_values", lambda self, values: calls.append(dict(values)) or real(self, values))
    p.grad = torch.randn(3)
    opt.step()  # the first step checks every value once (they may have been written since the build)
    calls.clear()
    for _ in range(3):
        p.grad = torch.randn(3)
        opt.step()
    assert calls == []  # nothing changed since: nothing checked again
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.randn(3)
    opt.step()
    assert sorted(sorted(c) for c in calls) == [["amsgrad"], ["lr"]]  # only what changed, each checked once
