"""The step users run, timed: `opt.step()` after a real forward and backward, with modopt's defaults,
side by side with the careful torch loop (and torchzero, when it is installed) in one process.

    python benchmarks/bench.py                 # both models, every pipeline, 3 repeats (a few minutes)
    python benchmarks/bench.py --quick         # tiny models, 2 steps: a smoke run (the tests run it)
    python benchmarks/bench.py --only ClipNorm --models mlp --repeats 5 --json rows.json
    modopt bench ...                           # the same, from a source checkout

Sides. For every pipeline and model, each side trains its own copy of the same model on the same
batches:

* **modopt**: `mo.Modular(params, *pipeline)` with every default (`nonfinite="skip"`: a step with
  an inf/NaN gradient is skipped, one host sync per step);
* **torch**: the same algorithm as a careful user writes it with torch: `torch.optim`'s fused
  optimizer, `torch.nn.utils` clipping or `torch._foreach_*` code, and the finite check that makes
  a non-finite step a no-op (`if norm.isfinite(): opt.step()`);
* **torchzero** (only when importable; not in the sweep): the same pipeline written with its modules and defaults.

Rows marked `nonfinite="ignore"` time modopt without the check against torch without it.

Each row (pipeline, model, policy) runs in a fresh Python process, so that no row inherits the memory
state (allocator, page cache) an earlier row left; `--in-process` runs them all in this one.

Timing. Every iteration all sides run forward and backward on the same batch, then each side's
`step` is timed alone with `time.perf_counter` (with `--device cuda`, between two
`torch.cuda.synchronize()`: the step's kernels are inside the time) (the order of the sides alternates every iteration,
Python's garbage collector is paused). After the warm-up, a repeat reports the median step time of
each side and the median of the per-iteration ratios modopt/torch (a paired statistic: a slow phase
of the machine hits both members of a pair). Each repeat builds fresh models and optimizers; the
table gives every repeat's ratio and their median. For `Accumulate(4)` a timed step is the four
`step` calls of one cycle, each after its own backward. On the sweep's models of fewer than 512
tensors a repeat times (and warms up) 512/N times as many steps (`steps_for`).

Memory. `extra` is the peak, during one more (untimed) step, of the bytes of tensors the step
allocated and still holds, in % of the parameter bytes, seen by a dispatch mode that sees every aten
op (torch's CPU allocator keeps no statistics; on CUDA `max_memory_allocated` measures the same).
Scratch memory inside one kernel is invisible to it, on both sides alike. `state` is the persistent
optimizer state in % of the parameter bytes.

Counts. `ops/syncs/bytes` is one more untimed step per side (each call of an `Accumulate` cycle,
summed) under a dispatch mode: aten ops other than views, host syncs (`_local_scalar_dense`,
`is_nonzero`) and the bytes the ops read and write in units of `P`, the parameters' bytes. They do not
depend on the machine: they are what a GPU pays for (`benchmarks/step_counts.py` prints them alone).

`diff` is the largest difference between the modopt and torch parameters after a repeat, relative
to the largest parameter: 0 means bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import modopt as mo
from modopt.core import runner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from call_counts import count as python_calls  # noqa: E402  (the Python-call counter of call_counts.py)

# --------------------------------------------------------------------------- models


class TinyTransformer(nn.Module):
    """A token classifier: embedding, pre-built encoder layers, layer norm, linear head."""

    def __init__(self, vocab: int, dim: int, heads: int, ff: int, layers: int, classes: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.norm(self.enc(self.emb(x))))


#: elements per tensor of the sweep's models (`tensors-N`)
SWEEP_SIZE = 256
#: the sweep's tensor counts and pipelines (`--sweep`)
SWEEP_TENSORS = (8, 64, 512, 2048, 4096)
SWEEP_PIPELINES = ("ClipNorm(1.0), Adam()", "ClipNormByEMA(), Normalize(), Adam()",
                   "Accumulate(4), ClipNorm(1.0), Adam()")
#: a sweep repeat at N tensors times (and warms up) `steps * SWEEP_EVEN // N` steps when that is more:
#: as many tensor-steps as `steps` steps at 512 tensors. A step of 8 small tensors takes tens of
#: microseconds, so ten of them are a sample of the machine's noise, not of the step.
SWEEP_EVEN = 512


def steps_for(model_name: str, steps: int, warmup: int) -> tuple[int, int]:
    """`(warmup, steps)` of one repeat on `model_name`: scaled up on the sweep's small models (`SWEEP_EVEN`)."""
    m = re.fullmatch(r"tensors-(\d+)", model_name)
    k = max(1, SWEEP_EVEN // int(m.group(1))) if m else 1
    return warmup * k, steps * k


class ManyTensors(nn.Module):
    """`n` parameter vectors of `size` elements; the output is each one times its input row, so a
    backward gives every tensor a gradient of its own (the model of the tensor-count sweep)."""

    def __init__(self, n: int, size: int):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(size) / size**0.5) for _ in range(n))

    def forward(self, x):
        return torch.stack(list(self.ps)) * x


def build_model(name: str, quick: bool) -> tuple[nn.Module, Callable[[torch.Generator], tuple]]:
    """The model and a batch maker (inputs, targets) drawn from a generator."""
    if name == "mlp":  # 5.77M parameters in 8 tensors (memory-bound)
        dims = [64, 128, 64, 32] if quick else [1024, 2048, 1024, 1024, 512]
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        model = nn.Sequential(*layers[:-1])
        batch = 8 if quick else 32

        def make(g):
            return torch.randn(batch, dims[0], generator=g), torch.randn(batch, dims[-1], generator=g)

        return model, make
    if name == "transformer":  # 5.79M parameters in 77 tensors (per-tensor overhead)
        vocab, dim, ff, nl, classes = (64, 16, 32, 2, 8) if quick else (4096, 256, 1024, 6, 16)
        model = TinyTransformer(vocab, dim, 4, ff, nl, classes)
        shape = (2, 8) if quick else (4, 32)

        def make(g):
            return torch.randint(0, vocab, shape, generator=g), torch.randint(0, classes, shape, generator=g)

        return model, make
    m = re.fullmatch(r"tensors-(\d+)", name)
    if m:  # the sweep: N tensors of 256 elements (per-tensor overhead alone)
        n = int(m.group(1))
        model = ManyTensors(n, SWEEP_SIZE)

        def make(g):
            return torch.randn(n, SWEEP_SIZE, generator=g), torch.randn(n, SWEEP_SIZE, generator=g)

        return model, make
    raise ValueError(f"unknown model {name!r}")  # pragma: no cover - argparse restricts the names


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if y.dtype == torch.long:
        return nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
    return nn.functional.mse_loss(out, y)


