"""The built docs site: it reads with no network, its formulas are MathML, every transform has its API page.

The site is built once (``mkdocs build --strict``, about 15 s) into a temporary folder; skipped where
mkdocs (the ``docs`` extra) is not installed. The hooks it runs are docs/hooks/*.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the docs site (the slow lane)

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"

#: a tag that makes the browser fetch what its src / href / srcset names (an <a href> is a link a reader follows)
FETCHING_TAG = re.compile(r"<(script|link|img|iframe|source|audio|video|embed|object|track)\b[^>]*>", re.I)
REMOTE_ATTR = re.compile(r"""\b(src|href|srcset|data)\s*=\s*["']?\s*(https?:|//)""", re.I)
REMOTE_CSS = re.compile(r"""@import|url\(\s*["']?\s*(https?:|//)""", re.I)
#: where a page may show LaTeX as text: code, and the MathML itself
CODE_OR_MATH = re.compile(r"<(pre|code|math)\b.*?</\1>", re.S)


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"modopt_docs_hook_{name}", HOOKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("latex2mathml")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _pages(site: Path) -> list[Path]:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 60, pages
    return pages


def test_the_built_site_fetches_nothing_from_the_network(site):
    remote = []
    for page in _pages(site):
        for tag in FETCHING_TAG.finditer(page.read_text(encoding="utf-8")):
            if REMOTE_ATTR.search(tag.group(0)):
                remote.append(f"{page.relative_to(site)}: {tag.group(0)}")
    for css in site.rglob("*.css"):
        for m in REMOTE_CSS.finditer(css.read_text(encoding="utf-8")):
            remote.append(f"{css.relative_to(site)}: {css.read_text(encoding='utf-8')[m.start():m.start() + 80]}")
    assert not remote, "the site loads these from the network:\n" + "\n".join(remote[:20])
    # (links in the prose, to papers and projects, stay: they are <a href>, followed only when clicked)
    assert any(re.search(r'<a href="https://', p.read_text(encoding="utf-8")) for p in _pages(site))


def test_every_formula_is_mathml_and_no_latex_is_left_as_text(site):
    formulas = 0
    for page in _pages(site):
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r'<(span|div) class="arithmatex">(.*?)</\1>', text, flags=re.S):
            assert m.group(2).startswith("<math"), f"{page.relative_to(site)}: {m.group(2)[:120]}"
            formulas += 1
        prose = CODE_OR_MATH.sub("", text)
        raw = re.search(r"\\\(|\\\[|\$\$", prose)
        assert raw is None, f"{page.relative_to(site)}: LaTeX as text: {prose[raw.start() - 80:raw.end() + 80]!r}"
        assert "mathjax" not in text.lower(), page
    assert formulas > 300  # the family pages' math and the transforms' docstrings


def test_the_math_hook_draws_what_the_pages_use_and_names_what_it_cannot():
    pytest.importorskip("latex2mathml")
    math_hook = _hook("mathml")
    # \big before a delimiter command, an escaped underscore in \text, an aligned block, an operator name
    out = math_hook.to_mathml(r"\big\lfloor \text{max\_norm} \big\rfloor", block=False)
    assert "\u230a" in out and "max_norm" in out and "\\" not in out
    out = math_hook.to_mathml(r"\begin{aligned} a &= b \\ c &= d \end{aligned}", block=True)
    assert out.count("<mtr>") == 2 and "&amp;" not in out and 'display="block"' in out
    assert "<mi>sign</mi>" in math_hook.to_mathml(r"\operatorname{sign}(x)", block=False)
    html = '<p>a <span class="arithmatex">\\(x \\undefinedcommand y\\)</span></p>'
    with pytest.raises(Exception, match=r"page\.md.*undefinedcommand"):
        math_hook.convert_page(html, "page.md")
    with pytest.raises(Exception, match=r"page\.md: LaTeX left as text"):
        math_hook.convert_page("<p>$$ x $$</p>", "page.md")


def test_every_transform_has_its_api_page_and_the_index_links_to_it(site):
    hook = _hook("transforms")
    from modopt.core.registry import get_transform

    names = hook.names()
    assert len(names) >= 40
    index = (site / "modules" / "index.html").read_text(encoding="utf-8")
    for name in names:
        page = site / "transforms" / name / "index.html"
        assert page.is_file(), f"no API page for {name}"
        text = page.read_text(encoding="utf-8")
        assert re.search(rf"<h1[^>]*>{name}\b", text), name
        for field in get_transform(name).model_fields:  # the fields table names every field
            assert f"<td><code>{field}</code></td>" in text, (name, field)
        assert f'<td><a href="../transforms/{name}/"' in index, f"the index does not link {name}'s page"
        # the page sits in the navigation, under the API reference
        assert f'href="../{name}/"' in text or f'href="./"' in text


def test_the_api_page_shows_each_signature_once(site):
    text = re.sub(r"<[^>]+>", "", (site / "api" / "index.html").read_text(encoding="utf-8"))
    assert len(re.findall(r"\bModular\(params", text)) == 1


