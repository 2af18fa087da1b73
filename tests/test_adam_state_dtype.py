"""`Adam`/`AdamW`'s `state_dtype="bfloat16"`: the moments kept in bfloat16 (docs/modules/optimizers.md,
"bfloat16 moments").

The step computes in the parameters' dtype (float32 for float16 parameters) from the stored moments and
stores the new moments rounded to nearest; this step's update reads the unrounded ones, as torch's fused
CUDA kernel does with bfloat16 moments. The reference below is written out by hand in float64.
"""

from __future__ import annotations

import io

import pydantic
import pytest
import torch

import modopt as mo

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.99, 1e-8, 0.05


def _params(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 5, dtype=dtype).to(device)),
            torch.nn.Parameter(torch.randn(7, dtype=dtype).to(device))]


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g).to(p.dtype) * (1 + step % 3)).to(p.device)


def _reference(p0: torch.Tensor, grads: list[torch.Tensor], *, store, amsgrad=False, decoupled=True):
    """AdamW (or Adam) by hand in float64; `store` rounds the moments kept between steps (bfloat16 state:
    a round trip through bfloat16; float32 state: through float32)."""
    p = p0.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    vmax = torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.double()
        if decoupled:
            p = p * (1 - LR * WD)
        else:
            g = g + WD * p
        m_new = B1 * m + (1 - B1) * g
        v_new = B2 * v + (1 - B2) * g * g
        vmax_new = torch.maximum(vmax, v_new)
        den = (vmax_new if amsgrad else v_new).sqrt() / (1 - B2**t) ** 0.5 + EPS
        p = p - LR / (1 - B1**t) * m_new / den  # (this step reads the unrounded moments)
        m, v, vmax = store(m_new), store(v_new), store(vmax_new)
    return p, m, v, vmax


def _bf16(x):
    return x.to(torch.bfloat16).double()


def _f32(x):
    return x.float().double()


def _run(t, ps, steps=12):
    opt = mo.Modular(ps, t)
    for s in range(steps):
        _grads(ps, s)
        opt.step()
    return opt


def _grads_seen(p, steps=12):
    out = []
    for s in range(steps):
        q = [torch.zeros(6, 5), torch.zeros(7)]  # (the shapes of `_params`, drawn in their order)
        _grads(q, s)
        out.append(q[0].grad if p.dim() == 2 else q[1].grad)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch's fused kernel on bfloat16 moments"))])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_bf16_moments_follow_the_hand_reference(cls, amsgrad, device):
    """The moments are bfloat16, each the float64 reference's moment rounded to bfloat16 (to one bfloat16
    step: the kernel's float32 arithmetic may sit on the other side of a rounding boundary), and the
    parameters follow the reference that stores bfloat16 moments, much closer than the one that stores
    float32 moments (which the float32-state optimizer follows): the rounding is really there. On CUDA
    torch's fused kernel takes the bfloat16 moments itself (scripts/gpu-check runs this case)."""
    ps = _params(device=device)
    p0 = ps[0].detach().cpu().clone()
    opt = _run(getattr(mo, cls)(LR, betas=(B1, B2), eps=EPS, weight_decay=WD, amsgrad=amsgrad,
                                state_dtype="bfloat16"), ps)
    state = opt.state[ps[0]]
    key = f"0:{cls}."
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    assert {state[key + n].dtype for n in names} == {torch.bfloat16}
    assert state[key + "step"].dtype == torch.float32
    ref_p, ref_m, ref_v, ref_vmax = _reference(p0, _grads_seen(p0), store=_bf16, amsgrad=amsgrad,
                                               decoupled=cls == "AdamW")
    for n, ref in zip(names, (ref_m, ref_v, ref_vmax)):
        got = state[key + n].double().cpu()
        ulp = ref.abs().clamp_min(1e-30) * 2.0**-7  # one bfloat16 step at the value
        assert ((got - ref).abs() <= ulp).all(), n
        assert (got == ref).float().mean() > 0.9, n  # mostly the very same bfloat16 value
    far, _, _, _ = _reference(p0, _grads_seen(p0), store=_f32, amsgrad=amsgrad, decoupled=cls == "AdamW")
    err = (ps[0].detach().double().cpu() - ref_p).abs().max()
    assert err < 2e-6
    assert (far - ref_p).abs().max() > 20 * err  # the rounding moves the trajectory measurably


