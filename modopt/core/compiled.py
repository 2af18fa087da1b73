"""A whole `Modular` step compiled once, with torch's fused optimizer kernel kept as one op
(`compile_step`), and a CUDA-graph capture of it (`cuda_graph_step`).

`torch.compile(opt.step)` traces the step with the optimizer transforms' multi-tensor formulas
(torch's fused kernels do not functionalize), so inductor computes Adam with its own loops: rounded
differently from eager, and on a CPU slower than aten's fused kernel. `compile_step` traces the
same step with the final `Adam`/`AdamW` calling torch's fused kernel through a custom op
(`modopt::fused_adam_`, declared as mutating its state), which inductor keeps as one call and
writes in place; what runs before it (the clip's scale, the skip's select) fuses around it.

This module is imported only when used (`modopt.compile_step`): declaring the custom op imports
`torch._library`, which `import modopt` does not pay for.
"""

from __future__ import annotations

import contextlib
import operator
import types
import weakref
from itertools import chain, compress, repeat
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import compile_marks, kernels
from .step import STATE_ROWS

__all__ = ["CompiledStep", "compile_step", "cuda_graph_step", "keeps_fused", "fused_adam_op", "tensor_hyperparams"]

def keeps_fused() -> bool:
    """Whether a traced optimizer transform calls torch's fused kernel through `fused_adam_op`
    (inside `compile_step`'s compiled function) instead of its traced multi-tensor formulas."""
    return compile_marks.KEEP_EAGER_KERNELS


@contextlib.contextmanager
def _keeping_fused(on: bool) -> Iterator[None]:
    was, compile_marks.KEEP_EAGER_KERNELS = compile_marks.KEEP_EAGER_KERNELS, on
    try:
        yield
    finally:
        compile_marks.KEEP_EAGER_KERNELS = was


#: functions `f(opt) -> int` that count what a traced step may have assumed about the state and still holds
#: (`kernels.packed_steps_hold`: the packed step counts); a call that finds less than after the last
#: eager call runs eagerly, which makes it hold again
HOLDS: list[Callable[[Any], int]] = []

#: the custom ops, once `fused_adam_op()` declared them (before any trace: dynamo cannot trace the declaration)
FUSED_ADAM: Callable[..., None] | None = None
LERP: Callable[..., None] | None = None
_LIB: Any = None


def fused_adam_op() -> Callable[..., None]:
    """`torch._fused_adam_` / `torch._fused_adamw_` as an op of its own (`modopt::fused_adam_`) that inductor keeps as one call
    (declared to mutate the parameters and moments, so it is written in place). The step counts come
    either as `steps`, already advanced by the graph and only read, or as `packed`, the one 1-D tensor
    the eager step keeps them in (`kernels._packed`), which the op advances by `step_by` (1 when None) and
    unbinds: the graph then takes one step input where it took one view per parameter (views of one
    storage, which AOTAutograd regenerates on every call). With `grad_mul` (a 0-d tensor, or one value
    per gradient) it first multiplies the gradients by it in place, the eager step's `_foreach_mul_` of
    a global clip or a per-tensor scale: inside the op the graph keeps no copy of the scaled gradients
    (a mutation of graph inputs that functionalization would write to a new buffer and back).
    Declared on the first call, outside any trace; traced code reads `FUSED_ADAM`."""
    global FUSED_ADAM, LERP, _LIB
    if FUSED_ADAM is not None:
        return FUSED_ADAM
    # declared with `torch.library.Library` rather than `torch.library.custom_op`: the graph then calls
    # the kernel through the dispatcher straight to one Python function (no Python autograd wrapper,
    # default filling and version bumps in Python around it: about a third of a small step's call)
    lib = torch.library.Library("modopt", "FRAGMENT")
    lib.define("fused_adam_(Tensor(a!)[] params, Tensor(e!)[] grads, Tensor(b!)[] exp_avgs, "
               "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, Tensor(f!)? packed, "
               "Tensor? step_by, Tensor lr, float beta1, float beta2, float weight_decay, float eps, bool amsgrad, "
               "bool maximize, bool decoupled, Tensor? found_inf, Tensor? grad_mul) -> ()")

    def _op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, packed, step_by, lr, beta1, beta2,
            weight_decay, eps, amsgrad, maximize, decoupled, found_inf, grad_mul):
        if packed is not None:  # advanced here, before the kernel reads them, as the eager `kernels._packed`
            packed.add_(1 if step_by is None else step_by)
            steps = _views_of(packed)
        if grad_mul is not None:  # the scale before, multiplied in place as the eager step's transform does
            torch._foreach_mul_(grads, grad_mul if grad_mul.dim() == 0 else grad_mul.unbind(0))
        kernels.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, decoupled=decoupled,
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                            grad_scale=None, found_inf=found_inf, maximize=maximize)

    def _fake(*args: Any) -> None:  # (it returns nothing; what it writes keeps its shape)
        return None

    lib.impl("fused_adam_", _op, "CompositeExplicitAutograd")
    torch.library.register_fake("modopt::fused_adam_", _fake, lib=lib)

    # an EMA's `lerp_` as the eager step runs it (see `ema_lerp_`)
    lib.define("lerp_(Tensor(a!)[] m, Tensor[] u, Tensor[] weights, Tensor? skip, bool host_read) -> ()")
    lib.impl("lerp_", ema_lerp_, "CompositeExplicitAutograd")
    torch.library.register_fake("modopt::lerp_", _fake, lib=lib)
    # the per-tensor norms stacked, as `reduce.pnorms` computes them eagerly (see `stacked_norms`)
    lib.define("norms(Tensor[] xs, float p) -> Tensor")
    lib.impl("norms", stacked_norms, "CompositeExplicitAutograd")
    torch.library.register_fake("modopt::norms", lambda xs, p: xs[0].new_empty((len(xs),)), lib=lib)
    _LIB = lib  # (a Library unregisters its definitions when collected)
    FUSED_ADAM = torch.ops.modopt.fused_adam_.default
    LERP = torch.ops.modopt.lerp_.default
    compile_marks.NORMS = torch.ops.modopt.norms.default
    return FUSED_ADAM


