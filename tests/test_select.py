"""modopt/core/select.py: the names a selection asks for (`Masked`'s `where`, AGC's `exclude`) are checked when the `Modular`
is built, from code and from a config, with the text a step would give, before any state exists."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import modopt as mo
from modopt.core.select import check_selections


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(7, 4)
        self.fc = torch.nn.Linear(4, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx))))


def grads(model, k=0):
    g = torch.Generator().manual_seed(k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def snapshot(model):
    return {n: (p.detach().clone(), p.grad) for n, p in model.named_parameters()}


def unchanged(model, snap):
    return all(torch.equal(p, snap[n][0]) and p.grad is snap[n][1] for n, p in model.named_parameters())


BAD = [
    (lambda: mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["nope"])),
     "0:Masked (where=Select(names=['nope'])) selects parameters by name, but names pattern 'nope' matches none"),
    (lambda: mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["fc.*", "fc.wieght"])),
     "names pattern 'fc.wieght' (did you mean 'fc.weight'?) matches none of the 5 parameter name(s) of the optimizer"),
    (lambda: mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["haed.*"], exclude=["*.bias"])),
     "0:Masked (where=Select(names=['haed.*'], exclude=['*.bias'])) selects parameters by name, but names pattern "
     "'haed.*' matches none"),
    (lambda: mo.Masked(mo.Masked(mo.ClipValue(0.1), where="fc.bais"), where="fc.*"),
     "0:Masked/0:Masked (where=Select(names=['fc.bais'])) selects parameters by name, but names pattern 'fc.bais' "
     "(did you mean 'fc.bias'?) matches none"),
]


@pytest.mark.parametrize("make,message", BAD, ids=[m.split(" selects")[0] for _, m in BAD])
def test_a_wrong_name_fails_when_the_optimizer_is_built(make, message):
    m = Net()
    grads(m)
    snap = snapshot(m)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        mo.Modular(m.named_parameters(), make(), mo.SGD(lr=0.1))
    assert "fc.weight" in str(e.value)  # the names it could have meant are listed
    assert unchanged(m, snap)  # nothing moved, no gradient touched


def test_several_wrong_patterns_are_all_named():
    m = Net()
    with pytest.raises(ValueError, match=r"names pattern 'nope'; names pattern 'fc.wieght' \(did you mean "
                                         r"'fc.weight'\?\) match none of the 5"):
        mo.Modular(m.named_parameters(), mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["nope", "fc.*", "fc.wieght"])),
                   mo.SGD(lr=0.1))


def test_exclude_patterns_may_name_parameters_the_model_lacks():
    """An exclude list takes nothing away where it names nothing (shared lists name parameters some models
    lack): not an error, and the step is that of the same pipeline without those patterns."""
    for pipe, same in [
        ([mo.AGC(exclude=["classifier.*", "head.*"]), mo.SGD(lr=0.1)], [mo.AGC(exclude=["head.*"]), mo.SGD(lr=0.1)]),
        ([mo.Masked(mo.ClipNorm(0.1), where=mo.Select(exclude=["haed.*"])), mo.SGD(lr=0.1)],
         [mo.Masked(mo.ClipNorm(0.1), where=mo.Select()), mo.SGD(lr=0.1)]),
    ]:
        a, b = Net(), Net()
        opt_a, opt_b = mo.Modular(a.named_parameters(), *pipe), mo.Modular(b.named_parameters(), *same)
        for k in range(3):
            grads(a, k)
            grads(b, k)
            opt_a.step()
            opt_b.step()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_the_right_names_still_work():
    m = Net()
    pipelines = [
        [mo.Masked(mo.ClipNorm(0.1), where=mo.Select(names=["fc.*", "head.weight"], exclude=["*.bias"])), mo.SGD(lr=0.1)],
        [mo.AGC(exclude=["head.*"]), mo.SGD(lr=0.1)],
        [mo.Masked(mo.SGD(lr=0.1), where="emb.*"), mo.Masked(mo.Adam(lr=0.1), where=mo.Select(exclude=["emb.*"]))],
        [mo.Masked(mo.ClipNorm(0.1), where=mo.Select(min_ndim=2)), mo.SGD(lr=0.1)],  # no names asked for
    ]
    for pipe in pipelines:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = mo.Modular(m.named_parameters(), *pipe)
            grads(m)
            opt.step()
    # an inner pattern may name parameters outside the outer selection (a typo names none at all); that
    # inner Masked selects nothing: the step reports it, as before
    opt = mo.Modular(m.named_parameters(), mo.Masked(mo.Masked(mo.ClipValue(0.1), where="head.*"), where="fc.*"),
                     mo.SGD(lr=0.1))
    grads(m)
    with pytest.warns(UserWarning, match="selects none"):
        opt.step()


def test_a_routed_pipeline_with_a_typo_names_it():
    m = Net()
    with pytest.raises(ValueError, match=r"names pattern 'embb\.\*' matches none"):
        mo.Modular(m.named_parameters(), mo.Masked(mo.SGD(lr=0.1), where="embb.*"),
                   mo.Masked(mo.Adam(lr=0.1), where=mo.Select(exclude=["embb.*"])))


# --- configs ----------------------------------------------------------------------------------

YAML = """\
transforms:
  - type: Masked
    where: {names: [%s]}
    transforms:
      - {type: ClipNorm, max_norm: 1.0}
  - {type: SGD, lr: 0.1}
