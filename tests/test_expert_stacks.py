"""Expert stacks (issue 56, build item 1): `batch_dims` on every transform that reads a parameter as a matrix.

An expert stack `(E, out, in)` with `batch_dims=1` is `E` matrices: each expert's update must equal, bit for
bit, the 2-D transform run on that expert alone (its own optimizer, its own state), with one batched
Newton-Schulz over the stack. The sizes here are at least 8 x 16: torch's CPU `bmm` computes a product of
fewer than 400 multiply-adds with its own loop, which rounds otherwise than `mm` (documented on the page).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import modopt as mo
from checks import assert_resumes_bit_for_bit
from modopt.spec import matrix_scale as spec_ms
from modopt.spec import orthogonal as spec

#: (E, out, in): out < in and out > in
SHAPES = [(3, 16, 24), (3, 24, 16)]
STEPS = 3


def _pipelines(bd, nsd: str) -> dict[str, list[mo.Transform]]:
    """Each transform that reads a matrix, in a pipeline that makes it decide the step."""
    return {
        "Orthogonalize": [mo.Orthogonalize(batch_dims=bd, adjust_lr="original", ns_dtype=nsd), mo.LR(0.1)],
        "Muon": [mo.Muon(0.02, adjust_lr_fn="original", batch_dims=bd, ns_dtype=nsd)],
        "NorMuon": [mo.Momentum(), mo.Orthogonalize(batch_dims=bd, ns_dtype=nsd),
                    mo.NorMuon(batch_dims=bd), mo.LR(0.1)],
        "NorMuon-larger": [mo.Momentum(), mo.Orthogonalize(batch_dims=bd, ns_dtype=nsd),
                           mo.NorMuon(batch_dims=bd, per="larger"), mo.LR(0.1)],
        "AdaMuon": [mo.AdaMuon(0.01, weight_decay=0.01, adjust_lr_fn="original", batch_dims=bd, ns_dtype=nsd)],
        "MuonEq": [mo.MuonEq(batch_dims=bd), mo.Orthogonalize(batch_dims=bd, ns_dtype=nsd), mo.LR(0.1)],
        "MuonPlus": [mo.Orthogonalize(batch_dims=bd, ns_dtype=nsd), mo.MuonPlus(batch_dims=bd), mo.LR(0.1)],
        "ShapeScale": [mo.LR(0.1), mo.ShapeScale(batch_dims=bd, adjust_lr="spectral_unclamped")],
    }


NAMES = list(_pipelines(None, "bfloat16"))


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    grads = [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(STEPS)]
    return p0, grads


def _stacked(name, p0, grads, bd, nsd):
    p = torch.nn.Parameter(p0.clone())
    opt = mo.Modular([p], *_pipelines(bd, nsd)[name])
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    return p.detach()


def _expert_loop(name, p0, grads, nsd):
    """The 2-D transform on each expert alone: one optimizer (and its state) per matrix."""
    flat = p0.reshape((-1,) + tuple(p0.shape[-2:]))
    out = []
    for e in range(flat.shape[0]):
        q = torch.nn.Parameter(flat[e].clone())
        opt = mo.Modular([q], *_pipelines(None, nsd)[name])
        for gr in grads:
            q.grad = gr.reshape(flat.shape)[e].clone()
            opt.step()
        out.append(q.detach())
    return torch.stack(out).reshape(p0.shape)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=["wide", "tall"])
@pytest.mark.parametrize("dtype,nsd", [(torch.float32, "bfloat16"), (torch.float32, "float32"),
                                       (torch.float64, "bfloat16"), (torch.float64, "float64")],
                         ids=["f32-nsbf16", "f32", "f64-nsbf16", "f64"])
def test_each_expert_equals_the_2d_transform_on_it_alone_bit_for_bit(name, shape, dtype, nsd):
    p0, grads = _data(shape, dtype)
    got = _stacked(name, p0, grads, 1, nsd)
    want = _expert_loop(name, p0, grads, nsd)
    for e in range(shape[0]):
        assert torch.equal(got[e], want[e]), (name, e, float((got[e] - want[e]).abs().max()))
    assert not torch.equal(got, p0)  # (it moved)


@pytest.mark.parametrize("name", ["Muon", "NorMuon", "AdaMuon", "MuonEq", "MuonPlus"])
def test_two_batch_dims_are_one_matrix_per_layer_and_expert(name):
    """`(L, E, out, in)` with `batch_dims=2`: `L * E` matrices."""
    p0, grads = _data((2, 2, 16, 24), torch.float32, seed=1)
    got = _stacked(name, p0, grads, 2, "float32")
    assert torch.equal(got, _expert_loop(name, p0, grads, "float32"))


@pytest.mark.parametrize("name", ["Orthogonalize", "Muon", "NorMuon", "AdaMuon", "MuonEq", "MuonPlus", "ShapeScale"])
def test_the_convolution_reading_is_another_update(name):
    """The old reading (`batch_dims` None or 0: one `E x (out * in)` matrix) is not the E-loop: the test above
    fails on it. `batch_dims=0` is that reading, bit for bit."""
    p0, grads = _data((3, 24, 16), torch.float32)
    flat = _stacked(name, p0, grads, 0, "float32")
    with pytest.warns(mo.LintWarning, match=r"\(3, 24, 16\) as 3 x 384"):
        assert torch.equal(flat, _stacked(name, p0, grads, None, "float32"))
    assert not torch.equal(flat, _expert_loop(name, p0, grads, "float32"))


def test_newton_schulz_is_one_batched_product_per_op():
    """One `baddbmm` per product for the whole stack (no Python loop over the experts), counted by the
    profiler's op names."""
    from torch.profiler import ProfilerActivity, profile

    from modopt.transforms.orthogonal import NS_COEFFICIENTS, newton_schulz

    x = torch.randn(8, 16, 24)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        newton_schulz(x, [NS_COEFFICIENTS] * 5, 1e-7, torch.float32)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::baddbmm") == 10  # two per step, five steps
    assert "aten::addmm" not in counts and "aten::mm" not in counts
    assert counts.get("aten::linalg_vector_norm") == 1