def test_default_is_unchanged_bit_for_bit():
    """state_dtype="param" (the default) is torch.optim.AdamW(fused=True), float32 moments, the same bits."""
    assert mo.AdamW().state_dtype == "param"
    ps, qs = _params(), _params()
    opt = _run(mo.AdamW(LR, betas=(B1, B2), weight_decay=WD), ps)
    ref = torch.optim.AdamW(qs, LR, betas=(B1, B2), weight_decay=WD, fused=True)
    for s in range(12):
        _grads(qs, s)
        ref.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        assert opt.state[p]["0:AdamW.exp_avg"].dtype == torch.float32
        assert torch.equal(opt.state[p]["0:AdamW.exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def _state_bytes(opt, names=("exp_avg", "exp_avg_sq", "max_exp_avg_sq")):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
               if k.rsplit(".", 1)[-1] in names)


def test_moment_memory_is_halved():
    ps, qs = _params(), _params()
    full = _state_bytes(_run(mo.AdamW(LR, amsgrad=True), ps, steps=1))
    half = _state_bytes(_run(mo.AdamW(LR, amsgrad=True, state_dtype="bfloat16"), qs, steps=1))
    n = sum(p.numel() for p in ps)
    assert full == 3 * 4 * n and half == 3 * 2 * n


def test_not_last_and_float_kinds_step_as_the_write_path():
    """Adam before another transform (its formulas, which return the update) with bfloat16 moments: close to
    the write path (the fused kernel); float64 and bfloat16 parameters keep working, float16 ones compute in
    float32 and store bfloat16 moments."""
    ps, qs = _params(), _params()
    _run(mo.Adam(LR, state_dtype="bfloat16"), ps)
    opt = _run(mo.Chain(mo.Adam(LR, state_dtype="bfloat16"), mo.ClipNorm(1e9)), qs)
    assert opt.state[qs[0]]["0:Chain/0:Adam.exp_avg"].dtype == torch.bfloat16
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    for dt in (torch.float64, torch.bfloat16, torch.float16):
        rs = _params(dt)
        p0 = rs[0].detach().clone()
        opt = _run(mo.Adam(LR, betas=(B1, B2), eps=EPS, weight_decay=WD, state_dtype="bfloat16"), rs)
        assert rs[0].dtype == dt and opt.state[rs[0]]["0:Adam.exp_avg"].dtype == torch.bfloat16
        ref_p, *_ = _reference(p0, [g.to(dt) for g in _grads_seen(p0)], store=_bf16, decoupled=False)
        tol = {torch.float64: 1e-6, torch.bfloat16: 0.05, torch.float16: 5e-3}[dt]
        assert (rs[0].detach().double() - ref_p).abs().max() < tol, dt


def _saved(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_checkpoint_round_trip_and_conversions():
    """bfloat16 state saves and loads (weights_only) as it is, and a load converts: float32 moments into a
    bfloat16-state optimizer are rounded to bfloat16, bfloat16 ones into a float32-state optimizer widened
    (exactly); the runs then continue as those optimizers do."""
    ps = _params()
    opt = _run(mo.AdamW(LR, state_dtype="bfloat16"), ps, steps=3)
    sd = _saved(opt)
    assert sd["state"][0]["0:AdamW.exp_avg"].dtype == torch.bfloat16
    again = mo.Modular(ps, mo.AdamW(LR, state_dtype="bfloat16"))
    again.load_state_dict(sd)
    for k, v in opt.state[ps[0]].items():
        assert torch.equal(again.state[ps[0]][k], v) and again.state[ps[0]][k].dtype == v.dtype

    with pytest.warns(UserWarning, match="state_dtype"):
        wide = mo.Modular(ps, mo.AdamW(LR))
        wide.load_state_dict(sd)
    m = wide.state[ps[0]]["0:AdamW.exp_avg"]
    assert m.dtype == torch.float32 and torch.equal(m, opt.state[ps[0]]["0:AdamW.exp_avg"].float())

    qs = _params()
    full = _run(mo.AdamW(LR), qs, steps=3)
    with pytest.warns(UserWarning, match="state_dtype"):
        narrow = mo.Modular(qs, mo.AdamW(LR, state_dtype="bfloat16"))
        narrow.load_state_dict(_saved(full))
    m32 = full.state[qs[0]]["0:AdamW.exp_avg"]
    m16 = narrow.state[qs[0]]["0:AdamW.exp_avg"]
    assert m16.dtype == torch.bfloat16 and torch.equal(m16, m32.to(torch.bfloat16))
    _grads(qs, 3)
    narrow.step()  # (the loaded bfloat16 moments step as any)
    assert narrow.state[qs[0]]["0:AdamW.exp_avg"].dtype == torch.bfloat16


def test_config_round_trip(tmp_path):
    cfg = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0), mo.AdamW(3e-4, state_dtype="bfloat16")])
    for fmt in ("yaml", "json"):
        path = cfg.save(tmp_path / f"c.{fmt}")
        assert "bfloat16" in path.read_text()
        back = mo.load_config(path)
        assert back == cfg and back.transforms[1].state_dtype == "bfloat16"
        opt = mo.Modular.from_config(_params(), path)
        assert opt.config == cfg
    (tmp_path / "bad.yaml").write_text("transforms:\n  - {type: AdamW, state_dtype: float16}\n")
    with pytest.raises(Exception, match="state_dtype"):
        mo.load_config(tmp_path / "bad.yaml")


