"""Continuing a torch run: a plain torch.optim state dict loads into Modular (and under attach), and
the continuation is torch's own, bit for bit (modopt/core/torch_checkpoint.py, docs/migration.md)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import modopt as mo

N_BEFORE, N_AFTER = 6, 24


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def groups(model, wd=(0.1, 0.0)):
    """Two param groups with different weight decay (weights, then biases), as nanoGPT builds them."""
    w, b = [p for p in model.parameters() if p.dim() == 2], [p for p in model.parameters() if p.dim() < 2]
    return [{"params": w, "weight_decay": wd[0]}, {"params": b, "weight_decay": wd[1]}]


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    # every fourth batch larger, so that the clip at 1.0 acts on some steps and not on others
    return [(torch.randn(16, 6, generator=g) * (6.0 if i % 4 == 3 else 1.0), torch.randn(16, 3, generator=g))
            for i in range(n)]


def train(model, opt, batches, clip=None):
    """`clip`: torch's clip_grad_norm_ at this max norm, over the optimizer's parameters in its order."""
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        opt.step()


def through_file(obj):
    """What a checkpoint file gives back: torch.save, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


#: name -> (the torch optimizer of the run, the modopt optimizer transform that continues it, its state keys)
ALGORITHMS = {
    "AdamW": (lambda gs: torch.optim.AdamW(gs, lr=3e-2, fused=True),
              lambda: mo.AdamW(lr=1e-3), {"step", "exp_avg", "exp_avg_sq"}),
    "Adam": (lambda gs: torch.optim.Adam(gs, lr=3e-2, betas=(0.8, 0.99), fused=True),
             lambda: mo.Adam(lr=1e-3), {"step", "exp_avg", "exp_avg_sq"}),
    "Adam-amsgrad": (lambda gs: torch.optim.Adam(gs, lr=3e-2, amsgrad=True, fused=True),
                     lambda: mo.Adam(lr=1e-3, amsgrad=True), {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "SGD-momentum": (lambda gs: torch.optim.SGD(gs, lr=5e-2, momentum=0.9, fused=True),
                     lambda: mo.SGD(lr=1e-3, momentum=0.9), {"momentum_buffer"}),
    "SGD-nesterov": (lambda gs: torch.optim.SGD(gs, lr=5e-2, momentum=0.8, nesterov=True, fused=True),
                     lambda: mo.SGD(lr=1e-3, momentum=0.8, nesterov=True), {"momentum_buffer"}),
    "SGD": (lambda gs: torch.optim.SGD(gs, lr=5e-2, fused=True), lambda: mo.SGD(lr=1e-3), set()),
    # torch's default kernel (the for-loop one on a CPU, its step count on the CPU): fused=False runs it
    "AdamW-torch-default": (lambda gs: torch.optim.AdamW(gs, lr=3e-2),
                            lambda: mo.AdamW(lr=1e-3, fused=False), {"step", "exp_avg", "exp_avg_sq"}),
    "SGD-torch-default": (lambda gs: torch.optim.SGD(gs, lr=5e-2, momentum=0.9),
                          lambda: mo.SGD(lr=1e-3, momentum=0.9, fused=False), {"momentum_buffer"}),
}


def torch_run(name, clip=1.0):
    """A torch run of N_BEFORE steps, its checkpoint (through a file), and the run continued N_AFTER steps."""
    make_torch = ALGORITHMS[name][0]
    batches = data(N_BEFORE + N_AFTER)
    model = make_model()
    opt = make_torch(groups(model))
    train(model, opt, batches[:N_BEFORE], clip)
    ckpt = through_file({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, batches[N_BEFORE:], clip)
    return model, opt, ckpt, batches[N_BEFORE:]


def fresh_ckpt(ckpt):
    """A copy of the checkpoint (torch's own load_state_dict keeps the loaded tensors, which a run then changes)."""
    return through_file(ckpt)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_modular_continues_a_torch_run_bit_for_bit(name):
    ref_model, ref_opt, ckpt, rest = torch_run(name)
    model = make_model(seed=5)
    model.load_state_dict(ckpt["model"])
    opt = mo.Modular(groups(model, wd=(0.0, 0.0)), mo.ClipNorm(1.0), ALGORITHMS[name][1]())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ClipNorm keeps no state: nothing to warn about
        opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
    # the param groups are torch's (lr, weight decay, betas, momentum), not the transform's defaults
    for g, tg in zip(opt.param_groups, ckpt["opt"]["param_groups"]):
        for k in opt.defaults:
            if k in tg:
                assert g[k] == tg[k], k
        assert not {"fused", "foreach", "capturable", "differentiable", "decoupled_weight_decay"} & set(g)
    # the moments and step counts, under the optimizer transform's key, as torch saved them
    key = mo.core.transform.walk(opt.transforms)[1][0]
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        saved = ckpt["opt"]["state"].get(i, {})
        assert set(saved) == ALGORITHMS[name][2]
        assert {k.split(".", 1)[1] for k in opt.state[p]} == set(saved)
        for k, v in saved.items():
            mine = opt.state[p][f"{key}.{k}"]
            assert mine.dtype == v.dtype and mine.shape == v.shape and torch.equal(mine, v), k
    train(model, opt, rest)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    # and the state at the end is torch's too
    ps = [p for g in opt.param_groups for p in g["params"]]
    for p, tp in zip(ps, [p for g in ref_opt.param_groups for p in g["params"]]):
        for k, v in ref_opt.state[tp].items():
            assert torch.equal(opt.state[p][f"{key}.{k}"], v), k


def test_torch_optimizer_transform_continues_a_torch_run():
    ref_model, _, ckpt, rest = torch_run("AdamW")
    model = make_model(seed=5)
    model.load_state_dict(ckpt["model"])
    opt = mo.Modular(groups(model), mo.ClipNorm(1.0), mo.TorchOptimizer(torch.optim.AdamW, fused=True))
    opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
    assert opt.param_groups[0]["lr"] == 3e-2
    train(model, opt, rest)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_the_mapping_reads_the_optimizer_transforms_torch_class():
    """Which torch.optim state an optimizer transform continues is what it declares (`torch_class`; the core
    imports no transform): `Adam` with decoupled weight decay continues an AdamW run bit for bit, and a
    subclass inherits the declaration."""
    assert mo.SGD(0.1).torch_class is torch.optim.SGD
    assert mo.Adam().torch_class is torch.optim.Adam
    assert mo.Adam(decoupled_weight_decay=True).torch_class is mo.AdamW().torch_class is torch.optim.AdamW
    assert mo.TorchOptimizer(torch.optim.SGD, lr=0.1).torch_class is torch.optim.SGD

    class _DecoupledAdam(mo.Adam):  # (a leading underscore: not registered for the registry-wide tests)
        """An Adam subclass (it continues what Adam continues)."""

    ref_model, _, ckpt, rest = torch_run("AdamW")
    model = make_model(seed=5)
    model.load_state_dict(ckpt["model"])
    opt = mo.Modular(groups(model), mo.ClipNorm(1.0), _DecoupledAdam(decoupled_weight_decay=True))
    opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
    assert float(next(iter(opt.state.values()))["1:_DecoupledAdam.step"]) == N_BEFORE
    train(model, opt, rest)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_a_state_dict_of_an_older_torch_loads_into_adam_or_adamw():
    """torch before 2.6 saves no `decoupled_weight_decay` (Adam and AdamW look alike), and a torch before
    1.12 a Python number for `step`: both load, as torch's own load_state_dict reads them."""
    ref_model, _, ckpt, rest = torch_run("AdamW")
    old = fresh_ckpt(ckpt)["opt"]
    for g in old["param_groups"]:
        del g["decoupled_weight_decay"]
    for s in old["state"].values():
        s["step"] = int(s["step"])
    model = make_model(seed=5)
    model.load_state_dict(ckpt["model"])
    opt = mo.Modular(groups(model), mo.ClipNorm(1.0), mo.AdamW())
    opt.load_state_dict(old)
    step = next(iter(opt.state.values()))["1:AdamW.step"]
    assert step.dtype == torch.float32 and step.dim() == 0 and float(step) == N_BEFORE
    train(model, opt, rest)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    mo.Modular(groups(make_model()), mo.Adam()).load_state_dict(old)  # (which one the run was, it cannot tell)


def test_stateful_transforms_start_fresh_with_one_warning_that_names_them():
    _, _, ckpt, rest = torch_run("AdamW")
    model = make_model()
    model.load_state_dict(ckpt["model"])
    opt = mo.Modular(groups(model), mo.ZClip(warmup_steps=3), mo.ClipNorm(1.0), mo.ClipNormByEMA(), mo.AdamW())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
    fresh = [w for w in caught if "start fresh" in str(w.message) or "starts fresh" in str(w.message)]
    assert len(caught) == 1 and len(fresh) == 1, [str(w.message) for w in caught]
    msg = str(fresh[0].message)
    assert "0:ZClip" in msg and "2:ClipNormByEMA" in msg and "1:ClipNorm," not in msg and "torch.optim.AdamW" in msg
    assert fresh[0].filename == __file__  # it points at the caller's load_state_dict
    assert not any(k.startswith(("0:", "2:")) for s in opt.state.values() for k in s)
    assert opt.state_dict()["modopt"]["transforms"] == {}
    train(model, opt, rest)  # and the run goes on


def snapshot(opt):
    """Everything a load could change, as plain comparable data."""
    def flat(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, tuple(x.shape), x.detach().clone().tolist())
        if isinstance(x, dict):
            return {str(k): flat(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [flat(v) for v in x]
        return x
    return flat(opt.state_dict()), [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]


def _refusals():
    """(the torch run, how its state dict is changed, the Modular's transforms, the error it gives,
    [False: groups without weight_decay])."""
    def wrong_groups(sd):
        sd["param_groups"] = [{**sd["param_groups"][0], "params": sd["param_groups"][0]["params"]
                               + sd["param_groups"][1]["params"]}]
        return sd

    def fewer_params(sd):
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]
        return sd

    def foreign_value(sd):
        sd["state"][0]["exp_avg_sq_row"] = torch.zeros(3)
        return sd

    def wrong_shape(sd):
        sd["state"][0]["exp_avg"] = torch.zeros(5)
        return sd

    def nan_moment(sd):
        sd["state"][1]["exp_avg"] = torch.full_like(sd["state"][1]["exp_avg"], float("nan"))
        return sd

    def bad_lr(sd):
        sd["param_groups"][1]["lr"] = -1.0
        return sd

    def rmsprop(_):
        m = make_model()
        o = torch.optim.RMSprop(groups(m), lr=1e-2)
        train(m, o, data(2))
        return o.state_dict()

    adamw = lambda: [mo.ZClip(warmup_steps=2), mo.AdamW()]  # noqa: E731
    return {
        "SGD into Adam": ("SGD-momentum", lambda sd: sd, lambda: [mo.Adam()], r"torch.optim.SGD state dict .*0:Adam"),
        "AdamW into SGD": ("AdamW", lambda sd: sd, lambda: [mo.SGD(momentum=0.9)], r"torch.optim.AdamW state dict"),
        "AdamW into Adam": ("AdamW", lambda sd: sd, lambda: [mo.Adam()], r"AdamW state dict .*here mo.AdamW"),
        "Adam into AdamW": ("Adam", lambda sd: sd, lambda: [mo.AdamW()], r"Adam state dict .*here mo.Adam"),
        "into LR": ("SGD", lambda sd: sd, lambda: [mo.LR(0.1)], r"mo.SGD, mo.Adam, mo.AdamW .* 0:LR", False),
        "groups": ("AdamW", wrong_groups, adamw, r"1 param groups, this optimizer 2"),
        "params": ("AdamW", fewer_params, adamw, r"param group 0 has 1 parameters in the checkpoint, 2 here"),
        "foreign value": ("AdamW", foreign_value, adamw, r"exp_avg_sq_row.*does not write"),
        "shape": ("AdamW", wrong_shape, adamw, r"does not fit the parameter"),
        "nan": ("AdamW", nan_moment, adamw, r"not finite"),
        "lr": ("AdamW", bad_lr, adamw, r"param group 1.*lr"),
        "RMSprop": ("AdamW", rmsprop, adamw, r"not one of torch.optim.SGD, Adam or AdamW"),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_a_refused_torch_state_dict_leaves_the_optimizer_as_it_was(case):
    algo, tamper, pipeline, match, *decay = _refusals()[case]
    _, _, ckpt, _ = torch_run(algo)
    model = make_model()
    gs = groups(model) if decay != [False] else [{"params": g["params"]} for g in groups(model)]
    opt = mo.Modular(gs, *pipeline())
    train(model, opt, data(4, seed=7))  # (it holds state and groups of its own)
    before = snapshot(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(tamper(fresh_ckpt(ckpt)["opt"]))
    assert not caught  # (no "starts fresh" for a load that did not happen)
    assert snapshot(opt) == before


# --- under mo.attach -------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["attach, then load", "load, then attach"])
def test_attach_continues_a_torch_run_bit_for_bit(order):
    """A torch run with clip_grad_norm_, continued by the same torch optimizer with ClipNorm attached."""
    ref_model, _, ckpt, rest = torch_run("AdamW")
    model = make_model(seed=5)
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.AdamW(groups(model), lr=1e-3, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ClipNorm keeps no state: nothing to warn about
        if order == "attach, then load":
            mo.attach(opt, mo.ClipNorm(1.0))
            opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
        else:
            opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
            mo.attach(opt, mo.ClipNorm(1.0))
    train(model, opt, rest)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("order", ["attach, then load", "load, then attach"])
def test_attach_of_a_stateful_transform_to_a_torch_run_warns_once(order):
    _, _, ckpt, rest = torch_run("AdamW")
    model = make_model()
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.AdamW(groups(model), lr=1e-3, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "attach, then load":
            h = mo.attach(opt, mo.ZClip(warmup_steps=2), mo.ClipNorm(1.0))
            train(model, opt, rest[:3])  # (state of its own, which the load replaces: fresh)
            opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
        else:
            opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
            h = mo.attach(opt, mo.ZClip(warmup_steps=2), mo.ClipNorm(1.0))
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert "0:ZClip" in msg and "ClipNorm" not in msg and "fresh" in msg
    assert caught[0].filename == __file__
    assert h.state_dict()["transforms"] == {} and h.state_dict()["state"] == {}
    train(model, opt, rest)


def test_a_run_with_attach_continues_in_modular():
    """attach(torch AdamW, ZClip) -> Modular(ZClip, AdamW): the attached transforms' state goes with it."""
    front = lambda: [mo.ZClip(warmup_steps=3, z_thresh=1.0), mo.ClipNormByEMA(scope="tensor")]  # noqa: E731
    batches = data(N_BEFORE + N_AFTER)
    ref = make_model()
    ref_opt = torch.optim.AdamW(groups(ref), lr=3e-2, fused=True)
    mo.attach(ref_opt, *front())
    train(ref, ref_opt, batches[:N_BEFORE])
    ckpt = through_file({"model": ref.state_dict(), "opt": ref_opt.state_dict()})
    train(ref, ref_opt, batches[N_BEFORE:])
    model = make_model(seed=5)
    model.load_state_dict(ckpt["model"])
    opt = mo.Modular(groups(model), *front(), mo.AdamW())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything with state has its state: nothing starts fresh
        opt.load_state_dict(fresh_ckpt(ckpt)["opt"])
    assert not any(k.startswith("modopt_attach") for g in opt.param_groups for k in g)
    assert set(opt.state_dict()["modopt"]["transforms"]) == {"0:ZClip"}
    train(model, opt, batches[N_BEFORE:])
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    # other transforms in front: refused, and nothing changed
    other = mo.Modular(groups(make_model()), mo.ClipNormByEMA(), mo.AdamW())
    before = snapshot(other)
    with pytest.raises(ValueError, match="attached in front of the torch optimizer differ"):
        other.load_state_dict(fresh_ckpt(ckpt)["opt"])
    assert snapshot(other) == before


def test_the_migration_page_example_runs(tmp_path, monkeypatch):
    """docs/migration.md, "Continuing a torch run": its python block, as a user would paste it."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "migration.md").read_text()
    section = page.split("## Continuing a torch run", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__doc_page__"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(blocks[0], "docs/migration.md", "exec"), ns)
    opt = ns["opt"]
    assert isinstance(opt, mo.Modular) and opt.param_groups[0]["weight_decay"] == 0.1
    assert {float(s["1:AdamW.step"]) for s in opt.state.values()} == {10.0}


def test_a_torch_checkpoint_of_another_kernel_says_which_kernel_continues():
    """torch.optim continues with the checkpoint's kernel (its groups' fused/foreach keys); a modopt transform
    keeps its own: the load says so, and the transform built with the checkpoint's kernel continues bit for bit."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    data = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ref = model()
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)  # torch's default kernel (fused=None, foreach=None)
    for x in data[:3]:
        topt.zero_grad()
        ref(x).pow(2).mean().backward()
        topt.step()
    sd = topt.state_dict()
    ours = model()
    ours.load_state_dict(ref.state_dict())
    with pytest.warns(UserWarning, match=r"written by torch's default .* kernel; 0:AdamW continues with its own, the "
                                         r"fused kernel.*Build AdamW\(fused=False\)"):
        mo.Modular(ours.parameters(), mo.AdamW(lr=1e-2)).load_state_dict(sd)
    same = mo.Modular(ours.parameters(), mo.AdamW(lr=1e-2, fused=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(sd)
    for x in data[3:]:
        for m, o in ((ref, topt), (ours, same)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)
