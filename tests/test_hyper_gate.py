"""modopt/core/hyper.py and modopt/core/values.py: one gate for every group value, on every path.

Entry path x group key x bad value, each asserting the one outcome the gate promises: refused
(ValueError/TypeError naming the group and key) with the parameters, every state tensor and the groups
as they were; or, for a tensor value the host does not read (the device path, a GPU's), the step
skipped and counted with no host sync. Then the rule table's own pieces and the doors beside the groups
(`tensor_hyperparams`, `compile_step`'s arguments, the flags, the bound of the parameters' dtype).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import modopt as mo
from checks import Syncs, assert_same, everything, refused
from modopt.core.values import F32_MAX, Rule, host_number

NAN, INF = float("nan"), float("inf")

#: pipelines and the number-valued group keys they read (each key's default value is a valid one)
PIPELINES = {
    "Adam": (lambda: (mo.Adam(lr=1e-2),), ("lr", "eps", "weight_decay")),
    "SGD": (lambda: (mo.SGD(lr=0.1, momentum=0.9),), ("lr", "momentum", "weight_decay")),
    "Muon": (lambda: (mo.Muon(lr=0.02),), ("lr", "momentum", "weight_decay")),
    "ScheduleFreeAdamW": (lambda: (mo.ScheduleFreeAdamW(lr=1e-2),), ("lr", "eps", "weight_decay")),
    "LR+WeightDecay": (lambda: (mo.WeightDecay(1e-2), mo.LR(0.1)), ("lr",)),
    "ClipNorm+AdamW": (lambda: (mo.ClipNorm(1.0), mo.AdamW(lr=1e-2)), ("lr", "eps", "weight_decay")),
}
CASES = [(name, key) for name, (_, keys) in PIPELINES.items() for key in keys]


def bad_values():
    """Each bad value by name: what a careless or hostile hand puts in a group."""
    return {
        "nan": NAN, "inf": INF, "-1": -1.0, "huge": 1e300, "string": "0.1", "numpy-nan": np.float32("nan"),
        "numpy-neg": np.float64(-1.0), "tensor0d-nan": torch.tensor(NAN), "tensor1d-nan": torch.tensor([NAN]),
        "tensor2d-inf": torch.tensor([[INF]]), "tensor-int": torch.tensor(1), "tensor-two": torch.tensor([0.1, 0.2]),
        "tensor-complex": torch.tensor(0.1 + 0j), "tensor-meta": torch.tensor(0.1, device="meta"),
        "numpy-array": np.array([[0.01]]),
    }


def make(name, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    return model, PIPELINES[name][0]()


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()


def warm(name):
    model, ts = make(name)
    opt = mo.Modular(model.parameters(), *ts)
    for i in range(2):
        backward(model, i)
        opt.step()
    backward(model, 7)
    return model, opt


@pytest.mark.parametrize("name,key", CASES)
@pytest.mark.parametrize("label", list(bad_values()))
def test_a_bad_value_is_refused_at_every_door_with_nothing_changed(name, key, label):
    v = bad_values()[label]
    model, ts = make(name)
    match = rf"param group \d.*{key}"
    with pytest.raises((ValueError, TypeError), match=match):  # the constructor's keyword defaults
        mo.Modular(model.parameters(), *ts, **{key: v})
    with pytest.raises((ValueError, TypeError), match=match):  # a group dict
        mo.Modular([{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), key: v}], *ts)
    opt = mo.Modular(model[0].parameters(), *ts)  # add_param_group: refused, the groups as they were
    refused(model, opt, lambda: opt.add_param_group({"params": list(model[2].parameters()), key: v}), match)
    assert len(opt.param_groups) == 1
    model, opt = warm(name)  # set between steps: refused by the next step, before it changes anything
    before = everything(model, opt)
    opt.param_groups[0][key] = v
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step()
    after = everything(model, opt)
    assert_same(before["params"], after["params"])
    assert_same(before["opt"]["state"], after["opt"]["state"])
    assert_same(before["opt"]["modopt"], after["opt"]["modopt"])
    model, opt = warm(name)  # in a checkpoint's groups: the load refused, the optimizer as it was
    sd = opt.state_dict()
    sd["param_groups"][0][key] = v
    refused(model, opt, lambda: opt.load_state_dict(sd), match)


@pytest.mark.parametrize("name,key", CASES)
@pytest.mark.parametrize("fill", [NAN, INF, -1.0, 1e300])
def test_a_tensor_filled_in_place_is_read_by_the_host_and_refused(name, key, fill):
    model, opt = warm(name)
    opt.param_groups[0][key] = torch.tensor(float(opt.param_groups[0][key]), dtype=torch.float64)
    opt.step()  # a good tensor value passes
    backward(model, 8)
    opt.param_groups[0][key].fill_(fill)  # a scheduler's fill_: the same object
    refused(model, opt, opt.step, rf"param group 0: '{key}'.*filled in place")


@pytest.mark.parametrize("name,key", CASES)
@pytest.mark.parametrize("fill", [NAN, INF, -1.0, 1e300])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_on_the_device_path_a_bad_tensor_value_skips_the_step_with_no_sync(name, key, fill, shape):
    if fill == 1e300 and key != "lr":
        pytest.skip("the kernels read a tensor other than lr as a number (a read of their own), and torch refuses "
                    "to read 1e300 into float32: possible only with a float64 tensor on the CPU")
    model, opt = warm(name)
    opt.param_groups[0][key] = torch.tensor(float(opt.param_groups[0][key]), dtype=torch.float64).reshape(shape)
    with Syncs():  # (inside it the CPU takes a GPU's path)
        opt.step()
    backward(model, 8)
    opt.param_groups[0][key].fill_(fill)
    before = everything(model, opt)
    counted = opt.stats["skipped_steps"].item()
    syncs = Syncs()
    with syncs:
        opt.step()
    if key == "lr":  # (the kernels read a tensor lr on the device; other keys as numbers, a read of their own)
        assert syncs.n == 0
    after = everything(model, opt)
    assert_same(before["params"], after["params"])
    assert_same(before["opt"]["state"], after["opt"]["state"])
    assert opt.stats["skipped_steps"].item() == counted + 1 and bool(opt.stats["nonfinite"])
    opt.param_groups[0][key].fill_(float(PIPELINES[name][0]()[-1].hyperparams()[key]))  # mended: steps again
    backward(model, 9)
    with Syncs():
        opt.step()
    assert opt.stats["skipped_steps"].item() == counted + 1
    assert any(not torch.equal(p, q) for p, q in zip(before["params"], everything(model, opt)["params"]))


def test_a_bad_device_value_under_nonfinite_raise_is_refused_naming_it():
    model, opt = warm("Adam")
    opt = mo.Modular(model.parameters(), mo.Adam(lr=1e-2), nonfinite="raise")
    opt.param_groups[0]["lr"] = torch.tensor(NAN)
    from modopt.core import hostdata

    with hostdata.device_path():
        refused(model, opt, opt.step, "tensor param-group value")


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_one_element_tensor_lr_of_any_shape_steps_as_the_float_does(shape):
    # torch.optim takes a 1-D or 2-D one-element lr (torch's test_tensor_lr with num_dim 1 and 2)
    runs = []
    for lr in (1e-2, torch.tensor(1e-2, dtype=torch.float64).reshape(shape)):
        model, ts = make("Adam")
        opt = mo.Modular(model.parameters(), mo.Adam(), lr=lr)
        for i in range(3):
            backward(model, i)
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert_same(runs[0], runs[1])


def test_a_numpy_scalar_in_range_is_taken_and_steps_as_the_float_does():
    runs = []
    for lr in (1e-2, np.float64(1e-2)):
        model, _ = make("SGD")
        opt = mo.Modular(model.parameters(), mo.SGD(momentum=0.9), lr=lr)
        for i in range(3):
            backward(model, i)
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert_same(runs[0], runs[1])


@pytest.mark.parametrize("v", [NAN, -1.0, "0.1", torch.tensor(NAN)])
@pytest.mark.compile
def test_compile_step_checks_the_group_values_before_its_graph(v):
    model, opt = warm("Adam")
    step = mo.compile_step(opt, warmup=1)
    step()
    backward(model, 9)
    step()  # the compiled graph
    backward(model, 10)
    opt.param_groups[0]["lr"] = v
    refused(model, opt, step, "param group 0.*'lr'")


@pytest.mark.compile
def test_compile_step_skips_a_device_tensor_value_filled_in_place_inside_its_graph():
    from modopt.core import hostdata

    model, opt = warm("Adam")
    mo.tensor_hyperparams(opt)
    with hostdata.device_path():
        step = mo.compile_step(opt, warmup=1)
        step()
        backward(model, 9)
        step()
        backward(model, 10)
        opt.param_groups[0]["lr"].fill_(NAN)
        before = everything(model, opt)
        step()
        after = everything(model, opt)
    assert_same(before["params"], after["params"])
    assert bool(opt.stats["skipped"])


def test_a_scheduler_writing_a_bad_float_is_refused_as_a_hand_is():
    model, opt = warm("Adam")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: -1.0 if k >= 1 else 1.0)
    opt.step()
    sched.step()
    backward(model, 3)
    refused(model, opt, opt.step, r"param group 0: 'lr' = -0.01: must be >= 0")


# --- the bound of the parameters' compute dtype ---------------------------------------------------
@pytest.mark.parametrize("ts,field", [((mo.Adam(lr=1e300),), "0:Adam.lr"), ((mo.Adam(weight_decay=1e300),), "weight_decay"),
                                      ((mo.Normalize(norm_value=1e300), mo.SGD(lr=0.1)), "0:Normalize.norm_value"),
                                      ((mo.ADOPT(eps=1e300),), "0:ADOPT.eps"),
                                      ((mo.ZClip(max_grad_norm=1e300), mo.Adam()), "0:ZClip.max_grad_norm"),
                                      ((mo.ClipNormByEMA(eps=1e300), mo.Adam()), "0:ClipNormByEMA.eps")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_value_beyond_the_parameters_compute_dtype_is_refused_at_build(ts, field, dtype):
    model = torch.nn.Linear(4, 2).to(dtype)
    with pytest.raises(ValueError, match=rf"{field}.*beyond what the parameters' float32 holds"):
        mo.Modular(model.parameters(), *ts)


def test_float64_parameters_hold_float64_values_and_a_float32_group_lowers_the_bound():
    big, small = torch.nn.Linear(4, 2).double(), torch.nn.Linear(4, 2)
    opt = mo.Modular(big.parameters(), mo.SGD(lr=1e300))  # representable for float64 parameters
    refused(big, opt, lambda: opt.add_param_group({"params": list(small.parameters())}), "0:SGD.lr.*float32")
    assert len(opt.param_groups) == 1 and opt._gate.bound > F32_MAX
    opt = mo.Modular(big.parameters(), mo.SGD(lr=0.1))
    opt.add_param_group({"params": list(small.parameters())})
    opt.param_groups[0]["lr"] = 1e300  # fine for the float64 group alone; not once a float32 group joined
    big(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="beyond"):
        opt.step()


# --- the rule table ---------------------------------------------------------------------------------
def test_a_rule_is_the_fields_declared_range_and_refuses_nan_on_both_sides():
    lr = Rule.of_field(mo.Adam.model_fields["lr"])
    momentum = Rule.of_field(mo.Muon.model_fields["momentum"])
    assert (lr.lo, lr.lo_open, lr.hi) == (0.0, False, math.inf)
    assert (momentum.lo, momentum.hi, momentum.hi_open) == (0.0, 1.0, True)
    for x in (0.0, 0.5, 0.999):
        assert momentum.holds(x, F32_MAX) and bool(momentum.ok(torch.tensor(x), F32_MAX))
    for x in (NAN, INF, -INF, 1.0, -1e-9, 1e39):
        assert not momentum.holds(x, F32_MAX) and not bool(momentum.ok(torch.tensor([x], dtype=torch.float64), F32_MAX))
    assert momentum.meet(lr) == Rule(0.0, False, 1.0, True)


@pytest.mark.parametrize("v", [torch.tensor([1.0, 2.0]), torch.tensor(1), torch.tensor(True), torch.tensor(1j),
                               torch.tensor(1.0, device="meta"), np.array([1.0, 2.0]), np.array([[0.01]]),
                               np.array(0.01), np.complex64(1j)])
def test_host_number_refuses_what_cannot_be_one_real_number(v):
    with pytest.raises(TypeError, match="'lr'"):
        host_number(v, "lr")
    assert host_number(torch.tensor([[0.5]]), "lr") == 0.5 and host_number(np.float32(0.5)) == 0.5


# --- the doors beside the groups --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": torch.int64}, "floating-point"), ({"keys": "lr"}, "tuple of group keys"),
    ({"keys": ("foo",)}, "no key 'foo'"), ({"keys": ("lr", "betas")}, "'betas' is"),
])
def test_tensor_hyperparams_checks_its_arguments_before_changing_any_group(kwargs, match):
    model, opt = warm("Adam")
    with pytest.raises((TypeError, ValueError), match=match):
        mo.tensor_hyperparams(opt, **kwargs)
    assert type(opt.param_groups[0]["lr"]) is float


@pytest.mark.parametrize("kwargs", [{"warmup": -1}, {"warmup": "3"}, {"warmup": 1.5}, {"warmup": True}])
@pytest.mark.compile
def test_compile_step_refuses_a_warmup_that_is_not_a_count(kwargs):
    model, opt = warm("Adam")
    with pytest.raises(ValueError, match="warmup"):
        mo.compile_step(opt, **kwargs)


@pytest.mark.compile
def test_compile_step_refuses_a_torch_optimizer():
    with pytest.raises(TypeError, match="modopt.Modular"):
        mo.compile_step(torch.optim.Adam(torch.nn.Linear(2, 2).parameters()))


@pytest.mark.parametrize("cls,field", [(mo.Adam, "amsgrad"), (mo.Adam, "maximize"), (mo.Adam, "fused"),
                                       (mo.SGD, "nesterov"), (mo.AdamW, "foreach")])
@pytest.mark.parametrize("v", ["yes", "true", 1, 0, 1.0])
def test_a_flag_takes_true_or_false_only(cls, field, v):
    with pytest.raises(ValueError, match=f"{field}.*true or false"):
        cls(**{field: v, **({"momentum": 0.9} if field == "nesterov" else {})})
    cls(**{field: True, **({"momentum": 0.9} if field == "nesterov" else {})})


def test_attach_holds_its_transforms_to_the_parameters_dtype_and_registers_nothing_when_refused():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"mo.attach: .*Normalize.norm_value.*float32"):
        mo.attach(opt, mo.Normalize(norm_value=1e300))
    assert not opt._optimizer_step_pre_hooks
    mo.attach(torch.optim.SGD(model.double().parameters(), lr=0.1), mo.Normalize(norm_value=1e300))
