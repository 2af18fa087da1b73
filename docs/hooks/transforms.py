"""mkdocs hook: one API page per registered transform, made from the class when the site is built.

Each page (``transforms/<Name>.md``, listed under "API reference" in the navigation) shows the
signature, every field with its type, range and default (``modopt.core.fieldtext``, as
``modopt modules`` and ``help()`` say them), the class docstring (the math, the source it
reproduces, a doctest), a runnable training loop and a link to the section of the family page.
Nothing is written by hand, so a page cannot drift from its class.

Two more things are made when the site is built, so that adding a transform touches no page:

- the table of every transform on docs/modules/index.md (``table().table()``, between its markers);
- on a family page (docs/modules/<family>.md), a section for each transform of the family that the
  page does not document by hand (a page documents a transform by hand when it states its
  positional argument, as tests/test_transform.py requires of every hand-written section):
  ``section(name)``, the API page's content under a ``## Name`` heading.

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


#: a hand-written positional sentence (tests/test_transform.py reads the same ones)
STATED = re.compile(r"`mo\.(\w+)\([^`]*\)` (?:is `mo\.\w+\(\w+=|takes no positional argument)")


def stated_by_hand() -> set[str]:
    """The transforms whose positional sentence a page's own Markdown states (docs/modules/*.md and
    docs/concepts.md, the pages tests/test_transform.py reads): they are documented by hand."""
    found: set[str] = set()
    for path in [*sorted((DOCS / "modules").glob("*.md")), DOCS / "concepts.md"]:
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            para = " ".join(para.split())
            if "Positional argument" in para or "positionally" in para:
                found.update(STATED.findall(para))
    return found


def generated(rel: str) -> list[str]:
    """The transforms whose section the site writes on docs/modules/<rel>: those of its family that no
    page documents by hand."""
    tt, by_hand = table(), stated_by_hand()
    return [n for n in names() if n not in by_hand and tt.family_page(_cls(n)) == rel]


def family(name: str) -> tuple[str, str]:
    """(the family page's title, its path relative to docs/ with the transform's anchor when it has one)."""
    tt = table()
    rel = tt.family_page(_cls(name))  # relative to docs/modules/
    path = (DOCS / "modules" / rel).resolve()
    text = path.read_text(encoding="utf-8")
    title = tt.family_title(text)
    if name in generated(rel):  # the section the site writes (section(name))
        return title, path.relative_to(DOCS).as_posix() + "#" + _slug(name)
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


def positional(name: str) -> str:
    """The positional sentence, with the value tests/examples.py gives the field (tests/test_transform.py
    evaluates both sides of it)."""
    cls = _cls(name)
    pos = cls._positional_field()
    if not pos:
        return f"Positional argument: `mo.{name}()` takes no positional argument."
    given = _examples().instances(name)[0]
    more = "".join(f", {k}={_code(getattr(given, k))}" for k, f in cls.model_fields.items()
                   if f.is_required() and k != pos)  # (the other fields it needs, as keywords on both sides)
    value = getattr(given, pos)
    if typing.get_origin(cls.model_fields[pos].annotation) is list:
        items = ", ".join(_code(v) for v in value)
        return f"Positional arguments: `mo.{name}({items}{more})` is `mo.{name}({pos}=[{items}]{more})`."
    return f"Positional argument: `mo.{name}({_code(value)}{more})` is `mo.{name}({pos}={_code(value)}{more})`."


def _reference(name: str, level: int) -> list[str]:
    """The signature, the positional sentence, the fields and the description, under headings of `level`."""
    from modopt.core.fieldtext import field_text
    from pydantic_core import PydanticUndefined

    cls = _cls(name)
    h = "#" * level
    rest = (inspect.getdoc(cls) or "").partition("\n\n")[2]
    out = ["```python", signature(name), "```", "", positional(name), ""]
    out += [f"{h} Fields", ""]
    if not cls.model_fields:
        out += ["It has none.", ""]
    else:
        out += ["| field | type and range | default |", "|---|---|---|"]
    for key, f in cls.model_fields.items():
        if f.is_required():
            default = "required"
        else:
            value = f.default_factory() if f.default is PydanticUndefined and f.default_factory else f.default
            default = f"`{_cell(_code(value))}`"
        out.append(f"| `{key}` | {_cell(field_text(f))} | {default} |")
    out += ["", f"{h} Description", "", rest.strip() or "(no more than the line above)", ""]
    return out


def _first(name: str) -> str:
    return " ".join((inspect.getdoc(_cls(name)) or "").partition("\n\n")[0].split())


def section(name: str) -> str:
    """The section the site writes on a family page for a transform the page does not document by hand."""
    out = [f"## {name}", "", _first(name), ""]
    out += _reference(name, 3)
    out += [f"Its [API page](../{FOLDER}/{name}.md) has a training loop that runs it.", ""]
    return "\n".join(out)


def page(name: str) -> str:
    """The Markdown of a transform's page."""
    cls = _cls(name)
    title, fam = family(name)
    up = "../"  # from transforms/<Name>.md to docs/
    from modopt.core import roles

    what = "an optimizer transform (it carries the learning rate)" if issubclass(cls, roles.Optimizer) else (
        "a weight-stage transform (after the optimizer's write)" if issubclass(cls, roles.WeightStage)
        else "a transform of the updates")
    out = [f"# {name}", "", _first(name), "",
           f"`modopt.{name}` (`{cls.__module__}`): {what}. Family: [{title}]({up}{fam}).", ""]
    out += _reference(name, 2)
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


def on_page_markdown(markdown, page, config, files):
    """The index's table of transforms; a family page's sections for the transforms it leaves to the site."""
    src = page.file.src_uri
    if src == "modules/index.md":
        return table().render(markdown)
    if src.startswith("modules/"):
        made = [section(n) for n in generated(src[len("modules/"):])]
        if made:
            return markdown.rstrip("\n") + "\n\n" + "\n".join(made)
    return markdown


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
