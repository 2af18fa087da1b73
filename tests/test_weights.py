"""modopt/transforms/weights.py and the weight stage (modopt/core/plan.py): transforms that act on the
parameters after the optimizer wrote them. QK-Clip (`mo.QKClip`) and its statistics provider
(`mo.AttentionLogits`, modopt/attention.py): the per-head max logit, the clip against its float64 spec,
the skip, no sync, compile."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from checks import Syncs, assert_resumes_bit_for_bit, assert_step_changes_nothing, mse_backward, regression_batches, tanh_mlp
from modopt.attention import mha_max_logits
from modopt.cli.tasks import TinyTransformer
from modopt.spec.weights import attention_max_logits, qk_clip, qk_clip_factor, qk_clip_rewritten
from modopt.spec.weights import frobenius, project_norm


SIZES = (5, 7, 2)


_model = functools.partial(tanh_mlp, SIZES)  # (dtype=..., seed=...)
_batches = functools.partial(regression_batches, sizes=SIZES, rows=4)  # (n, dtype=..., seed=...)
_backward = mse_backward


@pytest.mark.parametrize("kw", [{}, {"radius": 2.0}, {"min_ndim": 1, "eps": 1e-3}, {"radius": 0.5, "min_ndim": 0}])
def test_project_norm_matches_spec(kw):
    """float64, SGD before it: every step the SGD write, then each chosen tensor back to its radius."""
    t = mo.ProjectNorm(**kw)
    model = _model(dtype=torch.float64)
    opt = mo.Modular(model.parameters(), mo.SGD(lr=0.3), t)
    radii = [t.radius if t.radius is not None else frobenius(p) for p in model.parameters()]
    for x, y in _batches(6, dtype=torch.float64):
        _backward(model, x, y)
        fast = [p.detach() - 0.3 * p.grad for p in model.parameters()]
        want = project_norm(fast, radii, t.eps, t.min_ndim)
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)
    for p, r in zip(model.parameters(), radii):
        if p.dim() >= t.min_ndim:
            assert abs(frobenius(p) - r) <= 1e-12 * r + (t.eps * 2)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), scale=st.sampled_from([0.0, 1e-30, 1.0, 1e20]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_project_norm_holds_the_norm_and_never_makes_nan(shape, scale, dtype):
    g = torch.Generator().manual_seed(len(shape))
    p = torch.nn.Parameter((torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype))
    r0 = frobenius(p)
    opt = mo.Modular([p], mo.LR(0.5), mo.ProjectNorm(min_ndim=0))
    p.grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    opt.step()
    assert torch.isfinite(p).all()
    after = frobenius(p)
    if after > 0 and r0 > 0:
        assert abs(after - r0) <= 1e-5 * r0
    elif r0 == 0:  # the norm was 0: the radius is 0, the moved tensor is projected to 0 or (norm 0) kept
        assert after == 0 or p.numel() == 0 or abs(after) < float("inf")


def test_a_step_the_update_stage_stops_runs_no_weight_stage():
    """Accumulate's first call stops the step: nothing moved, so nothing is projected (every bit kept)."""
    model = _model(dtype=torch.float32)
    opt = mo.Modular(model.parameters(), mo.Accumulate(2), mo.SGD(lr=0.1), mo.ProjectNorm(3.0))
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, *_batches(1, dtype=torch.float32)[0])
    opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    _backward(model, *_batches(1, dtype=torch.float32)[0])
    opt.step()  # the cycle's step: written, then projected
    assert abs(frobenius(model[0].weight) - 3.0) < 1e-5


def test_the_weight_stage_resumes_bit_for_bit():
    data = _batches(10, dtype=torch.float32)
    make = lambda m: mo.Modular(m.parameters(), mo.Adam(lr=1e-2), mo.ProjectNorm())  # noqa: E731
    assert_resumes_bit_for_bit(lambda: _model(dtype=torch.float32), make, data, cut=4)


def test_weight_transforms_end_the_pipeline_at_its_top_level():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="before an update transform"):
        mo.Modular([p], mo.ProjectNorm(), mo.SGD(lr=0.1))
    with pytest.raises(ValueError, match="inside another transform"):
        mo.Modular([p], mo.Chain(mo.SGD(lr=0.1), mo.ProjectNorm()))
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.ProjectNorm())
    opt = mo.Modular([p], mo.SGD(lr=0.1), mo.ProjectNorm(), mo.ProjectNorm(1.0))  # two in a row: in order
    assert [k for k, _ in opt.plan.weights] == ["1:ProjectNorm", "2:ProjectNorm"]


@pytest.mark.parametrize("kw", [{"radius": math.inf}, {"radius": math.nan}, {"radius": 0.0}, {"eps": math.inf},
                                {"eps": -1.0}, {"radius": True}, {"min_ndim": -1}])
def test_project_norm_refuses_fields_that_would_break_the_weights(kw):
    with pytest.raises(pydantic.ValidationError, match=f"ProjectNorm.{next(iter(kw))}"):
        mo.ProjectNorm(**kw)


def test_project_norm_config_round_trip():
    cfg = mo.PipelineConfig(transforms=[mo.AdamW(lr=3e-4), mo.ProjectNorm(min_ndim=2)])
    assert mo.PipelineConfig.from_dict(cfg.to_dict()) == cfg


