"""The optimizer kernel is an argument: `fused` / `foreach` with torch's meanings, bit for bit with torch.

The drop-in check a nanoGPT user makes: a small GPT-style model, two weight-decay groups, the learning
rate set on every group each iteration, gradient accumulation and `clip_grad_norm_(..., 1.0)`. The
oracle is torch itself: `clip_grad_norm_` over the same list of parameters plus `torch.optim.AdamW` /
`Adam` / `SGD` with the matching kernel (fused, foreach, for-loop).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import modopt as mo
from checks import Ops
from modopt.core import kernels


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """nanoGPT's shape in miniature: token and position embeddings, pre-LN blocks, a tied head."""

    def __init__(self, vocab=32, block=16, d=32, layers=2, heads=2):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(block, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def groups_of(model, wd=0.1):
    """nanoGPT's `configure_optimizers`: matrices decay, biases and norms do not."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def lr_at(it, warmup=5, total=60, top=6e-3, low=6e-4):
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    r = (it - warmup) / (total - warmup)
    return low + 0.5 * (1 + math.cos(math.pi * r)) * (top - low)


def train(model, opt, step, iters=60, accum=2, seed=0):
    """nanoGPT's loop: the lr on every group, `accum` micro-batches, then `step()` (clip + update)."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for it in range(iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        for _ in range(accum):
            x = torch.randint(0, 32, (4, 16), generator=g)
            loss = model(x, torch.roll(x, -1, dims=1)) / accum
            loss.backward()
        losses.append(loss.item())
        step()
        opt.zero_grad(set_to_none=True)
    return losses


def torch_run(model, **kw):
    opt = torch.optim.AdamW(groups_of(model), lr=6e-3, betas=(0.9, 0.95), **kw)
    same_list = [p for gr in opt.param_groups for p in gr["params"]]  # the optimizer's order (see docs)

    def step():
        torch.nn.utils.clip_grad_norm_(same_list, 1.0)
        opt.step()

    return opt, step


@pytest.mark.parametrize("kernel", [{}, {"fused": False}, {"foreach": True}, {"fused": True}],
                         ids=["default", "fused=False", "foreach=True", "fused=True"])
def test_gpt_two_groups_per_iteration_lr_equals_torch_bit_for_bit(kernel):
    torch.manual_seed(0)
    ref = TinyGPT()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    opt = mo.Modular(groups_of(ours), mo.ClipNorm(1.0), mo.AdamW(lr=6e-3, betas=(0.9, 0.95), **kernel))
    # modopt's default runs torch's fused kernel (its docstring and docs/modules/optimizers.md say so)
    t_opt, t_step = torch_run(theirs, **({"fused": True} if not kernel else kernel))
    a = train(ours, opt, opt.step)
    b = train(theirs, t_opt, t_step)
    assert a == b
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
    # and the states: the same moments and counts, torch's step layout
    for p, q in zip(ours.parameters(), theirs.parameters()):
        mine = {k.rsplit(".", 1)[-1]: v for k, v in opt.state[p].items()}
        for k, v in t_opt.state[q].items():
            assert torch.equal(mine[k], v), k
            assert mine[k].device == v.device and mine[k].dtype == v.dtype, k


@pytest.mark.parametrize("fused", [True, False])
def test_gpt_attach_equals_torch_bit_for_bit(fused):
    torch.manual_seed(0)
    ref = TinyGPT()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    opt = torch.optim.AdamW(groups_of(ours), lr=6e-3, betas=(0.9, 0.95), fused=fused)
    handle = mo.attach(opt, mo.ClipNorm(1.0))
    t_opt, t_step = torch_run(theirs, fused=fused)
    assert train(ours, opt, opt.step) == train(theirs, t_opt, t_step)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
    handle.remove()


def test_the_kernel_that_runs_is_the_one_named():
    """Counted, not assumed: the default and `fused=True` call torch's fused kernel, `fused=False`
    on a CPU the for-loop kernel (modopt's `kernels.loop_adam_`, torch's operations per tensor: no
    foreach op on the parameters or moments, one on the step counts), `foreach=True` torch's foreach ops."""

    def ops(**kw):
        p = torch.nn.Parameter(torch.randn(4, 3))
        opt = mo.Modular([p], mo.AdamW(**kw), nonfinite="ignore")
        p.grad = torch.randn(4, 3)
        with Ops() as o:
            opt.step()
        return o.names

    for kw in ({}, {"fused": True}):
        assert "aten._fused_adamw_" in ops(**kw)
    loop = ops(fused=False)
    assert "aten._fused_adamw_" not in loop and "aten.lerp_" in loop
    assert {n for n in loop if "_foreach_" in n} == {"aten._foreach_add_"}  # (the step counts, +1 each)
    fe = ops(foreach=True)
    assert "aten._fused_adamw_" not in fe and "aten._foreach_lerp_" in fe


OPTIMIZERS = [
    ("AdamW", lambda **k: mo.AdamW(lr=1e-2, **k), lambda g, **k: torch.optim.AdamW(g, lr=1e-2, **k)),
    ("Adam-amsgrad-max", lambda **k: mo.Adam(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, **k),
     lambda g, **k: torch.optim.Adam(g, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, **k)),
    ("Adam-decoupled", lambda **k: mo.Adam(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, **k),
     lambda g, **k: torch.optim.Adam(g, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, **k)),
    ("SGD-momentum", lambda **k: mo.SGD(0.05, momentum=0.9, weight_decay=0.01, **k),
     lambda g, **k: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=0.01, **k)),
    ("SGD-nesterov-max", lambda **k: mo.SGD(0.05, momentum=0.9, nesterov=True, maximize=True, **k),
     lambda g, **k: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, maximize=True, **k)),
    ("SGD-dampening", lambda **k: mo.SGD(0.05, momentum=0.9, dampening=0.3, **k),
     lambda g, **k: torch.optim.SGD(g, lr=0.05, momentum=0.9, dampening=0.3, **k)),
]
KERNELS = [{"fused": True}, {"fused": False}, {"foreach": True}, {"foreach": False}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("name,ours,theirs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_every_kernel_and_dtype_equals_torch(name, ours, theirs, kernel, dtype):
    if kernel.get("fused") and name.startswith("SGD") and ("sgd", "cpu", dtype) in kernels.KNOWN_BAD:
        pytest.skip(f"torch {torch.__version__}'s CPU fused SGD is wrong in half precision (kernels.KERNEL_BUGS): "
                    "modopt takes foreach")
    torch.manual_seed(1)
    w = torch.randn(6, 5, dtype=dtype)
    p1, p2 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    b1, b2 = torch.nn.Parameter(torch.zeros(5, dtype=dtype)), torch.nn.Parameter(torch.zeros(5, dtype=dtype))
    opt = mo.Modular([{"params": [p1]}, {"params": [b1], "lr": 3e-3}], ours(**kernel))
    ref = theirs([{"params": [p2]}, {"params": [b2], "lr": 3e-3}], **kernel)
    g = torch.Generator().manual_seed(2)
    for i in range(8):
        grads = [torch.randn(6, 5, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]
        if i == 3:  # a NaN step: skipped by modopt (nonfinite="skip"), not given to torch
            p1.grad, b1.grad = grads[0].clone().fill_(float("nan")), grads[1].clone()
            opt.step()
            continue
        p1.grad, b1.grad = grads[0].clone(), grads[1].clone()
        p2.grad, b2.grad = grads[0].clone(), grads[1].clone()
        opt.step()
        ref.step()
    assert torch.equal(p1, p2) and torch.equal(b1, b2)


def syncs_per_step(**kw) -> tuple[int, int]:
    """Host syncs (`_local_scalar_dense`) in one finite default step of `Modular(ClipNorm, AdamW(**kw))`,
    and how many of them read a step count (torch's non-fused kernels read it on the host)."""

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero):
                self.n += 1
            return func(*args, **(kwargs or {}))

    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = mo.Modular(ps, mo.ClipNorm(1.0), mo.AdamW(**kw))
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        if _ == 2:
            with Count() as c:
                opt.step()
            return c.n, len(ps)
        opt.step()
    raise AssertionError


def test_the_skip_decision_stays_on_the_device_only_with_the_fused_kernels(device_path):
    assert syncs_per_step() == (0, 2)
    assert syncs_per_step(fused=True) == (0, 2)
    # the host decides the skip: one sync for the decision. The for-loop kernel reads the step counts
    # (CPU tensors: no device wait) in one `tolist`, which is no `_local_scalar_dense` (torch's own
    # for-loop reads each with `.item()`: one per tensor, counted)
    assert syncs_per_step(fused=False) == (1, 2)
    n, _ = syncs_per_step(foreach=True)
    assert n >= 1


def test_a_nan_step_with_torch_kernels_leaves_everything_as_it_was():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.AdamW(fused=False))
    p.grad = torch.randn(4, 3)
    opt.step()
    before = copy.deepcopy(opt.state_dict()), p.detach().clone()
    p.grad = torch.full((4, 3), float("nan"))
    opt.step()
    after = opt.state_dict()
    assert torch.equal(p, before[1])
    assert int(opt.stats["skipped_steps"]) == 1
    for (k, s), (_, s2) in zip(before[0]["state"].items(), after["state"].items()):
        for name, v in s.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, s2[name]), name


