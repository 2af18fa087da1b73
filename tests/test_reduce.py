"""modopt/core/reduce.py: the `ord` vocabulary, the slice rule under `dim` / `inverse_dims` (a tensor
left with no slice dim is left alone; against torchzero and the spec), and the step's per-tensor norm memo
(`NormMemo`: never serves a norm written through ``.data``, is kept only across transforms that did not
write, and is fresh every step)."""

from __future__ import annotations

import json
import math
from typing import ClassVar

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from modopt.core.reduce import parse_ord, slice_dims
from modopt.core.registry import available, get_transform
from modopt.core.transform import Transform
from modopt.spec import adaptive as spec_adaptive
from modopt.spec import core as spec_core
from modopt.spec import ema as spec_ema
from modopt.spec import growth as spec_growth
from modopt.spec import percentile as spec_percentile
from modopt.spec.scope import slice_dims as spec_slice_dims
from families import close, run_vs_spec
from harness import Harness


#: every registered transform with an `ord` field (found, so that a new one is covered)
ORD_TRANSFORMS = sorted(n for n in available() if "ord" in get_transform(n).model_fields)
#: fields a transform needs besides `ord` (the rest are defaults)
REQUIRED = {"ClipNorm": {"max_norm": 0.5}}
#: spellings of p = inf that a field accepts (any case of torch's "inf", "infinity", "+inf")
INF_SPELLINGS = ["inf", float("inf"), "Infinity", "INF", "+inf", "linf"]


def make(name: str, ord):
    return get_transform(name)(**REQUIRED.get(name, {}), ord=ord)


def test_every_ord_field_is_covered():
    assert {"AutoClip", "ClipNorm", "ClipNormByEMA", "ClipNormGrowth", "HistClip", "Normalize", "NormalizeByEMA",
            "ZClip"} <= set(ORD_TRANSFORMS)


@pytest.mark.parametrize("name", ORD_TRANSFORMS)
@pytest.mark.parametrize("ord", INF_SPELLINGS, ids=repr)
def test_inf_spellings_build_the_canonical_transform(name, ord):
    t = make(name, ord)
    assert t.ord == "linf"
    assert t == make(name, "linf")
    assert t.to_dict()["ord"] == "linf"
    assert type(t).from_dict(t.to_dict()) == t  # a round trip is stable
    assert "linf" in repr(t)


@pytest.mark.parametrize("name", ORD_TRANSFORMS)
def test_yaml_inf_json_and_toml_configs_give_the_canonical_pipeline(name, tmp_path):
    canonical = mo.PipelineConfig(transforms=[make(name, "linf"), mo.SGD(lr=0.1)])
    extra = "".join(f", {k}: {v}" for k, v in REQUIRED.get(name, {}).items())
    texts = {
        "a.yaml": f"transforms:\n  - {{type: {name}, ord: .inf{extra}}}\n  - {{type: SGD, lr: 0.1}}\n",
        "b.yaml": f"transforms:\n  - {{type: {name}, ord: inf{extra}}}\n  - {{type: SGD, lr: 0.1}}\n",  # a YAML string
        "c.json": json.dumps({"transforms": [{"type": name, "ord": "inf", **REQUIRED.get(name, {})},
                                             {"type": "SGD", "lr": 0.1}]}),
        "d.json": json.dumps({"transforms": [{"type": name, "ord": math.inf, **REQUIRED.get(name, {})},
                                             {"type": "SGD", "lr": 0.1}]}),  # Python's json writes Infinity
        "e.toml": f'[[transforms]]\ntype = "{name}"\nord = inf\n'
                  + "".join(f"{k} = {v}\n" for k, v in REQUIRED.get(name, {}).items())
                  + '[[transforms]]\ntype = "SGD"\nlr = 0.1\n',
    }
    for fname, text in texts.items():
        p = tmp_path / fname
        p.write_text(text)
        cfg = mo.load_config(p)
        assert cfg == canonical, fname
        assert cfg.transforms[0].ord == "linf", fname
    # the dump is canonical in every format, and reads back as the same pipeline
    assert "ord: linf" in canonical.to_yaml()
    assert json.loads(canonical.to_json())["transforms"][0]["ord"] == "linf"
    assert 'ord = "linf"' in canonical.to_toml()
    for fmt in ("yaml", "json", "toml"):
        saved = canonical.save(tmp_path / f"out.{fmt}")
        assert mo.load_config(saved) == canonical
        assert mo.load_config(saved).to_dict() == canonical.to_dict()


def _run(t: mo.Transform, steps: int = 4) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = mo.Modular(model.parameters(), t, mo.SGD(lr=0.1))
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * (5.0 if k == 2 else 1.0)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], {k: v.clone() for k, v in opt.stats.items()}


@pytest.mark.parametrize("name", ORD_TRANSFORMS)
def test_inf_spellings_step_exactly_as_the_canonical_one(name):
    ref_params, ref_stats = _run(make(name, "linf"))
    for ord in ("inf", float("inf")):
        params, stats = _run(make(name, ord))
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), (name, ord)
        assert stats.keys() == ref_stats.keys()
        for k in stats:
            assert torch.equal(stats[k], ref_stats[k]), (name, ord, k)


def test_inf_is_the_max_norm_and_the_functional_layer_takes_it():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, -4.0])
    assert parse_ord("inf") == parse_ord("linf") == parse_ord(float("inf")) == math.inf
    assert float(mo.grad_norm([p], "inf")) == 4.0
    assert float(mo.clip_grad_norm_([p], 1.0, ord="inf")) == 4.0
    q = torch.nn.Parameter(torch.zeros(2))
    q.grad = torch.tensor([3.0, -4.0])
    mo.normalize_grads_([q], ord="inf")
    assert torch.equal(q.grad, torch.tensor([0.75, -1.0]))


@pytest.mark.parametrize("name", ORD_TRANSFORMS)
@pytest.mark.parametrize("bad", ["-inf", float("-inf"), "-Infinity", "l7", "nan", float("nan"), -2.0, True, None, [2]],
                         ids=repr)
def test_bad_ords_name_the_field(name, bad):
    with pytest.raises(pydantic.ValidationError, match=rf"{name}\.ord") as e:
        make(name, bad)
    if bad in ("-inf", "-Infinity") or (isinstance(bad, float) and bad == -math.inf):
        assert "no min-norm ord" in str(e.value)


@pytest.mark.parametrize("text", ["ord: -.inf", "ord: '-inf'", "ord: .nan", "ord: linfinity"])
def test_bad_ords_in_a_config_name_the_field(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(f"transforms:\n  - {{type: SGD, lr: 0.1}}\n  - {{type: Normalize, {text}}}\n")
    with pytest.raises(mo.ConfigError, match=r"transforms\.1\.ord"):
        mo.load_config(p)


F32_ULP = 2.0**-23
TOL = 4 * F32_ULP


# --- a small model with biases --------------------------------------------------------------------


class Net(torch.nn.Module):
    """conv (4-D weight, bias), Linear, LayerNorm (1-D weight and bias), Linear, and a 0-d scale."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(64, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
        )
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.body(x) * self.temperature


def model_grads(seed: int) -> list[torch.Tensor]:
    """The gradients of one batch (float32), in parameter order."""
    torch.manual_seed(seed)
    m = Net()
    x, y = torch.randn(8, 3, 6, 6), torch.randn(8, 3)
    ((m(x) - y) ** 2).mean().backward()
    return [p.grad.detach().clone() for p in m.parameters()]


SHAPES = [tuple(g.shape) for g in model_grads(0)]
assert {len(s) for s in SHAPES} == {0, 1, 2, 4}  # a scalar, biases and LayerNorm, Linear weights, a conv weight

#: (dim, inverse_dims); each leaves some tensors alone (the comment says which) and slices the others
DIMS = [
    (0, True),        # per output unit; 1-D and 0-d alone (gradient centralization's setting)
    (0, False),       # over dim 0: every tensor has it (a 1-D tensor is one slice)
    (1, False),       # per row of a weight; 1-D and 0-d alone
    (1, True),        # everything but dim 1; a 1-D tensor is one slice
    ((0, 1), True),   # spatial slices of the conv; 2-D, 1-D and 0-d alone
    ((2, 3), False),  # the conv's kernels; the rest alone
    (-1, False),      # over the last dim: every tensor has it
    ((1, 2, 3), False),
]


def torchzero():
    return pytest.importorskip("torchzero")


def through_torchzero(module, grads):
    """torchzero's output: parameters at 0 take `p <- 0 - update`, which is exact."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torchzero().Optimizer(params, module).step()
    return [-p.detach() for p in params]


def through_modopt(transform, grads):
    """modopt's output through `Modular.step` (`LR(1)` and parameters at 0: exact)."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    mo.Modular(params, transform, mo.LR(1.0)).step()
    return [-p.detach() for p in params]


def pair(name: str, dim, inverse: bool, max_norm: float = 0.8, ord=2.0, min_size=None):
    """The modopt transform and the torchzero module with the same settings (torchzero's defaults
    otherwise). `ClipNorm` takes `eps=0`: torchzero adds nothing to the norm."""
    tz = torchzero()
    size = {} if min_size is None else {"min_size": min_size}
    if name == "ClipNorm":
        return (mo.ClipNorm(max_norm, ord=ord, eps=0.0, scope="tensor", dim=dim, inverse_dims=inverse, **size),
                tz.m.ClipNorm(max_norm, ord=ord, dim=dim, inverse_dims=inverse, **size))
    if name == "Normalize":
        return (mo.Normalize(ord=ord, scope="tensor", dim=dim, inverse_dims=inverse, **size),
                tz.m.Normalize(ord=ord, dim=dim, inverse_dims=inverse, **size))
    return (mo.Centralize(scope="tensor", dim=dim, inverse_dims=inverse, **size),
            tz.m.Centralize(dim=dim, inverse_dims=inverse, **size))


def assert_matches(out, ref, inputs):
    for o, r, u in zip(out, ref, inputs):
        mag = u.abs().max().item() if u.numel() else 0.0
        torch.testing.assert_close(o, r, rtol=TOL, atol=TOL * mag)


# --- (1) torchzero ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dim,inverse", DIMS, ids=[f"dim={d}-inv={i}" for d, i in DIMS])
@pytest.mark.parametrize("name", ["ClipNorm", "Normalize", "Centralize"])
def test_equals_torchzero_on_a_model_with_biases(name, dim, inverse, seed):
    grads = model_grads(seed)
    if name == "Centralize":
        # torchzero's Centralize does not count a 0-d tensor as 1-D (its ClipNorm and Normalize do) and
        # fails on one under a negative dim; with `min_size=2` (the default of both) it is left alone
        scalar = [i for i, g in enumerate(grads) if g.dim() == 0]
        out = through_modopt(pair(name, dim, inverse)[0], grads)
        assert scalar and all(torch.equal(out[i], grads[i]) for i in scalar)
        grads = [g for g in grads if g.dim()]
    t, z = pair(name, dim, inverse)
    out, ref = through_modopt(t, grads), through_torchzero(z, grads)
    assert_matches(out, ref, grads)
    for g, o in zip(grads, out):  # the rule itself: no slice dim, no change (bit for bit)
        if slice_dims(g.dim(), dim, inverse) is None:
            assert torch.equal(o, g)


def test_the_model_exercises_both_sides_of_the_rule():
    """ClipNorm(0.8) under dim=0, inverse_dims=True clips some output units and leaves others, and
    the biases, the LayerNorm and the scalar are left alone (before the rule each of their elements
    was clipped to 0.8 in magnitude: a value clip)."""
    grads = model_grads(0)
    out = through_modopt(pair("ClipNorm", 0, True)[0], grads)
    changed = [not torch.equal(o, g) for o, g in zip(out, grads)]
    assert changed == [g.dim() >= 2 for g in grads]
    w = next(g for g in grads if g.shape == (16, 64))  # the first Linear's weight: rows on both sides of 0.8
    rows = torch.linalg.vector_norm(w, dim=1)
    assert (rows > 0.8).any() and (rows < 0.8).any()
    assert any(g.dim() == 1 and g.abs().max() > 0.8 for g in grads)  # a value clip would have changed it


def test_bit_for_bit_on_the_model():
    """What the tolerance above allows is not used here: the same float32 ops give the same bits."""
    grads = model_grads(0)
    for name in ("ClipNorm", "Normalize", "Centralize"):
        for dim, inverse in DIMS:
            t, z = pair(name, dim, inverse)
            gs = [g for g in grads if g.dim()] if name == "Centralize" else grads  # (as above)
            for o, r in zip(through_modopt(t, gs), through_torchzero(z, gs)):
                assert torch.equal(o, r), (name, dim, inverse)


@settings(max_examples=40)
@given(data=st.data())
def test_equals_torchzero_on_drawn_shapes(data):
    """Drawn shapes (0-d to 4-D), non-negative dims (torchzero does not resolve negative dims under
    `inverse_dims`, see docs/migration.md), `ord` and `min_size`."""
    torchzero()
    n = data.draw(st.integers(1, 4))
    shapes = [tuple(data.draw(st.lists(st.integers(1, 4), min_size=0, max_size=4))) for _ in range(n)]
    name = data.draw(st.sampled_from(["ClipNorm", "Normalize", "Centralize"]))
    if name == "Centralize":  # torchzero skips 0-d tensors there only; modopt counts them as 1-D (see the docs)
        shapes = [s or (1,) for s in shapes]
    dim = data.draw(st.one_of(st.integers(0, 4), st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True)
                              .map(tuple)))
    inverse = data.draw(st.booleans())
    ord = data.draw(st.sampled_from([1.0, 2.0, math.inf]))
    min_size = data.draw(st.sampled_from([1, 2, 3]))
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=g) for s in shapes]
    t, z = pair(name, dim, inverse, max_norm=0.7, ord=ord, min_size=min_size)
    assert_matches(through_modopt(t, grads), through_torchzero(z, grads), grads)


# --- (2) runtime == spec on the model's shapes ------------------------------------------------------


ONE_STEP = {
    "ClipNorm": lambda kw: (mo.ClipNorm(0.8, eps=0.0, **kw),
                            lambda us, go: spec_core.clip_norm(us, go, 0.8, eps=0.0, **kw)),
    "Normalize": lambda kw: (mo.Normalize(**kw), lambda us, go: spec_core.normalize(us, go, **kw)),
    "Centralize": lambda kw: (mo.Centralize(min_size=1, **kw),
                              lambda us, go: spec_core.centralize(us, go, min_size=1, **kw)),
    "ClipNormByRMS": lambda kw: (mo.ClipNormByRMS(0.1, **kw),
                                 lambda us, go: spec_core.clip_norm_by_rms(us, go, 0.1, **kw)),
    "ZScoreNormalize": lambda kw: (mo.ZScoreNormalize(**kw),
                                   lambda us, go: spec_adaptive.z_score_normalize(us, go, **kw)),
    "ClipValueByPercentile": lambda kw: (mo.ClipValueByPercentile(50, **kw),
                                         lambda us, go: spec_percentile.clip_value_by_percentile(us, go, 50, **kw)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim,inverse", DIMS, ids=[f"dim={d}-inv={i}" for d, i in DIMS])
@pytest.mark.parametrize("name", list(ONE_STEP))
def test_runtime_equals_spec_one_step(name, dim, inverse, dtype):
    kw = {"scope": "tensor", "dim": dim, "inverse_dims": inverse}
    t, ref_of = ONE_STEP[name](kw)
    grads = [g.to(dtype) for g in model_grads(1)]
    group_of = [0] * len(grads)
    out = Harness(t, [torch.zeros_like(g) for g in grads], group_of).step(grads)
    ref = ref_of([g.double() for g in grads], group_of)
    for o, r, g in zip(out, ref, grads):
        mag = g.double().abs().max().item()
        rel = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(o.double(), r, rtol=rel, atol=rel * mag), (name, o, r)
        if slice_dims(g.dim(), dim, inverse) is None:
            assert torch.equal(o, g) and torch.equal(r, g.double())


STATEFUL = {
    "ClipNormByEMA": lambda go, kw: (mo.ClipNormByEMA(beta=0.9, **kw), spec_ema.ClipNormByEMA(go, beta=0.9, **kw)),
    "NormalizeByEMA": lambda go, kw: (mo.NormalizeByEMA(beta=0.9, **kw), spec_ema.NormalizeByEMA(go, beta=0.9, **kw)),
    "ClipNormGrowth": lambda go, kw: (mo.ClipNormGrowth(**kw), spec_growth.ClipNormGrowth(go, **kw)),
    "HistClip": lambda go, kw: (mo.HistClip(warmup_steps=3, **kw), spec_adaptive.HistClip(go, warmup_steps=3, **kw)),
    "ZClip": lambda go, kw: (mo.ZClip(warmup_steps=3, **kw), spec_adaptive.ZClip(go, warmup_steps=3, **kw)),
}


@pytest.mark.parametrize("dim,inverse", [(0, True), (1, False), ((0, 1), True)])
@pytest.mark.parametrize("name", list(STATEFUL))
def test_runtime_equals_spec_stateful(name, dim, inverse):
    """50 steps (zeros, a spike, alternating signs) on the model's shapes, float64; the tensors with
    no slice dim come back unchanged at every step."""
    group_of = [0] * 4 + [1] * (len(SHAPES) - 4)
    kw = {"scope": "tensor", "dim": dim, "inverse_dims": inverse}
    t, ref = STATEFUL[name](group_of, kw)
    h = run_vs_spec(t, ref, SHAPES, group_of, torch.float64, seed=3)
    us = [torch.randn(s, dtype=torch.float64) * 100 for s in SHAPES]
    out = h.step(us)
    close(out, ref.step(us), torch.float64, rel=1e-9, floor=1e-9)
    for u, o in zip(us, out):
        if slice_dims(u.dim(), dim, inverse) is None:
            assert torch.equal(o, u)


# --- (3) the rule, runtime == spec --------------------------------------------------------------------


@given(ndim=st.integers(0, 5), dim=st.one_of(st.none(), st.integers(-6, 6), st.lists(st.integers(-6, 6), max_size=4)
                                               .map(tuple)), inverse=st.booleans())
def test_runtime_and_spec_slice_dims_agree(ndim, dim, inverse):
    a, b = slice_dims(ndim, dim, inverse), spec_slice_dims(ndim, dim, inverse)
    if ndim == 0:  # a 0-d tensor's one slice is the tensor: no dims to pass to a reduction
        assert (a is None) == (b is None) and a in (None, ()) and b in (None, [0])
    else:
        assert a == (tuple(b) if b is not None else None)


def test_the_rule_by_example():
    assert slice_dims(1, 0, True) is None            # a bias per output unit: alone
    assert slice_dims(1, 1, False) is None           # a bias has no dim 1: alone
    assert slice_dims(1, 0, False) == (0,)           # a bias over its only dim: one slice
    assert slice_dims(2, 0, True) == (1,)            # a weight per output unit
    assert slice_dims(2, (0, 1), True) is None       # every dim listed: alone
    assert slice_dims(4, (0, 1), True) == (2, 3)     # a conv's kernels
    assert slice_dims(2, -1, True) == (0,)           # negative dims are resolved first
    assert slice_dims(2, 5, False) is None           # no listed dim exists
    assert slice_dims(3, None, True) == (0, 1, 2)    # nothing listed, inverted: the whole tensor
    assert slice_dims(0, 0, False) == () and slice_dims(0, 0, True) is None  # 0-d: 1-D with one element
    assert mo.GradientCentralization().model_dump()["dim"] == 0  # Centralize(dim=0, inverse_dims=True)


def test_gradient_centralization_leaves_biases_alone_whatever_min_size():
    """GC (Yong et al. 2020) skips 1-D tensors; before the rule it did so only through `min_size=2`
    (each bias element was its own slice; `min_size=1` zeroed the bias)."""
    grads = model_grads(2)
    for t in (mo.GradientCentralization(), mo.GradientCentralization(min_size=1)):
        out = through_modopt(t, grads)
        for g, o in zip(grads, out):
            if g.dim() < 2:
                assert torch.equal(o, g)
            else:
                means = o.double().mean(dim=tuple(range(1, g.dim())))
                assert torch.allclose(means, torch.zeros_like(means), atol=1e-6 * g.abs().max().item())


def test_a_scale_before_a_slicing_normalize_is_kept_on_the_tensors_it_leaves_alone():
    """`Normalize` undoes a positive scale before it only on the tensors it changes, so the runner may
    leave out the scale (`modopt.lint.cancelled_scales`) only when no tensor is left alone by the one
    and changed by the other: the same slicing, or a slicing that leaves no tensor alone."""
    from modopt.lint import cancelled_scales

    per_unit = mo.Normalize(scope="tensor", dim=0, inverse_dims=True)
    assert cancelled_scales([mo.ClipNorm(1.0), per_unit], "skip") == frozenset()
    same = mo.ClipNorm(1.0, scope="tensor", dim=0, inverse_dims=True)
    assert cancelled_scales([same, per_unit], "skip") == {"0:ClipNorm"}
    assert cancelled_scales([mo.ClipNorm(1.0), mo.Normalize(scope="tensor", dim=0)], "skip") == {"0:ClipNorm"}
    grads = model_grads(0)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    mo.Modular(params, mo.ClipNorm(0.5, eps=0.0), per_unit, mo.LR(1.0)).step()
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for p, g in zip(params, grads):
        if g.dim() < 2:  # left alone by Normalize: the global clip's scale stays
            torch.testing.assert_close(-p.detach(), g * (0.5 / total), rtol=TOL, atol=0.0)


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
        seg = st.segments(mo.ClipNorm(1.0, scope="tensor"))
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


# --- Step.finite: a norm's finiteness and the device's decision -------------------------------------------
def test_finite_reuses_the_non_finite_checks_decision_for_its_own_total():
    from modopt.core import runner
    from modopt.core.step import Step

    p = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for g in ([torch.ones(3), torch.ones(2)], [torch.ones(3), torch.tensor([1.0, math.nan])]):
        for q, gr in zip(p, g):
            q.grad = gr
        ctx = Step.over(p)
        with runner.device_path():
            assert runner.apply_nonfinite_policy("skip", ctx, g, on_device=True)
        total = ctx.memo.total(g, 2.0, torch.float32)
        assert total is ctx.checked and ctx.finite(total) is ctx.proceed  # no op: the check's own test
        other = total * 2
        assert torch.equal(ctx.finite(other), (other < math.inf) & ctx.proceed)
        ctx.skip_also(torch.tensor(True))  # a later skip: the check's decision no longer says it all
        assert ctx.checked is None and not bool(ctx.finite(total))
        # a global segment's statistic is a view of the total: the same answer, in its shape
        ctx2 = Step.over(p)
        with runner.device_path():
            runner.apply_nonfinite_policy("skip", ctx2, g, on_device=True)
        seen = ctx2.memo.total(g, 2.0, torch.float32).reshape(1)
        assert seen.shape == (1,) and torch.equal(ctx2.finite(seen), ctx2.proceed.reshape(1))


def test_finite_is_none_where_the_host_read_the_checks_decision():
    """On a CPU the host read the check's total and the step went ahead: that total and its views are finite,
    known without an op (None); any other norm is still tested."""
    from modopt.core import runner
    from modopt.core.step import Step

    p = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    g = [torch.ones(3), torch.ones(2)]
    for q, gr in zip(p, g):
        q.grad = gr
    ctx = Step.over(p)
    assert runner.apply_nonfinite_policy("skip", ctx, g, on_device=True, host_on_cpu=True)
    assert ctx.skip is None and ctx.checked is not None
    total = ctx.memo.total(g, 2.0, torch.float32)
    assert ctx.finite(total) is None and ctx.finite(total.reshape(1)) is None
    inf = torch.tensor([math.inf])
    assert not bool(ctx.finite(inf)) and bool(ctx.finite(total * 2))
    bad = [torch.ones(3), torch.tensor([1.0, math.nan])]
    ctx = Step.over(p)
    assert not runner.apply_nonfinite_policy("skip", ctx, bad, on_device=True, host_on_cpu=True)  # not run at all
