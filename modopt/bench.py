"""Speed and memory of modopt pipelines, side by side with hand-written torch.

`python -m modopt.bench` (also `modopt bench` and `benchmarks/run.py`).

For every pipeline and model, two (three with `torchzero` installed)
optimizers step the same parameters with the same gradient sequence:

* **modopt**: `mo.Modular(params, *pipeline)`;
* **torch**: the same algorithm written by hand with torch: `torch.optim`'s
  fused kernels plus `torch.nn.utils` clipping or `torch._foreach_*` ops;
* **torchzero** (only when it is importable): its equivalent modules.

Timing: the optimizers step **interleaved in one process** (A B A B ..., the
order alternating every step), each step timed alone with
`time.perf_counter`; the gradient is copied into `.grad` before each step
outside the timed region. After `--warmup` untimed steps, the table reports
the median step time of each side and the **median of the per-step ratios**
modopt / torch over `--steps` steps (a paired statistic: slow phases of the
machine hit both sides of a pair). For `Accumulate(k)` a timed step is the
`k` calls of one accumulation cycle.

Memory: `extra` is the peak, during one steady-state step, of the bytes of
tensors the step allocated and still holds, as a percentage of the parameter
bytes. It is measured in a separate, untimed step under a
`TorchDispatchMode` that sees every aten op: each output whose storage is new
(not an input of the op, not already counted) is counted by its storage bytes
until the storage is freed (tracked with a storage weak reference, checked
before every op). Kernel-internal scratch inside one op (for instance inside
torch's fused Adam) is invisible to it; allocations of both sides are counted
the same way. `state` is the bytes of persistent optimizer state (every
tensor in `opt.state` and modopt's transform store) as a percentage of the
parameter bytes. `tracemalloc` cannot see tensor memory and torch's CPU
allocator keeps no statistics, hence the dispatch-level count; on CUDA the
allocator's `max_memory_allocated` would give the same figure.

`agree` is the largest difference between the modopt and torch parameters
after the run, relative to the largest parameter magnitude: it shows that the
hand-written torch code computes the same algorithm.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import modopt as mo

# --------------------------------------------------------------------------- models


def model_shapes(name: str, quick: bool) -> list[tuple[int, ...]]:
    """Parameter shapes of the benchmark models (weights and biases of linear layers)."""
    if name == "mlp5m":  # ~5.3M parameters in 8 tensors
        dims = [64, 128, 64, 10] if quick else [1024, 2048, 1024, 1024, 10]
        layers = list(zip(dims[:-1], dims[1:]))
    elif name == "small300":  # 300 small tensors (150 layers), ~350k parameters
        layers = [(8, 8)] * 20 if quick else [(48, 48)] * 150
    else:  # pragma: no cover - argparse restricts the names
        raise ValueError(name)
    shapes: list[tuple[int, ...]] = []
    for fan_in, fan_out in layers:
        shapes += [(fan_out, fan_in), (fan_out,)]
    return shapes


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.05) for s in shapes]


def make_grads(shapes, n_sets: int = 3, seed: int = 1) -> list[list[torch.Tensor]]:
    """Gradient sets cycled through the run; the last one is a spike (5x larger)."""
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for k in range(n_sets):
        scale = 5.0 if k == n_sets - 1 else 1.0
        sets.append([torch.randn(s, generator=gen) * (0.01 * scale) for s in shapes])
    return sets


# --------------------------------------------------------------------------- sides


class Side:
    """One optimizer under test: `step()` plus what it holds."""

    def __init__(self, params: list[torch.nn.Parameter], step: Callable[[], Any], state: Callable[[], list]):
        self.params, self.step, self.state = params, step, state

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


def modopt_side(*transforms: mo.Transform, **kw: Any) -> Callable[[list], Side]:
    def build(params):
        opt = mo.Modular(params, *transforms, nonfinite="ignore", **kw)
        return Side(params, opt.step, _opt_state(opt))

    return build


# hand-written torch building blocks (foreach ops, no host sync) --------------------


def _grads(params):
    return [p.grad for p in params]


def _clip_norm_(grads, max_norm, total=None, eps=1e-6):
    """torch.nn.utils.clip_grad_norm_'s math on a list of tensors; returns the total norm."""
    if total is None:
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + eps), max=1.0))
    return total