def _mha(e=8, h=2, batch_first=True, bias=True, kdim=None, scale=1.0, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(e, h, batch_first=batch_first, bias=bias, kdim=kdim, vdim=kdim).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return m


def _x(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --- the provider: the logits are the ones MultiheadAttention softmaxes -----------------------------------
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_max_logits_are_the_logits_torch_softmaxes(batch_first, bias):
    """log(torch's per-head attention weights) = the spec's logits - their row logsumexp: the spec's
    logits are torch's (heads, scale, bias, layout); the hook's max equals the spec's max per head."""
    m = _mha(batch_first=batch_first, bias=bias, dtype=torch.float64, scale=1.5)
    x = _x(3, 5, 8, dtype=torch.float64)
    xin = x if batch_first else x.transpose(0, 1)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    _, w = m(xin, xin, xin, attn_mask=causal, need_weights=True, average_attn_weights=False)  # (B, H, L, L)
    wq, wk = m.in_proj_weight[:8], m.in_proj_weight[8:16]
    bq, bk = (m.in_proj_bias[:8], m.in_proj_bias[8:16]) if bias else (None, None)
    for h in range(2):
        d = 4
        q = x @ wq[h * d:(h + 1) * d].T + (0 if bq is None else bq[h * d:(h + 1) * d])
        k = x @ wk[h * d:(h + 1) * d].T + (0 if bk is None else bk[h * d:(h + 1) * d])
        s = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(causal, -math.inf)
        torch.testing.assert_close(w[:, h].log(), s - s.logsumexp(-1, keepdim=True), rtol=1e-9, atol=1e-9)
    want = attention_max_logits(x, x, wq, bq, wk, bk, 2, allowed=~causal)
    stats = mo.AttentionLogits.attach(m)
    with torch.enable_grad():
        float_mask = torch.zeros(5, 5, dtype=torch.float64).masked_fill(causal, -math.inf)  # -inf: masked
        m(xin, xin, xin, attn_mask=float_mask)
    torch.testing.assert_close(stats.max_logits()["attention"], torch.tensor(want, dtype=torch.float32))


def test_masks_padding_and_separate_key_projections_are_honoured():
    m = _mha(e=8, h=4, kdim=6, dtype=torch.float64)  # kdim != embed_dim: q_proj_weight / k_proj_weight
    q, k = _x(2, 3, 8, dtype=torch.float64), _x(2, 5, 6, seed=2, dtype=torch.float64)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    got = mha_max_logits(m, q, k, key_padding_mask=pad)
    allowed = (~pad)[:, None, :].expand(2, 3, 5)
    want = attention_max_logits(q, k, m.q_proj_weight, m.in_proj_bias[:8], m.k_proj_weight, m.in_proj_bias[8:16], 4,
                                allowed=allowed)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))  # (kept in float32)
    full = attention_max_logits(q, k, m.q_proj_weight, m.in_proj_bias[:8], m.k_proj_weight, m.in_proj_bias[8:16], 4)
    assert max(full) >= max(want) and full != want  # (the padding really left keys out)


def test_the_maximum_runs_over_the_micro_batches_and_only_training_forwards():
    m = _mha()
    stats = mo.AttentionLogits.attach(m)
    xs = [_x(2, 4, 8, seed=s) * (1 + s) for s in range(3)]
    for x in xs:
        m(x, x, x)
    with torch.no_grad():  # an evaluation forward is not recorded
        m(xs[2] * 100, xs[2] * 100, xs[2] * 100)
    want = torch.stack([mha_max_logits(m, x, x) for x in xs]).amax(0).detach()
    torch.testing.assert_close(stats.max_logits()["attention"], want)
    stats.reset()
    assert torch.isneginf(stats.max_logits()["attention"]).all()


# --- the clip against its spec --------------------------------------------------------------------------
def test_qk_clip_by_hand():
    """Two heads of one row each: S = (400, 50), tau = 100: eta = (1/4, 1); alpha = 1/2: query row 0 halves,
    key row 0 halves; alpha = 1: the query row takes all of it. S <= 0 or -inf (no forward): unchanged."""
    for alpha, q0, k0 in ((0.5, 1.0, 2.0), (1.0, 0.5, 4.0), (0.0, 2.0, 1.0)):
        wq = torch.nn.Parameter(torch.tensor([[2.0], [3.0]], dtype=torch.float64))
        wk = torch.nn.Parameter(torch.tensor([[4.0], [5.0]], dtype=torch.float64))
        stats = mo.AttentionLogits()
        stats.watch("attn", 2, query=wq, key=wk)
        opt = mo.Modular([wq, wk], mo.SGD(lr=0.0), mo.QKClip(alpha=alpha))
        stats.record("attn", torch.tensor([400.0, 50.0]))
        wq.grad, wk.grad = torch.zeros_like(wq), torch.zeros_like(wk)
        opt.step()
        assert wq.detach().flatten().tolist() == [q0, 3.0] and wk.detach().flatten().tolist() == [k0, 5.0]
        assert opt.stats["1:QKClip.max_logit"].tolist() == [400.0, 50.0] and int(opt.stats["1:QKClip.clipped"]) == 1
        for s in ([-3.0, 0.0], [-math.inf, 100.0], [math.nan, 1e-30], None):  # floored: no NaN, no negative
            if s is not None:  # (None: no forward recorded this step, the maxima are -inf)
                stats.record("attn", torch.tensor(s))
            opt.step()
            assert wq.detach().flatten().tolist() == [q0, 3.0] and wk.detach().flatten().tolist() == [k0, 5.0]
            assert int(opt.stats["1:QKClip.clipped"]) == 0
            stats.reset()


@pytest.mark.parametrize("kw", [{}, {"tau": 2.0}, {"tau": 0.7, "alpha": 0.25}, {"tau": 3.0, "alpha": 1.0, "eps": 1e-2}])
def test_qk_clip_matches_spec(kw):
    """float64, random heads: a user's attention (query and key weights and biases of 3 heads of 2 rows),
    random max logits each step (above, below, at tau, negative); SGD writes, then the clip, as the spec."""
    t = mo.QKClip(**kw)
    g = torch.Generator().manual_seed(0)
    wq, wk = (torch.nn.Parameter(torch.randn(6, 4, generator=g, dtype=torch.float64)) for _ in range(2))
    bq, bk = (torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64)) for _ in range(2))
    other = torch.nn.Parameter(torch.randn(6, 4, generator=g, dtype=torch.float64))  # in no attention: unchanged
    stats = mo.AttentionLogits()
    stats.watch("attn", 3, query=[wq, bq], key=[wk, bk])
    params = [wq, bq, other, wk, bk]
    opt = mo.Modular(params, mo.SGD(lr=0.1), t)
    for step in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        s = (torch.rand(3, generator=g, dtype=torch.float64) * 3 - 1) * t.tau * 2  # in (-2 tau, 4 tau)
        if step == 2:
            s[1] = t.tau
        stats.record("attn", s)
        fast = [p.detach() - 0.1 * p.grad for p in params]
        s32 = s.to(torch.float32).double().tolist()  # (the provider keeps float32)
        (q, b_q), (k, b_k) = qk_clip(fast[:2], fast[3:], s32, t.tau, t.alpha, t.eps)
        opt.step()
        for p, w in zip(params, [q, b_q, fast[2], k, b_k]):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)
        assert int(opt.stats["1:QKClip.clipped"]) == sum(qk_clip_factor(v, t.tau, t.eps) < 1 for v in s32)


