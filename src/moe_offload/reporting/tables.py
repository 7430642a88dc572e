"""Terminal tables of replay results: one table per trace and cache size, then a policy x size summary."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.table import Table

from moe_offload.reporting.results import RunResult


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def print_replay_tables(results: list[RunResult], console: Console, skipped: list[str] = ()) -> None:
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    for trace, rows in by_trace.items():
        sizes = sorted({r.cache_size for r in rows})
        for size in sizes:
            at_size = sorted((r for r in rows if r.cache_size == size), key=lambda r: (r.misses, r.policy))
            table = Table(title=f"{trace}  -  cache of {size} experts", title_justify="left")
            for column in ("policy", "accesses", "hits", "misses", "hit rate", "misses / OPT"):
                table.add_column(column, justify="left" if column == "policy" else "right")
            online = [r for r in at_size if r.policy not in ("belady", "belady-dist")]
            best = online[0].policy if online else None
            for r in at_size:
                name = f"[bold green]{r.policy}[/]" if r.policy == best else r.policy
                table.add_row(name, f"{r.accesses:,}", f"{r.hits:,}", f"{r.misses:,}", f"{r.hit_rate:.2%}",
                              _ratio(r.misses_vs_opt))
            console.print(table)
        if len(sizes) > 1:
            summary = Table(title=f"{trace}  -  misses relative to Belady OPT (lower is better; best online in bold)",
                            title_justify="left")
            summary.add_column("policy")
            for size in sizes:
                summary.add_column(f"k={size}", justify="right")
            best_at = {}
            for size in sizes:
                online = [r for r in rows if r.cache_size == size and r.policy not in ("belady", "belady-dist")]
                if online:
                    best_at[size] = min(r.misses for r in online)
            cell = {(r.policy, r.cache_size): r for r in rows}
            for policy in dict.fromkeys(r.policy for r in rows):
                values = []
                for size in sizes:
                    r = cell.get((policy, size))
                    text = "n/a" if r is None else _ratio(r.misses_vs_opt)
                    if r is not None and r.policy not in ("belady", "belady-dist") and r.misses == best_at.get(size):
                        text = f"[bold green]{text}[/]"
                    values.append(text)
                summary.add_row(policy, *values)
            console.print(summary)
        winners = []
        for size in sizes:
            online = [r for r in rows if r.cache_size == size and r.policy not in ("belady", "belady-dist")]
            if online:
                best_result = min(online, key=lambda r: (r.misses, r.policy))
                winners.append(f"k={size}: {best_result.policy} ({_ratio(best_result.misses_vs_opt)} OPT)")
        if winners:
            console.print("best online policy  " + ", ".join(winners))
        notes = sorted({note for r in rows for note in r.notes})
        for note in notes:
            console.print(f"note: {note}")
    for line in skipped:
        console.print(f"skipped: {line}")
