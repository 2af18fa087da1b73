"""The table of every registered transform on docs/modules/index.md, made from the registry.

    PYTHONPATH=. python docs/transforms_table.py   # print the table the site shows

The site's build (docs/hooks/transforms.py) puts the table between the page's markers, so the page's
file holds no copy that could fall behind, and a new transform needs no edit here. Each row: the name
(linked to its API page, transforms/<Name>.md, made from the class), its family (linked to the family
page, which documents it by hand or has the section the build writes), how it is called positionally,
and the first sentence of its docstring. tests/test_transforms_table.py checks the rows,
tests/test_docs_site.py the built page.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PAGE = Path(__file__).parent / "modules" / "index.md"
START, END = "<!-- transforms-table: start -->", "<!-- transforms-table: end -->"

#: the page (relative to docs/modules/) that documents the transforms of each module
PAGES = {
    "modopt.core.roles": "../concepts.md",  # (Chain)
    "modopt.transforms.masked": "../howto/compose.md",
    "modopt.transforms.matrix_scale": "orthogonal.md",
    "modopt.transforms.accumulate": "accumulate.md",
    "modopt.transforms.adaptive": "statistical.md",
    "modopt.transforms.agc": "agc.md",
    "modopt.transforms.caution": "caution.md",
    "modopt.transforms.clipping": "clipping.md",
    "modopt.transforms.ema": "ema.md",
    "modopt.transforms.growth": "growth.md",
    "modopt.transforms.guards": "guards.md",
    "modopt.transforms.normalization": "normalization.md",
    "modopt.transforms.optimizers": "optimizers.md",
    "modopt.transforms.torch_optimizer": "optimizers.md",
    "modopt.transforms.orthogonal": "orthogonal.md",
    "modopt.transforms.percentile": "percentile.md",
    "modopt.transforms.spam": "spam.md",
    "modopt.transforms.stability": "stability.md",
    "modopt.transforms.weights": "weights.md",
    "modopt.transforms.wrappers": "wrappers.md",
}


def summary(cls: type) -> str:
    """The first sentence of the class docstring, on one line (a table cell)."""
    text = " ".join((cls.__doc__ or "").strip().split())
    # (a sentence ends at . ! ? before a space, but not in "et al." "e.g." "i.e." "vs.")
    m = re.match(r"(.+?(?<! al)(?<!e\.g)(?<!i\.e)(?<! vs)[.!?])(\s|$)", text)
    first = m.group(1) if m else text
    return first.replace("|", "\\|")


def own_transforms() -> list[str]:
    """The registered transforms modopt ships (a user's or a test's own registrations are not listed)."""
    import modopt as mo
    from modopt.core.registry import get_transform

    return [n for n in mo.available() if get_transform(n).__module__.split(".")[0] == "modopt"]


def family_page(cls: type) -> str:
    """The page (relative to docs/modules/) that documents `cls`'s module."""
    page = PAGES.get(cls.__module__)
    if page is None:
        raise SystemExit(f"{cls.__name__}: no docs page for module {cls.__module__}; add it to PAGES in {__file__}")
    return page


def family_title(text: str) -> str:
    """A family page's short title: its first heading up to a colon (`# AGC: adaptive ...` is AGC)."""
    heading = re.search(r"^# (.+)$", text, flags=re.M)
    return heading.group(1).split(":")[0].strip() if heading else "?"


def table() -> str:
    from modopt.core.registry import get_transform

    rows = ["| transform | family | call | what it does |", "|---|---|---|---|"]
    for name in sorted(own_transforms(), key=str.lower):
        cls = get_transform(name)
        page = family_page(cls)
        title = family_title((PAGE.parent / page).read_text(encoding="utf-8"))
        pos = cls._positional_field()
        call = f"`mo.{name}({pos})`" if pos else f"`mo.{name}()`"
        rows.append(f"| [`{name}`](../transforms/{name}.md) | [{title}]({page}) | {call} | {summary(cls)} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    a, b = text.index(START) + len(START), text.index(END)
    return text[:a] + "\n" + table() + text[b:]


def main(argv: list[str]) -> int:
    sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
