"""A stateful transform written outside the package: registered, serialisable, checkpointed, tested.

docs/transform-reference.md (State) points here; the tests run this file.
`ClipToRunningAbs` clips every element of the update to `factor` times an EMA
of that element's magnitude: a per-element spike guard.

    python examples/custom_transform.py --quick
"""

import argparse
import io
import os
from typing import ClassVar

import torch
from pydantic import Field, PositiveFloat

import modopt as mo


class ClipToRunningAbs(mo.Transform):
    """Clip each element of the update to `factor` times an EMA of its magnitude.

    $$
    m \\leftarrow \\beta m + (1 - \\beta) |u|, \\qquad u \\leftarrow \\operatorname{clamp}(u, -f m, f m)
    $$

    The first step only records `m = |u|`. Telemetry: `clipped` (any element clipped).
    """

    positional = "factor"  # every transform says which field a bare argument sets: ClipToRunningAbs(2.0)

    factor: PositiveFloat = 3.0
    beta: float = Field(0.9, ge=0.0, lt=1.0)
    # what it saves: checked and placed on the parameter's device by load_state_dict
    state_buffers: ClassVar[dict] = {"abs_ema": "param", "steps": "counter"}

    def apply(self, ctx, st, updates):
        # one buffer per parameter, created on first use; saved in opt.state_dict()
        m = st.buffers("abs_ema", lambda i, p: updates[i].detach().abs().clone())
        fresh = st.store.setdefault("steps", 0) == 0
        st.store["steps"] += 1
        if fresh:
            st.record("clipped", torch.zeros((), dtype=torch.bool))
            return updates
        torch._foreach_lerp_(m, [u.abs() for u in updates], 1 - self.beta)
        bounds = [self.factor * x for x in m]
        clipped = torch.stack([(u.abs() > b).any() for u, b in zip(updates, bounds)]).any()
        for u, b in zip(updates, bounds):
            torch.clamp_(u, -b, b)  # in place: apply may modify `updates`
        st.record("clipped", clipped)  # a tensor: telemetry never synchronises
        return updates


def reference(grads, factor, beta, lr):
    """The same rule in float64 on plain tensors (the spec counterpart)."""
    m, out = None, []
    for g in grads:
        g = g.double()
        if m is None:
            m, u = g.abs(), g
        else:
            m = beta * m + (1 - beta) * g.abs()
            u = g.clamp(-factor * m, factor * m)
        out.append(-lr * u)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", default=bool(os.environ.get("MODOPT_QUICK")))
    steps = 8 if ap.parse_args().quick else 50

    # registered by subclassing: configs can name it
    assert "ClipToRunningAbs" in mo.available()
    t = ClipToRunningAbs(2.0, beta=0.8)
    cfg = mo.PipelineConfig.from_dict({"transforms": [t.to_dict(), {"type": "SGD", "lr": 0.1}]})
    print("config:", cfg.to_dict()["transforms"][0])

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=g) * (20.0 if k == 4 else 1.0) for k in range(steps)]  # a spike at step 5

    # exact against the float64 reference
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt = cfg.build([p])
    deltas = []
    for k, gr in enumerate(grads):
        before = p.detach().clone()
        p.grad = gr.double()
        opt.step()
        deltas.append(p.detach() - before)
        if k == 4:
            print("spike step clipped:", bool(next(v for kk, v in opt.stats.items() if kk.endswith(".clipped"))))
    ref = reference(grads, 2.0, 0.8, 0.1)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(deltas, ref))
    print("matches the float64 reference over", steps, "steps")

    # checkpoint: stop half-way, save, rebuild, load, continue: bit-exact
    def run(split):
        q = torch.nn.Parameter(torch.zeros(5))
        o = cfg.build([q])
        for k, gr in enumerate(grads):
            if k == split:
                buf = io.BytesIO()
                torch.save(o.state_dict(), buf)
                o = cfg.build([q])
                o.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
            q.grad = gr.clone()
            o.step()
        return q.detach()

    same = torch.equal(run(None), run(steps // 2))
    print("checkpoint resume bit-exact:", same)
    assert same


if __name__ == "__main__":
    main()
