"""`report.html` of `modopt compare` and `modopt sweep`: one self-contained file.

The tables are HTML tables, the plots PNG (or SVG) files embedded as base64
`data:` URIs (a PDF plot is linked: browsers do not show one inline), the style inline: no external asset, no script, nothing fetched, so the
file reads the same offline, attached to a mail or archived. Without
matplotlib the report holds the tables and says that the plots need it. Its
head is the command line and the provenance block of the result
(`provenance.py`): versions, commit, devices, date, config hash.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #1b1b1b; line-height: 1.45; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto;
  /* a shadow at an edge with more columns past it (it scrolls away with the table's end) */
  background: linear-gradient(to right, #fff 30%, #fff0) left / 2em 100% no-repeat local,
              linear-gradient(to left, #fff 30%, #fff0) right / 2em 100% no-repeat local,
              radial-gradient(farthest-side at 0 50%, #0004, #0000) left / 0.8em 100% no-repeat scroll,
              radial-gradient(farthest-side at 100% 50%, #0004, #0000) right / 0.8em 100% no-repeat scroll; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; white-space: nowrap; }
th { background: #f2f2f2; } td { text-align: right; font-variant-numeric: tabular-nums; }
td:first-child { text-align: left; }
code, .meta { font-family: ui-monospace, monospace; font-size: 0.9em; }
.meta { color: #555; } .note { color: #8a4b00; }
img { max-width: 100%; height: auto; }
"""


#: the characters of table text (cells plus padding) that fit the page's width; a wider table gets a note
WIDE_TABLE_CHARS = 130


class Report:
    """An HTML page built block by block: `heading`, `text`, `table`, `plot`; `write(path)`.

    `provenance`: the block of the result the page shows (the compare's or sweep's own); without one,
    the block of this process is built."""

    def __init__(self, title: str, command: str | None = None, provenance: dict[str, Any] | None = None):
        from .provenance import describe
        from .provenance import provenance as build

        self.title = title
        self.blocks: list[str] = []
        self.provenance: dict[str, Any] = provenance if provenance is not None else build()
        self.meta: list[str] = ([f"command: {command}"] if command else []) + describe(self.provenance)

    def heading(self, text: str) -> None:
        """Add a section heading."""
        self.blocks.append(f"<h2>{html.escape(text)}</h2>")

    def text(self, text: str, note: bool = False) -> None:
        """Add a paragraph (`note`: in the smaller note style)."""
        cls = ' class="note"' if note else ""
        self.blocks.append(f"<p{cls}>{html.escape(text)}</p>")

    def table(self, table: tuple[list[str], list[list[str]]]) -> None:
        """Add a table given as `(head, rows)`."""
        head, body = table
        rows = ["<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
        rows += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body]
        self.blocks.append('<div class="scroll"><table>\n' + "\n".join(rows) + "\n</table></div>")
        # about the characters a line of the page holds (72em of text): a wider table says it scrolls
        widths = [max(len(str(r[i])) for r in [head, *body] if i < len(r)) + 3 for i in range(len(head))]
        if sum(widths) > WIDE_TABLE_CHARS:
            self.blocks.append(f'<p class="meta">(the table scrolls sideways: {len(head)} columns)</p>')

    def plot(self, png: Path, alt: str, *, plots: bool = True) -> None:
        """Embed the plot `png` (a PNG or SVG file, as a `data:` URI); a PDF, which a browser does not show
        inline, is named with a link beside the report. When it was not drawn, say why (plots off, or
        matplotlib missing)."""
        kind = {".png": "image/png", ".svg": "image/svg+xml"}.get(png.suffix.lower())
        if png.is_file() and kind is None:
            self.blocks.append(f'<p class="note">{html.escape(alt)}: written as PDF beside this report, '
                               f'<a href="{html.escape(png.name)}">{html.escape(png.name)}</a> (a browser does not '
                               'show a PDF inline; --format png or svg embeds the plot here).</p>')
        elif png.is_file():
            data = base64.b64encode(png.read_bytes()).decode("ascii")
            self.blocks.append(f'<p><img alt="{html.escape(alt)}" src="data:{kind};base64,{data}"></p>')
        elif not plots:
            self.text(f"{png.name}: not drawn (plots were turned off with --no-plots).", note=True)
        else:
            self.text(f"{png.name}: not drawn. The plots need matplotlib, which is not installed here "
                      "(pip install 'torch-modopt[plot]').", note=True)

    def render(self) -> str:
        """The whole report as one self-contained HTML page."""
        meta = "".join(f'<div class="meta">{html.escape(m)}</div>' for m in self.meta)
        return (
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(self.title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            f"<h1>{html.escape(self.title)}</h1>\n{meta}\n" + "\n".join(self.blocks) + "\n</body>\n</html>\n"
        )

    def write(self, path: Path) -> None:
        """Write `render()` to `path` (UTF-8), without following a link there (`outfiles.open_out`)."""
        from .outfiles import write_text

        write_text(path, self.render())