def test_every_api_page_example_runs():
    hook = _hook("transforms")
    ran = 0
    for name in hook.names():
        code = hook.example(name)
        if code is None:  # (QKClip: the docstring's example, which tests/test_docstrings.py runs)
            continue
        ns: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (Identity: the lint says, rightly, that it does nothing)
            exec(compile(code, f"<{name} example>", "exec"), ns)
        assert f"mo.{name}(" in code, name
        loss = float(out.getvalue().split(":")[-1])
        assert math.isfinite(loss), (name, out.getvalue())
        ran += 1
    assert ran >= len(hook.names()) - 1


def test_every_transform_has_its_section_on_its_family_page(site):
    """The link from a transform's API page to its family page lands on its section: a hand-written one,
    or the one the build writes (docs/hooks/transforms.py's ``section``)."""
    hook = _hook("transforms")
    for name in hook.names():
        _, target = hook.family(name)
        path, _, anchor = target.partition("#")
        html = (site / path.removesuffix(".md") / "index.html").read_text(encoding="utf-8")
        assert re.search(rf"\b{name}\b", html), f"{name} is not on {path}"
        if anchor:
            assert f'id="{anchor}"' in html, f"{path} has no #{anchor} for {name}"


def test_a_transform_no_page_documents_gets_its_section_from_its_class(monkeypatch):
    """What a newcomer's transform gets without a hand-written section (Sign, pretended undocumented): a
    `## Sign` section on its family page made from the class, which the built page shows."""
    hook = _hook("transforms")
    assert "Sign" in hook.stated_by_hand() and "Sign" not in hook.generated("normalization.md")
    monkeypatch.setattr(hook, "stated_by_hand", lambda: set())
    assert "Sign" in hook.generated("normalization.md") and "ClipNorm" not in hook.generated("normalization.md")
    text = hook.section("Sign")
    assert text.startswith("## Sign\n\nReplace every element of the update by its sign")
    assert "Positional argument: `mo.Sign()` takes no positional argument." in text
    assert "### Fields" in text and "Bernstein" in text  # the fields table, the docstring's source
    assert hook.family("Sign")[1] == "modules/normalization.md#sign"

    class Page:  # what mkdocs hands on_page_markdown
        class file:
            src_uri = "modules/normalization.md"

    out = hook.on_page_markdown("# Normalization\n", Page, None, None)
    assert out.startswith("# Normalization\n\n## ") and text in out


# --- what a first hour on the docs meets ---------------------------------------------------------
def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_performance_page_opens_with_a_summary_of_its_own_figures():
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## .*$", text, flags=re.M)
    assert headings[0] == "## Where modopt stands", headings[:2]
    summary = _section(text, "## Where modopt stands")
    assert len(summary.strip().splitlines()) <= 20  # one screen
    rows = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| against")]
    assert len(rows) >= 4
    # no new measurement: every figure of the table is one the rest of the page states
    rest = text.replace(summary, "")
    for row in rows:
        for number in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", row):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", rest), (number, row)


def test_wide_tables_show_that_they_scroll():
    """Material puts each table in a `.md-typeset__scrollwrap` that scrolls sideways: its background draws a
    shadow at each edge (attached to the box: `scroll`), which two covers of the page's colour attached to the
    content (`local`) hide at an end the table has reached; the table lets them show through."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rules = dict((sel.strip(), body) for sel, body in re.findall(r"([^{}/]+)\{([^{}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S)))
    layers = re.split(r",\s*(?=(?:linear|radial)-gradient)", rules[".md-typeset__scrollwrap"].split("background:", 1)[1])
    covers = [x for x in layers if re.search(r"\blocal\b", x) and "--md-default-bg-color" in x]
    shadows = [x for x in layers if re.search(r"\bscroll\b", x) and "--md-default-fg-color" in x]
    assert {("left" in x.split(")")[-1]) for x in covers} == {True, False} and len(covers) == 2, covers
    assert {("left" in x.split(")")[-1]) for x in shadows} == {True, False} and len(shadows) == 2, shadows
    assert "transparent" in rules[".md-typeset__scrollwrap table:not([class])"]
    mkdocs = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "stylesheets/extra.css" in mkdocs


def test_getting_started_has_no_hidden_step():
    """A reader runs the page's blocks as they are shown: nothing the blocks need is made by a hidden setup
    (its `modopt validate my_experiment.yaml` validated a file only the test's setup had written)."""
    text = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert "docs-test: setup" not in text
    shown = text[text.index("## The command line"):]
    assert shown.index("> my_experiment.yaml") < shown.index("modopt validate my_experiment.yaml")


def test_the_readme_timing_names_its_machine_and_the_loaded_figure():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    para = readme[readme.index("Run the default experiment"):]
    para = " ".join(para[:para.index("```")].split())
    assert re.search(r"about 6 s \(5\.7 s, plots included\) on the project's 2-core development machine", para), para
    assert "torch 2.13.0" in para and "12 to 25 s" in para and "busy" in para
