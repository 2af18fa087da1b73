"""The pipeline's plan: what is true of the whole pipeline, decided once when the optimizer is built.

`make_plan(transforms, nonfinite)` runs when `Modular` is built (and `attach` attaches); the step reads
the `Plan` and works nothing out again. It holds:

* the structure checks, by the roles the transforms take (`modopt.core.roles`): a `LastWriter` comes
  last, a `SkipDecider` first, before any state, `WeightStage`s at the end of the top level, a
  `WeightSwap` outside any wrapper, `fold_clip` only on the last transform and only after a global scale;
* `cancelled`: the keys of the positive scales that a normalization right after them cancels, which
  the step leaves out (`TransformState.scale_`);
* `folded`: the key of the global scale the last optimizer's fused kernel takes as its `grad_scale`;
* `moment_links`: each transform that reads its optimizer's moments (SPAM), with the optimizer that
  offers them (`modopt.core.moments`);
* `routes`: the optimizer transforms inside `Masked` branches and the parameters they write;
* the weight stage: the trailing transforms that act on the weights after the optimizer wrote them;
* `swaps`: the transforms whose parameters have a train and an eval form (Schedule-Free), which
  `Modular.train()` / `eval()` call; they sit at the top level (or in plain `Chain`s), with no weight
  stage after them;
* whether `nonfinite="skip"` decides on the device: fixed here, unless a transform's answer reads
  param-group values (`Optimizer.skip_reads_groups`), which a scheduler may change between steps;
* `host_on_cpu`: whether a step over parameters on the CPU reads that decision back on the host instead
  (a sync there only reads memory) and runs the plain chain: every pipeline but one holding a transform
  that adds to the decision itself (a `SkipDecider`: `SkipStep` counts its skips with the device's);
* `shapes`: how each chain runs (its keys, its writer, its routed branches: `run_shapes`), and
  `host_skips`: the transforms told of a step the host skips (`SeesHostSkips`).

The analyses are sound: a scale is left out or folded only when it provably changes nothing
(rounding aside). `lint_findings` tells the user what the same analyses find (`cfg.lint()`, the
warning `Modular` gives when built; `modopt.lint` is its public face and documents the rules).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .keys import transform_key
from .moments import CAPABILITIES, ROLES, Link, Offer
from .reduce import parse_ord
from .registry import _TRANSFORMS, available, get_transform
from .roles import (Chain, LastWriter, NeedsMoments, Optimizer, Router, Scale, ScaleFact, SeesHostSkips, SkipDecider,
                    StageLimited, WeightStage, WeightSwap, Writer, holds_optimizer, may_stop, skips_on_device)
from .step import RunShape
from .select import routes as find_routes
from .state import declared_buffers
from .transform import Transform, walk


@dataclass(frozen=True)
class Plan:
    """The decisions about one pipeline (see the module docs); built by `make_plan`, never changed."""

    #: the top-level transforms, in order
    transforms: tuple[Transform, ...]
    #: the non-finite policy
    nonfinite: str
    #: every transform's state key (nested ones included), in chain order
    keys: tuple[str, ...]
    #: keys of the scales a later normalization cancels (left out of the step)
    cancelled: frozenset[str]
    #: key of the scale folded into the last optimizer's kernel, or None
    folded: str | None
    #: transform key -> the optimizer transform whose moments it reads
    moment_links: Mapping[str, Link]
    #: optimizer transforms in `Masked` branches (`modopt.core.select.routes`), or None: no routing
    routes: Any
    #: whether the skip is decided on the device, for every param-group value; None: asked per step
    device_skip: bool | None
    #: the top-level transforms of the update stage (all but the trailing weight transforms)
    updates: tuple[Transform, ...] = ()
    #: the weight stage: `(key, transform)` of each trailing transform with `stage = "weights"`, in order
    weights: tuple[tuple[str, Transform], ...] = ()
    #: `(key, transform)` of each `WeightSwap` (Schedule-Free), in chain order
    swaps: tuple[tuple[str, Transform], ...] = ()
    #: whether a step on the CPU reads the device's skip decision back and runs the plain chain
    host_on_cpu: bool = False
    #: the process group of the pipeline-parallel stages whose parameters the global statistics and the
    #: non-finite decision span (`Modular(..., stage_group=)`), or None: the optimizer's parameters are all
    stage_group: Any = None
    #: key of the global scale right before the last optimizer (`deferrable_scale`): traced by
    #: `compile_step`, the fused-kernel op multiplies the updates by it in place, as the eager step does
    deferred: str | None = None
    #: how each chain runs, by `(parent key, final)`: the top level's (`""`) and every container's children
    #: (`run_shapes`); the runner reads them instead of working them out each step
    shapes: Mapping[tuple[str, bool], RunShape] = field(default_factory=dict)
    #: `(key, transform)` of each transform that sees the steps the host skips (`SeesHostSkips`), in order
    host_skips: tuple[tuple[str, Transform], ...] = ()

    def skips_on_device(self, groups: list[dict[str, Any]]) -> bool:
        """Whether this step's skip is decided on the device (`groups`: the param groups as they are now)."""
        if self.device_skip is not None:
            return self.device_skip
        return all(skips_on_device(t, groups) for t in self.transforms)


