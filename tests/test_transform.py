"""modopt/core/transform.py and modopt/core/fieldtext.py: what users type means what they expect.

Positional fields, printing, frozen fields, validation errors that name the transform and the field,
the trust boundary of `TorchOptimizer` built in code, and `help()`'s field text."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pydantic
import pytest
import torch

import modopt as mo
from modopt.core import registry

DOCS = Path(__file__).resolve().parent.parent / "docs"
_STATED = re.compile(r"`(mo\.(\w+)\([^`]*\))` is `(mo\.\w+\((\w+)=[^`]*\))`")
_NONE = re.compile(r"`mo\.(\w+)\(\)` takes no positional argument")


def _doc_statements():
    """``{name: [(call, keyword_call, field)]}`` and the names documented as taking none: the hand-written
    pages, and the sections the site's build writes for the transforms no page documents by hand
    (docs/hooks/transforms.py's ``section``)."""
    stated: dict[str, list] = {}
    none: set[str] = set()
    spec = importlib.util.spec_from_file_location("modopt_docs_hook_transforms", DOCS / "hooks" / "transforms.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    pages = [path.read_text() for path in [*sorted((DOCS / "modules").glob("*.md")), DOCS / "concepts.md"]]
    pages += [hook.section(n) for path in sorted((DOCS / "modules").glob("*.md")) for n in hook.generated(path.name)]
    for text in pages:
        for line in text.split("\n\n"):
            line = " ".join(line.split())
            if "Positional argument" not in line and "positionally" not in line:
                continue
            for call, name, kw_call, field in _STATED.findall(line):
                stated.setdefault(name, []).append((call, kw_call, field))
            none.update(_NONE.findall(line))
    return stated, none


def test_every_transform_declares_its_positional_field_and_the_docs_state_it():
    stated, none = _doc_statements()
    ns = {"mo": mo, "torch": torch}
    builtin = [n for n in mo.available() if registry.get_transform(n).__module__.startswith("modopt.")]
    assert len(builtin) >= 25
    for name in builtin:
        cls = registry.get_transform(name)
        assert "positional" in cls.__dict__, f"{name} does not state `positional` in its own body"
        field = cls.positional
        if field is None:
            assert name in none, f"docs do not say that {name} takes no positional argument"
            assert name not in stated
            with pytest.raises(TypeError, match="takes no positional arguments"):
                cls(1.0)
            continue
        assert name in stated, f"docs do not state the positional argument of {name} ({field})"
        for call, kw_call, doc_field in stated[name]:
            assert doc_field == field, f"docs say {name}'s positional field is {doc_field}, the class says {field}"
            assert eval(call, ns) == eval(kw_call, ns), call  # the documented example means what it says


def test_optimizers_take_lr_first_clips_their_threshold_emas_beta():
    assert mo.AdamW(3e-4).lr == 3e-4 and mo.AdamW(3e-4).weight_decay == 1e-2
    assert mo.Adam(1e-3).lr == 1e-3 and mo.SGD(0.1).lr == 0.1 and mo.LR(0.1).lr == 0.1
    assert mo.ClipNorm(0.5).max_norm == 0.5 and mo.ClipValue(0.5).value == 0.5
    assert mo.NormalizeByEMA(0.95).beta == 0.95 and mo.ClipNormByEMA(0.95).beta == 0.95
    assert mo.ClipValueByEMA(0.95).beta == 0.95
    assert mo.ClipNormGrowth(2.0).mul == 2.0
    with pytest.raises(TypeError, match="GradientCentralization takes no positional"):
        mo.GradientCentralization(0)


def test_forgetting_positional_is_an_error_at_class_definition():
    with pytest.raises(TypeError, match=r"Forgetful does not say which field.*positional = 'factor'"):
        class Forgetful(mo.Transform):
            factor: float = 1.0

    with pytest.raises(TypeError, match="not one of its fields.*did you mean 'factor'"):
        class Typo(mo.Transform):
            factor: float = 1.0
            positional = "factr"

    class _Sub(mo.ClipNorm):  # inherits ClipNorm's statement
        pass

    assert _Sub(2.0).max_norm == 2.0


def test_repr_shows_class_and_non_default_fields():
    assert repr(mo.ClipNorm(1.0)) == "ClipNorm(max_norm=1.0)"
    assert str(mo.Adam()) == "Adam()"
    assert repr(mo.AdamW(3e-4)) == "AdamW(lr=0.0003)"
    assert repr(mo.Chain(mo.ClipNorm(1.0), mo.Adam())) == "Chain(ClipNorm(max_norm=1.0), Adam())"
    assert repr(mo.ClipNormByEMA(scope="tensor")) == "ClipNormByEMA(scope='tensor')"
    cfg = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0), mo.Adam()])
    assert repr(cfg) == "PipelineConfig(ClipNorm(max_norm=1.0), Adam())"
    assert str(mo.PipelineConfig(transforms=[mo.LR(0.1)], nonfinite="zero")) == "PipelineConfig(LR(lr=0.1), nonfinite='zero')"
    model = torch.nn.Linear(2, 1)
    h = mo.attach(torch.optim.SGD(model.parameters(), lr=0.1), mo.ClipNorm(1.0))
    assert repr(h) == "AttachHandle(SGD, ClipNorm(max_norm=1.0))"
    h.remove()
    assert repr(h) == "AttachHandle(SGD, ClipNorm(max_norm=1.0); removed)"