# --- the float64 spec -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=["wide", "tall"])
def test_float64_runtime_agrees_with_the_spec_per_expert(shape):
    p0, grads = _data(shape, torch.float64)
    tol = dict(rtol=1e-10, atol=1e-12)
    # Orthogonalize, with the shape factor of each expert
    (u,) = spec.orthogonalize([grads[0]], adjust_lr="original", batch_dims=1)
    got = _stacked("Orthogonalize", torch.zeros(shape, dtype=torch.float64), grads[:1], 1, "float64")
    torch.testing.assert_close(got, -0.1 * u, **tol)
    # Muon and AdaMuon: trajectories
    for name, ref in (("Muon", spec.Muon(adjust_lr_fn="original", batch_dims=1)),
                      ("AdaMuon", spec.AdaMuon(weight_decay=0.01, adjust_lr_fn="original", batch_dims=1))):
        p = torch.nn.Parameter(p0.clone())
        opt = mo.Modular([p], *_pipelines(1, "float64")[name])
        lr = opt.param_groups[0]["lr"]
        want = p0.clone()
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
            (want,) = ref.step([want], [gr], lr)
        torch.testing.assert_close(p.detach(), want, **tol)
    # NorMuon (both readings of its statistic) after an exact orthogonalization, one step at a time
    for per in ("row", "larger"):
        ref = spec.NorMuon(per=per, batch_dims=1)
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        opt = mo.Modular([p], mo.NorMuon(batch_dims=1, per=per), mo.LR(1.0))
        for gr in grads:
            before = p.detach().clone()
            p.grad = gr.clone()
            opt.step()
            (want,) = ref.step([gr])
            torch.testing.assert_close(before - p.detach(), want, **tol)
    # MuonEq, Muon+ and the shape factor
    for t, f in ((mo.MuonEq(batch_dims=1), spec_ms.muon_eq), (mo.MuonPlus(batch_dims=1), spec_ms.muon_plus),
                 (mo.ShapeScale(batch_dims=1, adjust_lr="spectral_unclamped"),
                  lambda us, batch_dims: spec_ms.shape_scale(us, "spectral_unclamped", batch_dims))):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        p.grad = grads[0].clone()
        mo.Modular([p], t, mo.LR(1.0)).step()
        torch.testing.assert_close(-p.detach(), f([grads[0]], batch_dims=1)[0], **tol)