def make_plan(transforms: Sequence[Transform], nonfinite: str, groups: list[dict[str, Any]] | None = None,
              stage_group: Any = None) -> Plan:
    """The plan of `transforms` under `nonfinite`; raises `ValueError` naming the transform for a pipeline
    that cannot run (see the module docs). `groups`: the param groups when known (for the device-skip
    answer of transforms that read them; re-planned by the host when groups are added)."""
    transforms = tuple(transforms)
    if stage_group is not None:  # every statistic must be able to span the pipeline stages
        for key, t in walk(transforms):
            try:
                if isinstance(t, StageLimited):
                    t.check_stages()
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
    n_updates = _check_stages(transforms)
    _check_last(transforms[:n_updates])
    _check_skip_first(transforms)
    swaps = _check_swaps(transforms, n_updates)
    head = transforms[:n_updates]  # (the analyses read the update stage; keys are positions: the same)
    folded = folded_scale(head)
    links = link(transforms)
    reads_groups = any(isinstance(t, Optimizer) and t.skip_reads_groups for _, t in walk(transforms))
    device_skip = None if reads_groups else all(skips_on_device(t, groups) for t in transforms)
    return Plan(
        transforms=transforms, nonfinite=nonfinite, keys=tuple(k for k, _ in walk(transforms)),
        cancelled=cancelled_scales(head, nonfinite), folded=folded, moment_links=links,
        routes=find_routes(transforms), device_skip=device_skip, updates=transforms[:n_updates],
        weights=tuple((f"{i}:{type(t).__name__}", t) for i, t in enumerate(transforms) if i >= n_updates),
        swaps=swaps, host_on_cpu=not any(isinstance(t, SkipDecider) for _, t in walk(transforms)),
        stage_group=stage_group, deferred=deferrable_scale(head), shapes=run_shapes(transforms[:n_updates]),
        host_skips=tuple((k, t) for k, t in walk(transforms) if isinstance(t, SeesHostSkips)),
    )


# --- structure ---------------------------------------------------------------------------------------
def _check_stages(transforms: tuple[Transform, ...]) -> int:
    """Weight transforms (`stage = "weights"`) come after every update transform, at the top level; returns
    how many update transforms lead."""
    n = len(transforms)
    while n > 0 and isinstance(transforms[n - 1], WeightStage):
        n -= 1
    for key, t in walk(transforms[:n]):
        if isinstance(t, WeightStage):
            where = "inside another transform" if "/" in key else "before an update transform"
            raise ValueError(f"{key}: {type(t).__name__} acts on the weights after the optimizer wrote them, so it "
                             f"comes at the end of the pipeline, at its top level (it is {where})")
    return n