def test_frozen_assignment_says_how_to_change_it():
    t = mo.ClipNorm(1.0)
    with pytest.raises(pydantic.ValidationError, match=r"ClipNorm is frozen.*model_copy\(update=\{'max_norm': 2.0\}\)"):
        t.max_norm = 2.0
    assert t.model_copy(update={"max_norm": 2.0}) == mo.ClipNorm(2.0)
    with pytest.raises(pydantic.ValidationError, match=r"ClipNorm.max_norm: Input should be greater than 0"):
        t.model_copy(update={"max_norm": -1.0})  # a copy is validated like a new instance
    with pytest.raises(TypeError, match="did you mean 'max_norm'"):
        t.model_copy(update={"max_nrom": 2.0})


def test_python_side_validation_errors_name_transform_and_field():
    with pytest.raises(pydantic.ValidationError) as info:
        mo.ClipNorm(max_norm=-1)
    msg = str(info.value)
    assert msg == "ClipNorm.max_norm: Input should be greater than 0 (got -1)"
    err = info.value.errors()[0]
    assert err["loc"] == ("max_norm",) and err["type"] == "greater_than"
    with pytest.raises(pydantic.ValidationError, match=r"^Adam.betas: betas\[1\] must be in \[0, 1\)"):
        mo.Adam(betas=(0.9, 1.0))


# --- the trust boundary (item 3) -------------------------------------------------------------
class _InCodeOptimizer(torch.optim.SGD):
    """A user optimizer class defined outside torch.optim (module level: importable by path)."""


def test_torch_optimizer_built_in_code_does_not_widen_the_allow_list():
    before = dict(registry._OPTIMIZERS)
    t = mo.TorchOptimizer(_InCodeOptimizer, lr=0.1)
    t2 = mo.TorchOptimizer(cls=_InCodeOptimizer, kwargs={"lr": 0.1})
    assert registry._OPTIMIZERS == before
    assert t._cls is _InCodeOptimizer and t2._cls is _InCodeOptimizer and t == t2
    # the in-code instance works
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = mo.Modular([p], t)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.9))
    # ... a changed copy keeps the class, still without registering it
    assert t.model_copy(update={"kwargs": {"lr": 0.2}})._cls is _InCodeOptimizer
    assert registry._OPTIMIZERS == before
    # a config may not name the class: the round trip says to register it
    data = opt.config.to_dict()
    with pytest.raises(pydantic.ValidationError, match=r"mo.register_optimizer\(_InCodeOptimizer\)"):
        mo.PipelineConfig.from_dict(data)
    with pytest.raises(pydantic.ValidationError, match="not allowed"):
        mo.TorchOptimizer(f"{__name__}._InCodeOptimizer")
    assert mo.PipelineConfig.from_dict(data, trust_imports=True).transforms[0]._cls is _InCodeOptimizer
    assert registry._OPTIMIZERS == before
    try:
        mo.register_optimizer(_InCodeOptimizer)
        assert mo.PipelineConfig.from_dict(data).transforms[0] == t
    finally:
        registry._OPTIMIZERS.pop(registry.class_path(_InCodeOptimizer), None)