def test_fields_are_checked():
    with pytest.raises(pydantic.ValidationError, match="state_dtype"):
        mo.Adam(state_dtype="float16")
    for kw in (dict(fused=False), dict(foreach=True), dict(foreach=False)):
        with pytest.raises(pydantic.ValidationError, match="state_dtype='bfloat16' runs on modopt's kernel"):
            mo.AdamW(state_dtype="bfloat16", **kw)
    mo.AdamW(state_dtype="bfloat16", fused=True)  # (torch's fused kernel is modopt's own choice)


@pytest.mark.compile
def test_compiled_step_stores_bf16_moments():
    """Under `mo.compile_step` the formulas run on float32 copies and store the moments rounded, as the
    eager step (equal up to inductor's reordering)."""
    ps, qs = _params(), _params()
    eager = _run(mo.AdamW(LR, state_dtype="bfloat16"), ps, steps=4)
    opt = mo.Modular(qs, mo.AdamW(LR, state_dtype="bfloat16"))
    step = mo.compile_step(opt)
    for s in range(4):
        _grads(qs, s)
        step()
    assert opt.state[qs[0]]["0:AdamW.exp_avg"].dtype == torch.bfloat16
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    torch.testing.assert_close(opt.state[qs[0]]["0:AdamW.exp_avg_sq"].float(),
                               eager.state[ps[0]]["0:AdamW.exp_avg_sq"].float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("beta2,decays", [(0.999, False), (0.99, True)])
def test_round_to_nearest_holds_the_second_moment_at_beta2_0999(beta2, decays):
    """What docs/modules/optimizers.md states: round to nearest drops a change below half a bfloat16 step,
    so `v <- 0.999 v` never moves a bfloat16 second moment (it does in float32); 0.99's decay does."""
    p = torch.nn.Parameter(torch.zeros(16))
    opt = mo.Modular([p], mo.Adam(1e-3, betas=(0.9, beta2), state_dtype="bfloat16"))
    p.grad = torch.ones(16)
    opt.step()
    v0 = opt.state[p]["0:Adam.exp_avg_sq"].clone()
    for _ in range(50):
        p.grad = torch.zeros(16)
        opt.step()
    v = opt.state[p]["0:Adam.exp_avg_sq"]
    assert bool((v < v0).all()) is decays
