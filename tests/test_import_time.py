"""`import modopt` stays cheap: it must not import `torch._dynamo` (about as long as `import torch`
itself). The timing is a benchmark (`benchmarks/import_time.py`), not a test; this checks the cause.

The functions `torch.compile` must treat specially are marked on first use (`modopt.core.compile_marks`);
`tests/test_compile.py` and `tests/test_one_graph.py` check that dynamo still sees them marked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modopt.core import compile_marks

pytestmark = pytest.mark.slow  # fresh interpreters, one compiling (the slow lane)

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_modopt_does_not_import_dynamo():
    assert _fresh("import modopt, sys; print('torch._dynamo' in sys.modules)") == "False"


def test_the_cli_does_not_import_dynamo():
    code = ("import sys\nfrom modopt.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch._dynamo' in sys.modules)")
    assert _fresh(code).splitlines()[-1] == "False"


def test_the_check_can_fail():
    assert _fresh("import modopt, sys, torch._dynamo; print('torch._dynamo' in sys.modules)") == "True"


_FIRST_READ_WHILE_TRACING = """
import torch
import modopt as mo
from modopt.core import compile_marks as cm

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))

def backward(m):
    m(torch.linspace(-1, 1, 20).reshape(5, 4)).square().sum().backward()

out = []
for build, words in (
    (lambda m: mo.Modular(m.parameters(), mo.TorchOptimizer(torch.optim.SGD, lr=0.1)),
     "TorchOptimizer runs the wrapped"),
    (lambda m: mo.Modular(m.parameters(), mo.SGD(lr=0.1), nonfinite="raise"), "decides on the host"),
):
    m = model()
    opt = build(m)
    backward(m)
    try:
        torch.compile(opt.step, fullgraph=True)()
        out.append("compiled")
    except torch._dynamo.exc.Unsupported as e:
        out.append(words in str(e))
# fnmatch cannot be traced: fullgraph works only with the name match marked constant
a, b = model(), model()
where = mo.Select(names=["*.weight"], exclude=["1.*"])
mk = lambda m: mo.Modular(m.named_parameters(), mo.Masked(mo.ClipValue(1e-3), where=where), mo.SGD(lr=0.1),
                          nonfinite="ignore")
eager, comp = mk(a), mk(b)
step = torch.compile(comp.step, fullgraph=True)
for _ in range(2):
    backward(a)
    backward(b)
    eager.step()
    step()
out.append(all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(a.parameters(), b.parameters())))
out.append(sorted(k for k in ("settle", "torch_optimizer_step", "any_match") if k in vars(cm)))
print(out)
"""


def test_dynamo_sees_the_marks_when_it_reads_them_first():
    """In a fresh process no mark exists until dynamo traces: the fullgraph errors still give the
    reasons, and a name selection still compiles into one graph."""
    out = _fresh(_FIRST_READ_WHILE_TRACING).splitlines()[-1]
    assert out == str([True, True, True, ["any_match", "settle", "torch_optimizer_step"]])


def test_a_mark_is_made_once_and_unknown_names_are_errors():
    """Reading a mark imports dynamo (here, in the test process) and caches the marked function."""
    marked = compile_marks.settle
    assert marked is compile_marks.settle
    assert vars(compile_marks)["settle"] is marked
    from modopt.core.runner import _settle

    assert marked is not _settle and marked.__wrapped__ is _settle
    from modopt.core.select import _any_match

    assert compile_marks.any_match is _any_match  # assume_constant_result marks the function itself
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        compile_marks.nothing  # noqa: B018


def test_torch_optimizer_uses_the_disabled_step_once_dynamo_is_loaded():
    """With dynamo imported (this process has it), eager steps go through the disabled function, as
    they did when it was made at import: a frame that dynamo runs eagerly cannot compile torch's step."""
    import torch._dynamo  # noqa: F401
    import modopt as mo

    p = torch.nn.Parameter(torch.ones(3))
    opt = mo.Modular([p], mo.TorchOptimizer(torch.optim.SGD, lr=0.5))
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), 0.5))
    assert "torch_optimizer_step" in vars(compile_marks)


def test_import_modopt_builds_no_transform_validator_until_one_is_used():
    """Each transform class makes its pydantic validator on first use (`defer_build`, where pydantic calls
    `__pydantic_on_complete__`), so `import modopt` does not pay for 54 of them; a used class keeps its readable
    signature after it is built."""
    import pydantic

    if not hasattr(pydantic.BaseModel, "__pydantic_on_complete__"):
        pytest.skip(f"pydantic {pydantic.VERSION} has no __pydantic_on_complete__: validators are built at import")
    code = ("import inspect, modopt as mo\nfrom modopt.core import registry\n"
            "built = lambda: sorted(n for n, c in registry._TRANSFORMS.items() if c.__pydantic_complete__)\n"
            "before = built()\nmo.ClipNorm(1.0)\n"
            "print(before, built(), str(inspect.signature(mo.ClipNorm).parameters['scope']))")
    out = _fresh(code).splitlines()[-1]
    assert out == "[] ['ClipNorm'] scope: \"'global' | 'group' | 'tensor'\" = 'global'", out
