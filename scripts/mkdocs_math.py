"""MkDocs hook: LaTeX in the documentation's Markdown becomes MathML when the site is built.

A browser renders MathML natively, so the site needs no MathJax or KaTeX script and no network: ``$$ ... $$``
(display, on lines of its own) and ``\\( ... \\)`` (inline) outside code are converted by latex2mathml (the
``docs`` extra). Code blocks and inline code are left as they are, so shell variables and regular
expressions in examples stay literal.
"""

from __future__ import annotations

import re

from latex2mathml.converter import convert

FENCED_OR_INLINE_CODE = re.compile(r"(```.*?```|`[^`\n]+`)", re.DOTALL)
DISPLAY = re.compile(r"^\$\$\n(.+?)\n\$\$$", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"\\\((.+?)\\\)")


def to_mathml(text: str) -> str:
    text = DISPLAY.sub(lambda m: convert(m.group(1).strip(), display="block"), text)
    return INLINE.sub(lambda m: convert(m.group(1).strip()), text)


def on_page_markdown(markdown: str, **_) -> str:
    parts = FENCED_OR_INLINE_CODE.split(markdown)
    # split() with one capturing group alternates text and code: even indices are text.
    return "".join(to_mathml(part) if index % 2 == 0 else part for index, part in enumerate(parts))
