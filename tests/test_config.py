"""Transforms as pydantic models, pipeline configs (YAML/JSON/TOML), schema, import trust."""

from __future__ import annotations

import json
import math

import pydantic
import pytest
import torch

import modopt as mo
from examples import NON_DEFAULT, all_examples, instances, pipeline_for
from modopt.cli import main as cli_main

FORMATS = ["yaml", "json", "toml"]


# --- Transform basics --------------------------------------------------------------


def test_fields_are_validated_on_construction():
    with pytest.raises(pydantic.ValidationError, match="max_norm"):
        mo.ClipNorm(max_norm=-1)
    with pytest.raises(pydantic.ValidationError, match="ord"):
        mo.ClipNorm(1.0, ord="l7")
    with pytest.raises(pydantic.ValidationError, match="ord"):
        mo.Normalize(ord=-2)
    with pytest.raises(pydantic.ValidationError, match="scope"):
        mo.ClipNorm(1.0, scope="layer")
    with pytest.raises(pydantic.ValidationError, match="dim/inverse_dims apply only with scope='tensor'"):
        mo.ClipNorm(1.0, dim=0)
    with pytest.raises(pydantic.ValidationError, match=r"ClipNorm.max_nrom: unknown field \(did you mean 'max_norm'\?\)"):
        mo.ClipNorm(1.0, max_nrom=2.0)
    with pytest.raises(pydantic.ValidationError, match="betas"):
        mo.Adam(betas=(0.9, 1.0))
    with pytest.raises(pydantic.ValidationError, match="nesterov"):
        mo.SGD(lr=0.1, nesterov=True)


def test_first_field_positional_frozen_repr_equality():
    a = mo.ClipNorm(1.0)
    assert a.max_norm == 1.0
    assert mo.ClipNorm(1.0) == mo.ClipNorm(max_norm=1) and mo.ClipNorm(1.0) != mo.ClipNorm(2.0)
    assert hash(mo.ClipNorm(1.0)) == hash(mo.ClipNorm(max_norm=1.0))
    with pytest.raises(pydantic.ValidationError):
        a.max_norm = 2.0  # frozen
    assert repr(mo.ClipNorm(1.0)) == "ClipNorm(max_norm=1.0)"  # non-default fields only
    assert repr(mo.ClipNorm(1.0, scope="tensor", eps=0)) == "ClipNorm(max_norm=1.0, eps=0.0, scope='tensor')"
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        mo.ClipNorm(1.0, 2.0)
    with pytest.raises(TypeError, match="both positionally and by name"):
        mo.ClipNorm(1.0, max_norm=2.0)
    assert mo.Normalize(2.0).norm_value == 2.0
    assert mo.LR(0.1).lr == 0.1


def test_registry_lists_every_transform_and_flat_exports():
    names = mo.available()
    for n in ["ClipValue", "ClipNorm", "Normalize", "Centralize", "GradientCentralization", "Identity",
              "SGD", "Adam", "AdamW", "LR", "TorchOptimizer", "Chain"]:
        assert n in names
        assert getattr(mo, n).__name__ == n
    assert names == sorted(names)


def test_gradient_centralization_is_centralize_dim0_inverse():
    gc = mo.GradientCentralization()
    assert (gc.dim, gc.inverse_dims, gc.scope, gc.min_size) == (0, True, "tensor", 2)


def test_chain_nests_and_user_subclasses_register():
    c = mo.Chain(mo.ClipNorm(1.0), mo.Chain(mo.Normalize()))
    assert isinstance(c.transforms[1], mo.Chain)

    class DoubleIt(mo.Transform):
        factor: float = 2.0
        positional = "factor"

        def apply(self, ctx, st, updates):
            torch._foreach_mul_(updates, self.factor)
            return updates

    assert "DoubleIt" in mo.available()
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    mo.Modular([p], c, DoubleIt(), mo.LR(1.0)).step()
    torch.testing.assert_close(p.detach(), -2 * torch.ones(2) / math.sqrt(2))


# --- round trips --------------------------------------------------------------------