#: id(packed) -> (a weak reference to it, its rows as views): made once, not on every call (a view costs
#: about 0.5 us: 0.25 ms a call at 512 parameters)
_VIEWS: dict[int, tuple[Any, list[torch.Tensor]]] = {}


def _views_of(packed: torch.Tensor) -> list[torch.Tensor]:
    """`list(packed.unbind(0))`, kept for as long as `packed` lives."""
    hit = _VIEWS.get(id(packed))
    if hit is None or hit[0]() is not packed:
        if len(_VIEWS) >= 64:  # (entries of tensors since freed)
            _VIEWS.clear()
        hit = _VIEWS[id(packed)] = (weakref.ref(packed), list(packed.unbind(0)))
    return hit[1]


def stacked_norms(xs: list[torch.Tensor], p: float) -> torch.Tensor:
    """`torch.stack(torch._foreach_norm(xs, p))` for tensors of one float32 or float64 dtype, the eager
    step's kernels: traced by `compile_step` as one op (`modopt::norms`) with one output, where
    `_foreach_norm` gave the graph one output per tensor (each checked and stacked by the graph's
    Python on every call: a cost per tensor)."""
    return torch.stack(torch._foreach_norm(xs, p))


def ema_lerp_(m: list[torch.Tensor], u: list[torch.Tensor], weights: list[torch.Tensor],
              skip: torch.Tensor | None, host_read: bool = False) -> None:
    """`m[i].lerp_(u[i], weights[i])` with aten's multi-tensor kernel, the eager step's, in place: traced by
    `compile_step` as one op (`modopt::lerp_`), so the EMA rounds as the eager one does and is written
    into its own tensor (inductor's lerp, read by the opaque norm that follows, lived in a fresh
    full-size block each call). `skip` is the step's device-side decision; on a skipped step every
    weight is 0, and `u` may hold inf or NaN (`m + 0 * (u - m)` is `m` only for finite `u`): on the
    CPU, where reading the decision costs nothing (`host_read`: the step's `cpu_kernels`), the EMA is then left
    alone, as the eager step, which decides there on the host, does not run at all; on the device path
    (a GPU's) the inf/NaN elements read as 0, the eager device path's cleaning, out of place (no sync,
    the gradients left as they are)."""
    if skip is not None:
        if host_read and skip.device.type == "cpu":
            if bool(skip):
                return
        else:
            u = [torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in u]
    torch._foreach_lerp_(m, u, weights)