def _check_last(transforms: tuple[Transform, ...]) -> None:
    """Transforms that must end the chain (they write the parameters themselves) do."""
    tail: set[int] = set()
    t = transforms[-1] if transforms else None
    while t is not None:
        tail.add(id(t))
        kids = t.children()
        t = kids[-1] if kids else None
    for key, t in walk(transforms):
        if isinstance(t, LastWriter) and id(t) not in tail:
            raise ValueError(f"{key}: {type(t).__name__} must be the last transform of the pipeline")


def _check_swaps(transforms: tuple[Transform, ...], n_updates: int) -> tuple[tuple[str, Transform], ...]:
    """Transforms whose parameters have a train and an eval form (`WeightSwap`: Schedule-Free) sit at the
    top level or in plain `Chain`s (a wrapper around one, `Lookahead`, would move the weights it keeps in
    step with its own copy), and no weight-stage transform follows (it would move `y` alone); returns them."""
    found = [(key, t) for key, t in walk(transforms) if isinstance(t, WeightSwap)]
    if not found:
        return ()
    owners = dict(walk(transforms))
    for key, t in found:
        parts = key.split("/")
        for depth in range(1, len(parts)):
            outer = owners["/".join(parts[:depth])]
            if type(outer) is not Chain:
                raise ValueError(f"{key}: {type(t).__name__} keeps the parameters in step with its own sequences (their "
                                 f"train and eval forms), so it cannot run inside {type(outer).__name__}: put it at the "
                                 "top level of the pipeline")
    if n_updates < len(transforms):
        w = transforms[n_updates]
        raise ValueError(f"{n_updates}:{type(w).__name__} acts on the weights after {found[0][0]} wrote them, which "
                         f"breaks {type(found[0][1]).__name__}'s relation between the parameters and its own sequences "
                         "(the eval form would be wrong): leave the weight stage out")
    return tuple(found)


def _check_skip_first(transforms: tuple[Transform, ...]) -> None:
    """A transform that skips the rest of the step (`SkipDecider`: `SkipStep`) is at the top level of the
    pipeline, and no transform before it keeps state: a step it skips must leave every state as it was,
    and what ran before it cannot be taken back."""
    top = {id(t) for t in transforms}
    for key, t in walk(transforms):
        if isinstance(t, SkipDecider) and id(t) not in top:
            raise ValueError(f"{key}: {type(t).__name__} must be at the top level of the pipeline, not inside "
                             "another transform: it skips the whole step")
    for i, t in enumerate(transforms):
        if isinstance(t, SkipDecider):
            stateful = [k for k, x in walk(transforms[:i]) if declared_buffers(x)]
            if stateful:
                raise ValueError(
                    f"{i}:{type(t).__name__} comes after {', '.join(stateful)}, which keep state: a step it skips "
                    f"must leave every state as it was, so put {type(t).__name__} before them (first in the pipeline)"
                )


# --- scales: left out before a normalization, folded into a kernel ------------------------------------
def flatten(transforms: Sequence[Transform], prefix: str = "") -> list[tuple[str, Transform]]:
    """Chains run in order on the same updates: the pipeline with chains flattened (keys as in `walk`)."""
    out: list[tuple[str, Transform]] = []
    for i, t in enumerate(transforms):
        key = f"{prefix}{i}:{type(t).__name__}"
        if type(t) is Chain:
            out.extend(flatten(t.transforms, key + "/"))
        else:
            out.append((key, t))
    return out


def pnorm(ord: Any) -> float | None:
    """p for a true p-norm (p > 0, inf included), else None."""
    try:
        o = parse_ord(ord)
    except Exception:
        return None
    return o if isinstance(o, float) and o > 0 else None


