"""The package's import contracts (pyproject.toml [tool.importlinter], docs/architecture.md): the code under
test keeps them, and they refuse an import that runs upward or closes a cycle, so they cannot pass vacuously."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moe_offload

pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install 'moe-offload[test]'")

SOURCE = Path(moe_offload.__file__).resolve().parent.parent  # the src/ folder the tests import
PYPROJECT = SOURCE.parent / "pyproject.toml"
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint(source: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``source`` with the project's contracts."""
    if not PYPROJECT.is_file():
        pytest.skip(f"no pyproject.toml beside {SOURCE} (an installed package, not a checkout)")
    env = dict(os.environ, PYTHONPATH=str(source))
    return subprocess.run([sys.executable, "-c", LINT, "--config", str(PYPROJECT), "--no-cache"], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts():
    result = lint(SOURCE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    # a policy reaching up into the runtime: against the layers and, through the runtime, a cycle
    ("policies/lru.py", "import moe_offload.runtime.engine", "moe_offload.policies is not allowed to import "
                                                             "moe_offload.runtime"),
    # two packages of one layer
    ("models/hub.py", "import moe_offload.prefetch", "moe_offload.models is not allowed to import "
                                                     "moe_offload.prefetch"),
    # a cycle inside one package: trace/validate.py imported by trace/format.py at its top
    ("trace/validate.py", "import moe_offload.trace.format", "No cycles are allowed in moe_offload.trace"),
    # the runtime reaching into the timed simulator's own tiers instead of the shared transfer queue
    ("runtime/placement.py", "import moe_offload.simulator.timed.tiers",
     "moe_offload.runtime is not allowed to import moe_offload.simulator.timed.tiers"),
])
def test_the_contracts_refuse_an_import_that_breaks_them(tmp_path, module, line, broken):
    shutil.copytree(SOURCE / "moe_offload", tmp_path / "moe_offload",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    with open(tmp_path / "moe_offload" / module, "a") as source:
        source.write(f"\n{line}\n")
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout
