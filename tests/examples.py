"""For every registered transform: instances with every field set away from its default,
and how it is checked against its float64 spec.

The conformance suite checks that every registered transform appears in
``NON_DEFAULT``, so a new transform gets the shared checks (config round trip of
every field, checkpoint round trip, zero/None/non-finite grads, half precision,
groups); ``tests/test_spec_coverage.py`` checks that it appears in ``SPECS`` or
``NO_SPEC``, and runs every ``Spec`` entry against its spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import modopt as mo
from modopt.spec import adaptive as spec_adaptive
from modopt.spec import core as spec_core
from modopt.spec import ema as spec_ema
from modopt.spec import guards as spec_guards
from modopt.spec import matrix_scale as spec_matrix_scale
from modopt.spec import orthogonal as spec_orthogonal
from modopt.spec import percentile as spec_percentile

# name -> an instance, or a list of instances, that together set every field away from its default
# (fields that exclude each other, like SGD's nesterov and dampening, need two instances)
NON_DEFAULT = {
    "Identity": mo.Identity(),
    "ClipValue": mo.ClipValue(0.05),
    "ClipNorm": mo.ClipNorm(0.5, ord="l1", eps=0.0, scope="tensor", dim=-1, inverse_dims=True, min_size=3),
    "Normalize": mo.Normalize(2.0, ord=3.0, scope="group", eps=1e-8, min_size=2),
    "Centralize": mo.Centralize(scope="tensor", dim=(0,), inverse_dims=True, min_size=3),
    "GradientCentralization": mo.GradientCentralization(dim=1, inverse_dims=False, scope="tensor", min_size=1),
    "Sign": mo.Sign(),  # it has no fields
    "ScaledSign": mo.ScaledSign(),  # it has no fields
    "Chain": mo.Chain(mo.ClipNorm(2.0), mo.Chain(mo.Normalize(), mo.Identity())),
    "LR": mo.LR(0.05),
    "SGD": [
        mo.SGD(lr=0.02, momentum=0.8, dampening=0.0, nesterov=True, weight_decay=1e-3),
        mo.SGD(lr=0.03, momentum=0.5, dampening=0.1, nesterov=False, weight_decay=1e-3),
        mo.SGD(lr=0.01, momentum=0.9, maximize=True, fused=False, foreach=True),  # torch's foreach kernel
        mo.SGD(lr=0.01, momentum=0.5, fused=True),
    ],
    "Adam": [
        mo.Adam(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=1e-3, amsgrad=True),
        # torch's for-loop kernel; it computes in the parameters' dtype, where eps=1e-8 rounds to 0 in float16
        mo.Adam(lr=2e-3, eps=1e-4, maximize=True, fused=False, foreach=False, decoupled_weight_decay=True),
        mo.Adam(lr=2e-3, fused=True),
        mo.Adam(lr=2e-3, amsgrad=True, state_dtype="bfloat16"),  # bfloat16 moments (the max too)
    ],
    "AdamW": [
        mo.AdamW(lr=2e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05, amsgrad=True),
        mo.AdamW(lr=2e-3, eps=1e-4, maximize=True, foreach=True),  # torch's foreach kernel (as above)
        mo.AdamW(lr=2e-3, fused=True),
        mo.AdamW(lr=2e-3, state_dtype="bfloat16"),  # bfloat16 moments
    ],
    # eps representable in fp16, so the half-precision checks test modopt rather than RMSprop's fp16 underflow
    "TorchOptimizer": mo.TorchOptimizer(torch.optim.RMSprop, lr=3e-3, alpha=0.95, eps=1e-4),
    # the module families (issue 3)
    "ClipNormByEMA": mo.ClipNormByEMA(
        beta=0.9, ord="l1", eps=1e-5, scope="tensor", dim=0, inverse_dims=True, min_size=2,
        max_ema_growth=2.0, ema_init="update",
    ),
    "NormalizeByEMA": mo.NormalizeByEMA(
        beta=0.95, ord=3.0, eps=1e-7, scope="group", min_size=2, max_ema_growth=None, ema_init="update"
    ),
    "ClipValueByEMA": mo.ClipValueByEMA(beta=0.9, ema_init="update"),
    "ClipNormGrowth": mo.ClipNormGrowth(
        add=0.5, mul=2.0, min_value=1e-3, max_decay=3.0, ord="linf", scope="tensor", dim=-1, inverse_dims=True,
        min_size=2,
    ),
    "ClipValueGrowth": mo.ClipValueGrowth(add=0.1, mul=None, min_value=1e-3, max_decay=None),
    "HistClip": mo.HistClip(
        mo.EMACriterion(alpha=0.9, r_thresh=1.2, rule="reciprocal"), warmup_steps=3, warmup_max_norm=None,
        update_stats_with="clipped", ord="l1", eps=0.0, scope="group", min_size=2,
    ),
    "ZClip": mo.ZClip(
        alpha=0.9, z_thresh=2.0, max_grad_norm=None, eps=1e-5, warmup_steps=3, mode="percentile", clip_option="mean",
        clip_factor=0.8, skip_update_on_spike=True, ord=3.0, scope="tensor", dim=0, inverse_dims=True, min_size=2,
    ),
    "AutoClip": mo.AutoClip(percentile=25.0, window=5, ord="l1", eps=0.0, scope="group", min_size=2),
    "ClipNormByRMS": mo.ClipNormByRMS(0.5, dim=0, inverse_dims=True, min_size=2),
    "ZScoreNormalize": mo.ZScoreNormalize(scope="tensor", dim=-1, inverse_dims=True, eps=1e-6, min_size=3),
    "ClipValueByPercentile": mo.ClipValueByPercentile(90, scope="tensor", dim=0, inverse_dims=True, min_size=2),
    # exclude=[] (not None): test_config builds from unnamed parameters, where a non-empty exclude is an error
    "AGC": mo.AGC(clipping=0.05, eps=1e-2, exclude=["2.bias"]),  # the example models name their params
    "ZeroNonFinite": mo.ZeroNonFinite(),
    "Accumulate": mo.Accumulate(2),
    "Lookahead": mo.Lookahead(mo.SGD(lr=0.05, momentum=0.9), k=2, alpha=0.3),
    "ProjectNorm": [mo.ProjectNorm(), mo.ProjectNorm(2.0, min_ndim=1, eps=1e-8)],
    # the example models hold no attention: QKClip warns and changes nothing there (it takes part for its config,
    # state, skip and compile plumbing); tests/test_weights.py clips real heads (nn.MultiheadAttention, TinyTransformer)
    "QKClip": mo.QKClip(50.0, alpha=0.3, eps=1e-3, eta_min=0.01, logits="rewritten"),
    # warm-up 2, so the 5-step checks cross its end; eps representable in fp16
    "ScheduleFreeSGD": mo.ScheduleFreeSGD(lr=0.05, momentum=0.8, weight_decay=1e-3, warmup_steps=2, r=0.5,
                                          weight_lr_power=1.0),
    "ScheduleFreeAdamW": mo.ScheduleFreeAdamW(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2, warmup_steps=2,
                                              r=1.0, weight_lr_power=0.5),
    # issue 12: a mask holding a nested mask; every Select field set
    "Masked": mo.Masked(
        mo.ClipNorm(0.5), mo.Masked(mo.Normalize(0.5), where=mo.Select(max_ndim=1)),
        where=mo.Select(names=["*"], exclude=["0.weight"], min_ndim=1, max_ndim=2, groups=[0, 1]),
    ),
    # the orthogonal family: float32/float64 Newton-Schulz here (the shared compile test compares with eager to
    # 1e-5; the bfloat16 default is checked against torch.optim.Muon and compiled in tests/test_orthogonal.py)
    "Orthogonalize": [
        mo.Orthogonalize(ns_coefficients=list(spec_orthogonal.TORCHZERO_COEFFICIENTS), eps=1e-6,
                         adjust_lr="match_rms_adamw", ns_dtype="float32"),
        mo.Orthogonalize(ns_steps=3, adjust_lr="original", ns_dtype="float64", sharded="dtensor"),
        # a named schedule; batch_dims=0: the convolution reading chosen (expert stacks: tests/test_expert_stacks.py)
        mo.Orthogonalize(ns_coefficients="polar_express", ns_safety=1.01, ns_dtype="float32", batch_dims=0),
        # issue 56: Emerging-Optimizers' cycling quintic, optax's AOL first step, torch 2.14's shape factor
        mo.Orthogonalize(ns_coefficients="quintic", ns_steps=7, ns_past_end="cycle", ns_preconditioning="aol",
                         adjust_lr="spectral_unclamped", ns_dtype="float64"),
    ],
    "OrthoGrad": [
        mo.OrthoGrad(eps=1e-6, renormalize=False, scope="tensor", dim=0, inverse_dims=True, min_size=3),
        mo.OrthoGrad(scope="global"),  # torchzero's OrthoGrad()
    ],
    "Momentum": mo.Momentum(0.9, nesterov=False),
    "Muon": [
        mo.Muon(lr=0.02, weight_decay=0.01, momentum=0.9, nesterov=False, ns_coefficients=(3.0, -3.2, 1.2), ns_steps=6,
                eps=1e-6, adjust_lr_fn="match_rms_adamw", ns_dtype="float32"),
        mo.Muon(lr=0.01, adjust_lr_fn="original", ns_dtype="float64", sharded="dtensor", batch_dims=0),
        # a named schedule (deepseek_v4 is tested in tests/test_muon_recipe.py: its eight steps of a=3.4445 magnify
        # rounding by about 2e4 in near-null directions, more than the 1e-6 of the shared compile check)
        mo.Muon(lr=0.01, ns_coefficients="quintic", ns_safety=1.05, ns_dtype="float64", ns_steps=7, ns_past_end="cycle",
                ns_preconditioning="schatten"),
    ],
    # Muon's 2026 recipe (issue 40): NorMuon after Orthogonalize, AdaMuon as one optimizer transform
    "NorMuon": mo.NorMuon(0.9, eps=1e-8, per="larger", batch_dims=0),
    # nanochat's MuonEq and Muon+, and the shape factor as its own transform (issue 56)
    "MuonEq": mo.MuonEq(eps=1e-3, batch_dims=0),
    "MuonPlus": mo.MuonPlus(eps=1e-3, batch_dims=0),
    "ShapeScale": mo.ShapeScale(adjust_lr="spectral_unclamped", batch_dims=0),
    "AdaMuon": [
        mo.AdaMuon(lr=0.01, betas=(0.8, 0.99), weight_decay=0.01, eps=1e-8, ns_eps=1e-6, adjust_lr_fn="original",
                   ns_coefficients="quintic", ns_steps=4, ns_safety=1.01, ns_dtype="float32"),
        mo.AdaMuon(ns_dtype="float64", sharded="dtensor", ns_past_end="cycle", ns_preconditioning="aol", batch_dims=0),
    ],
    # the stability family (issue 20); warm-up 3 and 2, so the 5-step checks cross its end
    "AdaGC": [
        mo.AdaGC(beta=0.9, lambda_abs=0.5, lambda_rel=1.2, warmup_steps=3, eps=1e-6, dim=0, inverse_dims=True,
                 min_size=2),
        mo.AdaGC(warmup_steps=2, scope="group"),
    ],
    # tests from step 2 or 3, with a sigma no gradient of the checks reaches (they count the skipped steps: a
    # spike is tested in tests/test_stability_more.py); watch="norm": the checks give no loss
    "SkipStep": [mo.SkipStep(window=3, sigma=1e3, min_steps=2, watch="norm"), mo.SkipStep(window=4, sigma=1e3)],
    "SkipNorm": mo.SkipNorm(1e6),  # (issue 56) above every finite gradient of the checks: none skipped
    "Clippy": [
        mo.Clippy(lambda_w=0.01, lambda_abs=1e-3, scope="tensor", dim=0, inverse_dims=True, min_size=2),
        mo.Clippy(scope="group"),
    ],
    "ADOPT": [
        mo.ADOPT(lr=2e-3, betas=(0.8, 0.99), eps=1e-4, weight_decay=1e-2, clip_power=None, maximize=True),
        mo.ADOPT(lr=2e-3, weight_decay=1e-2, decoupled_weight_decay=True, fixed_decay=True, clip_power=0.5),
    ],
    # SPAM and Stable-SPAM (issue 20): a reset at step 3, so the 5-step checks cross it (they need Adam after them)
    "SPAM": mo.SPAM(theta=100.0, reset_every=3, warmup_steps=2, clip_delay=1),
    "StableSPAM": [
        mo.StableSPAM(gamma1=0.6, gamma2=0.8, gamma3=0.99, eps=1e-6, reset_every=3, scope="tensor", dim=0,
                      inverse_dims=True, min_size=2),
        mo.StableSPAM(reset_every=None, scope="group"),
    ],
    # the caution family (issue 40): here before SGD (u is the gradient); after an optimizer, with the
    # references, in tests/test_caution.py
    "Cautious": [mo.Cautious("c_optim"), mo.Cautious("heavyball"), mo.Cautious("none")],
    "Grams": mo.Grams(),
    "WeightDecay": mo.WeightDecay(0.05, cautious=True),
    "CautiousWeightDecay": mo.CautiousWeightDecay(0.05, cautious=False),
}


@dataclass(frozen=True)
class Spec:
    """A one-step, stateless transform checked against its float64 spec by the generic test of
    ``tests/test_spec_coverage.py``: ``fn(updates, group_of, **fields)`` (or ``fn(updates, **fields)``
    when it takes no ``group_of``) returns the updates the transform makes, every field passed by name."""

    fn: Callable
    #: the rule subtracts a mean: rounding errors are relative to the inputs' magnitude, not the output's
    cancels: bool = False


@dataclass(frozen=True)
class Steps:
    """A stateful transform checked step by step against its float64 spec class by the generic test of
    ``tests/test_spec_coverage.py``: ``cls(group_of, **fields)`` (or ``cls(**fields)`` when it takes no
    ``group_of``), whose ``step(updates)`` returns each step's updates, every field passed by name."""

    cls: type