"""


@pytest.mark.parametrize("how", ["build", "from_config", "config="])
def test_a_wrong_name_in_a_config_fails_when_the_optimizer_is_built(tmp_path, how):
    path = tmp_path / "c.yaml"
    path.write_text(YAML % "'fc.*', nope")
    cfg = mo.load_config(path)  # a config alone knows no parameters: it loads
    m = Net()
    grads(m)
    snap = snapshot(m)
    build = {
        "build": lambda: cfg.build(m.named_parameters()),
        "from_config": lambda: mo.Modular.from_config(m.named_parameters(), path),
        "config=": lambda: mo.Modular(m.named_parameters(), config=str(path)),
    }[how]
    with pytest.raises(ValueError) as e:
        build()
    with pytest.raises(ValueError) as from_code:
        mo.Modular(m.named_parameters(), mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["fc.*", "nope"])),
                   mo.SGD(lr=0.1))
    assert str(e.value) == str(from_code.value)  # the same message as from code
    assert "names pattern 'nope' matches none" in str(e.value)
    assert unchanged(m, snap)
    # the right names build and step
    path.write_text(YAML % "'fc.*'")
    opt = mo.Modular.from_config(m.named_parameters(), path)
    opt.step()
    assert not unchanged(m, snap)


# --- no names -----------------------------------------------------------------------------------


def _step_error(select) -> str:
    """The error a step gives (names removed from the groups after the build, as a step sees them)."""
    m = Net()
    opt = mo.Modular(m.named_parameters(), mo.Masked(mo.ClipNorm(1.0), where=select), mo.SGD(lr=0.1))
    for g in opt.param_groups:
        del g["param_names"]
    grads(m)
    with pytest.raises(ValueError) as e:
        opt.step()
    return str(e.value)


def test_names_asked_without_names_fail_at_build_with_the_step_message():
    m = Net()
    grads(m)
    snap = snapshot(m)
    with pytest.raises(ValueError) as e:
        mo.Modular(m.parameters(), mo.Masked(mo.ClipNorm(1.0), where="fc.*"), mo.SGD(lr=0.1))
    assert str(e.value) == _step_error("fc.*")  # one function builds both texts
    assert re.search(r"5 parameter\(s\) have no name: build the optimizer from model\.named_parameters\(\)", str(e.value))
    assert unchanged(m, snap)
    # the same for AGC's exclude
    with pytest.raises(ValueError, match=r"AGC\(exclude=\['head\.\*'\]\) selects parameters by name, but 5"):
        mo.Modular(m.parameters(), mo.AGC(exclude=["head.*"]), mo.SGD(lr=0.1))


def test_names_asked_without_any_names_are_refused_even_when_other_criteria_take_nothing():
    m = Net()
    with pytest.raises(ValueError, match=r"have no name"):
        mo.Modular(m.parameters(), mo.Masked(mo.ClipNorm(1.0), where=mo.Select("*.weight", min_ndim=5)), mo.SGD(lr=0.1))


def test_unnamed_groups_a_name_selection_cannot_reach_are_fine():
    m = Net()
    named = dict(m.named_parameters())
    groups = [
        {"params": [named["emb.weight"]]},  # no names: not selected by the group criterion below
        {"params": [p for n, p in named.items() if n != "emb.weight"],
         "names": [n for n in named if n != "emb.weight"]},  # (torch's "param_names" must be in every group)
    ]
    opt = mo.Modular(groups, mo.Masked(mo.ClipNorm(0.1), where=mo.Select("*.bias", groups=[1])), mo.SGD(lr=0.1))
    grads(m)
    opt.step()
    # a selection that can reach the unnamed group is refused, naming the count
    with pytest.raises(ValueError, match=r"but 1 parameter\(s\) have no name"):
        mo.Modular(groups, mo.Masked(mo.ClipNorm(0.1), where="*.bias"), mo.SGD(lr=0.1))


def test_add_param_group_refuses_unnamed_parameters_and_leaves_the_optimizer_unchanged():
    m, extra = Net(), torch.nn.Linear(2, 2)
    named = dict(m.named_parameters())  # modopt's "names" key: torch refuses groups with and without "param_names"
    opt = mo.Modular([{"params": list(named.values()), "names": list(named)}],
                     mo.Masked(mo.ClipNorm(0.1), where="fc.*"), mo.SGD(lr=0.1))
    before = copy.deepcopy(opt.param_groups)
    with pytest.raises(ValueError, match=r"0:Masked \(where=Select\(names=\['fc\.\*'\]\)\) selects parameters by "
                                         r"name, but 2 parameter\(s\) have no name"):
        opt.add_param_group({"params": list(extra.parameters())})
    assert len(opt.param_groups) == len(before)
    # a later group with names is fine, whatever its names (the patterns were checked at build)
    opt.add_param_group({"params": list(extra.parameters()), "names": ["x.weight", "x.bias"]})
    grads(m)
    for p in extra.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def test_check_selections_on_a_torch_optimizers_groups():
    """The same check over any optimizer's param groups (what `attach` could call)."""
    m = Net()
    opt = torch.optim.SGD(m.named_parameters(), lr=0.1)
    check_selections([mo.Masked(mo.ClipNorm(1.0), where="fc.*")], list(enumerate(opt.param_groups)))
    with pytest.raises(ValueError, match=r"names pattern 'nope' matches none"):
        check_selections([mo.Masked(mo.ClipNorm(1.0), where="nope")], list(enumerate(opt.param_groups)))


def test_attach_checks_the_names_when_attached():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    with pytest.raises(ValueError, match="names pattern 'nope' matches none"):
        mo.attach(opt, mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["nope"])))
    handle = mo.attach(opt, mo.Masked(mo.ClipNorm(1.0), where=mo.Select(names=["0.weight"])))
    handle.remove()
