"""mkdocs hook: one API page per registered transform, made from the class when the site is built.

Each page (``transforms/<Name>.md``, listed under "API reference" in the navigation) shows the
signature, every field with its type, range and default (``modopt.core.fieldtext``, as
``modopt modules`` and ``help()`` say them), the class docstring (the math, the source it
reproduces, a doctest), a runnable training loop and a link to the section of the family page.
Nothing is written by hand, so a page cannot drift from its class. The index of every
transform is the table of docs/modules/index.md (docs/transforms_table.py), whose rows link here.

``example(name)`` is the loop a page shows; tests/test_docs_site.py runs every one of them.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import textwrap
import typing
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
if str(ROOT) not in sys.path:  # the pages document this checkout's modopt (as mkdocstrings' `paths: [.]`)
    sys.path.insert(0, str(ROOT))
#: where the pages are, under docs/ (a page's links are relative to it)
FOLDER = "transforms"
NAV_SECTION = "API reference"

#: the transform in a page's example where the one made from tests/examples.py would not read as a
#: use of it (None: the docstring's example is the one to read, for a transform that needs a model part)
EXAMPLE_INSTANCE: dict[str, str | None] = {
    "Chain": "mo.Chain(mo.ClipValue(0.5), mo.ClipNorm(1.0))",
    "Masked": 'mo.Masked(mo.ClipNorm(0.1), where="0.*")',
    "TorchOptimizer": "mo.TorchOptimizer(torch.optim.RMSprop, lr=1e-3)",
    "QKClip": None,  # reads the attention logits of a model's heads (mo.AttentionLogits)
}


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def table():
    """docs/transforms_table.py: the registry's list, each module's family page, a first sentence."""
    return _load("modopt_docs_transforms_table", DOCS / "transforms_table.py")


def _examples():
    return _load("modopt_docs_test_examples", ROOT / "tests" / "examples.py")


def names() -> list[str]:
    return sorted(table().own_transforms(), key=str.lower)


def _cls(name: str) -> type:
    from modopt.core.registry import get_transform

    return get_transform(name)


def family(name: str) -> tuple[str, str]:
    """(the family page's title, its path relative to docs/ with the transform's anchor when it has one)."""
    tt = table()
    rel = tt.family_page(_cls(name))  # relative to docs/modules/
    path = (DOCS / "modules" / rel).resolve()
    text = path.read_text(encoding="utf-8")
    title = tt.family_title(text)
    anchor = ""
    for heading in re.findall(r"^#{2,4} (.+)$", text, flags=re.M):
        if re.search(rf"(?<![\w.]){name}(?!\w)", heading):
            anchor = "#" + _slug(heading)
            break
    return title, path.relative_to(DOCS).as_posix() + anchor


def _slug(heading: str) -> str:
    from markdown.extensions.toc import slugify

    return slugify(re.sub(r"[`*]", "", heading), "-")


def _code(obj) -> str:
    """Python that builds `obj`: its repr with `mo.` before modopt's names."""
    import modopt as mo

    return re.sub(r"(?<![\w.'\"])([A-Z]\w*)\(", lambda m: f"mo.{m.group(1)}(" if hasattr(mo, m.group(1)) else m.group(0),
                  repr(obj))


def example(name: str) -> str | None:
    """A short training loop using the transform (its required fields as tests/examples.py sets them)."""
    import modopt as mo

    if name in EXAMPLE_INSTANCE:
        expr = EXAMPLE_INSTANCE[name]
        if expr is None:
            return None
        transform = eval(expr, {"mo": mo, "torch": __import__("torch")})
    else:
        cls, given = _cls(name), _examples().instances(name)[0]
        transform = cls(**{k: getattr(given, k) for k, f in cls.model_fields.items() if f.is_required()})
        expr = _code(transform)
    pipeline = [expr if t is transform else _code(t) for t in _examples().pipeline_for(transform)]
    params = "model.named_parameters()" if "where=" in expr else "model.parameters()"
    build = f"opt = mo.Modular({params}, {', '.join(pipeline)})"
    if len(build) > 80:  # (the page's code column: one transform a line)
        build = f"opt = mo.Modular(\n    {params},\n" + "".join(f"    {x},\n" for x in pipeline) + ")"
    build = textwrap.indent(build, " " * 8).lstrip()
    return textwrap.dedent(f"""\
        import torch
        import modopt as mo

        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        {build}
        x, y = torch.randn(64, 8), torch.randn(64, 1)
        for step in range(20):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"loss after 20 steps: {{loss.item():.4f}}")
        """)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def signature(name: str) -> str:
    sig = inspect.signature(_cls(name))
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()])
    one_line = f"mo.{name}{plain}"
    if len(one_line) <= 88:
        return one_line
    parts, star = [], False  # one parameter a line, `*` where the keyword-only ones start
    for p in plain.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        star = star or p.kind is p.VAR_POSITIONAL
        parts.append(str(p))
    lines = [""]  # as many parameters a line as fit in 80 columns
    for x in parts:
        if lines[-1] and len(lines[-1]) + len(x) + 2 > 76:
            lines.append("")
        lines[-1] += f"{x}, "
    return f"mo.{name}(\n" + "".join(f"    {line.rstrip()}\n" for line in lines) + ")"


