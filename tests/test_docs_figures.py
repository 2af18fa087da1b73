"""The published tables that are cheap to make are remade here and compared with the pages, cell by cell.

- docs/modules/statistical.md, "Golden traces": each column's transform is built from its head and
  the trace rerun (float64: exact on any machine);
- docs/cli.md, the teacher-student comparison: the command the page names is run and what it prints
  is compared with the page's table (every column but ms/step, which is wall time);
- docs/performance.md's pipeline names select their pipeline with `bench.py --only`.

The summary of the default run (docs/cli.md) is a console block, rerun by tests/test_docs_blocks.py.
The expensive figures (the transformer comparison, the benchmark, the plots) are remade by
`docs/regenerate`, not here.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import modopt as mo
from test_docs_blocks import LINKED_INTO_CWD, _env, read_blocks

ROOT = Path(__file__).resolve().parent.parent
#: columns that depend on the machine, not on the code
MACHINE_DEPENDENT = {"ms/step"}


def tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """The Markdown tables of a text: (line of the header, header cells, rows of cells)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            head, rows, j = _cells(lines[i]), [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append((i + 1, head, rows))
            i = j
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = re.search(r"^#{1,3} ", text[start + len(heading):], flags=re.M)
    return text[start:start + len(heading) + (nxt.start() if nxt else len(text))]


# --------------------------------------------------------------------------- golden traces

WARMUP = [1.0, 1.2, 0.8, 1.1, 0.9] * 5


def output_norms(transform: mo.Transform, norms: list[float]) -> list[float]:
    """The parameter change of each step of ``Modular([p], transform, LR(1))`` on a float64 scalar
    whose gradient is each norm in turn."""
    p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = mo.Modular([p], transform, mo.LR(1.0))
    out = []
    for g in norms:
        before = p.detach().clone()
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(float((before - p.detach()).abs()))
    return out


def test_the_golden_traces_of_the_statistical_page_are_what_the_transforms_compute():
    text = section((ROOT / "docs" / "modules" / "statistical.md").read_text(), "## Golden traces")
    assert "`[1.0, 1.2, 0.8, 1.1, 0.9] * 5`" in text  # the warm-up the page states is the one run here
    ((_, head, rows),) = tables(text)
    assert head[:2] == ["step", "in"] and len(head) == 5 and len(rows) == 8
    inputs = [float(r[1]) for r in rows]
    assert [int(r[0]) for r in rows] == list(range(len(WARMUP) + 1, len(WARMUP) + 1 + len(rows)))
    for col, name in enumerate(head[2:], start=2):
        transform = eval(name.strip("`"), {"mo": mo})  # the head is the transform, as built
        got = output_norms(transform, WARMUP + inputs)[len(WARMUP):]
        shown = [r[col] for r in rows]
        assert [f"{v:.6f}" for v in got] == shown, f"statistical.md, column {name}"


# --------------------------------------------------------------------------- the teacher-student table


def _command_and_table(page: str, needle: str) -> tuple[str, int, list[str], list[list[str]]]:
    """The bash command of ``page`` that contains ``needle`` and is followed by a table before the next
    code block: the command and its table."""
    text = (ROOT / page).read_text()
    blocks, _ = read_blocks(text, page)
    found = []
    for k, b in enumerate(blocks):
        end = blocks[k + 1].line if k + 1 < len(blocks) else len(text.splitlines()) + 1
        after = [t for t in tables(text) if b.line < t[0] < end]
        if b.lang == "bash" and needle in b.code and after:
            (command,) = [ln for ln in b.code.splitlines() if needle in ln]
            found.append((command.split(" #")[0].strip(), *after[0]))
    assert len(found) == 1, f"{page}: {len(found)} commands with {needle!r} followed by a table"
    return found[0]


@pytest.mark.slow
def test_the_teacher_student_table_of_cli_md_is_what_its_command_prints(tmp_path):
    command, line, head, rows = _command_and_table("docs/cli.md", "teacher_student.yaml")
    for name in LINKED_INTO_CWD:
        (tmp_path / name).symlink_to(ROOT / name)
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    printed = tables(done.stdout)
    assert printed, f"`{command}` printed no table:\n{done.stdout}"
    _, p_head, p_rows = printed[-1]
    p_by_run = {r[0]: dict(zip(p_head, r)) for r in p_rows}
    where = f"docs/cli.md:{line} (the table of `{command}`)"
    diffs = [f"column {c!r}: not in what the command prints ({p_head})" for c in head
             if c not in p_head and c not in MACHINE_DEPENDENT]
    diffs += [f"run {r[0]!r}: not in what the command prints" for r in rows if r[0] not in p_by_run]
    diffs += [f"run {r!r}: printed, not on the page" for r in p_by_run if r not in {row[0] for row in rows}]
    for row in rows:
        got = p_by_run.get(row[0], {})
        for col, shown in zip(head[1:], row[1:]):
            value = re.sub(r"\s*± n/a$", "", got.get(col, shown))  # one seed: no interval, nothing left out
            if col not in MACHINE_DEPENDENT and value != shown:
                diffs.append(f"{row[0]}, {col}: page {shown}, printed {value}")
    assert not diffs, f"{where} differs from what the command prints:\n" + "\n".join(diffs) + "\n" + done.stdout


# --------------------------------------------------------------------------- docs/regenerate


def load(path: Path, name: str):
    """A script of the checkout (not a package module) as a module."""
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    sys.modules[name] = module  # dataclasses look their module up
    loader.exec_module(module)
    return module


def test_every_image_of_the_docs_is_made_by_a_part_of_docs_regenerate():
    regenerate = load(ROOT / "docs" / "regenerate", "docs_regenerate")
    shown = {m for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
             for m in re.findall(r"img/([\w.-]+\.png)", p.read_text())}
    assert len(shown) >= 10
    copied = {dest for _, steps in regenerate.PARTS.values() for _, files in steps for dest in files.values()}
    gen_plots = load(ROOT / "docs" / "gen_plots.py", "docs_gen_plots")
    plotted = {f"{family}.png" for family in gen_plots.families()} | {"orthogonal.png"}
    mission = {"mission-pipeline.png"} if '"mission-pipeline.png"' in (ROOT / "docs" / "mission_plot.py").read_text() else set()
    assert shown <= copied | plotted | mission, f"images no part of docs/regenerate makes: {shown - copied - plotted - mission}"
    assert {"python docs/gen_plots.py", "python docs/mission_plot.py"} <= {
        c for _, steps in regenerate.PARTS.values() for c, _ in steps}


# --------------------------------------------------------------------------- bench.py --only


@pytest.fixture(scope="module")
def bench():
    return load(ROOT / "benchmarks" / "bench.py", "modopt_benchmark_names")


def test_every_pipeline_name_in_the_performance_tables_selects_its_pipeline_with_only(bench):
    names = {row[0] for _, head, rows in tables((ROOT / "docs" / "performance.md").read_text())
             if head[:2] == ["pipeline", "model"] for row in rows}
    assert len(names) >= 6
    for name in names:
        assert len(bench.select_pipelines(name)) == 1, name
    assert sorted(bench.LABELS.values()) == sorted(p.name for p in bench.PIPELINES)  # every pipeline has one


def test_only_with_a_name_that_matches_nothing_is_an_error_listing_the_names(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--only", "ClipNorm + Lion"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--only 'ClipNorm + Lion' matches no pipeline" in err
    assert all(label in err for label in bench.LABELS) and "ZClip(), AdamW()" in err
    assert [bench.PIPELINES[i].name for i in bench.select_pipelines("ClipNorm")] == [
        p.name for p in bench.PIPELINES if "ClipNorm" in p.name]  # a part of a name still selects every match
