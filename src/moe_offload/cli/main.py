"""Entry point of the `moe-offload` command: one sub-command per module, errors in one line."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from moe_offload.version import __version__
from moe_offload.errors import MoeOffloadError
from moe_offload.outputs import checked_stdout

# Each command's module (moe_offload.cli.<module>) by the name it registers, in the order of the help. A command
# line imports its own command's module alone: the others' imports (HTTP and TLS for `trace capture`, the
# importers, the report's) cost `simulate` 50 ms on a 2-core AMD EPYC machine. `moe-offload --help` imports all.
COMMANDS = {"simulate": "simulate_cmd", "sweep": "sweep_cmd", "generate": "generate_cmd", "serve": "serve_cmd",
            "pack": "pack_cmd", "record": "record_cmd", "trace": "trace_cmd", "policies": "policies_cmd",
            "train-eviction": "train_cmd", "train-tiny": "train_tiny_cmd", "configure": "configure_cmd",
            "hardware": "hardware_cmd", "report": "report_cmd", "placement": "placement_cmd"}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other error of the command (argparse prints the
    usage first, several lines of it for the larger commands)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def one_line(message) -> str:
    """A message in one line: the line breaks and runs of spaces of the text it quotes become one space."""
    return " ".join(str(message).split())


def command_module(name: str):
    """The module of the command ``name`` (a key of COMMANDS), imported."""
    return importlib.import_module(f"moe_offload.cli.{COMMANDS[name]}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone where it names one (only its module is imported)."""
    parser = _Parser(
        prog="moe-offload",
        description="Replay MoE routing traces through expert-cache policies and compare them with the optimum.")
    parser.add_argument("--version", action="version", version=f"moe-offload {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in [command] if command in COMMANDS else COMMANDS:
        command_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the command is the first word that is not an option: the options before it (--version, --help) take no value
    args = build_parser(next((word for word in argv if not word.startswith("-")), None)).parse_args(argv)
    try:
        with checked_stdout():
            return args.run(args) or 0
    except MoeOffloadError as exc:
        print(f"moe-offload: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-offload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def console() -> None:
    """The `moe-offload` executable: ``main`` on the process's command line, then the process ends.

    Python's collector is tuned for programs that make garbage as they go; a command mostly imports, and the
    objects of an import live as long as the process. Collecting young objects every 20,000 allocations, not
    every 700, takes the collector's time in a `simulate` of 20M requests from 0.10 s to 0.03 s, most of it
    while Numba imports. At the end the interpreter's shutdown collects over every object left, Numba's typing
    tables among them once a kernel is loaded: another 0.25 s of that 1.1 s command (2-core AMD EPYC). Nothing
    left then needs collecting, so the objects are frozen out of the collector first; atexit handlers and file
    flushes still run."""
    gc.set_threshold(20_000, 10, 10)
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    console()
