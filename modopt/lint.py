"""Pipeline lint: transforms whose effect is provably cancelled or overridden by a later one.

`cfg.lint()` (`opt.config.lint()`) returns `Finding` objects; `modopt validate`
prints them as warnings. The rules are sound: a finding is made only when the named
transform provably cannot change the parameters (for finite gradients whose norms do not
overflow float32; rounding aside). A transform that declares nothing the rules can use ends
the search: nothing is claimed across it, and neither across a subclass that rewrites
`apply` without declaring `scale_fact()` again. The first rule is the analysis the optimizer
itself acts on (`modopt.core.plan`: the cancelled scale is left out of the step); the others are
told, not acted on. The analysis lives in the plan (`modopt.core.plan.lint_findings`), below the
transforms, so that `Modular` warns without importing this module; this module is its public face.

* **scale before a normalization.** A transform whose `scale_fact()` sets the norm (`Normalize`
  with `eps=0`, `min_size=1`, a p-norm `ord` with p > 0) sets each segment's norm whatever
  positive factor multiplied it before, so an earlier positive scale that is constant on each of its segments, of the
  same or a coarser scope, has no effect. A transform declares that it is such a scale by taking
  the `ScaleFact` role with a positive `Scale` (a clip by norm, an EMA clip, a growth clip, `LR`); the
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

from .core.pipeline_config import PipelineConfig
from .core.plan import Finding, LintWarning, cancelled_scales, folded_scale, lint_findings

__all__ = ["Finding", "LintWarning", "lint", "cancelled_scales", "folded_scale"]


def lint(config: PipelineConfig) -> list[Finding]:
    """Findings for a `PipelineConfig` (see the module docs; `cfg.lint()` is the same)."""
    return lint_findings(config.transforms, config.nonfinite)
