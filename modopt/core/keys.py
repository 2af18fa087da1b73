"""State keys: the one place that writes and reads the names under which transform state is kept.

* A transform's **key** is its position in the chain: `"<i>:<Type>"` (`"1:ClipNormByEMA"`),
  nested with `/` inside `Chain` and `Masked` (`"2/0:Normalize"`).
* A **per-parameter value** lives in `opt.state[p]` under `"<key>.<name>"`
  (`"1:Adam.exp_avg"`); telemetry in `opt.stats` uses the same form (`"0:ClipNorm.norm"`).
* A **transform-wide value** lives in the transform's store under `name`; one value per
  param group (`scope="group"`) under `"<name>@group<i>"`, `i` the group's index in
  `optimizer.param_groups`. A checkpoint's inventory lists it as `"<key>/<name>"`.
"""

from __future__ import annotations

import re
from functools import lru_cache

_GROUP = re.compile(r"^(.+)@group(\d+)$")


@lru_cache(maxsize=4096)  # (pure; every step asks for the same few keys: a cached call runs no Python)
def transform_key(index: int, type_name: str, parent: str = "") -> str:
    """The key of the transform at `index` of a chain (`parent`: the key of the chain holding it)."""
    return f"{parent}/{index}:{type_name}" if parent else f"{index}:{type_name}"


@lru_cache(maxsize=4096)
def value_key(key: str, name: str) -> str:
    """`"<key>.<name>"`: a per-parameter value (or a telemetry entry) of the transform `key`."""
    return f"{key}.{name}"


def split_value_key(k: object) -> tuple[str, str] | None:
    """`(transform key, name)` of a `value_key`, or None when `k` is not one."""
    if not isinstance(k, str) or "." not in k:
        return None
    key, name = k.split(".", 1)
    return key, name


def inventory_key(key: str, name: str) -> str:
    """`"<key>/<name>"`: how a checkpoint's inventory names the transform-wide value `name` of `key`."""
    return f"{key}/{name}"


def group_key(name: str, group: int) -> str:
    """`"<name>@group<i>"`: a transform-wide value of param group `group`."""
    return f"{name}@group{group}"


def split_group_key(k: str) -> tuple[str, int | None]:
    """`(name, group index)` of a store name; the index is None for a value of the whole optimizer."""
    m = _GROUP.match(k)
    return (m.group(1), int(m.group(2))) if m else (k, None)
