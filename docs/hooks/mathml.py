"""mkdocs hook: the pages' LaTeX becomes MathML when the site is built, so it reads with no network.

pymdownx.arithmatex (``generic: true``) leaves each formula as ``\\(...\\)`` in a
``<span class="arithmatex">`` or ``\\[...\\]`` in a ``<div class="arithmatex">``; this hook
replaces the LaTeX by the MathML of ``latex2mathml`` (browsers draw MathML themselves). A
formula it cannot convert, or one whose MathML still holds a LaTeX command, fails the build
naming the page and the formula, as does a ``\\(`` or ``$$`` left in a page's prose.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError

ARITHMATEX = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)
#: prose that should have been math: a delimiter arithmatex did not take
RAW_MATH = re.compile(r"\\\(|\\\[|\$\$")
#: where a page may show LaTeX as text (code, and the MathML this hook wrote)
CODE = re.compile(r"<(pre|code|math)\b.*?</\1>", re.S)

#: \big\lfloor and friends: latex2mathml sizes a delimiter character, not a delimiter command
DELIMS = {
    "lfloor": "\u230a", "rfloor": "\u230b", "lceil": "\u2308", "rceil": "\u2309", "langle": "\u27e8",
    "rangle": "\u27e9", "lVert": "\u2016", "rVert": "\u2016", "lvert": "|", "rvert": "|", "|": "\u2016",
    "{": "{", "}": "}",
}
SIZED_DELIM = re.compile(r"\\(big|Big|bigg|Bigg)([lrm]?)\s*\\(" + "|".join(re.escape(d) for d in DELIMS) + r")(?![A-Za-z])")
TEXT_ARG = re.compile(r"\\(text|texttt|textrm|textit|mathrm|operatorname)\{([^{}]*)\}")
ALIGNED = re.compile(r"\\begin\{aligned\}(.*?)\\end\{aligned\}", re.S)
#: a word set as an operator (`\max`, `\operatorname{sign}`): an identifier, drawn upright and
#: without the space on both sides that MathML gives an unknown operator (`\bmod` keeps it)
WORD_OPERATOR = re.compile(r"<mo>([A-Za-z]{2,})</mo>")
#: a bar of |x| or ||x||: TeX gives it no space on either side; MathML gives an infix bar the space of a relation
BAR = re.compile(r"<mo((?:(?! lspace)[^>])*)>(&#x0007C;|&#x02016;|\||‖)</mo>")


def prepare(tex: str) -> str:
    """LaTeX that latex2mathml draws as TeX would."""
    tex = SIZED_DELIM.sub(lambda m: f"\\{m.group(1)}{m.group(2)} {DELIMS[m.group(3)]}", tex)
    # inside \text{...} latex2mathml keeps the backslash of an escaped underscore
    tex = TEXT_ARG.sub(lambda m: f"\\{m.group(1)}{{{m.group(2).replace(chr(92) + '_', '_')}}}", tex)

    def aligned(m: re.Match) -> str:  # aligned is an array of right- and left-aligned columns
        body = m.group(1)
        cols = max(row.count("&") for row in body.split("\\\\")) + 1
        return "\\begin{array}{" + ("rl" * cols)[:cols] + "}" + body + "\\end{array}"

    return ALIGNED.sub(aligned, tex)


def to_mathml(tex: str, block: bool) -> str:
    """The MathML of one formula; ValueError when latex2mathml fails or leaves LaTeX in it."""
    try:
        out = convert(prepare(tex), display="block" if block else "inline")
    except Exception as e:  # latex2mathml raises its own exception types, and IndexError on bad input
        raise ValueError(f"latex2mathml: {type(e).__name__}: {e}") from None
    try:
        tree = ET.fromstring(out)
    except ET.ParseError as e:
        raise ValueError(f"not well-formed MathML ({e})") from None
    left = [t for node in tree.iter() for t in (node.text, node.tail) if t and "\\" in t]
    if left:
        raise ValueError(f"LaTeX left in the MathML: {left}")
    if "\\begin{aligned}" in tex:  # (the CSS sets its columns in pairs, as TeX does: docs/stylesheets/extra.css)
        out = out.replace("<mtable>", '<mtable class="tex-aligned">')
    out = WORD_OPERATOR.sub(lambda m: m.group(0) if m.group(1) == "mod" else f"<mi>{m.group(1)}</mi>", out)
    return BAR.sub(r'<mo\1 lspace="0em" rspace="0em">\2</mo>', out)


def convert_page(text: str, where: str) -> str:
    """Every arithmatex formula of a page's HTML as MathML (PluginError naming `where` and the formula)."""

    def one(m: re.Match) -> str:
        tag, body = m.group(1), html.unescape(m.group(2)).strip()
        block = tag == "div"
        opening, closing = ("\\[", "\\]") if block else ("\\(", "\\)")
        if not (body.startswith(opening) and body.endswith(closing)):
            raise PluginError(f"{where}: math not in arithmatex's generic form: {body!r}")
        tex = body[2:-2].strip()
        try:
            mathml = to_mathml(tex, block)
        except ValueError as e:
            raise PluginError(f"{where}: cannot draw the formula {tex!r}: {e}") from None
        return f'<{tag} class="arithmatex">{mathml}</{tag}>'

    out = ARITHMATEX.sub(one, text)
    raw = RAW_MATH.search(CODE.sub("", out))
    if raw:
        prose = CODE.sub("", out)
        raise PluginError(f"{where}: LaTeX left as text: {prose[max(raw.start() - 60, 0):raw.end() + 60]!r}")
    return out


def on_page_content(html_text: str, page, config, files) -> str:
    return convert_page(html_text, page.file.src_uri)
