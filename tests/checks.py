"""Shared assertions of the test suite."""

from __future__ import annotations

import math
import typing

import torch


def assert_same(a, b, path: str = "") -> None:
    """Two state trees (dicts, lists, tensors, numbers) are identical: same keys, dtypes and bits
    (NaNs in the same places count as equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        same = torch.equal(a, b)
        if not same and a.is_floating_point():
            same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert same, path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def assert_step_changes_nothing(model, opt, syncs) -> None:
    """One `opt.step()` (under `syncs`, a sync counter) leaves the model's and the optimizer's whole state
    bit for bit as it was (a step skipped for non-finite gradients or a spike)."""
    import io

    before = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), before)
    with syncs:
        opt.step()
    before.seek(0)
    m_sd, o_sd = torch.load(before, weights_only=True)
    assert_same(m_sd, model.state_dict())
    assert_same(o_sd["state"], opt.state_dict()["state"])
    assert_same(o_sd["modopt"]["transforms"], opt.state_dict()["modopt"]["transforms"])


def assert_bad_steps_change_nothing(make, set_grads, *, steps: int, at, bads=(math.nan, math.inf)):
    """Two runs of `make()` (a fresh `(model, opt)`), `set_grads(model, k)` giving step `k` its gradients. In the
    second, before each step `k` in `at`, one extra step per value of `bads`: step `k`'s gradients with that
    value in the first element of the first parameter's. Each extra step is skipped and changes no bit of the
    model or the optimizer (`assert_step_changes_nothing`); no step of the second run, nor a read of its stats,
    syncs with the host (`Syncs`: the device path); `skipped_steps` counts the extra steps; and both runs end
    with the same parameters, bit for bit. Returns the second run's `(model, opt)` for a test's own checks."""
    ma, oa = make()
    mb, ob = make()
    assert ob._skip_on_device, "the host decides the skip in this pipeline"
    syncs = Syncs()
    for k in range(steps):
        for bad in (bads if k in at else ()):
            set_grads(mb, k)
            with torch.no_grad():
                next(mb.parameters()).grad.view(-1)[0] = bad
            assert_step_changes_nothing(mb, ob, syncs)
            assert bool(ob.stats["skipped"]), (k, bad)
        set_grads(ma, k)
        set_grads(mb, k)
        oa.step()
        with syncs:
            ob.step()
            _ = dict(ob.stats)  # telemetry stays on the device
    assert syncs.n == 0, f"{syncs.n} host syncs"
    assert int(ob.stats["skipped_steps"]) == len(at) * len(bads)
    for i, (p, q) in enumerate(zip(ma.parameters(), mb.parameters())):
        assert torch.equal(p, q), f"parameter {i}"
    return mb, ob


def train(model, opt, n, seed=0):
    """``n`` steps of a squared-output loss on seeded (5, 3) batches."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=g)).pow(2).sum().backward()
        opt.step()


def needs_the_host():
    """A transform that changes nothing and declares `device_skip = False`: a pipeline holding
    it decides the non-finite skip on the host (one sync a step), the way to test that path."""
    return _NeedsTheHost()


def _make_needs_the_host():
    import modopt as mo

    class _NeedsTheHost(mo.Transform):  # (a leading underscore: the registry's checks pass it by)
        """Changes nothing; declares `device_skip = False` (tests only)."""

        positional = None
        update_access = "none"  # it neither reads nor writes them: the norm memo passes by it
        device_skip = False  # (declared: stateless, it would be inferred True)

        def apply(self, ctx, st, updates):
            return updates

    return _NeedsTheHost


_NeedsTheHost = _make_needs_the_host()


