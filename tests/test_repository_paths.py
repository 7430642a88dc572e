"""The repository names no path of the machine it was written on, and the code cites no file the project lacks.

Absolute home and work folders (/work/, /home/, /Users/, /root/) would be wrong on every other machine; a
Markdown file named in the code (a docstring's "see X.md") must exist in the repository, so a reader can
follow it. Binary files (Parquet, weights, figures) are skipped: they are data, read by the tests that use
them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_FOLDERS = {".git", ".venv", "site", "out", "build", "__pycache__", ".pytest_cache", ".hypothesis"}
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|root)/")
MARKDOWN_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.md)\b")
CODE_FOLDERS = ("src", "tests", "benchmarks", "scripts")


def text_files(folders=None):
    starts = [ROOT / f for f in folders] if folders else [ROOT]
    for start in starts:
        for path in sorted(start.rglob("*")):
            relative = path.relative_to(ROOT)
            if not path.is_file() or SKIPPED_FOLDERS & set(relative.parts) or relative.name.endswith(".egg-info"):
                continue
            if any(part.endswith(".egg-info") for part in relative.parts):
                continue
            try:
                yield relative, path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary data


def test_no_absolute_path_of_a_machine():
    this_file = Path(__file__).resolve().relative_to(ROOT)
    found = [f"{relative}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}"
             for relative, text in text_files() if relative != this_file
             for match in MACHINE_PATH.finditer(text)]
    assert not found, "machine paths in the repository:\n" + "\n".join(found)


def test_code_names_only_markdown_files_that_exist():
    # A citation may be relative to the root, to its file, or to any folder ("data/NOTICE.md" in the package).
    present = [path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.md")
               if not SKIPPED_FOLDERS & set(path.relative_to(ROOT).parts)]
    this_file = Path(__file__).resolve().relative_to(ROOT)
    missing = []
    for relative, text in text_files(CODE_FOLDERS):
        if relative == this_file:
            continue
        for match in MARKDOWN_NAME.finditer(text):
            cited = match.group(1)
            if not any(path == cited or path.endswith("/" + cited) for path in present):
                missing.append(f"{relative}:{text.count(chr(10), 0, match.start()) + 1}: {cited}")
    assert not missing, "files named in the code that the repository lacks:\n" + "\n".join(missing)


def test_the_patterns_find_what_they_look_for():
    assert MACHINE_PATH.search("see /work/shared/traces") and MACHINE_PATH.search('"/root/.cache"')
    assert not MACHINE_PATH.search("~/.cache/x") and not MACHINE_PATH.search("https://example.org/home/page")
    assert [m.group(1) for m in MARKDOWN_NAME.finditer("(DESIGN.md) and docs/trace-format.md.")] == [
        "DESIGN.md", "docs/trace-format.md"]