# name -> how the transform is checked against its float64 spec (modopt/spec/): a ``Spec`` for the
# generic one-step test, ``Steps`` for the generic step-by-step test of a stateful one, or the test
# (``"tests/<file>.py::<test>"``) that checks it its own way
SPECS = {
    "Identity": Spec(spec_core.identity),
    "LR": Spec(spec_core.lr),
    "ClipValue": Spec(spec_core.clip_value),
    "ClipNorm": Spec(spec_core.clip_norm),
    "ClipNormByRMS": Spec(spec_core.clip_norm_by_rms),
    "Normalize": Spec(spec_core.normalize),
    "Centralize": Spec(spec_core.centralize, cancels=True),
    "GradientCentralization": Spec(spec_core.centralize, cancels=True),  # Centralize with other defaults
    "Sign": Spec(spec_core.sign),
    "ScaledSign": Spec(spec_core.scaled_sign),
    "ZScoreNormalize": Spec(spec_adaptive.z_score_normalize),
    "ClipValueByPercentile": Spec(spec_percentile.clip_value_by_percentile),
    "ZeroNonFinite": Spec(spec_guards.zero_nonfinite),  # non-finite inputs: tests/test_guards.py
    "ClipNormByEMA": Steps(spec_ema.ClipNormByEMA),
    "NormalizeByEMA": "tests/test_ema.py::test_normalize_by_ema_matches_spec",
    "ClipValueByEMA": "tests/test_ema.py::test_clip_value_by_ema_matches_spec",
    "ClipNormGrowth": "tests/test_growth.py::test_clip_norm_growth_matches_spec",
    "ClipValueGrowth": "tests/test_growth.py::test_clip_value_growth_matches_spec",
    "HistClip": "tests/test_statistical.py::test_histclip_matches_spec",
    "ZClip": "tests/test_statistical.py::test_zclip_matches_spec",
    "AutoClip": "tests/test_statistical.py::test_autoclip_matches_spec",
    "AGC": "tests/test_agc.py::test_matches_formula_per_unit",  # its spec also reads the parameters
    "Accumulate": "tests/test_accumulate.py::test_accumulate_matches_spec_and_stops_the_chain",
    "Lookahead": "tests/test_wrappers.py::test_lookahead_matches_spec",  # and pytorch_optimizer.Lookahead, bit for bit
    "ProjectNorm": "tests/test_weights.py::test_project_norm_matches_spec",  # a weight-stage transform
    "QKClip": "tests/test_weights.py::test_qk_clip_matches_spec",  # a weight-stage transform reading attention logits
    # and schedulefree's SGDScheduleFree / AdamWScheduleFree, bit for bit
    "ScheduleFreeSGD": "tests/test_wrappers.py::test_schedule_free_sgd_matches_spec",
    "ScheduleFreeAdamW": "tests/test_wrappers.py::test_schedule_free_adamw_matches_spec",
    "Orthogonalize": "tests/test_orthogonal.py::test_orthogonalize_matches_spec",  # float64 NS; bf16 within a bound
    "OrthoGrad": "tests/test_orthogonal.py::test_orthograd_matches_spec",  # its spec also reads the parameters
    "Momentum": "tests/test_orthogonal.py::test_momentum_matches_spec",
    "Muon": "tests/test_orthogonal.py::test_muon_matches_spec",  # and torch.optim.Muon, bit for bit
    "MuonEq": Spec(spec_matrix_scale.muon_eq),
    "MuonPlus": Spec(spec_matrix_scale.muon_plus),
    "ShapeScale": Spec(spec_matrix_scale.shape_scale),
    "NorMuon": "tests/test_muon_recipe.py::test_normuon_matches_spec",  # and pytorch_optimizer.NorMuon (a chain)
    "AdaMuon": "tests/test_muon_recipe.py::test_adamuon_matches_spec",  # and pytorch_optimizer.AdaMuon, bit for bit
    "AdaGC": "tests/test_stability.py::test_adagc_matches_spec",  # and pytorch_optimizer.AdaGC, bit for bit
    "SkipStep": "tests/test_stability_more.py::test_skip_step_matches_spec",  # and OLMo-core's rule (golden values)
    "SkipNorm": "tests/test_step_guards.py::test_skip_norm_matches_spec",  # and Megatron-LM's rule, at the boundary
    "Clippy": "tests/test_stability_more.py::test_clippy_matches_spec",  # and golden values by hand
    "ADOPT": "tests/test_stability_more.py::test_adopt_matches_spec",  # and pytorch_optimizer.ADOPT, bit for bit
    "SPAM": "tests/test_spam.py::test_spam_matches_spec",  # and pytorch_optimizer.SPAM (moments bit for bit)
    "StableSPAM": "tests/test_spam.py::test_stable_spam_matches_spec",  # and pytorch_optimizer.StableSPAM, bit for bit
    # their specs also read the gradients (Cautious, Grams) or the parameters and the group's lr (the decays)
    "Cautious": "tests/test_caution.py::test_cautious_matches_spec",  # and pytorch_optimizer, timm (parity tests)
    "Grams": "tests/test_caution.py::test_grams_matches_spec",  # and pytorch_optimizer.Grams
    "WeightDecay": "tests/test_caution.py::test_weight_decay_matches_spec",
    "CautiousWeightDecay": "tests/test_caution.py::test_weight_decay_matches_spec",
}

