"""mkdocs hook: on the API page, a docstring's own copy of its signature is dropped.

Some docstrings open with their call in a paragraph of its own (`Modular(params, *transforms,
nonfinite="skip", **group_defaults)`), written for help(); under mkdocstrings' heading, which
shows the real signature, it is a second signature that can disagree with it (Modular's lacked
`config` and `lint` and gave another default). A paragraph that is only `Name(...)`, for an object
the page documents, goes; the heading's signature stays.
"""

from __future__ import annotations

import re

OWN_CALL = re.compile(r"<p><code>(\w+)\([^<]*\)</code>\.?</p>\n?")
DOCUMENTED = re.compile(r'<h\d id="[\w.]*?\.?(\w+)" class="doc doc-heading"')


def on_page_content(html: str, page, config, files) -> str:
    if page.file.src_uri != "api.md":
        return html
    names = set(DOCUMENTED.findall(html))
    return OWN_CALL.sub(lambda m: "" if m.group(1) in names else m.group(0), html)