def test_steps_follow_the_kernel_across_a_checkpoint():
    """A checkpoint of the fused kernel (step counts on the parameters' device) continues under
    `fused=False` (torch keeps them on the CPU there) and back, equal to torch doing the same."""
    torch.manual_seed(0)
    w = torch.randn(5, 4)
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    a = mo.Modular([p], mo.AdamW(lr=1e-2))
    t = torch.optim.AdamW([q], lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(0)

    def both(n, a, t):
        for _ in range(n):
            grad = torch.randn(5, 4, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
            a.step()
            t.step()

    both(3, a, t)
    b = mo.Modular([p], mo.AdamW(lr=1e-2, fused=False))
    with pytest.warns(UserWarning, match="fused: None in the checkpoint, False here"):
        b.load_state_dict(a.state_dict())
    t2 = torch.optim.AdamW([q], lr=1e-2)
    t2.load_state_dict(t.state_dict())
    both(3, b, t2)
    assert torch.equal(p, q)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="fused and foreach"):
        mo.AdamW(fused=True, foreach=True)
    with pytest.raises(ValueError, match="differentiable"):
        mo.SGD(differentiable=True)
    with pytest.raises(ValueError, match="fold_clip"):
        mo.Adam(fold_clip=True, fused=False)
    with pytest.raises(ValueError, match="AdamW always decouples"):
        mo.AdamW(decoupled_weight_decay=False)
    p = torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match="capturable=True.*w is on cpu"):  # when built
        mo.Modular({"w": p}.items(), mo.Adam(capturable=True, fused=False))
    opt = mo.Modular([p], mo.Adam(capturable=True))  # the fused kernel: capturable changes nothing
    p.grad = torch.ones(2)
    opt.step()
    assert int(opt.state[p][next(k for k in opt.state[p] if k.endswith("step"))]) == 1