def test_torch_optimizer_local_class_round_trip_says_to_register():
    class Local(torch.optim.SGD):
        pass

    t = mo.TorchOptimizer(Local, lr=0.1)
    assert t._cls is Local
    with pytest.raises(pydantic.ValidationError, match=r"defined inside a function.*mo.register_optimizer\(Local\)"):
        mo.PipelineConfig.from_dict({"transforms": [t.to_dict()]}, trust_imports=True)
    with pytest.raises(pydantic.ValidationError, match="torch.optim.Optimizer subclass"):
        mo.TorchOptimizer(int)


def test_a_misspelled_field_gets_a_suggestion_and_one_error():
    with pytest.raises(pydantic.ValidationError, match=r"ClipNorm.max_nrom: unknown field \(did you mean 'max_norm'\?\)") as e:
        mo.ClipNorm(max_nrom=1.0)
    assert [err["type"] for err in e.value.errors()] == ["extra_forbidden"]  # not also "max_norm: Field required"
    with pytest.raises(pydantic.ValidationError, match=r"ClipNorm.bogus: unknown field; the fields: max_norm"):
        mo.ClipNorm(1.0, bogus=3)


def test_a_tensor_for_a_field_is_refused_with_where_it_belongs():
    with pytest.raises(TypeError, match=r"Adam.lr: got a tensor.*opt.param_groups\[i\]\['lr'\]"):
        mo.Adam(lr=torch.tensor(1e-3))
    with pytest.raises(TypeError, match="ClipNorm.max_norm: got a tensor"):
        mo.ClipNorm(torch.tensor(1.0))
    for betas in [(0.9, torch.tensor(0.99)), (torch.tensor(0.9), 0.99)]:  # (they became floats silently)
        with pytest.raises(TypeError, match=r"Adam.betas: got a tensor in betas.*give betas=\(0\.\d+, 0\.\d+\)"):
            mo.Adam(betas=betas)


@pytest.mark.parametrize("make", [lambda: mo.ClipNorm(True), lambda: mo.ZClip(warmup_steps=False),
                                  lambda: mo.Adam(lr=True), lambda: mo.ClipNorm(1.0, ord=True)],
                         ids=["max_norm", "warmup_steps", "lr", "ord"])
def test_a_bool_where_a_number_is_needed_is_refused(make):
    with pytest.raises(pydantic.ValidationError, match=r"a number is needed, got (True|False) \(a bool\)"):
        make()


def test_bool_fields_still_take_bools():
    assert mo.Adam(amsgrad=True).amsgrad is True and mo.SGD(lr=0.1, momentum=0.9, nesterov=True).nesterov is True


