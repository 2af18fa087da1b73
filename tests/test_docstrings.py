"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
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
