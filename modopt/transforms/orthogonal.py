"""Orthogonalized updates: Newton-Schulz orthogonalization and Muon, OrthoGrad, and Muon's momentum.

`Orthogonalize` replaces each matrix-shaped update by an approximation of its
polar factor (the nearest semi-orthogonal matrix), computed with a few
Newton-Schulz iterations as `torch.optim.Muon` computes it. `Momentum` is the
exponential moving average (optionally Nesterov) that Muon applies first, and
`Muon` is the two of them followed by the learning rate and a decoupled weight
decay, written as the last transform in torch's own order of operations.
`OrthoGrad` removes the part of each update that is parallel to its weight.
`NS_PRESETS` names published Newton-Schulz schedules (Polar Express, You's quintic, DeepSeek-V4's),
which `Orthogonalize`, `Muon` and `AdaMuon` take by name. `NorMuon` normalizes an orthogonalized
update per neuron, and `AdaMuon` is pytorch_optimizer's adaptive Muon as one optimizer transform.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Optional, Union

import torch
from pydantic import Field, model_validator

from ..core.distributed import (any_sharded, dtensor_of, is_sharded, like_dtensor, local, owner_apply, owner_split,
                                placed_like, sum_over_, whole_blocks_here)
from ..core.keys import value_key
from ..core.reduce import acc_dtype, tensor_pnorms
from ..core.step import Step, TransformState
from ..core import kernels
from ..core.roles import Planned, Segmented, ShapeDependent
from ..core.scope import Scoped, ScopeName
from ..core.transform import Transform
from ..core.state import Buffer, proceed_flag
from ._util import FiniteFloat, FiniteNonNegativeFloat, FinitePositiveFloat

__all__ = ["Orthogonalize", "OrthoGrad", "Momentum", "Muon", "NorMuon", "AdaMuon"]

NonNegativeFloat = FiniteNonNegativeFloat  # (finite: see `_util`)
PositiveFloat = FinitePositiveFloat
#: one quintic step `x <- a x + b (x x^T) x + c (x x^T)^2 x`, as `(a, b, c)`
Coefficients = tuple[FiniteFloat, FiniteFloat, FiniteFloat]
#: `torch.optim.Muon`'s coefficients (Keller Jordan's), used for every step
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
NSDtype = Literal["bfloat16", "float32", "float64"]

# --- named Newton-Schulz schedules ---------------------------------------------------------------------
#: the Polar Express paper's degree-5 schedule for l = 1e-3 (Amsel, Persson, Musco, Gower 2025,
#: arXiv 2505.16932, Algorithm 1), before its safety scaling; the last polynomial is the fixed point
_POLAR_EXPRESS_PAPER_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


def _safer(a: float, b: float, c: float, s: float) -> tuple[float, float, float]:
    """`p(x / s)` for `p(x) = a x + b x^3 + c x^5`: the polynomial made safe against an input above 1 by `s`."""
    return (a / s, b / s**3, c / s**5)


#: name -> (one `(a, b, c)` per step, the pre-scaling safety factor its source uses, the fewest steps
#: that keep the schedule's meaning). `ns_steps` takes the first triples and repeats the last one past the
#: end (the paper's rule, Emerging-Optimizers' `repeat_last` and pytorch_optimizer's).
NS_PRESETS: dict[str, tuple[tuple[tuple[float, float, float], ...], float, int]] = {
    # Keller Jordan's coefficients, torch.optim.Muon's default (pytorch_optimizer's "original",
    # Emerging-Optimizers' "simple")
    "original": ((NS_COEFFICIENTS,), 1.0, 1),
    # Jiacheng You's five (modded-nanogpt; Emerging-Optimizers' and pytorch_optimizer's "quintic",
    # torchzero's Orthogonalize default)
    "quintic": ((
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ), 1.0, 1),
    # Polar Express for five steps with a 2e-2 safety margin (computed with cushion 2), baked into all
    # but the last polynomial; the input divided by 1.02 ||X||_F (microsoft/dion `dion/polar_express.py`,
    # karpathy/nanochat `nanochat/optim.py`; pytorch_optimizer's "polar_express_safer" starts the same)
    "polar_express": ((
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ), 1.02, 1),
    # the paper's Algorithm 1: its eight polynomials, all but the last made safe by 1.01, the input
    # divided by 1.01 ||X||_F (NVIDIA-NeMo/Emerging-Optimizers' "polar_express" holds the same polynomials
    # rounded to four decimals and divides by ||X||_F alone: ns_safety=1.0)
    "polar_express_paper": (tuple(_safer(a, b, c, 1.01) for a, b, c in _POLAR_EXPRESS_PAPER_RAW[:-1])
                            + (_POLAR_EXPRESS_PAPER_RAW[-1],), 1.01, 1),
    # DeepSeek-V4: eight of Keller Jordan's steps, then two steps of (2, -1.5, 0.5), which settle the
    # singular values at 1 (Emerging-Optimizers' "deepseekv4"); fewer than ten steps would drop the second stage
    "deepseek_v4": ((NS_COEFFICIENTS,) * 8 + ((2.0, -1.5, 0.5),) * 2, 1.0, 10),
}
NSPreset = Literal["original", "quintic", "polar_express", "polar_express_paper", "deepseek_v4"]
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
AdjustLR = Literal["none", "original", "match_rms_adamw", "spectral_unclamped"]
#: what a named schedule does past its last polynomial: repeat it (the paper, pytorch_optimizer, Emerging-Optimizers
#: for its Polar Express, CANS and DeepSeek-V4 sets) or start the list again (Emerging-Optimizers' other sets)
PastEnd = Literal["repeat", "cycle"]
#: how the input is scaled before the first step: by its Frobenius norm, or optax's "aol" (each row by
#: `rsqrt(sum_j |A_ij|)`, `A = X X^T`, reused by the first step) and "schatten" (by `||A||_F^(-1/2)`)
Preconditioning = Literal["frobenius", "aol", "schatten"]


# --- the math, shared by the transforms -------------------------------------------------------------
def as_matrix(t: torch.Tensor, batch_dims: int | None = None) -> torch.Tensor | None:
    """The matrix (or stack of matrices) a tensor is orthogonalized as.

    `batch_dims` None or 0: the tensor itself for 2 dims, `t.reshape(t.shape[0], -1)` for more (a conv weight
    `(out, in, kh, kw)` becomes `(out, in * kh * kw)`). `batch_dims=k >= 1`: the first `k` dims index a batch
    of matrices, each read by that rule, as one `(B, rows, cols)` stack with `B = prod(shape[:k])` (an expert
    stack `(E, out, in)` with `k=1` is `E` matrices `out x in`). None when a matrix would have fewer than 2
    dims, and for empty tensors (left as they are)."""
    k = batch_dims or 0
    if t.dim() - k < 2 or t.numel() == 0:
        return None
    if k == 0:
        return t if t.dim() == 2 else t.reshape(t.shape[0], -1)
    return t.reshape(math.prod(t.shape[:k]), t.shape[k], -1)


def frobenius(x: torch.Tensor) -> torch.Tensor:
    """The Frobenius norm of each matrix of `x`: a 0-d tensor for a 2-D `x`, `(B, 1, 1)` for a `(B, rows, cols)`
    stack. Each matrix's norm equals `torch.linalg.vector_norm` of that matrix alone, bit for bit (torch 2.13,
    CPU: a reduction over the last two dims runs the same kernel per matrix as a full one)."""
    if x.dim() == 2:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)


def per_matrix_shape(t: torch.Tensor, batch_dims: int | None, m: torch.Tensor) -> tuple[int, ...]:
    """The shape that broadcasts one value per matrix of `m` (`as_matrix(t, batch_dims)`) over `t`:
    `shape[:k] + (1, ...)`; `()` for a single matrix."""
    k = batch_dims or 0
    return tuple(t.shape[:k]) + (1,) * (t.dim() - k) if m.dim() == 3 else ()


def per_row_shape(t: torch.Tensor, batch_dims: int | None) -> tuple[int, ...]:
    """The shape that broadcasts one value per row of each matrix over `t`: `shape[:k + 1] + (1, ...)`."""
    k = batch_dims or 0
    return tuple(t.shape[: k + 1]) + (1,) * (t.dim() - k - 1)


def per_column_shape(t: torch.Tensor, batch_dims: int | None) -> tuple[int, ...]:
    """The shape that broadcasts one value per column of each matrix over `t`: `shape[:k] + (1,) + shape[k + 1:]`."""
    k = batch_dims or 0
    return tuple(t.shape[:k]) + (1,) + tuple(t.shape[k + 1:])


def adjust_ratio(rows: int, cols: int, rule: str | None) -> float:
    """The learning-rate factor of a `rows x cols` matrix, as torch.optim.Muon computes it:
    `"original"` (and None) `sqrt(max(1, rows / cols))`, `"match_rms_adamw"` `0.2 * sqrt(max(rows, cols))`,
    `"spectral_unclamped"` `sqrt(rows / cols)` (torch 2.14, Bernstein's rule: below 1 for a wide matrix),
    `"none"` 1."""
    if rule is None or rule == "original":
        return math.sqrt(max(1, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral_unclamped":
        return math.sqrt(rows / cols)
    return 1.0


def coefficient_steps(coefficients: Union[Coefficients, list[Coefficients], str], steps: int,
                      past_end: str = "repeat") -> list[tuple[float, float, float]]:
    """One `(a, b, c)` per iteration: a single triple repeated `steps` times, the list as given, or a
    preset's (`NS_PRESETS`) first `steps` triples and past its end its last one repeated
    (`past_end="repeat"`) or the list started again (`"cycle"`)."""
    if isinstance(coefficients, str):
        table = NS_PRESETS[coefficients][0]
        n = len(table)
        return [tuple(table[i % n if past_end == "cycle" else min(i, n - 1)]) for i in range(steps)]
    if len(coefficients) == 3 and not isinstance(coefficients[0], (tuple, list)):
        return [tuple(coefficients)] * steps
    return [tuple(c) for c in coefficients]


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """The matrix-product FLOPs of `newton_schulz` on a `rows x cols` matrix (a multiply-add counted as 2,
    as `torch.utils.flop_counter` does): per step, on the wide orientation `n x k` (`n = min(rows, cols)`),
    `x x^T` and `poly @ x` take `2 n^2 k` each and `A A` takes `2 n^3`. The scalings and additions are
    elementwise and left out."""
    n, k = min(rows, cols), max(rows, cols)
    return steps * (4 * n * n * k + 2 * n**3)


def _preconditioned(x: torch.Tensor, eps: float, safety: float,
                    how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """optax's first-step preconditionings of the wide `x` (or a batch of them), in place of the division by the
    Frobenius norm: `(x scaled, its Gram matrix A = x x^T scaled alike)`, the Gram matrix reused by the first step.
    `"aol"`: each row times `s_i = rsqrt(sum_j |A_ij|)` and `A <- s A s` (Turbo-Muon; every singular value then at
    most 1, as the row sums bound the spectral norm of the scaled `A`); `"schatten"`: `x` times `||A||_F^(-1/2)`, the
    Schatten-4 norm. The sums are floored at `eps**2` (for one row either is the Frobenius rule with its floor `eps`)
    and the scale divided by `safety`."""
    gram = x @ x.mT
    if how == "aol":
        s = gram.abs().sum(dim=-1, keepdim=True).clamp(min=eps * eps).rsqrt()
    else:
        s = torch.linalg.matrix_norm(gram, keepdim=True).clamp(min=eps * eps).rsqrt()
    if safety != 1.0:
        s = s / safety
    return x * s, (gram * s * s.mT if how == "aol" else gram * (s * s))


def newton_schulz(m: torch.Tensor, steps: list[tuple[float, float, float]], eps: float,
                  dtype: torch.dtype, safety: float = 1.0, precondition: str = "frobenius") -> torch.Tensor:
    """Newton-Schulz orthogonalization of the 2-D `m`, in `dtype`, op for op as torch.optim.Muon; or of each
    matrix of a `(B, rows, cols)` stack at once (an expert stack: `as_matrix(t, batch_dims)`).

    Work on the wide orientation (transpose a tall matrix), divide by `max(||m||_F * safety, eps)` so
    that every singular value is at most `1 / safety` (the norm rounded to `dtype`, then multiplied by
    `safety` in `dtype`, as pytorch_optimizer's `zero_power_via_newton_schulz_5` does; `safety=1`: no
    multiply, torch's), then per step with `A = x x^T`:
    `x <- a x + (b A + c A A) x` (two `addmm`). The input is never written: torch divides in place, which
    for an input already in `dtype` is the caller's tensor; here only a copy made by the cast is divided in
    place, and an input already in `dtype` is divided into a new tensor. `precondition="aol"` or `"schatten"`
    scales the input by `_preconditioned` instead, and the first step reuses its Gram matrix (optax's rule).

    A stack runs the same ops batched (`baddbmm` for `addmm`, each matrix transposed when tall, divided by
    its own norm): one launch per op for the whole stack, not one per matrix. A stack of one matrix runs the
    2-D ops. Each matrix's result equals the 2-D call on it alone bit for bit where the batched matrix product
    is the single one's kernel: on a CPU in bfloat16 always, in float32/float64 from about 8 x 16 up (torch
    2.13; the smallest ones, 5 x 6 or 4 x 8, take another kernel and differ in the last bits); on a GPU cuBLAS
    may choose other kernels too.
    """
    if m.dim() == 3 and m.shape[0] == 1:
        return newton_schulz(m[0], steps, eps, dtype, safety, precondition).unsqueeze(0)
    batched = m.dim() == 3
    x = m.to(dtype)
    fresh = x is not m  # a copy made here: divide it in place, as torch does (no second matrix allocated)
    tall = m.size(-2) > m.size(-1)
    if tall:
        x = x.mT
    first = None
    if precondition != "frobenius":
        x, first = _preconditioned(x, eps, safety, precondition)
    else:
        # (`frobenius` written out for one matrix: a Python call less per matrix per step)
        norm = torch.linalg.vector_norm(x) if not batched else frobenius(x)
        if safety != 1.0:
            norm = norm * safety
        x = x.div_(norm.clamp(min=eps)) if fresh else x / norm.clamp(min=eps)
    mm = torch.baddbmm if batched else torch.addmm
    for a, b, c in steps:
        gram = x @ x.mT if first is None else first
        first = None
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, poly, x, beta=a)
    return x.mT if tall else x


def newton_schulz_batched(ms: list[torch.Tensor], steps: list[tuple[float, float, float]], eps: float,
                          dtype: torch.dtype, safety: float = 1.0, precondition: str = "frobenius") -> list[torch.Tensor]:
    """`newton_schulz` of each of the same-shape matrices (or same-shape stacks) `ms`, as one batch: the same ops
    with `bmm` (`baddbmm`) in place of `mm` (`addmm`), each matrix divided by its own norm. A single 2-D matrix
    goes through the 2-D ops. On a CPU the batched products equal the single ones bit for bit except for the
    smallest float32/float64 matrices (a 5 x 6 differed by 2e-6 in torch 2.13: another kernel); on a GPU cuBLAS
    may pick other kernels too: equal within rounding."""
    if len(ms) == 1:
        return [newton_schulz(ms[0], steps, eps, dtype, safety, precondition)]
    rows, cols = ms[0].shape[-2:]
    x = torch.cat([m.reshape(-1, rows, cols) for m in ms])
    out = newton_schulz(x, steps, eps, dtype, safety, precondition)
    return [o.reshape(m.shape) for o, m in zip(out.split([m.numel() // (rows * cols) for m in ms]), ms)]


def momentum_(ctx: Step, bufs: list[torch.Tensor], updates: list[torch.Tensor], beta: float, nesterov: bool,
              copy: bool = True, cache: dict | None = None) -> list[torch.Tensor]:
    """torch.optim.Muon's momentum, per tensor: `b <- lerp(b, u, 1 - beta)`; the direction is
    `lerp(u, b, beta)` (Nesterov) or `b` (a copy unless `copy=False`). On a step the device skips
    (`ctx.skip`) every buffer keeps its old value, bit for bit, and a non-finite `u` never enters it.

    How a skipped step keeps the buffer, without a host sync:

    * float32/float64 (`clean_skip(b, u)`): `u` is multiplied by 1 (a step that goes ahead: `u` itself,
      bit for bit) or NaN (a skipped one), its NaNs and infinities set to 0 (so `+0.0` everywhere on a
      skipped step), and the buffer takes the in-place lerp with a 0-d weight: `1 - beta` (bit for bit the
      Python float's lerp) or `-0.0`, and `b + (-0)(+0 - b)` is `b` exactly, a `-0.0` element included.
      The Nesterov direction is the in-place lerp of that tensor with a 0-d weight `beta` or `+0.0`: `+0.0`
      everywhere on a skipped step, which Newton-Schulz maps to `+0.0` (`Muon.apply_final` relies on it).
      Plain vectorized kernels: on a CPU `torch.where` runs about five times slower per element than a lerp;
    * other dtypes: the lerp on a new tensor (bit for bit the in-place one) and a `where` that keeps the
      old buffer (a 0-d weight of a half dtype would round `1 - beta` where torch's float does not).

    `cache` (a dict, per step and group) keeps the 0-d factors, made once per dtype."""
    out = []
    cache = {} if cache is None else cache
    for b, u in zip(bufs, updates):
        if ctx.skip is None:
            b.lerp_(u, 1 - beta)
        elif clean_skip(b, u):
            keep, weight, nesterov_weight = _skip_weights(ctx.skip, b, beta, cache)
            clean = torch.nan_to_num_(u * keep, nan=0.0, posinf=0.0, neginf=0.0)  # (a new tensor)
            b.lerp_(clean, weight)
            if nesterov:
                out.append(clean.lerp_(b, nesterov_weight))
                continue
        else:  # the same lerp on a new tensor (bit for bit the in-place one), the old buffer where skipped
            torch.where(ctx.skip, b, torch.lerp(b, u, 1 - beta), out=b)  # (an exact overlap: elementwise)
        out.append(u.lerp(b, beta) if nesterov else b.clone() if copy else b)
    return out


def clean_skip(b: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether `momentum_` keeps buffer `b` on a skipped step by arithmetic (float32/float64) rather than a
    `where`; with Nesterov its direction is then `+0.0` everywhere on such a step."""
    return b.dtype in (torch.float32, torch.float64) and u.dtype == b.dtype


def _skip_weights(skip: torch.Tensor, b: torch.Tensor, beta: float, cache: dict) -> tuple[torch.Tensor, ...]:
    """The 0-d factors of `momentum_`'s arithmetic path, in `b`'s dtype, made once per dtype and beta:
    `(1, 1 - beta, beta)` on a step that goes ahead, `(NaN, -0.0, +0.0)` on one the device skips."""
    key = ("momentum", b.dtype, b.device, beta)
    f = cache.get(key)
    if f is None:
        def pick(skipped: float, ahead: float) -> torch.Tensor:
            return torch.where(skip, torch.full((), skipped, dtype=b.dtype, device=b.device),
                               torch.full((), ahead, dtype=b.dtype, device=b.device))

        f = cache[key] = (pick(math.nan, 1.0), pick(-0.0, 1 - beta), pick(0.0, beta))
    return f


def laid_out_like(u: torch.Tensor, o: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`o` (the orthogonalized matrix of `u`, possibly a transposed view) as a new tensor with `u`'s shape,
    dtype and memory layout, times `scale`. Never a transposed view: torch's fused optimizer kernels read
    a gradient's memory as if it had the parameter's strides (torch 2.13), so a view would be misread."""
    out = torch.empty_like(u)
    out.copy_(placed_like(o.reshape(u.shape), u))
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        out.mul_(scale)
    return out


def _decay_factor(cache: dict, skip: torch.Tensor, lr_wd: float, p: torch.Tensor) -> torch.Tensor:
    """`1 - lr_wd` as a 0-d tensor of `p`'s dtype on a step that goes ahead, `1` on one the device skips
    (made once per dtype and group: `cache`). For float32/float64 `p.mul_` by it is `p.mul_(1 - lr_wd)` bit
    for bit: torch rounds the Python float to the parameter's dtype too."""
    f = cache.get(p.dtype)
    if f is None:
        f = cache[p.dtype] = torch.where(skip, torch.ones((), dtype=p.dtype, device=skip.device), 1 - lr_wd)
    return f


def _zero(cache: dict, o: torch.Tensor) -> torch.Tensor:
    """A 0-d zero of `o`'s dtype on its device, made once per dtype and group (`cache`): a `where` with it
    launches no scalar op per tensor."""
    key = ("zero", o.dtype)
    z = cache.get(key)
    if z is None:
        z = cache[key] = torch.zeros((), dtype=o.dtype, device=o.device)
    return z


def _zeros_like_update(updates):
    return lambda i, p: torch.zeros_like(updates[i], memory_format=torch.preserve_format)


class _Matrices(ShapeDependent, abstract=True):
    """The `batch_dims` field of every transform that reads a parameter as a matrix, and its build-time check.

    `batch_dims` is the number of leading dims that index a batch of matrices (`as_matrix`): an expert
    stack `(E, out, in)` takes 1 (`E` matrices `out x in`), a stack `(L, E, out, in)` takes 2. Every
    per-matrix rule (the orthogonalization, a norm, per-row statistics, the shape factor) then acts on each
    matrix alone. None (default) is the convolution reading, `reshape(shape[0], -1)`, with a `mo.LintWarning`
    at build for each parameter of 3 or more dims it reads so; 0 is that reading chosen (no warning)."""

    batch_dims: Optional[int] = Field(None, ge=0, le=8)

    def shape_dependence(self) -> str | None:
        """A matrix reading is the shape itself (a 1-D piece is no matrix: it would pass through unchanged)."""
        return "reads each parameter as a matrix (or a stack of them, batch_dims)"

    def matrix(self, t: torch.Tensor) -> torch.Tensor | None:
        """`as_matrix(t, batch_dims)`: the 2-D matrix, the `(B, rows, cols)` stack, or None (left as it is)."""
        return as_matrix(t, self.batch_dims)

    def _takes_split_stack(self, p: torch.Tensor) -> bool:
        """Whether this transform steps the DTensor stack `p` split inside its matrices (checked when the
        optimizer is built): no rule but the owner-rank orthogonalization sees a whole matrix there."""
        return False

    def check_params(self, named: list[tuple[str | None, torch.Tensor]]) -> None:
        """Refuse a DTensor stack split inside its matrices that this transform cannot step (`_takes_split_stack`),
        and warn (`mo.LintWarning`, once per transform) about the parameters it reads in a way that was not
        chosen: 3 or more dims with `batch_dims=None` (one flattened matrix, the convolution reading), or 2 or
        more dims that `batch_dims` leaves without a matrix (left unchanged). Each is named with its shape and
        the reading used."""
        import warnings

        from ..core.plan import LintWarning
        from ..core.torch_checkpoint import caller_stacklevel

        def label(i: int, name: str | None) -> str:
            return repr(name) if name is not None else f"#{i} (unnamed)"

        name = type(self).__name__
        if self.batch_dims is None:
            flat = [f"{label(i, n)} {tuple(p.shape)} as {p.shape[0]} x {p.numel() // max(p.shape[0], 1)}"
                    for i, (n, p) in enumerate(named) if p.dim() >= 3 and p.numel() > 0]
            if flat:
                shown = "; ".join(flat[:8]) + (f"; ... ({len(flat) - 8} more)" if len(flat) > 8 else "")
                warnings.warn(
                    f"{name} reads {len(flat)} parameter(s) of 3 or more dims as one matrix each, "
                    f"(shape[0], prod(shape[1:])), the convolution reading: {shown}. For a stack of matrices (an "
                    f"expert stack (E, out, in)) set batch_dims=1, per parameter with "
                    f"mo.Masked(mo.{name}(batch_dims=1), where='*.experts.*'); batch_dims=0 keeps this reading "
                    "without this warning (modopt.LintWarning)", LintWarning, stacklevel=caller_stacklevel())
            return
        k = self.batch_dims
        for i, (n, p) in enumerate(named):
            if (k and p.dim() - k >= 2 and is_sharded(p) and not whole_blocks_here(p, k)
                    and not self._takes_split_stack(p)):
                raise ValueError(
                    f"modopt: parameter {label(i, n)} {tuple(p.shape)} is a stack of matrices split inside them "
                    f"over the ranks ({', '.join(map(str, p.placements))}): {name}(batch_dims={k}) takes each "
                    "matrix's statistics, which no rank holds whole. Split the stack on its first "
                    f"{k} dim(s) only (expert parallel: each rank whole matrices), keep it replicated, or give it "
                    "Orthogonalize or Muon (sharded='owner'), which gather each matrix on one rank")
        idle = [f"{label(i, n)} {tuple(p.shape)}" for i, (n, p) in enumerate(named)
                if p.dim() >= 2 and p.dim() - k < 2 and p.numel() > 0]
        if idle:
            shown = "; ".join(idle[:8]) + (f"; ... ({len(idle) - 8} more)" if len(idle) > 8 else "")
            warnings.warn(
                f"{name}(batch_dims={k}) reads {len(idle)} parameter(s) of fewer than {k + 2} dims as no matrix "
                f"(their first {k} dim(s) index the batch, and what is left has fewer than 2), so treats them as it "
                f"treats a bias: {shown}. Select only the stacks for batch_dims={k} (mo.Masked), and give the "
                "others a transform with batch_dims=None (modopt.LintWarning)", LintWarning,
                stacklevel=caller_stacklevel())


def _refuse_sharded_stacks(t: _Matrices, updates: list[torch.Tensor]) -> None:
    """Raise when a DTensor (FSDP2, tensor or expert parallel) update is read as a stack of matrices by a path
    that would take its statistics over the whole tensor: only `Orthogonalize` and `Muon` with `sharded="owner"`
    orthogonalize sharded stacks (each on its owner rank)."""
    k = t.batch_dims or 0
    bad = [tuple(u.shape) for u in updates if k and is_sharded(u) and u.dim() - k >= 2]
    if bad:
        raise NotImplementedError(
            f"{type(t).__name__}(batch_dims={k}) got DTensor (sharded) update(s) of shape {bad[0]}: its per-matrix "
            "statistics of sharded stacks are not implemented; Orthogonalize and Muon with sharded='owner' "
            "orthogonalize them, or keep the stacks unsharded (replicated) for this transform")


def blockwise(t: _Matrices, updates: list[torch.Tensor], rule: Any) -> list[torch.Tensor]:
    """`rule(u)` for each update (its new update, or None to leave it as it is), for a stateless per-matrix rule.
    A DTensor stack split only on its batch dims (each rank holds whole matrices: an expert stack split on its
    expert dim, `whole_blocks_here`) runs the rule on this rank's matrices where they lie, with no communication,
    the result laid out as the update; another sharded stack is refused (`_refuse_sharded_stacks`)."""
    if not any_sharded(updates):
        return [u if r is None else r for u, r in zip(updates, map(rule, updates))]
    k = t.batch_dims or 0
    _refuse_sharded_stacks(t, [u for u in updates if not whole_blocks_here(u, k)])
    out = []
    for u in updates:
        here = whole_blocks_here(u, k)
        r = rule(local(u) if here else u)
        out.append(u if r is None else like_dtensor(r, u) if here else r)
    return out


#: the schedules by (coefficients, steps, past_end): read on every matrix of every step
_STEPS: dict[tuple[Any, int, str], list[tuple[float, float, float]]] = {}


class _NewtonSchulz(_Matrices, abstract=True):
    """The Newton-Schulz fields shared by `Orthogonalize`, `Muon` and `AdaMuon`."""

    ns_coefficients: Union[NSPreset, Coefficients, list[Coefficients]] = NS_COEFFICIENTS
    ns_steps: int = Field(5, ge=0, lt=100)
    ns_safety: Optional[float] = Field(None, ge=1.0, allow_inf_nan=False)
    eps: PositiveFloat = 1e-7
    ns_dtype: NSDtype = "bfloat16"
    ns_past_end: PastEnd = "repeat"
    ns_preconditioning: Preconditioning = "frobenius"

    @model_validator(mode="after")
    def _one_triple_per_step(self):
        c = self.ns_coefficients
        if isinstance(c, list) and len(c) != self.ns_steps:
            raise ValueError(f"ns_coefficients lists {len(c)} (a, b, c) triples, one per step, but ns_steps is "
                             f"{self.ns_steps}: give one triple (used for every step) or ns_steps={len(c)}")
        if isinstance(c, str) and self.ns_steps < NS_PRESETS[c][2]:
            raise ValueError(f"ns_coefficients={c!r} is a {NS_PRESETS[c][2]}-step schedule (eight fast steps, then "
                             f"two that settle the singular values): ns_steps must be at least {NS_PRESETS[c][2]}, "
                             f"got {self.ns_steps}")
        return self

    def safety(self) -> float:
        """The factor the input's Frobenius norm is multiplied by before the iteration: `ns_safety`, or the
        preset's own when it is None (1.02 for `"polar_express"`, 1.01 for `"polar_express_paper"`, else 1)."""
        if self.ns_safety is not None:
            return self.ns_safety
        return NS_PRESETS[self.ns_coefficients][1] if isinstance(self.ns_coefficients, str) else 1.0

    def norm_floor(self) -> float:
        """The floor of the (safety-scaled) norm the input is divided by: `eps` (`AdaMuon`: `ns_eps`)."""
        return self.eps

    def coefficient_steps(self) -> list[tuple[float, float, float]]:
        """One `(a, b, c)` per step: `ns_coefficients` over `ns_steps`, a preset continued by `ns_past_end`.
        Made once per (coefficients, steps, past_end) and shared (callers only read it); a list of triples
        (unhashable) is made on each call."""
        key = (self.ns_coefficients, self.ns_steps, self.ns_past_end)
        try:
            steps = _STEPS.get(key)
        except TypeError:
            return coefficient_steps(*key)
        if steps is None:
            steps = _STEPS[key] = coefficient_steps(*key)
        return steps

    def orthogonalized(self, m: torch.Tensor) -> torch.Tensor:
        """Newton-Schulz of the matrix `m`, in `ns_dtype` (torch.optim.Muon's op order)."""
        return newton_schulz(m, self.coefficient_steps(), self.norm_floor(), _DTYPES[self.ns_dtype], self.safety(),
                             self.ns_preconditioning)

    def keeps_positive_zero(self) -> bool:
        """Whether `orthogonalized` maps a matrix of `+0.0` to `+0.0` exactly: `x / max(0, eps)` is `+0.0` (with a
        preconditioning, `+0.0` times a finite scale), and each step's `a x + (b A + c A A) x` is `(+0) + (±0)`,
        which is `+0.0`, when `a > 0`."""
        return all(a > 0 for a, _, _ in self.coefficient_steps())


class _OwnerRank(_NewtonSchulz, abstract=True):
    """The `sharded` field of `Orthogonalize` and `Muon`: how a matrix sharded by FSDP2 is orthogonalized."""

    sharded: Literal["owner", "dtensor"] = "owner"

    def _takes_split_stack(self, p: torch.Tensor) -> bool:
        """The owner path gathers each matrix of a stack split inside them on one rank (a layout `owner_split`
        takes); the DTensor path does not."""
        return self.sharded == "owner" and owner_split(p) is not None

    def _owner_orthogonalized(self, directions: list[torch.Tensor | None],
                              out_dtypes: list[torch.dtype | None]) -> dict[int, torch.Tensor]:
        """`{i: this rank's shard of NS(full direction i), shaped as the direction's shard, in out_dtypes[i]}` for
        each sharded matrix-shaped direction that the owner path takes (`sharded="owner"`, eager, a layout that
        `owner_split` accepts); the others are left to the per-matrix path (`{}`: all of them)."""
        if torch.compiler.is_compiling() or not any_sharded(directions):
            return {}
        k = self.batch_dims or 0
        # expert parallel: a stack split over its batch dims only holds whole matrices on each rank, which are
        # orthogonalized where they are (no communication, either `sharded` mode)
        here = [i for i, d in enumerate(directions)
                if d is not None and d.dim() - k >= 2 and d.numel() > 0 and whole_blocks_here(d, k)]
        whole = set(here)  # (a set: thousands of expert matrices are looked up once each)
        idx = [] if self.sharded != "owner" else [
            i for i, d in enumerate(directions)
            if d is not None and d.dim() - k >= 2 and d.numel() > 0 and i not in whole and owner_split(d) is not None]
        if not idx and not here:
            return {}
        nsd = _DTYPES[self.ns_dtype]
        steps, eps, safety = self.coefficient_steps(), self.norm_floor(), self.safety()

        def narrow(dt: torch.dtype) -> torch.dtype:  # a cast to the narrower dtype on the sender is the same op
            return nsd if nsd.itemsize <= dt.itemsize else dt

        def orthogonalize_all(fulls: list[torch.Tensor]) -> list[torch.Tensor]:
            res: list[torch.Tensor | None] = [None] * len(fulls)
            by_shape: dict[tuple, list[int]] = {}
            for j, f in enumerate(fulls):
                by_shape.setdefault(tuple(f.shape), []).append(j)
            for js in by_shape.values():
                outs = newton_schulz_batched([self.matrix(fulls[j]) for j in js], steps, eps, nsd, safety,
                                             self.ns_preconditioning)
                for j, o in zip(js, outs):
                    res[j] = o.reshape(fulls[j].shape)
            return res  # type: ignore[return-value]

        out: dict[int, torch.Tensor] = {}
        for i in here:  # the owner path's casts and kernels, on this rank's whole matrices
            x = local(directions[i])
            out[i] = (orthogonalize_all([x.to(narrow(x.dtype))])[0] if x.numel() else x).to(out_dtypes[i] or nsd)
        if idx:
            wire_in = [narrow(directions[i].dtype) for i in idx]
            wire_out = [out_dtypes[i] or nsd for i in idx]
            out.update(zip(idx, owner_apply([directions[i] for i in idx], orthogonalize_all, wire_in, wire_out)))
        return out


class Orthogonalize(_OwnerRank):
    r"""Replace each matrix-shaped update by its Newton-Schulz orthogonalization (Muon's step direction).

    With $X$ the update as a matrix, transposed to be wide if it is tall, and
    $A = X X^\top$:

    $$
    X_0 = \frac{X}{\max(\lVert X \rVert_F, \varepsilon)}, \qquad
    X_{k+1} = a X_k + (b A_k + c A_k^2) X_k, \qquad
    u \leftarrow r \cdot X_{\text{ns\_steps}}
    $$

    which maps each singular value $\sigma \le 1$ of $X_0$ through the odd
    polynomial $a\sigma + b\sigma^3 + c\sigma^5$, `ns_steps` times, and keeps the
    singular vectors: it approximates the polar factor $U V^\top$ of
    $X = U \Sigma V^\top$. With torch's coefficients five steps leave the
    singular values between about 0.7 and 1.2, not at 1 (see
    docs/modules/orthogonal.md for the measured spread).

    Defaults: torch.optim.Muon's `ns_coefficients=(3.4445, -4.775, 2.0315)`
    (one triple for every step, or a list of `ns_steps` triples, one per step),
    `ns_steps=5`, `eps=1e-7`, computed in `ns_dtype="bfloat16"` (torch's and
    Keller Jordan's choice; `"float32"`/`"float64"` for accuracy) and cast back
    to the update's dtype. Under FSDP2, `sharded="owner"` (default) orthogonalizes
    each sharded matrix once on an owner rank (two `all_to_all`s a step, bit for bit
    the single-process result); `"dtensor"` uses DTensor's sharded matrix products
    (docs/howto/distributed.md). `adjust_lr` scales the result by torch.optim.Muon's
    per-shape factor $r$ of a `rows x cols` matrix: `"none"` (default, 1),
    `"original"` $\sqrt{\max(1, \text{rows}/\text{cols})}$, `"match_rms_adamw"`
    $0.2\sqrt{\max(\text{rows}, \text{cols})}$ (Moonlight).

    Shapes: a tensor with more than 2 dims is orthogonalized as
    `reshape(shape[0], -1)` (a conv weight `(out, in, kh, kw)` as
    `(out, in*kh*kw)`, Keller Jordan's rule; torchzero batches over the trailing
    dims instead). `batch_dims=k` reads the first `k` dims as a batch of matrices
    (an expert stack `(E, out, in)` with `batch_dims=1`: `E` matrices, each
    orthogonalized alone and scaled by its own `r`, in one batched Newton-Schulz);
    None (default) warns at build about each parameter of 3 or more dims it
    flattens, 0 flattens without the warning. Tensors with 0 or 1 dims (biases, gains, scalars) and empty
    tensors pass through unchanged: route them to another optimizer with
    `mo.Masked`. The rule is scale-invariant (up to `eps`): a positive scale of
    the whole update before it (a norm clip) has no effect. Reproduces the
    orthogonalization of torch.optim.Muon (bit for bit in the default bfloat16)
    and, with torchzero's per-step coefficients, torchzero's `Orthogonalize`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2, 2)); p.grad = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    >>> opt = mo.Modular([p], mo.Orthogonalize(), mo.LR(1.0)); opt.step()
    >>> (-p.data).diag()   # singular values 3 and 1 both moved near 1 (the polar factor U V^T is I)
    tensor([0.7500, 1.1328])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # stateless: keeps its (no) state on a step the device skips

    adjust_lr: AdjustLR = "none"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Replace each matrix-shaped update by its Newton-Schulz orthogonalization (others pass through)."""
        out = list(updates)
        nsd = _DTYPES[self.ns_dtype]  # (FSDP2: the result comes back in the narrower of ns_dtype and u's dtype)
        owned = self._owner_orthogonalized(updates, [nsd if nsd.itemsize <= u.dtype.itemsize else u.dtype
                                                     for u in updates])
        for i, u in enumerate(updates):
            m = as_matrix(u, self.batch_dims)
            if m is None:
                continue
            r = adjust_ratio(m.shape[-2], m.shape[-1], self.adjust_lr)  # (each matrix's own shape)
            if i in owned:  # this rank's shard of the owner's result: the same cast and product, on the shard
                out[i] = like_dtensor(laid_out_like(local(u), owned[i], r), u)
                continue
            if self.batch_dims:
                _refuse_sharded_stacks(self, [u])
            out[i] = laid_out_like(u, self.orthogonalized(m), r)  # cast to u's dtype, then times r
        return out


class Momentum(Transform):
    r"""Exponential moving average of the updates, with Nesterov's look-ahead: torch.optim.Muon's momentum.

    $$
    b \leftarrow \beta b + (1-\beta) u, \qquad
    u \leftarrow \begin{cases} (1-\beta) u + \beta b & \text{nesterov} \\ b & \text{otherwise} \end{cases}
    $$

    computed as torch does (`b.lerp_(u, 1 - beta)`, then `u.lerp(b, beta)`),
    with `b` starting at zero and kept per parameter (`momentum_buffer`).
    Defaults: `beta=0.95`, `nesterov=True` (torch.optim.Muon's and Keller
    Jordan's). The EMA form is `(1 - beta)` times SGD's heavy-ball buffer
    `b <- beta b + u` (Moonlight's Muon); in front of `Orthogonalize`, which is
    scale-invariant, the two give the same direction.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1)); p.grad = torch.tensor([1.0])
    >>> opt = mo.Modular([p], mo.Momentum(0.5, nesterov=False), mo.LR(1.0))
    >>> opt.step(); opt.step(); p.data   # b = 0.5, then 0.75
    tensor([-1.2500])

    ```
    """

    positional: ClassVar[str | None] = "beta"
    device_skip = True  # keeps its buffers on a step the device skips (momentum_; zeros start like torch's)

    beta: float = Field(0.95, ge=0.0, lt=1.0)
    nesterov: bool = True
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"momentum_buffer": "param"}

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Update the momentum buffers; the (Nesterov) momentum direction."""
        bufs = st.buffers("momentum_buffer", _zeros_like_update(updates))
        return momentum_(ctx, bufs, updates, self.beta, self.nesterov)


class OrthoGrad(Scoped):
    r"""Remove the component of the update parallel to its weight, then restore the update's norm (⊥Grad).

    Per segment of the scope, with $w$ the parameters' values:

    $$
    u_\perp = u - \frac{\langle w, u \rangle}{\langle w, w \rangle + \varepsilon}\, w, \qquad
    u \leftarrow u_\perp \cdot \frac{\lVert u \rVert_2}{\lVert u_\perp \rVert_2}
    $$

    (the rescale only with `renormalize=True`). A segment whose $u_\perp$ is
    zero (a zero update, or one parallel to the weight) becomes zero instead of
    NaN. Defaults: `eps=1e-8` (torchzero's `OrthoGrad`; the paper's
    implementation uses 1e-30), `renormalize=True`, `scope="tensor"` (one
    projection per parameter tensor, as in Prieto et al. 2025, "Grokking at the
    Edge of Numerical Stability", arXiv:2501.04697); `scope="global"` is
    torchzero's `OrthoGrad()`, which projects the concatenation of all
    parameters. Every scope works, `dim` too (one projection per slice). Dot
    products and norms accumulate in at least float32.

    `min_size=2`: a one-element segment (a scalar parameter) is left as it is.
    Its update is always parallel to its weight, so the exact rule returns it
    unchanged when `eps > 0` (the remainder `u eps / (w^2 + eps)` rescaled to
    `|u|`); computed, that remainder is rounding noise. Close to parallel, in
    general, the rescale magnifies rounding by `|u| / |u_perp|`. A dot product or
    norm that overflows its accumulation dtype (float32 for float32 and half
    tensors: values beyond about 1e19) leaves the segment unprojected, or not
    rescaled, instead of NaN.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.tensor([1.0, 0.0])); p.grad = torch.tensor([3.0, 4.0])
    >>> opt = mo.Modular([p], mo.OrthoGrad(), mo.LR(1.0)); opt.step(); p.data   # u_perp = (0, 4), norm 5
    tensor([ 1., -5.])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # stateless

    eps: NonNegativeFloat = 1e-8
    renormalize: bool = True
    scope: ScopeName = "tensor"
    min_size: int = Field(2, ge=1)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Remove from each segment its component along the parameter (optionally keeping its norm)."""
        seg = st.segments(self)
        params = [p.detach() for p in ctx.params]

        def products(xs, ys):  # elementwise products in the accumulation dtype (no half-precision rounding)
            return [x.to(acc_dtype(x.dtype)) * y.to(acc_dtype(x.dtype)) for x, y in zip(xs, ys)]

        dot = seg.reduce(products(updates, params), "sum")
        ww = seg.reduce(products(params, params), "sum")
        coef = dot / (ww + self.eps)
        coef = torch.where(torch.isfinite(coef), coef, 0.0)  # 0/0 (a zero weight, eps=0) or an overflow: 0
        out = list(updates)
        for i, c in enumerate(seg.expand(coef)):
            if seg.active[i]:
                u = updates[i]
                out[i] = torch.addcmul(u.to(c.dtype), params[i].to(c.dtype), -c).to(u.dtype)
        if self.renormalize:
            before = seg.reduce(updates, 2.0)
            after = seg.reduce(out, 2.0)  # (new tensors: never a norm memo entry of the updates)
            scale = before / after  # 0/0 (nothing left), x/0, or norms that overflowed: no rescale
            seg.mul_(out, torch.where(torch.isfinite(scale), scale, 1.0))
        return out


class Muon(_OwnerRank, Planned):
    r"""Muon: momentum, Newton-Schulz orthogonalization and a decoupled weight decay; `torch.optim.Muon`, bit for bit.

    Per parameter, with $g$ the update entering it (the gradient):

    $$
    \begin{aligned}
    b &\leftarrow \mu b + (1-\mu) g, \qquad d = (1-\mu) g + \mu b \ \text{(nesterov) or } b \\
    O &= \operatorname{NS}(d) \quad \text{(as `Orthogonalize`)} \\
    p &\leftarrow p\,(1 - \text{lr}\,\lambda) - \text{lr}\cdot r(\text{shape})\; O
    \end{aligned}
    $$

    that is `Chain(Momentum(momentum, nesterov), Orthogonalize(adjust_lr=...), LR(lr))`
    plus the decoupled weight decay $\lambda$ (`weight_decay`), which uses the
    unadjusted lr. `adjust_lr_fn` is torch's: None or `"original"`
    ($r = \sqrt{\max(1, \text{rows}/\text{cols})}$), `"match_rms_adamw"`
    ($r = 0.2\sqrt{\max(\text{rows}, \text{cols})}$: Moonlight's rule, which lets
    Muon reuse AdamW's lr and weight decay). Defaults are torch.optim.Muon's:
    `lr=1e-3`, `weight_decay=0.1`, `momentum=0.95`, `nesterov=True`, the
    Newton-Schulz fields of `Orthogonalize` (`ns_dtype="bfloat16"`, and
    `sharded`, its FSDP2 path).
    Exposes `lr`, `momentum`, `weight_decay`, `nesterov` as group keys.

    As the last transform it writes the parameters in torch's order of operations
    (`p.mul_(1 - lr * wd)`, then `p.add_(O, alpha=-lr * r)`), so it equals
    `torch.optim.Muon` with the same arguments bit for bit (float32, bfloat16 and
    float64 parameters, schedulers included; except bfloat16 with
    `nesterov=False`, where torch divides its momentum buffer in place by its
    norm and modopt keeps the moving average). A step the device skips leaves the
    parameters and the momentum buffers bit for bit as they were, with no host
    sync: for float32/float64 the gradient is multiplied by a 0-d 1 or NaN and
    cleaned of NaNs (zeros on a skipped step), the buffer takes torch's in-place
    lerp with a weight of `1 - momentum` or -0.0, and the parameters torch's
    in-place step with factors that make it a no-op (two passes over the
    gradient more than torch; `momentum_`). Without Nesterov or with coefficients
    whose `a <= 0` a `where` zeroes `O` on a skipped step; for half precision a
    `where` keeps the old values. Elsewhere in a chain (and compiled) it returns the update
    `lr r O + lr λ p`.

    Muon is meant for the hidden 2-D weights: torch refuses other shapes. Here a
    tensor with more than 2 dims is orthogonalized as `reshape(shape[0], -1)`, or with
    `batch_dims=k` as a stack of matrices over its first `k` dims (an expert stack
    `(E, out, in)`: `batch_dims=1`, each expert with its own `r`), and
    a tensor with 0 or 1 dims gets the momentum step without orthogonalization
    ($r = 1$). Route embeddings, the head, norms and biases to `AdamW` with
    `mo.Masked` (docs/modules/orthogonal.md has the recipe).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.ones(2, 2)); p.grad = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    >>> ref = torch.nn.Parameter(torch.ones(2, 2)); ref.grad = p.grad.clone()
    >>> mo.Modular([p], mo.Muon(0.02)).step(); torch.optim.Muon([ref], lr=0.02).step()
    >>> torch.equal(p, ref)
    True

    ```
    """

    positional: ClassVar[str | None] = "lr"
    device_skip = True  # keeps its buffers and the parameters on a step the device skips (momentum_, apply_final)

    lr: NonNegativeFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.1
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    nesterov: bool = True
    adjust_lr_fn: Optional[Literal["original", "match_rms_adamw", "spectral_unclamped"]] = None
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay", "nesterov")
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"momentum_buffer": "param"}

    def make_plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """This layout's groups and momentum buffers (`kernels.GroupPlan`), stepped by `_step`."""
        return kernels.GroupPlan(ctx, st, write, self.group_keys, self._step,
                                 {"momentum_buffer": _zeros_like_update(updates)})

    def traced_step(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """Compiled: the update, which the runner writes (lr a graph input, not a constant); no write."""
        return super().traced_step(ctx, st, updates, write) if not write else False

    def _owner_directions(self, ctx: Step, plan: kernels.GroupPlan, values: list[dict[str, Any]],
                          updates: list[torch.Tensor]) -> tuple[list, dict[int, torch.Tensor], dict[int, dict]]:
        """Under FSDP2 with `sharded="owner"` (eager): every parameter's direction (the momentum buffers updated),
        this rank's shards of the owner-rank orthogonalizations (`_owner_orthogonalized`, in `ns_dtype`), and
        each group's 0-d factors (by the group's first index). `([], {}, {})` otherwise: nothing done."""
        if self.sharded != "owner" or torch.compiler.is_compiling() or not any_sharded(updates):
            return [], {}, {}
        dirs: list = []
        factors: dict[int, dict] = {}
        for v, (a, b, state) in zip(values, plan.groups):
            factors[a] = {}
            dirs.extend(momentum_(ctx, state["momentum_buffer"], updates[a:b], v["momentum"], v["nesterov"],
                                  copy=False, cache=factors[a]))
        return dirs, self._owner_orthogonalized(dirs, [None] * len(dirs)), factors

    def _step(self, ctx: Step, st: TransformState, plan: kernels.GroupPlan, values: list[dict[str, Any]],
              updates: list[torch.Tensor], write: bool) -> list[torch.Tensor] | bool:
        """With `write`: write the parameters (momentum, orthogonalization, weight decay, learning rate), True;
        False for a tensor `lr` (the runner writes the update path's result instead). Else the updates."""
        if not write:
            return self._updates(ctx, plan, values, updates)
        if any(isinstance(v["lr"], torch.Tensor) for v in values):
            return False  # a tensor lr: the update path, which multiplies by it
        skip = ctx.skip
        # FSDP2 with sharded="owner": every direction first, then each sharded matrix orthogonalized once, on
        # its owner rank (one exchange for all of them); else one tensor at a time below
        dirs, owned, group_factors = self._owner_directions(ctx, plan, values, updates)
        for v, (a, b, state) in zip(values, plan.groups):
            lr, wd, mu, nesterov = v["lr"], v["weight_decay"], v["momentum"], v["nesterov"]
            factors: dict[Any, torch.Tensor] = group_factors.get(a, {})
            bufs = state["momentum_buffer"]
            for i, p, buf, u in zip(range(a, b), ctx.params[a:b], bufs, updates[a:b]):
                # one tensor at a time, as torch does: one direction alive at once, not the group's
                (d,) = (dirs[i],) if dirs else momentum_(ctx, [buf], [u], mu, nesterov, copy=False, cache=factors)
                m = as_matrix(d, self.batch_dims)
                if m is None:
                    o, step = d, lr * 1.0
                else:
                    if self.batch_dims and i not in owned:
                        _refuse_sharded_stacks(self, [d])
                    o = like_dtensor(owned[i], p) if i in owned else self.orthogonalized(m)
                    step = lr * adjust_ratio(m.shape[-2], m.shape[-1], self.adjust_lr_fn)
                    if o.shape != p.shape:
                        o = o.reshape(p.shape)
                    o = placed_like(o, p)  # (FSDP2: written into p's own shard)
                if skip is None:  # torch's in-place step
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    p.add_(o, alpha=-step)
                elif wd == 0 or p.dtype in (torch.float32, torch.float64):
                    # torch's in-place step, made a no-op on a skipped step: `p * 1` is `p`, and `p + (-step) * (+0)`
                    # is `p + (-0.0)`, `p` exactly (step >= 0)
                    if wd != 0:
                        p.mul_(_decay_factor(factors, skip, lr * wd, p))
                    if nesterov and clean_skip(buf, u) and (m is None or self.keeps_positive_zero()):
                        p.add_(o, alpha=-step)  # the direction, and so `O`, is +0.0 on a skipped step (momentum_)
                    else:  # `O` zeroed on a skipped step: one pass over it more than torch
                        # (Newton-Schulz's output is this step's own tensor: zeroed in place; a 0-/1-D tensor's
                        # direction may be the momentum buffer itself, so it is zeroed aside)
                        zero = _zero(factors, o)
                        p.add_(torch.where(skip, zero, o, out=o) if m is not None else torch.where(skip, zero, o),
                               alpha=-step)
                else:
                    # half precision: a 0-d factor would be rounded to the parameter's dtype where torch's float is
                    # not, so the same two ops on a new tensor (bit for bit the in-place ones), the old values kept
                    new = p.mul(1 - lr * wd)
                    new.add_(o, alpha=-step)
                    torch.where(skip, p, new, out=p)
        return True

    def _updates(self, ctx: Step, plan: kernels.GroupPlan, values: list[dict[str, Any]],
                 updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """The Muon step as updates."""
        out: list[torch.Tensor] = []
        dirs, owned, _ = self._owner_directions(ctx, plan, values, updates)
        for v, (a, b, state) in zip(values, plan.groups):
            lr = kernels.lr_value(v["lr"], updates[a]) if b > a else v["lr"]
            wd = v["weight_decay"]
            ds = dirs[a:b] if dirs else momentum_(ctx, state["momentum_buffer"], updates[a:b], v["momentum"],
                                                   v["nesterov"], copy=False)
            for i, p, d in zip(range(a, b), ctx.params[a:b], ds):
                m = as_matrix(d, self.batch_dims)
                if m is None:
                    u = d * lr
                else:
                    r = adjust_ratio(m.shape[-2], m.shape[-1], self.adjust_lr_fn)
                    if self.batch_dims and i not in owned:
                        _refuse_sharded_stacks(self, [d])
                    u = (like_dtensor(laid_out_like(local(d), owned[i], lr * r), d) if i in owned
                         else laid_out_like(d, self.orthogonalized(m), lr * r))
                if wd != 0:
                    u = u + p.detach() * (lr * wd)
                out.append(u)
        return out


class NorMuon(_Matrices, Segmented):
    r"""NorMuon's per-neuron normalization of an orthogonalized update (Li et al. 2025, arXiv 2510.05491).

    Placed after `Orthogonalize`, per matrix-shaped update $O$ (a tensor with
    more than 2 dims as `reshape(shape[0], -1)`; with `batch_dims=k` each matrix of
    a stack over the first `k` dims, its own $v$: shape `(E, rows, 1)` for an expert
    stack), with a second moment $v$ per row (per output neuron of a `Linear` weight):

    $$
    v \leftarrow \beta_2 v + (1-\beta_2)\,\operatorname{mean}_{\text{row}}(O \odot O), \qquad
    \tilde O = \frac{O}{\sqrt{v} + \varepsilon}, \qquad
    O \leftarrow \tilde O \cdot \frac{\lVert O \rVert_F}{\lVert \tilde O \rVert_F + \varepsilon}
    $$

    ($v$ starts at zero, no bias correction): every neuron's step gets the same
    scale over time, and the update keeps the Frobenius norm it had after
    orthogonalization. Tensors with 0 or 1 dims and empty tensors pass through
    unchanged (no state). The rule is computed in at least float32 and cast back
    to the update's dtype; $v$ is kept in that precision (`second_moment`, one
    value per row or column).

    Defaults are the official code's (ShizukaKuze/NorMuon `normuon.py`) and
    pytorch_optimizer's `NorMuon`: `beta2=0.95`, `eps=1e-10`, `per="row"`. The
    parity traps: microsoft/dion's NorMuon uses `eps=1e-8` (and a clamp, not a
    sum, in the rescale); karpathy/nanochat keeps one value per index of the
    larger dimension, i.e. the mean over the smaller dimension (`per="larger"`:
    per row of a tall or square matrix, per column of a wide one) and floors $v$
    at `1e-10` before its square root where the paper adds $\varepsilon$ after it.
    The scale is preserved, so `Orthogonalize(adjust_lr=...)` before it and
    `LR` after it compose as in the reference: NorMuon is
    `Chain(Momentum(0.95), Orthogonalize(adjust_lr="original"), NorMuon(), LR(lr))`.
    A step the device skips keeps $v$ bit for bit (no host sync). Under FSDP2 or
    tensor parallelism the row sums are all-reduced; an expert stack split on its
    expert dim keeps each expert's $v$ on the rank that holds the expert.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2, 2)); p.grad = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    >>> opt = mo.Modular([p], mo.Orthogonalize(ns_dtype="float64"), mo.NorMuon(), mo.LR(1.0)); opt.step()
    >>> (-p.data).diag()   # both rows now have the same size, the Frobenius norm is kept
    tensor([0.9624, 0.9624])

    ```
    """

    positional: ClassVar[str | None] = "beta2"
    device_skip = True  # keeps its second moments on a step the device skips (a where on the small buffer)

    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: PositiveFloat = 1e-10
    per: Literal["row", "larger"] = "row"
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"second_moment": Buffer("segment", low=0)}

    def per_row(self, rows: int, cols: int) -> bool:
        """Whether a `rows x cols` matrix keeps one second moment per row (else one per column)."""
        return self.per == "row" or rows >= cols

    def segment_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """The shape of a parameter's second moment: `(rows, 1, ...)` per row, `(1, *shape[1:])` per column;
        with `batch_dims=k` one such per matrix: `shape[:k] + (rows, 1, ...)`, `shape[:k] + (1, *shape[k+1:])`."""
        k = self.batch_dims or 0
        if p.dim() - k < 2:
            return ()
        if self.per_row(p.shape[k], math.prod(p.shape[k + 1:])):
            return per_row_shape(p, k)
        return per_column_shape(p, k)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Normalize each matrix-shaped update per row (or column) by its second moment, keeping its norm."""
        here: list[bool] | None = None  # (None: no DTensor, every update is computed below as it is)
        out = list(updates)
        if any_sharded(updates):
            # a stack split only on its batch dims (an expert stack on its expert dim) holds whole matrices on
            # each rank: the rule runs on them where they lie (eager); the other DTensors take the sharded path
            k = 0 if torch.compiler.is_compiling() else self.batch_dims or 0
            here = [not is_sharded(u) or whole_blocks_here(u, k) for u in updates]
            if not all(here):
                out = self._apply_sharded(ctx, st, updates, here)
        key = value_key(st.key, "second_moment")
        states = ctx.param_states()
        for i, u in enumerate(updates):
            if here is not None:
                if not here[i]:
                    continue
                u = local(u)
            m = self.matrix(u)
            if m is None:
                continue
            acc = acc_dtype(u.dtype)
            rows, cols = m.shape[-2:]
            row = self.per_row(rows, cols)
            v = states[i].get(key)
            if v is None:
                v = torch.zeros(self.segment_shape(u), dtype=acc, device=u.device)
                w = updates[i]  # (a stack whole on this rank: its moments split as the stack is, on the batch dims)
                states[i][key] = v if u is w else dtensor_of(v, w.device_mesh, w.placements, self.segment_shape(w))
            v = local(v)
            vm = v.view(m.shape[:-2] + ((rows, 1) if row else (1, cols)))
            x = m.to(acc)
            norm = frobenius(x)  # (each matrix's own: a stack's norms are (B, 1, 1))
            mean_sq = x.square().mean(dim=-1 if row else -2, keepdim=True)
            if ctx.skip is None:
                vm.lerp_(mean_sq, 1 - self.beta2)
            else:  # the same lerp on a new tensor (bit for bit the in-place one), the old values where skipped
                torch.where(ctx.skip, vm, torch.lerp(vm, mean_sq, 1 - self.beta2), out=vm)
            y = x / (vm.sqrt() + self.eps)
            y = y * (norm / (frobenius(y) + self.eps))
            out[i] = laid_out_like(u, y) if u is updates[i] else like_dtensor(laid_out_like(u, y), updates[i])
        return out

    def _apply_sharded(self, ctx: Step, st: TransformState, updates: list[torch.Tensor],
                       done: list[bool]) -> list[torch.Tensor]:
        """`apply` for DTensor updates (FSDP2, tensor parallel): the same rule on each rank's block. The second
        moment is a DTensor split as the update's rows (per row) or columns (per column) are and replicated over
        the other mesh dims; each row's (column's) sum of squares is all-reduced over the mesh dims that split its
        columns (rows), and the two Frobenius norms are those of the full matrices (`tensor_pnorms`). The updates
        `done` marks (plain tensors, stacks whole on each rank) are left to `apply`."""
        from torch.distributed.tensor import Replicate

        out = list(updates)
        key = value_key(st.key, "second_moment")
        states = ctx.param_states()
        idx = [i for i, u in enumerate(updates) if not done[i] and as_matrix(u) is not None]
        if not idx:
            return out
        _refuse_sharded_stacks(self, [updates[i] for i in idx])
        acc = torch.float64 if any(acc_dtype(updates[i].dtype) == torch.float64 for i in idx) else torch.float32
        norms = tensor_pnorms([updates[i] for i in idx], 2.0, acc)
        ys: list[torch.Tensor] = []
        for i in idx:
            u = updates[i]
            x = local(u).to(acc_dtype(u.dtype)).reshape(local(u).shape[0], math.prod(local(u).shape[1:]))
            rows, cols = as_matrix(u).shape if not is_sharded(u) else (u.shape[0], u.numel() // max(u.shape[0], 1))
            row = self.per_row(rows, cols)
            across: list = []  # the groups of the mesh dims that split the dims this statistic sums over
            v = states[i].get(key)
            if is_sharded(u):
                mesh = u.device_mesh
                keep = []
                for md, pl in enumerate(u.placements):
                    splits_rows = not pl.is_replicate() and pl.dim % u.dim() == 0
                    if not pl.is_replicate() and splits_rows != row:
                        across.append(mesh.get_group(md))
                    keep.append(pl if not pl.is_replicate() and splits_rows == row else Replicate())
                if v is None:
                    shape = self.segment_shape(u)
                    lshape = ((x.shape[0],) + (1,) * (u.dim() - 1) if row else (1,) + tuple(local(u).shape[1:]))
                    v = states[i][key] = dtensor_of(torch.zeros(lshape, dtype=x.dtype, device=x.device), mesh, keep,
                                                    shape)
            elif v is None:
                v = states[i][key] = torch.zeros(self.segment_shape(u), dtype=x.dtype, device=u.device)
            vm = local(v).view(-1, 1) if row else local(v).view(1, -1)
            sq = x.square().sum(dim=1 if row else 0, keepdim=True)
            sum_over_(sq, across)
            mean_sq = sq / (cols if row else rows)
            if ctx.skip is None:
                vm.lerp_(mean_sq, 1 - self.beta2)
            else:
                torch.where(ctx.skip, vm, torch.lerp(vm, mean_sq, 1 - self.beta2), out=vm)
            y = (x / (vm.sqrt() + self.eps)).view(local(u).shape)
            ys.append(like_dtensor(y, u) if is_sharded(u) else y)
        ynorms = tensor_pnorms(ys, 2.0, acc)
        for j, (i, y) in enumerate(zip(idx, ys)):
            u = updates[i]
            scale = (norms[j] / (ynorms[j] + self.eps)).to(local(y).dtype)
            res = (local(y) * scale).to(u.dtype)
            out[i] = like_dtensor(res, u) if is_sharded(u) else res
        return out


class AdaMuon(_OwnerRank, Planned):
    r"""AdaMuon (Si et al. 2025, arXiv 2507.11005): Muon with an elementwise second moment of the orthogonalized step.

    Per parameter, with $g$ the update entering it (the gradient), $t$ its step
    and $O$ a `rows x cols` matrix:

    $$
    \begin{aligned}
    m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad O = \operatorname{NS}(m) \\
    v &\leftarrow \beta_2 v + (1-\beta_2)\, O \odot O, \qquad
    \tilde O = \frac{O}{\sqrt{v / (1-\beta_2^t)} + \varepsilon} \\
    p &\leftarrow p\,(1 - \text{lr}\,\lambda) - \text{lr}\cdot r \cdot
        \frac{\sqrt{\min(\text{rows}, \text{cols})}}{\lVert \tilde O \rVert_F + \varepsilon}\, \tilde O
    \end{aligned}
    $$

    with $r$ = `adjust_lr_fn`'s factor: `"match_rms_adamw"` (default,
    $0.2\sqrt{\max(\text{rows}, \text{cols})}$, which gives the step an RMS of
    0.2 lr on a square matrix) or `"original"` ($\sqrt{\max(1, \text{rows}/\text{cols})}$).
    No Nesterov, no bias correction of $m$ (the orthogonalization is
    scale-invariant). It is `pytorch_optimizer.AdaMuon` (4.1.0) for its
    `use_muon=True` groups, with its defaults: `lr=0.02`, `betas=(0.9, 0.95)`,
    `weight_decay=0` (decoupled, with the unadjusted lr, applied first),
    `eps=1e-10` (in the denominator and the norm), and its Newton-Schulz:
    Keller Jordan's coefficients, 5 steps in bfloat16 with the input divided by
    `max(||m||_F, ns_eps)`, `ns_eps=1e-7`. The Newton-Schulz fields are
    `Orthogonalize`'s (presets included); as the reference, $O$ stays in
    `ns_dtype` through the division and the rescale, and $v$ has the parameter's
    dtype. As the last transform it writes the parameters in the reference's
    order of operations, bit for bit on a CPU in float32 and bfloat16; elsewhere
    in a chain (and compiled) it returns the update.

    One optimizer transform rather than a composition: the reference keeps
    $\tilde O$ in the Newton-Schulz precision between the orthogonalization and
    the write (a chain would cast it back to the parameter's dtype between
    transforms), counts steps for its bias correction, and applies its decay
    before the step; `lr` and `betas` are group keys, so schedulers drive them.

    Tensors with 0 or 1 dims get the momentum step `lr m` (the reference refuses
    them: route them to `AdamW` with `mo.Masked`); a tensor with more than 2
    dims is orthogonalized as `reshape(shape[0], -1)`, or with `batch_dims=k` as a
    stack of matrices, each with its own norm and $r$. A step the device skips
    leaves the parameters, $m$, $v$ and the step counts bit for bit as they were
    (no host sync; the new values are made aside and a `where` keeps the old ones).

    Under FSDP2 and tensor parallelism, `sharded="owner"` (default) orthogonalizes
    each full momentum matrix once, on one owner rank, and the rest runs on the
    local shards with the full matrix's norm all-reduced; `sharded="dtensor"`
    runs the Newton-Schulz products on the DTensors (docs/howto/distributed.md).
    An expert stack split on its expert dim (`batch_dims=1`) is computed where
    each expert lies; a stack split inside its matrices is refused.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2, 2)); p.grad = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    >>> opt = mo.Modular([p], mo.AdaMuon(0.1)); opt.step()
    >>> p.data   # every element of O over sqrt(v) is about 1/sqrt(1 - 0.95); then RMS 0.2 lr
    tensor([[-0.0283,  0.0000],
            [ 0.0000, -0.0283]])

    ```
    """

    positional: ClassVar[str | None] = "lr"
    device_skip = True  # keeps its moments, step counts and the parameters on a step the device skips

    lr: NonNegativeFloat = 0.02
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: NonNegativeFloat = 0.0
    eps: PositiveFloat = 1e-10
    ns_eps: PositiveFloat = 1e-7
    adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral_unclamped"] = "match_rms_adamw"
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "betas", "weight_decay")
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "step": Buffer("counter", dtype="float32"),  # this parameter's steps taken
        "exp_avg": "param",
        "exp_avg_sq": Buffer("param", low=0),
    }

    @model_validator(mode="after")
    def _betas_in_range(self):
        for b in self.betas:
            if not (0.0 <= b < 1.0):
                raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        return self

    def _takes_split_stack(self, p: torch.Tensor) -> bool:
        """Its second moment and norm are each expert's: a stack split inside its matrices is refused (built)."""
        return False

    def norm_floor(self) -> float:
        """The floor of the norm the Newton-Schulz input is divided by: `ns_eps` (`eps` is the adaptive one)."""
        return self.ns_eps

    def make_plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """This layout's groups, moments and step counts (`kernels.GroupPlan`), stepped by `_step`."""
        zeros = _zeros_like_update(updates)
        return kernels.GroupPlan(ctx, st, write, self.group_keys, self._step, {
            "step": lambda i, p: torch.zeros((), dtype=torch.float32, device=p.device),
            "exp_avg": zeros, "exp_avg_sq": zeros})

    def traced_step(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """Compiled: the update, which the runner writes (lr a graph input, not a constant); no write."""
        return super().traced_step(ctx, st, updates, write) if not write else False

    def _steps(self, ctx: Step, plan: kernels.GroupPlan, values: list[dict[str, Any]], updates: list[torch.Tensor]):
        """Update the moments and step counts (kept where the device skips); per parameter `(p, o, lr, r, wd)`:
        the step is `p * (1 - lr wd) - lr r o`, `o` in `ns_dtype` for a matrix."""
        skip = ctx.skip
        ms_all = [m for _, _, state in plan.groups for m in state["exp_avg"]]
        go = proceed_flag(ctx)
        out = []
        per_group = []
        for v, (a, b, state) in zip(values, plan.groups):
            beta1 = v["betas"][0]
            steps = list(state["step"])
            if torch.compiler.is_compiling():
                new = [s + (1.0 if go is None else go.to(torch.float32)) for s in steps]
                for s, x in zip(steps, new):
                    s.copy_(x)
                steps = new
            elif steps:
                torch._foreach_add_(steps, 1 if go is None else [go.to(torch.float32)] * len(steps))
            for u, m in zip(updates[a:b], state["exp_avg"]):
                if skip is None:
                    m.lerp_(u, 1 - beta1)
                else:
                    torch.where(skip, m, torch.lerp(m, u, 1 - beta1), out=m)
            per_group.append((v, a, b, steps, state))
        # FSDP2 / tensor parallel with sharded="owner" (eager): each sharded momentum orthogonalized once, on its
        # owner rank, the shards of the result back in ns_dtype; the rest of the rule is elementwise on the shards
        # but for the norm of the full O (all-reduced). A stack split on its batch dims only (an expert stack on
        # its expert dim) holds whole matrices here: the rule runs on them where they lie, each by its own norm
        # (a stack split otherwise was refused when the optimizer was built: `check_params`)
        blocks: set[int] = set()
        if any_sharded(ms_all):
            k = self.batch_dims or 0
            blocks = {i for i, m in enumerate(ms_all) if whole_blocks_here(m, k)}
        owned = self._owner_orthogonalized(ms_all, [None] * len(ms_all))
        if blocks - owned.keys():  # (a traced step orthogonalizes no stack where it lies: refused, as before)
            _refuse_sharded_stacks(self, [ms_all[i] for i in sorted(blocks - owned.keys())])
        for vals, a, b, steps, state in per_group:
            lr, wd = vals["lr"], vals["weight_decay"]
            beta2 = vals["betas"][1]
            for i, p, m, v, t in zip(range(a, b), ctx.params[a:b], state["exp_avg"], state["exp_avg_sq"], steps):
                mat = self.matrix(m)
                if mat is None:
                    out.append((p, m, lr, 1.0, wd))
                    continue
                if i in owned:
                    o, v = owned[i], local(v)
                    if i in blocks:  # (this rank's matrices of the stack)
                        mat = self.matrix(local(m))
                else:  # row-major, as the reference's flattened copy: the norm below adds up in its order
                    # (row-major by `contiguous()`, not `reshape(-1)`: DTensor refuses to flatten a matrix sharded
                    # unevenly; laid out as the moment it is written into, as DTensor's in-place ops require)
                    o = placed_like(self.orthogonalized(mat).contiguous().view(p.shape), v)
                new_v = v * beta2 if skip is not None else v.mul_(beta2)
                new_v.addcmul_(o, o, value=1 - beta2)
                if skip is not None:
                    torch.where(skip, v, new_v, out=v)
                correction = 1 - torch.pow(beta2, t.to(torch.float64))
                if v.dtype == torch.float64:
                    scaled = v / correction
                else:  # the reference divides by a Python float: computed in float32, rounded to v's dtype
                    scaled = (v.float() / correction.float()).to(v.dtype)
                o.div_(scaled.sqrt_().add_(self.eps))
                rows, cols = mat.shape[-2:]  # (each matrix's own shape)
                scale = math.sqrt(min(rows, cols))
                r = adjust_ratio(rows, cols, self.adjust_lr_fn)
                if i in owned and i not in blocks:  # the norm of the full O, rounded to its dtype as `o.norm()` is
                    o.mul_(scale / tensor_pnorms([like_dtensor(o, p)], 2.0, torch.float32)[0].to(o.dtype).add_(self.eps))
                    out.append((p, like_dtensor(o, p), lr, r, wd))
                    continue
                if mat.dim() == 3:  # each matrix by its own norm
                    norm = frobenius(o.view(mat.shape)).view(per_matrix_shape(o, self.batch_dims, mat))
                else:
                    norm = o.norm()
                o.mul_(scale / (norm + self.eps))  # (not in place: a DTensor's norm is a pending reduction)
                out.append((p, like_dtensor(o, p) if i in blocks else placed_like(o, p), lr, r, wd))
        return out

    def _step(self, ctx: Step, st: TransformState, plan: kernels.GroupPlan, values: list[dict[str, Any]],
              updates: list[torch.Tensor], write: bool) -> list[torch.Tensor] | bool:
        """With `write`: write the parameters in the reference's order (decay, then `p += -lr r O`), True; False
        for a tensor `lr` (the runner writes the update path's result instead). Else the updates
        `factor * O + decay * p`, in each update's dtype."""
        if not write:
            out = []
            for (p, o, lr, r, wd), u in zip(self._steps(ctx, plan, values, updates), updates):
                lr = kernels.lr_value(lr, u)
                step = laid_out_like(u, o, lr * r)
                if wd != 0:
                    step = step + p.detach() * (lr * wd)
                out.append(step)
            return out
        if any(isinstance(v["lr"], torch.Tensor) for v in values):
            return False
        skip = ctx.skip
        for p, o, lr, r, wd in self._steps(ctx, plan, values, updates):
            factor, decay = lr * r, lr * wd
            if skip is None:
                if decay != 0:
                    p.mul_(1 - decay)
                p.add_(o, alpha=-factor)
            else:
                new = p.mul(1 - decay) if decay != 0 else p.clone()
                new.add_(o, alpha=-factor)
                torch.where(skip, p, new, out=p)
        return True
