"""Forward statistics of attention layers for `QKClip`: each head's maximum pre-softmax logit.

`AttentionLogits` records, on the device and with no host sync, the running maximum of each head's logit
`q·k / sqrt(d)` over the forwards since the last optimizer step that consumed it, and says which rows of
which parameters are each head's query and key rows. `AttentionLogits.attach(model)` hooks every
`torch.nn.MultiheadAttention` of a model; a user's own attention calls `record(name, max_logits)` itself.
With `keep_inputs=True` the provider also keeps each recorded forward's inputs until a step consumes them,
so that `QKClip(logits="rewritten")` can measure the logits again at the weights the optimizer wrote.

Why a provider outside the transform: a `Transform` is a frozen pydantic model that serialises to a config,
so it cannot hold a model, hooks or tensors. The provider registers each watched layer under its query and
key parameters (an attribute of each parameter); `QKClip` finds the layers through the parameters its
optimizer steps, when the step's layout is first seen. The config stays `QKClip(tau=...)`,
and the same config works for any model whose attention is watched.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["AttentionLogits"]

#: the attribute of a parameter listing the watched layers whose query or key rows it holds (an attribute,
#: not a weak map: a compiled step reads it, and dynamo cannot trace a weak map's lookup)
_ATTR = "_modopt_attention_layers"

Rows = tuple[torch.Tensor, int, int]


class _Layer:
    """One watched attention layer: its heads, its query and key rows, the maxima per head, and (with
    `keep_inputs`) the inputs of the forwards since the last step that consumed them.

    The maxima belong to the `opt.step()` call after their forwards: `QKClip` settles them at each call
    before the chain runs (`settle`), dropping those of a call the non-finite policy skips (`drop_call` when
    the host decides), and consumes the rest after a write (`consume`)."""

    def __init__(self, name: str, heads: int, query: list[Rows], key: list[Rows], device: torch.device,
                 logits_fn: Callable[..., torch.Tensor] | None = None, keep: bool = False) -> None:
        self.name, self.heads, self.query, self.key = name, heads, query, key
        #: `[heads]` float32: the max logit of each head over the forwards recorded since the last step call
        #: that settled them; -inf: none seen
        self.max_logits = torch.full((heads,), -math.inf, dtype=torch.float32, device=device)
        #: `[heads]` float32: the max over the forwards of the calls since the last write that went ahead
        #: (`Accumulate`'s micro-batches; the weights have not moved since they were measured)
        self.held = torch.full((heads,), -math.inf, dtype=torch.float32, device=device)
        #: `logits_fn(*inputs)`: `[heads]` max logits of one forward's `inputs` at the layer's current weights
        self.logits_fn, self.keep = logits_fn, keep
        #: the inputs of the forwards since the last step (tuples, as `record(..., inputs=)` got them)
        self.kept: list[tuple[Any, ...]] = []
        #: one entry per settled `kept` entry (the first `len(kept_skip)`): None when its call went ahead, else
        #: the 0-d bool by which the device skipped that call (its forward is then left out of the clip)
        self.kept_skip: list[torch.Tensor | None] = []
        #: `[heads]` float32: the max logits of the forwards of calls that went ahead before a write the device
        #: skipped, measured at the weights of that step (unchanged by it); -inf when the last step went ahead
        self.carry = torch.full((heads,), -math.inf, dtype=torch.float32, device=device)
        #: the kinds of inputs (shapes, dtypes, devices) `logits_fn` has answered well for (tried before a write)
        self.fn_checked: set[tuple[Any, ...]] = set()
        #: the function `fn_checked` was filled by (another one starts it afresh)
        self.fn_checked_for: Callable[..., torch.Tensor] | None = logits_fn
        #: `logits_fn` is modopt's own (`nn.MultiheadAttention`'s): nothing to try
        self.fn_trusted = False

    def settle(self, skip: torch.Tensor | None) -> None:
        """A step call goes ahead (`skip` None) or the device decides it (`skip`): fold the maxima recorded since
        the last call into `held` (-inf where `skip`: a skipped call's forwards are left out) and mark the
        inputs kept since then with `skip`."""
        m = self.max_logits
        torch.maximum(self.held, m if skip is None else torch.where(skip, -math.inf, m), out=self.held)
        m.fill_(-math.inf)
        self.kept_skip.extend([skip] * (len(self.kept) - len(self.kept_skip)))

    def drop_call(self) -> None:
        """The host skipped a step call: forget the maxima and the inputs recorded since the last call."""
        self.max_logits.fill_(-math.inf)
        del self.kept[len(self.kept_skip):]

    def consume(self, skip: torch.Tensor | None) -> None:
        """After the clip: reset the maxima (kept where the device skipped the write: the weights did not move,
        so they are still measurements of them) and let the kept inputs go."""
        if skip is None:
            self.held.fill_(-math.inf)
        else:
            self.held.copy_(torch.where(skip, self.held, -math.inf))
        if self.kept:  # (consumed; in the default mode a provider that keeps inputs must not pile them up)
            self.kept.clear()
            self.kept_skip.clear()


def _flag(value: Any, door: str) -> bool:
    """`value` if it is a bool; a `TypeError` naming `door` otherwise (a string such as "no" is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{door}: expected True or False, got {value!r}")
    return value


def _rows(spec: Any, heads: int, what: str) -> Rows:
    """`param` (every row) or `(param, start, stop)`: rows start..stop, split evenly into the heads."""
    if isinstance(spec, torch.Tensor):
        t, start, stop = spec, 0, (spec.shape[0] if spec.dim() else 0)
    else:
        t, start, stop = spec
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise TypeError(f"AttentionLogits: {what} must be a tensor with rows (or (tensor, start, stop))")
    if not 0 <= start < stop <= t.shape[0] or (stop - start) % heads:
        raise ValueError(f"AttentionLogits: {what} rows {start}:{stop} of a tensor with {t.shape[0]} rows do not "
                         f"split into {heads} heads")
    return t, int(start), int(stop)


class AttentionLogits:
    """The per-head maximum pre-softmax logit of watched attention layers, for `QKClip`.

    `AttentionLogits.attach(model)`: watch (hook) every `torch.nn.MultiheadAttention` of `model`.
    For a user's attention: `stats.watch(name, heads, query=..., key=...)` once, then
    `stats.record(name, max_logits)` in each forward with a `[heads]` tensor. Only forwards under
    grad mode (training forwards) are recorded by the hooks; the maximum runs over every recorded forward
    (the micro-batches of a step) until `QKClip` reads it after the optimizer's write and resets it. The
    forwards before an `opt.step()` call that the non-finite policy skips are dropped from it. Each query or
    key row is watched by one layer of one provider: `watch` and `attach` refuse rows watched already.

    `keep_inputs=True` (for `QKClip(logits="rewritten")`): each recorded forward's inputs are kept too
    (references to its query and key inputs and masks, detached; no copy) until a step consumes them, and a
    user's layer gives `logits_fn` to `watch` and its inputs to `record`.
    """

    def __init__(self, keep_inputs: bool = False) -> None:
        self.layers: dict[str, _Layer] = {}
        self._handles: list[Any] = []
        self.keep_inputs: bool = _flag(keep_inputs, "AttentionLogits(keep_inputs=...)")

    # --- a user's own attention ---------------------------------------------------------------------
    def watch(self, name: str, heads: int, query: Sequence[Any] | Any, key: Sequence[Any] | Any,
              logits_fn: Callable[..., torch.Tensor] | None = None) -> None:
        """Watch the layer `name` with `heads` heads. `query` and `key`: the parameters (or
        `(param, start, stop)` row ranges, a list of several: a weight and its bias) holding the query
        and key rows; each range splits into `heads` equal blocks, head h the h-th (as `view(heads, d, ...)`).

        `logits_fn(*inputs)` (for `QKClip(logits="rewritten")`): the `[heads]` max logits, at the layer's
        weights as they are when it is called, of one forward whose `inputs` were given to `record`."""
        if logits_fn is not None and not callable(logits_fn):
            raise TypeError(f"AttentionLogits: logits_fn of {name!r} must be callable (got {logits_fn!r})")
        if name in self.layers:
            raise ValueError(f"AttentionLogits: {name!r} is watched already")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"AttentionLogits: heads must be a positive int (got {heads!r})")
        q = [_rows(s, heads, "query") for s in (query if _is_list(query) else [query])]
        k = [_rows(s, heads, "key") for s in (key if _is_list(key) else [key])]
        self._refuse_watched_rows(name, q + k)
        layer = _Layer(name, heads, q, k, q[0][0].device, logits_fn, self.keep_inputs and logits_fn is not None)
        self.layers[name] = layer
        for t, _, _ in q + k:
            entries = t.__dict__.setdefault(_ATTR, [])
            if all(e is not layer for e in entries):
                entries.append(layer)

    def _refuse_watched_rows(self, name: str, rows: list[Rows]) -> None:
        """A `ValueError` when rows of `rows` are watched already (by this provider or another): each head's
        rows are scaled once per watching layer, so two watchers would clip it twice."""
        for t, a, b in rows:
            for other in t.__dict__.get(_ATTR, ()):
                for u, c, d in other.query + other.key:
                    if u is t and a < d and c < b:
                        whose = ("this provider's layer" if self.layers.get(other.name) is other
                                 else "the layer of another AttentionLogits provider")
                        raise ValueError(
                            f"AttentionLogits.watch({name!r}): rows {a}:{b} of a tensor of shape {tuple(t.shape)} "
                            f"are watched already, rows {c}:{d} by {whose} {other.name!r}; two watchers would "
                            f"clip those heads twice. Record through that provider, or call its detach() first "
                            f"(nothing was watched)")

    def record(self, name: str, max_logits: torch.Tensor, inputs: tuple[Any, ...] | None = None) -> None:
        """Fold a forward's max logits, a real floating-point tensor of shape `[heads]`, into layer `name`'s
        running maximum (on the device; the arguments are checked on the host, by their metadata: no sync).
        With `keep_inputs` and a layer watched with `logits_fn`, `inputs` (a tuple, `logits_fn`'s arguments) is
        kept until a step consumes it; its tensors are kept detached, by reference: do not write into them
        before the step."""
        layer = self.layers.get(name) if isinstance(name, str) else None
        if layer is None:
            raise ValueError(f"AttentionLogits.record({name!r}): no watched layer has this name; the watched layers "
                             f"are {list(self.layers)} (nothing was recorded)")
        door = f"AttentionLogits.record({name!r})"
        if not isinstance(max_logits, torch.Tensor):
            raise TypeError(f"{door}: max_logits must be a tensor of shape [{layer.heads}] (the layer's heads), "
                            f"got {type(max_logits).__name__} {max_logits!r} (nothing was recorded)")
        if not max_logits.is_floating_point():  # (complex, bool, integer: not a logit)
            raise TypeError(f"{door}: max_logits must be a real floating-point tensor, got dtype {max_logits.dtype} "
                            f"(nothing was recorded)")
        if tuple(max_logits.shape) != (layer.heads,):
            raise ValueError(f"{door}: max_logits must have shape [{layer.heads}] (one max per head), got "
                             f"{list(max_logits.shape)} (nothing was recorded)")
        if layer.keep:
            if not isinstance(inputs, tuple):
                raise TypeError(f"{door}: the provider keeps inputs (keep_inputs=True) for QKClip(logits='rewritten'): "
                                f"pass inputs=(...), the arguments of its logits_fn (nothing was recorded)")
            layer.kept.append(tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in inputs))
        m = max_logits.detach().to(device=layer.max_logits.device, dtype=torch.float32)
        torch.maximum(layer.max_logits, m, out=layer.max_logits)

    def kept_inputs(self) -> dict[str, int]:
        """How many forwards' inputs each layer keeps for the next step (0 without `keep_inputs`)."""
        return {n: len(layer.kept) for n, layer in self.layers.items()}

    def max_logits(self) -> dict[str, torch.Tensor]:
        """Each layer's running max logit per head (a new tensor), by name: over the forwards the next write
        clips by (those of step calls skipped for non-finite gradients left out)."""
        return {n: torch.maximum(layer.held, layer.max_logits) for n, layer in self.layers.items()}

    def reset(self) -> None:
        """Forget the recorded maxima (-inf: nothing seen) and the kept inputs."""
        for layer in self.layers.values():
            for t in (layer.max_logits, layer.held, layer.carry):
                t.fill_(-math.inf)
            layer.kept.clear()
            layer.kept_skip.clear()

    def detach(self) -> None:
        """Remove the hooks and stop watching (the parameters are left as they are)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self.layers.values():
            self._unwatch(layer)
        self.layers.clear()

    @staticmethod
    def _unwatch(layer: _Layer) -> None:
        """Take `layer` off its query and key tensors."""
        for t, _, _ in layer.query + layer.key:
            entries = getattr(t, _ATTR, [])
            entries[:] = [e for e in entries if e is not layer]

    # --- torch.nn.MultiheadAttention -------------------------------------------------------------------
    @classmethod
    def attach(cls, model: torch.nn.Module, stats: AttentionLogits | None = None, *,
               keep_inputs: bool | None = None) -> AttentionLogits:
        """Watch every `torch.nn.MultiheadAttention` in `model` (by its module name) with a forward hook
        that recomputes its logits; returns the provider (`stats`, or a new one). `keep_inputs=True`: the
        hook also keeps each forward's query and key inputs and masks for `QKClip(logits="rewritten")`."""
        if keep_inputs is not None:
            _flag(keep_inputs, "AttentionLogits.attach(keep_inputs=...)")
        if stats is not None and keep_inputs is not None and keep_inputs != stats.keep_inputs:
            raise ValueError("AttentionLogits.attach: keep_inputs differs from the given provider's")
        self = stats if stats is not None else cls(keep_inputs=bool(keep_inputs))
        found = [(name or "attention", mod) for name, mod in model.named_modules()
                 if isinstance(mod, torch.nn.MultiheadAttention)]
        if not found:
            raise ValueError("AttentionLogits.attach: the model holds no torch.nn.MultiheadAttention; for another "
                             "attention, call stats.watch(...) and stats.record(...) (docs/modules/weights.md)")
        names, hooks = list(self.layers), len(self._handles)
        try:
            for name, mod in found:
                self.watch_mha(name, mod)
        except Exception:  # all or nothing: unwatch and unhook the layers this call added
            for h in self._handles[hooks:]:
                h.remove()
            del self._handles[hooks:]
            for name in [n for n in self.layers if n not in names]:
                self._unwatch(self.layers.pop(name))
            raise
        return self

    def watch_mha(self, name: str, mod: torch.nn.MultiheadAttention) -> None:
        """Watch one `nn.MultiheadAttention`: query rows `[0:E]`, key rows `[E:2E]` of `in_proj_weight`
        (and of `in_proj_bias`), or `q_proj_weight` / `k_proj_weight` when key and query sizes differ."""
        e, h = mod.embed_dim, mod.num_heads
        if mod._qkv_same_embed_dim:
            query: list[Any] = [(mod.in_proj_weight, 0, e)]
            key: list[Any] = [(mod.in_proj_weight, e, 2 * e)]
        else:
            query, key = [(mod.q_proj_weight, 0, e)], [(mod.k_proj_weight, 0, e)]
        if mod.in_proj_bias is not None:
            query.append((mod.in_proj_bias, 0, e))
            key.append((mod.in_proj_bias, e, 2 * e))
        self.watch(name, h, query=query, key=key, logits_fn=functools.partial(_mha_logits_fn, mod))
        self.layers[name].fn_trusted = True
        self._handles.append(mod.register_forward_hook(_mha_hook(self, name), with_kwargs=True))


def _is_list(x: Any) -> bool:
    """A list of row specs (not one `(param, start, stop)` triple)."""
    return isinstance(x, list) or (isinstance(x, tuple) and not (len(x) == 3 and isinstance(x[1], int)))


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _mha_hook(stats: AttentionLogits, name: str):
    def hook(mod: torch.nn.MultiheadAttention, args: tuple, kwargs: dict, out: Any) -> None:
        s = stats  # (held by the hook: the model keeps its provider alive)
        if name not in s.layers or not torch.is_grad_enabled():
            return
        bound = dict(zip(_MHA_ARGS, args))
        bound.update({k: v for k, v in kwargs.items() if k in _MHA_ARGS})
        inputs = (bound["query"], bound["key"], bound.get("attn_mask"), bound.get("key_padding_mask"))
        with torch.no_grad():
            s.record(name, mha_max_logits(mod, *inputs), inputs)

    return hook


def _masked(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Where a mask excludes a position: True in a bool mask, -inf in a float mask."""
    if mask is None:
        return None
    return mask if mask.dtype == torch.bool else torch.isneginf(mask)


def mha_max_logits(mod: torch.nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[heads]`: each head's max of `q·k / sqrt(d)` over the batch and the positions the masks keep
    (a position a bool mask marks True, or a float mask sets to -inf, is left out; finite float mask values
    are not added: the clip bounds `q·k`). `bias_k` and `add_zero_attn` keys are left out. `dtype`: compute
    the projections and the scores in it (default: the projections in the inputs' and weights' dtype, the
    scores then cast to float32, as the hook records them)."""
    e, h = mod.embed_dim, mod.num_heads
    d = e // h
    if mod._qkv_same_embed_dim:
        wq, wk = mod.in_proj_weight[:e], mod.in_proj_weight[e:2 * e]
    else:
        wq, wk = mod.q_proj_weight, mod.k_proj_weight
    bq = bk = None
    if mod.in_proj_bias is not None:
        bq, bk = mod.in_proj_bias[:e], mod.in_proj_bias[e:2 * e]
    if dtype is not None:
        query, key, wq, wk = (t.to(dtype) for t in (query, key, wq, wk))
        bq, bk = (None if t is None else t.to(dtype) for t in (bq, bk))
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(0), key.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not mod.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
    q = torch.nn.functional.linear(query, wq, bq).view(b, lq, h, d).transpose(1, 2)
    k = torch.nn.functional.linear(key, wk, bk).view(b, lk, h, d).transpose(1, 2)
    s = q @ k.transpose(-1, -2)
    s = (s.float() if dtype is None else s) / math.sqrt(d)  # (b, h, lq, lk)
    m = _masked(attn_mask)
    if m is not None:
        s = s.masked_fill(m.view(b, h, lq, lk) if m.dim() == 3 else m, -math.inf)
    m = _masked(key_padding_mask)
    if m is not None:
        s = s.masked_fill(m.view(b, 1, 1, lk), -math.inf)
    return s.amax(dim=(0, 2, 3))


def _mha_logits_fn(mod: torch.nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                   attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """The hook's `logits_fn`: `mha_max_logits` of kept inputs, at the current weights, in at least float32."""
    w = mod.in_proj_weight if mod._qkv_same_embed_dim else mod.q_proj_weight
    dtype = torch.promote_types(torch.promote_types(query.dtype, w.dtype), torch.float32)
    return mha_max_logits(mod, query, key, attn_mask, key_padding_mask, dtype=dtype)


def layers_of(params: Iterable[torch.Tensor]) -> list[_Layer]:
    """The watched layers holding query or key rows among `params`, in first-seen order."""
    out: list[_Layer] = []
    for p in params:
        for layer in getattr(p, _ATTR, ()):
            if all(x is not layer for x in out):
                out.append(layer)
    return out