def _train(opt, model, steps=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


EXAMPLES = all_examples()


@pytest.mark.parametrize("name,t", EXAMPLES, ids=[e[0] for e in EXAMPLES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_config_round_trip_rebuilds_same_trajectory(name, t, fmt, tmp_path):
    cfg = mo.PipelineConfig(transforms=pipeline_for(t), nonfinite="zero")
    path = cfg.save(tmp_path / f"cfg.{fmt}")
    back = mo.load_config(path)
    assert back == cfg
    assert back.to_dict() == cfg.to_dict()
    ma, mb = _model(), _model()
    pa = _train(cfg.build(ma.named_parameters()), ma)
    pb = _train(mo.Modular.from_config(mb.named_parameters(), path), mb)
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)


def test_non_default_examples_really_are_non_default():
    for name in NON_DEFAULT:
        ts = instances(name)
        cls = type(ts[0])
        for field, info in cls.model_fields.items():
            if info.is_required() or name in ("Chain", "TorchOptimizer", "Identity"):
                continue
            if field == "fold_clip":  # needs a global clip before it (the examples run alone):
                continue  # tests/test_fold_clip.py sets it, round trip included
            if field in ("capturable", "differentiable"):  # capturable runs on CUDA only (torch refuses a CPU
                continue  # tensor), differentiable=True is refused: tests/test_kernel_choice.py checks both
            if name == "AdamW" and field == "decoupled_weight_decay":  # fixed to True (Adam has it free)
                continue
            default = info.get_default(call_default_factory=True)
            ok = False
            for t in ts:
                if field in ("dim", "inverse_dims") and getattr(t, "scope", "tensor") != "tensor":
                    ok = True  # only meaningful (and only allowed) with scope="tensor"
                elif field == "scope" and getattr(t, "dim", None) is not None:
                    ok = True  # dims need scope="tensor", whatever the default
                elif getattr(t, field) != default:
                    ok = True
            assert ok, f"{name}.{field} is at its default in every example"


def test_every_registered_transform_has_a_non_default_example():
    missing = [n for n in mo.available() if n not in NON_DEFAULT and not n.startswith("_")]
    user_defined = {"DoubleIt"}  # defined inside a test above
    assert set(missing) <= user_defined, f"add these to tests/examples.py NON_DEFAULT: {missing}"


def test_opt_config_rebuilds_the_optimizer():
    model = _model()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(0.5, ord="linf"), mo.Adam(lr=0.01), lr=0.02, nonfinite="raise")
    cfg = opt.config
    assert isinstance(cfg, mo.PipelineConfig)
    assert cfg.nonfinite == "raise" and cfg.defaults == {"lr": 0.02}
    rebuilt = cfg.build(_model().parameters())
    assert rebuilt.config == cfg and rebuilt.param_groups[0]["lr"] == 0.02
    yaml_text = cfg.to_yaml()
    assert "type: ClipNorm" in yaml_text and "linf" in yaml_text
    assert json.loads(cfg.to_json())["transforms"][1]["type"] == "Adam"


def test_infinite_values_round_trip(tmp_path):
    cfg = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0, ord=math.inf), mo.SGD(lr=0.1)])
    for fmt in FORMATS:
        assert mo.load_config(cfg.save(tmp_path / f"c.{fmt}")) == cfg


# --- invalid configs -------------------------------------------------------------------


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_negative_max_norm_names_the_field(tmp_path):
    p = write(tmp_path, "c.yaml", "transforms:\n  - {type: SGD, lr: 0.1}\n  - {type: ClipNorm, max_norm: -1}\n")
    with pytest.raises(mo.ConfigError, match=r"transforms\.1\.max_norm"):
        mo.load_config(p)


def test_unknown_type_lists_known_types(tmp_path):
    p = write(tmp_path, "c.json", json.dumps({"transforms": [{"type": "ClipNrom", "max_norm": 1}]}))
    with pytest.raises(mo.ConfigError, match=r"unknown transform type 'ClipNrom' \(did you mean 'ClipNorm'\?\); known types: .*ClipNorm"):
        mo.load_config(p)


def test_unknown_field_is_named(tmp_path):
    p = write(tmp_path, "c.toml", 'transforms = [{type = "ClipNorm", max_norm = 1.0, max_nrom = 2.0}]\n')
    with pytest.raises(mo.ConfigError, match=r"transforms\.0\.max_nrom"):
        mo.load_config(p)


def test_bad_yaml_names_the_line(tmp_path):
    p = write(tmp_path, "c.yaml", "transforms:\n  - type: ClipNorm\n    max_norm: [1.0\n  - type: SGD\n")
    with pytest.raises(mo.ConfigError, match=r"c\.yaml, line \d+, column \d+: invalid YAML"):
        mo.load_config(p)


def test_bad_json_and_toml_name_the_place(tmp_path):
    with pytest.raises(mo.ConfigError, match=r"line 1, column \d+: invalid JSON"):
        mo.load_config(write(tmp_path, "c.json", '{"transforms": [}'))
    with pytest.raises(mo.ConfigError, match=r"invalid TOML.*line 2"):
        mo.load_config(write(tmp_path, "c.toml", "nonfinite = 'skip'\ntransforms = = [\n"))
    with pytest.raises(mo.ConfigError, match="unknown config format"):
        mo.load_config(write(tmp_path, "c.ini", "x"))
    with pytest.raises(mo.ConfigError, match="cannot read"):
        mo.load_config(tmp_path / "missing.yaml")


def test_invalid_config_never_half_builds(tmp_path):
    p = write(tmp_path, "c.yaml", "transforms:\n  - {type: ClipNorm, max_norm: 1}\n  - {type: Adam, lr: -1}\n")
    model = _model()
    with pytest.raises(mo.ConfigError, match=r"transforms\.1\.lr"):
        mo.Modular.from_config(model.parameters(), p)
    # a param-group key modopt does not know is kept, as torch.optim keeps it (issue 11 item 4) ...
    opt = mo.PipelineConfig(transforms=[mo.Adam()]).build([{"params": model.parameters(), "swa_lr": 0.5}])
    assert opt.param_groups[0]["swa_lr"] == 0.5
    # ... one that names a hyperparameter no transform of the pipeline reads is refused (issue 26 item 7)
    with pytest.raises(ValueError, match=r"param group 0: no transform of this pipeline reads 'nesterov'"):
        mo.PipelineConfig(transforms=[mo.Adam()]).build([{"params": model.parameters(), "nesterov": True}])