def test_spec_reads_each_expert_as_its_own_matrix():
    """The spec's own definition: `matrices_of` slices the stack; the shape factor is each expert's."""
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    ms = spec.matrices_of(x, 1)
    assert [tuple(m.shape) for m in ms] == [(3, 20), (3, 20)] and torch.equal(ms[1], x[1].reshape(3, 20))
    assert torch.equal(spec.from_matrices(ms, x.shape), x)
    assert spec.matrices_of(torch.randn(4, 5), 1) is None  # E vectors: no matrix
    (o,) = spec.orthogonalize([torch.randn(2, 8, 2, dtype=torch.float64)], adjust_lr="original", batch_dims=1,
                              exact=True)
    assert torch.allclose(torch.linalg.matrix_norm(o[0], ord=2), torch.tensor(2.0, dtype=torch.float64))  # sqrt(8/2)


# --- state, checkpoints, config ---------------------------------------------------------------------------------
def _moe():
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(16, 16)
            self.experts = torch.nn.Module()
            self.experts.w1 = torch.nn.Parameter(torch.randn(4, 32, 16) * 0.1)
            self.experts.w2 = torch.nn.Parameter(torch.randn(4, 16, 32) * 0.1)

    return Block()


def _moe_pipeline(name="Muon"):
    inner = {"Muon": [mo.Muon(0.02, batch_dims=1, ns_dtype="float32")],
             "NorMuon": [mo.Momentum(), mo.Orthogonalize(batch_dims=1, ns_dtype="float32"), mo.NorMuon(batch_dims=1),
                         mo.ShapeScale(batch_dims=1), mo.SGD(0.02)],
             "AdaMuon": [mo.AdaMuon(0.02, batch_dims=1, ns_dtype="float32")]}[name]
    rest = {"Muon": mo.Muon(0.02, ns_dtype="float32"), "NorMuon": mo.SGD(0.02), "AdaMuon": mo.AdaMuon(0.02)}[name]
    return [mo.Masked(*inner, where="*experts.*"),
            mo.Masked(rest, where=mo.Select(min_ndim=2, exclude=["*experts.*"])),
            mo.Masked(mo.AdamW(0.02, betas=(0.9, 0.95)), where=mo.Select(max_ndim=1))]


def _grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("name", ["Muon", "NorMuon", "AdaMuon"])
def test_save_and_resume_mid_run_is_bit_for_bit(name):
    """Beyond the registry's resume (2-D matrices only): 3-D expert stacks orthogonalized per expert
    (`batch_dims=1`), with masks routing the other matrices and the vectors to their own optimizers."""
    def step(model, opt, k):
        _grads(model, k)
        opt.step()

    assert_resumes_bit_for_bit(
        _moe, lambda m: mo.Modular(m.named_parameters(), *_moe_pipeline(name), lr=0.02, weight_decay=0.0),
        step=step, steps=6, cut=3)


def test_normuon_keeps_one_second_moment_per_row_of_each_expert():
    model = _moe()
    opt = mo.Modular(model.named_parameters(), *_moe_pipeline("NorMuon"), lr=0.02, weight_decay=0.0)
    _grads(model, 0)
    opt.step()
    (v,) = [v for k, v in opt.state[model.experts.w1].items() if k.endswith("second_moment")]
    assert v.shape == (4, 32, 1)  # E experts x 32 rows
    (v,) = [v for k, v in opt.state[model.attn.weight].items() if k.endswith("second_moment")] or [None]
    assert v is None  # (the dense weights go to SGD here)
    per_col = mo.NorMuon(per="larger", batch_dims=1)
    assert per_col.segment_shape(model.experts.w2) == (4, 1, 32)  # wide experts (16 x 32): per column
    assert per_col.segment_shape(model.experts.w1) == (4, 32, 1)


