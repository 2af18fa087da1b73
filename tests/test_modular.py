"""`Modular` (modopt/core/modular.py) as an optimizer: what it takes and refuses, and how it steps.

Sparse gradients and complex parameters are clear errors (Modular and attach), a parameter listed
twice is refused, an expanded gradient steps as its contiguous copy; closures, named parameters and
group defaults, group keys, position deciding gradient vs update clipping, deepcopy and pickle."""

from __future__ import annotations

import copy

import pytest
import torch

import modopt as mo


# --- what a step refuses: sparse gradients, complex parameters ----------------------------------------


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


class _NoDouble(mo.Transform, abstract=True):
    """Refuses float64 parameters in `check_params` (abstract: not registered)."""

    positional = None

    def apply(self, ctx, st, updates):
        return updates

    def check_params(self, named):
        for n, p in named:
            if p.dtype == torch.float64:
                raise ValueError(f"_NoDouble: parameter {n!r} is float64")


def test_every_door_asks_each_transform_about_its_parameters():
    """`check_params` runs at every door that hands parameters over, before any state exists: the build,
    a group added after it (not added) and `mo.attach` (nothing attached)."""
    double = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="parameter 'd' is float64"):
        mo.Modular([("d", double)], _NoDouble(), mo.SGD(lr=0.1))
    opt = mo.Modular([("a", torch.nn.Parameter(torch.zeros(2)))], _NoDouble(), mo.SGD(lr=0.1))
    with pytest.raises(ValueError, match="parameter 'd' is float64"):
        opt.add_param_group({"params": [double], "param_names": ["d"]})
    assert len(opt.param_groups) == 1
    sgd = torch.optim.SGD([double], lr=0.1)
    sgd.param_groups[0]["param_names"] = ["d"]
    with pytest.raises(ValueError, match="parameter 'd' is float64"):
        mo.attach(sgd, _NoDouble())
    assert not sgd._optimizer_step_pre_hooks


def test_a_parameter_in_two_groups_is_still_torchs_error():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        mo.Modular([{"params": [w]}, {"params": [w]}], mo.Adam())


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


# --- steps, closures, groups, copies ---------------------------------------------------------------


# (the small model, its batches and the training loop are the equivalence suite's)
from test_torch_equivalence import batches, make_model, run  # noqa: E402


def test_clipnorm_normalize_adam_trains_a_small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    w = torch.randn(10, 1)
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Normalize(), mo.Adam(lr=3e-3))
    losses = []
    for _ in range(300):
        x = torch.randn(32, 10)
        y = x @ w
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.2 * sum(losses[:20]) / 20


def test_step_returns_closure_loss_and_skips_params_without_grad():
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(2))
    opt = mo.Modular([a, b], mo.SGD(lr=0.5))

    def closure():
        opt.zero_grad()
        loss = (a * 2).sum()
        loss.backward()
        return loss

    out = opt.step(closure)
    assert out.item() == 4.0
    assert torch.equal(a.detach(), torch.zeros(2)) and torch.equal(b.detach(), torch.ones(2))
    assert b not in opt.state or not opt.state[b]


def test_position_decides_gradient_vs_update_clipping():
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(2))
    for x in (p, q):
        x.grad = torch.tensor([3.0, 4.0])
    mo.Modular([p], mo.ClipNorm(1.0, eps=0.0), mo.LR(0.1)).step()  # clip grad, then lr: |step| = 0.1
    mo.Modular([q], mo.LR(0.1), mo.ClipNorm(1.0, eps=0.0)).step()  # lr then clip: |step| = 0.5 <= 1
    torch.testing.assert_close(p.detach().norm(), torch.tensor(0.1))
    torch.testing.assert_close(q.detach().norm(), torch.tensor(0.5))


def test_named_parameters_and_group_defaults():
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(1.0), mo.Adam(), lr=0.05)
    assert opt.param_groups[0]["lr"] == 0.05
    assert opt.param_groups[0]["param_names"][0] == "0.weight"
    assert opt.config.defaults == {"lr": 0.05}


def test_unknown_group_key_is_kept_as_torch_but_misplaced_keys_and_constructor_typos_are_errors():
    model = make_model()
    # torch.optim keeps group keys it does not use (issue 11 item 4); so does Modular, for keys modopt
    # does not know (frameworks add their own) ...
    opt = mo.Modular([{"params": model.parameters(), "lr_scale": 0.9}], mo.Adam())
    assert opt.param_groups[0]["lr_scale"] == 0.9
    # ... but a hyperparameter that no transform reads is refused, not silently ignored (issue 26 item 7)
    with pytest.raises(ValueError, match="no transform of this pipeline reads 'momentum'"):
        mo.Modular([{"params": model.parameters(), "momentum": 0.9}], mo.Adam())
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        mo.Modular(model.parameters(), mo.Adam(), momentum=0.9)
    with pytest.raises(ValueError, match="exposed by both"):
        mo.Modular(model.parameters(), mo.LR(0.1), mo.Adam())


