"""Terminal tables: replay results (one table per trace and cache size, then a policy x size summary) and timed
results (latency and traffic per trace)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from rich.console import Console
from rich.table import Table

from moe_offload.results import RunResult


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _online(result: RunResult) -> bool:
    """Whether a replay result is an online policy's: not Belady's, nor a placement made in hindsight."""
    return result.policy not in ("belady", "belady-dist") and not result.in_hindsight


def binary_bytes(count: float) -> str:
    """A byte count in binary units only (B, KiB, MiB, GiB, TiB), three significant digits, so that every
    size in a table is of one unit family (hardware.format_bytes writes rates in decimal units)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def print_replay_tables(results: list[RunResult], console: Console, skipped: list[str] = ()) -> None:
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    for trace, rows in by_trace.items():
        sizes = sorted({r.cache_size for r in rows})
        for size in sizes:
            at_size = sorted((r for r in rows if r.cache_size == size), key=lambda r: (r.fast_misses, r.policy))
            # a placement's misses are served where the experts live: a column of their own, when there are any
            bypassing = any(r.bypassed is not None for r in at_size)
            table = Table(title=f"{trace}  -  cache of {size} experts", title_justify="left")
            columns = ("policy", "accesses", "hits", "misses") + ("bypassed",) * bypassing + ("hit rate",
                                                                                          "misses / OPT")
            for column in columns:
                table.add_column(column, justify="left" if column == "policy" else "right")
            online = [r for r in at_size if _online(r)]
            best = online[0].policy if online else None
            for r in at_size:
                name = f"[bold green]{r.policy}[/]" if r.policy == best else r.policy
                bypassed = (f"{r.bypassed:,}" if r.bypassed is not None else "-",) * bypassing
                table.add_row(name, f"{r.accesses:,}", f"{r.hits:,}", f"{r.misses:,}", *bypassed,
                              f"{r.hit_rate:.2%}", _ratio(r.misses_vs_opt))
            console.print(table)
        if len(sizes) > 1:
            summary = Table(title=f"{trace}  -  misses relative to Belady OPT (lower is better; best online in bold)",
                            title_justify="left")
            summary.add_column("policy")
            for size in sizes:
                summary.add_column(f"k={size}", justify="right")
            best_at = {}
            for size in sizes:
                online = [r for r in rows if r.cache_size == size and _online(r)]
                if online:
                    best_at[size] = min(r.fast_misses for r in online)
            cell = {(r.policy, r.cache_size): r for r in rows}
            for policy in dict.fromkeys(r.policy for r in rows):
                values = []
                for size in sizes:
                    r = cell.get((policy, size))
                    text = "n/a" if r is None else _ratio(r.misses_vs_opt)
                    if r is not None and _online(r) and r.fast_misses == best_at.get(size):
                        text = f"[bold green]{text}[/]"
                    values.append(text)
                summary.add_row(policy, *values)
            console.print(summary)
        winners = _best_online(rows, sizes)
        if winners:
            console.print("best online policy  " + winners)
        notes = sorted({note for r in rows for note in r.notes})
        for note in notes:
            console.print(f"note: {note}")
    for line in skipped:
        console.print(f"skipped: {line}")


def _best_online(rows: list[RunResult], sizes) -> str:
    """The policy with the fewest misses at each cache size, Belady left out: "k=64: lcp (1.234x OPT), ..."."""
    winners = []
    for size in sizes:
        online = [r for r in rows if r.cache_size == size and _online(r)]
        if online:
            best_result = min(online, key=lambda r: (r.fast_misses, r.policy))
            winners.append(f"k={size}: {best_result.policy} ({_ratio(best_result.misses_vs_opt)} OPT)")
    return ", ".join(winners)


def print_replay_summary(results: list[RunResult], console: Console) -> None:
    """One line per trace instead of print_replay_tables' tables: how many runs, the best online policy at
    each cache size."""
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    for trace, rows in by_trace.items():
        sizes = sorted({r.cache_size for r in rows})
        policies = {r.policy for r in rows}
        console.print(f"{trace}: {len(policies)} policies at {len(sizes)} cache sizes; best online policy  "
                      f"{_best_online(rows, sizes) or '-'}", highlight=False, soft_wrap=True)