def tensor_hyperparams(opt: Any, keys: tuple[str, ...] = ("lr",), device: torch.device | str | None = None,
                       dtype: torch.dtype = torch.float64) -> None:
    """Make the group values `keys` (default the learning rate) 0-d tensors on `device` (default each
    group's first parameter's), in place in `opt.param_groups`, as torch.optim takes `lr=torch.tensor(...)`.
    torch's schedulers then write them in place (`fill_`), so a compiled or captured step reads the new
    value from memory: no recompile, no new capture. Float64 by default on the CPU (the fused CPU kernel
    reads a tensor lr as a double: the same bits as the float); on CUDA float32 suffices (the kernel's
    arithmetic is float32). A group value already a tensor is left as it is. The step checks such a value
    each time (`modopt.core.hyper`): read on the CPU, on the device elsewhere (a bad one skips the step).

    Everything is checked before any group changes: `keys` a tuple or list of group keys that a
    transform of `opt` reads and whose values are numbers (not `betas`' pair), `dtype` a floating dtype."""
    if isinstance(keys, str) or not isinstance(keys, (tuple, list)) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"tensor_hyperparams: keys must be a tuple of group keys, e.g. ('lr',), got {keys!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"tensor_hyperparams: dtype must be a floating-point torch dtype, got {dtype!r} (an integer "
                        "lr of 0.01 would be 0)")
    readable = set(getattr(getattr(opt, "_gate", None), "live", ())) or None
    for i, g in enumerate(opt.param_groups):
        for k in keys:
            if k not in g or (readable is not None and k not in readable):
                raise ValueError(f"tensor_hyperparams: param group {i} has no key {k!r} that the optimizer reads "
                                 f"(its keys: {', '.join(sorted(readable or g)) if readable or g else 'none'})")
            v = g[k]
            if not isinstance(v, torch.Tensor) and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"tensor_hyperparams: param group {i}: {k!r} is {v!r}, not a number (only keys "
                                "holding one number become tensors)")
    for g in opt.param_groups:
        dev = device if device is not None else (g["params"][0].device if g["params"] else "cpu")
        dt = dtype if torch.device(dev).type == "cpu" else torch.float32
        for k in keys:
            v = g[k]
            if not isinstance(v, torch.Tensor):
                g[k] = torch.tensor(float(v), dtype=dt, device=dev)


class CompiledStep:
    """`compile_step(opt)`'s result: call it as `opt.step` (`step()`, `step(loss=...)`).

    The first `warmup` calls run `opt.step()` eagerly (they create the state, so the graph sees
    it as it will stay); later calls run the compiled step, except a call that finds the state no
    longer as a graph may have assumed (`HOLDS`: step counts loaded or replaced by hand, which the
    graph reads packed), which runs eagerly and so makes it hold again. `opt.stats` and
    `state_dict()` are the optimizer's as usual."""

    def __init__(self, opt: Any, *, warmup: int = 1, guards: str = "full", **compile_kwargs: Any) -> None:
        from .modular import Modular

        if not isinstance(opt, Modular):
            raise TypeError(f"compile_step: opt must be a modopt.Modular, got {type(opt).__name__} (for a torch "
                            "optimizer, torch.compile(opt.step) is torch's own recipe)")
        if guards not in ("full", "tensors", "own"):
            raise ValueError(f"compile_step: guards must be 'full', 'own' or 'tensors', got {guards!r}")
        if type(warmup) is not int or warmup < 0:
            raise ValueError(f"compile_step: warmup must be a whole number of eager steps >= 0, got {warmup!r}")
        fused_adam_op()  # (declared now: a trace cannot)
        self.opt: Modular = opt
        self.warmup: int = warmup
        self.calls: int = 0
        options = dict(compile_kwargs.pop("options", None) or {})
        if guards == "tensors":
            options["guard_filter_fn"] = torch.compiler.keep_tensor_guards_unsafe
        compile_kwargs.setdefault("fullgraph", True)
        self._compiled = torch.compile(_own_step(opt), options=options or None, **compile_kwargs)
        self.guards = guards
        #: guards="own": the graphs compiled without dynamo's guards, by the key they were traced under
        self._fast: dict[tuple, Callable[..., Any]] = {}
        self._seen: tuple | None = None
        # (without inductor's size assert on each input, 0.4 us a tensor: a guard-free graph runs only while the
        # key holds, and the key holds what the asserts check, see `own_key`)
        self._fast_options = {**options, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                              "size_asserts": False}
        self._compile_kwargs = compile_kwargs
        #: what each of `HOLDS` gave after the last eager call
        self._held: tuple[int, ...] = ()

    def __call__(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:
        self.calls += 1
        if self.calls <= self.warmup:
            return self._eager(closure, loss)
        if closure is not None:  # (the closure's backward runs outside the graph)
            with torch.enable_grad():
                loss = closure()
        opt = self.opt
        # the group values, by the gate every step passes (the graph checks the tensor ones again, on the device)
        opt._gate.check_step(opt.param_groups, opt.device_path)
        rows = opt.runtime_store(STATE_ROWS).setdefault("rows", [])  # (the trace's states: see STATE_ROWS)
        rows[:] = map(opt.state.get, chain.from_iterable(map(_params_of, opt.param_groups)))
        if self.guards != "own":
            if self._lost():
                return self._eager(None, loss)
            with _keeping_fused(True):
                return self._compiled(loss)
        key = own_key(self.opt, loss)
        fast = self._fast.get(key)
        if fast is None and self._lost():  # (a changed state changes the key: checked only then)
            return self._eager(None, loss)
        with _keeping_fused(True):
            if fast is None:
                if key != self._seen or len(self._fast) >= MAX_FAST:  # new, or too many: dynamo's guards decide
                    self._seen = key
                    return self._compiled(loss)
                # the same key two calls running: a graph of its own, traced now, run without guards while
                # the key stays (a key that changes every call, a float lr under a scheduler, never gets one)
                fast = self._fast[key] = torch.compile(_own_step(self.opt), options=self._fast_options,
                                                       **self._compile_kwargs)
            return fast(loss)

    def _eager(self, closure: Callable[[], Any] | None, loss: Any) -> Any:
        out = self.opt.step(closure, loss=loss)
        self._held = tuple(hold(self.opt) for hold in HOLDS)
        return out

    def _lost(self) -> bool:
        """Whether something a traced step may have assumed about the state no longer holds (`HOLDS`)."""
        return any(hold(self.opt) < held for hold, held in zip(HOLDS, self._held))


#: guards="own": at most this many guard-free graphs per CompiledStep (then every call runs dynamo's guards)
MAX_FAST = 4

_grad_of = operator.attrgetter("grad")
_params_of = operator.itemgetter("params")
_dtype_of = operator.attrgetter("dtype")


#: values a traced step may bake into its graph, keyed by what they are (a freed number's id can come back
#: as another number's: an id alone could run a graph traced for another value)
_PLAIN = (int, float, bool, str, type(None))


def _value(v: Any) -> Any:
    """`v` in a key: a number, string or None as itself (with its type: 1 and 1.0 trace alike, True does
    not), a tuple of them likewise, anything else by identity."""
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v):
        return (tuple, tuple(map(type, v)), v)
    return id(v)


def _entries(store: dict[str, Any]) -> tuple:
    """A store's entries (a transform key -> its dict of values), one level further in: numbers and strings
    as themselves, tensors, which a step may rebind (a new EMA each step; the graph reads the current one),
    by their dtype, shape and device, anything else by identity; the length of each list, dict or tuple there."""
    out: list[Any] = [id(store), len(store)]
    for d in store.values():
        out += (id(d), len(d), *d.keys())
        for v in d.values():
            if isinstance(v, torch.Tensor):
                out += (v.dtype, v.shape, v.device)
            elif isinstance(v, (list, dict)) or (isinstance(v, tuple) and not isinstance(_value(v), tuple)):
                out += (id(v), len(v))
            else:
                out.append(_value(v))
    return tuple(out)


def _numels(values: list[Any]) -> tuple:
    """Each value's element count if it is a tensor (one resized in place keeps its identity), else None."""
    if all(map(isinstance, values, repeat(torch.Tensor))):  # (C-level: the usual case)
        return tuple(map(torch.Tensor.numel, values))
    return tuple(v.numel() if isinstance(v, torch.Tensor) else None for v in values)


def own_key(opt: Any, loss: Any = None) -> tuple[Any, ...]:
    """What `compile_step(opt, guards="own")`'s guard-free graphs are keyed by: everything the traced step
    reads from Python, by identity. The pipeline (`opt.plan`, `opt.transforms`), every param group's
    dict, its values and parameters (a float learning rate a scheduler rebinds is a new object: a new key;
    a tensor one written in place is not), which parameters have a gradient and whether each is
    contiguous, the parameters' dtypes, shapes and whether they are contiguous (a gradient has its
    parameter's shape and dtype: torch checks that), every state entry (`opt.state`, the transforms'
    stores and caches, two levels deep, with the lengths of lists there; a state tensor by identity and
    its element count, which a resize in place changes), the skip counter, the step hooks and taps, the
    non-finite path (the optimizer's `device_path`), grad mode and the deterministic-algorithms flag, and
    whether a loss is given. That is what inductor's size assert on each input checks, which the
    guard-free graphs leave out (0.4 us a tensor). Not seen: a state tensor given another shape of the
    same size or another dtype through `.data` (load a state dict instead)."""
    groups = opt.param_groups
    params = list(chain.from_iterable(map(_params_of, groups)))
    grads = list(map(_grad_of, params))
    has = tuple(map(operator.is_not, grads, repeat(None)))
    state = opt.state
    values = list(chain.from_iterable(map(dict.values, state.values())))
    return (
        id(opt.plan), id(opt.transforms), id(groups), len(groups),
        tuple(chain.from_iterable((id(g), len(g), *g.keys(), *map(_value, g.values())) for g in groups)),
        tuple(map(id, params)), has, all(map(torch.Tensor.is_contiguous, compress(grads, has))),
        tuple(map(_dtype_of, params)), tuple(map(torch.Tensor.size, params)), all(map(torch.Tensor.is_contiguous, params)),
        id(state), len(state), tuple(map(id, state.values())), tuple(map(id, values)), _numels(values),
        _entries(opt._store), _entries(opt._runtime), id(opt._skipped_steps),
        len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks),
        len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks), len(opt.__dict__.get("_step_taps", ())),
        opt.device_path, torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
        loss is None, type(loss),
    )


