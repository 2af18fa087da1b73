"""docs/modules/index.md: its table of transforms is the registry's (docs/transforms_table.py, written
into the page when the site is built; tests/test_docs_site.py checks the built page)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


DOCS = Path(__file__).resolve().parents[1] / "docs"


def _module():
    spec = importlib.util.spec_from_file_location("transforms_table", DOCS / "transforms_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_table_lists_every_registered_transform_as_the_registry_says():
    mod = _module()
    text = mod.render(mod.PAGE.read_text(encoding="utf-8"))  # what the site's build shows
    listed = re.findall(r"^\| \[`(\w+)`\]\(([^)]+)\) \| \[[^]]+\]\(([^)]+)\)", text, flags=re.M)
    assert sorted(n for n, _, _ in listed) == sorted(mod.own_transforms())
    assert len(listed) >= 40 and {"ClipNorm", "Adam", "QKClip"} <= {n for n, _, _ in listed}
    for name, api, page in listed:  # the API page docs/hooks/transforms.py makes; the family page exists
        assert api == f"../transforms/{name}.md", (name, api)
        assert (mod.PAGE.parent / page).resolve().is_file(), f"{name}: {page} does not exist"
    # the page's file keeps no copy of the table (it could fall behind the registry)
    assert "| transform | family |" not in mod.PAGE.read_text(encoding="utf-8")


def test_a_first_sentence_keeps_abbreviations_whole():
    mod = _module()

    class Cited:
        """AdaGC (Wang et al. 2025): clip each tensor, e.g. a bias. More text here."""

    assert mod.summary(Cited) == "AdaGC (Wang et al. 2025): clip each tensor, e.g. a bias."
