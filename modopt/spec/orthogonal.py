"""Spec of the orthogonal family (float64, one tensor or segment at a time).

The definition is the exact polar factor: for a matrix `X = U S V^T` (thin SVD),
`polar(X) = U V^T`, the semi-orthogonal matrix nearest to `X` in the Frobenius
norm (the rank-deficient case keeps only the singular vectors of the nonzero
singular values). `Orthogonalize` and `Muon` do not compute it: they run a fixed
number of Newton-Schulz steps whose singular values land near 1, not at 1.
`newton_schulz` is that iteration in float64, the oracle of the runtime's
arithmetic; `spread` measures how far it lands from `polar`.

`spread_table()` returns the table of docs/modules/orthogonal.md:
`python -c "from modopt.spec.orthogonal import spread_table; print(spread_table())"`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from .scope import Dims, gather, scatter, segments

#: torch.optim.Muon's quintic coefficients (Keller Jordan's)
#: Newton-Schulz coefficients: one `(a, b, c)` for every step, or one triple per step
Coefficients = Union[Sequence[float], Sequence[Sequence[float]]]

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
#: torchzero's `Orthogonalize` default: one triple per step (five steps)
TORCHZERO_COEFFICIENTS = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def matrix_of(t: torch.Tensor) -> torch.Tensor | None:
    """The float64 matrix a tensor is orthogonalized as: `(shape[0], prod(shape[1:]))`, or None for
    fewer than 2 dims or no elements (the tensor is left as it is)."""
    if t.dim() < 2 or t.numel() == 0:
        return None
    return t.detach().to(torch.float64).reshape(t.shape[0], -1)


def matrices_of(t: torch.Tensor, batch_dims: Optional[int] = None) -> list[torch.Tensor] | None:
    """The float64 matrices a tensor is read as, one by one: `[matrix_of(t)]` for `batch_dims` None or 0;
    for `batch_dims=k` the first `k` dims index the matrices, each slice `t[i]` (row-major order over those
    dims) read by `matrix_of`. None when a slice is no matrix (fewer than 2 dims) or the tensor is empty."""
    k = batch_dims or 0
    if t.dim() - k < 2 or t.numel() == 0:
        return None
    if k == 0:
        return [matrix_of(t)]
    return [matrix_of(s) for s in t.detach().reshape((-1,) + tuple(t.shape[k:])).unbind(0)]


def from_matrices(ms: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The tensor of `shape` whose matrices (`matrices_of`) are `ms`."""
    return torch.stack([m.reshape(-1) for m in ms]).reshape(tuple(shape))


def polar(x: torch.Tensor) -> torch.Tensor:
    """The polar factor `U V^T` of a matrix, through its SVD in float64. Singular values below
    `max(rows, cols) * eps(float64) * s_max` count as zero (numpy's rank rule): their vectors are left
    out, so a zero matrix maps to zero."""
    x = x.to(torch.float64)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    if s.numel() == 0:
        return torch.zeros_like(x)
    tol = max(x.shape) * torch.finfo(torch.float64).eps * float(s.max())
    keep = (s > tol).to(torch.float64)
    return (u * keep) @ vh