# name -> why the transform has no float64 spec, and what checks it instead
NO_SPEC = {
    "SGD": "torch's optimizer is the oracle: tests/test_torch_equivalence.py::test_optimizer_trajectory_matches_torch "
           "and, in every dtype, tests/test_optimizer_dtypes.py::test_optimizer_matches_torch_reference",
    "Adam": "torch's optimizer is the oracle: tests/test_torch_equivalence.py::test_optimizer_trajectory_matches_torch "
            "and, in every dtype, tests/test_optimizer_dtypes.py::test_optimizer_matches_torch_reference",
    "AdamW": "torch's optimizer is the oracle: tests/test_torch_equivalence.py::test_optimizer_trajectory_matches_torch "
             "and, in every dtype, tests/test_optimizer_dtypes.py::test_optimizer_matches_torch_reference",
    "TorchOptimizer": "it runs the wrapped torch optimizer, which is its own oracle: bit for bit in "
                      "tests/test_torch_equivalence.py::test_torch_optimizer_transform_matches_torch",
    "Chain": "a composition with no rule of its own: it runs its transforms in order, each paired with its own "
             "spec here; a Chain equals its transforms listed flat, bit for bit "
             "(tests/test_masked.py::test_nesting_and_chain_inside_compose_as_intersection_and_sequence)",
    "Masked": "a composition with no rule of its own: the masked transform equals the transform run on the "
              "selection alone (tests/test_masked.py::test_masked_transform_equals_the_transform_on_the_selection_alone), "
              "a masked global clip equals torch's over the selection "
              "(tests/test_masked.py::test_masked_global_clip_equals_torch_clip_grad_norm_over_the_selection)",
}

