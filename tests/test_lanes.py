"""The test lanes (docs/testing.md): the bare `python -m pytest` runs exactly the tests
with no lane marker, every other test is in exactly one lane, and a test that calls the compiler is in the
compile lane. One collection in a subprocess (no test runs), read back through a small plugin."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import LANE_WORKERS, LANES

ROOT = Path(__file__).resolve().parents[1]

# Loaded into the collecting pytest with -p: it records every collected test with its lane markers (before the
# mark plugin deselects), which the bare command then keeps, and the tests whose own body calls the compiler.
PROBE = textwrap.dedent('''
    import ast, inspect, json, os, textwrap
    import pytest

    LANES = set(json.loads(os.environ["LANES_PROBE_LANES"]))
    seen = {}
    _calls = {}

    def _calls_compiler(fn):
        """`torch.compile(...)` or `<anything>.compile_step(...)` / `compile_step(...)` in the test's own body."""
        if fn not in _calls:
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError):
                tree = ast.parse("")
            found = False
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    torch_compile = name == "compile" and isinstance(f, ast.Attribute) and \\
                        isinstance(f.value, ast.Name) and f.value.id == "torch"
                    found = found or torch_compile or name == "compile_step"
            _calls[fn] = found
        return _calls[fn]

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(items):
        for item in items:
            fn = getattr(item, "function", None)
            seen[item.nodeid] = {
                "lanes": sorted({m.name for m in item.iter_markers()} & LANES),
                "compiles": bool(fn is not None and _calls_compiler(fn)),
            }

    def pytest_collection_finish(session):
        with open(os.environ["LANES_PROBE_OUT"], "w") as f:
            json.dump({"all": seen, "selected": [i.nodeid for i in session.items]}, f)
''')


def test_each_test_is_in_one_lane_and_the_bare_command_runs_the_fast_one(tmp_path):
    (tmp_path / "lanes_probe.py").write_text(PROBE)
    out = tmp_path / "lanes.json"
    env = dict(os.environ, LANES_PROBE_OUT=str(out), LANES_PROBE_LANES=json.dumps(LANES),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    # the README's command as a contributor types it (no path, no -m), only collecting
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        "-p", "lanes_probe"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    every, selected = got["all"], set(got["selected"])

    twice = sorted(n for n, t in every.items() if len(t["lanes"]) > 1)
    assert not twice, f"tests in more than one lane (CI would run them twice): {twice[:10]}"
    fast = {n for n, t in every.items() if not t["lanes"]}
    assert selected == fast, (
        f"the bare command runs tests of other lanes: {sorted(selected - fast)[:10]}; "
        f"or leaves out fast ones: {sorted(fast - selected)[:10]}")
    assert set(LANE_WORKERS) == set(LANES), "each lane names its CI workers (.ci/run reads LANE_WORKERS)"
    for lane in LANES:  # a lane that lost its marker everywhere would pass silently
        assert any(lane in t["lanes"] for t in every.values()), f"no test is marked {lane}"
    assert any("test_lanes.py::" in n for n in fast), "this check itself is in the fast lane"

    compiling = sorted({n.split("[")[0] for n, t in every.items() if t["compiles"] and "compile" not in t["lanes"]})
    assert not compiling, (
        "these tests call torch.compile or compile_step but are not in the compile lane; "
        f"add @pytest.mark.compile: {compiling}")


# --- the map of tests/README.md: the tests filed by the code they test --------------------------------------------
def unmapped(root: Path) -> tuple[list[str], list[str]]:
    """`(test files, modules)` that tests/README.md's map does not name: a test file by its name in backquotes, a
    module by a test file named after it (`test_<module>.py`, `test_<package>_<module>.py`) or by its path in a row (`core/step.py`,
    `modopt/attention.py`, `modules.py` in the cli row). Package `__init__`s, `__main__` and private modules are
    left out, as are the float64 specs (`modopt/spec/`, one row: every registered transform against its spec)."""
    text = (root / "tests" / "README.md").read_text(encoding="utf-8")
    tests = [p.name for p in sorted((root / "tests").glob("test_*.py")) if f"`{p.name}`" not in text]
    modules = []
    for p in sorted((root / "modopt").rglob("*.py")):
        rel = p.relative_to(root / "modopt")
        if p.name.startswith("_") or rel.parts[0] == "spec":
            continue
        named = (f"{rel.parent.name}/{p.name}" if len(rel.parts) > 1 else f"modopt/{p.name}")
        own = [f"test_{p.stem}.py"] + ([f"test_{rel.parent.name}_{p.stem}.py"] if len(rel.parts) > 1 else [])
        if not any((root / "tests" / t).exists() for t in own) and named not in text \
                and not (len(rel.parts) > 1 and f"`{p.name}`" in text):
            modules.append(str(rel))
    return tests, modules


def test_every_test_file_and_every_module_has_its_row_in_the_map():
    tests, modules = unmapped(ROOT)
    assert not tests, f"tests/README.md has no row for {tests}: say which code each tests"
    assert not modules, f"tests/README.md names no test file for {modules}: add a row (or a test_<module>.py)"


def test_the_map_check_sees_a_missing_row(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "modopt" / "core").mkdir(parents=True)
    (tmp_path / "tests" / "README.md").write_text("| `test_a.py` | `core/a.py` |\n", encoding="utf-8")
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / "tests" / name).write_text("", encoding="utf-8")
    for name in ("a.py", "b.py", "c.py", "d.py", "_private.py"):
        (tmp_path / "modopt" / "core" / name).write_text("", encoding="utf-8")
    assert unmapped(tmp_path) == (["test_b.py", "test_c.py"], ["core/d.py"])
