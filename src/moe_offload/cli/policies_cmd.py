"""`moe-offload policies`: the eviction policies and prefetchers, what each does and where it comes from."""

from __future__ import annotations

from moe_offload.policies import POLICIES
from moe_offload.prefetch import PREFETCHERS
from moe_offload.simulator import kernels


def register(subparsers) -> None:
    parser = subparsers.add_parser("policies", help="list the eviction policies and prefetchers",
                                   description="List the eviction policies and the prefetchers with a one-line "
                                               "description and their source.")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="eviction policies (use the name with --policy)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("what it evicts")
    table.add_column("source")
    table.add_column("replay")
    for name, info in POLICIES.items():
        table.add_row(name + (" (offline)" if info.offline else ""), info.summary, info.source,
                      "compiled" if info.policy.replay_kernel is not None else "Python")
    console = Console()
    console.print(table)
    if not kernels.numba_available():
        console.print(f"(the replay runs every policy in Python: {kernels.INSTALL_HINT})")
    prefetchers = Table(title="prefetchers (use the name with simulate --timed --prefetch)", title_justify="left")
    prefetchers.add_column("name", style="bold")
    prefetchers.add_column("what it prefetches")
    prefetchers.add_column("trace needs")
    prefetchers.add_column("source")
    for name, prefetcher in PREFETCHERS.items():
        prefetchers.add_row(name, prefetcher.summary, ", ".join(prefetcher.requires) or "-", prefetcher.source)
    console.print(prefetchers)
    return 0
