"""Griffe extension for the documentation build: a docstring's indented formula is shown as a code block.

The docstrings write a formula as an indented line right under the sentence that introduces it, as plain text
reads best. Markdown takes such a line for a continuation of the sentence and runs the formula into it; a blank
line before the indented lines makes them the code block they are meant to be. Nothing else changes.
"""

from __future__ import annotations

import griffe

CODE_INDENT = 4


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def separate_indented_blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    in_fence = False
    for line in lines:
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        previous = out[-1] if out else ""
        starts_block = (not in_fence and line.strip() and previous.strip()
                        and indentation(line) >= indentation(previous) + CODE_INDENT)
        if starts_block:
            out.append("")
        out.append(line)
    return "\n".join(out)


class IndentedFormulas(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = separate_indented_blocks(obj.docstring.value)