def test_fused_true_refuses_parameters_torch_has_no_fused_kernel_for(monkeypatch):
    monkeypatch.setattr(kernels, "fused_ok", lambda *a, **k: False)
    p = torch.nn.Parameter(torch.randn(2))
    opt = mo.Modular({"layer.w": p}.items(), mo.AdamW(fused=True))
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="fused=True.*layer.w"):  # (torch.optim raises a RuntimeError too)
        opt.step()
    before = p.detach().clone()
    opt2 = mo.Modular({"layer.w": p}.items(), mo.AdamW())  # the default falls back instead
    opt2.step()
    assert not torch.equal(p, before)


@pytest.mark.parametrize("make", [lambda: mo.AdamW(lr=0.1), lambda: mo.SGD(0.1, momentum=0.9)], ids=["AdamW", "SGD"])
def test_a_gradient_laid_out_unlike_its_parameter_steps_right(make):
    """torch 2.13's fused CPU kernels read a transposed-view gradient in the parameter's order (wrong, and
    `torch.optim.Adam(fused=True)` is wrong the same way): modopt hands them a copy in the parameter's
    layout, so the step equals torch's for-loop kernel on the same values."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 5))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = mo.Modular([p], make()), mo.Modular([q], make().model_copy(update={"fused": False}))
    for _ in range(3):
        g = torch.randn(5, 3).t()  # a transposed view
        p.grad, q.grad = g, g.contiguous()
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fused vs for-loop: rounding only


# --- kernels.const: cached 0-d constants for where / fmin -----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_cached_constant_gives_a_where_and_an_fmin_the_numbers_values_and_dtype(dtype):
    x = torch.tensor([0.5, -0.0, 2.0, math.inf, -math.inf, math.nan], dtype=dtype)
    cond = torch.tensor([True, False, True, False, True, False])
    for value in (1.0, 0.0, -0.0, math.inf):
        want, got = torch.where(cond, x, value), torch.where(cond, x, kernels.const(value, x))
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(want, nan=7.0))
        assert torch.equal(got.signbit(), want.signbit())  # -0.0 and 0.0 are different constants
    # below_one: min(ratio, 1) with NaN -> 1, signed zeros and -inf kept; the same as the two-op form
    from modopt.transforms._util import below_one

    two_ops = torch.clamp(x, max=1.0).nan_to_num_(nan=1.0, posinf=math.inf, neginf=-math.inf)
    assert torch.equal(below_one(x), two_ops) and torch.equal(below_one(x).signbit(), two_ops.signbit())
    c = kernels.const(1.0, x)
    assert c is kernels.const(1.0, x) and c.dim() == 0 and c.dtype == dtype  # made once


def test_a_where_on_a_constant_makes_no_scalar_tensor():
    x = torch.rand(3)
    with Ops() as plain:
        torch.where(x > 0.5, x, 1.0)
    one = kernels.const(1.0, x)
    with Ops() as cached:
        torch.where(x > 0.5, x, one)
    assert "aten.scalar_tensor" in plain.names and "aten.scalar_tensor" not in cached.names
