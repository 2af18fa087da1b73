"""Integrations: mo.attach on torch optimizers == Modular, closures, checkpoints, deepcopy / pickle, Lightning."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import modopt as mo


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g) * (1 + 3 * (i % 3 == 2)) for i in range(n)]


def train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def close(ma, mb, rtol=1e-5, atol=1e-6):
    for p, q in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol)


FRONTS = {
    "ClipNorm": lambda: [mo.ClipNorm(0.3)],
    "ClipNormByEMA+Normalize": lambda: [mo.ClipNormByEMA(beta=0.5, scope="tensor"), mo.Normalize(2.0, scope="group")],
    "ZClip+ClipValue": lambda: [mo.ZClip(warmup_steps=3, max_grad_norm=0.5), mo.ClipValue(0.05)],
    "HistClip": lambda: [mo.HistClip(mo.EMACriterion(r_thresh=1.1), warmup_steps=2, warmup_max_norm=0.4)],
}
OPTS = {
    "AdamW": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05), lambda: mo.AdamW(lr=1e-2, weight_decay=0.05)),
    "SGD": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
            lambda: mo.SGD(lr=0.05, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("front", list(FRONTS))
@pytest.mark.parametrize("opt_name", list(OPTS))
def test_attach_gives_the_modular_trajectory(front, opt_name):
    make_torch, make_mo = OPTS[opt_name]
    xs = batches(12)
    ma = make_model()
    topt = make_torch(ma.parameters())
    handle = mo.attach(topt, *FRONTS[front]())
    train(ma, topt, xs)
    mb = make_model()
    train(mb, mo.Modular(mb.parameters(), *FRONTS[front](), make_mo()), xs)
    close(ma, mb)
    moved = make_model()
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(ma.parameters(), moved.parameters()))
    # and the attached transforms did something: without them the trajectory differs
    mc = make_model()
    train(mc, make_torch(mc.parameters()), xs)
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(ma.parameters(), mc.parameters()))
    assert handle.stats and not bool(handle.stats["skipped"])


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_handle_remove_detaches(opt_name):
    make_torch, _ = OPTS[opt_name]
    xs = batches(8)
    ma = make_model()
    topt = make_torch(ma.parameters())
    handle = mo.attach(topt, mo.ClipNorm(0.01))
    train(ma, topt, xs[:3])
    handle.remove()
    mb = copy.deepcopy(ma)
    tb = make_torch(mb.parameters())
    tb.load_state_dict(copy.deepcopy(topt.state_dict()))  # torch shares, not copies, loaded state tensors
    train(ma, topt, xs[3:])  # now plain torch steps
    train(mb, tb, xs[3:])
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
    with mo.attach(topt, mo.ClipNorm(0.01)) as h2:  # the context manager removes on exit
        assert len(topt._optimizer_step_pre_hooks) == 1
    assert len(topt._optimizer_step_pre_hooks) == 0 and h2.transforms


def test_attach_skips_nonfinite_steps_and_refuses_optimizer_transforms():
    m = make_model()
    topt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    handle = mo.attach(topt, mo.ClipNormByEMA())
    train(m, topt, batches(2))
    before = [p.detach().clone() for p in m.parameters()]
    sd = copy.deepcopy(handle.state_dict())
    topt.zero_grad()
    m(batches(1)[0]).pow(2).mean().backward()
    m[0].weight.grad[0, 0] = float("nan")
    topt.step()
    assert bool(handle.stats["skipped"])
    for p, q in zip(before, m.parameters()):
        assert torch.equal(p, q)
    for k, v in sd["state"].items():
        for name, t in v.items():
            assert torch.equal(t, handle.state_dict()["state"][k][name])
    for bad in (mo.Adam(), mo.Accumulate(2), mo.Chain(mo.ClipNorm(1.0), mo.SGD(lr=0.1))):
        with pytest.raises(ValueError, match="cannot be attached"):
            mo.attach(topt, bad)


# --- step(closure) and checkpoints through the optimizer's own state_dict -----------------


def closure_for(model, opt, x):
    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_attach_runs_on_the_gradients_a_closure_computes(how):
    xs = batches(6)
    ma = make_model()
    ta = torch.optim.SGD(ma.parameters(), lr=0.5)
    before = [p.detach().clone() for p in ma.parameters()]
    handle = mo.attach(ta, mo.ClipNorm(1e-6))
    for x in xs:
        c = closure_for(ma, ta, x)
        loss = ta.step(c) if how == "positional" else ta.step(closure=c)
        assert loss is not None  # step returns the closure's loss
        assert not bool(handle.stats["skipped"])
    # each step moves by lr * 1e-6 at most (total norm over all parameters)
    moved = torch.cat([(p - q).flatten() for p, q in zip(ma.parameters(), before)]).norm()
    assert moved <= 6 * 0.5 * 1e-6 * (1 + 1e-4)
    # and equals the no-closure trajectory exactly, with a stateful transform too
    for front in FRONTS.values():
        mb, mc = make_model(), make_model()
        tb, tc = torch.optim.AdamW(mb.parameters(), lr=1e-2), torch.optim.AdamW(mc.parameters(), lr=1e-2)
        mo.attach(tb, *front())
        mo.attach(tc, *front())
        train(mb, tb, xs)
        for x in xs:
            tc.step(closure_for(mc, tc, x))
        for p, q in zip(mb.parameters(), mc.parameters()):
            assert torch.equal(p, q)


def test_attach_closure_skips_a_nonfinite_step():
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    handle = mo.attach(opt, mo.ZClip(warmup_steps=2))
    for x in batches(3):
        opt.step(closure_for(m, opt, x))
    before = [p.detach().clone() for p in m.parameters()]
    torch_state = copy.deepcopy(opt.state_dict())
    zstate = copy.deepcopy(handle.state_dict())

    def bad():
        opt.zero_grad()
        m(batches(1)[0]).pow(2).mean().backward()
        m[0].weight.grad[0, 0] = float("inf")
        return torch.tensor(1.0)

    opt.step(bad)
    assert bool(handle.stats["skipped"])
    for p, q in zip(before, m.parameters()):
        assert torch.equal(p, q)
    for i, s in torch_state["state"].items():
        assert torch.equal(s["momentum_buffer"], opt.state_dict()["state"][i]["momentum_buffer"])
    assert str(zstate) == str(handle.state_dict())


def test_attach_refuses_closures_evaluated_twice_per_step():
    m = make_model()
    with pytest.raises(ValueError, match="LBFGS"):
        mo.attach(torch.optim.LBFGS(m.parameters()), mo.ClipNorm(1.0))

    class TwiceSGD(torch.optim.SGD):  # an optimizer with a line search of its own
        def step(self, closure=None):
            closure()
            return super().step(closure)

    opt = TwiceSGD(m.parameters(), lr=0.1)
    mo.attach(opt, mo.ClipNorm(1.0))
    with pytest.raises(RuntimeError, match="closure more than once"):
        opt.step(closure_for(m, opt, batches(1)[0]))


def _attached(seed=0):
    m = make_model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt, mo.attach(opt, mo.ZClip(warmup_steps=2, z_thresh=1.0), mo.ClipNormByEMA(scope="tensor"))


def test_attach_state_travels_inside_the_optimizer_state_dict():
    xs = batches(10)
    m, opt, h = _attached()
    train(m, opt, xs[:5])
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    assert "modopt_attach" in opt.state_dict()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2, opt2, h2 = _attached(seed=3)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])  # no extra code: the handle's state comes back with the optimizer's
    assert str(h2.state_dict()) == str(h.state_dict())
    train(m, opt, xs[5:])
    train(m2, opt2, xs[5:])
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    # a fresh handle (a state dict without the handle's entry: it starts fresh, and says so) differs:
    # the test can fail (a fresh copy of the checkpoint: torch's own load keeps the loaded tensors)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    assert ck["opt"]["param_groups"][0]["modopt_attach"] is ck["opt"]["modopt_attach"]  # (saved once, in both places)
    plain = {k: v for k, v in ck["opt"].items() if k != "modopt_attach"}
    plain["param_groups"] = [{k: v for k, v in g.items() if k != "modopt_attach"} for g in plain["param_groups"]]
    m3, opt3, _ = _attached(seed=3)
    m3.load_state_dict(ck["model"])
    with pytest.warns(UserWarning, match=r"no state for 0:ZClip, 1:ClipNormByEMA attached by mo.attach"):
        opt3.load_state_dict(plain)
    train(m3, opt3, xs[5:])
    assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), m3.parameters()))
    # a plain torch optimizer (nothing attached) still loads the checkpoint
    torch.optim.AdamW(make_model().parameters(), lr=1e-2).load_state_dict(ck["opt"])


def test_a_bad_attach_entry_leaves_optimizer_and_handle_as_they_were():
    m, opt, h = _attached()
    train(m, opt, batches(3))
    sd = opt.state_dict()
    before_opt, before_h = copy.deepcopy(opt.state_dict()), str(h.state_dict())
    m2, opt2, h2 = _attached()
    train(m2, opt2, batches(2, seed=5))
    before_opt2, before_h2 = str(opt2.state_dict()), str(h2.state_dict())
    for broken in ({"state": {99: {}}, "transforms": {}}, {"transforms": {}}):
        with pytest.raises(ValueError):
            opt2.load_state_dict({**sd, "modopt_attach": broken})
        assert str(opt2.state_dict()) == before_opt2 and str(h2.state_dict()) == before_h2
    assert str(before_opt) == str(opt.state_dict()) and before_h == str(h.state_dict())


def test_a_handle_checkpoint_that_lacks_state_is_refused_naming_it_and_strict_false_restarts_it():
    """The handle's entry carries its inventory: a value taken out of a parameter's entry, or a transform's
    statistic taken out of `transforms`, is refused through the optimizer's own load_state_dict (nothing
    changes, optimizer or handle) and through the handle's, naming each; `strict=False` loads the rest
    with one warning; an entry saved before the first step (nothing held yet) loads."""
    m, opt, h = _attached()
    train(m, opt, batches(3))
    sd = copy.deepcopy(opt.state_dict())
    entry = sd["modopt_attach"]
    assert "1:ClipNormByEMA.ema" in entry["inventory"] and entry["param_keys"]
    key = next(iter(entry["state"][0]))
    del entry["state"][0][key]
    stat = next(iter(entry["transforms"]["0:ZClip"]))
    del entry["transforms"]["0:ZClip"][stat]
    sd["param_groups"][0]["modopt_attach"] = entry
    m2, opt2, h2 = _attached()
    train(m2, opt2, batches(2, seed=5))
    before_opt2, before_h2 = str(opt2.state_dict()), str(h2.state_dict())
    with pytest.raises(ValueError, match=rf"(?s)lacks state.*parameter 0 \(shape .*{key!r}.*transform 0:ZClip: {stat!r}.*"
                       r"handle.load_state_dict\(sd\['modopt_attach'\], strict=False\)"):
        opt2.load_state_dict(sd)
    assert str(opt2.state_dict()) == before_opt2 and str(h2.state_dict()) == before_h2
    with pytest.raises(ValueError, match=r"AttachHandle.load_state_dict: the checkpoint lacks state"):
        h2.load_state_dict(entry)
    with pytest.warns(UserWarning, match=rf"(?s)strict=False.*{key!r}"):
        h2.load_state_dict(entry, strict=False)
    assert key not in h2.state[next(iter(m2.parameters()))]  # (restarts: made again at the next step)
    train(m2, opt2, batches(1, seed=6))  # the restarted parts are made again and the step runs
    # never held is not missing: a checkpoint taken before the first step loads into a trained handle
    m3, opt3, h3 = _attached()
    h2.load_state_dict(h3.state_dict())
    with pytest.raises(ValueError, match="inventory"):
        h2.load_state_dict({**entry, "inventory": "all"})


def test_two_handles_and_remove():
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    h1 = mo.attach(opt, mo.ClipNormByEMA())
    h2 = mo.attach(opt, mo.ZClip(warmup_steps=2))
    train(m, opt, batches(3))
    sd = opt.state_dict()
    assert {"modopt_attach", "modopt_attach.1"} <= set(sd)
    h2.remove()
    h1.remove()
    assert not any(k.startswith("modopt_attach") for k in opt.state_dict())
    assert len(opt._optimizer_load_state_dict_pre_hooks) == 0


# --- deepcopy / pickle ------------------------------------------------------------------


def _trained(load_from_checkpoint: bool):
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ZClip(warmup_steps=2), mo.ClipNormByEMA(scope="tensor"),
                     mo.AdamW(lr=1e-2))
    train(model, opt, batches(4))
    if load_from_checkpoint:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        opt2 = mo.Modular(model.named_parameters(), *opt.transforms)
        opt2.load_state_dict(torch.load(buf, weights_only=True))
        opt = opt2
    return model, opt


@pytest.mark.parametrize("load_from_checkpoint", [False, True])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_modular_continue_identically(how, load_from_checkpoint):
    model, opt = _trained(load_from_checkpoint)
    if how == "deepcopy":
        m2, o2 = copy.deepcopy((model, opt))
    else:
        m2, o2 = pickle.loads(pickle.dumps((model, opt)))
    assert o2.config == opt.config and o2 is not opt
    assert all(any(p is q for q in m2.parameters()) for g in o2.param_groups for p in g["params"])
    xs = batches(5, seed=7)
    train(model, opt, xs)
    train(m2, o2, xs)
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert int(o2.stats["skipped_steps"]) == 0


# --- Lightning ------------------------------------------------------------------------------


def test_lightning_module_trains_with_modular_and_a_scheduler(tmp_path):
    import lightning as L  # a dev dependency

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = mo.Modular(self.net.parameters(), mo.ClipNorm(1.0), mo.AdamW(lr=1e-2))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    xs = torch.cat(batches(4))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs), batch_size=7)
    net = Net()
    before = [p.detach().clone() for p in net.parameters()]
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(net, loader)
    opt = trainer.optimizers[0]
    assert isinstance(opt, mo.Modular) and opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


class _AttachedNet:
    """A LightningModule (built lazily: Lightning is imported inside the test) with an attached pipeline."""

    @staticmethod
    def make(L, front, lr=0.5):
        class Net(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = make_model()
                self.handle = None

            def training_step(self, batch, _):
                return self.net(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                opt = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=0.9)
                self.handle = mo.attach(opt, *front())
                return opt

        return Net()


def _loader(n=6):
    xs = torch.cat(batches(n))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs), batch_size=7)


def _trainer(L, tmp_path, steps, **kw):
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), **kw)


def test_lightning_automatic_optimisation_runs_attached_transforms(tmp_path):
    import lightning as L

    net = _AttachedNet.make(L, lambda: [mo.ClipNorm(1e-6)])
    before = [p.detach().clone() for p in net.parameters()]
    _trainer(L, tmp_path, 4, enable_checkpointing=False).fit(net, _loader())
    moved = torch.cat([(p - q).flatten() for p, q in zip(net.parameters(), before)]).norm()
    # Lightning calls opt.step(closure): the clip applies to the closure's gradients
    assert 0 < moved < 4 * 0.5 * 1e-6 * 4  # lr * max_norm per step, momentum <= 1/(1-0.9) not reached in 4 steps
    assert not bool(net.handle.stats["skipped"])


def test_lightning_checkpoint_resumes_the_attached_state(tmp_path):
    import lightning as L

    front = lambda: [mo.ZClip(warmup_steps=2, z_thresh=1.0), mo.ClipNormByEMA(scope="tensor")]  # noqa: E731
    full = _AttachedNet.make(L, front, lr=0.05)
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    _trainer(L, tmp_path / "full", 6, callbacks=[cb]).fit(full, _loader(3))  # 3 steps an epoch
    ck = tmp_path / "ck" / "epoch=0-step=3.ckpt"
    saved = torch.load(ck, weights_only=False)["optimizer_states"][0]
    assert "0:ZClip" in saved["modopt_attach"]["transforms"]  # Lightning saved the handle's state, no extra code
    resumed = _AttachedNet.make(L, front, lr=0.05)
    _trainer(L, tmp_path / "b", 6, enable_checkpointing=False).fit(resumed, _loader(3), ckpt_path=str(ck))
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert str(full.handle.state_dict()) == str(resumed.handle.state_dict())


def test_attach_and_modular_step_meta_parameters_without_reading_them():
    """Meta tensors hold no values: the non-finite check has nothing to read (torch.optim steps them too)."""
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    p.grad = torch.empty(3, device="meta")
    opt = torch.optim.SGD([p], lr=0.1)
    mo.attach(opt, mo.ClipNorm(1.0))
    opt.step()
    for t in (mo.Adam(), mo.AdamW(), mo.SGD(lr=0.1, momentum=0.9)):
        m = mo.Modular([p], t)
        m.step()
        m.step()
    with pytest.raises(RuntimeError, match="fused=True: torch has no fused"):
        mo.Modular([p], mo.Adam(fused=True)).step()
