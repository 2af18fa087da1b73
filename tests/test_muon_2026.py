"""The Muon recipes as their authors run them in 2026 (issue 56, item 3).

* nanochat's Muon (karpathy/nanochat `nanochat/optim.py` at commit
  92d63d4e8bb4df75c3b71618f31ddde2378b2bcd, MIT license): `examples/configs/muon_normuon_polar_express.yaml`
  against nanochat's own step functions, vendored below (compile decorators and the distributed
  machinery left out; the arithmetic is theirs, op for op); `MuonEq`, `MuonPlus` and `ShapeScale`
  against their float64 spec;
* torch 2.14's `adjust_lr_fn="spectral_unclamped"`, against the float64 spec here and against torch's
  own `Muon` where torch >= 2.14 is installed;
* optax's `preconditioning="aol"` (and `"schatten"`), against optax's own `orthogonalize_via_newton_schulz`
  and the spec;
* a named schedule past its end (`ns_past_end`: Emerging-Optimizers cycles `quintic`) and the Polar
  Express paper's digits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pydantic
import pytest
import torch
from torch.torch_version import TorchVersion

import modopt as mo
from checks import randn, seeded_grads, twin_params
from modopt.spec import matrix_scale as mspec
from modopt.spec import orthogonal as spec
from modopt.transforms.orthogonal import NS_PRESETS, coefficient_steps

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "muon_normuon_polar_express.yaml"
MATRICES = ["*.in_proj_weight", "*.out_proj.weight", "*.linear1.weight", "*.linear2.weight"]


# --- nanochat, vendored (nanochat/optim.py at 92d63d4e8bb4df75c3b71618f31ddde2378b2bcd) ----------------------
NANOCHAT_POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def nanochat_muon_step(stacked_grads, stacked_params, momentum_buffer, second_momentum_buffer, momentum_t, lr_t,
                       wd_t, beta2_t, ns_steps, red_dim, compute_dtype=torch.float32):
    """nanochat's `muon_step_fused` (without `torch.compile`; `COMPUTE_DTYPE` an argument)."""
    momentum = momentum_t.to(stacked_grads.dtype)
    momentum_buffer.lerp_(stacked_grads, 1 - momentum)
    g = stacked_grads.lerp_(momentum_buffer, momentum)
    X = g.bfloat16() if compute_dtype == torch.bfloat16 else g
    target = X.float().norm(dim=(-2, -1), keepdim=True) / (X.size(-2) ** 0.5)  # MuonEq
    row_norm = X.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)
    X = X * (target / row_norm).to(X.dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)  # Polar Express
    if g.size(-2) > g.size(-1):
        for a, b, c in NANOCHAT_POLAR_EXPRESS[:ns_steps]:
            A = X.mT @ X
            B = b * A + c * (A @ A)
            X = a * X + X @ B
    else:
        for a, b, c in NANOCHAT_POLAR_EXPRESS[:ns_steps]:
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    g = X.to(stacked_params.dtype)
    target_norm = min(g.size(-2), g.size(-1)) ** 0.5  # Muon+
    current_norm = g.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)
    g = g * (target_norm / current_norm).to(g.dtype)
    beta2 = beta2_t.to(g.dtype)  # NorMuon
    v_mean = g.float().square().mean(dim=red_dim, keepdim=True)
    red_dim_size = g.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red_dim_size).sqrt()
    second_momentum_buffer.lerp_(v_mean.to(dtype=second_momentum_buffer.dtype), 1 - beta2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.float().square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * (step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype)
    lr = lr_t.to(g.dtype)  # cautious weight decay and the step
    wd = wd_t.to(g.dtype)
    mask = (g * stacked_params) >= 0
    stacked_params.sub_(lr * g + lr * wd * stacked_params * mask)


def nanochat_adamw_step(p, grad, exp_avg, exp_avg_sq, step_t, lr_t, beta1_t, beta2_t, eps_t, wd_t):
    """nanochat's `adamw_step_fused` (without `torch.compile`)."""
    p32, exp_avg32, exp_avg_sq32, grad32 = p.float(), exp_avg.float(), exp_avg_sq.float(), grad.float()
    p32.mul_(1 - lr_t * wd_t)
    exp_avg32.lerp_(grad32, 1 - beta1_t)
    exp_avg_sq32.lerp_(grad32.square(), 1 - beta2_t)
    bias1 = 1 - beta1_t ** step_t
    bias2 = 1 - beta2_t ** step_t
    denom = (exp_avg_sq32 / bias2).sqrt() + eps_t
    p32.add_(exp_avg32 / denom, alpha=-(lr_t / bias1))
    p.copy_(p32)
    exp_avg.copy_(exp_avg32)
    exp_avg_sq.copy_(exp_avg_sq32)


class NanochatMuonAdamW:
    """nanochat's `MuonAdamW.step` on one rank, for one `kind='muon'` group and one `kind='adamw'` group: each
    Muon matrix stepped as a stack of one (nanochat stacks same-shape matrices; every statistic is per matrix),
    its lr multiplied by `max(1, rows / cols) ** 0.5` as `_compute_muon` does."""

    def __init__(self, muon_params, adamw_params, lr, momentum, beta2, weight_decay, adamw_betas, adamw_eps,
                 adamw_wd, adamw_lr):
        self.muon, self.adamw = list(muon_params), list(adamw_params)
        self.hyper = dict(lr=lr, momentum=momentum, beta2=beta2, wd=weight_decay)
        self.adamw_hyper = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, wd=adamw_wd)
        self.state: dict = {}

    @torch.no_grad()
    def step(self):
        h = self.hyper
        f32 = lambda v: torch.tensor(float(v), dtype=torch.float32)  # noqa: E731 (its 0-d CPU tensors)
        for p in self.muon:
            st = self.state.setdefault(p, {})
            rows, cols = p.shape
            if not st:
                st["m"] = torch.zeros(1, rows, cols, dtype=p.dtype)
                st["v"] = torch.zeros((1, rows, 1) if rows >= cols else (1, 1, cols), dtype=p.dtype)
            stacked = p.detach()[None].clone()
            nanochat_muon_step(p.grad[None].clone(), stacked, st["m"], st["v"], f32(h["momentum"]),
                               f32(h["lr"] * max(1.0, rows / cols) ** 0.5), f32(h["wd"]), f32(h["beta2"]), 5,
                               -1 if rows >= cols else -2)
            p.copy_(stacked[0])
        a = self.adamw_hyper
        for p in self.adamw:
            st = self.state.setdefault(p, {})
            if not st:
                st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            st["step"] += 1
            nanochat_adamw_step(p.data, p.grad, st["m"], st["v"], f32(st["step"]), f32(a["lr"]), f32(a["betas"][0]),
                                f32(a["betas"][1]), f32(a["eps"]), f32(a["wd"]))