def page(name: str) -> str:
    """The Markdown of a transform's page."""
    from modopt.core.fieldtext import field_text
    from pydantic_core import PydanticUndefined

    cls = _cls(name)
    title, fam = family(name)
    up = "../"  # from transforms/<Name>.md to docs/
    doc = inspect.getdoc(cls) or ""
    first, _, rest = doc.partition("\n\n")
    what = "an optimizer transform (it carries the learning rate)" if getattr(cls, "is_optimizer", False) else (
        "a weight-stage transform (after the optimizer's write)" if getattr(cls, "stage", "") == "weights"
        else "a transform of the updates")
    out = [f"# {name}", "", " ".join(first.split()), "",
           f"`modopt.{name}` (`{cls.__module__}`): {what}. Family: [{title}]({up}{fam}).", "",
           "```python", signature(name), "```", ""]
    pos = cls._positional_field()
    if pos and typing.get_origin(cls.model_fields[pos].annotation) is list:
        out += [f"Positional arguments: `mo.{name}(a, b)` is `mo.{name}({pos}=[a, b])`.", ""]
    elif pos:
        out += [f"Positional argument: `mo.{name}(v)` is `mo.{name}({pos}=v)`.", ""]
    out += ["## Fields", "", "| field | type and range | default |", "|---|---|---|"]
    for key, f in cls.model_fields.items():
        if f.is_required():
            default = "required"
        else:
            value = f.default_factory() if f.default is PydanticUndefined and f.default_factory else f.default
            default = f"`{_cell(_code(value))}`"
        out.append(f"| `{key}` | {_cell(field_text(f))} | {default} |")
    out += ["", "## Description", "", rest.strip() or "(no more than the line above)", ""]
    loop = example(name)
    out += ["## Example", ""]
    if loop is None:
        out += [f"`{name}` needs more than a small model: see the example above and "
                f"[{title}]({up}{fam}).", ""]
    else:
        out += ["A few steps on a small regression, as it runs:", "", "```python", loop.rstrip(), "```", ""]
    out += [f"More: the [{title}]({up}{fam}) page (the math in context, the measured behaviour, "
            "the related transforms); [all transforms](../modules/index.md).", ""]
    return "\n".join(out)


def on_files(files, config):
    from mkdocs.structure.files import File

    for name in names():
        files.append(File.generated(config, f"{FOLDER}/{name}.md", content=page(name)))
    return files


def on_nav(nav, config, files):
    """The transform pages, as a "Transforms" section at the end of the API reference section."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.nav import Section

    section = next((i for i in nav.items if i.is_section and i.title == NAV_SECTION), None)
    if section is None:
        raise PluginError(f"docs/hooks/transforms.py: mkdocs.yml's nav has no section {NAV_SECTION!r}")
    pages = [files.get_file_from_path(f"{FOLDER}/{n}.md").page for n in names()]
    sub = Section("Transforms", pages)
    for p in pages:
        p.parent = sub
    sub.parent = section
    section.children.append(sub)
    # the reading order (previous / next) follows the navigation
    order = []

    def walk(items):
        for item in items:
            if item.is_section:
                walk(item.children)
            elif item.is_page:
                order.append(item)

    walk(nav.items)
    nav.pages = order
    for a, p, b in zip([None, *order[:-1]], order, [*order[1:], None]):
        p.previous_page, p.next_page = a, b
    return nav