def torch_clipnorm_adam(params):
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return Side(params, step, _opt_state(opt))


def torch_clipvalue_sgd(params):
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)

    def step():
        torch.nn.utils.clip_grad_value_(params, 0.01, foreach=True)
        opt.step()

    return Side(params, step, _opt_state(opt))


def torch_centralize_normalize_adam(params):
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    multi = [i for i, p in enumerate(params) if p.numel() >= 2]

    def step():
        grads = _grads(params)
        cg = [grads[i] for i in multi]
        torch._foreach_sub_(cg, [g.mean() for g in cg])
        norms = torch.stack(torch._foreach_norm(grads))
        scale = torch.where(norms > 0, 1.0 / norms, 1.0)
        torch._foreach_mul_(grads, scale.unbind(0))
        opt.step()

    return Side(params, step, _opt_state(opt))


def torch_emaclip_normalize_adam(params, beta=0.99, growth=1.5, eps=1e-6):
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    ema = [torch.zeros_like(p) for p in params]
    prev = torch.zeros(())  # norm of the EMA after the previous step

    def step():
        nonlocal prev
        grads = _grads(params)
        torch._foreach_lerp_(ema, grads, 1 - beta)
        n_ema = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ema)))
        limit = torch.where(prev > 0, torch.clamp(growth * prev / n_ema, max=1.0), 1.0)
        limit = torch.where(n_ema > 0, limit, 1.0)
        torch._foreach_mul_(ema, limit)
        prev = n_ema * limit
        norms = torch.stack(torch._foreach_norm(grads))
        n_u = torch.linalg.vector_norm(norms)
        clip = 1.0 / torch.clamp(n_u / torch.clamp(prev, min=eps), min=1.0)
        # Normalize (scope="tensor") of the clipped update: the clip cancels where a norm is positive
        scale = torch.where(norms > 0, 1.0 / norms, clip)
        torch._foreach_mul_(grads, scale.unbind(0))
        opt.step()

    return Side(params, step, lambda: [_opt_state(opt)(), ema, prev])


def torch_zclip_adamw(params, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup=25):
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    hist: list[torch.Tensor] = []
    stats: dict[str, torch.Tensor] = {}

    def step():
        grads = _grads(params)
        g = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if len(hist) < warmup:  # Python counter: no host sync
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

    return Side(params, step, lambda: [_opt_state(opt)(), stats])


