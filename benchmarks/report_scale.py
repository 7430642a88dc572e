"""How long `moe-offload report` takes on a large trace, phase by phase, against one libCacheSim LRU replay of the
same request sequence, and its peak memory.

    python benchmarks/report_scale.py [--tokens 20000] [--layers 48] [--experts 128] [--top-k 8]
        [--fast-memory 25%] [--jobs 2] [--expert-bytes BYTES] [--sample-above N | --exact] [--html FILE]

The trace is synthetic: Zipf-popular experts per layer (paper 001's section 5.1 law, a = 1.2, each layer its
own popularity order), requests of 256 decode tokens one after the other, Qwen3-30B-A3B's shape by default (48
layers, top-8 of 128). Without --expert-bytes the trace gives no expert size, so the report has no latency
section (the timed simulator's runs are their own benchmark); with it, the budget must fit the default
hardware profile's GPU, checked before any work as `moe-offload report` checks it. 20,000 tokens are 7.7M
requests; a million tokens, a day of one vLLM instance, 384M:

    python benchmarks/report_scale.py --tokens 1000000

Prints the seconds (wall clock, and CPU of the process and its workers) of each phase as it ends (the trace,
working set, the bound with OPT's curve, timed runs if any, HTML), the report, the whole report's time over one
libCacheSim LRU replay of the same sequence (read from its oracleGeneral file, written after the report so its
memory is not the report's), and the process's peak resident memory during the report.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

REQUEST_TOKENS = 256


def synthetic_trace(tokens: int, layers: int, experts: int, top_k: int, expert_bytes: int | None):
    import numpy as np

    from moe_offload.trace.format import Trace
    from moe_offload.trace.synthetic import zipf_trace

    base = zipf_trace(layers, experts, top_k, tokens, a=1.2, b=0.0, seed=0, shuffle=True)
    rows = np.arange(tokens)
    meta = replace(base.meta, expert_bytes=expert_bytes)
    return Trace.build(meta, base.experts, request=rows // REQUEST_TOKENS, position=rows % REQUEST_TOKENS,
                       path="synthetic-zipf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--fast-memory", default="25%")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--expert-bytes", help="bytes of one expert: adds the latency section (default none)")
    parser.add_argument("--sample-above", type=int, default=None, help="as `report --sample-above`")
    parser.add_argument("--exact", action="store_true", help="as `report --exact`")
    parser.add_argument("--html", metavar="FILE", help="also write the report's page")
    args = parser.parse_args()

    import resource
    import tempfile
    from pathlib import Path

    from rich.console import Console

    from moe_offload.cli.report_cmd import DEFAULT_TIMED_TOKENS, fast_memory_experts
    from moe_offload.hardware import resolve_profile
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.reporting.bound import SAMPLE_ABOVE
    from moe_offload.reporting.html import render_html
    from moe_offload.reporting.report import build_report, print_report
    from moe_offload.simulator.replay import ReplayInput
    from moe_offload.simulator.timed import Arrivals, check_timed_run
    from moe_offload.trace.flatten import write_oracle_general
    from moe_offload.values import parse_bytes

    if args.html:
        check_output(args.html, suffixes=(".html",), what="report")
    marks = []  # (what starts, wall clock, CPU time of this process and its workers): on a shared machine they differ

    def step(text: str) -> None:  # each phase's time as it ends, so that a long run shows where it is
        times = os.times()  # worker processes count once their pool has ended (each grid's does)
        now, cpu = time.perf_counter(), times.user + times.system + times.children_user + times.children_system
        if marks:
            print(f"  {now - marks[-1][1]:8.2f} s wall {cpu - marks[-1][2]:8.2f} s CPU  {marks[-1][0]}", flush=True)
        marks.append((text, now, cpu))

    expert_bytes = parse_bytes(args.expert_bytes, "--expert-bytes") if args.expert_bytes else None
    hardware = resolve_profile(None)
    step("synthetic trace and its flattened sequence")
    trace = synthetic_trace(args.tokens, args.layers, args.experts, args.top_k, expert_bytes)
    meta = trace.meta
    cache_size = fast_memory_experts(args.fast_memory, meta.num_expert_slots, meta.top_k, meta.expert_bytes)
    if expert_bytes:  # as `moe-offload report`: the budget must fit the GPU the latency runs on
        check_timed_run(trace, hardware, "lru", cache_size * expert_bytes, expert_bytes, Arrivals())
    data = ReplayInput.of(trace, name="synthetic-zipf")
    report = build_report(data, "synthetic-zipf", cache_size, hardware, meta.expert_bytes,
                          timed_tokens=DEFAULT_TIMED_TOKENS, jobs=args.jobs, step=step,
                          sample_above=None if args.exact else args.sample_above or SAMPLE_ABOVE)
    step("HTML page")
    page = render_html(report)
    step("end")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    if args.html:
        write_atomically(args.html, page)
    print_report(report, Console(width=120))
    print(f"\n{args.tokens:,} tokens x {args.layers} layers x top-{args.top_k} of {args.experts} experts, "
          f"{len(data.sequence):,} expert requests: {marks[-1][1] - marks[0][1]:.2f} s wall, "
          f"{marks[-1][2] - marks[0][2]:.2f} s CPU in all (phases above)")
    bound, latency = report.bound, report.latency
    if bound.sampled:
        print(f"  (the Python policies {', '.join(r.policy for r in bound.sampled)} replayed the first "
              f"{bound.sampled_tokens:,} tokens)")
    if latency is not None and latency.sampled:
        print(f"  (the timed simulator ran the first {latency.tokens:,} tokens)")
    print(f"peak resident memory of the report's process: {peak / 2**30:.2f} GiB "
          f"({peak / len(data.sequence):.1f} bytes per request)")
    try:
        import libcachesim as lcs
    except ImportError:
        print("libcachesim is not installed (pip install libcachesim): no reference time")
        return 0
    with tempfile.TemporaryDirectory(prefix="report-scale-") as work:
        oracle = write_oracle_general(data.sequence, Path(work) / "trace.oracleGeneral.bin", None)
        start = time.perf_counter()
        reader = lcs.TraceReader(str(oracle), lcs.TraceType.ORACLE_GENERAL_TRACE)
        lcs.LRU(cache_size).process_trace(reader)
        reference = time.perf_counter() - start
    whole = marks[-1][1] - marks[0][1]
    print(f"one libCacheSim LRU replay of the same sequence: {reference:.2f} s; the report took {whole / reference:.1f} "
          "of them")
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
