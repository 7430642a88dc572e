"""The documentation is checked, so that a renamed option breaks the tests, not the user.

* The site builds with MkDocs in strict mode: a broken link, a missing anchor or a docstring that fails to
  render is an error (skipped, with the reason, where the ``docs`` extra is not installed).
* Every fenced ``bash`` block marked ``<!-- runnable -->`` in README.md and docs/getting-started.md runs, as a
  user would paste it, in an empty folder, with ``moe-offload`` being this checkout's command line. A block
  whose command needs an extra that is not installed is skipped with the command's own one-line reason.
* The README stays a front door (at most 250 lines) and its links to files of the repository resolve.
* The build's hooks (scripts/mkdocs_*.py, scripts/griffe_docstrings.py) do what they say on small pages.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE_PAGES = ("README.md", "docs/getting-started.md")
RUNNABLE_BLOCK = re.compile(r"^<!-- runnable -->\n```bash\n(.*?)^```$", re.DOTALL | re.MULTILINE)
MISSING_EXTRA = "which is not installed: pip install 'moe-offload["


def runnable_blocks():
    blocks = []
    for page in RUNNABLE_PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        for match in RUNNABLE_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the fence's line
            blocks.append(pytest.param(match.group(1), id=f"{page}:{line}"))
    return blocks


def test_runnable_blocks_are_found():
    # README: one per task but serving; getting started: its first commands.
    assert len(runnable_blocks()) >= 8


@pytest.fixture(scope="module")
def command_line(tmp_path_factory) -> dict:
    """The environment of a user's shell, with ``moe-offload`` running this checkout's sources."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "moe-offload"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m moe_offload.cli.main "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("block", runnable_blocks())
def test_runnable_block(block, command_line, tmp_path):
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=command_line,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and MISSING_EXTRA in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move the detail to docs/"


def test_quoted_policy_counts_are_the_registry_s():
    from moe_offload.policies import POLICIES
    from moe_offload.prefetch import PREFETCHERS

    quoted = [(page, match) for page in RUNNABLE_PAGES
              for match in re.findall(r"(\d+) eviction policies and (\d+) prefetchers",
                                      (ROOT / page).read_text(encoding="utf-8"))]
    assert quoted, "the pages no longer quote the counts: drop this test"
    for page, (policies, prefetchers) in quoted:
        assert (int(policies), int(prefetchers)) == (len(POLICIES), len(PREFETCHERS)), page


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to no page"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files the repository lacks: {missing}"


def test_docs_build_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "latex2mathml"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed: pip install 'moe-offload[docs]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    policy_page = (tmp_path / "site" / "policies" / "lcp.html").read_text(encoding="utf-8")
    assert "<math" in policy_page, "the policy page's formula was not rendered to MathML"
    assert "Least Cache Priority" in policy_page, "the policy's docstring is not on its page"
    remote = [f"{page.relative_to(tmp_path)}: {url}" for page in (tmp_path / "site").rglob("*.html")
              for url in re.findall(r'<(?:script|link|img)[^>]*(?:src|href)="(https?://[^"]+)"', page.read_text())]
    assert not remote, f"the site loads files from the network: {remote[:5]}"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_math_hook_converts_outside_code_only():
    pytest.importorskip("latex2mathml")
    math = load_script("mkdocs_math")
    page = "Inline \\(x^2\\) here.\n\n$$\nP = \\mu\n$$\n\n`\\(kept\\)` and\n```bash\necho $$\n```\n"
    out = math.on_page_markdown(page)
    assert out.count("<math") == 2 and 'display="block"' in out
    assert "`\\(kept\\)`" in out and "echo $$" in out


def test_roles_hook_keeps_the_code():
    roles = load_script("mkdocs_roles")
    html = "An :class:<code>~a.b.Engine</code> and :meth:<code>generate</code>."
    assert roles.on_page_content(html) == "An <code>Engine</code> and <code>generate</code>."


def test_indented_formula_becomes_its_own_block():
    pytest.importorskip("griffe")
    docstrings = load_script("griffe_docstrings")
    text = "Its order is that of\n    log mu - t,\nwhich changes.\n* item\n  continued"
    assert docstrings.separate_indented_blocks(text) == (
        "Its order is that of\n\n    log mu - t,\nwhich changes.\n* item\n  continued")
