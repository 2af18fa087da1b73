"""Integrations: mo.attach on torch optimizers == Modular, removal, deepcopy / pickle, Lightning (if installed)."""

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
    try:
        import lightning as L
    except ImportError:
        L = pytest.importorskip(
            "pytorch_lightning",
            reason="Lightning is not installed (deliberately not a CI dependency: too heavy); "
            "see docs/howto/lightning.md",
        )

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