def _task():
    from modopt.cli.tasks import make_task

    return make_task("transformer", {"vocab": 16, "seq_len": 24, "d_model": 32, "nhead": 2, "layers": 2, "ff": 64}, 0)


def _config(tmp_path, ns_dtype="float32"):
    """The example config with Newton-Schulz in `ns_dtype` (nanochat computes in float32 on a CPU)."""
    text = CONFIG.read_text().replace("ns_safety: 1.01}", f"ns_safety: 1.01, ns_dtype: {ns_dtype}}}")
    path = tmp_path / "nanochat.yaml"
    path.write_text(text)
    return mo.load_config(path)


def test_the_nanochat_config_holds_nanochats_values():
    """Safety 1.01 (nanochat since March 2026), MuonEq before and Muon+ after the orthogonalization, NorMuon's
    beta2 0.9 over the smaller dimension, and the shape factor last (after the cautious decay)."""
    cfg = mo.load_config(CONFIG)
    task = _task()
    opt = cfg.build(list(task.model.named_parameters()))
    (branch,) = [t for t in opt.transforms if isinstance(t, mo.Masked) and any(isinstance(c, mo.NorMuon)
                                                                               for c in t.transforms)]
    kinds = [type(c) for c in branch.transforms]
    assert kinds == [mo.Momentum, mo.MuonEq, mo.Orthogonalize, mo.MuonPlus, mo.NorMuon, mo.LR,
                     mo.CautiousWeightDecay, mo.ShapeScale]
    mom, _, ortho, _, nor, lr, wd, shape = branch.transforms
    assert (mom.beta, mom.nesterov) == (0.95, True)
    assert ortho.ns_coefficients == "polar_express" and ortho.safety() == 1.01 and ortho.ns_steps == 5
    assert ortho.adjust_lr == "none" and shape.adjust_lr == "original"  # the factor after Muon+, on the decay too
    assert list(ortho.coefficient_steps()) == NANOCHAT_POLAR_EXPRESS
    assert (nor.beta2, nor.per) == (0.9, "larger")
    assert lr.lr == 0.02 and wd.cautious
    (adamw,) = [c for t in opt.transforms if isinstance(t, mo.Masked) for c in t.transforms if isinstance(c, mo.AdamW)]
    assert adamw.betas[0] == 0.8 and adamw.eps == 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_nanochat_config_follows_nanochats_own_step(tmp_path, dtype):
    """Eight steps of the config's optimizer on the transformer task (real `backward()`), against nanochat's
    vendored `MuonAdamW` step on a twin model with the same hyperparameters: every parameter agrees after every
    step. The remaining differences are nanochat's floors (`||X|| 1.01 + 1e-6` where modopt clamps at `eps`,
    `rsqrt(max(v, 1e-10))` where NorMuon adds 1e-10 to `sqrt(v)`) and rounding. The old config (safety 1.02,
    the decay on the unadjusted lr, beta2 0.95, neither MuonEq nor Muon+) fails this test at the first step."""
    cfg = _config(tmp_path, "float64" if dtype == torch.float64 else "float32")
    # float32: a cautious mask may flip on an element whose update rounds across 0, a step of lr r wd |p| < 1e-4
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    ours, theirs = _task(), _task()
    ours.model.to(dtype)
    theirs.model.to(dtype)
    theirs.model.load_state_dict(ours.model.state_dict())
    opt = cfg.build(list(ours.model.named_parameters()))
    named = dict(theirs.model.named_parameters())
    is_matrix = lambda n: any(n.endswith(m.lstrip("*")) for m in MATRICES)  # noqa: E731
    ref = NanochatMuonAdamW([p for n, p in named.items() if is_matrix(n)],
                            [p for n, p in named.items() if not is_matrix(n)],
                            lr=0.02, momentum=0.95, beta2=0.9, weight_decay=0.01, adamw_betas=(0.8, 0.95),
                            adamw_eps=1e-10, adamw_wd=0.0, adamw_lr=0.02)
    assert any(p.shape[0] > p.shape[1] for n, p in named.items() if is_matrix(n))  # tall ones: the shape factor
    g = torch.Generator().manual_seed(3)
    d = ours.model.embed.weight.shape[1]
    for k in range(8):
        tokens = torch.randint(0, 16, (4, 24), generator=g)
        for model, o in ((ours.model, opt), (theirs.model, ref)):
            for p in model.parameters():
                p.grad = None
            logits = model(tokens)
            # (times 1000: gradients far above nanochat's floor `+ 1e-6` on the Newton-Schulz input's norm)
            (1000 * torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())).backward()
            for n, p in model.named_parameters():
                if n.endswith("in_proj_bias"):  # the key bias: its gradient is 0 up to rounding (softmax is shift
                    p.grad[d:2 * d] = 0.0        # invariant), noise that Adam with eps 1e-10 turns into full steps
            o.step()
        for (n, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=f"step {k}: {n}")


