"""Checkpoints as torch.optim treats them: extra group keys, resuming with changed hyperparameters,
declared buffers (custom ones included), devices, and torch's state-dict hooks."""

from __future__ import annotations

import copy
import io
import warnings
from typing import ClassVar

import pytest
import torch

import modopt as mo
from checks import assert_same


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def batch(k):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(6, 3, generator=g) * (1 + k % 3), torch.randn(6, 2, generator=g)


def loss_backward(model, k):
    x, y = batch(k)
    model.zero_grad()
    (model(x) - y).pow(2).mean().backward()


# --- issue 11 item 4: extra param-group keys ------------------------------------------------
def named_groups(model):
    ps = list(model.parameters())
    return [{"params": ps[:2], "name": "body", "lr_scale": 0.5}, {"params": ps[2:], "name": "head", "lr_scale": 1.0}]


def test_extra_group_keys_are_kept_and_survive_a_checkpoint():
    model = make_model()
    opt = mo.Modular(named_groups(model), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    swa = torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=2)
    for k in range(3):
        loss_backward(model, k)
        opt.step()
        swa.step()
    sd = roundtrip(opt.state_dict())
    assert [g["name"] for g in sd["param_groups"]] == ["body", "head"]
    assert [g["swa_lr"] for g in sd["param_groups"]] == [0.05, 0.05]
    fresh = mo.Modular(make_model().parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))  # one group: layout differs
    with pytest.raises(ValueError, match="2 param groups, this optimizer 1"):
        fresh.load_state_dict(sd)
    m2 = make_model(1)
    o2 = mo.Modular([{"params": g["params"]} for g in named_groups(m2)], mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    o2.load_state_dict(sd)
    for g, saved in zip(o2.param_groups, opt.param_groups):
        assert (g["name"], g["lr_scale"], g["swa_lr"], g["lr"]) == (saved["name"], saved["lr_scale"], saved["swa_lr"], saved["lr"])
    assert "modopt" not in o2.param_groups[0]  # the carried transform state is not a group key


def test_add_param_group_keeps_unknown_keys_but_constructor_typos_are_errors():
    model = make_model()
    ps = list(model.parameters())
    opt = mo.Modular(ps[:2], mo.Adam(lr=1e-2))
    opt.add_param_group({"params": ps[2:], "name": "head", "weight_decay": 0.1, "lr_scale": 0.1})
    assert opt.param_groups[1]["name"] == "head" and opt.param_groups[1]["lr"] == 1e-2
    with pytest.raises(TypeError, match=r"unknown hyperparameter\(s\) \['lrr'\]"):
        mo.Modular(ps, mo.Adam(), lrr=1)
    with pytest.raises(ValueError, match="'modopt' is reserved"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "modopt": 1})