def _sync_ops():
    import torch

    return (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


def _make_syncs():
    from torch.utils._python_dispatch import TorchDispatchMode

    from modopt.core import runner

    class Syncs(TorchDispatchMode):
        """Counts host syncs (`.item()`, `bool(tensor)`: `aten._local_scalar_dense`, `aten.is_nonzero`) in `n`.

        Inside it, steps on the CPU take the device path (`modopt.core.runner.device_path`): the
        syncs counted are the ones a GPU would wait for."""

        def __init__(self):
            super().__init__()
            self.n = 0
            self._paths = []

        def __enter__(self):
            # what a GPU pays: the device path, which a CPU step otherwise reads back on the host
            self._paths.append(runner.device_path())
            self._paths[-1].__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            self._paths.pop().__exit__(*exc)
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in _sync_ops()
            return func(*args, **(kwargs or {}))

    return Syncs


Syncs = _make_syncs()


def _make_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        """The aten ops run inside it, by name (`aten._fused_sgd_`), in `names`."""

        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    return Ops


Ops = _make_ops()


def split(params, groups):
    """The first parameter in a group of its own and the rest in another (`groups`), or the list itself."""
    return [{"params": params[:1]}, {"params": params[1:]}] if groups else params


def run_twins(ref, opt, a, b, stream, each=None):
    """Step the reference and modopt on the same gradients (None: no gradient); `each(k)` after every step."""
    for k, gs in enumerate(stream):
        for p, q, gr in zip(a, b, gs):
            p.grad = None if gr is None else gr.clone()
            q.grad = None if gr is None else gr.clone()
        ref.step()
        opt.step()
        if each is not None:
            each(k)


def flat_state(sd, prefix: str = "") -> dict:
    """Every tensor and number of a (state) dict, nested dicts included, cloned, by path."""
    import copy

    out = {}
    for k, v in sd.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            out.update(flat_state(v, key))
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
        elif k != "params":
            out[key] = copy.deepcopy(v)
    return out


def saved(opt, params) -> dict:
    """Every value `opt` saves (its per-parameter state and every transform's store) and every parameter
    (`params`: a module or a list of tensors), cloned, by path."""
    ps = list(params.parameters()) if hasattr(params, "parameters") else list(params)
    sd = opt.state_dict()
    out = flat_state({"state": sd["state"], "modopt": sd["modopt"]["transforms"]})
    out.update({f"param{i}": p.detach().clone() for i, p in enumerate(ps)})
    return out


def same(a: dict, b: dict) -> None:
    """Two `saved()` snapshots hold the same keys and the same bits (dtypes and shapes included)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y, k


def tanh_mlp(sizes=(6, 12, 3), dtype=torch.float32, seed=0):
    """A small `Linear -> Tanh -> Linear` model of `sizes` (in, hidden, out), seeded."""
    torch.manual_seed(seed)
    n_in, hidden, n_out = sizes
    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, n_out)).to(dtype)


def regression_batches(n, sizes=(6, 12, 3), rows=5, dtype=torch.float32, seed=1):
    """`n` seeded `(x, y)` batches of `rows` rows for a model of `sizes`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, sizes[0], generator=g, dtype=dtype), torch.randn(rows, sizes[-1], generator=g, dtype=dtype))
            for _ in range(n)]


def mse_backward(model, x, y) -> None:
    """Fresh gradients of the mean squared error of `model` on `(x, y)`."""
    model.zero_grad()
    (model(x) - y).pow(2).mean().backward()


class Resumed(typing.NamedTuple):
    """What `assert_resumes_bit_for_bit` hands back for a test's own checks."""

    saved: dict  #: the optimizer's state dict as loaded back (weights_only)
    at_cut: typing.Any  #: the optimizer that was saved, as it was at the cut
    model: typing.Any  #: the resumed model, at the end (bit for bit the straight run's)
    opt: typing.Any  #: the resumed optimizer, at the end