def segments(t: Any) -> tuple[str, Any, bool]:
    """`(scope, dim, inverse_dims)` of a reducing transform."""
    return (t.scope, t.dim, t.inverse_dims)


def contains(outer: tuple[str, Any, bool], inner: tuple[str, Any, bool]) -> bool:
    """Every segment of scope `inner` lies inside one segment of scope `outer`, and `inner` leaves no
    tensor alone that `outer` changes (a slicing may leave a tensor with no slice dim alone, e.g. a
    bias under `dim=0, inverse_dims=True`: then only the same slicing is provably the same)."""
    o, i = outer, inner
    if _may_leave_alone(i):
        return o == i
    if o[0] == "global":
        return True
    if o[0] == "group":
        return i[0] in ("group", "tensor")
    if o[1] is None and not o[2]:  # whole tensors
        return i[0] == "tensor"
    return o == i  # slices: only the same slicing is provably the same


def _may_leave_alone(seg: tuple) -> bool:
    """Whether the slicing `(scope, dim, inverse_dims)` leaves some tensor shape with no slice dim
    (`modopt.core.reduce.slice_dims`); tensors with more dims than any listed dim reaches never are."""
    from .reduce import slice_dims

    scope, dim, inverse = seg
    if scope != "tensor" or (dim is None and not inverse):
        return False
    listed = (dim,) if isinstance(dim, int) else tuple(dim or ())
    reach = max([abs(d) for d in listed] + [0]) + 2
    return any(slice_dims(ndim, dim, inverse) is None for ndim in range(reach))


def _declared_with_apply(t: Transform, method: str) -> bool:
    """`method` was declared with (or after) the `apply` it speaks for: a subclass that rewrites `apply`
    without declaring it again says nothing."""
    mro = type(t).__mro__
    applies = next(k for k in mro if "apply" in k.__dict__)
    declares = next(k for k in mro if method in k.__dict__)
    return issubclass(declares, applies)


def scale_fact(t: Transform) -> Scale | None:
    """`t.scale_fact()` of a `ScaleFact`, trusted only when declared with its `apply` (see
    `_declared_with_apply`); None otherwise."""
    if not isinstance(t, ScaleFact) or not _declared_with_apply(t, "scale_fact"):
        return None
    return t.scale_fact()


def positive_scale(t: Transform) -> tuple[str, Any, bool] | None:
    """`(scope, dim, inverse_dims)` of a positive scale (`Scale.positive`), else None."""
    fact = scale_fact(t)
    return fact.segments if fact is not None and fact.positive else None


def sets_norm(t: Transform) -> tuple[str, Any, bool] | None:
    """`(scope, dim, inverse_dims)` of a scale that sets the norm (`Scale.sets_norm`), else None."""
    fact = scale_fact(t)
    return fact.segments if fact is not None and fact.sets_norm else None


def cancelled_by(flat: list[tuple[str, Transform]], j: int) -> Iterator[tuple[str, Transform]]:
    """`(key, transform)` of each positive scale right before the normalization `flat[j]` that it cancels,
    nearest first (transforms with `update_access = "none"` are looked through)."""
    target = sets_norm(flat[j][1])
    for i in range(j - 1, -1, -1):
        key, t = flat[i]
        if t.update_access == "none":
            continue
        seg = positive_scale(t)
        if seg is None or target is None or not contains(seg, target):
            return
        yield key, t


def cancelled_scales(transforms: Sequence[Transform], nonfinite: str) -> frozenset[str]:
    """Keys of the transforms whose multiply the runner may leave out (`TransformState.scale_`).

    Only the positive scale right before a normalization that sets its segments' norm (`sets_norm()`)
    and cancels it: the normalization then reads the same update it would read after the multiply,
    up to a positive factor per segment, and sets its norm (equal up to rounding; the transform's state
    and telemetry do not depend on its own multiply). An earlier scale in a run of several is kept: the
    scale after it reads its output, for its state and telemetry. Nothing is left out under
    `nonfinite="ignore"` (a non-finite update reaches the transforms).
    """
    if nonfinite == "ignore":
        return frozenset()
    flat = flatten(transforms)
    out = set()
    for j, (_, n) in enumerate(flat):
        if sets_norm(n) is not None:
            out.update(key for key, _ in list(cancelled_by(flat, j))[:1])
    return frozenset(out)


