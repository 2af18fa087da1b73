"""Statistics over seeds: the mean with its Student-t interval, and paired differences.

`modopt compare --seeds` and `modopt sweep` report, for every metric, the mean
over seeds and the 95% confidence interval of that mean from Student's t
distribution with `n - 1` degrees of freedom:

    mean +- t_{(1 + level) / 2, n - 1} * sd / sqrt(n),   sd the sample standard deviation (n - 1 in the denominator)

The interval assumes the per-seed values are independent draws from one
distribution (seeds are) and is exact for normal values; for a few seeds of a
skewed metric (a spike count) it is an approximation. What an interval rests
on is its `status` (`interval`), and every printed cell names its `n`:

* `interval`: `MIN_SEEDS` values or more that differ: `mean ± half-width (n=5)`;
* `too_few`: 2 to `MIN_SEEDS - 1` values that differ: the half-width is
  computed (in the JSON) but not printed, the cell reads `mean (n=3, too few)`.
  Its width is t x sd / sqrt(n) with sd estimated from those few values, and
  that estimate is itself loose: the 95% interval of the true sd reaches 31.9x
  the observed one with 2 values, 6.3x with 3, 3.7x with 4 and 2.9x with 5;
* `same`: 2 or more values, all equal: `mean (same on all 3 seeds)`. There is
  no interval (half-width None), and no zero width is ever shown: equal values
  say the seeds did not vary this metric, not that its mean is known exactly;
* `one`: one value, no interval: `mean (n=1, no interval)`;
* `none`: no value: `-`.

A paired difference (`paired`) is the same interval over the per-seed
differences `variant - baseline` on the seeds both have: pairing removes what
the seed does to both runs alike (the data order, the initialisation).

The t quantile is computed here (no scipy at run time): bisection on the
distribution function, written through the regularized incomplete beta
function, evaluated by its continued fraction.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

#: the confidence level of every interval modopt reports
LEVEL = 0.95
#: how an interval is named in tables, JSON and reports
METHOD = "Student-t 95% interval of the mean over seeds"
#: the fewest seeds an interval is printed for (below: "too few", see the module's docstring)
MIN_SEEDS = 5
#: every `status` of an interval, as `interval()` sets it
STATUSES = ("none", "one", "same", "too_few", "interval")


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 10_000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even term d_{2m}
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # odd term d_{2m+1}
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            frac *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return frac


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (`scipy.stats.t.ppf(p, df)`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    tail = 1.0 - p
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > tail:  # the tail falls as t grows: bracket the root
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-15 * hi:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_sf(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def interval(values: Sequence[float | None], level: float = LEVEL) -> dict[str, Any]:
    """Mean and Student-t interval of `values` (None entries, e.g. a non-finite loss, left out).

    Returns `{n, missing, mean, sd, half_width, low, high, status}` (`status`:
    one of `STATUSES`, see the module's docstring). With one value `sd`,
    `half_width`, `low` and `high` are None; with equal values `sd` is 0 and the
    others None (no interval, not one of zero width); with none every statistic
    is None.
    """
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    out: dict[str, Any] = {"n": n, "missing": len(values) - n, "mean": None, "sd": None,
                           "half_width": None, "low": None, "high": None, "status": "none"}
    if n == 0:
        return out
    if all(x == xs[0] for x in xs):  # the value itself as the mean (a sum divided back may round); -0.0 as 0
        out.update(mean=xs[0] + 0.0, status="one" if n == 1 else "same", sd=None if n == 1 else 0.0)
        return out
    mean = math.fsum(xs) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    out.update(mean=mean, sd=sd, half_width=half, low=mean - half, high=mean + half,
               status="interval" if n >= MIN_SEEDS else "too_few")
    return out


def paired(values: Sequence[float | None], base: Sequence[float | None], level: float = LEVEL) -> dict[str, Any]:
    """The interval of the per-seed differences `values[i] - base[i]` (pairs with a None left out)."""
    if len(values) != len(base):
        raise ValueError(f"paired values need one baseline value each: {len(values)} values, {len(base)} baseline values")
    diffs = [None if v is None or b is None else v - b for v, b in zip(values, base)]
    return interval(diffs, level)


def _two_digits(x: float) -> str:
    """`x` to two significant digits, without an exponent between 0.001 and 10^6 (`170`, not `1.7e+02`)."""
    if x == 0 or not 1e-3 <= abs(x) < 1e6:
        return format(x, ".2g")
    digits = 1 - math.floor(math.log10(abs(x)))  # decimals to keep; negative: round to tens, hundreds, ...
    return f"{round(x, digits):.{max(0, digits)}f}"


def format_interval(iv: dict[str, Any], spec: str = ".4g", signed: bool = False) -> str:
    """A table cell that says what it rests on: `mean ± half-width (n=5)` from `MIN_SEEDS` seeds,
    `mean (n=3, too few)` below, `mean (same on all 3 seeds)`, `mean (n=1, no interval)`, `-` with none;
    `n=4 of 5` when a seed has no value."""
    if iv["mean"] is None:
        return "-"
    n, missing = iv["n"], iv.get("missing") or 0
    of = f" of {n + missing}" if missing else ""
    text = format(iv["mean"], ("+" if signed else "") + spec)
    status = iv.get("status") or _status(iv)
    if status == "same":
        return f"{text} (same on all {n}{of} seeds)"
    if status == "one":
        return f"{text} (n=1{of}, no interval)"
    if status == "too_few":
        return f"{text} (n={n}{of}, too few)"
    return f"{text} ± {_two_digits(iv['half_width'])} (n={n}{of})"


def _status(iv: dict[str, Any]) -> str:
    """The status of an interval written before intervals carried one (compare.json of schema 1)."""
    if iv["mean"] is None:
        return "none"
    if iv["n"] == 1 or iv["half_width"] is None:
        return "one"
    if iv["half_width"] == 0:
        return "same"
    return "interval" if iv["n"] >= MIN_SEEDS else "too_few"