#: what the generated ``Masked[...]`` examples select: the example models' later layers (and a 0-d
#: parameter where there is one); the complement gets its own optimizer when the branch holds one
MASK = mo.Select(exclude=["0.*"])
MASK_REST = mo.Select(names=["0.*"])
#: transforms that cannot run inside Masked (they step every parameter of the optimizer themselves)
UNMASKABLE = {"TorchOptimizer", "SkipStep", "SkipNorm", "Lookahead", "ProjectNorm", "QKClip", "ScheduleFreeSGD", "ScheduleFreeAdamW"}
# (SkipStep skips the whole step: it sits at the top level; Lookahead pulls every parameter of the optimizer; a
# weight-stage transform sits at the top level; Schedule-Free's eval form swaps every parameter)


def instances(name: str) -> list[mo.Transform]:
    v = NON_DEFAULT[name]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def base_examples() -> list[tuple[str, mo.Transform]]:
    out = []
    for name in sorted(NON_DEFAULT):
        for i, t in enumerate(instances(name)):
            out.append((f"{name}-{i}" if i else name, t))
    return out


def masked_examples() -> list[tuple[str, mo.Transform]]:
    """``Masked`` around every example (generated, so a new transform is covered masked too)."""
    return [
        (f"Masked[{eid}]", mo.Masked(t, where=MASK))
        for eid, t in base_examples()
        if eid.split("-")[0] not in UNMASKABLE and eid != "Masked"
    ]