@pytest.mark.parametrize("make, match", [
    (lambda: mo.ClipNorm("1"), "got the string '1'"),
    (lambda: mo.Adam(lr="1e-3"), "got the string '1e-3'"),
    (lambda: mo.ZClip(warmup_steps="25"), "got the string '25'"),
    (lambda: mo.Normalize(norm_value=float("inf")), "finite number"),
    (lambda: mo.ClipNorm(float("nan")), "finite number"),
    (lambda: mo.Adam(eps=float("inf")), "finite number"),
    (lambda: mo.ZClip(warmup_steps=10**30), "below 2\\*\\*62"),
    (lambda: mo.ZClip(warmup_steps=1e30), "below 2\\*\\*62"),
], ids=["str-max_norm", "str-lr", "str-count", "inf-norm_value", "nan-max_norm", "inf-eps", "huge-int", "huge-float-count"])
def test_strings_non_finite_values_and_huge_counts_are_refused(make, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        make()


def test_string_fields_and_infinite_orders_still_work():
    assert mo.ClipNorm(1.0, ord="l1").ord == 1.0 or mo.ClipNorm(1.0, ord="l1").ord == "l1"
    assert mo.ClipNorm(1.0, ord=float("inf")) == mo.ClipNorm(1.0, ord="linf")
    assert mo.ClipNorm(1.0, scope="tensor").scope == "tensor"


def test_exponent_numbers_in_yaml_are_floats_as_in_yaml_1_2(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("transforms:\n  - {type: ClipNorm, max_norm: 1e0}\n  - {type: Adam, lr: 3e-4, eps: .1e-7}\n")
    opt = mo.Modular([torch.nn.Parameter(torch.zeros(2))], config=str(path))
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["eps"] == 1e-8
    path.write_text("transforms:\n  - {type: Adam, lr: '3e-4'}\n")  # quoted: a string, refused
    with pytest.raises(Exception, match="got the string '3e-4'"):
        mo.Modular([torch.nn.Parameter(torch.zeros(2))], config=str(path))


def test_help_shows_each_field_with_its_type_in_words_and_its_default():
    import inspect

    sig = inspect.signature(mo.ZClip)
    assert str(sig.parameters["alpha"]) == "alpha: 'float, 0.0 <= x < 1.0' = 0.97"
    assert str(sig.parameters["scope"]) == "scope: \"'global' | 'group' | 'tensor'\" = 'global'"
    pos = inspect.signature(mo.ClipNorm).parameters["max_norm"]
    assert pos.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and pos.default is inspect.Parameter.empty
    assert "Annotated" not in str(inspect.signature(mo.Masked)) and "function" not in str(sig)


# --- what a first hour trips on: suggestions, each error once, bounds as written ----------------
def test_did_you_mean_ignores_case():
    from modopt.core.transform import closest, did_you_mean

    # compared as written, `Adamw` is closer to `Adam` (drop a letter) than to `AdamW` (change a case)
    assert did_you_mean("Adamw", mo.available()) == " (did you mean 'AdamW'?)"
    assert closest("adamw", mo.available()) == "AdamW" and closest("zclip", mo.available()) == "ZClip"
    assert closest("ClipNrom", mo.available()) == "ClipNorm" and closest("qwerty", mo.available()) is None
    with pytest.raises(pydantic.ValidationError, match=r"Adam.Amsgrad: unknown field \(did you mean 'amsgrad'\?\)"):
        mo.Adam(Amsgrad=True)
    # a config's type, in the library and through `modopt validate`'s loader; nothing is built
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(mo.ConfigError, match=r"transforms.0: unknown transform type 'Adamw' \(did you mean 'AdamW'\?\)"):
        mo.Modular.from_config(model.parameters(), {"transforms": [{"type": "Adamw", "lr": 0.1}]})
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_validation_error_states_each_error_once_with_the_value():
    with pytest.raises(pydantic.ValidationError) as info:
        mo.Adam(amsgrad="yes")
    text = str(info.value)
    assert text == "Adam.amsgrad: true or false is needed, not str (got 'yes')"  # (pydantic's text said it twice)
    assert info.value.errors()[0]["loc"] == ("amsgrad",) and info.value.title == "Adam"
    with pytest.raises(pydantic.ValidationError) as info:
        mo.Adam(amsgrad="yes", lr=-1)
    lines = str(info.value).splitlines()
    assert lines == ["2 errors in Adam:", "  Adam.lr: Input should be greater than or equal to 0 (got -1)",
                     "  Adam.amsgrad: true or false is needed, not str (got 'yes')"]
    # a message that names the value already is not followed by it again
    with pytest.raises(pydantic.ValidationError) as info:
        mo.ZClip(warmup_steps=2**62)
    assert str(info.value) == "ZClip.warmup_steps: a count below 2**62 is needed, got 4611686018427387904"
    # a changed copy that is refused leaves the original as it was
    t = mo.ClipNorm(1.0)
    with pytest.raises(pydantic.ValidationError) as info:
        t.model_copy(update={"max_norm": -2.0})
    assert str(info.value) == "ClipNorm.max_norm: Input should be greater than 0 (got -2.0)" and t.max_norm == 1.0


def test_a_validation_error_pickles_whole():
    import pickle

    with pytest.raises(pydantic.ValidationError) as info:
        mo.Adam(amsgrad="yes", lr=-1)
    back = pickle.loads(pickle.dumps(info.value))  # (a worker process sends its error back this way)
    assert isinstance(back, pydantic.ValidationError) and str(back) == str(info.value)
    assert back.errors() == info.value.errors()


def test_modopt_validate_states_each_error_once(tmp_path, capsys):
    from modopt.cli import main as cli_main

    path = tmp_path / "c.yaml"
    path.write_text("transforms:\n  - {type: Adam, amsgrad: yes2}\n  - {type: Adamw}\n")
    before = path.read_bytes()
    assert cli_main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("true or false is needed") == 1 and "Value error" not in err
    assert "transforms.0.amsgrad: true or false is needed, not str" in err
    assert "transforms.1: unknown transform type 'Adamw' (did you mean 'AdamW'?)" in err
    assert path.read_bytes() == before


def test_bounds_read_as_a_user_writes_them():
    import inspect

    from modopt.core.fieldtext import format_range, number_text

    assert [number_text(v) for v in (2**62, 2**63 - 1, 2.0**64, -2**63, 2**20, 65535, 100, 0.5, 1e-6)] == [
        "2**62", "2**63 - 1", "2**64", "-2**63", "2**20", "65535", "100", "0.5", "1e-06"]
    assert format_range({"ge": 0, "lt": 2**62}) == "0 <= x < 2**62"
    # every field's range in help() and `modopt modules` (the same text): no int64-sized literal
    for name in mo.available():
        for pname, param in inspect.signature(registry.get_transform(name)).parameters.items():
            assert not re.search(r"\d{7,}", str(param.annotation)), (name, pname, param.annotation)
    # AdaGC's count is bounded where every count field is (the check before the field's own)
    assert str(inspect.signature(mo.AdaGC).parameters["warmup_steps"].annotation) == "int, 0 <= x < 2**62"
    # and the errors say it the same way
    with pytest.raises(pydantic.ValidationError, match=r"^SPAM.warmup_steps: Input should be less than 2\*\*20 \(got 1048576\)$"):
        mo.SPAM(warmup_steps=2**20)


def test_help_of_every_transform_is_no_longer_than_torchs_adamw_and_opens_with_its_fields():
    """`help(mo.X)` lists what modopt's classes define, not the members every pydantic model inherits: each
    registered transform's page is at most `help(torch.optim.AdamW)`'s length, and its first lines give the
    signature (fields with defaults) and then the docstring. pydantic's methods stay callable."""
    import pydoc

    def page(obj) -> list[str]:
        return pydoc.render_doc(obj, renderer=pydoc.plaintext).splitlines()

    limit = len(page(torch.optim.AdamW))
    too_long = {n: len(page(c)) for n, c in registry._TRANSFORMS.items() if len(page(c)) > limit}
    assert not too_long, f"help() longer than torch.optim.AdamW's {limit} lines: {too_long}"
    head = page(mo.ZClip)[:6]
    assert head[3].startswith(" |  ZClip(*, ") and "alpha: 'float, 0.0 <= x < 1.0' = 0.97" in head[3], head
    assert mo.ZClip.__doc__.splitlines()[0] in head[5]
    assert "model_validate_json" not in dir(mo.ZClip) and "alpha" in dir(mo.ZClip) and "to_dict" in dir(mo.ZClip)
    assert mo.ZClip.model_validate_json('{"alpha": 0.9}') == mo.ZClip(alpha=0.9)