def print_timed_summary(results: list[RunResult], console: Console, hardware=None) -> None:
    """One line per trace instead of print_timed_tables' tables: how many runs, and the run of lowest TPOT
    at each cache size against the all-resident bound."""
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    where = f" on {hardware.name}" if hardware is not None else ""
    for trace, rows in by_trace.items():
        bound = next((r for r in rows if r.policy == "all-resident"), None)
        measured = [r for r in rows if r.policy != "all-resident" and r.prefetcher != "oracle" and r.tpot_seconds]
        fastest = []
        for size in sorted({r.cache_bytes for r in measured}):
            best = min((r for r in measured if r.cache_bytes == size), key=lambda r: (r.tpot_seconds, run_label(r)))
            versus = (f", {best.tpot_seconds / bound.tpot_seconds:.2f}x all-resident"
                      if bound is not None and bound.tpot_seconds else "")
            fastest.append(f"{binary_bytes(size)}: {run_label(best)} {_ms(best.tpot_seconds)} ms{versus}")
        console.print(f"{trace}{where}: {len(rows)} runs; lowest TPOT  {'; '.join(fastest) or '-'}",
                      highlight=False, soft_wrap=True)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def run_label(result: RunResult) -> str:
    """How a timed run is named in tables and plots: the policy and the prefetcher (and the admission rule),
    or the bound."""
    rule = f", {result.admission}" if result.admission else ""
    if result.prefetcher is None:
        return result.policy if result.policy == "all-resident" else f"{result.policy}, no prefetch{rule}"
    return f"{result.policy} + {result.prefetcher}{rule}"


def print_timed_tables(results: list[RunResult], console: Console, hardware=None, arrivals: str | None = None) -> None:
    """Per trace: a latency table (TTFT, TPOT over requests, the slowest tokens, TPOT relative to the
    all-resident run and to the oracle prefetcher with the same policy and cache, stall time) and a traffic
    table (hits, on-demand loads, prefetches, bytes per link)."""
    by_trace: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_trace[result.trace].append(result)
    for trace, rows in by_trace.items():
        bound = next((r for r in rows if r.policy == "all-resident"), None)
        oracle = {(r.policy, r.cache_bytes): r for r in rows if r.prefetcher == "oracle"}
        where = f" on {hardware.name}" if hardware is not None else ""
        how = f" ({arrivals})" if arrivals else ""
        latency = Table(title=f"{trace}{where}{how}  -  latency in ms (TPOT over requests; token p99 over all "
                              "output tokens)", title_justify="left")
        for column in ("run", "cache", "TTFT", "TPOT", "p50", "p90", "p99", "token p99", "TPOT / all-resident",
                       "TPOT / oracle", "stall s"):
            latency.add_column(column, justify="left" if column in ("run", "cache") else "right")
        traffic = Table(title=f"{trace}{where}  -  expert traffic", title_justify="left")
        links = list(dict.fromkeys(link for r in rows for link in (r.bytes_per_link or {})))
        hosting = any(r.bypassed is not None for r in rows)  # experts computed on the host: their columns
        for column in ("run", "cache", "hit rate", "on-demand", "prefetched", "used", "wasted", "precision",
                       "recall", *(("bypassed", "host s") if hosting else ()), *(f"{link} moved" for link in links)):
            traffic.add_column(column, justify="left" if column in ("run", "cache") else "right")
        ordered = sorted(rows, key=lambda r: (r.policy != "all-resident", r.cache_bytes or 0, r.policy,
                                              r.prefetcher != "oracle", r.prefetcher or ""))
        for r in ordered:
            cache = "all experts" if r.policy == "all-resident" else f"{r.cache_size} ({binary_bytes(r.cache_bytes)})"
            tpot = r.tpot_seconds
            vs_bound = f"{tpot / bound.tpot_seconds:.2f}x" if tpot and bound and bound.tpot_seconds else "-"
            reference = oracle.get((r.policy, r.cache_bytes))
            vs_oracle = (f"{tpot / reference.tpot_seconds:.2f}x" if tpot and reference and reference.tpot_seconds
                         and r.policy != "all-resident" else "-")
            percentiles = r.tpot_percentiles or {}
            token_p99 = (float(np.percentile(r.token_latency_seconds, 99)) if r.token_latency_seconds else None)
            label = run_label(r)
            latency.add_row(label, cache, _ms(r.ttft_seconds), _ms(tpot), _ms(percentiles.get("p50")),
                            _ms(percentiles.get("p90")), _ms(percentiles.get("p99")), _ms(token_p99), vs_bound,
                            vs_oracle, f"{r.stall_seconds:.3f}")
            prefetching = r.prefetcher is not None
            traffic.add_row(label, cache, f"{r.hit_rate:.2%}", f"{r.on_demand_loads:,}",
                            f"{r.prefetches_issued:,}" if prefetching else "-",
                            f"{r.prefetches_used:,}" if prefetching else "-",
                            f"{r.prefetches_wasted:,}" if prefetching else "-",
                            _share(r.prefetch_precision), _share(r.prefetch_recall) if prefetching else "-",
                            *((f"{r.bypassed:,}" if r.bypassed is not None else "-",
                               f"{r.host_compute_seconds:.3f}" if r.host_compute_seconds is not None else "-")
                              if hosting else ()),
                            *(binary_bytes(r.bytes_per_link.get(link, 0)) if r.bytes_per_link.get(link) else "0"
                              for link in links))
        console.print(latency)
        console.print(traffic)
        for note in sorted({note for r in rows for note in r.notes}):
            console.print(f"note: {note}")


