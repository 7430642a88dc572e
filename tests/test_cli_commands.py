"""The command line's dispatch (cli/main.py): a command line imports only its own command's module, and the
table that names each command's module agrees with what the module registers."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from cli_driver import run
from moe_offload.cli.main import COMMANDS, build_parser, command_module


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_module_registers_the_name_it_is_listed_under(name):
    subparsers = argparse.ArgumentParser().add_subparsers()
    command_module(name).register(subparsers)
    assert list(subparsers.choices) == [name]


def test_a_command_line_imports_its_own_command_module_alone():
    script = ("from moe_offload.cli.main import main\n"
              "main(['simulate', '--help'])\n")
    listing = ("import sys\nfrom moe_offload.cli.main import build_parser\nbuild_parser('simulate')\n"
               "print(sorted(m for m in sys.modules if m.startswith('moe_offload.cli.') and m.endswith('_cmd')))")
    done = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['moe_offload.cli.simulate_cmd']"
    helped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert helped.returncode == 0 and "--policy" in helped.stdout, helped.stderr


def test_the_whole_parser_knows_every_command(capsys):
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(COMMANDS)
    code, _, err = run(capsys, "no-such-command")
    assert code == 2 and "invalid choice: 'no-such-command'" in err and "simulate" in err and "trace" in err, err
    code, _, err = run(capsys)
    assert code == 2 and "COMMAND" in err, err
    code, out, _ = run(capsys, "--version", "trace")
    assert code == 0 and out.startswith("moe-offload ")
