"""Entry point of the `moe-offload` command: one sub-command per module, errors in one line."""

from __future__ import annotations

import argparse
import gc
import os
import sys

from moe_offload.version import __version__
from moe_offload.cli import (configure_cmd, generate_cmd, hardware_cmd, pack_cmd, placement_cmd, policies_cmd,
                              record_cmd, report_cmd, serve_cmd, simulate_cmd, sweep_cmd, trace_cmd, train_cmd, train_tiny_cmd)
from moe_offload.errors import MoeOffloadError
from moe_offload.outputs import checked_stdout

COMMANDS = (simulate_cmd, sweep_cmd, generate_cmd, serve_cmd, pack_cmd, record_cmd, trace_cmd, policies_cmd, train_cmd,
            train_tiny_cmd, configure_cmd, hardware_cmd, report_cmd, placement_cmd)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other error of the command (argparse prints the
    usage first, several lines of it for the larger commands)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def one_line(message) -> str:
    """A message in one line: the line breaks and runs of spaces of the text it quotes become one space."""
    return " ".join(str(message).split())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moe-offload",
        description="Replay MoE routing traces through expert-cache policies and compare them with the optimum.")
    parser.add_argument("--version", action="version", version=f"moe-offload {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
