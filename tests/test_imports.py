"""The package's dependency direction: no import cycles, and every module imports on its own.

Data and contracts sit at the bottom (keys, registry, reduce, state, runner, transform,
scope), the config (`core.pipeline_config`) and the checkpoint format (`core.checkpoint`)
below the optimizer (`core.modular`), the command line above everything. An import that
points back up, even one hidden inside a function or under `if TYPE_CHECKING:` (a type hint
is an arrow too), makes a cycle and fails here unless `ALLOWED_CYCLES` lists it with why;
and the package has no `TYPE_CHECKING` blocks at all, so every arrow is one the code really
needs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "modopt"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _targets(mods: dict[str, Path], cur: str, node: ast.AST) -> list[str]:
    base = cur.split(".") if mods[cur].name == "__init__.py" else cur.split(".")[:-1]
    if isinstance(node, ast.ImportFrom):
        pkg = base[: len(base) - node.level + 1] if node.level else []
        mod = ".".join(pkg + ([node.module] if node.module else [])) if node.level else (node.module or "")
        return [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names if mod in mods or f"{mod}.{a.name}" in mods]
    return [a.name for a in node.names if a.name in mods]


def import_graph(at_load: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at run time (function-level imports included; with
    `at_load`, only those its import runs: none inside a function)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}

    def visit(node: ast.AST, cur: str) -> None:
        for child in ast.iter_child_nodes(node):
            if at_load and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                edges[cur].update(t for t in _targets(mods, cur, child) if t != cur)
            visit(child, cur)

    for name, path in mods.items():
        visit(ast.parse(path.read_text()), name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            strong(v)
    return found


#: the import cycles that remain, each with why; the list only shrinks
ALLOWED_CYCLES = [
    # each makes the other: a Modular holds its PipelineConfig (modular.py imports the config module when
    # loaded) and `PipelineConfig.build` makes a Modular (importing modular.py inside `build`, when it runs).
    # The config has its own module (issue 37 item 4); the other ways out are one module for the two
    # concerns, as before, or a registry of builders, which issue 17 item 5 removed
    ["modopt.core.modular", "modopt.core.pipeline_config"],
]


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == ALLOWED_CYCLES
    # and each one that remains is closed only inside a function: loading the package follows one direction
    assert cycles(import_graph(at_load=True)) == []
    assert "modopt.core.modular" not in import_graph(at_load=True)["modopt.core.pipeline_config"]


def type_checking_blocks() -> dict[str, int]:
    """Module -> the number of `if TYPE_CHECKING:` blocks in it (none expected)."""
    out = {}
    for name, path in _modules().items():
        n = sum(1 for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
        if n:
            out[name] = n
    return out


def test_no_type_checking_imports():
    assert type_checking_blocks() == {}


def test_the_core_is_layered():
    """The runner sits below the transforms: it never imports them (nor scope, nor the optimizer)."""
    edges = import_graph()
    assert not edges["modopt.core.runner"] & {"modopt.core.transform", "modopt.core.scope", "modopt.core.modular"}
    # the config and the checkpoint format sit below the optimizer: they never import it at load
    at_load = import_graph(at_load=True)
    for below in ("modopt.core.pipeline_config", "modopt.core.checkpoint", "modopt.core.configfile"):
        assert "modopt.core.modular" not in at_load[below], below
    assert "modopt.core.modular" not in edges["modopt.core.checkpoint"]
    # a config builds its optimizer directly (an import inside PipelineConfig.build), not through a registry
    import modopt.core.registry as registry

    assert not hasattr(registry, "builder") and not hasattr(registry, "register_builder")


#: the core's imports of the layers above it that remain, each with why; the list only shrinks
CORE_UPWARD = {
    # `cfg.lint()`, the linter's method on a config: it tells the user, and nothing in the core reads it
    ("modopt.core.pipeline_config", "modopt.lint"),
    # `Modular(..., lint=True)` warns once, when built, about what the linter finds (the step never reads
    # lint: the plan holds what it acts on); to go, the linter would read the plan (issue 37 item 1)
    ("modopt.core.modular", "modopt.lint"),
    # a torch.optim checkpoint continues in the transform that runs the same torch algorithm (mo.SGD, mo.Adam,
    # mo.AdamW, or mo.TorchOptimizer of the same class); to go, the optimizer transforms would declare their
    # algorithm
    ("modopt.core.torch_checkpoint", "modopt.transforms.optimizers"),
    ("modopt.core.torch_checkpoint", "modopt.transforms.torch_optimizer"),
}


def test_the_core_imports_nothing_above_it_but_the_listed():
    """`modopt.core` sits below the transforms, the linter and the command line: the step and the plan never
    import them (the plan reads what transforms declare). The remaining exceptions are listed with why."""
    edges = import_graph()
    upward = {(m, t) for m, ts in edges.items() if m.startswith("modopt.core")
              for t in ts if t.startswith(("modopt.transforms", "modopt.lint", "modopt.cli", "modopt.telemetry",
                                           "modopt.rewind", "modopt.functional", "modopt.config"))}
    assert upward == CORE_UPWARD
    for step_module in ("modopt.core.runner", "modopt.core.plan", "modopt.core.reduce", "modopt.core.scope"):
        assert not any(m == step_module for m, _ in upward), step_module
    # and each exception is an import inside a function: loading the core loads none of the layers above it
    at_load = import_graph(at_load=True)
    assert not {(m, t) for m, t in CORE_UPWARD if t in at_load[m]}


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_function_level_imports():
    edges = import_graph()
    assert "modopt.core.pipeline_config" in edges["modopt.config"]
    assert "modopt.core.modular" in edges["modopt.core.pipeline_config"]  # imported inside PipelineConfig.build
    assert "modopt.cli.compare" in edges["modopt.cli"]  # imported inside a function of cli/__init__.py


def test_every_module_imports_on_its_own():
    names = [n for n in _modules() if not n.endswith("__main__")]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'modopt' or m.startswith('modopt.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
        "print('ok', len(" + repr(names) + "))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