def all_examples() -> list[tuple[str, mo.Transform]]:
    """Every example as ``(id, instance)``, for parametrized tests; then each of them masked."""
    return base_examples() + masked_examples()


def routes_optimizer(t: mo.Transform) -> bool:
    return isinstance(t, mo.Masked) and any(isinstance(c, mo.roles.Optimizer) for c in t.transforms)


def needs_moments(t: mo.Transform) -> bool:
    """``t`` or a transform inside it needs the optimizer's moments (SPAM: ``modopt.core.moments``)."""
    from modopt.core.plan import needs_of

    return bool(needs_of(t)) or any(needs_moments(c) for c in t.children())


def pipeline_for(t: mo.Transform) -> list[mo.Transform]:
    """A runnable pipeline exercising ``t``: optimizers end it, others precede SGD (Adam for a transform
    that needs the optimizer's moments); a masked optimizer gets a second branch for the parameters it
    does not select (routing), with the same optimizer, so that one param group holding both selections
    has one default per shared key."""
    if isinstance(t, mo.roles.Optimizer) or isinstance(t, mo.roles.LastWriter):  # (Lookahead ends the pipeline: its inner optimizer writes)
        return [t]
    if isinstance(t, mo.roles.WeightStage):  # after the optimizer's write
        return [mo.SGD(lr=0.01), t]
    if needs_moments(t) and isinstance(t, mo.Masked):  # its optimizer in its selection (SPAM's warm-up scales the lr)
        return [mo.Masked(*t.transforms, mo.Adam(lr=0.01), where=t.where), mo.Masked(mo.Adam(lr=0.01), where=MASK_REST)]
    if needs_moments(t):
        return [t, mo.Adam(lr=0.01)]
    if routes_optimizer(t):
        return [t, mo.Masked(*[c for c in t.transforms if isinstance(c, mo.roles.Optimizer)], where=MASK_REST)]
    return [t, mo.SGD(lr=0.01)]
