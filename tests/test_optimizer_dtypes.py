"""Every optimizer transform, in every float dtype, against torch's reference optimizers.

Run the way users run it: `Modular.step()` after a real forward and backward, two
param groups that differ in lr and weight decay, alone or after `ClipNorm(1.0)`
(whose scale is multiplied into the gradients first, as torch's clip_grad_norm_ does), for many steps.

The references, and why they are trusted:

* SGD (plain, momentum, nesterov, dampening, weight decay) and `LR`:
  `torch.optim.SGD(foreach=False)`, torch's for-loop, in the parameter's own
  dtype. Its arithmetic is a few elementwise ops per tensor, right in every
  dtype. (Not `fused=True`: the CPU `_fused_sgd_` of torch 2.4.0 to 2.13.x moves
  only the first 8 elements of a float16/bfloat16 tensor; `kernels.KERNEL_BUGS`.)
* Adam/AdamW in float32/float64: `torch.optim.Adam/AdamW(foreach=False)`.
* Adam/AdamW in float16/bfloat16: torch's for-loop Adam computes in the
  parameter's dtype, where `eps=1e-8` rounds to 0 in float16 and `(1-beta2) g^2`
  underflows, so `m / (sqrt(v) + eps)` is 0/0 for small gradients: it is not a
  reference. torch's own mixed-precision contract (the fused kernels, AMP) is
  half *storage* with float32 *arithmetic*; the reference here is exactly that,
  written independently of any fused kernel: every step, float32 copies of the
  parameter, gradient and moments go through torch's for-loop `adam` function
  and are rounded back to the parameter's dtype.

Compared: each parameter's displacement from its start, to a few units of the
dtype's rounding (the two sides round at different points, and the rounding
feeds back through the forward pass); and no element that the reference moved
is left where it started.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.adam import adam as torch_adam_fn

import modopt as mo
from checks import Ops
from modopt.core import kernels

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
STEPS = 25
GROUP_LR = (1.0, 0.5)  # group i's lr is the case's lr times this
WDS = (0.0, 0.05)


# (name, family, hyperparameters shared by modopt and torch, modopt factory)
CASES = [
    ("sgd", "sgd", dict(lr=0.3), mo.SGD),
    ("sgd_momentum", "sgd", dict(lr=0.08, momentum=0.9), mo.SGD),
    ("sgd_nesterov", "sgd", dict(lr=0.08, momentum=0.9, nesterov=True), mo.SGD),
    ("sgd_dampening", "sgd", dict(lr=0.1, momentum=0.9, dampening=0.3), mo.SGD),
    ("sgd_weight_decay", "sgd", dict(lr=0.2, momentum=0.5, weight_decay=0.01), mo.SGD),
    ("adam", "adam", dict(lr=1e-2), mo.Adam),
    ("adam_amsgrad", "adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.01), mo.Adam),
    ("adamw", "adamw", dict(lr=1e-2, weight_decay=0.1), mo.AdamW),
    ("adamw_amsgrad", "adamw", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.99)), mo.AdamW),
    ("lr", "lr", dict(lr=0.3), mo.LR),
]


def make_model(dtype, device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 12), torch.nn.Tanh(),
                                torch.nn.Linear(12, 3))
    return model.to(device, dtype)


def data(dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g).to(device, dtype), torch.randn(16, 3, generator=g).to(device, dtype))
            for _ in range(STEPS)]


def groups(model, family, lr):
    ps = list(model.parameters())
    out = [{"params": ps[:2], "lr": lr * GROUP_LR[0]}, {"params": ps[2:], "lr": lr * GROUP_LR[1]}]
    if family != "lr":  # per-group weight decay where the transform has it
        for g, wd in zip(out, WDS):
            g["weight_decay"] = wd
    return out


def backward(model, x, y):
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y.float()).mul(4.0).backward()  # norms around 1..5: clips bite


def clip_reference(params, max_norm=1.0, eps=1e-6):
    """torch.nn.utils.clip_grad_norm_, in at least float32 arithmetic (half-precision gradients
    would round the norm): the clipped gradients, in float32 (float64 for float64 parameters)."""
    g32 = [p.grad.to(torch.promote_types(p.dtype, torch.float32)) for p in params]
    # per-tensor norms by torch's foreach kernel, as clip_grad_norm_(foreach=True) takes them: on CUDA it
    # sums in another order than linalg.vector_norm, and one unit of float32 rounding in the coefficient
    # moves a half-precision gradient near zero by a unit, which Adam's g / sqrt(v) turns into a whole step
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g32, 2.0)))
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    # torch's CUDA kernels multiply a float16/bfloat16 tensor by a 0-d float32 tensor on the device
    # after rounding it to the tensor's dtype (the foreach kernel's fast route reads the scalar as the
    # list's dtype; its slow route and `mul_` cast it to the common dtype); the CPU kernels read the
    # float32 value. modopt's clip multiplies with those kernels, as clip_grad_norm_ does.
    return [g * (coef.to(p.dtype).to(g.dtype) if p.device.type != "cpu" else coef) for g, p in zip(g32, params)]


class TorchReference:
    """The reference optimizer for one (case, dtype), stepping ``model``'s parameters."""

    def __init__(self, model, family, hyper, dtype, clip):
        self.family, self.dtype, self.clip = family, dtype, clip
        self.groups = groups(model, family, hyper["lr"])
        hyper = dict(hyper)
        self.upcast = family in ("adam", "adamw") and dtype in (torch.float16, torch.bfloat16)
        if family in ("sgd", "lr"):
            self.opt = torch.optim.SGD(self.groups, **hyper, foreach=False)
        elif not self.upcast:
            cls = torch.optim.AdamW if family == "adamw" else torch.optim.Adam
            self.opt = cls(self.groups, **hyper, foreach=False)
        else:
            self.hyper = {"betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, **hyper}
            self.state = {}

    def step(self):
        params = [p for g in self.groups for p in g["params"]]
        if self.clip:
            clipped = clip_reference(params)
            for p, g in zip(params, clipped):
                p.grad.copy_(g)  # rounded to the parameter's dtype, as torch's clip_grad_norm_ leaves it
            clipped = [p.grad.float() for p in params]
        else:
            clipped = [p.grad.float() for p in params]
        if not self.upcast:
            self.opt.step()
            return
        i = 0
        h = self.hyper
        for group in self.groups:
            for p in group["params"]:
                st = self.state.setdefault(p, {
                    "m": torch.zeros_like(p, dtype=torch.float32), "v": torch.zeros_like(p, dtype=torch.float32),
                    "vmax": torch.zeros_like(p, dtype=torch.float32),
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                })
                p32 = p.detach().float()
                torch_adam_fn(
                    [p32], [clipped[i]], [st["m"]], [st["v"]], [st["vmax"]] if h["amsgrad"] else [], [st["step"]],
                    foreach=False, amsgrad=h["amsgrad"], beta1=h["betas"][0], beta2=h["betas"][1], lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=h["eps"], maximize=False,
                    decoupled_weight_decay=self.family == "adamw",
                )
                with torch.no_grad():
                    p.copy_(p32)
                for k in ("m", "v", "vmax"):  # the moments are stored in the parameter's dtype
                    st[k].copy_(st[k].to(self.dtype))
                i += 1


def ulp(dtype):
    return torch.finfo(dtype).eps


def compare(case, dtype, clip, device="cpu"):
    """`Modular` with the case's optimizer against torch's reference, both on `device` (tests/test_cuda.py
    runs it on CUDA, where modopt picks CUDA's fused kernels and torch's for-loop reference runs there too)."""
    name, family, hyper, factory = case
    mod_model, ref_model = make_model(dtype, device), make_model(dtype, device)
    start = [p.detach().clone() for p in mod_model.parameters()]
    chain = ([mo.ClipNorm(1.0)] if clip else []) + [factory(**hyper)]
    opt = mo.Modular(groups(mod_model, family, hyper["lr"]), *chain)
    ref = TorchReference(ref_model, family, hyper, dtype, clip)
    for x, y in data(dtype, device):
        backward(mod_model, x, y)
        opt.step()
        backward(ref_model, x, y)
        ref.step()
    # a few units of rounding at the parameter's magnitude, growing with the steps taken
    k = 16.0 if dtype in (torch.float16, torch.bfloat16) else 64.0
    for (pname, p), r, p0 in zip(mod_model.named_parameters(), ref_model.parameters(), start):
        d_mod = (p.detach() - p0).double()
        d_ref = (r.detach() - p0).double()
        scale = torch.maximum(p0.double().abs(), d_ref.abs()).clamp(min=0.05)
        tol = k * ulp(dtype) * scale
        err = (d_mod - d_ref).abs()
        moved = float((d_ref.abs() > tol).double().mean())
        assert moved > 0.1, f"{pname}: the reference moved {moved:.0%} of it beyond rounding; the test would show little"
        left_behind = (p.detach() == p0) & (d_ref.abs() > tol)
        assert not left_behind.any(), (
            f"{name} {dtype} clip={clip}: {int(left_behind.sum())} of {p.numel()} elements of {pname} did not move "
            "where the reference moved them"
        )
        assert (err <= tol).all(), (
            f"{name} {dtype} clip={clip}: {pname} differs from torch by {float((err / tol).max()):.1f}x the tolerance "
            f"({int((err > tol).sum())} of {p.numel()} elements)"
        )


@pytest.mark.parametrize("clip", [False, True], ids=["alone", "after_clipnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_optimizer_matches_torch_reference(case, dtype, clip):
    compare(case, dtype, clip)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("clip", [False, True], ids=["alone", "after_clipnorm"])
def test_the_check_catches_the_eight_element_sgd_bug(monkeypatch, dtype, clip):
    """On a torch that has the CPU fused-SGD bug: with the shim's exclusion removed (modopt's old
    behaviour: fused SGD for every float dtype on CPU) the comparison above fails."""
    if ("sgd", "cpu", dtype) not in kernels.known_bad(torch.__version__):
        pytest.skip(f"torch {torch.__version__}'s CPU fused SGD is right for {dtype} (kernels.KERNEL_BUGS): "
                    "no bug for the check to catch")
    monkeypatch.setattr(kernels, "KNOWN_BAD", set())
    assert kernels.fused_ok("sgd", torch.device("cpu"), dtype)
    with pytest.raises(AssertionError, match="did not move"):
        compare(CASES[1], dtype, clip)


BUG_CASES = [(bug, dtype) for bug in kernels.KERNEL_BUGS for dtype in bug.dtypes]


@pytest.mark.parametrize("bug,dtype", BUG_CASES,
                         ids=[f"{b.kernel}-{b.device}-{str(d).replace('torch.', '')}" for b, d in BUG_CASES])
def test_kernel_bugs_hold_for_the_running_torch(bug, dtype):
    """Each `kernels.KERNEL_BUGS` entry against the running torch. Where the entry says this version
    has the defect, torch's fused kernel really is wrong and modopt's default takes the foreach
    path; where it says this version has none (fixed, or older than the defect), the fused kernel
    is right and modopt's default runs it. A failure on a new torch means the entry's versions
    (`first_bad`, `fixed_in`) are wrong there."""
    assert (bug.kernel, bug.device) == ("sgd", "cpu"), "this check runs the CPU fused SGD only; extend it first"
    version = torch.__version__
    # one plain step of torch's fused kernel: lr 1, gradient 1, from 0: every element must become -1 (exact)
    p = torch.zeros(1000, dtype=dtype)
    kernels.fused_sgd_([p], [torch.ones_like(p)], [], lr=1.0, weight_decay=0.0, momentum=0.0, dampening=0.0,
                       nesterov=False, is_first_step=False, grad_scale=None)
    right = int((p == -1).sum())
    # the same step through modopt's default SGD: right either way, fused only where torch's kernel is
    q = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    q.grad = torch.ones_like(q)
    opt = mo.Modular([q], mo.SGD(1.0))
    with Ops() as ops:
        opt.step()
    assert int((q.detach() == -1).sum()) == 1000, f"torch {torch.__version__}: modopt's SGD left elements of {dtype} behind"
    ran_fused = "aten._fused_sgd_" in ops.names
    span = f"{bug.first_bad} <= version < {bug.fixed_in}"
    if bug.affects(version):
        assert right < 1000, f"torch {version}: fused {bug.kernel} is right for {dtype}, but KERNEL_BUGS says {span} has the bug"
        assert not kernels.fused_ok(bug.kernel, torch.device(bug.device), dtype) and not ran_fused
    else:
        assert right == 1000, f"torch {version}: fused {bug.kernel} moved {right} of 1000 elements of {dtype}, but " \
                              f"KERNEL_BUGS says only {span} has the bug"
        assert kernels.fused_ok(bug.kernel, torch.device(bug.device), dtype) and ran_fused


def test_known_bad_follows_the_torch_version():
    """`known_bad(version)` against the versions the fused-SGD bug was seen in (docs/torch-versions.md)."""
    half = {("sgd", "cpu", torch.float16), ("sgd", "cpu", torch.bfloat16)}
    for version in ("2.4.0", "2.8.0", "2.12.1", "2.13.0", "2.13.0+cpu", "2.13.0+cu130", "2.14.0.dev20260101"):
        assert kernels.known_bad(version) == half, version
    for version in ("2.3.1", "2.14.0", "2.14.0+cu130", "2.14.1", "2.15.0", "2.15.0+cu132", "3.0.0"):
        assert kernels.known_bad(version) == set(), version
    assert kernels.KNOWN_BAD == kernels.known_bad(torch.__version__) == kernels.known_bad()
    for bad in ("latest", "", None, 2.13):
        with pytest.raises(ValueError, match="version: expected a torch version"):
            kernels.known_bad(bad)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("kernel", ["sgd", "adam", "adamw"])
def test_every_chosen_fused_kernel_moves_every_element(kernel, dtype, device):
    """Where the shim picks a fused kernel, one step on tensors of awkward lengths (around the
    vector widths) equals torch's for-loop optimizer, in float32 arithmetic for half dtypes; on
    every device the tests have (CUDA's fused kernels are other code than the CPU's)."""
    if not kernels.fused_ok(kernel, torch.device(device), dtype):
        pytest.skip(f"the shim does not choose fused {kernel} for {dtype} on {device}")
    g = torch.Generator().manual_seed(0)
    sizes = [1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 1000, 4099]
    ps = [torch.randn(n, generator=g).to(device, dtype) for n in sizes]
    gs = [torch.randn(n, generator=g).to(device, dtype) for n in sizes]
    ref = [p.double().clone() for p in ps]
    if kernel == "sgd":
        kernels.fused_sgd_(ps, gs, [], lr=0.5, weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False,
                           is_first_step=False, grad_scale=None)
        for r, gr in zip(ref, gs):
            r.sub_(0.5 * gr.double())
    else:
        zeros = lambda: [torch.zeros_like(p) for p in ps]  # noqa: E731
        kernels.fused_adam_(ps, gs, zeros(), zeros(), [], [torch.ones((), device=device) for _ in ps], decoupled=kernel == "adamw",
                            lr=0.5, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, grad_scale=None)
        z = lambda: [torch.zeros_like(r) for r in ref]  # noqa: E731
        torch_adam_fn(ref, [x.double() for x in gs], z(), z(), [], [torch.zeros((), dtype=torch.float64, device=device) for _ in ref],
                      foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=0.5, weight_decay=0.1, eps=1e-8,
                      maximize=False, decoupled_weight_decay=kernel == "adamw")
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.double(), r, rtol=4 * ulp(dtype), atol=4 * ulp(dtype))


# --- modopt's for-loop Adam (`kernels.loop_adam_`) against torch's, bit for bit -------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bit patterns (so that NaN == NaN of the same payload and -0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def loop_case(dtype, amsgrad, seed=0):
    """Parameters of awkward lengths (around the vector widths) and layouts (a transposed view, a
    channels-last 4-d tensor), their moments and step counts, and 40 steps of gradients from 1e-7 to 1e3
    with exact zeros: the values torch's for-loop Adam rounds differently in each dtype."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g) * 2 for n in (1, 7, 17, 33, 65, 1000)]
    ps.append(torch.randn(9, 5, generator=g).t())  # non-contiguous (its moments follow its strides)
    ps.append(torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last))
    ps = [p.to(dtype) for p in ps]
    zeros = lambda: [torch.zeros_like(p, memory_format=torch.preserve_format) for p in ps]  # noqa: E731
    state = (ps, zeros(), zeros(), zeros() if amsgrad else [], [torch.zeros(()) for _ in ps])
    grads = []
    for _ in range(40):
        scale = 10.0 ** float(torch.randint(-7, 4, (), generator=g))
        step = [(torch.randn(p.shape, generator=g) * scale).to(dtype) for p in ps]
        for s in step:
            s.view(-1)[::5] = 0.0
        grads.append(step)
    return state, grads


@pytest.mark.parametrize("maximize", [False, True], ids=["min", "maximize"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_loop_adam_is_torchs_for_loop_bit_for_bit(dtype, decoupled, amsgrad, maximize):
    """`kernels.loop_adam_` (what `fused=False`/`foreach=False` run on a CPU) against torch's for-loop
    Adam (`torch.optim.adam.adam(foreach=False)`, `torch.optim.Adam/AdamW(foreach=False)`'s step):
    every parameter, moment and step count the same bits after every step, with weight decay, the
    learning rate changed halfway, in every float dtype (torch's for-loop computes in the parameter's
    dtype: half precision rounds at every operation, so any operation out of torch's order shows)."""
    ours, grads = loop_case(dtype, amsgrad)
    theirs, _ = loop_case(dtype, amsgrad)
    for i, gs in enumerate(grads):
        hyper = dict(lr=1e-2 if i < 20 else 3e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
                     amsgrad=amsgrad, maximize=maximize)
        kernels.loop_adam_(ours[0], [x.clone() for x in gs], *ours[1:], decoupled=decoupled, **hyper)
        torch_adam_fn(theirs[0], [x.clone() for x in gs], *theirs[1:], foreach=False, decoupled_weight_decay=decoupled,
                      **hyper)
        for a, b, what in zip(ours, theirs, ("params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")):
            assert same_bits(a, b), f"step {i + 1}: {what} differ from torch's for-loop Adam"
    assert not same_bits(ours[0], loop_case(dtype, amsgrad)[0][0]), "the parameters did not move"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_loop_adam_with_a_learning_rate_changed_every_step_stays_torchs_and_keeps_few_factors(dtype, monkeypatch):
    """`loop_adam_` multiplies float32/float64 tensors by cached 0-d factors (`kernels.const`): with a
    learning rate that changes every step (a scheduler) each step's factor is a new one, still torch's
    for-loop bit for bit, and the cache stays bounded (`kernels.MAX_CONSTS`), not one per step forever."""
    monkeypatch.setattr(kernels, "MAX_CONSTS", 16)  # (a small bound, so that 90 steps run past it)
    ours, grads = loop_case(dtype, False)
    theirs, _ = loop_case(dtype, False)
    for i in range(90):
        gs = grads[i % len(grads)]
        hyper = dict(lr=1e-2 / (1 + i), beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False,
                     maximize=False)
        kernels.loop_adam_(ours[0], [x.clone() for x in gs], *ours[1:], decoupled=True, **hyper)
        torch_adam_fn(theirs[0], [x.clone() for x in gs], *theirs[1:], foreach=False, decoupled_weight_decay=True,
                      **hyper)
        for a, b, what in zip(ours, theirs, ("params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")):
            assert same_bits(a, b), f"step {i + 1}: {what} differ from torch's for-loop AdamW"
    assert 0 < len(kernels._CONSTS) <= kernels.MAX_CONSTS


def test_loop_adam_leaves_the_gradients_as_they_are():
    """torch's for-loop negates (`maximize`) and adds the L2 term out of place: the caller's gradients
    (modopt's updates may be `p.grad` itself) are never written."""
    (ps, m, v, vmax, steps), grads = loop_case(torch.float32, True)
    gs = grads[0]
    before = [g.clone() for g in gs]
    kernels.loop_adam_(ps, gs, m, v, vmax, steps, decoupled=False, lr=1e-2, beta1=0.9, beta2=0.999,
                       weight_decay=0.1, eps=1e-8, amsgrad=True, maximize=True)
    assert same_bits(gs, before)


@pytest.mark.parametrize("kernel", [{"fused": False}, {"foreach": False}], ids=["fused=False", "foreach=False"])
@pytest.mark.parametrize("case", [c for c in CASES if c[1] in ("adam", "adamw")], ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "maximize"])
def test_torch_kernel_adam_equals_torch_for_loop_bit_for_bit(dtype, case, kernel, maximize):
    """Run as users run it (two param groups with their own lr and weight decay, real forward and
    backward), modopt's `Adam/AdamW(fused=False)` and `(foreach=False)` against
    `torch.optim.Adam/AdamW(foreach=False)`: the same parameters and states, bit for bit, in every
    float dtype; and the loop that ran is modopt's (`kernels.loop_adam_`). (No clip in front: in half
    precision `ClipNorm` and `clip_grad_norm_` round the clipped gradient differently, whichever kernel
    follows.)"""
    name, family, hyper, factory = case
    hyper = dict(hyper, maximize=maximize)
    if dtype == torch.float16:  # (1e-8 is 0 in float16: the for-loop's first 0/0 would make every step NaN)
        hyper["eps"] = 1e-3
    mod_model, ref_model = make_model(dtype), make_model(dtype)
    opt = mo.Modular(groups(mod_model, family, hyper["lr"]), factory(**hyper, **kernel))
    cls = torch.optim.AdamW if family == "adamw" else torch.optim.Adam
    ref = cls(groups(ref_model, family, hyper["lr"]), **hyper, foreach=False)
    calls = []
    real = kernels.loop_adam_

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    kernels.loop_adam_ = counted
    try:
        for x, y in data(dtype):
            backward(mod_model, x, y)
            opt.step()
            backward(ref_model, x, y)
            ref.step()
    finally:
        kernels.loop_adam_ = real
    assert len(calls) == 2 * STEPS  # (one call per param group and step)
    assert int(opt.stats["skipped_steps"]) == 0 and all(p.isfinite().all() for p in mod_model.parameters())
    assert same_bits(list(mod_model.parameters()), list(ref_model.parameters()))
    for p, q in zip(mod_model.parameters(), ref_model.parameters()):
        mine = {k.rsplit(".", 1)[-1]: v for k, v in opt.state[p].items()}
        for k, v in ref.state[q].items():
            assert same_bits([mine[k]], [v]), k


def test_loop_adam_runs_only_where_it_is_torchs_for_loop():
    """`kernels.loop_adam_ok`: modopt's loop stands in for torch's for-loop kernel on CPU tensors with
    torch's step layout and number hyperparameters; torch's own call everywhere else (its foreach
    kernel, `capturable`, tensor hyperparameters, other step layouts, complex parameters)."""
    p = [torch.zeros(3), torch.zeros(2, 2)]
    steps = [torch.zeros(()), torch.zeros(())]
    ok = lambda p=p, steps=steps, **k: kernels.loop_adam_ok(p, steps, **{  # noqa: E731
        "foreach": False, "capturable": False, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, **k})
    assert ok() and ok(foreach=None) == (not kernels.torch_default_foreach(p))
    assert not ok(foreach=True) and not ok(capturable=True) and not ok(p=[], steps=[])
    for key in ("lr", "beta1", "beta2"):
        assert not ok(**{key: torch.tensor(0.5)})
    assert not ok(steps=[torch.zeros(()), torch.zeros((), dtype=torch.float64)])
    assert not ok(steps=[torch.zeros(()), torch.zeros(1)])
    assert not ok(p=[torch.zeros(3, dtype=torch.complex64), torch.zeros(2, 2)])
    if torch.cuda.is_available():
        assert not ok(p=[torch.zeros(3, device="cuda"), torch.zeros(2, 2, device="cuda")])
        assert not ok(steps=[torch.zeros((), device="cuda"), torch.zeros(())])