# --------------------------------------------------------------------------- sides


@dataclass
class Side:
    """One optimizer under test: its model, `step()` and what it keeps."""

    model: nn.Module
    step: Callable[[], Any]
    state: Callable[[], list]

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def state_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in tree_leaves(self.state()):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total


def _opt_state(opt: torch.optim.Optimizer) -> Callable[[], list]:
    def state():
        out: list = [dict(s) for s in opt.state.values()]
        if isinstance(opt, mo.Modular):
            out.append({k: dict(v) for k, v in opt._store.items()})
        return out

    return state


def modopt_side(make: Callable[[], list], nonfinite: str | None,
                groups: Callable[[nn.Module], list[dict]] | None = None) -> Callable[[nn.Module], Side]:
    def build(model):
        kw = {} if nonfinite is None else {"nonfinite": nonfinite}
        opt = mo.Modular(model.parameters() if groups is None else groups(model), *make(), **kw)
        return Side(model, opt.step, _opt_state(opt))

    return build


# The careful torch user: the same algorithm with torch's kernels, and (check=True) a finite check
# that turns a non-finite step into a no-op. Each builder returns a Side.


def _grads(params):
    return [p.grad for p in params]


def _finite(total: torch.Tensor, check: bool) -> bool:
    return bool(total.isfinite()) if check else True  # the one host sync of the careful loop


def torch_clipnorm_adam(model, check):
    ps = list(model.parameters())
    opt = torch.optim.Adam(ps, lr=1e-3, fused=True)

    def step():
        n = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        if _finite(n, check):
            opt.step()

    return Side(model, step, _opt_state(opt))


def torch_clipnorm_adamw_default(model, check):
    """torch's own default AdamW kernel (`fused=None, foreach=None`: the for-loop kernel on a CPU,
    foreach on CUDA), against `AdamW(fused=False)`: like against like."""
    ps = list(model.parameters())
    opt = torch.optim.AdamW(ps, lr=1e-3)

    def step():
        n = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        if _finite(n, check):
            opt.step()

    return Side(model, step, _opt_state(opt))


def torch_mission(model, check, beta=0.99, growth=1.5, eps=1e-6):
    """ClipNormByEMA() (global EMA of the update, growth limit 1.5), Normalize() (per tensor), Adam()."""
    ps = list(model.parameters())
    opt = torch.optim.Adam(ps, lr=1e-3, fused=True)
    ema = [torch.zeros_like(p) for p in ps]
    prev = torch.zeros((), device=ps[0].device)  # the EMA's norm after the previous step

    def step():
        nonlocal prev
        grads = _grads(ps)
        norms = torch.stack(torch._foreach_norm(grads))
        n_u = torch.linalg.vector_norm(norms)
        if not _finite(n_u, check):
            return
        torch._foreach_lerp_(ema, grads, 1 - beta)
        n_ema = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ema)))
        limit = torch.where(prev > 0, torch.clamp(growth * prev / n_ema, max=1.0), 1.0)
        limit = torch.where(n_ema > 0, limit, 1.0)
        torch._foreach_mul_(ema, limit)
        prev = n_ema * limit
        clip = 1.0 / torch.clamp(n_u / torch.clamp(prev, min=eps), min=1.0)
        # Normalize of the clipped update: the clip cancels wherever a tensor's norm is positive
        scale = torch.where(norms > 0, 1.0 / norms, clip)
        torch._foreach_mul_(grads, scale.unbind(0))
        opt.step()

    return Side(model, step, lambda: [_opt_state(opt)(), ema, prev])


def torch_clipvalue_sgd(model, check):
    ps = list(model.parameters())
    opt = torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)

    def step():
        if check and not _finite(torch.nn.utils.get_total_norm(_grads(ps), foreach=True), True):
            return
        torch.nn.utils.clip_grad_value_(ps, 0.01, foreach=True)
        opt.step()

    return Side(model, step, _opt_state(opt))


def torch_centralize_normalize_adam(model, check):
    ps = list(model.parameters())
    opt = torch.optim.Adam(ps, lr=1e-3, fused=True)
    multi = [i for i, p in enumerate(ps) if p.numel() >= 2]

    def step():
        grads = _grads(ps)
        if check and not _finite(torch.nn.utils.get_total_norm(grads, foreach=True), True):
            return
        cg = [grads[i] for i in multi]
        torch._foreach_sub_(cg, [g.mean() for g in cg])
        norms = torch.stack(torch._foreach_norm(grads))
        torch._foreach_mul_(grads, torch.where(norms > 0, 1.0 / norms, 1.0).unbind(0))
        opt.step()

    return Side(model, step, _opt_state(opt))


def torch_zclip_adamw(model, check, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup=25):
    ps = list(model.parameters())
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    hist: list[torch.Tensor] = []
    stats: dict[str, torch.Tensor] = {}

    def step():
        grads = _grads(ps)
        g = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if not _finite(g, check):
            return
        if len(hist) < warmup:  # a Python counter: no host sync
            hist.append(g)
            thresh = torch.full((), max_grad_norm)
            if len(hist) == warmup:
                h = torch.stack(hist)
                stats["mu"], stats["var"] = h.mean(), h.var(correction=0)
        else:
            mu, var = stats["mu"], stats["var"]
            sigma = var.sqrt()
            z = (g - mu) / (sigma + eps)
            spike = z > z_thresh
            c = mu + z_thresh**2 * sigma / torch.where(spike, z, 1.0)
            x = torch.where(spike, c, g)
            new_mu = alpha * mu + (1 - alpha) * x
            stats["var"] = alpha * var + (1 - alpha) * (x - new_mu) ** 2
            stats["mu"] = new_mu
            thresh = torch.clamp(torch.where(spike, c, math.inf), max=max_grad_norm)
        torch._foreach_mul_(grads, torch.clamp(thresh / (g + eps), max=1.0))
        opt.step()

    return Side(model, step, lambda: [_opt_state(opt)(), stats])


def by_ndim(model: nn.Module) -> list[dict]:
    """Two param groups: group 0 the tensors that are not matrices (AdamW), group 1 the 2-D ones (Muon)."""
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.dim() != 2]}, {"params": [p for p in ps if p.dim() == 2]}]


