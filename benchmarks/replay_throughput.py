"""Replay throughput of every policy, with libCacheSim's LRU, FIFO and Belady on the same trace in the same run.

    python benchmarks/replay_throughput.py [--accesses 1000000] [--cache-fraction 0.25] [--repeat 3]

The trace is a seeded Zipf trace of a Mixtral-shaped model (32 layers x 8 experts, top-2), flattened as the
replay simulator does; libCacheSim reads the same request sequence from its oracleGeneral binary. Each
timing is the best of --repeat runs. Reported: accesses per second, and for LRU, FIFO and Belady the ratio
of libCacheSim's throughput to ours (how many times faster the C implementation is) with a check that
both count the same misses.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_offload.policies import POLICIES
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.flatten import write_oracle_general
from moe_offload.trace.synthetic import zipf_trace

LIBCACHESIM = {"lru": "LRU", "fifo": "FIFO", "belady": "Belady"}


def best_time(function, repeat: int):
    best, value = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        value = function()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accesses", type=int, default=1_000_000)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()

    layers, experts, top_k = 32, 8, 2
    tokens = max(1, args.accesses // (layers * top_k))
    trace = zipf_trace(layers, experts, top_k, tokens, a=1.0, b=1.0, seed=0, shuffle=True)
    flatten_s, data = best_time(lambda: ReplayInput.of(trace, name="zipf"), 1)
    n = len(data.sequence)
    cache_size = max(top_k, round(args.cache_fraction * layers * experts))
    console = Console(width=150)
    console.print(f"trace: Zipf a=1 b=1, {layers}x{experts} top-{top_k}, {tokens:,} tokens = {n:,} requests; "
                  f"cache {cache_size} experts; flattening took {flatten_s:.2f} s")

    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
        console.print("libcachesim is not installed (pip install libcachesim): no reference timings")

    table = Table(title="replay throughput (best of %d)" % args.repeat, title_justify="left")
    for column in ("policy", "misses", "seconds", "M accesses/s", "libCacheSim M accesses/s",
                   "libCacheSim / ours", "same misses"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        oracle = Path(tmp) / "trace.oracleGeneral.bin"
        write_oracle_general(data.sequence, oracle, expert_bytes=None)
        for policy in args.policies.split(","):
            seconds, result = best_time(lambda: replay(data, policy, cache_size), args.repeat)
            row = [policy, f"{result.misses:,}", f"{seconds:.3f}", f"{n / seconds / 1e6:.2f}"]
            if lcs is not None and policy in LIBCACHESIM:
                def run_reference():
                    reader = lcs.TraceReader(str(oracle), lcs.TraceType.ORACLE_GENERAL_TRACE)
                    return getattr(lcs, LIBCACHESIM[policy])(cache_size).process_trace(reader)[0]
                ref_seconds, miss_ratio = best_time(run_reference, args.repeat)
                row += [f"{n / ref_seconds / 1e6:.2f}", f"{seconds / ref_seconds:.1f}x",
                        "yes" if round(miss_ratio * n) == result.misses else f"NO ({round(miss_ratio * n):,})"]
            else:
                row += ["", "", ""]
            table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