def test_a_checkpoint_of_the_other_reading_is_refused_naming_the_shapes():
    """NorMuon's second moments of the convolution reading `(E, 1, 1)` do not load where each expert keeps
    its rows `(E, out, 1)`: the loader names the state and the shapes."""
    p = torch.nn.Parameter(torch.randn(4, 32, 16))
    old = mo.Modular([p], mo.Orthogonalize(batch_dims=0), mo.NorMuon(batch_dims=0), mo.LR(0.1))
    p.grad = torch.randn(4, 32, 16)
    old.step()
    new = mo.Modular([p], mo.Orthogonalize(batch_dims=1), mo.NorMuon(batch_dims=1), mo.LR(0.1))
    with pytest.raises(ValueError, match=r"second_moment.*\(4, 32, 1\)|\(4, 32, 1\).*second_moment"):
        new.load_state_dict(old.state_dict())


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_config_round_trip_keeps_batch_dims(fmt, tmp_path):
    cfg = mo.PipelineConfig(transforms=_moe_pipeline("NorMuon"), defaults={"lr": 0.02, "weight_decay": 0.0})
    path = cfg.save(tmp_path / f"moe.{fmt}")
    assert "batch_dims" in path.read_text()
    back = mo.load_config(path)
    assert back == cfg and back.to_dict() == cfg.to_dict()
    inner = back.transforms[0].transforms
    assert [t.batch_dims for t in inner if hasattr(t, "batch_dims")] == [1, 1, 1]
    a, b = _moe(), _moe()
    oa, ob = cfg.build(a.named_parameters()), mo.Modular.from_config(b.named_parameters(), path)
    for s in range(3):
        _grads(a, s), _grads(b, s)
        oa.step(), ob.step()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    d = mo.Muon(batch_dims=1).to_dict()
    assert d["batch_dims"] == 1 and mo.Transform.from_dict(d) == mo.Muon(batch_dims=1)
    with pytest.raises(ValueError, match="batch_dims"):
        mo.Muon(batch_dims=-1)


# --- the build-time warning -------------------------------------------------------------------------------------
def _lint(*pipeline, model=None):
    model = model or _moe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mo.Modular(model.named_parameters(), *pipeline, lr=0.02, weight_decay=0.0)
    return [str(w.message) for w in caught if issubclass(w.category, mo.LintWarning)], caught


def test_a_stack_given_no_choice_is_warned_about_at_build():
    msgs, caught = _lint(mo.Masked(mo.Muon(0.02), where=mo.Select(min_ndim=2)),
                         mo.Masked(mo.AdamW(0.02), where=mo.Select(max_ndim=1)))
    assert len(msgs) == 1, msgs
    (m,) = msgs
    assert "'experts.w1' (4, 32, 16) as 4 x 512" in m and "'experts.w2' (4, 16, 32) as 4 x 512" in m
    assert "attn" not in m  # (2-D: no choice to make)
    assert "batch_dims=1" in m and "mo.Masked(mo.Muon(batch_dims=1)" in m and "batch_dims=0" in m
    assert [w.filename for w in caught if issubclass(w.category, mo.LintWarning)] == [__file__]  # the user's line
    for t in (mo.Orthogonalize(), mo.NorMuon(), mo.AdaMuon(), mo.MuonEq(), mo.MuonPlus(), mo.ShapeScale()):
        msgs, _ = _lint(mo.Chain(t, mo.SGD(0.02)) if not isinstance(t, mo.AdaMuon) else t)
        assert len(msgs) == 1 and type(t).__name__ in msgs[0] and "experts.w1" in msgs[0], (t, msgs)


def test_lint_false_silences_it_and_errors_still_raise():
    """`Modular(..., lint=False)` builds silently, this warning included; a parameter check that refuses still
    refuses."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mo.Modular(_moe().named_parameters(), mo.Muon(0.02), lint=False)
    with pytest.raises(mo.LintWarning):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mo.Modular(_moe().named_parameters(), mo.Muon(0.02))
    with pytest.raises(ValueError, match="capturable=True"):
        mo.Modular(torch.nn.Linear(2, 2).parameters(), mo.Adam(capturable=True, fused=False), lint=False)


def test_masked_batch_dims_on_the_experts_silences_it():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mo.Modular(_moe().named_parameters(), *_moe_pipeline("Muon"), lr=0.02, weight_decay=0.0)
        mo.Modular(_moe().named_parameters(), *_moe_pipeline("NorMuon"), lr=0.02, weight_decay=0.0)
        mo.Modular(_moe().named_parameters(), mo.Muon(batch_dims=0))  # the convolution reading, chosen
    # a branch that does not choose still warns, about the stacks it selects only
    msgs, _ = _lint(mo.Masked(mo.Muon(0.02, batch_dims=1), where="experts.w1"),
                    mo.Masked(mo.Muon(0.02), where=mo.Select(min_ndim=2, exclude=["experts.w1"])),
                    mo.Masked(mo.AdamW(0.02), where=mo.Select(max_ndim=1)))
    assert len(msgs) == 1 and "experts.w2" in msgs[0] and "experts.w1" not in msgs[0], msgs


def test_batch_dims_that_leaves_no_matrix_is_warned_about():
    msgs, _ = _lint(mo.Muon(0.02, batch_dims=1))
    assert len(msgs) == 1 and "'attn.weight' (16, 16)" in msgs[0] and "experts" not in msgs[0], msgs