def test_yaml_is_loaded_safely(tmp_path):
    p = write(tmp_path, "c.yaml", "transforms: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(mo.ConfigError, match="invalid YAML"):
        mo.load_config(p)


# --- TorchOptimizer import trust ---------------------------------------------------------


class MySGD(torch.optim.SGD):
    pass


def test_torch_optimizer_imports_only_allowed_paths(tmp_path):
    ok = write(tmp_path, "ok.yaml", "transforms:\n  - {type: TorchOptimizer, cls: torch.optim.Adagrad, kwargs: {lr: 0.1}}\n")
    cfg = mo.load_config(ok)
    assert cfg.transforms[0].cls == "torch.optim.Adagrad"
    path = f"{MySGD.__module__}.MySGD"
    bad = write(tmp_path, "bad.yaml", f"transforms:\n  - {{type: TorchOptimizer, cls: {path}, kwargs: {{lr: 0.1}}}}\n")
    with pytest.raises(mo.ConfigError, match=r"transforms\.0\.cls.*not allowed"):
        mo.load_config(bad)
    trusted = mo.load_config(bad, trust_imports=True)
    assert trusted.transforms[0].cls == path
    model = _model()
    trusted.build(model.parameters())  # building after validation needs no further trust
    evil = write(tmp_path, "evil.yaml", "transforms:\n  - {type: TorchOptimizer, cls: os.system}\n")
    with pytest.raises(mo.ConfigError, match="not allowed"):
        mo.load_config(evil)
    with pytest.raises(mo.ConfigError, match="not a torch.optim.Optimizer"):
        mo.load_config(evil, trust_imports=True)
    with pytest.raises(mo.ConfigError, match="does not take"):
        mo.load_config(write(tmp_path, "k.yaml", "transforms:\n  - {type: TorchOptimizer, cls: torch.optim.SGD, kwargs: {lr: 0.1, foo: 1}}\n"))


def test_register_optimizer_allows_a_class():
    class Registered(torch.optim.SGD):
        pass

    mo.register_optimizer(Registered)
    path = f"{Registered.__module__}.{Registered.__qualname__}"
    cfg = mo.PipelineConfig.from_dict({"transforms": [{"type": "TorchOptimizer", "cls": path, "kwargs": {"lr": 0.1}}]})
    assert cfg.transforms[0].cls == path


# --- schema -------------------------------------------------------------------------------


def test_config_schema_covers_every_transform_and_validates_configs():
    import jsonschema  # part of the dev extra
    schema = mo.config_schema()
    json.dumps(schema)
    for name in mo.available():
        if name != "DoubleIt":
            assert name in schema["$defs"]
    good = mo.PipelineConfig(transforms=[t for _, t in EXAMPLES if not isinstance(t, mo.roles.Optimizer)] + [mo.Adam()]).to_dict()
    jsonschema.validate(good, schema)
    bad = {"transforms": [{"type": "ClipNorm", "max_norm": -1.0}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


PWN = "!!python/object/apply:os.system ['touch {marker}']"


@pytest.mark.parametrize("where", ["top", "field", "experiment"])
def test_yaml_tags_never_run_code_library_and_cli(tmp_path, capsys, where):
    marker = tmp_path / "pwned"
    tag = PWN.format(marker=marker)
    text = {
        "top": f"transforms: {tag}\n",
        "field": f"transforms:\n  - {{type: ClipNorm, max_norm: {tag}}}\n",
        "experiment": f"optimizer:\n  transforms:\n    - {{type: Adam}}\ntask: {tag}\n",
    }[where]
    path = tmp_path / "evil.yaml"
    path.write_text(text)
    with pytest.raises(mo.ConfigError, match="invalid YAML"):
        mo.load_config(path)
    assert cli_main(["validate", str(path)]) == 1
    assert cli_main(["run", str(path), "--out", str(tmp_path / "run"), "--quiet", "--no-plots"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert not marker.exists()


def test_cli_refuses_import_paths_outside_the_allow_list(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text("optimizer:\n  transforms:\n    - {type: TorchOptimizer, cls: os.system}\ntrain: {steps: 2}\n")
    assert cli_main(["validate", str(path)]) == 1
    assert "not allowed" in capsys.readouterr().err
    assert cli_main(["run", str(path), "--out", str(tmp_path / "r"), "--quiet", "--no-plots"]) == 1
    # trusting imports still refuses what is not an optimizer class
    assert cli_main(["validate", str(path), "--trust-imports"]) == 1
    assert "not a torch.optim.Optimizer" in capsys.readouterr().err
