"""Flat partitions (DeepSpeed ZeRO's 1-D shards marked by `ds_shape`, FSDP1's `FlatParameter`) are refused when the
optimizer is built by every transform whose result depends on a tensor's shape (`roles.ShapeDependent`,
`modopt.core.partitions`), and accepted by elementwise and global-scope pipelines.

A fake flat partition suffices: a 1-D parameter with `ds_shape` set to the full shape it stands for, as ZeRO-3
records it on each partitioned parameter.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import modopt as mo
from modopt.core import partitions
from modopt.core.roles import ShapeDependent

FULL = (4, 3)


def flat(shape=FULL) -> torch.nn.Parameter:
    """A rank's piece of a flattened `shape` tensor (here the whole of it, as one rank of one), marked as ZeRO-3 does."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape).reshape(-1))
    p.ds_shape = torch.Size(shape)
    p.grad = torch.randn(p.shape)
    return p


def whole(shape=FULL) -> torch.nn.Parameter:
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(*shape))
    p.grad = torch.randn(p.shape)
    return p


def build(named, *pipeline):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (lint and batch_dims readings: not what is tested here)
        return mo.Modular(named, *pipeline)


#: pipelines whose result depends on a tensor's shape: (pipeline, the refusing key, the clause of its reason)
REFUSED = {
    "Orthogonalize": ([mo.Orthogonalize(), mo.SGD(lr=0.1)], "0:Orthogonalize", "as a matrix"),
    "Muon": ([mo.Muon(lr=0.1)], "0:Muon", "as a matrix"),
    "Muon-batch_dims": ([mo.Muon(lr=0.1, batch_dims=1)], "0:Muon", "as a matrix"),
    "NorMuon": ([mo.Orthogonalize(), mo.NorMuon(), mo.SGD(lr=0.1)], "0:Orthogonalize", "as a matrix"),
    "NorMuon-alone": ([mo.NorMuon(), mo.SGD(lr=0.1)], "0:NorMuon", "as a matrix"),
    "AdaMuon": ([mo.AdaMuon(lr=0.1)], "0:AdaMuon", "as a matrix"),
    "MuonEq": ([mo.MuonEq(), mo.SGD(lr=0.1)], "0:MuonEq", "as a matrix"),
    "MuonPlus": ([mo.MuonPlus(), mo.SGD(lr=0.1)], "0:MuonPlus", "as a matrix"),
    "ShapeScale": ([mo.ShapeScale(), mo.SGD(lr=0.1)], "0:ShapeScale", "as a matrix"),
    "ClipNorm-tensor": ([mo.ClipNorm(1.0, scope="tensor"), mo.Adam()], "0:ClipNorm", "per tensor"),
    "ClipNorm-slices": ([mo.ClipNorm(1.0, scope="tensor", dim=1), mo.Adam()], "0:ClipNorm", "per slice"),
    "Normalize-default": ([mo.Normalize(), mo.SGD(lr=0.1)], "0:Normalize", "per tensor"),
    "Centralize-default": ([mo.Centralize(), mo.SGD(lr=0.1)], "0:Centralize", "per tensor"),
    "ClipNormByEMA-tensor": ([mo.ClipNormByEMA(scope="tensor"), mo.AdamW()], "0:ClipNormByEMA", "per tensor"),
    "AdaGC-default": ([mo.AdaGC(), mo.AdamW()], "0:AdaGC", "per tensor"),
    "Clippy-default": ([mo.SGD(lr=0.1), mo.Clippy()], "1:Clippy", "per tensor"),
    "ClipValueByPercentile-default": ([mo.ClipValueByPercentile(90), mo.SGD(lr=0.1)], "0:ClipValueByPercentile",
                                      "per tensor"),
    "OrthoGrad-tensor": ([mo.OrthoGrad(scope="tensor"), mo.SGD(lr=0.1)], "0:OrthoGrad", "per tensor"),
    "AGC": ([mo.AGC(0.01), mo.SGD(lr=0.1)], "0:AGC", "each unit"),
    "Cautious": ([mo.Adam(), mo.Cautious()], "1:Cautious", "count of kept elements"),
    "ScaledSign": ([mo.ScaledSign(), mo.SGD(lr=0.1)], "0:ScaledSign", "mean absolute value"),
    "ProjectNorm": ([mo.SGD(lr=0.1), mo.ProjectNorm(min_ndim=1)], "1:ProjectNorm", "norm ball"),
    "Masked-by-ndim": ([mo.Masked(mo.Adam(), where=mo.Select(min_ndim=1))], "0:Masked", "number of dims"),
    "inside-Chain": ([mo.Chain(mo.ClipNorm(1.0), mo.Normalize()), mo.SGD(lr=0.1)], "0:Chain/1:Normalize",
                     "per tensor"),
    "TorchOptimizer-Adafactor": ([mo.TorchOptimizer(torch.optim.Adafactor, lr=0.01)], "0:TorchOptimizer",
                                 "not known to be elementwise"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_shape_dependent_transform_refuses_a_flat_partition(case):
    pipeline, key, why = REFUSED[case]
    with pytest.raises(ValueError) as e:
        build([("layer.weight", flat())], *pipeline)
    msg = str(e.value)
    assert "'layer.weight'" in msg and "flat partition of shape (12,)" in msg and "(4, 3)" in msg, msg
    assert f"{key} " in msg and why in msg, msg


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_same_pipeline_takes_whole_tensors(case):
    """The control: each refused pipeline builds on the whole tensor, and on a 'partition' whose `ds_shape` is its
    own shape (a ZeRO-3 parameter gathered whole), so the refusal above is the flat partition's alone."""
    pipeline, _, _ = REFUSED[case]
    build([("layer.weight", whole())], *pipeline)
    gathered = whole()
    gathered.ds_shape = gathered.shape
    build([("layer.weight", gathered)], *pipeline)


ALLOWED = {
    "ClipNorm-global+Adam": [mo.ClipNorm(0.5), mo.Adam(lr=0.1)],
    "ClipNorm-group+AdamW": [mo.ClipNorm(0.5, scope="group"), mo.AdamW(lr=0.1)],
    "ZClip+AdamW": [mo.ZClip(warmup_steps=1), mo.AdamW(lr=0.1)],
    "ClipNormByEMA-global+SGD": [mo.ClipNormByEMA(), mo.SGD(lr=0.1, momentum=0.9)],
    "Normalize-global": [mo.Normalize(scope="global"), mo.SGD(lr=0.1)],
    "ClipValue+Sign": [mo.ClipValue(0.5), mo.Sign(), mo.SGD(lr=0.1)],
    "Cautious-none": [mo.Adam(lr=0.1), mo.Cautious("none")],
    "TorchOptimizer-RMSprop": [mo.ClipNorm(0.5), mo.TorchOptimizer(torch.optim.RMSprop, lr=0.01)],
    "Masked-by-name": [mo.Masked(mo.Muon(lr=0.1, weight_decay=0.0), where="*.matrix"),
                       mo.Masked(mo.AdamW(lr=0.1, weight_decay=0.0), where="*.flat")],
}


@pytest.mark.parametrize("case", list(ALLOWED))
def test_elementwise_and_global_pipelines_take_flat_partitions(case):
    """Elementwise rules and global- or group-scope statistics do not read a shape: a flat partition is stepped
    (a `Masked` branch of Muon that selects only whole matrices by name is fine too)."""
    p, m = flat(), whole()
    opt = build([("x.flat", p), ("x.matrix", m)], *ALLOWED[case])
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p.detach(), before)


def test_the_refusal_is_the_same_through_add_param_group_and_leaves_the_optimizer_as_it_was():
    opt = build([("w", whole())], mo.Muon(lr=0.1))
    with pytest.raises(ValueError, match=r"parameter 'extra.weight' is a flat partition.*0:Muon reads each"):
        opt.add_param_group({"params": [flat()], "param_names": ["extra.weight"]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [whole((2, 2))], "param_names": ["ok"]})  # a whole tensor is still welcome
    assert len(opt.param_groups) == 2


def test_an_unnamed_flat_partition_is_named_by_its_position():
    with pytest.raises(ValueError, match=r"parameter #1 \(unnamed\) is a flat partition"):
        build([whole(), flat()], mo.Normalize(), mo.SGD(lr=0.1))


def test_an_fsdp1_flat_parameter_is_a_flat_partition():
    pytest.importorskip("torch.distributed.fsdp._flat_param")
    from torch.distributed.fsdp._flat_param import FlatParameter

    fp = FlatParameter(torch.zeros(12), requires_grad=True)
    assert "FlatParameter" in partitions.flat_partition(fp)
    with pytest.raises(ValueError, match="FSDP1 FlatParameter"):
        build([fp], mo.Muon(lr=0.1))
    assert partitions.flat_partition(torch.nn.Parameter(torch.zeros(12))) is None


def test_without_the_check_the_flat_partition_would_be_silently_wrong(monkeypatch):
    """Why it is refused: with the check switched off, Muon builds and steps the flat piece as it is not a matrix
    (momentum times lr, no orthogonalization), far from the step of the tensor it stands for."""
    import modopt.core.modular as modular

    monkeypatch.setattr(modular, "check_flat_partitions", lambda *a: None)
    p, w = flat(), whole()
    with torch.no_grad():
        w.copy_(p.reshape(FULL))
    w.grad = p.grad.reshape(FULL).clone()
    a = build([("p", p)], mo.Muon(lr=0.1))
    b = build([("w", w)], mo.Muon(lr=0.1))
    a.step()
    b.step()
    assert (p.detach().reshape(FULL) - w.detach()).abs().max() > 1e-2


def test_each_shape_dependent_builtin_says_why_and_the_elementwise_ones_do_not_take_the_role():
    from modopt.core.registry import _TRANSFORMS

    takers = {n for n, c in _TRANSFORMS.items() if issubclass(c, ShapeDependent)}
    for name in ("Orthogonalize", "Muon", "NorMuon", "AdaMuon", "MuonEq", "MuonPlus", "ShapeScale", "AGC", "Cautious",
                 "ScaledSign", "ProjectNorm", "QKClip", "Masked", "ClipNorm", "Normalize", "ZClip"):
        assert name in takers, name
    for name in ("Adam", "AdamW", "SGD", "LR", "ClipValue", "Sign", "Grams", "WeightDecay", "SPAM", "Momentum"):
        assert name not in takers, name
    assert mo.ClipNorm(1.0).shape_dependence() is None  # global scope
    assert mo.ClipNorm(1.0, scope="group").shape_dependence() is None
    assert mo.Cautious("none").shape_dependence() is None


def test_attach_refuses_a_shape_dependent_transform_in_front_of_flat_partitions():
    """`mo.attach` is a door too: a per-tensor clip in front of a torch optimizer over a ZeRO-3 piece is refused
    when attached (nothing is hooked), and a global clip is attached."""
    p = flat()
    opt = torch.optim.AdamW([p], lr=0.1)
    with pytest.raises(ValueError, match=r"flat partition .*0:ClipNorm"):
        mo.attach(opt, mo.ClipNorm(1.0, scope="tensor"))
    assert not getattr(opt, "_modopt_attach_keys", set())
    handle = mo.attach(opt, mo.ClipNorm(1.0))
    opt.step()
    handle.remove()
