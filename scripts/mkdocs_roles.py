"""MkDocs hook: the Sphinx roles of the docstrings (``:class:`~a.b.C```, ``:meth:`x```) shown as code.

mkdocstrings renders docstrings as Markdown, which leaves the role's name in front of the code span. The
role is dropped after rendering; a leading ``~`` keeps the last dotted component only, as Sphinx does.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc|obj):<code>(~?)([^<]*)</code>")


def shown(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_) -> str:
    return ROLE.sub(shown, html)