def assert_resumes_bit_for_bit(make_model, make_opt, data=None, *, cut: int, steps: int | None = None, step=None,
                               make_resumed=None) -> Resumed:
    """`steps` steps straight through, and the same stopped after `cut` of them, saved with `torch.save`, loaded
    with `weights_only=True` into a fresh model and optimizer (`make_resumed(model)`, by default `make_opt`) and
    continued, end with the same parameters and optimizer state, bit for bit.

    `step(model, opt, k)` sets the gradients of step `k` and steps; by default the mean squared error on batch
    `data[k]`, and `steps` is `len(data)`."""
    import io

    if step is None:
        def step(model, opt, k):
            mse_backward(model, *data[k])
            opt.step()

        steps = len(data) if steps is None else steps
    assert 0 < cut < steps, (cut, steps)  # a cut with nothing before or after it checks no resume

    straight = make_model()
    straight_opt = make_opt(straight)
    for k in range(steps):
        step(straight, straight_opt, k)
    model = make_model()
    opt = make_opt(model)
    for k in range(cut):
        step(model, opt, k)
    buf = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), buf)
    buf.seek(0)
    msd, osd = torch.load(buf, weights_only=True)
    resumed = make_model()
    resumed.load_state_dict(msd)
    opt2 = (make_resumed or make_opt)(resumed)
    opt2.load_state_dict(osd)
    for k in range(cut, steps):
        step(resumed, opt2, k)
    ps, qs = list(straight.parameters()), list(resumed.parameters())
    assert len(ps) == len(qs)
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert torch.equal(p, q), f"parameter {i}"
    a, b = straight_opt.state_dict(), opt2.state_dict()
    assert_same(a["state"], b["state"], "state")
    assert_same(a["modopt"]["transforms"], b["modopt"]["transforms"], "modopt/transforms")
    return Resumed(osd, opt, resumed, opt2)


# --- seeded tensors and a NaN step, for the orthogonalized optimizers' tests -------------------------------
def randn(shape, seed, dtype=torch.float64):
    """A seeded standard normal tensor (drawn in float64, then cast: the same values in every dtype)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def twin_params(shapes, dtype, seed=0):
    """Two lists of parameters with the same seeded values: one for modopt, one for the reference."""
    ps = [randn(s, seed + i, dtype) for i, s in enumerate(shapes)]
    return [torch.nn.Parameter(p.clone()) for p in ps], [torch.nn.Parameter(p.clone()) for p in ps]


def seeded_grads(params, k, seed, dtype, nan_at=None):
    """Gradients of step `k` (seeded by `seed` and `k`); a NaN in the first one when `k == nan_at`."""
    g = torch.Generator().manual_seed(seed * 1000 + k)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
        if k == nan_at and i == 0:
            p.grad.view(-1)[0] = math.nan


def assert_a_nan_step_changes_no_bit(ours, opt, theirs, ref, steps=6, at=3):
    """`opt` over `ours` with an extra NaN step after step `at` (skipped on the device, no host sync)
    ends bit for bit where `ref` over `theirs` ends without it."""
    syncs = Syncs()
    for k in range(steps):
        seeded_grads(ours, k, 0, ours[0].dtype)
        with syncs:
            opt.step()
        if k == at:
            seeded_grads(ours, 99, 0, ours[0].dtype, nan_at=99)
            with syncs:
                opt.step()
            assert bool(opt.stats["skipped"])
        seeded_grads(theirs, k, 0, theirs[0].dtype)
        ref.step()
    assert syncs.n == 0
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def assert_same_run(oa, a, ob, b, steps):
    """`steps` float32 steps of two optimizers on the same gradients; the parameters agree to float32 rounding."""
    for k in range(steps):
        seeded_grads(a, k, 0, torch.float32)
        seeded_grads(b, k, 0, torch.float32)
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def everything(model, opt):
    """What a refusal must leave as it was: parameters, state (tensors and store), groups."""
    import copy

    return copy.deepcopy({"params": [p.detach().clone() for p in model.parameters()], "opt": opt.state_dict()})


def refused(model, opt, call, match):
    """`call()` raises ValueError or TypeError matching `match`, and leaves `everything` as it was."""
    import pytest

    before = everything(model, opt)
    with pytest.raises((ValueError, TypeError), match=match):
        call()
    assert_same(before, everything(model, opt))
