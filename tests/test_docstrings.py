"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import pkgutil

import pytest

import modopt

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(modopt.__path__, "modopt.") if ".cli" not in m.name and not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_every_registered_transform_with_a_docstring_example_is_exercised():
    attempted = 0
    for name in MODULES:
        if name.startswith("modopt.transforms"):
            for test in doctest.DocTestFinder().find(importlib.import_module(name), name):
                attempted += len(test.examples)
    assert attempted >= 20, attempted


# --- every public function, method and class has a docstring (what `pyright --verifytypes` counts; tests/test_types.py
# runs pyright itself where it can, this check runs everywhere) ------------------------------------------------------
def _public_modules() -> list[str]:
    """Every module of the package outside private ones (a `_name` part), the command line included."""
    names = [m.name for m in pkgutil.walk_packages(modopt.__path__, "modopt.") if not m.name.endswith("__main__")]
    return sorted(["modopt", *(n for n in names if not any(p.startswith("_") for p in n.split(".")))])


def _public_names(module) -> list[str]:
    """`__all__`, else the names the module itself defines without a leading underscore."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]


def _class_docstrings(module) -> dict[str, bool]:
    """Class name -> whether its body starts with a docstring (read from the source: a dataclass writes its
    own `__doc__` when the class has none)."""
    tree = ast.parse(inspect.getsource(module))
    return {n.name: ast.get_docstring(n) is not None for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _functions_of(cls: type) -> dict[str, object]:
    """The public methods (properties' getters included) a class and its modopt base classes define."""
    out: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("modopt"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if inspect.isfunction(fn):
                out[f"{klass.__qualname__}.{name}"] = fn
    return out


def undocumented() -> list[str]:
    """`module.name` of every public function, method and class without a docstring."""
    missing: set[str] = set()
    for name in _public_modules():
        module = importlib.import_module(name)
        classes = _class_docstrings(module)
        for attr in _public_names(module):
            obj = getattr(module, attr)
            if getattr(obj, "__module__", None) != name:
                continue  # a re-export: checked where it is defined
            if isinstance(obj, type):
                for klass in obj.__mro__:  # the class and the modopt base classes it inherits from
                    if klass.__module__.startswith("modopt"):
                        docs = classes if klass.__module__ == name else _class_docstrings(importlib.import_module(klass.__module__))
                        if not docs.get(klass.__name__, bool(klass.__doc__)):
                            missing.add(f"{klass.__module__}.{klass.__qualname__}")
                for where, fn in _functions_of(obj).items():
                    if not getattr(fn, "__doc__", None):
                        missing.add(f"{fn.__module__}.{where}")
            elif inspect.isfunction(obj) and not obj.__doc__:
                missing.add(f"{name}.{attr}")
    return sorted(missing)


def test_every_public_function_and_class_has_a_docstring():
    missing = undocumented()
    assert not missing, f"{len(missing)} public function(s)/class(es) without a docstring:\n" + "\n".join(missing)


def test_the_docstring_check_sees_a_missing_docstring(monkeypatch):
    def bare(x: int) -> int:
        return x

    bare.__module__ = "modopt.functional"
    monkeypatch.setattr(modopt.functional, "bare_for_the_test", bare, raising=False)
    monkeypatch.setattr(modopt.functional, "__all__", [*getattr(modopt.functional, "__all__", []), "bare_for_the_test"],
                        raising=False)
    assert "modopt.functional.bare_for_the_test" in undocumented()


# --- no control characters in the package's text: a `\tau` or `\text` written into a file through a string that was not
# raw arrives as a tab plus "au" and renders as broken math in help() and on the docs site ---------------------------
def control_characters(root) -> list[str]:
    """`path:line` of every character below U+0020 other than a newline in the package's sources and the docs."""
    found = []
    for path in sorted([*root.joinpath("modopt").rglob("*.py"), *root.joinpath("docs").rglob("*.md")]):
        for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if any(ord(c) < 0x20 for c in line):
                found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_no_control_characters_in_the_sources_and_docs():
    from pathlib import Path
    found = control_characters(Path(__file__).resolve().parents[1])
    assert not found, "a tab or other control character (a math escape from a string that was not raw?): " + ", ".join(found)


def test_the_control_character_check_sees_a_tab(tmp_path):
    (tmp_path / "modopt").mkdir(); (tmp_path / "docs").mkdir()
    (tmp_path / "modopt" / "m.py").write_text('"""ok"""\n', encoding="utf-8")
    (tmp_path / "docs" / "page.md").write_text("fine\n$$ G > \tau $$\n", encoding="utf-8")
    assert control_characters(tmp_path) == ["docs/page.md:2"]