# --- named schedules (the definitions; the runtime keeps its own table, tests/test_muon_recipe.py compares) --
#: Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932), Algorithm 1: the degree-5
#: polynomials optimal for singular values in [1e-3, 1], in order; the eighth is the fixed point
PAPER_POLAR_EXPRESS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
#: name -> (schedule, default safety factor of the pre-scaling)
PRESETS: dict[str, tuple[list[tuple[float, float, float]], float]] = {
    "original": ([NS_COEFFICIENTS], 1.0),
    "quintic": (TORCHZERO_COEFFICIENTS, 1.0),
    # microsoft/dion dion/polar_express.py and karpathy/nanochat nanochat/optim.py: five polynomials
    # for five steps, a 1.02 safety margin in all but the last; the input divided by 1.02 ||X||_F
    "polar_express": ([
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ], 1.02),
    # the paper's Algorithm 1: p_k(x / 1.01) for all but the last polynomial; input divided by 1.01 ||X||_F
    "polar_express_paper": ([(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PAPER_POLAR_EXPRESS[:-1]]
                            + [PAPER_POLAR_EXPRESS[-1]], 1.01),
    # DeepSeek-V4: Keller Jordan's coefficients eight times, then (2, -1.5, 0.5) twice
    "deepseek_v4": ([NS_COEFFICIENTS] * 8 + [(2.0, -1.5, 0.5)] * 2, 1.0),
}


def safety_of(coefficients: Union[str, Coefficients], ns_safety: Optional[float]) -> float:
    """The pre-scaling factor: `ns_safety`, or the preset's own when None (1 for explicit coefficients)."""
    if ns_safety is not None:
        return ns_safety
    return PRESETS[coefficients][1] if isinstance(coefficients, str) else 1.0


def steps_of(coefficients: Union[str, Coefficients], steps: int, past_end: str = "repeat") -> list[tuple[float, float, float]]:
    """One `(a, b, c)` per step: one triple for every step, a list of triples as given, or a preset's
    first `steps` triples and past its end its last one repeated (`past_end="repeat"`) or the list read
    again from its start (`"cycle"`, Emerging-Optimizers' rule for its `quintic`)."""
    if isinstance(coefficients, str):
        table = PRESETS[coefficients][0]
        if past_end == "cycle":
            return [tuple(table[i % len(table)]) for i in range(steps)]
        return [tuple(table[i]) if i < len(table) else tuple(table[-1]) for i in range(steps)]
    if len(coefficients) == 3 and not isinstance(coefficients[0], (tuple, list)):
        return [tuple(coefficients)] * steps
    return [tuple(c) for c in coefficients]


def precondition(x: torch.Tensor, how: str = "frobenius", eps: float = 1e-7, safety: float = 1.0) -> torch.Tensor:
    """`x0`, the wide matrix `x` scaled so that every singular value is at most `1 / safety`, in float64:
    `"frobenius"` `x / max(safety ||x||_F, eps)`; `"aol"` row `i` times `1 / (safety sqrt(max(r_i, eps^2)))`
    with `r_i = sum_j |(x x^T)_ij|` (a bound on the spectral norm of the scaled matrix: Gershgorin's
    theorem on its Gram matrix); `"schatten"` `x / (safety sqrt(max(||x x^T||_F, eps^2)))`, the
    Schatten-4 norm (optax's `preconditioning`; their floor is `1e-8` on the sums)."""
    x = x.to(torch.float64)
    if how == "frobenius":
        return x / max(safety * float(torch.linalg.matrix_norm(x)), eps)
    gram = x @ x.T
    if how == "aol":
        r = gram.abs().sum(dim=1).clamp(min=eps * eps)
        return x / (safety * r.sqrt())[:, None]
    return x / (safety * math.sqrt(max(float(torch.linalg.matrix_norm(gram)), eps * eps)))


def newton_schulz(x: torch.Tensor, coefficients: Union[str, Coefficients] = NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, safety: float = 1.0, past_end: str = "repeat",
                  preconditioning: str = "frobenius") -> torch.Tensor:
    """`steps` quintic Newton-Schulz steps on the matrix `x`, in float64.

    Wide orientation (a tall matrix is transposed, and transposed back at the end);
    `x0 = x / max(safety ||x||_F, eps)` (every singular value at most 1 / safety; other scalings:
    `precondition`); then with `A = x x^T`: `x <- a x + b A x + c A A x`. Each singular value s goes
    through `a s + b s^3 + c s^5`, the singular vectors stay.
    """
    x = x.to(torch.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = precondition(x, preconditioning, eps, safety)
    for a, b, c in steps_of(coefficients, steps, past_end):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


def adjust_ratio(rows: int, cols: int, rule: Optional[str]) -> float:
    """torch.optim.Muon's learning-rate factor of a `rows x cols` matrix (`"none"`: 1)."""
    if rule is None or rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral_unclamped":  # torch 2.14: Bernstein's sqrt(fan_out / fan_in), below 1 when wide
        return math.sqrt(rows / cols)
    return 1.0


def orthogonalize(updates: Sequence[torch.Tensor], ns_coefficients: Union[str, Coefficients] = NS_COEFFICIENTS,
                  ns_steps: int = 5, eps: float = 1e-7, adjust_lr: Optional[str] = "none", ns_dtype: str = "bfloat16",
                  exact: bool = False, ns_safety: Optional[float] = None, ns_past_end: str = "repeat",
                  ns_preconditioning: str = "frobenius", batch_dims: Optional[int] = None) -> list[torch.Tensor]:
    """`Orthogonalize`: each matrix of each tensor (`matrices_of`: one per tensor of 2+ dims, or one per index
    of its first `batch_dims` dims) replaced by its Newton-Schulz iteration (`exact=True`: by its polar
    factor), times the `adjust_lr` factor of its own shape; others unchanged. `ns_dtype` is the runtime's
    working precision: the spec is float64 whatever it says."""
    safety = safety_of(ns_coefficients, ns_safety)
    out = []
    for u in updates:
        ms = matrices_of(u, batch_dims)
        if ms is None:
            out.append(u.detach().to(torch.float64).clone())
            continue
        os = []
        for m in ms:
            o = polar(m) if exact else newton_schulz(m, ns_coefficients, ns_steps, eps, safety, ns_past_end,
                                                     ns_preconditioning)
            os.append(o * adjust_ratio(m.shape[0], m.shape[1], adjust_lr))
        out.append(from_matrices(os, u.shape))
    return out


def ortho_grad(updates: Sequence[torch.Tensor], params: Sequence[torch.Tensor], group_of: Sequence[int],
               eps: float = 1e-8, renormalize: bool = True, scope: str = "tensor", dim: Dims = None,
               inverse_dims: bool = False, min_size: int = 2) -> list[torch.Tensor]:
    """`OrthoGrad`, per segment: `u - <w, u> / (<w, w> + eps) * w` (no projection where the denominator
    is 0), then, with `renormalize`, rescaled to the segment's old 2-norm where the new one is > 0.
    Segments with fewer than `min_size` elements are left as they are."""
    out = [u.detach().to(torch.float64).clone() for u in updates]
    ws = [p.detach().to(torch.float64) for p in params]
    for seg in segments(out, group_of, scope, dim, inverse_dims):
        x, w = gather(out, seg), gather(ws, seg)
        if x.numel() < min_size:
            continue
        den = float(w @ w) + eps
        y = x - (float(w @ x) / den) * w if den > 0 else x.clone()
        if renormalize:
            before, after = float(x.norm()), float(y.norm())
            if after > 0:
                y = y * (before / after)
        scatter(out, seg, y)
    return out


class Momentum:
    """`Momentum`: `b <- beta b + (1 - beta) u` (from zeros); `u <- (1 - beta) u + beta b` (Nesterov) or `b`."""

    beta: float
    nesterov: bool

    def __init__(self, beta: float = 0.95, nesterov: bool = True) -> None:
        self.beta, self.nesterov = beta, nesterov
        self.b: Optional[list[torch.Tensor]] = None

    def step(self, updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One step: the new directions (float64); the buffers move on."""
        us = [u.detach().to(torch.float64) for u in updates]
        if self.b is None:
            self.b = [torch.zeros_like(u) for u in us]
        self.b = [self.beta * b + (1 - self.beta) * u for b, u in zip(self.b, us)]
        if self.nesterov:
            return [(1 - self.beta) * u + self.beta * b for u, b in zip(us, self.b)]
        return [b.clone() for b in self.b]


class Muon:
    """`Muon` (and torch.optim.Muon), as a parameter trajectory in float64: `step(params, grads, lr)`
    returns the new parameters `p (1 - lr wd) - lr r O`, with `O` the Newton-Schulz iteration of the
    momentum direction (`exact=True`: its polar factor) and `r` the `adjust_lr_fn` factor; tensors with
    fewer than 2 dims take the momentum direction itself, `r = 1`."""

    def __init__(self, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: Union[str, Coefficients] = NS_COEFFICIENTS, ns_steps: int = 5, eps: float = 1e-7,
                 adjust_lr_fn: Optional[str] = None, exact: bool = False, ns_safety: Optional[float] = None,
                 ns_past_end: str = "repeat", ns_preconditioning: str = "frobenius", batch_dims: Optional[int] = None,
                 **_runtime_only: Any) -> None:
        self.wd: float = weight_decay
        self.momentum: Momentum = Momentum(momentum, nesterov)
        self.ns: dict[str, Any] = dict(ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps, exact=exact,
                                       ns_safety=ns_safety, ns_past_end=ns_past_end,
                                       ns_preconditioning=ns_preconditioning, adjust_lr=adjust_lr_fn,
                                       batch_dims=batch_dims)
        self.adjust: Optional[str] = adjust_lr_fn
        self.batch_dims: Optional[int] = batch_dims

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> list[torch.Tensor]:
        """One step: the new parameters (float64) after the gradients `grads` with learning rate `lr`."""
        out = []
        for p, d in zip(params, self.momentum.step(grads)):
            p = p.detach().to(torch.float64)
            (o,) = orthogonalize([d], **self.ns)  # (times each matrix's own factor r; 1 for no matrix)
            out.append(p * (1 - lr * self.wd) - lr * o)
        return out


class NorMuon:
    """`NorMuon`, one step at a time: for each tensor with 2+ dims (as its matrix `O`, `rows x cols`),
    `v <- beta2 v + (1 - beta2) mean(O**2)` over each row (`per="larger"`: over the smaller dimension, so per
    row of a tall or square matrix and per column of a wide one), from zeros; `N = O / (sqrt(v) + eps)`;
    the output `N ||O||_F / (||N||_F + eps)`. Other tensors are returned unchanged."""

    def __init__(self, beta2: float = 0.95, eps: float = 1e-10, per: str = "row",
                 batch_dims: Optional[int] = None) -> None:
        self.beta2: float = beta2
        self.eps: float = eps
        self.per: str = per
        self.batch_dims: Optional[int] = batch_dims
        self.v: dict[tuple[int, int], torch.Tensor] = {}  # (tensor, matrix) -> its second moments

    def step(self, updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One step: the normalized updates (float64); the second moments move on (one set per matrix)."""
        out = []
        for i, u in enumerate(updates):
            os = matrices_of(u, self.batch_dims)
            if os is None:
                out.append(u.detach().to(torch.float64).clone())
                continue
            ns = []
            for j, o in enumerate(os):
                rows, cols = o.shape
                by_row = self.per == "row" or rows >= cols
                mean_sq = (o * o).mean(dim=1) if by_row else (o * o).mean(dim=0)
                v = self.v.get((i, j), torch.zeros_like(mean_sq))
                v = self.v[i, j] = self.beta2 * v + (1 - self.beta2) * mean_sq
                d = v.sqrt() + self.eps
                n = o / d[:, None] if by_row else o / d[None, :]
                ns.append(n * (float(torch.linalg.matrix_norm(o)) / (float(torch.linalg.matrix_norm(n)) + self.eps)))
            out.append(from_matrices(ns, u.shape))
        return out


class AdaMuon:
    """`AdaMuon` (and pytorch_optimizer.AdaMuon), as a parameter trajectory in float64: `step(params, grads,
    lr)` returns the new parameters. Per matrix (`rows x cols`): `m <- beta1 m + (1 - beta1) g`;
    `O = NS(m)`; `v <- beta2 v + (1 - beta2) O**2`; `N = O / (sqrt(v / (1 - beta2**t)) + eps)`;
    `p <- p (1 - lr wd) - lr r sqrt(min(rows, cols)) N / (||N||_F + eps)`, `r` the `adjust_lr_fn` factor.
    Tensors with fewer than 2 dims: `p (1 - lr wd) - lr m`."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0, eps: float = 1e-10,
                 ns_coefficients: Union[str, Coefficients] = NS_COEFFICIENTS, ns_steps: int = 5,
                 ns_eps: float = 1e-7, ns_safety: Optional[float] = None, ns_past_end: str = "repeat",
                 ns_preconditioning: str = "frobenius", adjust_lr_fn: str = "match_rms_adamw",
                 batch_dims: Optional[int] = None, **_runtime_only: Any) -> None:
        self.batch_dims: Optional[int] = batch_dims
        self.betas: tuple[float, float] = betas
        self.wd: float = weight_decay
        self.eps: float = eps
        self.adjust: str = adjust_lr_fn
        self.ns: dict[str, Any] = dict(coefficients=ns_coefficients, steps=ns_steps, eps=ns_eps,
                                       safety=safety_of(ns_coefficients, ns_safety), past_end=ns_past_end,
                                       preconditioning=ns_preconditioning)
        self.m: Optional[list[torch.Tensor]] = None
        self.v: Optional[list[torch.Tensor]] = None
        self.t: int = 0

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> list[torch.Tensor]:
        """One step: the new parameters (float64)."""
        b1, b2 = self.betas
        gs = [g.detach().to(torch.float64) for g in grads]
        if self.m is None:
            self.m = [torch.zeros_like(g) for g in gs]
            self.v = [torch.zeros_like(g) for g in gs]
        assert self.v is not None
        self.t += 1
        out = []
        for i, (p, g) in enumerate(zip(params, gs)):
            p = p.detach().to(torch.float64) * (1 - lr * self.wd)
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            xs = matrices_of(self.m[i], self.batch_dims)
            if xs is None:
                out.append(p - lr * self.m[i])
                continue
            o = from_matrices([newton_schulz(x, **self.ns) for x in xs], g.shape)
            self.v[i] = b2 * self.v[i] + (1 - b2) * o * o
            steps = []
            for x, n in zip(xs, matrices_of(o / ((self.v[i] / (1 - b2**self.t)).sqrt() + self.eps), self.batch_dims)):
                rows, cols = x.shape  # each matrix: its own norm and shape factor
                n = n * (math.sqrt(min(rows, cols)) / (float(torch.linalg.matrix_norm(n)) + self.eps))
                steps.append(adjust_ratio(rows, cols, self.adjust) * n)
            out.append(p - lr * from_matrices(steps, g.shape))
        return out


# --- how far Newton-Schulz lands from the polar factor ---------------------------------------------
#: where five steps of torch's coefficients put a singular value s of `x0` (`scalar_map`): every
#: s in [BAND_FROM, 1] lands in BAND (measured on a grid of 200001 points, log-spaced over [1e-6, 1]);
#: a smaller s is multiplied by about a**5 = 485 and stays below the band
BAND_FROM = 1.5e-3
BAND = (0.680, 1.203)


def scalar_map(s: torch.Tensor, coefficients: Coefficients = NS_COEFFICIENTS, steps: int = 5,
               past_end: str = "repeat") -> torch.Tensor:
    """What the iteration does to one singular value of `x0` (in [0, 1]): `s <- a s + b s^3 + c s^5`."""
    s = s.to(torch.float64)
    for a, b, c in steps_of(coefficients, steps, past_end):
        s = a * s + b * s**3 + c * s**5
    return s


def matrices(seed: int = 0, n: int = 128) -> list[tuple[str, torch.Tensor]]:
    """The test matrices of the spread table, `(label, matrix)` in float64: Gaussian ones (square ones
    have singular values down to about 0, rectangular ones are well conditioned), `n x n` ones with
    singular values log-spaced from 1 down to `1/cond`, and a rank-deficient one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((64, 64), (256, 64), (64, 256), (n, n)):
        out.append((f"Gaussian {shape[0]}x{shape[1]}", torch.randn(shape, generator=g, dtype=torch.float64)))
    for cond in (1e2, 1e3, 1e4, 1e6):
        q1, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        s = torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)
        out.append((f"cond {cond:.0e}, {n}x{n}", (q1 * s) @ q2.T))
    a, b = torch.randn(64, 8, generator=g, dtype=torch.float64), torch.randn(8, 64, generator=g, dtype=torch.float64)
    out.append(("rank 8, 64x64", a @ b))  # a gradient over a batch of 8: 56 singular values are 0
    return out


def spread(o: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """How far `o` (an orthogonalization of `x`) is from `polar(x)`, whose singular values are all 1:
    the smallest and largest singular values of `o`, the fraction of them in `BAND`, and
    `||o - polar(x)||` in the spectral norm and relative to `||polar(x)||_F`."""
    o = o.to(torch.float64)
    ref = polar(x)
    s = torch.linalg.svdvals(o)
    return {
        "s_min": float(s.min()),
        "s_max": float(s.max()),
        "in_band": float(((s >= BAND[0] - 0.005) & (s <= BAND[1] + 0.005)).to(torch.float64).mean()),
        "spectral": float(torch.linalg.matrix_norm(o - ref, ord=2)),
        "frobenius_rel": float(torch.linalg.matrix_norm(o - ref) / torch.linalg.matrix_norm(ref)),
    }


def spread_table() -> str:  # pragma: no cover - the table docs/modules/orthogonal.md quotes
    """The spread of five torch-coefficient steps on `matrices()`, in float64 (`newton_schulz`) and as
    the runtime computes it by default (bfloat16), as a Markdown table."""
    from ..transforms.orthogonal import newton_schulz as runtime_ns

    rows = ["| matrix | precision | min s | max s | s within [0.68, 1.21] | ‖O − UVᵀ‖₂ "
            "| ‖O − UVᵀ‖_F / ‖UVᵀ‖_F |",
            "|---|---|---|---|---|---|---|"]
    for label, x in matrices():
        for prec, o in (
            ("float64", newton_schulz(x)),
            ("bfloat16", runtime_ns(x.float(), [NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16).double()),
        ):
            r = spread(o, x)
            rows.append(f"| {label} | {prec} | {r['s_min']:.3f} | {r['s_max']:.3f} | {100 * r['in_band']:.0f}% | "
                        f"{r['spectral']:.3f} | {r['frobenius_rel']:.3f} |")
    return "\n".join(rows)