def torch_muon_adamw(model, check):
    """torch.optim.Muon on the matrices, AdamW(fused) on the rest, both with torch's defaults."""
    rest, mats = (g["params"] for g in by_ndim(model))
    ps = rest + mats
    adamw = torch.optim.AdamW(rest, lr=1e-3, fused=True)
    muon = torch.optim.Muon(mats)

    def step():
        if _finite(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(_grads(ps)))), check):
            adamw.step()
            muon.step()

    return Side(model, step, lambda: [_opt_state(adamw)(), _opt_state(muon)()])


def torch_accumulate_clipnorm_adam(model, check, k=4):
    from torch.optim.adam import adam

    ps = list(model.parameters())
    acc = [torch.zeros_like(p) for p in ps]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    steps = [torch.zeros((), device=p.device) for p in ps]  # fused Adam: step counts on the params' device
    calls = [0]

    def step():
        grads = _grads(ps)
        if check and not _finite(torch.nn.utils.get_total_norm(grads, foreach=True), True):
            return
        torch._foreach_add_(acc, grads)
        calls[0] += 1
        if calls[0] % k:
            return
        torch._foreach_mul_(acc, 1.0 / k)
        torch._foreach_copy_(grads, acc)
        torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        adam(ps, grads, m, v, [], steps, fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
             weight_decay=0.0, eps=1e-8, maximize=False)
        torch._foreach_zero_(acc)

    return Side(model, step, lambda: [acc, m, v, steps])


# torchzero (an optional peer) ---------------------------------------------------------------


def torchzero():
    try:
        import torchzero as tz  # type: ignore[import-not-found]
    except Exception:
        return None
    return tz


def torchzero_side(modules: Callable[[Any], list]) -> Callable[[nn.Module], Side]:
    tz = torchzero()

    def build(model):
        cls = getattr(tz, "Modular", None) or tz.Optimizer  # the class was renamed across releases
        opt = cls(model.parameters(), *modules(tz.m))
        return Side(model, opt.step, lambda: [dict(s) for s in opt.state.values()])

    return build


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:  # pragma: no cover - imported from a checkout
        return "?"


# --------------------------------------------------------------------------- pipelines


@dataclass
class Pipeline:
    name: str
    modopt: Callable[[], list]
    torch: Callable[[nn.Module, bool], Side]
    torch_label: str
    #: the same pipeline in torchzero's modules (with its defaults), or None where it has none
    torchzero: Callable[[Any], list] | None = None
    #: optimizer calls per timed step (Accumulate(k): the k calls of one cycle)
    calls: int = 1
    #: param groups built from the model for the modopt side (None: `model.parameters()`)
    groups: Callable[[nn.Module], list[dict]] | None = None
    #: the bytes limit of one step (of a cycle, for Accumulate) in units of P, and its derivation: every
    #: state tensor (parameters included) read and written once, the gradient read once for the update
    #: and once more for each reduction that must finish before the update (the finite check included)
    limit: float | None = None
    limit_why: str = ""


PIPELINES = [
    Pipeline("ClipNorm(1.0), Adam()", lambda: [mo.ClipNorm(1.0), mo.Adam()], torch_clipnorm_adam,
             "clip_grad_norm_(foreach) + Adam(fused)",
             lambda m: [m.ClipNorm(1.0, dim="global"), m.Adam(), m.LR(1e-3)],
             limit=8, limit_why="p, m, v read and written (6P), the gradient read for the update and for its norm (2P)"),
    Pipeline("ClipNormByEMA(), Normalize(), Adam()", lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
             torch_mission, "foreach EMA clip and normalize + Adam(fused)",
             lambda m: [m.ClipNormByEMA(), m.Normalize(), m.Adam(), m.LR(1e-3)],
             limit=10, limit_why="p, m, v and the EMA read and written (8P), the gradient read for the update and "
                                 "for its norms (2P; the EMA's norm taken as it is written)"),
    Pipeline("ClipValue(0.01), SGD(0.01, momentum=0.9)",
             lambda: [mo.ClipValue(0.01), mo.SGD(lr=1e-2, momentum=0.9)], torch_clipvalue_sgd,
             "clip_grad_value_(foreach) + SGD(fused)",
             lambda m: [m.ClipValue(0.01), m.HeavyBall(0.9), m.LR(1e-2)],
             limit=6, limit_why="p and the momentum read and written (4P), the gradient read for the update and "
                                "for the finite check (2P)"),
    Pipeline("Centralize(), Normalize(), Adam()", lambda: [mo.Centralize(), mo.Normalize(), mo.Adam()],
             torch_centralize_normalize_adam, "foreach centralize and normalize + Adam(fused)",
             lambda m: [m.Centralize(), m.Normalize(), m.Adam(), m.LR(1e-3)],
             limit=9, limit_why="p, m, v read and written (6P), the gradient read for the update, for its means "
                                "(which also settle finiteness) and for the centred norms (3P)"),
    Pipeline("ZClip(), AdamW()", lambda: [mo.ZClip(), mo.AdamW()], torch_zclip_adamw,
             "foreach z-score clip + AdamW(fused)",
             limit=8, limit_why="p, m, v read and written (6P), the gradient read for the update and for its norm (2P)"),
    Pipeline("Accumulate(4), ClipNorm(1.0), Adam()", lambda: [mo.Accumulate(4), mo.ClipNorm(1.0), mo.Adam()],
             torch_accumulate_clipnorm_adam, "foreach accumulate + clip_grad_norm_ + adam(fused)",
             calls=4, limit=25, limit_why="per call the gradient read for the finite check and for the sum, the sum "
             "read and written (4 x 4P); at the end p, m, v read and written, the mean read for its norm and the "
             "update, the sum cleared (9P)"),
    # Muon on the 2-D tensors (group 1), AdamW on the rest (group 0), each with its defaults; no clip. No
    # bytes limit: the Newton-Schulz iterations' matmul operands are the same on both sides
    Pipeline("Muon() on matrices, AdamW() on the rest",
             lambda: [mo.Masked(mo.AdamW(), where=mo.Select(groups=[0])),
                      mo.Masked(mo.Muon(), where=mo.Select(groups=[1]))],
             torch_muon_adamw, "torch.optim.Muon on the matrices + AdamW(fused) on the rest", groups=by_ndim),
    # a setting: torch's own default kernel (the for-loop kernel on a CPU), the host decides the skip
    Pipeline("ClipNorm(1.0), AdamW(fused=False)", lambda: [mo.ClipNorm(1.0), mo.AdamW(fused=False)],
             torch_clipnorm_adamw_default, "clip_grad_norm_(foreach) + AdamW() (torch's default kernel)",
             limit=8, limit_why="as ClipNorm(1.0), Adam()"),
    # a setting, not a default: the clip's scale goes into the fused kernel's grad_scale (not bit-exact)
    Pipeline("ClipNorm(1.0), Adam(fold_clip=True)", lambda: [mo.ClipNorm(1.0), mo.Adam(fold_clip=True)],
             torch_clipnorm_adam, "clip_grad_norm_(foreach) + Adam(fused)",
             limit=8, limit_why="as ClipNorm(1.0), Adam(); the kernel writes the gradients back (1P) when it "
                                "unscales them"),
]
#: pipelines that also get a `nonfinite="ignore"` row (modopt and torch without the finite check)
IGNORE_ROWS = ("ClipNorm(1.0), Adam()", "ClipNormByEMA(), Normalize(), Adam()")
#: the short names docs/performance.md's tables give the pipelines (their "pipeline" column); --only takes them
LABELS = {
    "ClipNorm + Adam": "ClipNorm(1.0), Adam()",
    "mission": "ClipNormByEMA(), Normalize(), Adam()",
    "ClipValue + SGD": "ClipValue(0.01), SGD(0.01, momentum=0.9)",
    "Centralize + Normalize + Adam": "Centralize(), Normalize(), Adam()",
    "ZClip + AdamW": "ZClip(), AdamW()",
    "Accumulate + ClipNorm + Adam": "Accumulate(4), ClipNorm(1.0), Adam()",
    "Muon + AdamW": "Muon() on matrices, AdamW() on the rest",
    "ClipNorm + AdamW(fused=False)": "ClipNorm(1.0), AdamW(fused=False)",
    "ClipNorm + Adam, folded": "ClipNorm(1.0), Adam(fold_clip=True)",
}


