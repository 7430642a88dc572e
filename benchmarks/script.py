"""What every benchmark does around its ``main``: a bad option or input (any MoeOffloadError, ConfigError
among them) ends in one line and exit status 2, as the CLI's commands do; ``main``'s return value is the exit
status."""

from __future__ import annotations

import sys


def run(main) -> None:
    from moe_offload.cli.main import one_line
    from moe_offload.errors import MoeOffloadError

    try:
        sys.exit(main())
    except MoeOffloadError as problem:
        print(f"error: {one_line(problem)}", file=sys.stderr)
        sys.exit(2)
