"""Every example runs, in its short mode (scripts with --quick, configs with a few steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modopt.cli import main

pytestmark = pytest.mark.slow  # runs every example (the slow lane)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
CONFIGS = sorted((EXAMPLES / "configs").glob("*.yaml"))


def test_examples_exist():
    names = {p.name for p in SCRIPTS}
    assert {"train_loop.py", "attach_adamw.py", "checkpoint_resume.py"} <= names
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_quick(script):
    env = {**os.environ, "MODOPT_QUICK": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    if script.name == "checkpoint_resume.py":
        assert "identical = True" in r.stdout
    if script.name == "custom_transform.py":  # the stateful example of docs/transform-reference.md
        assert "matches the float64 reference" in r.stdout and "bit-exact: True" in r.stdout


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_runs_short(config, tmp_path, capsys):
    assert main(["validate", str(config)]) == 0
    out = tmp_path / "cmp"
    assert main(["compare", str(config), "--steps", "6", "--out", str(out), "--quiet", "--no-plots"]) == 0
    rows = [seed for run in json.loads((out / "compare.json").read_text())["runs"] for seed in run["per_seed"]]
    assert rows and all(r["steps"] == 6 for r in rows)