def test_swalr_matches_torch_adam():
    def run(make_opt):
        model = make_model()
        opt = make_opt(named_groups(model))
        sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=3, anneal_strategy="linear")
        lrs = []
        for k in range(6):
            loss_backward(model, k)
            opt.step()
            sched.step()
            lrs.append([g["lr"] for g in opt.param_groups])
        return [p.detach().clone() for p in model.parameters()], lrs

    ours, our_lrs = run(lambda gs: mo.Modular(gs, mo.Adam(lr=1e-2)))
    ref, ref_lrs = run(lambda gs: torch.optim.Adam(gs, lr=1e-2))
    assert our_lrs == ref_lrs
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --- issue 10 item 2: resume with changed hyperparameters, as torch --------------------------
def test_resume_with_changed_lr_and_max_norm_matches_torch():
    """Save after 3 steps; resume in an optimizer built with a new lr and a new max_norm.

    torch.optim restores the group's lr from the checkpoint (the user then lowers it by hand);
    the clip's max_norm is the live transform's. modopt must do exactly what the torch loop does.
    """
    def torch_run():
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for k in range(3):
            loss_backward(model, k)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        ck = roundtrip({"m": model.state_dict(), "o": opt.state_dict()})
        m2 = make_model(7)
        m2.load_state_dict(ck["m"])
        o2 = torch.optim.Adam(m2.parameters(), lr=3e-4)
        o2.load_state_dict(ck["o"])
        restored = o2.param_groups[0]["lr"]
        o2.param_groups[0]["lr"] = 3e-4
        for k in range(3, 8):
            loss_backward(m2, k)
            torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)
            o2.step()
        return [p.detach() for p in m2.parameters()], restored

    def modopt_run():
        model = make_model()
        opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
        for k in range(3):
            loss_backward(model, k)
            opt.step()
        ck = roundtrip({"m": model.state_dict(), "o": opt.state_dict()})
        m2 = make_model(7)
        m2.load_state_dict(ck["m"])
        o2 = mo.Modular(m2.parameters(), mo.ClipNorm(0.05), mo.Adam(lr=3e-4))
        with pytest.warns(UserWarning) as rec:
            o2.load_state_dict(ck["o"])
        assert len(rec) == 1
        msg = str(rec[0].message)
        assert "transforms.0.max_norm: 1.0 in the checkpoint, 0.05 here (this optimizer's value is kept)" in msg
        assert "transforms.1.lr: 0.01 in the checkpoint, 0.0003 here (a param-group key" in msg
        assert o2.transforms[0].max_norm == 0.05
        restored = o2.param_groups[0]["lr"]
        o2.param_groups[0]["lr"] = 3e-4
        clipped = []
        for k in range(3, 8):
            loss_backward(m2, k)
            o2.step()
            clipped.append(float(o2.stats["0:ClipNorm.scale"]) < 1)
        assert all(clipped), "the new max_norm must bind (else the test would not see it)"
        return [p.detach() for p in m2.parameters()], restored

    ref, ref_lr = torch_run()
    ours, our_lr = modopt_run()
    assert our_lr == ref_lr == 1e-2
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_same_hyperparameters_load_without_a_warning():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ZClip(warmup_steps=2), mo.AdamW(lr=1e-2))
    for k in range(3):
        loss_backward(model, k)
        opt.step()
    o2 = mo.Modular(model.parameters(), mo.ZClip(warmup_steps=2), mo.AdamW(lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o2.load_state_dict(roundtrip(opt.state_dict()))
    assert_same(opt.state_dict()["state"], o2.state_dict()["state"])


# --- declared buffers ------------------------------------------------------------------------
class _SummaryClip(mo.Transform):
    """A contributor's transform: keeps 4 summary statistics per parameter (shape (4,), not the parameter's)."""

    positional = "beta"
    beta: float = 0.5
    state_buffers: ClassVar[dict] = {"summary": mo.Buffer("fixed", shape=(4,)), "calls": "counter"}

    def apply(self, ctx, st, updates):
        summ = st.buffers("summary", lambda i, p: torch.zeros(4, device=p.device))
        for s, u in zip(summ, updates):
            new = torch.stack([u.mean(), u.std(correction=0), u.abs().max(), u.norm()])
            s.lerp_(new, 1 - self.beta)
            u.clamp_(-s[2], s[2])
        st.store["calls"] = st.store.get("calls", 0) + 1
        return updates


class _Undeclared(mo.Transform):
    positional = None

    def apply(self, ctx, st, updates):
        st.buffers("secret", lambda i, p: torch.zeros(4))
        return updates


def test_custom_transform_with_a_4_shaped_per_parameter_buffer_checkpoints_and_resumes():
    def run(split):
        model = make_model()
        opt = mo.Modular(model.parameters(), _SummaryClip(), mo.SGD(lr=0.1))
        for k in range(6):
            if k == split:
                ck = roundtrip({"m": model.state_dict(), "o": opt.state_dict()})
                model = make_model(3)
                model.load_state_dict(ck["m"])
                opt = mo.Modular(model.parameters(), _SummaryClip(), mo.SGD(lr=0.1))
                opt.load_state_dict(ck["o"])
            loss_backward(model, k)
            opt.step()
        return model, opt

    straight, o1 = run(split=-1)
    resumed, o2 = run(split=3)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert o2._store["0:_SummaryClip"]["calls"] == 6
    assert all(s["0:_SummaryClip.summary"].shape == (4,) for s in o2.state.values())
    sd = o2.state_dict()
    sd["state"][0]["0:_SummaryClip.summary"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"shape \(5,\) does not fit the declared shape \(4,\)"):
        o2.load_state_dict(sd)


def test_undeclared_buffer_is_a_clear_error_naming_transform_and_buffer():
    model = make_model()
    opt = mo.Modular(model.parameters(), _Undeclared(), mo.SGD(lr=0.1))
    loss_backward(model, 0)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"'secret' of transform 0:_Undeclared \(_Undeclared\), which _Undeclared does not "
                                         r"declare; declare it on the class, e\.g\. `state_buffers: ClassVar\[dict\]"):
        opt.load_state_dict(opt.state_dict())
    assert_same(before, opt.state_dict())


def test_buffer_declarations_are_checked():
    with pytest.raises(ValueError, match="kind must be one of"):
        mo.Buffer("perparam")
    with pytest.raises(ValueError, match="only for kind 'fixed'"):
        mo.Buffer("param", shape=(4,))
    for name in mo.available():  # every registered transform declares valid buffers
        from modopt.core.state import declared_buffers

        declared_buffers(mo.core.registry.get_transform(name))


def devices():
    out = ["meta"]  # a device with no data: shows where every buffer lands without an accelerator
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.mark.parametrize("device", devices())
def test_a_cpu_checkpoint_loads_with_every_buffer_on_the_parameters_device(device):
    pipeline = lambda: [mo.ZClip(warmup_steps=2), mo.ClipNormByEMA(scope="tensor", dim=0, inverse_dims=True),
                        mo.AutoClip(window=3, scope="group"), _SummaryClip(), mo.AdamW(lr=1e-2)]  # noqa: E731
    model = make_model()
    opt = mo.Modular(named_groups(model), *pipeline())
    for k in range(4):
        loss_backward(model, k)
        opt.step()
    ck = roundtrip(opt.state_dict())
    far = make_model().to(device)
    o2 = mo.Modular(named_groups(far), *pipeline())
    o2.load_state_dict(ck)
    n = 0
    for p in far.parameters():
        for k, v in o2.state[p].items():
            assert v.device == p.device, k
            n += 1
    for key, store in o2._store.items():
        for name, v in store.items():
            if isinstance(v, torch.Tensor):
                assert v.device.type == device, (key, name)
                n += 1
    assert n > 20
    if device == "cuda":  # and it trains on from there, equal to the CPU run
        opt_ref = mo.Modular(named_groups(model), *pipeline())
        opt_ref.load_state_dict(ck)
        far.load_state_dict(model.state_dict())
        for k in range(4, 6):
            loss_backward(model, k)
            opt_ref.step()
            x, y = batch(k)
            far.zero_grad()
            (far(x.to(device)) - y.to(device)).pow(2).mean().backward()
            o2.step()
        for a, b in zip(model.parameters(), far.parameters()):
            torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


# --- issue 11 item 5: torch's state-dict hooks ----------------------------------------------
def test_load_state_dict_hooks_run_as_in_torch():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    loss_backward(model, 0)
    opt.step()
    sd = opt.state_dict()
    calls = []

    def pre(o, d):
        calls.append(("pre", o is opt, "modopt" in d))
        d = dict(d)
        d["param_groups"] = [{**g, "lr": 0.123} for g in d["param_groups"]]
        return d

    def post(o):
        calls.append(("post", o.param_groups[0]["lr"]))

    h1 = opt.register_load_state_dict_pre_hook(pre)
    h2 = opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(sd)
    assert calls == [("pre", True, True), ("post", 0.123)]
    assert opt.param_groups[0]["lr"] == 0.123
    assert sd["param_groups"][0]["lr"] == 1e-2  # the caller's dict is not modified (shallow copy, as torch)
    h1.remove()
    h2.remove()
    opt.load_state_dict(sd)
    assert len(calls) == 2 and opt.param_groups[0]["lr"] == 1e-2


def test_state_dict_hooks_see_the_modopt_entry():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ZClip(warmup_steps=1), mo.Adam(lr=1e-2))
    loss_backward(model, 0)
    opt.step()
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))

    def post(o, d):
        seen.append(sorted(d["modopt"]["transforms"]))
        d["extra"] = 1
        return d

    opt.register_state_dict_post_hook(post)
    opt.register_state_dict_post_hook(lambda o, d: seen.append("first"), prepend=True)
    sd = opt.state_dict()
    assert seen == ["pre", "first", ["0:ZClip"]]
    assert sd["extra"] == 1 and sd["modopt"]["format_version"] == 2
    assert len(opt._optimizer_state_dict_post_hooks) == 2  # modopt's entry is not a registered hook