def print_runtime_summary(generation, engine, console: Console | None = None) -> None:
    """The end of `moe-offload generate`: speed, latency, cache and traffic of one generate call."""
    console = console or Console()
    stats = generation.stats
    held = (f"{stats.cache_size} cached tops and a buffer of {engine.spec.top_k} experts, of "
            if getattr(engine, "split", None) is not None else f"{stats.cache_size} experts of ")  # runtime/split.py
    table = Table(title=f"{engine.manifest.directory.name}: {run_label(stats)}, fast tier "
                        f"{binary_bytes(stats.cache_bytes)} ({held}"
                        f"{engine.spec.num_layers * engine.spec.num_experts})", show_header=False)
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("tokens", f"{len(generation.token_ids)} generated after {generation.prompt_tokens} prompt tokens"),
        ("tokens/s", f"{generation.tokens_per_second:.1f}"),
        ("TTFT", f"{_ms(stats.ttft_seconds)} ms"),
        ("TPOT", f"{_ms(stats.tpot_seconds)} ms"),
        ("hit rate", f"{_share(stats.hit_rate)} of {stats.accesses} expert requests"),
        ("on-demand loads", str(stats.on_demand_loads)),
    ]
    compute_bytes, manifest = getattr(engine, "compute_expert_bytes", None), engine.manifest
    if compute_bytes and compute_bytes != manifest.expert_bytes:  # docs/budgets.md: the runtime's expert size
        dtype = str(getattr(engine, "compute_dtype", "")).removeprefix("torch.")
        rows += [("an expert in the fast tier", f"{binary_bytes(compute_bytes)} ({dtype}, the compute dtype; "
                                                f"stored as {binary_bytes(manifest.expert_bytes)} in {manifest.dtype})")]
    if stats.bypassed is not None:  # a placing policy (runtime/placement.py)
        rows += [("computed on the host", f"{stats.bypassed} expert requests in {_ms(stats.host_compute_seconds)} ms")]
    rows += [
        ("prefetch precision", _share(stats.prefetch_precision)),
        ("prefetch recall", _share(stats.prefetch_recall)),
        ("stall", f"{_ms(stats.stall_seconds)} ms"),
        ("eviction decisions", f"{stats.policy_decisions} in {_ms(stats.policy_decision_seconds)} ms"),
        ("start-up", f"{engine.startup_seconds * 1e3:.0f} ms (non-expert weights)"),
    ]
    rows += [(f"moved {link}", binary_bytes(count)) for link, count in sorted((stats.bytes_per_link or {}).items())]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
