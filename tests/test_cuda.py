"""modopt on a CUDA device: what the CPU suite cannot show. Skipped where torch sees no GPU.

Users train on GPUs, where the default step must stay on the device and torch's CUDA kernels are
other code than the CPU's. These tests run on a machine with a GPU (docs/performance.md says when and
on which torch they last ran):

* every example transform of the conformance suite (tests/examples.py), in float64 on CUDA, against
  the same pipeline in float64 on the CPU (which the rest of the suite checks against the spec and
  the references);
* every optimizer case in every dtype against torch's for-loop reference on CUDA
  (tests/test_optimizer_dtypes.py's `compare`, where modopt picks CUDA's fused kernels);
* the default step of the headline pipelines under `torch.cuda.set_sync_debug_mode("error")`, which
  raises on any synchronizing CUDA call (also the ones a dispatch mode does not see, such as a
  device-to-host copy), after a real backward; a non-finite step skipped on the device changes no bit;
* `Muon` against `torch.optim.Muon` bit for bit on CUDA (float32, bfloat16);
* `torch.compile(opt.step, fullgraph=True)` on CUDA (inductor's GPU code) against eager;
* a CUDA checkpoint loaded with `weights_only=True` resumes bit for bit; `GradScaler` with float16
  autocast against torch's Adam under the same scaler.

`scripts/gpu-check` runs this file with the CUDA benchmarks. `MODOPT_TEST_DEVICE=cpu` runs the same
checks with CPU tensors, which is how they were checked on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

import modopt as mo
from checks import Syncs, assert_same
from examples import all_examples, pipeline_for
from modopt.core.transform import walk

#: the device under test: CUDA; `MODOPT_TEST_DEVICE=cpu` runs the same checks with CPU tensors (a check of
#: the tests themselves on a machine without a GPU; the rest of the suite covers the CPU)
CUDA = os.environ.get("MODOPT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def no_sync_allowed():
    """`torch.cuda.set_sync_debug_mode("error")` inside: any synchronizing CUDA call raises."""
    if CUDA != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.l1 = torch.nn.Linear(16, 24)
        self.l2 = torch.nn.Linear(24, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.l2(torch.tanh(self.l1(self.emb(x)))))


def net(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return _Net().to(device, dtype)


def batches(n, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, (6, 5), generator=g).to(device), torch.randn(6, 5, 8, generator=g).to(device))
            for _ in range(n)]


def loss_fn(model, x, y):
    return (model(x).float() - y.float()).pow(2).mean() * 10.0


def by_ndim(model):
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.dim() != 2]}, {"params": [p for p in ps if p.dim() == 2]}]


HEADLINE = {  # the pipelines the README and the benchmark lead with, every field at its default
    "mission": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-3)],
    "ClipNorm+Adam": lambda: [mo.ClipNorm(1.0), mo.Adam()],
    "ZClip+AdamW": lambda: [mo.ZClip(), mo.AdamW()],
    "ClipValue+SGD": lambda: [mo.ClipValue(0.5), mo.SGD(lr=1e-2, momentum=0.9)],
    "Centralize+Normalize+Adam": lambda: [mo.Centralize(), mo.Normalize(), mo.Adam()],
    "AutoClip+Adam": lambda: [mo.AutoClip(), mo.Adam()],
    "AGC+SGD": lambda: [mo.AGC(), mo.SGD(lr=1e-2)],
    "SPAM": lambda: [mo.SPAM(), mo.Adam()],
    "Muon+AdamW": lambda: [mo.Masked(mo.AdamW(), where=mo.Select(groups=[0])),
                           mo.Masked(mo.Muon(), where=mo.Select(groups=[1]))],
}


def _build(name, model):
    ps = by_ndim(model) if name == "Muon+AdamW" else model.parameters()
    return mo.Modular(ps, *HEADLINE[name]())


# --- every transform: CUDA float64 against the CPU float64 run ------------------------------------------------


EXAMPLES = all_examples()


@pytest.mark.parametrize("name,t", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_every_example_on_cuda_equals_the_cpu_run_in_float64(name, t):
    """Eight steps of the conformance example's pipeline on the same float64 model, on the CPU and on
    CUDA: the parameters and every state tensor agree to float64 rounding (the two devices reduce in
    different orders, so not bit for bit)."""
    from test_conformance import groups, loss_of, make_model

    runs = []
    for device in ("cpu", CUDA):
        model = make_model(torch.float64).to(device)
        opt = mo.Modular(groups(model), *pipeline_for(t.model_copy(deep=True)))
        g = torch.Generator().manual_seed(3)
        for _ in range(8):
            x = torch.randn(6, 4, generator=g, dtype=torch.float64).to(device)
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
        runs.append(([p.detach().cpu() for p in model.parameters()], _tensors(opt.state_dict())))
    (p_cpu, s_cpu), (p_gpu, s_gpu) = runs
    tol = _tolerance(t)
    for a, b in zip(p_cpu, p_gpu):
        torch.testing.assert_close(b, a, **tol)
    assert s_cpu.keys() == s_gpu.keys()
    for k in s_cpu:
        a, b = s_cpu[k], s_gpu[k]
        assert a.dtype == b.dtype, k
        if a.is_floating_point():
            torch.testing.assert_close(b, a, equal_nan=True, msg=k, **tol)
        else:
            assert torch.equal(a, b), k


def _tolerance(t: mo.Transform) -> dict:
    """float64 rounding; float32's where the example orthogonalizes in float32 (`ns_dtype`): CUDA's and the
    CPU's matrix products round differently, and eight steps carry it on."""
    low = [x.ns_dtype for _, x in walk([t]) if getattr(x, "ns_dtype", "float64") != "float64"]
    if not low:
        return dict(rtol=1e-9, atol=1e-12)
    assert set(low) == {"float32"}, low  # (bfloat16 examples belong in tests/test_orthogonal.py)
    return dict(rtol=1e-5, atol=1e-7)


