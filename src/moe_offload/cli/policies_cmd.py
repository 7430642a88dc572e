"""`moe-offload policies`: the eviction policies, what each does and where it comes from."""

from __future__ import annotations

from moe_offload.policies import POLICIES


def register(subparsers) -> None:
    parser = subparsers.add_parser("policies", help="list the eviction policies",
                                   description="List the eviction policies with a one-line description and source.")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="eviction policies (use the name with --policy)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("what it evicts")
    table.add_column("source")
    for name, info in POLICIES.items():
        table.add_row(name + (" (offline)" if info.offline else ""), info.summary, info.source)
    Console().print(table)
    return 0