def torch_accumulate_clipnorm_adam(params, k=4):
    from torch.optim.adam import adam

    acc = [torch.zeros_like(p) for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    calls = [0]

    def step():
        torch._foreach_add_(acc, _grads(params))
        calls[0] += 1
        if calls[0] % k:
            return
        torch._foreach_mul_(acc, 1.0 / k)
        _clip_norm_(acc, 1.0)
        adam(params, acc, m, v, [], steps, fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
             weight_decay=0.0, eps=1e-8, maximize=False)
        torch._foreach_zero_(acc)

    return Side(params, step, lambda: [acc, m, v, steps])


# torchzero (optional peer) -------------------------------------------------------------


def _torchzero():
    try:
        import torchzero as tz  # type: ignore[import-not-found]
    except Exception:
        return None
    return tz


def torchzero_side(make_modules: Callable[[Any], list]) -> Callable[[list], Side] | None:
    tz = _torchzero()
    if tz is None:
        return None

    def build(params):
        cls = getattr(tz, "Modular", None) or tz.Optimizer  # the class was renamed across releases
        opt = cls(params, *make_modules(tz.m))

        def state():
            return [dict(s) for s in opt.state.values()]

        return Side(params, opt.step, state)

    return build


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    needs: tuple[str, ...]
    modopt: Callable[[], Callable[[list], Side]]
    torch: Callable[[list], Side]
    torch_label: str
    torchzero: Callable[[Any], list] | None = None
    #: optimizer calls per timed step (Accumulate(k): a step is the k calls of one cycle)
    calls: int = 1


def cases() -> list[Case]:
    return [
        Case("ClipNorm(1.0)+Adam", ("ClipNorm", "Adam"),
             lambda: modopt_side(mo.ClipNorm(1.0), mo.Adam(lr=1e-3)),
             torch_clipnorm_adam, "clip_grad_norm_(foreach) + Adam(fused)",
             lambda m: [m.ClipNorm(1.0, dim="global"), m.Adam(), m.LR(1e-3)]),
        Case("ClipValue(0.01)+SGD(momentum=0.9)", ("ClipValue", "SGD"),
             lambda: modopt_side(mo.ClipValue(0.01), mo.SGD(lr=1e-2, momentum=0.9)),
             torch_clipvalue_sgd, "clip_grad_value_(foreach) + SGD(fused)",
             lambda m: [m.ClipValue(0.01), m.HeavyBall(0.9), m.LR(1e-2)]),
        Case("Centralize+Normalize+Adam", ("Centralize", "Normalize", "Adam"),
             lambda: modopt_side(mo.Centralize(), mo.Normalize(), mo.Adam(lr=1e-3)),
             torch_centralize_normalize_adam, "foreach centralize/normalize + Adam(fused)",
             lambda m: [m.Centralize(), m.Normalize(), m.Adam(), m.LR(1e-3)]),
        Case("ClipNormByEMA+Normalize+Adam", ("ClipNormByEMA", "Normalize", "Adam"),
             lambda: modopt_side(mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-3)),
             torch_emaclip_normalize_adam, "foreach EMA clip/normalize + Adam(fused)",
             lambda m: [m.ClipNormByEMA(tensorwise=False), m.Normalize(), m.Adam(), m.LR(1e-3)]),
        Case("ZClip+AdamW", ("ZClip", "AdamW"),
             lambda: modopt_side(mo.ZClip(), mo.AdamW(lr=1e-3)),
             torch_zclip_adamw, "foreach z-score clip + AdamW(fused)"),
        Case("Accumulate(4)+ClipNorm(1.0)+Adam", ("Accumulate", "ClipNorm", "Adam"),
             lambda: modopt_side(mo.Accumulate(4), mo.ClipNorm(1.0), mo.Adam(lr=1e-3)),
             torch_accumulate_clipnorm_adam, "foreach accumulate + clip + adam(fused)", calls=4),
    ]


# --------------------------------------------------------------------------- memory


class AllocationCounter(TorchDispatchMode):
    """Counts bytes of storages allocated under it and still alive; `peak` is the maximum."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
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


def extra_peak_bytes(side: Side) -> int:
    counter = AllocationCounter()
    with counter:
        side.step()
    return counter.peak


# --------------------------------------------------------------------------- runner


@dataclass
class Row:
    model: str
    pipeline: str
    modopt_ms: float
    torch_ms: float
    ratio: float
    torch_label: str
    extra_modopt: float  # % of parameter bytes
    extra_torch: float
    state_modopt: float
    state_torch: float
    agree: float
    torchzero_ms: float | None = None
    torchzero_ratio: float | None = None
    note: str = ""
    extras: dict = field(default_factory=dict)


def _load(params, grads):
    torch._foreach_copy_([p.grad for p in params], grads)


def run_case(case: Case, model: str, quick: bool, steps: int, warmup: int) -> Row:
    shapes = model_shapes(model, quick)
    grad_sets = make_grads(shapes)
    builders = [("modopt", case.modopt()), ("torch", case.torch)]
    tz_build = torchzero_side(case.torchzero) if case.torchzero else None
    if tz_build is not None:
        builders.append(("torchzero", tz_build))
    sides: dict[str, Side] = {}
    note = ""
    for name, build in builders:
        params = make_params(shapes)
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            sides[name] = build(params)
        except Exception as e:  # a peer without the module: report, keep going
            if name != "torchzero":
                raise
            note = f"torchzero: {type(e).__name__}: {e}"[:120]
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(warmup + steps):
            grads = grad_sets[i % len(grad_sets)]
            order = names if i % 2 == 0 else names[::-1]
            for n in order:
                side = sides[n]
                spent = 0.0
                for _ in range(case.calls):
                    _load(side.params, grads)
                    t0 = time.perf_counter()
                    side.step()
                    spent += time.perf_counter() - t0
                if i >= warmup:
                    times[n].append(spent)
    finally:
        if gc_was:
            gc.enable()
    scale = max(p.abs().max().item() for p in sides["torch"].params) or 1.0
    agree = max(
        (a - b).abs().max().item() for a, b in zip(sides["modopt"].params, sides["torch"].params)
    ) / scale
    pbytes = sum(p.numel() * p.element_size() for p in sides["torch"].params)
    mem = {}
    for n in ("modopt", "torch"):
        peak = 0
        for _ in range(case.calls):  # every call of a cycle (the last one updates the parameters)
            _load(sides[n].params, grad_sets[0])
            peak = max(peak, extra_peak_bytes(sides[n]))
        mem[n] = 100.0 * peak / pbytes
    ratios = [a / b for a, b in zip(times["modopt"], times["torch"])]
    row = Row(
        model=model, pipeline=case.name,
        modopt_ms=1e3 * statistics.median(times["modopt"]), torch_ms=1e3 * statistics.median(times["torch"]),
        ratio=statistics.median(ratios), torch_label=case.torch_label,
        extra_modopt=mem["modopt"], extra_torch=mem["torch"],
        state_modopt=100.0 * sides["modopt"].state_bytes() / pbytes,
        state_torch=100.0 * sides["torch"].state_bytes() / pbytes,
        agree=agree, note=note,
    )
    if "torchzero" in times:
        row.torchzero_ms = 1e3 * statistics.median(times["torchzero"])
        row.torchzero_ratio = statistics.median(a / b for a, b in zip(times["modopt"], times["torchzero"]))
    return row


def format_table(rows: list[Row], skipped: list[str]) -> str:
    has_tz = any(r.torchzero_ms is not None for r in rows)
    head = ["model", "pipeline", "modopt ms", "torch ms", "ratio"]
    if has_tz:
        head += ["torchzero ms", "modopt/tz"]
    head += ["extra mem modopt", "extra mem torch", "state modopt", "state torch", "agree"]
    lines = [head]
    for r in rows:
        line = [r.model, r.pipeline, f"{r.modopt_ms:.3f}", f"{r.torch_ms:.3f}", f"{r.ratio:.2f}x"]
        if has_tz:
            line += [f"{r.torchzero_ms:.3f}" if r.torchzero_ms is not None else "n/a",
                     f"{r.torchzero_ratio:.2f}x" if r.torchzero_ratio is not None else "n/a"]
        line += [f"{r.extra_modopt:.1f}%", f"{r.extra_torch:.1f}%", f"{r.state_modopt:.0f}%",
                 f"{r.state_torch:.0f}%", f"{r.agree:.1e}"]
        lines.append(line)
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = sorted({f"- {r.pipeline}: torch side is {r.torch_label}" for r in rows})
    notes += [f"- {r.model} {r.pipeline}: {r.note}" for r in rows if r.note]
    notes += [f"- skipped {s}" for s in skipped]
    if _torchzero() is None:
        notes.append("- torchzero is not importable: no torchzero column")
    return "\n".join(out + [""] + notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="modopt bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models and few steps (CI smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per pipeline (default 200, quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 30, quick 2)")
    ap.add_argument("--models", nargs="+", choices=["mlp5m", "small300"], default=["mlp5m", "small300"])
    ap.add_argument("--only", default=None, help="run pipelines whose name contains this text")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (4 if args.quick else 200)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 30)
    if args.threads:
        torch.set_num_threads(args.threads)
    registered = set(mo.available())
    rows: list[Row] = []
    skipped: list[str] = []
    print(f"modopt bench: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{steps} timed steps after {warmup} warm-up{' (quick)' if args.quick else ''}", flush=True)
    for case in cases():
        if args.only and args.only not in case.name:
            continue
        missing = [n for n in case.needs if n not in registered]
        if missing:
            skipped.append(f"{case.name} (not registered: {', '.join(missing)})")
            continue
        for model in args.models:
            rows.append(run_case(case, model, args.quick, steps, warmup))
            print(f"  {model:9s} {case.name}: {rows[-1].ratio:.2f}x", file=sys.stderr, flush=True)
    print(format_table(rows, skipped))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
