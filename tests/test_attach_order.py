"""mo.attach and optimizer.load_state_dict in either order: the attached transforms' state comes back.

nanoGPT's train.py builds the optimizer, loads the checkpoint into it, and only then does anything
else: the attached transforms' state must survive a load that happens before `attach`. It rides in
`param_groups[0]["modopt_attach"]` (torch keeps a group's keys when it loads), where attach picks it up.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import modopt as mo

N_BEFORE, N_AFTER = 8, 20


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    # spikes every third batch: ZClip's running mean and variance decide what it clips
    return [torch.randn(9, 5, generator=g) * (8.0 if i % 3 == 2 else 1.0) for i in range(n)]


def train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def zclip():
    return mo.ZClip(warmup_steps=3, z_thresh=1.0, alpha=0.9)


def build(seed=0):
    model = make_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def saved_run():
    """A run with ZClip attached: the checkpoint's bytes, and the run continued without a break."""
    xs = data(N_BEFORE + N_AFTER)
    model, opt = build()
    mo.attach(opt, zclip())
    train(model, opt, xs[:N_BEFORE])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, xs[N_BEFORE:])
    return buf.getvalue(), model, xs[N_BEFORE:]


def load(raw):
    """A fresh read of the checkpoint, as a new process gets it."""
    return torch.load(io.BytesIO(raw), weights_only=True)


def resume(raw, order, *transforms):
    """Rebuild from scratch (new model, optimizer and transforms) and load in the given order."""
    ckpt = load(raw)
    model, opt = build(seed=7)
    model.load_state_dict(ckpt["model"])
    if order == "load, then attach":
        opt.load_state_dict(ckpt["opt"])
        handle = mo.attach(opt, *(transforms or (zclip(),)))
    else:
        handle = mo.attach(opt, *(transforms or (zclip(),)))
        opt.load_state_dict(ckpt["opt"])
    return model, opt, handle


def same(ma, mb):
    return all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))


def test_either_order_resumes_the_attached_state_bit_for_bit():
    raw, straight, rest = saved_run()
    saved_handle = load(raw)["opt"]["modopt_attach"]
    assert set(saved_handle["transforms"]["0:ZClip"]) >= {"mu", "var"}
    runs = {}
    for order in ("load, then attach", "attach, then load"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing starts fresh, nothing to warn about
            model, opt, handle = resume(raw, order)
        assert str(handle.state_dict()) == str(saved_handle), order
        assert "modopt_attach" not in opt.param_groups[0]  # (the handle holds it, not the group)
        train(model, opt, rest)
        runs[order] = model
    assert same(runs["load, then attach"], straight)
    assert same(runs["attach, then load"], straight)
    assert same(runs["load, then attach"], runs["attach, then load"])
    # the test can fail: ZClip started fresh takes another path
    ckpt = load(raw)
    for k in [k for k in ckpt["opt"] if k.startswith("modopt_attach")]:
        del ckpt["opt"][k]
    del ckpt["opt"]["param_groups"][0]["modopt_attach"]
    model, opt = build()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    with pytest.warns(UserWarning, match="0:ZClip: it starts fresh"):
        mo.attach(opt, zclip())
    train(model, opt, rest)
    assert not same(model, straight)


def test_two_handles_each_pick_up_their_own_state_after_a_load():
    xs = data(N_BEFORE + N_AFTER)
    model, opt = build()
    mo.attach(opt, zclip())
    mo.attach(opt, mo.ClipNormByEMA(beta=0.5, scope="tensor"))
    train(model, opt, xs[:N_BEFORE])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, xs[N_BEFORE:])
    ckpt = load(buf.getvalue())
    m2, o2 = build(seed=3)
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["opt"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mo.attach(o2, zclip())
        mo.attach(o2, mo.ClipNormByEMA(beta=0.5, scope="tensor"))
    assert not any(k.startswith("modopt_attach") for k in o2.param_groups[0])
    train(m2, o2, xs[N_BEFORE:])
    assert same(m2, model)


def test_other_transforms_after_a_load_are_refused_and_change_nothing():
    raw, straight, rest = saved_run()
    ckpt = load(raw)
    model, opt = build(seed=7)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    with pytest.raises(ValueError, match=r"Attach the transforms it was saved with, or `del optimizer\.param_groups"):
        mo.attach(opt, mo.ClipNormByEMA())
    assert "modopt_attach" in opt.param_groups[0]  # still there for the right transforms
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_load_state_dict_pre_hooks
    assert not getattr(opt, "_modopt_attach_keys", set())
    mo.attach(opt, zclip())
    train(model, opt, rest)
    assert same(model, straight)


def test_an_older_checkpoint_loaded_before_attach_warns_with_the_fix():
    """A checkpoint from a modopt that kept the handle's state only at the top of the state dict: a load
    before attach cannot keep it (torch drops the key), so attach says so and names the fix."""
    raw, straight, rest = saved_run()
    ckpt = load(raw)
    del ckpt["opt"]["param_groups"][0]["modopt_attach"]
    model, opt = build(seed=7)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    with pytest.warns(UserWarning, match=r"0:ZClip: it starts fresh.*optimizer\.load_state_dict\(checkpoint\)") as w:
        mo.attach(opt, zclip())
    assert w[0].filename == __file__
    opt.load_state_dict(load(raw)["opt"])  # the fix: load again, now that ZClip is attached
    train(model, opt, rest)
    assert same(model, straight)


def test_the_state_passes_through_an_optimizer_without_attach():
    """Loaded into a torch optimizer with nothing attached and saved again, the entry is still there."""
    raw, straight, rest = saved_run()
    ckpt = load(raw)
    _, plain = build()
    plain.load_state_dict(ckpt["opt"])
    again = io.BytesIO()
    torch.save({"model": ckpt["model"], "opt": plain.state_dict()}, again)
    model, opt, _ = resume(again.getvalue(), "load, then attach")
    train(model, opt, rest)
    assert same(model, straight)