def select_pipelines(only: str | None) -> list[int]:
    """Indices of the pipelines `--only TEXT` names: a short name of LABELS (case and spaces ignored, and
    a table's trailing note such as " (setting)") names its pipeline alone; otherwise every pipeline
    whose name or short name contains TEXT. A TEXT that matches none is an error listing the names."""
    if only is None:
        return list(range(len(PIPELINES)))
    key = "".join(only.split()).lower()
    short = {name: label for label, name in LABELS.items()}
    keys = (key, "".join(re.sub(r"\s+\([^()]*\)$", "", only).split()).lower())
    exact = [i for i, p in enumerate(PIPELINES) if "".join(short.get(p.name, "").split()).lower() in keys]
    found = exact or [i for i, p in enumerate(PIPELINES)
                      if only in p.name or key in "".join(short.get(p.name, "").split()).lower()]
    if not found:
        names = "; ".join(f"{short.get(p.name, '-')} ({p.name})" for p in PIPELINES)
        raise ValueError(f"--only {only!r} matches no pipeline; the pipelines (short name (name)) are: {names}")
    return found


# --------------------------------------------------------------------------- memory


class AllocationCounter(TorchDispatchMode):
    """Bytes of storages allocated under it and still alive; `peak` is their maximum."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr == 0 or ptr in inputs or ptr in self.live:
                continue
            self.live[ptr] = (StorageWeakRef(s), s.nbytes())
            self.current += s.nbytes()
        self.peak = max(self.peak, self.current)
        return out


# --------------------------------------------------------------------------- runner


@dataclass
class Row:
    model: str
    pipeline: str
    nonfinite: str
    modopt_ms: float
    torch_ms: float
    ratio: float  # median over repeats of each repeat's median paired ratio modopt/torch
    ratios: list[float]
    torch_label: str
    diff: float
    extra_modopt: float
    extra_torch: float
    state_modopt: float
    state_torch: float
    torchzero_ms: float | None = None
    torchzero_speedup: float | None = None  # median over repeats of torchzero/modopt paired ratios
    torchzero_speedups: list[float] = field(default_factory=list)
    params: int = 0
    tensors: int = 0
    #: one untimed step counted per side (summed over the calls of an Accumulate cycle): aten ops
    #: (views excluded), host syncs, and bytes read and written in units of the parameters' bytes
    counts: dict[str, list[float]] = field(default_factory=dict)
    #: the pipeline's bytes limit per step in P (`Pipeline.limit`), None where none is stated
    limit: float | None = None
    #: torch and Python versions the counts were made with (the Python calls depend on both)
    versions: str = ""


def _backward(side: Side, batch: tuple) -> None:
    for p in side.model.parameters():
        p.grad = None
    loss_fn(side.model, *batch).backward()


DEVICE = torch.device("cpu")  # where the models and batches live (--device)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _timed_steps(sides: dict[str, Side], batches: list[tuple], warmup: int, calls: int) -> dict[str, list[float]]:
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(len(batches) // calls):
            for n in names if i % 2 == 0 else names[::-1]:
                spent = 0.0
                for c in range(calls):
                    _backward(sides[n], batches[i * calls + c])
                    _sync()  # on CUDA: the backward done before the clock starts, the step's kernels before it stops
                    t0 = time.perf_counter()
                    sides[n].step()
                    _sync()
                    spent += time.perf_counter() - t0
                if i >= warmup:
                    times[n].append(spent)
    finally:
        if gc_was:
            gc.enable()
    return times


SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero")


class StepCounter(TorchDispatchMode):
    """Counts what runs under it: aten ops other than views, host syncs (`_local_scalar_dense`,
    `is_nonzero`) and the bytes the ops read and write (torch's fused optimizers count as writing the
    gradients only when they unscale them). The counts are a GPU's: inside it a modopt step on the CPU
    takes the device path (`modopt.core.runner.device_path`), which it otherwise reads back on
    the host; the times elsewhere in this script are this machine's default path."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.bytes = 0
        self.names: dict[str, int] = {}
        self._paths: list[Any] = []

    def __enter__(self):
        self._paths.append(runner.device_path())
        self._paths[-1].__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._paths.pop().__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        name = name if name.startswith("aten.") else "aten." + name
        if name in SYNC_OPS:
            self.syncs += 1
        if torch.Tag.view_copy in func.tags or func.is_view:
            return out
        self.ops += 1
        self.names[name] = self.names.get(name, 0) + 1
        read = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        written: dict[int, torch.Tensor] = {}
        for i, a in enumerate(func._schema.arguments):  # what the op updates in place
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else (kwargs or {}).get(a.name)
                if a.name == "grads" and (kwargs or {}).get("grad_scale") is None:
                    continue  # torch's fused optimizers write the gradients only to unscale them
                written.update((id(t), t) for t in tree_leaves(v) if isinstance(t, torch.Tensor))
        written.update((id(t), t) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and id(t) not in read)
        moved = sum(t.numel() * t.element_size() for t in [*read.values(), *written.values()])
        self.bytes += moved
        return out