# --- attach handles are checked like Modular ---------------------------------------------------
def attached(*transforms, seed=0):
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, mo.attach(opt, *transforms)


def test_attach_handle_round_trip_and_checks():
    model, opt, h = attached(mo.ZClip(warmup_steps=2), mo.ClipNormByEMA(scope="tensor"))
    for k in range(4):
        loss_backward(model, k)
        opt.step()
    sd = roundtrip(h.state_dict())
    m2, o2, h2 = attached(mo.ZClip(warmup_steps=2), mo.ClipNormByEMA(scope="tensor"), seed=1)
    h2.load_state_dict(sd)
    assert_same(h.state_dict(), h2.state_dict())
    m2.load_state_dict(model.state_dict())
    for k in range(4, 6):
        for mm, oo in ((model, opt), (m2, o2)):
            loss_backward(mm, k)
            oo.step()
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)

    _, _, h3 = attached(mo.ZClip(warmup_steps=5), mo.ClipNormByEMA(scope="tensor"))
    with pytest.warns(UserWarning, match=r"transforms\.0\.warmup_steps: 2 in the checkpoint, 5 here"):
        h3.load_state_dict(sd)

    bad = [
        (lambda d: d["state"][0].__setitem__("1:ClipNormByEMA.ema", torch.zeros(7)), "does not fit the parameter"),
        (lambda d: d["state"][0].__setitem__("1:ClipNormByEMA.nope", torch.zeros(())), "does not declare"),
        (lambda d: d["state"].__setitem__(99, {}), "parameter index 99"),
        (lambda d: d["transforms"].__setitem__("5:Other", {}), "unknown key"),
        (lambda d: d["transforms"]["0:ZClip"].__setitem__("mu", torch.zeros(3)), "does not fit"),
        (lambda d: d.__setitem__("config", [{"type": "ClipNorm", "max_norm": 1.0}]), "length 1 != 2"),
        (lambda d: d.pop("state"), "expected a dict with 'state' and 'transforms'"),
    ]
    before = copy.deepcopy(h2.state_dict())
    for tamper, match in bad:
        d = copy.deepcopy(sd)
        tamper(d)
        with pytest.raises(ValueError, match=match):
            h2.load_state_dict(d)
        assert_same(before, h2.state_dict())


def test_meta_device_parameters_step_without_a_host_sync():
    """Shape-only (meta) parameters: a step runs (no Tensor.item() on meta tensors) and keeps shapes."""
    p = torch.nn.Parameter(torch.zeros(3, 2, device="meta"))
    p.grad = torch.ones(3, 2, device="meta")
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.ClipNormByEMA(), mo.SGD(lr=0.1, momentum=0.9))
    opt.step()
    assert opt.state[p]["1:ClipNormByEMA.ema"].device.type == "meta" and opt.state[p]["1:ClipNormByEMA.ema"].shape == (3, 2)
