"""How long `moe-offload report` takes on a large trace, phase by phase.

    python benchmarks/report_scale.py [--tokens 20000] [--layers 32] [--experts 8] [--top-k 2]
        [--fast-memory 25%] [--jobs 2] [--html FILE]

The trace is synthetic: Zipf-popular experts per layer (paper 001's section 5.1 law, a = 1.2, each layer its
own popularity order), requests of 256 decode tokens one after the other, experts of Mixtral-8x7B's size
(176 MiB). The default of 20,000 tokens runs in under a minute; the issue's scale is a million tokens:

    python benchmarks/report_scale.py --tokens 1000000

Prints the seconds of each phase (flattening, working set, bound with OPT's budget search, timed runs on their
sample, HTML) and what ran on a sample (the Python policies' prefix, the timed simulator's first rows).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

REQUEST_TOKENS = 256
EXPERT_BYTES = 176 * 2**20


def synthetic_trace(tokens: int, layers: int, experts: int, top_k: int):
    import numpy as np

    from moe_offload.trace.format import Trace
    from moe_offload.trace.synthetic import zipf_trace

    base = zipf_trace(layers, experts, top_k, tokens, a=1.2, b=0.0, seed=0, shuffle=True)
    rows = np.arange(tokens)
    meta = replace(base.meta, expert_bytes=EXPERT_BYTES)
    return Trace.build(meta, base.experts, request=rows // REQUEST_TOKENS, position=rows % REQUEST_TOKENS,
                       path="synthetic-zipf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--fast-memory", default="25%")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--html", metavar="FILE", help="also write the report's page")
    args = parser.parse_args()

    from rich.console import Console

    from moe_offload.cli.report_cmd import DEFAULT_TIMED_TOKENS, fast_memory_experts
    from moe_offload.hardware import resolve_profile
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.reporting.html import render_html
    from moe_offload.reporting.report import build_report, print_report
    from moe_offload.simulator.replay import ReplayInput

    if args.html:
        check_output(args.html, suffixes=(".html",), what="report")
    marks = []  # (what starts, when)

    def step(text: str) -> None:
        marks.append((text, time.perf_counter()))

    step("synthetic trace and its flattened sequence")
    trace = synthetic_trace(args.tokens, args.layers, args.experts, args.top_k)
    meta = trace.meta
    cache_size = fast_memory_experts(args.fast_memory, meta.num_expert_slots, meta.top_k, meta.expert_bytes)
    data = ReplayInput.of(trace, name="synthetic-zipf")
    report = build_report(data, "synthetic-zipf", cache_size, resolve_profile(None), meta.expert_bytes,
                          timed_tokens=DEFAULT_TIMED_TOKENS, jobs=args.jobs, step=step)
    step("HTML page")
    page = render_html(report)
    step("end")
    if args.html:
        write_atomically(args.html, page)
    print_report(report, Console(width=120))
    print(f"\n{args.tokens:,} tokens x {args.layers} layers x top-{args.top_k} of {args.experts} experts, "
          f"{len(data.sequence):,} expert requests; seconds per phase:")
    for (name, begun), (_, ended) in zip(marks, marks[1:]):
        print(f"  {ended - begun:8.2f}  {name}")
    print(f"  {marks[-1][1] - marks[0][1]:8.2f}  in all")
    bound, latency = report.bound, report.latency
    if bound.sampled:
        print(f"  (the Python policies {', '.join(r.policy for r in bound.sampled)} replayed the first "
              f"{bound.sampled_tokens:,} tokens)")
    if latency is not None and latency.sampled:
        print(f"  (the timed simulator ran the first {latency.tokens:,} tokens)")
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