def _extra_peak(side: Side, batch: tuple) -> int:
    _backward(side, batch)
    counter = AllocationCounter()
    with counter:
        side.step()
    return counter.peak


def _counted(side: Side, batch: tuple) -> StepCounter:
    _backward(side, batch)
    counter = StepCounter()
    with counter:
        side.step()
    return counter


#: untimed cycles before the counted ones (`count_row`); ZClip's careful loop branches on a Python counter
#: through its 25-step warm-up, so its rows count the steady state after it
COUNT_AFTER = 3
COUNT_AFTER_OVERRIDE = {"ZClip(), AdamW()": 25}


def versions() -> str:
    return f"torch {torch.__version__}, Python {sys.version_info[0]}.{sys.version_info[1]}"


def count_row(pipe: Pipeline, model_name: str, nonfinite: str | None, quick: bool = False) -> dict[str, list[float]]:
    """The deterministic columns of a row, per side: `[ops, syncs, bytes in P, Python calls]` of one cycle
    (the `pipe.calls` steps of it summed). Fresh sides from seed 0 take `COUNT_AFTER` untimed cycles on shared
    batches; then one cycle runs under `call_counts.count` (Python calls in the library's own files:
    modopt's for modopt, torch's for torch; the default path, the one timed on this machine), one untimed on
    the device path, and the next under `StepCounter` (aten ops, host syncs and bytes of the device path,
    what a GPU runs: a steady cycle of it, as a GPU runs every step; a CPU's host path may keep a value in
    another form, which the first device step after it converts once). They do not depend on the machine,
    only on the torch and Python versions (`versions()`)."""
    check = nonfinite != "ignore"
    torch.manual_seed(0)
    base, make_batch = build_model(model_name, quick)
    base.to(DEVICE)
    builders: dict[str, Callable[[nn.Module], Side]] = {
        "modopt": modopt_side(pipe.modopt, nonfinite, pipe.groups), "torch": lambda m: pipe.torch(m, check)}
    sides = {n: b(copy.deepcopy(base)) for n, b in builders.items()}
    roots = {"modopt": os.path.dirname(mo.__file__), "torch": os.path.dirname(torch.__file__)}
    g = torch.Generator().manual_seed(1000)
    after = COUNT_AFTER_OVERRIDE.get(pipe.name, COUNT_AFTER)
    batches = [tuple(t.to(DEVICE) for t in make_batch(g)) for _ in range((after + 3) * pipe.calls)]
    pbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    out: dict[str, list[float]] = {}
    for n, side in sides.items():
        for b in batches[:after * pipe.calls]:
            _backward(side, b)
            side.step()
        calls = 0
        for b in batches[after * pipe.calls:(after + 1) * pipe.calls]:
            _backward(side, b)
            calls += python_calls(side.step, roots[n]).calls
        with runner.device_path():
            for b in batches[(after + 1) * pipe.calls:(after + 2) * pipe.calls]:
                _backward(side, b)
                side.step()
        got = [_counted(side, b) for b in batches[(after + 2) * pipe.calls:]]
        out[n] = [sum(c.ops for c in got), sum(c.syncs for c in got), sum(c.bytes for c in got) / pbytes, calls]
    return out


def run_one(pipe: Pipeline, model_name: str, nonfinite: str | None, args) -> Row:
    check = nonfinite != "ignore"
    ratios, speedups, t_mo, t_to, t_tz, diffs = [], [], [], [], [], []
    mem: dict[str, float] = {}
    state: dict[str, float] = {}
    for rep in range(args.repeats):
        torch.manual_seed(rep)
        base, make_batch = build_model(model_name, args.quick)
        base.to(DEVICE)
        builders: dict[str, Callable[[nn.Module], Side]] = {
            "modopt": modopt_side(pipe.modopt, nonfinite, pipe.groups),
            "torch": lambda m: pipe.torch(m, check),
        }
        if pipe.torchzero is not None and torchzero() is not None and check and not model_name.startswith("tensors-"):
            builders["torchzero"] = torchzero_side(pipe.torchzero)
        sides = {n: b(copy.deepcopy(base)) for n, b in builders.items()}
        g = torch.Generator().manual_seed(1000 + rep)
        warmup, steps = (args.warmup, args.steps) if args.quick else steps_for(model_name, args.steps, args.warmup)
        batches = [tuple(t.to(DEVICE) for t in make_batch(g)) for _ in range((warmup + steps) * pipe.calls)]
        times = _timed_steps(sides, batches, warmup, pipe.calls)
        ratios.append(statistics.median(a / b for a, b in zip(times["modopt"], times["torch"])))
        t_mo.append(statistics.median(times["modopt"]))
        t_to.append(statistics.median(times["torch"]))
        if "torchzero" in times:
            speedups.append(statistics.median(z / a for a, z in zip(times["modopt"], times["torchzero"])))
            t_tz.append(statistics.median(times["torchzero"]))
        ps_mo, ps_to = sides["modopt"].params, sides["torch"].params
        scale = max(p.abs().max().item() for p in ps_to) or 1.0
        diffs.append(max((a - b).abs().max().item() for a, b in zip(ps_mo, ps_to)) / scale)
        if rep == 0:
            pbytes = sum(p.numel() * p.element_size() for p in ps_to)
            for n in ("modopt", "torch"):
                peak = max(_extra_peak(sides[n], batches[c]) for c in range(pipe.calls))
                mem[n] = 100.0 * peak / pbytes
                state[n] = 100.0 * sides[n].state_bytes() / pbytes
    counts = count_row(pipe, model_name, nonfinite, args.quick)
    params = list(base.parameters())
    return Row(
        model=model_name, pipeline=pipe.name, nonfinite=nonfinite or "skip (default)",
        modopt_ms=1e3 * statistics.median(t_mo), torch_ms=1e3 * statistics.median(t_to),
        ratio=statistics.median(ratios), ratios=ratios, torch_label=pipe.torch_label + (", stepping only when the gradients' norm is finite" if check else ""),
        diff=max(diffs), extra_modopt=mem["modopt"], extra_torch=mem["torch"],
        state_modopt=state["modopt"], state_torch=state["torch"],
        torchzero_ms=1e3 * statistics.median(t_tz) if t_tz else None,
        torchzero_speedup=statistics.median(speedups) if speedups else None, torchzero_speedups=speedups,
        params=sum(p.numel() for p in params), tensors=len(params), counts=counts, limit=pipe.limit,
        versions=versions(),
    )