def _tensors(tree, path=""):
    out = {}
    if isinstance(tree, torch.Tensor):
        out[path] = tree.detach().cpu()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{path}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{path}/{i}"))
    return out


# --- optimizers: every case and dtype against torch's reference on CUDA -------------------------------------


def _optimizer_cases():
    from test_optimizer_dtypes import CASES, DTYPES

    return [(c, d, clip) for c in CASES for d in DTYPES for clip in (False, True)]


@pytest.mark.parametrize("case,dtype,clip", _optimizer_cases(),
                         ids=[f"{c[0]}-{str(d)[6:]}-{'clip' if k else 'alone'}" for c, d, k in _optimizer_cases()])
def test_optimizer_matches_torch_reference_on_cuda(case, dtype, clip):
    from test_optimizer_dtypes import compare

    compare(case, dtype, clip, device=CUDA)


# --- the default step stays on the device ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HEADLINE))
def test_default_step_never_synchronizes_and_skips_a_nan_step_on_the_device(name):
    """Eight default steps after a real backward under `set_sync_debug_mode("error")` (any synchronizing
    CUDA call raises) and a dispatch-mode count of `.item()`-like ops (0); then a step whose gradient holds
    a NaN changes no bit of the parameters or the optimizer state, still without a sync."""
    model = net(CUDA)
    opt = _build(name, model)
    data = batches(9, CUDA)
    syncs = Syncs()
    for x, y in data[:8]:
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        with no_sync_allowed(), syncs:
            opt.step()
            _ = dict(opt.stats)  # telemetry stays on the device too
    assert syncs.n == 0
    x, y = data[8]
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    before = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), before)
    with no_sync_allowed(), syncs:
        opt.step()
    assert syncs.n == 0
    before.seek(0)
    m_sd, o_sd = torch.load(before, weights_only=True)
    assert_same(m_sd, model.state_dict())
    assert_same(o_sd["state"], opt.state_dict()["state"])
    old, new = _tensors(o_sd["modopt"]["transforms"]), _tensors(opt.state_dict()["modopt"]["transforms"])
    assert old.keys() == new.keys()
    for k in old:
        a, b = old[k], new[k]
        if k.endswith("AutoClip/history") and b.numel() == a.numel() + 1:
            # without a window AutoClip's buffer gains one unused slot (+inf) per call, a skipped one too
            # (its docstring): the norms it holds are what must not change
            assert torch.isinf(b[-1]) and b[-1] > 0, k
            b = b[:-1]
        assert_same(a, b, k)


# --- Muon against torch.optim.Muon on CUDA -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [{}, {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"}], ids=["defaults", "match_rms"])
def test_muon_equals_torch_muon_bit_for_bit_on_cuda(dtype, kw):
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32, 64), (128, 128), (3, 33), (256, 1024)]
    init = [torch.randn(s, generator=g).to(CUDA, dtype) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    a, b = mo.Modular(ours, mo.Muon(**kw)), torch.optim.Muon(ref, **kw)
    for k in range(10):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g).to(CUDA, dtype)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q), p.shape


# --- torch.compile on CUDA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ClipNorm+Adam", "mission"])
@pytest.mark.compile
def test_fullgraph_compiled_default_step_on_cuda_matches_eager(name):
    torch._dynamo.reset()
    eager_model, compiled_model = net(CUDA), net(CUDA)
    eager, compiled = _build(name, eager_model), _build(name, compiled_model)
    step = torch.compile(compiled.step, fullgraph=True)
    counters = torch._dynamo.utils.counters
    counters.clear()
    for x, y in batches(6, CUDA):
        for model, opt, do in ((eager_model, eager, eager.step), (compiled_model, compiled, step)):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            do()
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 2


# --- checkpoints and AMP -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mission", "ZClip+AdamW", "Muon+AdamW"])
def test_cuda_checkpoint_resumes_bit_for_bit(name):
    data = batches(10, CUDA)
    straight_model = net(CUDA)
    straight = _build(name, straight_model)
    for x, y in data:
        straight.zero_grad()
        loss_fn(straight_model, x, y).backward()
        straight.step()
    model = net(CUDA)
    opt = _build(name, model)
    for x, y in data[:5]:
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2 = net(CUDA, seed=5)
    model2.load_state_dict(ck["model"])
    opt2 = _build(name, model2)
    opt2.load_state_dict(ck["opt"])
    for x, y in data[5:]:
        opt2.zero_grad()
        loss_fn(model2, x, y).backward()
        opt2.step()
    for p, q in zip(straight_model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_grad_scaler_with_float16_autocast_matches_torch_adam():
    """`GradScaler` + `autocast(float16)`: `Modular(Adam())` against `torch.optim.Adam(fused=True)` under
    the same scaler, an overflowing step included (both skip it and halve the scale)."""
    models = [net(CUDA), net(CUDA)]
    opts = [mo.Modular(models[0].parameters(), mo.Adam(lr=1e-2)),
            torch.optim.Adam(models[1].parameters(), lr=1e-2, fused=True)]
    scalers = [torch.amp.GradScaler(CUDA, init_scale=2.0**14) for _ in models]
    for k, (x, y) in enumerate(batches(12, CUDA)):
        for model, opt, scaler in zip(models, opts, scalers):
            opt.zero_grad()
            with torch.autocast(CUDA, dtype=torch.float16):
                loss = loss_fn(model, x, y) * (1e6 if k == 4 else 1.0)  # step 4 overflows in float16
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0**14
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
