"""`moe-offload report` of a counts-only table (trace/counts.py): the static answers counts give, and the
sections that need a full trace said by name, so that nothing is left silently out."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moe_offload.trace.counts import ExpertCounts

# Budgets of the coverage table, as shares of all L*J experts (beside the one asked for)
COVERAGE_SHARES = (0.10, 0.25, 0.50, 0.75)
NEEDS_A_FULL_TRACE = ("the working set (sliding windows, reuse distances)", "the bound (Belady's hit rate and every "
                      "online policy: a cache's hits depend on the order of requests)", "the verdict",
                      "the latency (the timed simulator replays the order too)")


def print_counts_report(counts: ExpertCounts, name: str, cache_size: int, console: Console) -> None:
    L, J = counts.num_layers, counts.num_experts
    console.print(f"[bold]{name}[/]: expert counts of {L} layers x {J} experts; {counts.total:,.0f} expert requests "
                  "(counts only: no order)")
    total = counts.num_expert_slots
    console.print(f"fast memory: {cache_size:,} of {total:,} experts ({cache_size / total:.1%}), "
                  f"{cache_size / L:.3g} per layer")
    coverage = counts.frequency_coverage([cache_size])[0]
    console.print(f"\n[bold]frequency placement[/]: keeping the {cache_size:,} most requested experts serves "
                  f"{coverage:.2%} of the expert requests (static-freq in hindsight on the traffic counted)")
    budgets = sorted({max(1, round(share * total)) for share in COVERAGE_SHARES} | {cache_size})
    table = Table(title="coverage of a frequency placement", title_justify="left")
    for column in ("experts kept", "share of all experts", "requests served"):
        table.add_column(column, justify="right")
    for budget, share in zip(budgets, counts.frequency_coverage(budgets)):
        table.add_row(f"{budget:,}", f"{budget / total:.1%}", f"{share:.2%}")
    console.print(table)
    skew = [s for s in counts.layer_skew() if s.requests > 0]
    if skew:
        tops = [s.top_share for s in skew]
        entropy = [s.entropy_ratio for s in skew]
        console.print(f"skew: a layer's most requested expert takes {sum(tops) / len(tops):.1%} of its requests "
                      f"(layers from {min(tops):.1%} to {max(tops):.1%}; uniform {1 / J:.1%}); entropy "
                      f"{sum(entropy) / len(entropy):.2f} of uniform's")
    host = counts.host_layers(cache_size)
    console.print("layers to keep on the host (the placement keeps none of their experts): "
                  + (", ".join(map(str, host)) if host else "none"))
    console.print("\nneeds a full trace (record or import the routing, not its counts): "
                  + "; ".join(NEEDS_A_FULL_TRACE), markup=False, highlight=False)