# --- MuonEq, Muon+, ShapeScale -------------------------------------------------------------------------------
SHAPES = [(), (5,), (1, 6), (6, 1), (4, 7), (7, 4), (5, 5), (3, 2, 2), (4, 2, 3, 3), (0, 3)]


@pytest.mark.parametrize("name", ["MuonEq", "MuonPlus", "ShapeScale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_rescalings_match_their_spec(name, dtype):
    kws = {"MuonEq": [{}, {"eps": 1e-2}], "MuonPlus": [{}, {"eps": 10.0}],
           "ShapeScale": [{"adjust_lr": a} for a in ("original", "spectral_unclamped", "match_rms_adamw", "none")]}
    fn = {"MuonEq": mspec.muon_eq, "MuonPlus": mspec.muon_plus, "ShapeScale": mspec.shape_scale}[name]
    for kw in kws[name]:
        ps = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
        for i, p in enumerate(ps):
            p.grad = randn(p.shape, i, dtype)
        want = fn([p.grad for p in ps], **kw)
        mo.Modular(ps, getattr(mo, name)(**kw), mo.LR(1.0)).step()
        for p, w in zip(ps, want):
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            torch.testing.assert_close(-p.detach().to(torch.float64), w, rtol=tol, atol=tol, msg=f"{kw} {p.shape}")


def test_muon_eq_equalizes_the_rows_and_muon_plus_sets_the_norm():
    x = torch.tensor([[3.0, 0.0, 4.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    (eq,) = mspec.muon_eq([x])
    rms = math.sqrt((25 + 1) / 3)
    torch.testing.assert_close(eq.norm(dim=1), torch.tensor([rms, rms, 0.0], dtype=torch.float64))  # a zero row stays
    for shape in [(4, 7), (7, 4), (3, 2, 2)]:
        (plus,) = mspec.muon_plus([randn(shape, 1)])
        assert float(plus.norm()) == pytest.approx(math.sqrt(min(shape[0], math.prod(shape[1:]))), rel=1e-14)
    p = torch.nn.Parameter(torch.zeros(3, 3))
    p.grad = torch.zeros(3, 3)
    mo.Modular([p], mo.MuonEq(), mo.MuonPlus(), mo.LR(1.0)).step()
    assert torch.equal(p, torch.zeros(3, 3))  # zero in, zero out (no NaN)
    with pytest.raises(pydantic.ValidationError):
        mo.MuonEq(eps=0.0)
    with pytest.raises(pydantic.ValidationError):
        mo.MuonPlus(eps=math.nan)
    with pytest.raises(pydantic.ValidationError, match="spectral_unclamped"):
        mo.ShapeScale(adjust_lr="spectral")


def test_the_rescalings_keep_a_transposed_updates_layout():
    """A parameter stored transposed steps as its contiguous twin through torch's fused AdamW, which reads a
    gradient as laid out like its parameter: the results keep the update's strides."""
    for t in (mo.MuonEq(), mo.MuonPlus(), mo.ShapeScale()):
        p = torch.nn.Parameter(torch.zeros(5, 3).T)
        q = torch.nn.Parameter(torch.zeros(3, 5))
        g = randn((3, 5), 2, torch.float32)
        p.grad, q.grad = g.T.contiguous().T, g.clone()
        assert p.grad.stride() != q.grad.stride()
        mo.Modular([p], t, mo.AdamW(0.1, fused=True)).step()
        mo.Modular([q], t, mo.AdamW(0.1, fused=True)).step()
        assert torch.equal(p, q), t


# --- torch 2.14's spectral_unclamped -------------------------------------------------------------------------
def test_spectral_unclamped_is_sqrt_rows_over_cols():
    assert spec.adjust_ratio(16, 4, "spectral_unclamped") == 2.0
    assert spec.adjust_ratio(4, 16, "spectral_unclamped") == 0.5  # "original" clamps this one at 1
    assert spec.adjust_ratio(4, 16, "original") == 1.0
    from modopt.transforms.orthogonal import adjust_ratio

    for rows, cols in [(16, 4), (4, 16), (5, 5), (3, 7)]:
        assert adjust_ratio(rows, cols, "spectral_unclamped") == math.sqrt(rows / cols)


@pytest.mark.parametrize("t", ["Muon", "Orthogonalize", "AdaMuon"])
def test_spectral_unclamped_matches_spec(t):
    """Four float64 steps of each transform with `spectral_unclamped` against the spec (wide, tall, 4-d)."""
    shapes = [(4, 16), (16, 4), (6, 2, 2, 2), (5,)]
    ps, _ = twin_params(shapes, torch.float64)
    want = [p.detach().clone() for p in ps]
    if t == "Muon":
        opt = mo.Modular(ps, mo.Muon(0.02, adjust_lr_fn="spectral_unclamped", ns_dtype="float64"))
        ref = spec.Muon(adjust_lr_fn="spectral_unclamped")
    elif t == "AdaMuon":
        opt = mo.Modular(ps, mo.AdaMuon(0.02, adjust_lr_fn="spectral_unclamped", ns_dtype="float64"))
        ref = spec.AdaMuon(adjust_lr_fn="spectral_unclamped")
    else:
        opt = mo.Modular(ps, mo.Orthogonalize(adjust_lr="spectral_unclamped", ns_dtype="float64"), mo.LR(0.02))
        ref = None
    for k in range(4):
        seeded_grads(ps, k, 5, torch.float64)
        if ref is None:
            want = [w - 0.02 * o for w, o in zip(want, spec.orthogonalize([p.grad for p in ps],
                                                                          adjust_lr="spectral_unclamped"))]
        else:
            want = ref.step(want, [p.grad for p in ps], 0.02)
        opt.step()
        for p, w in zip(ps, want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-11, atol=1e-12, msg=f"{t} {k} {p.shape}")
    wide = ps[0].detach() - want[0]
    assert float(wide.abs().max()) < 1e-12


@pytest.mark.skipif(TorchVersion(torch.__version__) < "2.14",
                    reason=f"torch {torch.__version__}'s Muon has no adjust_lr_fn='spectral_unclamped' (torch 2.14 added "
                           "it); the float64 spec test above checks the formula")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_spectral_unclamped_equals_torch_muon_bit_for_bit(dtype):
    shapes = [(8, 4), (4, 8), (16, 16), (3, 33), (33, 3)]
    ours, ref = twin_params(shapes, dtype, 0)
    a = mo.Modular(ours, mo.Muon(0.02, weight_decay=0.05, adjust_lr_fn="spectral_unclamped"))
    b = torch.optim.Muon(ref, lr=0.02, weight_decay=0.05, adjust_lr_fn="spectral_unclamped")
    for k in range(6):
        seeded_grads(ours, k, 0, dtype)
        seeded_grads(ref, k, 0, dtype)
        a.step()
        b.step()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q), (k, p.shape)


# --- a schedule past its end; the Polar Express paper's digits -------------------------------------------------
def test_past_end_repeats_or_cycles():
    q = NS_PRESETS["quintic"][0]
    assert coefficient_steps("quintic", 8) == list(q) + [q[-1]] * 3
    assert coefficient_steps("quintic", 8, "cycle") == list(q) + list(q[:3])  # Emerging-Optimizers' quintic
    assert coefficient_steps("polar_express", 7, "repeat")[5:] == [NS_PRESETS["polar_express"][0][-1]] * 2
    assert spec.steps_of("quintic", 12, "cycle") == coefficient_steps("quintic", 12, "cycle")
    t = mo.Orthogonalize(ns_coefficients="quintic", ns_steps=8, ns_past_end="cycle")
    assert t.coefficient_steps() == coefficient_steps("quintic", 8, "cycle")
    assert mo.Orthogonalize().ns_past_end == "repeat"  # the default: the paper's and pytorch_optimizer's rule
    with pytest.raises(pydantic.ValidationError, match="repeat"):
        mo.Orthogonalize(ns_past_end="wrap")


def test_emerging_optimizers_quintic_cycles():
    """Emerging-Optimizers' `get_coefficient_iterator(steps, sets, mode)` (muon_utils.py at fd77292): "cycle" is
    `itertools.cycle`, "repeat_last" chains a repeat of the last set; `newton_schulz` uses "repeat_last" only for
    "polar_express", "cans" and "deepseekv4". The rule restated with itertools, against ours."""
    from itertools import chain, cycle, islice, repeat

    q = list(NS_PRESETS["quintic"][0])
    assert coefficient_steps("quintic", 8, "cycle") == list(islice(cycle(q), 8))
    assert coefficient_steps("quintic", 8, "repeat") == list(islice(chain(q, repeat(q[-1])), 8))
    s = torch.logspace(-3, 0, 2001, dtype=torch.float64)
    gap = (spec.scalar_map(s, "quintic", 8, "cycle") - spec.scalar_map(s, "quintic", 8, "repeat")).abs().max()
    assert float(gap) > 0.1  # the two readings of eight quintic steps are far apart


@pytest.mark.parametrize("past_end", ["repeat", "cycle"])
@pytest.mark.parametrize("preset", ["quintic", "polar_express", "polar_express_paper", "original"])
def test_past_end_matches_spec(preset, past_end):
    for t in (mo.Orthogonalize(ns_coefficients=preset, ns_steps=9, ns_past_end=past_end, ns_dtype="float64"),):
        p = torch.nn.Parameter(torch.zeros(6, 9, dtype=torch.float64))
        p.grad = randn((6, 9), 4)
        want = spec.orthogonalize([p.grad], ns_coefficients=preset, ns_steps=9, ns_past_end=past_end)[0]
        mo.Modular([p], t, mo.LR(1.0)).step()
        torch.testing.assert_close(-p.detach(), want, rtol=1e-10, atol=1e-12)


#: the Polar Express paper's Algorithm 1 (arXiv 2505.16932), its digits, before the 1.01 safety it applies
PAPER_ALGORITHM_1 = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
#: Emerging-Optimizers' "polar_express" (muon_utils.py at fd77292): the paper's, divided by 1.01 ** degree
EMERGING_POLAR_EXPRESS = [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                          (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                          (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)]


def test_polar_express_paper_holds_the_papers_digits():
    """The paper's own safety step, `(a / 1.01, b / 1.01**3, c / 1.01**5)` for all but the last, on its digits,
    is the preset to the last bit. Emerging-Optimizers writes the same polynomials with four decimals, some cut
    rather than rounded (8.20516 as 8.2051): up to 1.3e-4 apart, which moves five steps' output by 6e-4 on a
    16 x 32 Gaussian matrix (three to five steps: 3e-4 to 1.4e-3; by eight steps both have converged)."""
    want = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PAPER_ALGORITHM_1[:-1]] + [PAPER_ALGORITHM_1[-1]]
    assert [tuple(c) for c in NS_PRESETS["polar_express_paper"][0]] == want
    assert [tuple(c) for c in spec.PRESETS["polar_express_paper"][0]] == want
    gaps = [abs(x - y) for w, e in zip(want, EMERGING_POLAR_EXPRESS) for x, y in zip(w, e)]
    assert 5e-5 < max(gaps) < 1.5e-4
    assert any(round(x, 4) != y for w, e in zip(want, EMERGING_POLAR_EXPRESS) for x, y in zip(w, e))
    x = randn((16, 32), 0)
    ours = spec.newton_schulz(x, "polar_express_paper", 5, safety=1.0)
    theirs = spec.newton_schulz(x, EMERGING_POLAR_EXPRESS[:5], 5)
    assert 1e-4 < float((ours - theirs).abs().max()) < 2e-3  # (5.8e-4 in float64 here)


# --- optax's AOL and Schatten preconditioning -------------------------------------------------------------------
def _optax_ortho():
    pytest.importorskip("optax")
    import jax

    jax.config.update("jax_enable_x64", True)
    import inspect

    import jax.numpy as jnp
    from optax.contrib import _muon

    if "aol" not in inspect.getsource(_muon):
        pytest.skip("this optax has no preconditioning='aol'")
    return jnp, _muon.orthogonalize_via_newton_schulz


@pytest.mark.parametrize("how", ["aol", "schatten"])
@pytest.mark.parametrize("coefficients", ["original", "quintic"])
def test_preconditioning_matches_optax_in_float64(how, coefficients):
    """optax floors the first step's sums at 1e-8, which `eps=1e-4` makes modopt's floor (`eps**2`)."""
    import numpy as np

    jnp, ortho = _optax_ortho()
    steps = coefficient_steps(coefficients, 4)
    for seed, shape in enumerate([(8, 4), (4, 8), (16, 16), (1, 7), (5, 12)]):
        x = randn(shape, seed)
        theirs = torch.from_numpy(np.asarray(ortho(jnp.asarray(x.numpy()), jnp.asarray(steps, dtype=jnp.float64),
                                                   preconditioning=how)))
        t = mo.Orthogonalize(ns_coefficients=coefficients, ns_steps=4, ns_preconditioning=how, eps=1e-4,
                             ns_dtype="float64")
        torch.testing.assert_close(t.orthogonalized(x), theirs, rtol=0, atol=1e-12)
        want = spec.orthogonalize([x], ns_coefficients=coefficients, ns_steps=4, eps=1e-4, ns_preconditioning=how)[0]
        torch.testing.assert_close(want, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("how", ["aol", "schatten"])
def test_preconditioning_in_float32_is_within_rounding_of_optax(how):
    import numpy as np

    jnp, ortho = _optax_ortho()
    steps = coefficient_steps("original", 4)
    x = randn((24, 40), 3, torch.float32)
    theirs = torch.from_numpy(np.asarray(ortho(jnp.asarray(x.numpy()), jnp.asarray(steps, dtype=jnp.float32),
                                               preconditioning=how)))
    ours = mo.Orthogonalize(ns_steps=4, ns_preconditioning=how, eps=1e-4, ns_dtype="float32").orthogonalized(x)
    assert float((ours - theirs).abs().max()) < 1e-4


def test_aol_bounds_the_spectrum_and_lands_closer_than_frobenius():
    """The AOL-scaled input has every singular value at most 1 (row sums of |A| bound its spectral norm), and
    larger ones than the Frobenius division: four AOL steps land nearer the polar factor than four plain ones
    on Gaussian matrices (Turbo-Muon's point: one step saved)."""
    for seed, shape in enumerate([(64, 64), (64, 256), (128, 32)]):
        x = randn(shape, seed)
        w = x.T if shape[0] > shape[1] else x
        s_aol = torch.linalg.svdvals(spec.precondition(w, "aol"))
        s_fro = torch.linalg.svdvals(spec.precondition(w, "frobenius"))
        assert float(s_aol.max()) <= 1 + 1e-12 and float(s_aol.min()) > float(s_fro.min())
        ref = spec.polar(x)
        err = {how: float(torch.linalg.matrix_norm(spec.orthogonalize([x], "quintic", 4, ns_preconditioning=how)[0]
                                                   - ref)) for how in ("aol", "frobenius")}
        assert err["aol"] < err["frobenius"], (shape, err)


@pytest.mark.parametrize("how", ["aol", "schatten"])
def test_preconditioning_through_muon_matches_spec_and_round_trips(how, tmp_path):
    shapes = [(6, 4), (4, 6), (3, 2, 2)]
    ps, _ = twin_params(shapes, torch.float64)
    t = mo.Muon(0.02, ns_preconditioning=how, ns_steps=4, ns_dtype="float64")
    opt = mo.Modular(ps, t)
    ref = spec.Muon(ns_preconditioning=how, ns_steps=4)
    want = [p.detach().clone() for p in ps]
    for k in range(3):
        seeded_grads(ps, k, 7, torch.float64)
        want = ref.step(want, [p.grad for p in ps], 0.02)
        opt.step()
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-11, atol=1e-12)
    cfg = opt.config
    again = mo.PipelineConfig.from_dict(cfg.to_dict())
    assert again.transforms[0] == t and again.transforms[0].ns_preconditioning == how
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert mo.load_config(path).transforms[0] == t
    with pytest.raises(pydantic.ValidationError, match="aol"):
        mo.Muon(ns_preconditioning="spectral")


def test_the_new_fields_round_trip_through_a_config():
    ts = [mo.Orthogonalize(ns_coefficients="quintic", ns_steps=8, ns_past_end="cycle", ns_preconditioning="aol",
                           adjust_lr="spectral_unclamped"),
          mo.MuonEq(eps=1e-5), mo.MuonPlus(eps=1e-5), mo.ShapeScale(adjust_lr="spectral_unclamped"), mo.LR(0.1)]
    for chain in (ts, [mo.AdaMuon(adjust_lr_fn="spectral_unclamped", ns_past_end="cycle")]):
        cfg = mo.Modular([torch.nn.Parameter(torch.zeros(3, 3))], *chain).config
        again = mo.PipelineConfig.from_dict(cfg.to_dict())
        assert list(again.transforms) == list(cfg.transforms) == chain