def deferrable_scale(transforms: Sequence[Transform]) -> str | None:
    """The key of the transform right before the last one (through those with `update_access = "none"`)
    when it declares that it ends with a scale (`scale_fact()`) of one factor
    for all parameters (global scope) or one per whole tensor (tensor scope, no slices), else None.
    `compile_step`'s graph hands that scale to the fused optimizer op, which multiplies the updates in
    place before its kernel: the eager step's two calls, without a functionalized copy of the gradients."""
    flat = flatten(transforms)
    last = flat[-1][1] if flat else None
    if not isinstance(last, Writer) or not last.takes_scale:  # (a wrapper, SGD, a torch optimizer: the runner's multiply)
        return None
    before = _before_last(flat)
    if before is None:
        return None
    key, t = before
    fact = scale_fact(t)
    seg = fact.segments if fact is not None else None
    return key if _one_factor(seg) or _per_tensor(seg) else None


def _before_last(flat: list[tuple[str, Transform]]) -> tuple[str, Transform] | None:
    """`(key, transform)` of the transform right before the last one, looking through those with
    `update_access = "none"`; None when there is none."""
    for key, t in reversed(flat[:-1]):
        if t.update_access != "none":
            return key, t
    return None


def _one_factor(seg: tuple | None) -> bool:
    """Whether a declared `(scope, dim, inverse_dims)` is one factor for all parameters (global, no dim)."""
    return seg is not None and seg[0] == "global" and seg[1] is None


def _per_tensor(seg: tuple | None) -> bool:
    """Whether a declared `(scope, dim, inverse_dims)` is one factor per whole tensor (tensor scope, no slices)."""
    return seg is not None and seg[0] == "tensor" and seg[1] is None and not seg[2]


def folded_scale(transforms: Sequence[Transform]) -> str | None:
    """The key of the transform whose scale the final optimizer folds into its fused kernel, or None.

    Only where the last transform asks for it (`Adam(fold_clip=True)`, `AdamW(fold_clip=True)`)
    and the transform right before it (through those with `update_access = "none"`) is a
    scale of one factor for all parameters: a positive `scale_fact()` declared, global scope.
    Raises ValueError, naming the field, when the optimizer asks and there is no such scale.
    """
    flat = flatten(transforms)
    for key, t in walk(transforms):
        if isinstance(t, Writer) and t.folds_clip and (not flat or t is not flat[-1][1]):
            raise ValueError(f"{key}.fold_clip: only the last transform of the pipeline (its optimizer) can "
                             "fold a clip's scale into its kernel; set fold_clip=False")
    if not flat or not isinstance(flat[-1][1], Writer) or not flat[-1][1].folds_clip:
        return None
    okey, _ = flat[-1]
    before = _before_last(flat)
    if before is None:
        raise ValueError(f"{okey}.fold_clip: no transform before it has a scale to fold; set fold_clip=False")
    key, t = before
    if _one_factor(positive_scale(t)):
        return key
    raise ValueError(
        f"{okey}.fold_clip: the transform before it, {key}, does not declare one positive scale for "
        f"all parameters (a positive scale_fact() with scope='global'), so there is no scale to fold; use a "
        f"global-scope ClipNorm (or ClipNormByRMS, ClipNormByEMA, ...) right before it, or fold_clip=False"
    )


# --- lint: what provably has no effect, told to the user ----------------------------------------------
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


def _is(t: Transform, name: str) -> bool:
    """`t` is exactly the transform class registered as `name` (names are unique in the registry, so the
    plan names a transform class without importing the transforms, which sit above it)."""
    return type(t) is _TRANSFORMS.get(name)