def test_torch_optimizer_must_be_last_and_sparse_complex_errors():
    with pytest.raises(ValueError, match="must be the last"):
        mo.Modular([torch.nn.Parameter(torch.zeros(1))], mo.TorchOptimizer(torch.optim.SGD, lr=0.1), mo.Identity())
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        mo.Modular([p], mo.SGD(lr=0.1)).step()
    c = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    c.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        mo.Modular([c], mo.SGD(lr=0.1)).step()


def test_deepcopy_and_pickle_roundtrip():
    import pickle

    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    run(model, opt, batches(3))
    opt2 = copy.deepcopy(opt)
    assert opt2.config == opt.config
    assert len(opt2.state) == len(opt.state)
    opt3 = pickle.loads(pickle.dumps(opt))
    assert opt3.config == opt.config


@pytest.mark.parametrize("bad", ["pp", 0, [0, 1]])
def test_stage_group_must_be_a_process_group(bad):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="stage_group must be the torch.distributed process group"):
        mo.Modular([p], mo.ClipNorm(1.0), mo.Adam(), stage_group=bad)


# --- the step's wrapper (`modopt.core.runner._hooked`): torch's hooks and profiler range, for less ------
def test_step_hooks_run_in_torchs_order_and_a_pre_hook_can_replace_the_arguments():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    p = torch.nn.Parameter(torch.ones(2))
    opt = mo.Modular([p], mo.SGD(lr=1.0))
    seen = []

    def closure():
        seen.append(("closure", torch.is_grad_enabled()))
        p.grad = torch.full((2,), 0.5)
        return torch.tensor(3.0)

    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global pre")),
        opt.register_step_pre_hook(lambda o, a, k: (seen.append("pre"), ((o, closure), k))[1]),
        opt.register_step_post_hook(lambda o, a, k: seen.append(("post", a[1] is closure))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append("global post")),
    ]
    try:
        loss = opt.step()  # no closure given: the pre-hook supplies one
    finally:
        for h in handles:
            h.remove()
    assert seen == ["global pre", "pre", ("closure", True), ("post", True), "global post"]
    assert float(loss) == 3.0 and torch.equal(p.detach(), torch.full((2,), 0.5))
    bad = opt.register_step_pre_hook(lambda o, a, k: "not a pair")
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        opt.step()
    bad.remove()


def test_the_step_runs_without_autograd_and_restores_grad_mode_when_it_raises():
    p = torch.nn.Parameter(torch.ones(2))
    opt = mo.Modular([p], mo.SGD(lr=1.0), nonfinite="raise")
    modes = []
    opt.register_step_post_hook(lambda o, a, k: modes.append(torch.is_grad_enabled()))
    p.grad = torch.ones(2)
    opt.step()
    assert p.grad_fn is None and not p.detach().requires_grad and modes == [True]
    p.grad = torch.full((2,), float("nan"))
    with pytest.raises(FloatingPointError):
        opt.step()
    assert torch.is_grad_enabled()
    with torch.no_grad():
        p.grad = torch.ones(2)
        opt.step()
        assert not torch.is_grad_enabled()


def test_a_profiler_sees_the_step_as_torchs_optimizers_name_it():
    p = torch.nn.Parameter(torch.ones(2))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.Adam())
    p.grad = torch.ones(2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#Modular.step" in {e.key for e in prof.key_averages()}
    assert getattr(type(opt).step, "hooked", False)  # torch's Optimizer does not wrap it again

    class Sub(mo.Modular):
        pass

    sub = Sub([torch.nn.Parameter(torch.ones(1))], mo.SGD(lr=1.0))
    assert type(sub).step is mo.Modular.step and type(opt).step is mo.Modular.step  # not wrapped a second time


@pytest.mark.parametrize("kwargs, says", [
    (dict(nonfinite="skp"), "Modular.nonfinite: Input should be 'skip', 'raise', 'zero' or 'ignore' (got 'skp')"),
    (dict(max_consecutive_skips=0), "Modular.max_consecutive_skips: Input should be greater than or equal to 1 (got 0)"),
    (dict(max_consecutive_skips="3"), "Modular.max_consecutive_skips: a whole number of steps >= 1 (or null) is needed"),
    (dict(max_consecutive_skips=2**70), "Modular.max_consecutive_skips: Input should be less than 2**62"),
])
def test_a_refused_pipeline_keyword_is_named_once_as_a_transform_field_is(kwargs, says):
    """Modular's own keywords get the transforms' form of error (one line naming the keyword), not pydantic's
    text of the whole PipelineConfig model with its links; still a pydantic ValidationError."""
    import pydantic

    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(pydantic.ValidationError) as e:
        mo.Modular([p], mo.Adam(), **kwargs)
    assert str(e.value).startswith(says) and "\n" not in str(e.value) and "pydantic.dev" not in str(e.value)
    with pytest.raises(pydantic.ValidationError, match=r"^attach\.nonfinite: "):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.ClipNorm(1.0), nonfinite="skp")
