"""Hostile input: configs never run code (library and CLI), bad checkpoints are refused before anything
changes, sparse gradients and complex parameters are clear errors (Modular and attach)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import modopt as mo
from checks import assert_same, train
from modopt.cli import main as cli_main

PWN = "!!python/object/apply:os.system ['touch {marker}']"


def model_and_opt(*transforms, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = mo.Modular(model.parameters(), *(transforms or (mo.ClipNormByEMA(scope="tensor"), mo.Adam(lr=1e-2))))
    return model, opt



def snapshot(opt):
    return copy.deepcopy(opt.state_dict())



# --- configs never run code ---------------------------------------------------------------------


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


# --- checkpoints --------------------------------------------------------------------------------------


def test_truncated_checkpoint_file_raises_and_changes_nothing():
    model, opt = model_and_opt()
    train(model, opt, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    data = buf.getvalue()
    train(model, opt, 1, seed=1)
    before = snapshot(opt)
    for cut in (len(data) // 3, len(data) - 50):
        with pytest.raises(Exception):
            opt.load_state_dict(torch.load(io.BytesIO(data[:cut]), weights_only=True))
        assert_same(before, snapshot(opt))


def _drop_param_state(sd):
    sd["state"].pop(next(iter(sd["state"])))


@pytest.mark.parametrize(
    "tamper,match",
    [
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(99)), "does not fit the parameter"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(4, 3, 2)), "does not fit"),
        (lambda sd: sd["state"][0].__setitem__("0:ClipNormByEMA.ema", torch.zeros(3, 4)), "does not fit"),
        (lambda sd: sd["state"][1].__setitem__("1:Adam.exp_avg_sq", torch.zeros(2)), "does not fit"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(4, 3, dtype=torch.int64)), "floating-point"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(4, 3, dtype=torch.complex64)), "complex"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.step", torch.zeros(1, 1, 1)), "does not fit"),
        (lambda sd: sd["modopt"].__setitem__("format_version", "1"), "format_version"),
        (lambda sd: sd["modopt"].__setitem__("format_version", True), "format_version"),
        (lambda sd: sd["modopt"].__setitem__("config", {"transforms": []}), "pipeline differs"),
        (lambda sd: sd["modopt"].__setitem__("skipped_steps", 3), "skipped_steps"),
        (lambda sd: sd.__setitem__("state", [1, 2]), "'state' must be a dict"),
        (lambda sd: sd["param_groups"][0].__setitem__("params", "all"), "malformed"),
    ],
)
def test_tampered_buffers_are_refused_before_anything_changes(tamper, match):
    model, opt = model_and_opt()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    tamper(sd)
    train(model, opt, 1, seed=1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))
    train(model, opt, 1, seed=2)  # still steps normally
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_wrong_shape_buffer_is_refused_on_a_fresh_optimizer():
    model, opt = model_and_opt()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["1:Adam.exp_avg"] = torch.zeros(3, 4)  # the (2, 4) weight's buffer, transposed
    _, fresh = model_and_opt()
    with pytest.raises(ValueError, match=r"buffer '1:Adam.exp_avg' of parameter 2 \(shape \(2, 4\)\) has shape \(3, 4\)"):
        fresh.load_state_dict(sd)
    assert len(fresh.state) == 0


def test_a_checkpoint_missing_a_parameter_state_loads_as_fresh_state():
    """Documented: a parameter without saved state starts fresh (as torch.optim does), it is not an error."""
    model, opt = model_and_opt()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    _drop_param_state(sd)
    _, o2 = model_and_opt()
    o2.load_state_dict(sd)
    assert len(o2.state) == len(opt.state) - 1


# --- sparse gradients, complex parameters --------------------------------------------------------------


def test_sparse_gradients_and_complex_parameters_are_clear_errors_with_attach():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with mo.attach(opt, mo.ClipNorm(1.0)):
        before = emb.weight.detach().clone()
        with pytest.raises(RuntimeError, match="sparse gradients"):
            opt.step()
        assert torch.equal(before, emb.weight)
    with pytest.raises(RuntimeError, match="sparse gradients"):
        mo.Modular(emb.parameters(), mo.ClipNorm(1.0), mo.SGD(lr=0.1)).step()
    c = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    c.grad = torch.ones(2, dtype=torch.complex64)
    copt = torch.optim.SGD([c], lr=0.1)
    mo.attach(copt, mo.Normalize())
    with pytest.raises(RuntimeError, match="complex parameters.*view_as_real"):
        copt.step()
    named = mo.Modular([("z", c)], mo.Normalize(), mo.SGD(lr=0.1))
    with pytest.raises(RuntimeError, match="complex parameters \\(parameter z of group 0\\)"):
        named.step()
    assert torch.equal(c.detach(), torch.ones(2, dtype=torch.complex64))


# --- a parameter listed twice -----------------------------------------------------------------------


def test_a_parameter_listed_twice_is_refused_with_its_name():
    """torch.optim only warns (its fused, foreach and for-loop Adam then give three different
    trajectories); Modular refuses it, naming the parameter, before any state exists."""
    model = torch.nn.Linear(3, 2)
    w, b = model.weight, model.bias
    with pytest.raises(ValueError, match=r"param group 0 lists parameter at positions 0 and 2 more than once"):
        mo.Modular([w, b, w], mo.Adam())
    named = list(model.named_parameters()) + [("weight", w)]
    with pytest.raises(ValueError, match=r"lists parameter 'weight' more than once"):
        mo.Modular(named, mo.ClipNorm(1.0), mo.SGD(lr=0.1))
    opt = mo.Modular([w], mo.Adam())
    with pytest.raises(ValueError, match=r"param group 1 lists parameter"):
        opt.add_param_group({"params": [b, b]})
    assert len(opt.param_groups) == 1  # the refused group is not kept


def test_a_parameter_in_two_groups_is_still_torchs_error():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        mo.Modular([{"params": [w]}, {"params": [w]}], mo.Adam())


def _torch_adam_checkpoint(model) -> dict:
    """A torch.optim.Adam checkpoint after two real steps (what a user resumes from)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for seed in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
        opt.step()
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "after_steps"])
@pytest.mark.parametrize("tamper,match", [
    (lambda s: s["exp_avg_sq"].fill_(float("nan")), "not free of NaN"),
    (lambda s: s["exp_avg_sq"].fill_(-1.0), ">= 0"),
    (lambda s: s["exp_avg"].fill_(float("inf")), "not finite"),
    (lambda s: s.__setitem__("step", torch.tensor(float("nan"))), "not finite"),
    (lambda s: s.__setitem__("step", torch.tensor(-5.0)), ">= 0"),
    (lambda s: s.__setitem__("step", -5.0), ">= 0"),
    (lambda s: s.pop("exp_avg_sq"), "lacks 'exp_avg_sq'"),
    (lambda s: s.__setitem__("exp_avg", s["exp_avg"].to(torch.int64)), "floating-point tensor shaped like"),
    (lambda s: s.__setitem__("exp_avg", torch.zeros(7)), "floating-point tensor shaped like"),
])
def test_torch_optimizer_refuses_a_wrapped_state_torchs_step_cannot_use(tamper, match, fresh):
    # mo.TorchOptimizer(torch.optim.Adam) loading a torch.optim.Adam checkpoint (or its own): each of
    # these loaded and then made NaN parameters or crashed inside torch's step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    sd = _torch_adam_checkpoint(model)
    tamper(sd["state"][0])
    opt = mo.Modular(model.parameters(), mo.TorchOptimizer(torch.optim.Adam, lr=1e-2))
    if not fresh:
        train(model, opt, 1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the kernel note of a torch checkpoint)
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))
    train(model, opt, 1, seed=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_torch_optimizer_loads_an_untouched_torch_checkpoint_and_continues_as_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin = copy.deepcopy(model)
    sd = _torch_adam_checkpoint(model)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-2)
    _torch_adam_checkpoint(twin)  # the same two steps on the twin
    ref.load_state_dict(copy.deepcopy(sd))
    opt = mo.Modular(model.parameters(), mo.TorchOptimizer(torch.optim.Adam, lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.load_state_dict(sd)
    for m, o in ((model, opt), (twin, ref)):
        o.zero_grad()
        m(torch.ones(5, 3)).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("pipeline", [
    lambda: [mo.ClipNormByEMA(), mo.Adam()], lambda: [mo.ClipNorm(0.1), mo.Adam()],
    lambda: [mo.Normalize(), mo.SGD(lr=0.1, momentum=0.9)], lambda: [mo.ZeroNonFinite(), mo.AdamW()],
], ids=["ClipNormByEMA", "ClipNorm", "Normalize", "ZeroNonFinite"])
def test_an_expanded_gradient_steps_as_its_contiguous_copy(pipeline):
    # a stride-0 gradient (`t.expand(...)`) cannot be written in place; the step equals the one on an
    # ordinary gradient of the same values (it raised "more than one element ... refers to a single memory location")
    p, q = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4, 3))
    o1, o2 = mo.Modular([p], *pipeline()), mo.Modular([q], *pipeline())
    for step in range(3):
        row = torch.arange(3.0) + step
        p.grad = row.expand(4, 3)
        q.grad = row.expand(4, 3).clone()
        o1.step()
        o2.step()
    assert torch.equal(p, q) and not torch.equal(p, torch.zeros(4, 3))