def lint_findings(transforms: Sequence[Transform], nonfinite: str) -> list[Finding]:
    """The lint findings of a pipeline (`modopt.lint` states the rules): `cancelled_by` told as advice,
    a clip that another clip or a normalization already bounds, a pipeline with no optimizer."""
    flat: list[tuple[str, Any]] = flatten(transforms)  # (fields read by name: the classes sit above the core)
    findings: list[Finding] = []
    if flat and not any(isinstance(t, (Optimizer, LastWriter)) for _, t in walk(tuple(transforms))):
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
            if nonfinite == "ignore":
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
        if _is(n, "ClipNorm"):
            for i in range(j - 1, -1, -1):
                key, t = flat[i]
                if t.update_access == "none":
                    continue
                if _is(t, "ClipNorm"):
                    if (segments(t) == segments(n) and parse_ord(t.ord) == parse_ord(n.ord)
                            and pnorm(t.ord) is not None and t.min_size == 1 and n.max_norm >= t.max_norm + n.eps):
                        findings.append(Finding(
                            nkey, key,
                            f"{nkey} never clips: {key} already limits the same norm to {t.max_norm} "
                            f"<= {n.max_norm}.",
                            f"drop {nkey.split(':')[-1]} (or give it a threshold below {t.max_norm})",
                        ))
                        break
                if (_is(t, "Normalize") and nonfinite != "ignore" and segments(t) == segments(n)
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


# --- how each chain runs -------------------------------------------------------------------------------
def _routes(t: Transform) -> bool:
    return isinstance(t, Router) and t.routes()


def _routed_run(transforms: Sequence[Transform], end: int) -> int:
    """The start of the run of routed `Masked` branches that ends the chain at `end` (`end` when there is
    none, or one). Each branch's optimizer writes its own parameters in turn, as separate torch optimizers
    would (`torch.optim.Muon` on the matrices, `AdamW` on the rest), instead of only the last one: this
    is the order of the plain step, since a branch touches only its own parameters' updates and every
    parameter reaches one optimizer. It needs that no branch after the first can stop the step
    (`StepStopper`): parameters already written could not be taken back."""
    first = end
    if end >= 0 and _routes(transforms[end]):
        while first > 0 and _routes(transforms[first - 1]) and not may_stop(transforms[first]):
            first -= 1
    return first


def _shape(transforms: Sequence[Transform], parent: str, final: bool) -> RunShape:
    keys = tuple(transform_key(i, type(t).__name__, parent) for i, t in enumerate(transforms))
    end = first = len(transforms) - 1
    if final:
        while end > 0 and transforms[end].update_access == "none":
            end -= 1
        first = _routed_run(transforms, end)
    return RunShape(keys, end, first, end >= 0 and isinstance(transforms[end], Writer))


def run_shapes(transforms: Sequence[Transform]) -> dict[tuple[str, bool], RunShape]:
    """The `RunShape` of the top-level chain (`""`) and of every container's children, by `(parent key,
    final)`, as the runner meets them (`modopt.core.step.run`)."""
    out = {("", final): _shape(transforms, "", final) for final in (False, True)}
    for key, t in walk(tuple(transforms)):
        kids = t.children()
        if kids:
            for final in (False, True):
                out[(key, final)] = _shape(kids, key, final)
    return out


# --- the moment links (`modopt.core.moments`) ----------------------------------------------------------
def offer_of(t: Any) -> Offer | None:
    """The offer of an optimizer transform (or class), None for one that offers nothing."""
    optimizer = issubclass(t, Optimizer) if isinstance(t, type) else isinstance(t, Optimizer)
    return t.offers if optimizer else None


def needs_of(t: Transform) -> tuple[str, ...]:
    """What a transform needs from its optimizer (`NeedsMoments.needs()`), or nothing."""
    return tuple(t.needs()) if isinstance(t, NeedsMoments) else ()


def _check_names(key: str, t: Transform, need: tuple[str, ...]) -> None:
    bad = [n for n in need if n not in ROLES + CAPABILITIES]
    if bad:  # a transform's own mistake: name it for its author
        raise ValueError(f"{key}: {type(t).__name__}.needs names {bad}, which is neither a role {ROLES} "
                         f"nor a capability {CAPABILITIES} of modopt.core.moments")


def _offering(need: tuple[str, ...]) -> str:
    names = [n for n in available() if set(need) <= set((offer_of(get_transform(n)) or Offer()).provides())]
    return " or ".join(f"mo.{n}" for n in names) or "none registered"


def _flat(items: list[tuple[str, Any, bool]]):
    """`(key, transform, outside)` in the order they run, looking into plain containers (`Chain`), not into
    branches that route their own selection (`Masked` holding an optimizer: `routes()`), which come as
    themselves; `outside`: the transform runs outside the selection (`Masked`) that holds the asking one."""
    for key, t, outside in items:
        kids = t.children()
        if kids and not isinstance(t, Optimizer) and not (isinstance(t, Router) and t.routes()):
            yield from _flat([(transform_key(i, type(c).__name__, key), c, outside) for i, c in enumerate(kids)])
        else:
            yield key, t, outside


def _provider(key: str, t: Any, need: tuple[str, ...], after: list[tuple[str, Any, bool]]) -> Link:
    name, what = type(t).__name__, ", ".join(need)
    for k, r, outside in _flat(after):
        if isinstance(r, Optimizer) and outside and "lr_scale" in need:
            raise ValueError(
                f"{key}: {name} scales the learning rate of the optimizer transform after it, and {k} also steps "
                f"parameters outside the selection around {name}; put an optimizer in the same selection "
                f"(mo.Masked({name}(...), mo.AdamW(...), where=...)), or turn the warm-up off (warmup_steps=0)"
            )
        if isinstance(r, Optimizer):
            offer = offer_of(r) or Offer()
            missing = [n for n in need if n not in offer.provides()]
            if missing:
                has = ", ".join(offer.provides()) or "nothing"
                raise ValueError(
                    f"{key}: {name} needs {', '.join(missing)} from the optimizer transform after it, and {k} "
                    f"does not offer {'it' if len(missing) == 1 else 'them'} (it offers: {has}); "
                    f"put {_offering(need)} after {name}"
                )
            return Link(k, offer)
        if holds_optimizer(r):
            raise ValueError(
                f"{key}: {name} needs {what} from the optimizer transform after it, and the next one is inside {k}, "
                f"which steps only the parameters it selects; put the optimizer in the same chain as {name} "
                f"(mo.Masked({name}(...), mo.AdamW(...), where=...))"
            )
    raise ValueError(
        f"{key}: {name} needs {what} from an optimizer transform after it, and the pipeline has none after it; "
        f"end the pipeline with {_offering(need)}"
    )


def link(transforms: Any) -> dict[str, Link]:
    """Every transform that needs something (`needs_of`), by key, with its provider; `ValueError` otherwise."""
    out: dict[str, Link] = {}
    _link(list(transforms), "", [], out)
    return out


def _link(chain: list[Any], parent: str, after: list[tuple[str, Any, bool]], out: dict[str, Link]) -> None:
    keyed = [(transform_key(i, type(t).__name__, parent), t, False) for i, t in enumerate(chain)]
    for i, (key, t, _) in enumerate(keyed):
        rest = keyed[i + 1:] + after
        need = needs_of(t)
        if need:
            _check_names(key, t, need)
            out[key] = _provider(key, t, need, rest)
        kids = t.children()
        if kids:  # inside a selection (`Masked`: any container but a plain Chain) what follows it is outside
            selects = type(t) is not Chain
            _link(list(kids), key, [(k, r, o or selects) for k, r, o in rest], out)
