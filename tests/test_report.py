"""modopt.cli.report: the HTML page of a compare or sweep, block by block."""

from __future__ import annotations

from modopt.cli.report import WIDE_TABLE_CHARS, Report


def _page(tmp_path, *tables) -> str:
    r = Report("t", provenance={})
    for t in tables:
        r.table(t)
    path = tmp_path / "report.html"
    r.write(path)
    return path.read_text()


def test_a_table_wider_than_the_page_says_it_scrolls_and_a_narrow_one_does_not(tmp_path):
    narrow = (["run", "loss"], [["a", "1.0"]])
    cell = "x" * (WIDE_TABLE_CHARS // 4)
    wide = (["run", *[f"c{i}" for i in range(5)]], [["a", *[cell] * 5]])
    assert "scrolls sideways" not in _page(tmp_path, narrow)
    page = _page(tmp_path, narrow, wide)
    assert page.count("(the table scrolls sideways: 6 columns)") == 1
    assert page.index("scrolls sideways") > page.rindex("<table>")  # (under the wide table)


def test_cells_are_escaped(tmp_path):
    assert "&lt;b&gt;" in _page(tmp_path, (["<b>"], [["1"]])) and "<b>" not in _page(tmp_path, (["<b>"], [["1"]]))
