"""Every code block of README.md and docs/**/*.md runs, in page order, as a reader would run it.

Each page's runnable blocks run in ONE fresh Python process (so a block sees what the blocks above it
defined), in an empty temporary directory, with ``MPLBACKEND=Agg``, under a per-page timeout. Where a
page shows output, what the block printed must match it. The conventions a page uses to steer this
(hidden setup, fragments, skips, shown output, command transcripts) are documented in
docs/transform-reference.md, "Code blocks in the docs"; this file is their only implementation.

Run ``python tests/test_docs_blocks.py PAGE.md`` to run one page the way the test does and see
what each block printed.
"""

from __future__ import annotations

import contextlib
import difflib
import doctest
import importlib.util
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: what a reader runs from a clone: the pages' commands name these paths relative to the root
LINKED_INTO_CWD = ("examples", "benchmarks")
#: `modopt run` / `modopt compare` in a bash block whose output the page does not show run this
#: many steps (a smoke run: the command, its config and its flags are what is checked)
SHORT_STEPS = 8
#: seconds a page may take unless it says otherwise (`<!-- docs-test: page timeout=N -->`)
PAGE_TIMEOUT = 300

MARKER = re.compile(r"^\s*<!--\s*docs-test:(.*?)(-->)?\s*$")
FENCE_OPEN = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<lang>[\w+-]*)[^`]*$")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
RUN_LANGS = {"python": "python", "py": "python", "pycon": "doctest", "bash": "bash", "sh": "bash", "shell": "bash"}

#: markers that pages outside this change's scope still need; each names the first line of its block.
#: Move them into the page (as `<!-- docs-test: ... -->` right before the block) and delete them here:
#: the test below fails once a page carries the marker itself.
PENDING_MARKERS: dict[str, dict[str, str]] = {}


class DocsTestError(ValueError):
    """A page breaks the docs-test conventions (a marker with no block, an unknown directive, ...)."""


@dataclass
class Marker:
    directive: str  # setup, fragment, skip, output, console, file, page
    arg: str  # the rest: a reason, a file name, options
    line: int


@dataclass
class Block:
    """One fenced block of a page: its language, the line of its opening fence and its text."""

    lang: str
    line: int  # 1-based line of the opening fence
    code: str
    marker: Marker | None = None
    prose_before: bool = True  # prose (not only blank lines or markers) since the previous block


@dataclass
class Expect:
    text: str
    line: int
    rtol: float | None = None


@dataclass
class Step:
    """What the driver runs: python, bash, a console transcript, or a file to write."""

    kind: str
    line: int
    code: str
    expect: Expect | None = None  # python/bash: what it printed; console: per command, below
    commands: list = field(default_factory=list)  # console: [(command, Expect)]
    path: str = ""  # file


@dataclass
class Plan:
    page: str
    steps: list[Step]
    skipped: list[tuple[int, str]]  # (line, reason)
    timeout: float = PAGE_TIMEOUT
    slow: bool = False
    requires: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.steps)


# --------------------------------------------------------------------------- parsing


def parse_options(arg: str) -> tuple[set[str], dict[str, str]]:
    """``slow timeout=300 requires=lightning`` -> ({"slow"}, {"timeout": "300", "requires": "lightning"})."""
    flags, opts = set(), {}
    for word in arg.split():
        key, eq, value = word.partition("=")
        (opts.__setitem__(key, value) if eq else flags.add(key))
    return flags, opts


def read_blocks(text: str, page: str = "<page>") -> tuple[list[Block], list[Marker]]:
    """The fenced blocks of a Markdown text, each with the docs-test marker right before it.

    Returns the blocks (a hidden setup comment as a python block whose line is the comment's) and
    the page markers (``<!-- docs-test: page ... -->``)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    page_markers: list[Marker] = []
    pending: Marker | None = None
    prose = True
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        if m:
            end = i
            while "-->" not in lines[end]:
                end += 1
                if end == len(lines):
                    raise DocsTestError(f"{page}:{i + 1}: a docs-test comment that never ends (no '-->')")
            directive, _, arg = m.group(1).strip().partition(" ")
            directive = directive.rstrip(":")
            arg = arg.strip()
            if directive == "setup":
                body = lines[i + 1:end] if m.group(2) is None else []
                if not body or lines[end].strip() != "-->":
                    raise DocsTestError(f"{page}:{i + 1}: a setup comment holds python lines between "
                                        "'<!-- docs-test: setup' and a line '-->'")
                if any(not ln.strip() for ln in body):
                    raise DocsTestError(f"{page}:{i + 1}: a blank line inside a setup comment (Markdown would end "
                                        "the hidden HTML block there and show the rest)")
                blocks.append(Block("python", i + 1, textwrap.dedent("\n".join(body)), None, prose))
                prose = False
            elif directive == "page":
                page_markers.append(Marker("page", arg, i + 1))
            else:
                if directive not in {"fragment", "skip", "output", "console", "file"}:
                    raise DocsTestError(f"{page}:{i + 1}: unknown docs-test directive {directive!r} "
                                        "(setup, fragment, skip, output, console, file, page)")
                if directive == "skip" and not arg.lstrip(":").strip():
                    raise DocsTestError(f"{page}:{i + 1}: 'docs-test: skip' needs a reason: "
                                        "<!-- docs-test: skip: why -->")
                if pending is not None:
                    raise DocsTestError(f"{page}:{pending.line}: a docs-test marker with no code block after it")
                pending = Marker(directive, arg.lstrip(":").strip(), i + 1)
            i = end + 1
            continue
        fence = FENCE_OPEN.match(line)
        if fence:
            indent, ticks = len(fence["indent"]), fence["ticks"]
            close = re.compile(rf"^\s*`{{{len(ticks)},}}\s*$")
            end = i + 1
            while end < len(lines) and not close.match(lines[end]):
                end += 1
            if end == len(lines):
                raise DocsTestError(f"{page}:{i + 1}: a code block that is never closed")
            body = [ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in lines[i + 1:end]]
            blocks.append(Block(fence["lang"].lower(), i + 1, "\n".join(body), pending, prose))
            pending, prose = None, False
            i = end + 1
            continue
        if line.strip():
            if pending is not None:
                raise DocsTestError(f"{page}:{pending.line}: a docs-test marker must sit right before its "
                                    "code block (only blank lines between)")
            prose = True
        i += 1
    if pending is not None:
        raise DocsTestError(f"{page}:{pending.line}: a docs-test marker with no code block after it")
    return blocks, page_markers


def plan_page(text: str, page: str, pending: dict[str, str] | None = None) -> Plan:
    """What the test runs of a page, in order, and what it skips (with the reasons)."""
    blocks, page_markers = read_blocks(text, page)
    plan = Plan(page, [], [])
    for pm in page_markers:
        flags, opts = parse_options(pm.arg)
        unknown = (flags - {"slow"}) | (set(opts) - {"timeout", "requires"})
        if unknown:
            raise DocsTestError(f"{page}:{pm.line}: unknown page option(s) {sorted(unknown)} (slow, timeout=N, requires=pkg,...)")
        plan.slow |= "slow" in flags
        if "timeout" in opts:
            plan.timeout = float(opts["timeout"])
        plan.requires += [r for r in opts.get("requires", "").split(",") if r]
    pending = dict(pending or {})
    last_runnable: Step | None = None
    for b in blocks:
        first = b.code.strip().splitlines()[0] if b.code.strip() else ""
        if b.marker is None and first in pending:
            directive, _, arg = pending.pop(first).partition(":")
            b.marker = Marker(directive.strip(), arg.strip(), b.line)
        elif b.marker is not None and first in pending:
            raise DocsTestError(f"{page}:{b.line}: the page now carries its own marker for this block: "
                                "delete its entry from PENDING_MARKERS in tests/test_docs_blocks.py")
        d = b.marker.directive if b.marker else None
        kind = RUN_LANGS.get(b.lang)
        where = f"{page}:{b.line}"
        if d in ("fragment", "skip"):
            plan.skipped.append((b.line, f"{d}: {b.marker.arg}" if b.marker.arg else d))
            continue
        if d == "file":
            if not b.marker.arg or "/" in b.marker.arg.strip("./"):
                raise DocsTestError(f"{where}: 'docs-test: file NAME' names a file in the working directory")
            plan.steps.append(Step("file", b.line, b.code + "\n", path=b.marker.arg))
            continue
        if d == "output" or (d is None and b.lang == "text" and not b.prose_before
                             and last_runnable is not None and last_runnable.kind == "python"):
            if last_runnable is None or last_runnable.expect is not None:
                raise DocsTestError(f"{where}: an output block with no block of its own before it")
            _, opts = parse_options(b.marker.arg if b.marker else "")
            last_runnable.expect = Expect(b.code, b.line + 1, float(opts["rtol"]) if "rtol" in opts else None)
            continue
        if d == "console":
            _, opts = parse_options(b.marker.arg)
            plan.steps.append(Step("console", b.line + 1, b.code,
                                   commands=console_commands(b.code, b.line, opts.get("rtol"), where)))
            last_runnable = None
            continue
        if kind is None:
            continue  # yaml, toml, text, markdown: data or prose, read by a reader, not run
        if kind == "bash" and re.search(r"\bpip\s+install\b|\bapt(-get)?\s+install\b", b.code):
            raise DocsTestError(f"{where}: a bash block that installs packages must be marked "
                                "<!-- docs-test: skip: installs packages -->")
        plan.steps.append(Step(kind, b.line + 1, b.code))  # the line of its first line of code
        last_runnable = plan.steps[-1]
    if pending:
        raise DocsTestError(f"{page}: PENDING_MARKERS names blocks the page no longer has: {sorted(pending)}")
    for s in plan.steps:  # a command whose output the page does not show runs a few steps only
        if s.kind == "bash" and s.expect is None:
            s.code = shorten_steps(s.code)
    return plan


def console_commands(text: str, line: int, rtol: str | None, where: str) -> list:
    """``$ cmd`` lines and the output shown under each, as [(command, Expect)]."""
    out: list = []
    for k, ln in enumerate(text.splitlines()):
        if ln.startswith("$ "):
            out.append([ln[2:], Expect("", line + 2 + k, float(rtol) if rtol else None)])
        elif not out:
            raise DocsTestError(f"{where}: a console block starts with a '$ command' line")
        else:
            out[-1][1].text += ln + "\n"
    return [tuple(c) for c in out]


def shorten_steps(script: str, steps: int = SHORT_STEPS) -> str:
    """``modopt run``/``modopt compare`` lines get ``--steps N`` (replaced, or added before a comment)."""
    lines = []
    for ln in script.splitlines():
        if re.search(r"(^|[;&|]\s*)modopt\s+(run|compare)\b", ln) and "--resume" not in ln:
            cmd, hash_, comment = ln.partition(" #")
            if re.search(r"--steps[= ]\d+", cmd):
                cmd = re.sub(r"--steps[= ]\d+", f"--steps {steps}", cmd)
            else:
                cmd = cmd.rstrip() + f" --steps {steps}"
            ln = cmd + ("  #" + comment if hash_ else "")
        lines.append(ln)
    return "\n".join(lines)


# --------------------------------------------------------------------------- output comparison


def _clean(text: str) -> str:
    return "\n".join(ln.rstrip() for ln in text.strip("\n").splitlines()).strip("\n")


def output_matches(expected: str, actual: str, rtol: float | None = None) -> bool:
    """Doctest-style: ``...`` stands for any text (also across lines); trailing spaces and leading or
    trailing blank lines do not count. With ``rtol``, every number must equal the shown one to that
    relative tolerance (an integer shown as 0 must be 0); otherwise numbers are text like the rest."""
    expected, actual = _clean(expected), _clean(actual)
    parts, shown = [], []
    for k, piece in enumerate(expected.split("...")):
        if k:
            parts.append("(?:.*?)")
        if rtol is None:
            parts.append(re.escape(piece))
        else:
            at = 0
            for m in NUMBER.finditer(piece):
                parts += [re.escape(piece[at:m.start()]), f"({NUMBER.pattern})"]
                shown.append(float(m.group()))
                at = m.end()
            parts.append(re.escape(piece[at:]))
    m = re.fullmatch("".join(parts), actual, flags=re.S)
    if m is None:
        return False
    if rtol is None:
        return True
    got = [float(x) for x in m.groups()]
    return len(shown) == len(got) and all(math.isclose(g, s, rel_tol=rtol, abs_tol=0.0) for g, s in zip(got, shown))


def describe_mismatch(where: str, expected: str, actual: str) -> str:
    diff = "\n".join(difflib.unified_diff(_clean(expected).splitlines(), _clean(actual).splitlines(),
                                          "shown on the page", "printed", lineterm=""))
    return f"{where}: the output differs from the page's\n{diff}"


# --------------------------------------------------------------------------- the driver (child process)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["MPLBACKEND"] = "Agg"
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("MODOPT_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def drive(plan_path: str, results_path: str) -> None:
    """Run a plan's steps in order in this process; one JSON line per step, written as it finishes."""
    data = json.loads(Path(plan_path).read_text())
    page_file = str(ROOT / data["page"])
    ns: dict = {"__name__": "__main__", "__file__": page_file}
    with open(results_path, "a") as results:
        for index, s in enumerate(data["steps"]):
            results.write(json.dumps({"index": index, "started": True}) + "\n")
            results.flush()
            t0 = time.perf_counter()
            out, error = "", None
            try:
                if s["kind"] == "python":
                    buf = io.StringIO()
                    code = compile("\n" * (s["line"] - 1) + s["code"], page_file, "exec")
                    with contextlib.redirect_stdout(buf):
                        exec(code, ns)
                    out = buf.getvalue()
                elif s["kind"] == "doctest":  # a ```pycon block: doctest's own comparison, in the page's namespace
                    test = doctest.DocTestParser().get_doctest(s["code"], ns, data["page"], page_file, s["line"] - 1)
                    buf = io.StringIO()
                    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
                    runner.run(test, out=buf.write, clear_globs=False)
                    out = buf.getvalue()
                    if runner.failures:
                        error, out = out, ""  # doctest's report says what it expected and got
                elif s["kind"] == "file":
                    Path(s["path"]).write_text(s["code"])
                elif s["kind"] == "bash":
                    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", s["code"]], capture_output=True,
                                          text=True)
                    out = done.stdout + done.stderr
                    if done.returncode != 0:
                        error = f"exit status {done.returncode}"
                elif s["kind"] == "console":
                    outs = []
                    for command, _expect in s["commands"]:  # stdout and stderr as a terminal shows them
                        done = subprocess.run(["bash", "-c", command], stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True)
                        outs.append(done.stdout)
                    out = json.dumps(outs)
            except BaseException:  # noqa: BLE001 - reported with its traceback, and the page stops here
                error = traceback.format_exc(limit=-8)
                out = buf.getvalue() if s["kind"] == "python" else out
            sys.stdout.flush()
            results.write(json.dumps({"index": index, "output": out, "error": error,
                                      "seconds": round(time.perf_counter() - t0, 2)}) + "\n")
            results.flush()
            if error is not None:
                return


def run_plan(plan: Plan, workdir: Path) -> tuple[list[dict], str]:
    """Run a plan in a fresh process with cwd ``workdir``; return each step's result and the process's
    own stdout/stderr (warnings, a crash)."""
    for name in LINKED_INTO_CWD:
        if not (workdir / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    plan_path, results_path = workdir / ".docs-plan.json", workdir / ".docs-results.jsonl"
    plan_path.write_text(json.dumps({"page": plan.page, "steps": [s.__dict__ | {
        "expect": None, "commands": [(c, None) for c, _ in s.commands]} for s in plan.steps]}))
    results_path.write_text("")
    proc = subprocess.Popen([sys.executable, __file__, "--drive", str(plan_path), str(results_path)], cwd=workdir,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout ends its commands too
    try:
        log = proc.communicate(timeout=plan.timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = f"TIMEOUT after {plan.timeout:g} s\n" + proc.communicate()[0]
    rows = [json.loads(ln) for ln in results_path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if "started" not in r], log if rows else log + "\n(no step started)"


def check_results(plan: Plan, results: list[dict], log: str) -> list[str]:
    """Every step ran, none failed, and every shown output matches; the failures, each naming the
    page and the block's line."""
    problems = []
    for s, r in zip(plan.steps, results):
        where = f"{plan.page}:{s.line} ({s.kind} block)"
        if r["error"] is not None:
            problems.append(f"{where} failed:\n{r['error']}".rstrip() + (f"\nit printed:\n{r['output']}" if r["output"] else ""))
            break
        if s.kind == "console":
            for (command, expect), got in zip(s.commands, json.loads(r["output"])):
                if not output_matches(expect.text, got, expect.rtol):
                    problems.append(describe_mismatch(f"{plan.page}:{expect.line} ($ {command})", expect.text, got))
        elif s.expect is not None and not output_matches(s.expect.text, r["output"], s.expect.rtol):
            problems.append(describe_mismatch(f"{plan.page}:{s.expect.line} (output of the block at line {s.line})",
                                              s.expect.text, r["output"]))
    if not problems and len(results) < len(plan.steps):
        s = plan.steps[len(results)]
        problems.append(f"{plan.page}:{s.line} ({s.kind} block) did not finish:\n{log[-3000:]}")
    return problems


# --------------------------------------------------------------------------- the tests


def pages() -> list[str]:
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


def plan_of(page: str) -> Plan:
    return plan_page((ROOT / page).read_text(), page, PENDING_MARKERS.get(page))


def run_page(page: str, workdir: Path) -> tuple[Plan, list[dict], list[str]]:
    plan = plan_of(page)
    results, log = run_plan(plan, workdir)
    return plan, results, check_results(plan, results, log)


# --- the parser, the comparison and the driver on synthetic pages ---------------------------------

SYNTHETIC = """# A page

<!-- docs-test: setup
import math
hidden = 40
-->
Prose.

```python
x = hidden + 2
print(x)
```

```text
42
```

<!-- docs-test: fragment: a sketch -->
```python
for batch in loader: ...
```

```yaml
a: 1
```

<!-- docs-test: file conf.yaml -->
```yaml
value: 7
```

```python
import pathlib
print(pathlib.Path("conf.yaml").read_text().strip(), round(math.pi, 4), "at 0x7f3a")
```

<!-- docs-test: output rtol=0.01 -->
```text
value: 7 3.14 at ...
```

```pycon
>>> x * 2
84

```

<!-- docs-test: console -->
```text
$ echo one; echo two >&2
one
two
$ printf 'x=%s\\n' 5
x=5
```

<!-- docs-test: skip: installs packages -->
```bash
pip install something
```

```bash
modopt run examples/configs/a.yaml   # train
```
"""


def test_the_parser_reads_markers_outputs_and_consoles():
    plan = plan_page(SYNTHETIC, "synthetic.md")
    fence = {ln: k for k, ln in enumerate(SYNTHETIC.splitlines())}  # a code line's index is its fence's line
    assert [s.kind for s in plan.steps] == ["python", "python", "file", "python", "doctest", "console", "bash"]
    setup, shown, conf, tolerant, doc, console, bash = plan.steps
    assert setup.code == "import math\nhidden = 40" and setup.line == fence["import math"] + 1
    assert shown.line == fence["x = hidden + 2"] + 1 == 10
    assert shown.expect.text == "42" and shown.expect.line == fence["42"] + 1 and shown.expect.rtol is None
    assert conf.path == "conf.yaml" and conf.code == "value: 7\n"
    assert tolerant.expect.rtol == 0.01 and tolerant.expect.text == "value: 7 3.14 at ..."
    assert [c for c, _ in console.commands] == ["echo one; echo two >&2", "printf 'x=%s\\n' 5"]
    assert [e.text for _, e in console.commands] == ["one\ntwo\n", "x=5\n"]
    assert bash.code == f"modopt run examples/configs/a.yaml --steps {SHORT_STEPS}  # train"
    assert plan.skipped == [(fence["for batch in loader: ..."], "fragment: a sketch"),
                            (fence["pip install something"], "skip: installs packages")]


@pytest.mark.parametrize("text, message", [
    ("<!-- docs-test: fragment -->\nProse.\n```python\nx\n```\n", "must sit right before its code block"),
    ("<!-- docs-test: fragment -->\n", "no code block after it"),
    ("<!-- docs-test: nonsense -->\n```python\nx\n```\n", "unknown docs-test directive 'nonsense'"),
    ("<!-- docs-test: skip -->\n```python\nx\n```\n", "needs a reason"),
    ("```bash\npip install torch\n```\n", "must be marked"),
    ("<!-- docs-test: setup\nx = 1\n\ny = 2\n-->\n", "a blank line inside a setup comment"),
    ("<!-- docs-test: setup\nx = 1\n", "never ends"),
    ("```python\nx = 1\n", "never closed"),
    ("Prose.\n\n<!-- docs-test: output -->\n```text\n1\n```\n", "no block of its own before it"),
    ("<!-- docs-test: page fast -->\n", "unknown page option"),
    ("<!-- docs-test: console -->\n```text\noutput first\n$ echo\n```\n", "starts with a '$ command' line"),
])
def test_the_parser_refuses_a_broken_convention_naming_the_line(text, message):
    with pytest.raises(DocsTestError, match=re.escape(message)) as e:
        plan_page(text, "bad.md")
    assert str(e.value).startswith("bad.md")


def test_pending_markers_apply_until_the_page_has_its_own():
    text = "```bash\nsleep 600\n```\n"
    plan = plan_page(text, "p.md", {"sleep 600": "skip: too long"})
    assert not plan.steps and plan.skipped == [(1, "skip: too long")]
    with pytest.raises(DocsTestError, match="delete its entry"):
        plan_page("<!-- docs-test: skip: long -->\n" + text, "p.md", {"sleep 600": "skip: too long"})
    with pytest.raises(DocsTestError, match="no longer has"):
        plan_page(text, "p.md", {"sleep 5": "skip: x"})


def test_output_comparison():
    assert output_matches("a\nb", "\na  \nb\n\n")  # trailing spaces and blank lines around do not count
    assert not output_matches("a\nb", "a\n b")
    assert output_matches("time: ... ms\nend", "time: 8.66 ms\nend")
    assert output_matches("start\n...\nend", "start\nline 1\nline 2\nend")  # ... spans lines
    assert not output_matches("loss 0.5", "loss 0.51")  # numbers are text unless the page gives rtol
    assert output_matches("loss 0.5 at step 3", "loss 0.504 at step 3", rtol=0.01)
    assert not output_matches("loss 0.5 at step 3", "loss 0.51 at step 3", rtol=0.01)
    assert not output_matches("loss 0.5 at step 3", "loss 0.5 at step 4", rtol=0.01)
    assert not output_matches("0 skipped", "1e-9 skipped", rtol=0.5)  # a shown 0 must be 0
    assert output_matches("a [1, 2] ...", "a [1.0, 2.0] b", rtol=1e-9)


def test_shorten_steps():
    assert shorten_steps("modopt run x.yaml --steps 600 --seed 1") == f"modopt run x.yaml --steps {SHORT_STEPS} --seed 1"
    assert shorten_steps("modopt compare a.yaml b.yaml") == f"modopt compare a.yaml b.yaml --steps {SHORT_STEPS}"
    assert shorten_steps("modopt validate x.yaml  # check") == "modopt validate x.yaml  # check"
    assert shorten_steps("modopt run --resume runs/a") == "modopt run --resume runs/a"


def test_a_synthetic_page_runs_in_order_and_its_outputs_are_compared(tmp_path):
    plan = plan_page(SYNTHETIC.split("<!-- docs-test: skip")[0], "synthetic.md")
    results, log = run_plan(plan, tmp_path)
    assert check_results(plan, results, log) == [], log
    assert [r["output"] for r in results[:2]] == ["", "42\n"] and (tmp_path / "conf.yaml").read_text() == "value: 7\n"
    assert json.loads(results[5]["output"]) == ["one\ntwo\n", "x=5\n"]


def test_a_failing_block_is_reported_with_its_page_and_line_and_stops_the_page(tmp_path):
    text = "```python\nx = 1\n```\n\nText.\n\n```python\ny = 2\nz = undefined_name\n```\n\n```python\nprint('never')\n```\n"
    plan = plan_page(text, "docs/fake.md")
    results, log = run_plan(plan, tmp_path)
    (problem,) = check_results(plan, results, log)
    assert problem.startswith("docs/fake.md:8 (python block) failed:")
    assert 'docs/fake.md", line 9' in problem and "NameError: name 'undefined_name' is not defined" in problem
    assert len(results) == 2  # the third block did not run


def test_a_wrong_output_a_failing_doctest_and_a_failing_command_are_reported(tmp_path):
    text = ("```python\nprint(1 + 1)\n```\n\n```text\n3\n```\n\n```pycon\n>>> 2 * 2\n5\n\n```\n")
    plan = plan_page(text, "docs/out.md")
    problems = check_results(plan, *run_plan(plan, tmp_path))
    assert problems[0].startswith("docs/out.md:6 (output of the block at line 2): the output differs")
    assert "-3\n+2" in problems[0]
    assert problems[1].startswith("docs/out.md:10 (doctest block) failed:") and "Expected:\n    5\nGot:\n    4" in problems[1]
    plan = plan_page("Prose.\n\n```bash\necho before; false; echo after\n```\n", "docs/sh.md")
    (problem,) = check_results(plan, *run_plan(plan, tmp_path))
    assert problem.startswith("docs/sh.md:4 (bash block) failed:\nexit status 1\nit printed:\nbefore")
    assert "after" not in problem


def test_a_page_past_its_timeout_names_the_block_that_was_running_and_ends_its_commands(tmp_path):
    plan = plan_page("<!-- docs-test: page timeout=5 -->\n\n```python\nx = 1\n```\n\n```bash\necho $$ > pid\nexec sleep 60\n```\n",
                     "docs/slow.md")
    (problem,) = check_results(plan, *run_plan(plan, tmp_path))
    assert problem.startswith("docs/slow.md:8 (bash block) did not finish:") and "TIMEOUT after 5 s" in problem
    pid, deadline = int((tmp_path / "pid").read_text()), time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the page's command outlived its timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_example_of_the_conventions_in_the_transform_reference_runs_as_it_says(tmp_path):
    text = (ROOT / "docs" / "transform-reference.md").read_text()
    blocks, _ = read_blocks(text[text.index("## Code blocks in the docs"):], "docs/transform-reference.md")
    (example,) = [b for b in blocks if b.lang == "markdown"]
    plan = plan_page(example.code, "transform-reference.md example")
    assert [s.kind for s in plan.steps] == ["python", "python"] and plan.steps[1].expect is not None
    assert check_results(plan, *run_plan(plan, tmp_path)) == []


#: what the page tests ran in this session, for the summary at the end
RAN: dict[str, Plan] = {}


def _page_params():
    out = []
    for page in pages():
        try:
            slow = plan_of(page).slow
        except DocsTestError:
            slow = False  # the page's own test reports the error
        out.append(pytest.param(page, id=page, marks=[pytest.mark.slow] if slow else []))
    return out


def _run_in_tmp(plan: Plan) -> tuple[list[dict], str]:
    with tempfile.TemporaryDirectory(prefix="docs-page-") as tmp:
        return run_plan(plan, Path(tmp))


@pytest.fixture(scope="session")
def page_runs(request):
    """The selected pages' processes, started up front, two at a time (MODOPT_DOCS_JOBS=N: N), each
    page alone in its own process and directory; a page's test waits for its own."""

    selected = [item.callspec.params["page"] for item in request.session.items
                if getattr(item, "function", None) is test_page and hasattr(item, "callspec")]
    plans = {}
    for page in selected:
        try:
            plan = plan_of(page)
        except DocsTestError:
            continue  # reported by the page's test
        if plan.steps and all(_importable(m) for m in plan.requires):
            plans[page] = plan
    jobs = int(os.environ.get("MODOPT_DOCS_JOBS", min(2, os.cpu_count() or 1)))
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    yield {page: pool.submit(_run_in_tmp, plan) for page, plan in plans.items()}
    pool.shutdown(wait=True, cancel_futures=True)  # a session stopped early (-x) does not run the rest


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.slow
def test_page(page, page_runs):
    """The page's blocks run in order in one fresh process, and print what the page shows."""
    plan = plan_of(page)
    for module in plan.requires:
        pytest.importorskip(module, reason=f"{page} needs {module}, which is not a dev dependency")
    if not plan.steps:
        pytest.skip(f"{page}: no block to run" + (f" ({len(plan.skipped)} marked: "
                    + "; ".join(f"line {ln}: {why}" for ln, why in plan.skipped) + ")" if plan.skipped else ""))
    results, log = page_runs[page].result() if page in page_runs else _run_in_tmp(plan)
    problems = check_results(plan, results, log)
    assert not problems, "\n\n".join(problems)
    assert len(results) == len(plan.steps)
    RAN[page] = plan


#: a floor under what the parser finds, so a parser that finds nothing fails (the pages hold more)
MIN_PAGES, MIN_PYTHON, MIN_BASH, MIN_CONSOLE, MIN_OUTPUTS = 28, 60, 4, 2, 6


def test_summary_of_the_docs_blocks(request):
    """How many blocks and pages the docs test runs (printed in the test report), with a floor; when
    every page ran in this session, every planned block ran."""
    plans = [plan_of(p) for p in pages()]
    runnable = [p for p in plans if p.steps]
    counts = {k: sum(p.count(k) for p in plans) for k in ("python", "doctest", "bash", "console", "file")}
    outputs = sum(s.expect is not None for p in plans for s in p.steps) + sum(len(s.commands) for p in plans for s in p.steps)
    skipped = sum(len(p.skipped) for p in plans)
    assert len(plans) >= MIN_PAGES and counts["python"] >= MIN_PYTHON and counts["bash"] >= MIN_BASH
    assert counts["console"] >= MIN_CONSOLE and outputs >= MIN_OUTPUTS
    line = (f"docs blocks: {sum(counts.values())} blocks on {len(runnable)} of {len(plans)} pages "
            f"({', '.join(f'{v} {k}' for k, v in counts.items())}; {outputs} shown outputs compared; "
            f"{skipped} blocks marked fragment/skip)")
    ran = [p for p in runnable if p.page in RAN]
    if len(ran) == len(runnable):
        assert sum(len(RAN[p.page].steps) for p in ran) == sum(len(p.steps) for p in runnable)
        line += ": all ran in this session"
    else:
        line += f": {len(ran)} of those pages ran in this session"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():  # in the report, whatever the capture mode
        reporter.write_line("\n" + line)


def pytest_generate_tests(metafunc):
    if metafunc.function is test_page:
        metafunc.parametrize("page", _page_params())


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--drive":
    drive(sys.argv[2], sys.argv[3])
    sys.exit(0)

if __name__ == "__main__":  # python tests/test_docs_blocks.py [PAGE.md ...]: run pages, show each step
    for page in sys.argv[1:] or pages():
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            try:
                plan, results, problems = run_page(page, Path(tmp))
            except DocsTestError as e:
                print(f"== {page}: {e}")
                continue
            print(f"== {page}: {len(results)}/{len(plan.steps)} steps in {time.perf_counter() - t0:.1f} s, "
                  f"{len(plan.skipped)} skipped {[line for line, _ in plan.skipped]}")
            for s, r in zip(plan.steps, results):
                print(f"   line {s.line:4d} {s.kind:7s} {r['seconds']:6.2f} s  {r['output'][:300]!r}")
            for p in problems:
                print("   FAIL " + p.replace("\n", "\n        "))
