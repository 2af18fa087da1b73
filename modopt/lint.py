"""Pipeline lint: transforms whose effect is provably cancelled or overridden by a later one.

`cfg.lint()` (`opt.config.lint()`) returns `Finding` objects; `modopt validate`
prints them as warnings. The rules are sound: a finding is made only when the named
transform provably cannot change the parameters (for finite gradients whose norms do not
overflow float32; rounding aside). A transform that declares nothing the rules can use ends
the search: nothing is claimed across it, and neither across a subclass that rewrites
`apply` without declaring `positive_scale()` again. The first rule is the analysis the optimizer
itself acts on (`modopt.core.plan`: the cancelled scale is left out of the step); the others are
told, not acted on.

* **scale before a normalization.** A transform that declares `sets_norm()` (`Normalize`
  with `eps=0`, `min_size=1`, a p-norm `ord` with p > 0) sets each segment's norm whatever
  positive factor multiplied it before, so an earlier positive scale that is constant on each of its segments, of the
  same or a coarser scope, has no effect. A transform declares that it is such a scale by
  `Transform.positive_scale()` (a clip by norm, an EMA clip, a growth clip, `LR`); the
  linter holds no list of types. Transforms that neither read nor write the updates
  (`update_access = "none"`, `Identity`) are looked through.
* **a clip that never binds.** `ClipNorm(a)` then `ClipNorm(b)` over the same
  segments with the same `ord` and `b >= a + eps` (the second's): the second never scales.
* **no optimizer.** A pipeline with no optimizer transform subtracts its last update as it is
  (SGD with lr 1); `mo.LR(1.0)` says so on purpose.
* **a clip after a normalization of the same norm.** `Normalize(norm_value=v)` then
  `ClipNorm(b)` over the same segments with the same p-norm `ord` and `b >= v + eps`
  (with a relative margin of 1e-5 for rounding): the normalized norm is at most `v`, so the
  clip never binds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .core.reduce import parse_ord
from .core.transform import walk
from .core.plan import cancelled_by, cancelled_scales, flatten, folded_scale, pnorm, segments, sets_norm

__all__ = ["Finding", "LintWarning", "lint", "cancelled_scales", "folded_scale"]


class LintWarning(UserWarning):
    """A lint finding, warned when an optimizer is built: a transform of its pipeline provably has no effect
    (filter it with `warnings.filterwarnings("ignore", category=mo.LintWarning)`, or build with `lint=False`)."""


@dataclass(frozen=True)
class Finding:
    """One lint finding: the transform (`key` as in telemetry, e.g. `0:ClipNormByEMA`), why, and the fix."""

    key: str
    by: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message} Fix: {self.fix}."


def lint(config: Any) -> list[Finding]:
    """Findings for a `PipelineConfig` (see the module docs; `Any` here: `modopt.core.pipeline_config` imports this module)."""
    from . import transforms as T

    flat = flatten(config.transforms)
    findings: list[Finding] = []
    if flat and not any(t.is_optimizer or t.must_be_last for _, t in walk(config.transforms)):
        last = flat[-1][0]
        findings.append(Finding(
            last, "",
            "the pipeline has no optimizer transform: the update after the last transform is subtracted as it "
            "is, like SGD with lr 1.",
            "end it with an optimizer transform (mo.SGD(lr=...), mo.Adam(), mo.AdamW(), mo.LR(...)), or "
            "mo.LR(1.0) to keep this on purpose",
        ))
    for j, (nkey, n) in enumerate(flat):
        if sets_norm(n) is not None:
            if config.nonfinite == "ignore":
                continue  # non-finite gradients reach the transforms: nothing is provable
            for key, t in cancelled_by(flat, j):
                name = type(t).__name__
                what = "the learning rate's value (only lr=0 would stop the step)" if name == "LR" else "its scaling"
                findings.append(Finding(
                    key, nkey,
                    f"{key} has no effect: {nkey} (scope={n.scope!r}) rescales every segment to norm "
                    f"{n.norm_value} afterwards, cancelling {what}.",
                    f"put Normalize first (Normalize(), {name}(), ...) so that {name} acts on the normalized "
                    f"update, or drop {name}",
                ))
        if type(n) is T.ClipNorm:
            for i in range(j - 1, -1, -1):
                key, t = flat[i]
                if t.update_access == "none":
                    continue
                if type(t) is T.ClipNorm:
                    if (segments(t) == segments(n) and parse_ord(t.ord) == parse_ord(n.ord)
                            and pnorm(t.ord) is not None and t.min_size == 1 and n.max_norm >= t.max_norm + n.eps):
                        findings.append(Finding(
                            nkey, key,
                            f"{nkey} never clips: {key} already limits the same norm to {t.max_norm} "
                            f"<= {n.max_norm}.",
                            f"drop {nkey.split(':')[-1]} (or give it a threshold below {t.max_norm})",
                        ))
                        break
                if (type(t) is T.Normalize and config.nonfinite != "ignore" and segments(t) == segments(n)
                        and pnorm(t.ord) is not None and parse_ord(t.ord) == parse_ord(n.ord)
                        and t.min_size == 1 and n.min_size == 1
                        and n.max_norm >= t.norm_value * (1 + 1e-5) + n.eps):
                    findings.append(Finding(
                        nkey, key,
                        f"{nkey} never clips: {key} has already set that norm to {t.norm_value} "
                        f"<= {n.max_norm}.",
                        f"drop {nkey.split(':')[-1]} (or give it a threshold below {t.norm_value})",
                    ))
                break
    return findings