def test_rows_of_one_fused_tensor_and_only_the_steps_parameters():
    """MultiheadAttention's in_proj_weight holds q, k, v: the value rows stay; with SGD(lr=0) the clipped
    weights give, on the same input, per-head max logits eta_h * S_h <= tau."""
    m = _mha(scale=4.0, dtype=torch.float64)
    mo.AttentionLogits.attach(m)
    opt = mo.Modular(m.parameters(), mo.SGD(lr=0.0), mo.QKClip(3.0))
    x = _x(2, 6, 8, dtype=torch.float64)
    m(x, x, x)[0].sum().backward()
    before = mha_max_logits(m, x, x).detach()
    v_rows = m.in_proj_weight[16:].detach().clone()
    opt.step()
    after = mha_max_logits(m, x, x).detach()
    assert (before > 3.0).any()
    torch.testing.assert_close(after, torch.minimum(before, torch.full_like(before, 3.0)), rtol=1e-6, atol=1e-9)
    assert torch.equal(m.in_proj_weight[16:], v_rows)


def test_a_tiny_transformer_keeps_its_logits_near_tau_and_without_the_clip_they_grow():
    """The built-in transformer task's model (nn.MultiheadAttention), Adam at lr=0.1: the max logit of a
    forward after each step grows past 8 tau without QK-Clip; with it, it stays under 2.5 tau and under tau
    whenever the step before was clipped hard enough. (QK-Clip is reactive: it scales by the logits of the
    forward before the write, so the write itself can add a little; Kimi K2's method is the same.)

    `logits="rewritten"`: on the inputs each attention layer saw in the step's forward, the clipped weights
    give every head a max logit <= tau (float32 rounding: 1e-5 relative); a forward after the step on the
    same batch feeds the upper layer other inputs (the embeddings and the layer below moved too), so there
    the bound is not exact, but it stays under 1.6 tau, below the reactive rule's at every step."""
    tau = 5.0

    def run(clip, logits="recorded"):
        torch.manual_seed(0)
        m = TinyTransformer(vocab=16, seq_len=12, d_model=32, nhead=4, layers=2, ff=64)
        stats = mo.AttentionLogits.attach(m, keep_inputs=logits == "rewritten")
        opt = mo.Modular(m.named_parameters(), mo.Adam(lr=0.1), *([mo.QKClip(tau, logits=logits)] if clip else []))
        g = torch.Generator().manual_seed(1)
        after, on_kept = [], []
        for _ in range(8):
            tok = torch.randint(0, 16, (8, 12), generator=g)
            loss = torch.nn.functional.cross_entropy(m(tok[:, :-1]).reshape(-1, 16), tok[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            kept = {n: list(layer.kept) for n, layer in stats.layers.items()}  # (the step consumes them)
            opt.step()
            assert stats.kept_inputs() == {n: 0 for n in stats.layers}
            mods = dict(m.named_modules())
            on_kept += [float(mha_max_logits(mods[n], *inp).detach().max()) for n, ins in kept.items() for inp in ins]
            stats.reset()
            m(tok[:, :-1])  # a forward after the step, on the same batch
            after.append(max(float(v.max()) for v in stats.max_logits().values()))
            stats.reset()
        return after, on_kept

    (without, _), (with_clip, _), (rewritten, on_kept) = run(False), run(True), run(True, "rewritten")
    assert without[-1] > 8 * tau
    assert max(with_clip) < 2.5 * tau and with_clip[-1] < without[-1] / 4
    assert len(on_kept) == 8 * 2 and max(on_kept) <= tau * (1 + 1e-5) and max(on_kept) > tau * (1 - 1e-5)
    assert max(rewritten) < 1.6 * tau and all(r < w for r, w in zip(rewritten, with_clip))


def test_rewritten_logits_stay_under_tau_in_the_next_forward_when_the_attention_inputs_do_not_move():
    """One layer, only its in_proj (query, key, value rows) stepped, Adam at lr=0.1: the next forward on the
    same batch sees the inputs the step kept, so with `logits="rewritten"` every head's max logit is <= tau
    (1e-5 relative: float32); the reactive default goes past 1.5 tau on the same run."""
    tau = 2.0

    def run(logits):
        torch.manual_seed(0)
        m = TinyTransformer(vocab=16, seq_len=12, d_model=32, nhead=4, layers=1, ff=64)
        stats = mo.AttentionLogits.attach(m, keep_inputs=logits == "rewritten")
        attn = m.encoder.layers[0].self_attn
        opt = mo.Modular([attn.in_proj_weight, attn.in_proj_bias], mo.Adam(lr=0.1), mo.QKClip(tau, logits=logits))
        g = torch.Generator().manual_seed(1)
        after = []
        for _ in range(8):
            tok = torch.randint(0, 16, (8, 12), generator=g)
            loss = torch.nn.functional.cross_entropy(m(tok[:, :-1]).reshape(-1, 16), tok[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats.reset()
            m(tok[:, :-1])
            after.append(float(stats.max_logits()["encoder.layers.0.self_attn"].max()))
            stats.reset()
        return after

    recorded, rewritten = run("recorded"), run("rewritten")
    assert max(rewritten) <= tau * (1 + 1e-5) and max(recorded) > 1.5 * tau


# --- logits="rewritten": each head's max logit measured at the written weights -------------------------------
@pytest.mark.parametrize("kw", [{"tau": 2.0}, {"tau": 0.7, "alpha": 0.25}, {"tau": 3.0, "alpha": 1.0, "eps": 1e-2}])
def test_qk_clip_rewritten_matches_spec(kw):
    """float64 nn.MultiheadAttention (sequence first, biases), SGD at lr=0.1, two forwards per step (a causal
    float mask, a key padding mask): S' is the spec's max over both forwards at the written weights and
    biases, the query and key rows (biases too) are the spec's clip by S', the value rows the plain write;
    the clipped weights give those inputs each head's max logit min(S', tau), or eta_min S' where the floor holds."""
    t = mo.QKClip(logits="rewritten", **kw)
    m = _mha(scale=2.0, batch_first=False, dtype=torch.float64)
    stats = mo.AttentionLogits.attach(m, keep_inputs=True)
    opt = mo.Modular(m.parameters(), mo.SGD(lr=0.1), t)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    float_causal = torch.zeros(5, 5, dtype=torch.float64).masked_fill(causal, -math.inf)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    clipped = 0
    for step in range(4):
        xs = [_x(2, 5, 8, seed=10 * step + j, dtype=torch.float64) * (1 + step) for j in range(2)]
        seq = [x.transpose(0, 1) for x in xs]
        opt.zero_grad()
        m(seq[0], seq[0], seq[0], attn_mask=float_causal)[0].pow(2).sum().backward()
        m(seq[1], seq[1], seq[1], key_padding_mask=pad)[0].pow(2).sum().backward()
        assert stats.kept_inputs() == {"attention": 2}
        w, b = (p.detach() - 0.1 * p.grad for p in (m.in_proj_weight, m.in_proj_bias))
        forwards = [(xs[0], xs[0], ~causal), (xs[1], xs[1], (~pad)[:, None, :])]
        s, (wq, bq, wk, bk) = qk_clip_rewritten(w[:8], b[:8], w[8:16], b[8:16], 2, forwards, t.tau, t.alpha, t.eps)
        opt.step()
        for got, want in ((m.in_proj_weight[:8], wq), (m.in_proj_bias[:8], bq), (m.in_proj_weight[8:16], wk),
                          (m.in_proj_bias[8:16], bk), (m.in_proj_weight[16:], w[16:]), (m.in_proj_bias[16:], b[16:])):
            torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(opt.stats["1:QKClip.max_logit"], torch.tensor(s, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-12)
        after = torch.maximum(mha_max_logits(m, seq[0], seq[0], float_causal, dtype=torch.float64),
                              mha_max_logits(m, seq[1], seq[1], None, pad, dtype=torch.float64)).detach()
        s = torch.tensor(s, dtype=torch.float64)  # (one head here is 1000 tau: the floor holds it to s * eta_min)
        torch.testing.assert_close(after, torch.maximum(s.clamp_max(t.tau), s * t.eta_min), rtol=1e-12, atol=1e-12)
        clipped += int(opt.stats["1:QKClip.clipped"])
        assert stats.kept_inputs() == {"attention": 0}
    assert clipped > 0


def _written_logits(m, lr, forwards):
    """Each head's max logit over `forwards` (kwargs of `mha_max_logits`) at the weights SGD(lr) will write
    (float64), the weights left as they are."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in m.parameters()]
        for p in m.parameters():
            p.sub_(lr * p.grad)
        s = torch.stack([mha_max_logits(m, dtype=torch.float64, **f) for f in forwards]).amax(0)
        for p, q in zip(m.parameters(), saved):
            p.copy_(q)
    return s


def test_rewritten_honours_separate_projections_3d_masks_and_batch_first():
    """kdim != embed_dim (q_proj_weight, k_proj_weight), a 3-D bool attention mask (one per batch and head),
    batch first, float32: S' is the max logit at the written weights of the positions the mask keeps, and the
    clipped weights give those inputs min(S', tau) (float32 rounding: 1e-5 relative)."""
    m = _mha(e=8, h=4, kdim=6, scale=3.0)
    mo.AttentionLogits.attach(m, keep_inputs=True)
    opt = mo.Modular(m.parameters(), mo.SGD(lr=0.05), mo.QKClip(1.5, logits="rewritten"))
    q, k = _x(2, 3, 8), _x(2, 5, 6, seed=2)
    mask = torch.rand(2 * 4, 3, 5, generator=torch.Generator().manual_seed(3)) < 0.4
    mask[:, :, 0] = False  # (every query keeps a key)
    f = {"query": q, "key": k, "attn_mask": mask}
    m(q, k, k, attn_mask=mask)[0].pow(2).sum().backward()
    want = _written_logits(m, 0.05, [f])
    unmasked = _written_logits(m, 0.05, [{"query": q, "key": k}])
    k_proj = m.k_proj_weight.detach() - 0.05 * m.k_proj_weight.grad
    opt.step()
    torch.testing.assert_close(opt.stats["1:QKClip.max_logit"], want.float(), rtol=1e-5, atol=1e-6)
    assert int(opt.stats["1:QKClip.clipped"]) > 0 and not torch.allclose(want, unmasked)  # (the mask matters)
    after = mha_max_logits(m, dtype=torch.float64, **f).detach()
    torch.testing.assert_close(after, want.clamp_max(1.5), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(m.k_proj_weight, k_proj)  # the key rows were scaled (the separate projection)


def test_rewritten_accumulate_clips_by_the_max_of_the_micro_batches_at_the_written_weights():
    """Accumulate(2): the first call stops (nothing moves, its inputs are kept); the cycle's step measures
    both micro-batches at the written weights and leaves each head's max over both at min(S', tau)."""
    m = _mha(scale=3.0)
    stats = mo.AttentionLogits.attach(m, keep_inputs=True)
    opt = mo.Modular(m.parameters(), mo.Accumulate(2), mo.SGD(lr=0.05), mo.QKClip(1.0, logits="rewritten"))
    xs = [_x(2, 4, 8, seed=1), _x(2, 4, 8, seed=2) * 2]
    w0 = m.in_proj_weight.detach().clone()
    m(xs[0], xs[0], xs[0])[0].sum().backward()
    first = [p.grad.clone() for p in m.parameters()]
    opt.step()
    assert torch.equal(m.in_proj_weight, w0) and stats.kept_inputs() == {"attention": 1}
    opt.zero_grad()
    m(xs[1], xs[1], xs[1])[0].sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    for p, g, g0 in zip(m.parameters(), grads, first):  # (the written weights: SGD on the mean gradient)
        p.grad = (g + g0) / 2
    want = _written_logits(m, 0.05, [{"query": x, "key": x} for x in xs])
    for p, g in zip(m.parameters(), grads):
        p.grad = g
    opt.step()
    torch.testing.assert_close(opt.stats["2:QKClip.max_logit"], want.float(), rtol=1e-5, atol=1e-6)
    after = torch.stack([mha_max_logits(m, x, x, dtype=torch.float64) for x in xs]).amax(0).detach()
    torch.testing.assert_close(after, want.clamp_max(1.0), rtol=1e-5, atol=1e-6)
    assert stats.kept_inputs() == {"attention": 0} and (want > 1.0).any()


# --- the step's rules -----------------------------------------------------------------------------------
def test_a_skipped_step_keeps_every_bit_and_drops_its_forwards_maxima_without_a_sync():
    m = _mha(scale=3.0)
    stats = mo.AttentionLogits.attach(m)
    opt = mo.Modular(m.parameters(), mo.Adam(lr=1e-2), mo.QKClip(1.0))
    x = _x(2, 4, 8)
    for _ in range(2):
        opt.zero_grad()
        m(x, x, x)[0].pow(2).sum().backward()
        with Syncs() as s:
            opt.step()
        assert s.n == 0 and int(opt.stats["1:QKClip.clipped"]) > 0
        assert torch.isneginf(stats.max_logits()["attention"]).all()  # consumed: reset for the next step
    opt.zero_grad()
    m(x, x, x)[0].pow(2).sum().backward()
    assert torch.isfinite(stats.max_logits()["attention"]).all()
    m.in_proj_weight.grad[0, 0] = math.nan
    syncs = Syncs()
    assert_step_changes_nothing(m, opt, syncs)
    assert syncs.n == 0 and bool(opt.stats["skipped"])
    assert torch.isneginf(stats.max_logits()["attention"]).all()  # the skipped call's forward is dropped


def _path(device_decides):
    """The device path of the non-finite skip (what a GPU runs), or the CPU's default (the host reads it)."""
    from modopt.core import runner

    return runner.device_path() if device_decides else contextlib.nullcontext()


@pytest.mark.parametrize("device_decides", [False, True])
def test_an_overflowed_forward_whose_step_is_skipped_never_reaches_a_later_clip(device_decides):
    """nn.MultiheadAttention, Adam, QKClip(100): a forward on inputs * 1e19 overflows (its gradients and its
    logits are not finite: the step is skipped), then a step on sane inputs. The skipped call's maxima are
    dropped, so the second step is, bit for bit, that of a run which never saw the overflowed forward (the
    recorded +inf used to give eta = 0 and zero the query and key rows of every head for good)."""

    def make():
        torch.manual_seed(0)
        a = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        mo.AttentionLogits.attach(a)
        return a, mo.Modular(a.parameters(), mo.Adam(lr=1e-3), mo.QKClip(tau=100.0))

    (a, opt), (b, ref) = make(), make()
    x = _x(2, 5, 8)
    big = x * 1e19
    a(big, big, big)[0].sum().backward()
    with _path(device_decides):
        opt.step()
    assert bool(opt.stats["skipped"])
    for m, o in ((a, opt), (b, ref)):
        o.zero_grad()
        m(x, x, x)[0].sum().backward()
        with _path(device_decides):
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert a.in_proj_weight[0:16].abs().amin(dim=1).gt(0).all()  # every query and key row alive
    assert int(opt.stats["1:QKClip.clipped"]) == 0 and not bool(opt.stats["skipped"])


def test_a_non_finite_logit_leaves_its_head_alone_and_a_huge_one_is_floored():
    """Two heads of one row each, tau = 100, alpha = 1/2. +inf and NaN are no measurement: the head is left
    alone (`nonfinite` counts it); a finite 1.5e38 would scale its head by 1e-36: the floor eta_min (1e-3)
    holds it (`floored`); eta_min = 1 clips nothing. Against the spec's factor."""
    for eta_min in (1e-3, 0.5, 1.0):
        wq = torch.nn.Parameter(torch.tensor([[2.0], [3.0]], dtype=torch.float64))
        wk = torch.nn.Parameter(torch.tensor([[4.0], [5.0]], dtype=torch.float64))
        stats = mo.AttentionLogits()
        stats.watch("attn", 2, query=wq, key=wk)
        opt = mo.Modular([wq, wk], mo.SGD(lr=0.0), mo.QKClip(100.0, eta_min=eta_min))
        wq.grad, wk.grad = torch.zeros_like(wq), torch.zeros_like(wk)
        for s in ([math.inf, 400.0], [1.5e38, math.nan], [math.inf, 1e6]):
            q0, k0 = wq.detach().clone(), wk.detach().clone()
            stats.record("attn", torch.tensor(s))
            opt.step()
            s32 = torch.tensor(s).double().tolist()
            eta = torch.tensor([qk_clip_factor(v, 100.0, 1e-6, eta_min) for v in s32], dtype=torch.float64)
            torch.testing.assert_close(wq.detach(), q0 * eta.sqrt().unsqueeze(1), rtol=1e-15, atol=0)
            torch.testing.assert_close(wk.detach(), k0 * eta.sqrt().unsqueeze(1), rtol=1e-15, atol=0)
            assert (wq.detach() != 0).all() and (wk.detach() != 0).all()
            assert int(opt.stats["1:QKClip.nonfinite"]) == 1
            floored = sum(math.isfinite(v) and 100.0 / v < eta_min for v in s32)
            assert int(opt.stats["1:QKClip.floored"]) == floored and (floored == 1 or s[0] == math.inf)
            assert int(opt.stats["1:QKClip.clipped"]) == int((eta < 1).sum())


@pytest.mark.parametrize("device_decides", [False, True])
def test_accumulate_drops_only_the_maxima_of_the_call_it_skipped(device_decides):
    """Accumulate(3), lr 0: the second micro-batch's step call is skipped (a NaN gradient): the cycle's clip
    is by the max of the first and third micro-batches only, though the second's logits were the largest."""
    m = _mha(scale=3.0)
    mo.AttentionLogits.attach(m)
    opt = mo.Modular(m.parameters(), mo.Accumulate(3), mo.SGD(lr=0.0), mo.QKClip(1.0))
    xs = [_x(2, 4, 8, seed=1), _x(2, 4, 8, seed=2) * 5, _x(2, 4, 8, seed=3) * 2]
    logits = [mha_max_logits(m, x, x).detach() for x in xs]
    for k, x in enumerate(xs):
        opt.zero_grad()
        m(x, x, x)[0].sum().backward()
        if k == 1:
            m.in_proj_weight.grad[0, 0] = math.nan
        with _path(device_decides):
            opt.step()
    want = torch.maximum(logits[0], logits[2])
    torch.testing.assert_close(opt.stats["2:QKClip.max_logit"], want)
    assert (logits[1] > want).all() and int(opt.stats["2:QKClip.clipped"]) > 0


def test_accumulate_clips_once_per_cycle_by_the_max_of_its_micro_batches():
    m = _mha(scale=3.0)
    mo.AttentionLogits.attach(m)
    opt = mo.Modular(m.parameters(), mo.Accumulate(2), mo.SGD(lr=0.0), mo.QKClip(1.0))
    xs = [_x(2, 4, 8, seed=1), _x(2, 4, 8, seed=2) * 2]
    w0 = m.in_proj_weight.detach().clone()
    m(xs[0], xs[0], xs[0])[0].sum().backward()
    opt.step()
    assert torch.equal(m.in_proj_weight, w0)  # stopped: nothing clipped, the maximum keeps running
    m(xs[1], xs[1], xs[1])[0].sum().backward()
    want = torch.maximum(mha_max_logits(m, xs[0], xs[0]), mha_max_logits(m, xs[1], xs[1])).detach()
    opt.step()
    torch.testing.assert_close(opt.stats["2:QKClip.max_logit"], want)


@pytest.mark.parametrize("logits", ["recorded", "rewritten"])
@pytest.mark.compile
def test_the_step_compiles_to_one_graph_equal_to_eager(logits, device_path):
    """`torch.compile(opt.step, fullgraph=True)` with QKClip (the forward hook runs outside the step), against
    the eager device path (a compiled step decides every skip on the device), a skipped step included.
    `logits="rewritten"` measures the kept inputs at the written weights inside the graph and consumes them."""
    torch._dynamo.reset()
    keep = logits == "rewritten"

    def make():
        m = _mha(scale=2.0)
        stats = mo.AttentionLogits.attach(m, keep_inputs=keep)
        return m, stats, mo.Modular(m.parameters(), mo.SGD(lr=1e-2, momentum=0.9), mo.QKClip(2.0, logits=logits))

    (a, _, eager), (b, stats, comp) = make(), make()
    step = torch.compile(comp.step, fullgraph=True)
    clipped = 0
    for k in range(4):
        x = _x(3, 5, 8, seed=k)
        for m in (a, b):
            m.zero_grad()
            m(x, x, x)[0].pow(2).sum().backward()
            if k == 2:
                m.in_proj_weight.grad[0, 0] = math.nan
        eager.step()
        step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(comp.stats["1:QKClip.max_logit"], eager.stats["1:QKClip.max_logit"])
        assert torch.equal(eager.stats["1:QKClip.clipped"], comp.stats["1:QKClip.clipped"])
        if keep:
            assert stats.kept_inputs() == {"attention": 0}
        clipped += int(comp.stats["1:QKClip.clipped"])
    assert clipped > 0 and int(comp.stats["skipped_steps"]) == 1


def test_without_a_watched_attention_it_warns_and_changes_nothing():
    p = torch.nn.Parameter(torch.ones(2, 2))
    opt = mo.Modular([p], mo.SGD(lr=0.5), mo.QKClip())
    p.grad = torch.ones(2, 2)
    with pytest.warns(UserWarning, match="AttentionLogits.attach"):
        opt.step()
    assert torch.equal(p.detach(), torch.full((2, 2), 0.5))


def test_a_detached_provider_stops_recording_and_the_clip_stops():
    m = _mha(scale=3.0)
    stats = mo.AttentionLogits.attach(m)
    stats.detach()
    x = _x(2, 4, 8)
    m(x, x, x)[0].sum().backward()
    assert stats.layers == {} and not m._forward_hooks
    w = m.in_proj_weight.detach().clone()
    opt = mo.Modular(m.parameters(), mo.SGD(lr=0.0), mo.QKClip(1e-3))
    with pytest.warns(UserWarning, match="does nothing"):
        opt.step()
    assert torch.equal(m.in_proj_weight, w)


@pytest.mark.parametrize("value", ["no", 1, math.nan])
def test_the_provider_refuses_a_keep_inputs_that_is_not_a_bool_before_hooking(value):
    m = _mha(scale=1.0)
    with pytest.raises(TypeError, match=r"keep_inputs=\.\.\.\): expected True or False"):
        mo.AttentionLogits(keep_inputs=value)
    with pytest.raises(TypeError, match=r"attach\(keep_inputs=\.\.\.\): expected True or False"):
        mo.AttentionLogits.attach(m, keep_inputs=value)
    assert not m._forward_hooks and not m._forward_pre_hooks  # nothing hooked


def test_the_provider_refuses_rows_that_do_not_split_into_heads():
    w = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="split into 4 heads"):
        mo.AttentionLogits().watch("a", 4, query=w, key=w)
    with pytest.raises(ValueError, match="no torch.nn.MultiheadAttention"):
        mo.AttentionLogits.attach(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kw", [{"tau": 0.0}, {"tau": math.inf}, {"alpha": 1.5}, {"alpha": -0.1}, {"eps": 0.0},
                                {"eps": math.nan}, {"eta_min": 0.0}, {"eta_min": 1.5}, {"eta_min": math.nan}])
def test_qk_clip_refuses_fields_that_would_break_the_weights(kw):
    with pytest.raises(pydantic.ValidationError, match=f"QKClip.{next(iter(kw))}"):
        mo.QKClip(**kw)


def test_qk_clip_config_round_trip_and_position():
    cfg = mo.PipelineConfig(transforms=[mo.Muon(lr=0.02), mo.QKClip(50.0, alpha=0.3)])
    assert mo.PipelineConfig.from_dict(cfg.to_dict()) == cfg and mo.QKClip(50.0).tau == 50.0
    cfg = mo.PipelineConfig(transforms=[mo.Muon(lr=0.02), mo.QKClip(50.0, logits="rewritten")])
    back = mo.PipelineConfig.from_dict(cfg.to_dict())
    assert back == cfg and back.transforms[1].logits == "rewritten" and "rewritten" in cfg.to_yaml()
    assert mo.QKClip().logits == "recorded"
    with pytest.raises(pydantic.ValidationError, match="QKClip.logits"):
        mo.QKClip(logits="after")
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="before an update transform"):
        mo.Modular([p], mo.QKClip(), mo.SGD(lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [k for k, _ in mo.Modular([p], mo.SGD(lr=0.1), mo.QKClip()).plan.weights] == ["1:QKClip"]


@pytest.mark.compile
def test_the_hook_records_the_same_maxima_inside_a_compiled_model():
    """`torch.compile(model, fullgraph=True)` traces the forward hook: the maxima are the eager ones."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    stats = mo.AttentionLogits.attach(layer)
    x = _x(2, 6, 16)
    torch.compile(layer, fullgraph=True)(x).sum().backward()
    want = mha_max_logits(layer.self_attn, x, x).detach()
    torch.testing.assert_close(stats.max_logits()["self_attn"], want)
    assert torch.isfinite(want).all()


def test_modopt_run_hooks_the_task_attention_for_the_example_config():
    """examples/configs/muon_qkclip.yaml as `modopt run` builds it: its pipeline holds QKClip, so the
    transformer task's nn.MultiheadAttention layers are watched (2 layers x 2 heads recorded)."""
    from pathlib import Path

    from modopt.cli.experiment import load_experiment
    from modopt.cli.run import start_run

    exp = load_experiment(Path(__file__).resolve().parents[1] / "examples" / "configs" / "muon_qkclip.yaml")
    torch.manual_seed(0)
    task, opt = start_run(exp)
    loss = task.loss_fn(task.model, task.get_batch(0, 8))
    loss.backward()
    opt.step()
    s = opt.stats["3:QKClip.max_logit"]
    assert s.shape == (4,) and torch.isfinite(s).all() and [k for k, _ in opt.plan.weights] == ["3:QKClip"]


def test_rewritten_skipped_step_keeps_every_bit_and_drops_its_forwards_without_a_sync():
    """A step skipped for a NaN gradient changes no bit of the parameters and leaves its own forward out of
    the next step's S': on the device path (what a GPU runs; inside `Syncs`: no sync) its kept inputs are
    marked by the device's decision and let go, on the host path (the CPU's default) dropped. The next step
    measures only its own forward, at its written weights: exact on both paths."""
    x1, x2 = _x(2, 4, 8, seed=1) * 3, _x(2, 4, 8, seed=2) * 0.5
    for device_decides in (True, False):
        m = _mha(scale=3.0)
        stats = mo.AttentionLogits.attach(m, keep_inputs=True)
        opt = mo.Modular(m.parameters(), mo.Adam(lr=1e-2), mo.QKClip(1.0, logits="rewritten"))
        m(x2, x2, x2)[0].pow(2).sum().backward()
        with Syncs() as s:
            opt.step()
        assert s.n == 0 and int(opt.stats["1:QKClip.clipped"]) > 0 and stats.kept_inputs() == {"attention": 0}
        opt.zero_grad()
        m(x1, x1, x1)[0].pow(2).sum().backward()
        m.in_proj_weight.grad[0, 0] = math.nan
        syncs = Syncs()
        if device_decides:
            assert_step_changes_nothing(m, opt, syncs)
            assert syncs.n == 0 and bool(opt.stats["skipped"])
        else:
            before = [p.detach().clone() for p in m.parameters()]
            opt.step()
            assert bool(opt.stats["skipped"]) and all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
        assert stats.kept_inputs() == {"attention": 0} and torch.isneginf(stats.layers["attention"].carry).all()
        assert torch.isneginf(stats.max_logits()["attention"]).all()
        opt.zero_grad()
        m(x2, x2, x2)[0].pow(2).sum().backward()
        with Syncs() as s:
            opt.step()
        assert s.n == 0
        s_ = opt.stats["1:QKClip.max_logit"]
        now = mha_max_logits(m, x2, x2).detach()
        torch.testing.assert_close(now, s_.clamp_max(1.0), rtol=1e-5, atol=1e-6)  # x2 alone, measured after
        assert (mha_max_logits(m, x1, x1) > 1.0).any()  # (x1 would have clipped harder)


def test_rewritten_on_a_users_attention_takes_its_logits_fn_and_refuses_without_one():
    """A user's attention: `watch(..., logits_fn=)` and `record(..., inputs=)` on a provider that keeps inputs;
    the clipped weights give the kept inputs each head's max logit min(S', tau). Without the provider keeping
    inputs, or without a logits_fn, the step refuses before it writes (the error names the layer and the
    field); a provider that keeps inputs refuses a record without them."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.qkv = torch.nn.Linear(8, 24)
            with torch.no_grad():
                self.qkv.weight.mul_(4.0)

        def max_logits(self, x):  # [heads] at the current weights
            q, k, _ = (t.view(*x.shape[:2], 2, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            return (q @ k.transpose(-1, -2) / 2.0).amax(dim=(0, 2, 3))

    def build(keep, fn):
        att = Attention()
        stats = mo.AttentionLogits(keep_inputs=keep)
        w, b = att.qkv.weight, att.qkv.bias
        stats.watch("mine", 2, query=[(w, 0, 8), (b, 0, 8)], key=[(w, 8, 16), (b, 8, 16)],
                    logits_fn=att.max_logits if fn else None)
        return att, stats, mo.Modular(att.parameters(), mo.SGD(lr=0.1), mo.QKClip(1.0, logits="rewritten"))

    x = _x(2, 5, 8)
    att, stats, opt = build(True, True)
    y = att.qkv(x)
    stats.record("mine", att.max_logits(x).detach(), inputs=(x,))
    y.pow(2).sum().backward()
    with torch.no_grad():
        att.qkv.weight.sub_(0.1 * att.qkv.weight.grad)
        att.qkv.bias.sub_(0.1 * att.qkv.bias.grad)
        want = att.max_logits(x)
        att.qkv.weight.add_(0.1 * att.qkv.weight.grad)
        att.qkv.bias.add_(0.1 * att.qkv.bias.grad)
    opt.step()
    torch.testing.assert_close(opt.stats["1:QKClip.max_logit"], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(att.max_logits(x).detach(), want.clamp_max(1.0), rtol=1e-5, atol=1e-6)
    assert (want > 1.0).any()
    with pytest.raises(TypeError, match="pass inputs="):
        stats.record("mine", want)
    for keep, fn, hint in ((False, True, "keep_inputs=True"), (True, False, "logits_fn")):
        att, stats, opt = build(keep, fn)
        stats.record("mine", torch.tensor([5.0, 5.0]), **({"inputs": (x,)} if keep and fn else {}))
        att.qkv(x).sum().backward()
        w = att.qkv.weight.detach().clone()
        with pytest.raises(ValueError, match=f"logits='rewritten'.*'mine'.*{hint}"):
            opt.step()
        assert torch.equal(att.qkv.weight, w)  # refused before the write
    m = _mha()
    mo.AttentionLogits.attach(m)  # (the hook's provider keeps no inputs)
    m(x, x, x)[0].sum().backward()
    with pytest.raises(ValueError, match=r"'attention'.*attach\(model, keep_inputs=True\)"):
        mo.Modular(m.parameters(), mo.SGD(lr=0.1), mo.QKClip(logits="rewritten")).step()


def test_a_logits_fn_that_fails_is_refused_before_the_write_with_nothing_changed():
    """logits="rewritten" with a user's logits_fn that raises, or returns a [heads, 1] or an integer tensor:
    the step raises (naming the layer) before the optimizer writes: parameters, Adam's state, the recorded
    maxima and the kept inputs as they were; with a working logits_fn the same step then goes ahead."""
    import io

    from checks import assert_same

    w = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)) * 3)
    good = lambda x: ((x @ w[:4].T).view(-1, 2, 2) * (x @ w[4:].T).view(-1, 2, 2)).sum(-1).amax(0)  # noqa: E731

    def boom(x):
        raise RuntimeError("boom")

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for fn, error, match in ((boom, ValueError, "raised RuntimeError: boom"),
                             (lambda x: good(x).unsqueeze(1), TypeError, r"shape \[2\], returned a tensor of dtype "
                              r"torch.float32 and shape \[2, 1\]"),
                             (lambda x: good(x).long(), TypeError, "dtype torch.int64")):
        stats = mo.AttentionLogits(keep_inputs=True)
        stats.watch("mine", 2, query=(w, 0, 4), key=(w, 4, 8), logits_fn=fn)
        opt = mo.Modular([w], mo.Adam(lr=0.1), mo.QKClip(1.0, logits="rewritten"))
        for _ in range(2):  # (the second step: Adam has state to keep)
            w.grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
            stats.record("mine", good(x).detach(), inputs=(x,))
            before = io.BytesIO()
            torch.save((w.detach().clone(), opt.state_dict(), stats.max_logits()), before)
            with pytest.raises(error, match=f"logits_fn of the attention layer 'mine'.*{match}.*nothing was changed"):
                opt.step()
            before.seek(0)
            assert_same(torch.load(before, weights_only=True), (w.detach(), opt.state_dict(), stats.max_logits()))
            assert stats.kept_inputs() == {"mine": 1} and stats.layers["mine"].kept[0][0] is not None
            stats.layers["mine"].logits_fn = good  # (the layer's function, mended)
            opt.step()
            assert stats.kept_inputs() == {"mine": 0} and torch.isfinite(opt.stats["1:QKClip.max_logit"]).all()
            stats.layers["mine"].logits_fn = fn
        stats.detach()


def test_a_non_contiguous_watched_parameter_is_clipped_as_a_contiguous_one():
    """Query and key weights stored transposed (non-contiguous, e.g. tied to another layer's weight.T): the
    clip scales each head's rows through a view, bit for bit as for contiguous copies of them."""
    g = torch.Generator().manual_seed(0)
    raw = [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    runs = []
    for contiguous in (False, True):
        wq, wk = (torch.nn.Parameter(r.t().contiguous() if contiguous else r.clone().t()) for r in raw[:2])
        assert wq.is_contiguous() == contiguous
        stats = mo.AttentionLogits()
        stats.watch("attn", 2, query=wq, key=wk)
        opt = mo.Modular([wq, wk], mo.SGD(lr=0.1), mo.QKClip(1.0, alpha=0.3))
        wq.grad, wk.grad = raw[2].t().clone(), raw[2].t().clone()
        stats.record("attn", torch.tensor([5.0, 0.5]))
        opt.step()
        assert int(opt.stats["1:QKClip.clipped"]) == 1
        runs.append((wq.detach().clone(), wk.detach().clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_provider_that_keeps_inputs_lets_them_go_in_the_default_mode_and_on_reset():
    m = _mha(scale=3.0)
    stats = mo.AttentionLogits.attach(m, keep_inputs=True)
    x = _x(2, 4, 8)
    opt = mo.Modular(m.parameters(), mo.SGD(lr=0.0), mo.QKClip(1.0))
    m(x, x, x)[0].sum().backward()
    m(x, x, x)
    assert stats.kept_inputs() == {"attention": 2} and stats.layers["attention"].kept[0][0] is not x  # (detached)
    opt.step()
    assert stats.kept_inputs() == {"attention": 0}
    m(x, x, x)
    stats.reset()
    assert stats.kept_inputs() == {"attention": 0}
    with pytest.raises(ValueError, match="keep_inputs differs"):
        mo.AttentionLogits.attach(m, stats, keep_inputs=False)