def _step(loss: Any = None, opt: Any = None) -> Any:
    return type(opt).step(opt, loss=loss)  # (the class's: a scheduler wraps the instance's, untraceably)


def _own_step(opt: Any) -> Callable[..., Any]:
    """`opt.step(loss=...)` as a function with a code object of its own (the optimizer a default
    argument). Dynamo keeps its compiled graphs on the code object: with `torch.compile(opt.step)`
    every `Modular` of the process shares `Modular.step`'s, so each call walks the guards of the
    other optimizers' graphs first, and with fewer guards one optimizer's graph could run for another.
    Here each `CompiledStep` has its own."""
    return types.FunctionType(_step.__code__.replace(), _step.__globals__, "modopt_step", (None, opt))


def compile_step(opt: Any, *, warmup: int = 1, guards: str = "full", **compile_kwargs: Any) -> CompiledStep:
    """`opt.step` compiled as one graph (`torch.compile(..., fullgraph=True)` unless told otherwise),
    with the final `Adam`/`AdamW` running torch's fused kernel as one op of the graph: on the CPU the
    same bits as the eager step (see docs/howto/compile.md). `guards="own"` runs, while modopt's own key
    (`own_key`: the pipeline, the param groups' values, the layout and the state entries, by identity)
    stays what it was on the call before, a graph compiled without dynamo's guards, and every other call
    under dynamo's guards (a changed float learning rate, a loaded state, a new group: never a stale
    graph). `guards="tensors"` keeps only dynamo's
    tensor guards (`torch.compiler.keep_tensor_guards_unsafe`): cheaper calls, but a changed group value
    of another type or a new state entry is not seen; use it only for a fixed pipeline and layout."""
    return CompiledStep(opt, warmup=warmup, guards=guards, **compile_kwargs)


def cuda_graph_step(opt: Any, *, warmup: int = 3, stream: Any = None) -> Callable[[], None]:
    """Capture `opt.step()` in a CUDA graph and return the function that replays it.

    The step must read everything that changes from device memory: the gradients stay the same
    tensors (zero them with `opt.zero_grad(set_to_none=False)`, and let backward accumulate into
    them), the learning rate is a device tensor (`tensor_hyperparams(opt)` is called here), and the
    pipeline decides the skip on the device (the default). `warmup` eager steps run first on a side
    stream (they create the state, as torch's capture recipe asks). A CUDA device is required."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params or params[0].device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("cuda_graph_step: the parameters must be on a CUDA device (a CUDA graph captures "
                           "CUDA kernels); on the CPU use compile_step(opt)")
    if any(p.grad is None for p in params):
        raise RuntimeError("cuda_graph_step: every parameter needs a gradient before the capture (the graph "
                           "reads the .grad tensors it saw): run one backward first")
    if not opt.plan.skips_on_device(opt.param_groups) and opt.plan.nonfinite not in ("ignore", "zero"):
        raise RuntimeError("cuda_graph_step: this pipeline decides the non-finite skip on the host (a sync), which "
                           "a CUDA graph cannot hold; use transforms that skip on the device or nonfinite='ignore'")
    tensor_hyperparams(opt)
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay
