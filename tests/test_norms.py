"""modopt/core/norms.py, the `ord` vocabulary.

`ord="inf"`: every `ord` field takes torch's spelling of the max-norm (`"inf"`), `float("inf")` and YAML's `.inf`, stores and writes the canonical `"linf"`, and refuses `-inf` (there is no min-norm `ord`)."""

from __future__ import annotations

import json
import math

import pydantic
import pytest
import torch

import modopt as mo
from modopt.core.norms import parse_ord
from modopt.core.registry import available, get_transform

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
