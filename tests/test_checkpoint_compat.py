"""Checkpoint compatibility: the committed format-1 fixture loads and resumes; format migrations chain."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import modopt as mo
from modopt.core import checkpoint

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
import make_checkpoint_v1 as v1  # noqa: E402


def load_fixture():
    return torch.load(DATA / "checkpoint_v1.pt", weights_only=True)


#: the parameters after the fixture's resumed steps. The fixture's own `expected` is what the code
#: computed before the one-D rule (docs/concepts.md, "Slices"): its ClipNormByEMA(dim=0,
#: inverse_dims=True) clipped each bias element as a slice of its own, and now leaves the biases
#: alone. These values were computed by the code before the rule with the biases left alone
#: (`v1.one_d_pipeline()`, `v1.record_one_d()`); the fixture still loads as it is
EXPECTED = torch.load(DATA / "checkpoint_v1_one_d.pt", weights_only=True)


def test_v1_fixture_loads_and_resumes():
    ck = load_fixture()
    assert ck["optimizer"]["modopt"]["format_version"] == 1
    m = v1.model()
    m.load_state_dict(ck["model"])
    opt = mo.Modular(v1.groups(m), *v1.pipeline())
    # the pipeline still serialises as it did, but for fields added since, at their defaults
    assert mo.PipelineConfig.from_dict(ck["config"]) == opt.config
    now = opt.config.to_dict()
    for t_now, t_then in zip(now["transforms"], ck["config"]["transforms"]):
        for k in set(t_now) - set(t_then):
            assert type(mo.PipelineConfig.from_dict({"transforms": [t_then]}).transforms[0]).model_fields[k].default \
                == t_now[k], k
            del t_now[k]
    assert now == ck["config"]
    opt.load_state_dict(ck["optimizer"])
    assert opt.param_groups[1]["lr"] == 5e-3
    v1.train(m, opt, ck["resume_batches"])
    for p, e in zip(m.parameters(), EXPECTED):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_v1_fixture_rebuilds_from_its_own_config():
    ck = load_fixture()
    m = v1.model()
    m.load_state_dict(ck["model"])
    opt = mo.Modular.from_config(v1.groups(m), ck["config"])
    opt.load_state_dict(ck["optimizer"])
    v1.train(m, opt, ck["resume_batches"])
    for p, e in zip(m.parameters(), EXPECTED):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_v1_fixture_under_the_one_d_rule_is_what_min_size_2_computed_before_it():
    """The biases' per-element slices of the fixture keep their saved values (the layout did not change);
    the rule leaves the biases alone as `min_size=2` does, in the code before the rule and now."""
    ck = load_fixture()
    for pipe in (v1.pipeline(), v1.one_d_pipeline()):
        m = v1.model()
        m.load_state_dict(ck["model"])
        opt = mo.Modular(v1.groups(m), *pipe)
        with warnings.catch_warnings():  # (one_d_pipeline: min_size 1 in the checkpoint, 2 here)
            warnings.simplefilter("ignore", UserWarning)
            opt.load_state_dict(ck["optimizer"])
        v1.train(m, opt, ck["resume_batches"])
        for p, e in zip(m.parameters(), EXPECTED):  # (within rounding: EXPECTED was computed on another CPU, whose
            torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-7)  # vector width sums in another order)
    # the old rule's values differ by far more than rounding
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(ck["expected"], EXPECTED))


def test_a_changed_structure_names_the_first_difference_and_changed_values_warn():
    ck = load_fixture()
    m = v1.model()
    pipe = v1.pipeline()
    pipe[1] = mo.ClipNormByEMA(beta=0.8, scope="tensor", dim=0, inverse_dims=True)
    opt = mo.Modular(v1.groups(m), *pipe)
    with pytest.warns(UserWarning, match=r"transforms\.1\.beta: 0\.9 in the checkpoint, 0\.8 here \(this optimizer's value is kept\)"):
        opt.load_state_dict(ck["optimizer"])
    opt = mo.Modular(v1.groups(m), *v1.pipeline(), nonfinite="zero")
    with pytest.warns(UserWarning, match=r"nonfinite: 'skip' in the checkpoint, 'zero' here"):
        opt.load_state_dict(ck["optimizer"])
    assert opt.config.nonfinite == "zero"
    opt = mo.Modular(v1.groups(m), *v1.pipeline()[:-1], mo.Adam(lr=1e-2))
    with pytest.raises(ValueError, match=r"config\.transforms\.3\.type: 'AdamW' != 'Adam'"):
        opt.load_state_dict(ck["optimizer"])
    pipe = v1.pipeline()
    pipe[1] = mo.ClipNormByEMA(beta=0.9, scope="tensor", dim=1)
    opt = mo.Modular(v1.groups(m), *pipe)
    with pytest.raises(ValueError, match=r"config\.transforms\.1\.dim: 0 != 1"):
        opt.load_state_dict(ck["optimizer"])


def test_load_state_dict_runs_the_migration_chain(monkeypatch):
    """Format N -> N+1: simulate the next format; the v1 fixture is migrated before any check, then resumes."""
    ck = load_fixture()
    calls = []

    def v1_to_v2(sd):
        calls.append(1)
        return {**sd, "modopt": {**sd["modopt"], "format_version": 2}}

    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", 2)
    monkeypatch.setitem(checkpoint.MIGRATIONS, 1, v1_to_v2)
    m = v1.model()
    m.load_state_dict(ck["model"])
    opt = mo.Modular(v1.groups(m), *v1.pipeline())
    opt.load_state_dict(ck["optimizer"])
    assert calls == [1]
    assert opt.state_dict()["modopt"]["format_version"] == 2
    v1.train(m, opt, ck["resume_batches"])
    for p, e in zip(m.parameters(), EXPECTED):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_missing_or_broken_migration_is_a_clear_error_and_changes_nothing(monkeypatch):
    ck = load_fixture()
    m = v1.model()
    opt = mo.Modular(v1.groups(m), *v1.pipeline())
    v1.train(m, opt, ck["resume_batches"][:1])
    before = copy.deepcopy(opt.state_dict())
    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", 3)
    monkeypatch.setitem(checkpoint.MIGRATIONS, 1, lambda sd: {**sd, "modopt": {**sd["modopt"], "format_version": 2}})
    with pytest.raises(ValueError, match="no migration from checkpoint format_version 2 to 3"):
        opt.load_state_dict(ck["optimizer"])
    monkeypatch.setitem(checkpoint.MIGRATIONS, 2, lambda sd: sd)  # forgets to bump the version
    with pytest.raises(ValueError, match="migration to format_version 3 returned format 2"):
        opt.load_state_dict(ck["optimizer"])
    after = opt.state_dict()
    for k in before["state"]:
        for name, v in before["state"][k].items():
            assert torch.equal(v, after["state"][k][name])


def test_a_modular_pickled_when_torch_optimizer_lived_in_optimizers_py_unpickles_and_continues():
    """`pickle` names a class by its module: a Modular pickled before `TorchOptimizer` had its own module
    names `modopt.transforms.optimizers.TorchOptimizer`. That path still resolves, to the same class, and
    the unpickled optimizer continues bit for bit (its wrapped torch.optim.SGD's momentum included)."""
    import pickle

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.TorchOptimizer(torch.optim.SGD, lr=0.1, momentum=0.9))
    for _ in range(2):
        p.grad = torch.randn(4, 3)
        opt.step()
    # protocol 2 writes a class as the text `module\nname\n`: the old module's path is a byte replacement
    new = pickle.dumps(opt, protocol=2)
    assert new.count(b"modopt.transforms.torch_optimizer\nTorchOptimizer\n") == 1
    old = new.replace(b"modopt.transforms.torch_optimizer\nTorchOptimizer\n",
                      b"modopt.transforms.optimizers\nTorchOptimizer\n")
    assert b"modopt.transforms.torch_optimizer" not in old
    back = pickle.loads(old)
    assert type(back.transforms[1]) is mo.TorchOptimizer
    q = back.param_groups[0]["params"][0]
    assert torch.equal(q, p) and q is not p
    for _ in range(3):
        g = torch.randn(4, 3)
        p.grad, q.grad = g, g.clone()
        opt.step()
        back.step()
        assert torch.equal(q, p)
    from modopt.core.keys import value_key

    k = value_key("1:TorchOptimizer", "inner")
    assert torch.equal(back.state[q][k]["momentum_buffer"], opt.state[p][k]["momentum_buffer"])