def format_table(rows: list[Row]) -> str:
    has_tz = any(r.torchzero_ms is not None for r in rows)
    head = ["model", "pipeline", "nonfinite", "modopt ms", "torch ms", "modopt/torch", "repeats"]
    if has_tz:
        head += ["torchzero ms", "torchzero/modopt"]
    head += ["ops/syncs/bytes/calls modopt", "ops/syncs/bytes/calls torch", "bytes limit"]
    head += ["extra mem modopt", "extra mem torch", "state modopt", "state torch", "diff"]
    lines = [head]
    for r in rows:
        line = [r.model, r.pipeline, r.nonfinite, f"{r.modopt_ms:.2f}", f"{r.torch_ms:.2f}", f"{r.ratio:.3f}x",
                " ".join(f"{x:.3f}" for x in r.ratios)]
        if has_tz:
            line += [f"{r.torchzero_ms:.2f}" if r.torchzero_ms is not None else "-",
                     f"{r.torchzero_speedup:.2f}x" if r.torchzero_speedup is not None else "-"]
        line += [_counts(r.counts.get("modopt")), _counts(r.counts.get("torch")),
                 "-" if r.limit is None else f"{r.limit:g}P"]
        line += [f"{r.extra_modopt:.1f}%", f"{r.extra_torch:.1f}%", f"{r.state_modopt:.0f}%", f"{r.state_torch:.0f}%",
                 f"{r.diff:.1e}"]
        lines.append(line)
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    models = {r.model: f"- {r.model}: {r.params / 1e6:.2f}M parameters in {r.tensors} tensors" for r in rows}
    notes = list(models.values())
    notes += sorted({f"- {r.pipeline} ({r.nonfinite}): the torch side is {r.torch_label}" for r in rows})
    why = {p.name: p.limit_why for p in PIPELINES if p.limit is not None}
    notes += [f"- bytes limit of {name}: {why[name]}" for name in dict.fromkeys(r.pipeline for r in rows) if name in why]
    if torchzero() is None:
        notes.append("- torchzero is not importable: no torchzero column")
    return "\n".join(out + [""] + notes)


def _counts(c: list[float] | None) -> str:
    """`ops / syncs / bytes / Python calls` of one side's counted cycle (`count_row`)."""
    return "-" if not c else f"{int(c[0])} / {int(c[1])} / {c[2]:.1f}P / {int(c[3])}"


#: pipelines that are settings, not defaults (the docs tables mark them)
SETTINGS = ("ClipNorm(1.0), AdamW(fused=False)", "ClipNorm(1.0), Adam(fold_clip=True)")
#: the docs tables (`--docs`): each is preceded by a marker line naming it and the versions the counts were
#: made with; tests/test_bench.py finds the tables by it and checks every count column against `count_row`
DOCS_MARKER = "<!-- bench.py --docs: table {kind}; counts made with {versions} -->"
DOCS_COUNTS = ("ops / syncs / bytes / Python calls a step, modopt", "the same, torch")


def short_name(pipeline: str) -> str:
    short = {name: label for label, name in LABELS.items()}.get(pipeline, pipeline)
    return short + (" (setting)" if pipeline in SETTINGS else "")


def model_label(model: str) -> str:
    m = re.fullmatch(r"tensors-(\d+)", model)
    return m.group(1) if m else {"mlp": "MLP"}.get(model, model)


def docs_table(rows: list[Row], kind: str) -> str:
    """The table docs/performance.md publishes, from the rows: `main` (the default rows of the bench
    models), `ignore` (their `nonfinite="ignore"` rows) or `sweep` (the `tensors-N` models)."""
    def is_sweep(r: Row) -> bool:
        return r.model.startswith("tensors-")

    ignore = [r for r in rows if r.nonfinite == "ignore"]  # (the sweep has none: --sweep leaves them out)
    chosen = {"sweep": [r for r in rows if is_sweep(r) and r not in ignore],
              "main": [r for r in rows if not is_sweep(r) and r not in ignore],
              "ignore": [r for r in ignore if not is_sweep(r)]}[kind]
    if not chosen:
        return ""
    tz = kind == "main" and any(r.torchzero_speedup is not None for r in chosen)
    head = ["pipeline", f"tensors x {SWEEP_SIZE}" if kind == "sweep" else "model", "modopt / torch ms",
            "modopt/torch (repeats)"] + (["torchzero/modopt"] if tz else []) + list(DOCS_COUNTS)
    head += ["bytes limit"] if kind != "ignore" else []
    lines = [DOCS_MARKER.format(kind=kind, versions=chosen[0].versions or versions()),
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in chosen:
        cells = [short_name(r.pipeline), model_label(r.model), f"{r.modopt_ms:.2f} / {r.torch_ms:.2f}",
                 f"{r.ratio:.3f}x ({', '.join(f'{x:.3f}' for x in r.ratios)})"]
        if tz:
            cells.append("-" if r.torchzero_speedup is None else f"{r.torchzero_speedup:.2f}x")
        cells += [_counts(r.counts.get("modopt")), _counts(r.counts.get("torch"))]
        if kind != "ignore":
            cells.append("-" if r.limit is None else f"{r.limit:g}P")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def counts_table(chosen: list[int], models: list[str], ignore_rows: bool, quick: bool = False) -> str:
    """The deterministic columns alone (`--counts`: no timing), as docs/performance.md publishes them."""
    head = ["pipeline", "model", "nonfinite", *DOCS_COUNTS, "bytes limit"]
    lines = [DOCS_MARKER.format(kind="counts", versions=versions()), "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for index in chosen:
        pipe = PIPELINES[index]
        for nf in [None] + (["ignore"] if ignore_rows and pipe.name in IGNORE_ROWS else []):
            for model in models:
                got = count_row(pipe, model, nf, quick)
                lines.append("| " + " | ".join([short_name(pipe.name), model_label(model), nf or "skip (default)",
                                                _counts(got["modopt"]), _counts(got["torch"]),
                                                "-" if pipe.limit is None else f"{pipe.limit:g}P"]) + " |")
    return "\n".join(lines)


def parse_docs_tables(text: str) -> dict[str, tuple[str, list[dict[str, str]]]]:
    """The tables `docs_table` wrote into a page: kind -> (versions, rows as {column: cell})."""
    out = {}
    marker = re.compile(re.escape(DOCS_MARKER).replace(r"\{kind\}", r"(\w+)").replace(r"\{versions\}", r"(.+?)"))
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = marker.fullmatch(line.strip())
        if not m:
            continue
        head = [c.strip() for c in lines[i + 1].strip().strip("|").split("|")]
        rows = []
        for row in lines[i + 3:]:
            if not row.startswith("|"):
                break
            rows.append(dict(zip(head, (c.strip() for c in row.strip().strip("|").split("|")))))
        out[m.group(1)] = (m.group(2), rows)
    return out


def row_key(kind: str, cells: dict[str, str]) -> tuple[Pipeline, str, str | None]:
    """The (pipeline, model, nonfinite) a published row was made from."""
    name = re.sub(r" \(setting\)$", "", cells["pipeline"])
    pipe = next(p for p in PIPELINES if p.name == LABELS.get(name, name))
    model = cells.get("model")
    model = f"tensors-{cells[f'tensors x {SWEEP_SIZE}']}" if model is None else {"MLP": "mlp"}.get(model, model)
    model = re.sub(r"^(\d+)$", r"tensors-\1", model)
    ignore = kind == "ignore" or cells.get("nonfinite") == "ignore"
    return pipe, model, "ignore" if ignore else None


def run_here(index: int, model: str, nonfinite: str | None, args) -> Row:
    """`run_one` in this process."""
    return run_one(PIPELINES[index], model, nonfinite, args)


def run_isolated(index: int, model: str, nonfinite: str | None, args) -> Row:
    """`run_one` in a fresh Python process (this script with `--row`)."""
    cmd = [sys.executable, __file__, "--row", str(index), model, nonfinite or "default",
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    if args.quick:
        cmd.append("--quick")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device != "cpu":
        cmd += ["--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark row {PIPELINES[index].name} / {model} failed:\n{done.stderr}")
    return Row(**json.loads(done.stdout.strip().splitlines()[-1]))


# --------------------------------------------------------------------------- compiled rows (--compiled)

#: the pipelines of the compiled rows; the hand-written compiled step exists for ClipNorm + Adam only
COMPILED_PIPELINES = ("ClipNorm(1.0), Adam()", "ClipNormByEMA(), Normalize(), Adam()", "ZClip(), AdamW()")


def compiled_row(pipe: Pipeline, model_name: str, args) -> dict[str, Any]:
    """One compiled row: eager modopt, `mo.compile_step(opt, guards="own")` and (ClipNorm + Adam) the same
    algorithm hand-written per tensor and compiled (`compile_whole.hand_compiled`), each training its copy
    of the model on the same batches (`_timed_steps`, after the graphs are built in the warm-up). Per
    repeat the median step time of each side; the ratios are medians of the per-iteration ratios. The
    Python calls are one more step's calls into modopt's files (`call_counts.count`); ops, syncs and
    bytes are eager modopt's (a dispatch mode makes dynamo run a compiled step eagerly: not countable)."""
    from compile_whole import hand_compiled

    torch.manual_seed(0)
    base, make_batch = build_model(model_name, args.quick)
    builders: dict[str, Callable[[nn.Module], Side]] = {"eager": modopt_side(pipe.modopt, None, pipe.groups)}

    def compiled(model):
        side = modopt_side(pipe.modopt, None, pipe.groups)(model)
        side.step = mo.compile_step(side.step.__self__, guards="own")
        return side

    builders["compiled"] = compiled
    if pipe.name == "ClipNorm(1.0), Adam()":
        builders["hand compiled"] = lambda m: Side(m, hand_compiled(list(m.parameters())), lambda: [])
    ratio_eager, ratio_hand, ms = [], [], {n: [] for n in builders}
    warm = max(args.warmup, 3)  # (call 1 eager, call 2 dynamo's guarded graph, call 3 the guard-free one)
    for rep in range(args.repeats):
        sides = {n: b(copy.deepcopy(base)) for n, b in builders.items()}
        g = torch.Generator().manual_seed(rep)
        batches = [make_batch(g) for _ in range(warm + args.steps)]
        times = _timed_steps(sides, batches, warm, 1)
        for n in sides:
            ms[n].append(statistics.median(times[n]) * 1e3)
        ratio_eager.append(statistics.median(c / e for c, e in zip(times["compiled"], times["eager"])))
        if "hand compiled" in times:
            ratio_hand.append(statistics.median(c / h for c, h in zip(times["compiled"], times["hand compiled"])))
    counts = count_row(pipe, model_name, None, args.quick)["modopt"]
    side = sides["compiled"]
    _backward(side, batches[0])
    calls = python_calls(side.step, os.path.dirname(mo.__file__)).calls
    return {"pipeline": pipe.name, "model": model_name, "ms": {n: statistics.median(v) for n, v in ms.items()},
            "vs_eager": statistics.median(ratio_eager), "vs_eager_repeats": ratio_eager,
            "vs_hand": statistics.median(ratio_hand) if ratio_hand else None, "vs_hand_repeats": ratio_hand,
            "eager_counts": counts, "compiled_python_calls": calls}


def compiled_table(rows: list[dict[str, Any]]) -> str:
    """The compiled rows as docs/performance.md publishes them (`--compiled --docs`)."""
    short = {name: label for label, name in LABELS.items()}
    out = ["| pipeline | model | eager / compiled / hand compiled ms | compiled / eager (repeats) | "
           "compiled / hand compiled (repeats) | Python calls a step, compiled (eager) | "
           "ops / syncs / bytes, eager modopt |",
           "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        m = r["ms"]
        hand = f"{r['vs_hand']:.3f}x ({', '.join(f'{x:.3f}' for x in r['vs_hand_repeats'])})" if r["vs_hand"] else "-"
        c = r["eager_counts"]
        out.append(f"| {short.get(r['pipeline'], r['pipeline'])} | {model_label(r['model'])} | "
                   f"{m['eager']:.2f} / {m['compiled']:.2f} / {m['hand compiled']:.2f} |"
                   if "hand compiled" in m else
                   f"| {short.get(r['pipeline'], r['pipeline'])} | {model_label(r['model'])} | "
                   f"{m['eager']:.2f} / {m['compiled']:.2f} / - |")
        out[-1] += (f" {r['vs_eager']:.3f}x ({', '.join(f'{x:.3f}' for x in r['vs_eager_repeats'])}) | {hand} | "
                    f"{r['compiled_python_calls']} ({c[3]:.0f}) | {c[0]:.0f} / {c[1]:.0f} / {c[2]:.1f}P |")
    return "\n".join(out)


def run_peers(args) -> int:
    """`--peers`: modopt against the peers' own optimizers (`benchmarks/peers.py`'s rows, run by its
    `run_rows`), its defaults where not given (20 timed steps, 3 repeats, 1 thread); `--docs` adds the
    table docs/performance.md publishes."""
    import peers  # (here, not at the top: peers.py imports this module)

    args.steps = args.steps if args.steps is not None else (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    torch.set_num_threads(args.threads or 1)
    print(peers.header(args), flush=True)
    rows = peers.run_rows(args.peers, args.models, args, peers._report)
    print(peers.format_table(rows))
    if args.docs:
        print("\n" + peers.docs_table(rows, versions()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="modopt bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 timed steps, 1 repeat (a smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 30; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="independent repeats (default 3; quick 1)")
    ap.add_argument("--models", nargs="+", choices=["mlp", "transformer"], default=["mlp", "transformer"])
    ap.add_argument("--only", default=None, help="only the pipeline with this short name (docs/performance.md's "
                    "'pipeline' column, e.g. 'ClipNorm + Adam', 'mission'), or those whose name contains this text")
    ap.add_argument("--no-ignore-rows", action="store_true", help='skip the nonfinite="ignore" rows')
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="where the models, batches and optimizers live (default cpu; "
                    "e.g. cuda: each timed step is then bracketed by torch.cuda.synchronize)")
    ap.add_argument("--sweep", action="store_true", help="instead: the tensor-count sweep, N tensors of "
                    f"{SWEEP_SIZE} elements for each N of --tensors, the pipelines {', '.join(SWEEP_PIPELINES)}")
    ap.add_argument("--tensors", type=int, nargs="+", default=list(SWEEP_TENSORS),
                    help=f"the sweep's tensor counts (default {' '.join(map(str, SWEEP_TENSORS))})")
    ap.add_argument("--docs", action="store_true", help="also print the tables as docs/performance.md publishes "
                    "them (tests/test_bench.py checks their count columns against what the step counts now)")
    ap.add_argument("--counts", action="store_true", help="instead: only the count columns (ops, syncs, bytes, "
                    "Python calls per step, each side), untimed, as the table docs/performance.md publishes")
    ap.add_argument("--compiled", action="store_true", help="instead: the compiled rows, eager modopt against "
                    "mo.compile_step(opt, guards='own') and a hand-written compiled step, in this process")
    ap.add_argument("--peers", nargs="*", default=None, metavar="METHOD", help="instead: modopt against the "
                    "peers' own optimizers (benchmarks/peers.py: StableSPAM, SPAM, AdaGC against pytorch_optimizer's; "
                    "'AdamW+clip (heavyball)' where heavyball is installed), "
                    "the methods named or all; 20 timed steps, 3 repeats, 1 thread unless given")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    ap.add_argument("--in-process", action="store_true",
                    help="run every row in this process (default: each in a fresh one; --quick runs in process)")
    ap.add_argument("--row", nargs=3, metavar=("INDEX", "MODEL", "NONFINITE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peers is not None:
        import peers  # (see run_peers)

        unknown = sorted(set(args.peers) - {p.name for p in peers.PEERS})
        if unknown:
            ap.error(f"--peers: no peer row for {', '.join(unknown)}; the rows: {', '.join(p.name for p in peers.PEERS)}")
        return run_peers(args)
    try:
        chosen = select_pipelines(args.only)
    except ValueError as e:
        ap.error(str(e))
    if args.sweep:
        chosen = [i for i in chosen if PIPELINES[i].name in SWEEP_PIPELINES]
        if not chosen:
            ap.error(f"--sweep runs {'; '.join(SWEEP_PIPELINES)}: --only {args.only!r} names none of them")
        args.models = [f"tensors-{n}" for n in args.tensors]
        args.no_ignore_rows = True
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    global DEVICE
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device!r}: torch {torch.__version__} sees no CUDA device here")
    DEVICE = device  # (only a device that is there: a refused one leaves the module as it was)
    if args.row:  # one row, in a process of its own: print it as JSON
        index, model, nonfinite = args.row
        row = run_one(PIPELINES[int(index)], model, None if nonfinite == "default" else nonfinite, args)
        print(json.dumps(asdict(row)))
        return 0
    if args.counts:
        print(counts_table(chosen, args.models, not args.no_ignore_rows, args.quick))
        return 0
    if args.compiled:
        import warnings
        warnings.filterwarnings("ignore")
        crows = [compiled_row(PIPELINES[i], m, args) for i in chosen if PIPELINES[i].name in COMPILED_PIPELINES
                 for m in args.models]
        print(compiled_table(crows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(crows, f, indent=1)
        return 0
    isolate = not (args.in_process or args.quick)
    tz = torchzero()
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"modopt bench: torch {torch.__version__}, {where}, "
          f"{args.repeats} repeat(s) of {args.steps} timed steps after {args.warmup} warm-up"
          f"{f' (x {SWEEP_EVEN}/N at N < {SWEEP_EVEN} tensors)' if args.sweep and not args.quick else ''}"
          f"{', torchzero ' + _version('torchzero') if tz else ''}{', rows in separate processes' if isolate else ''}"
          f"{' (quick)' if args.quick else ''}",
          flush=True)
    rows: list[Row] = []
    run = run_isolated if isolate else run_here
    for index, pipe in enumerate(PIPELINES):
        if index not in chosen:
            continue
        variants = [None] + (["ignore"] if pipe.name in IGNORE_ROWS and not args.no_ignore_rows else [])
        for nonfinite in variants:
            for model in args.models:
                rows.append(run(index, model, nonfinite, args))
                r = rows[-1]
                tz_part = f", torchzero/modopt {r.torchzero_speedup:.2f}x" if r.torchzero_speedup else ""
                print(f"  {model:11s} {pipe.name} [{r.nonfinite}]: modopt/torch {r.ratio:.3f}x{tz_part}",
                      file=sys.stderr, flush=True)
    print(format_table(rows))
    if args.docs:
        for kind in ("main", "ignore", "sweep"):
            table = docs_table(rows, kind)
            if table:
                print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
