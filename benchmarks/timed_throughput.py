"""How fast the timed simulator runs: token-layers per CPU second of one ``simulate_timed`` run on the bundled
traces, on desktop-rtx4090 with a quarter of the experts in the GPU.

    python benchmarks/timed_throughput.py

A token-layer is one trace row through one layer: the OLMoE trace (one request decoding, one token a pass,
16 layers of top-8) has 299 x 16; the tiny trace (ShareGPT and HumanEval prompts, prefill passes of many
tokens, 8 layers of top-2) 7,603 x 8, of which most come in few passes, so it runs more of them a second.
CPU seconds (``time.process_time``) of the run alone, trace reading and imports excluded, so the figure does
not count the time a loaded machine gives other processes. Compare two versions of the code by running this
on each back to back on the same machine.
"""

from __future__ import annotations

import time

from moe_offload.bundled import DEFAULT_TINY_TRACE, DEFAULT_TRACE
from moe_offload.hardware.profile import resolve_profile
from moe_offload.simulator.timed import simulate_timed
from moe_offload.trace.format import read_trace

RUNS = [  # (trace, policy, prefetcher)
    (DEFAULT_TRACE, "lru", None),
    (DEFAULT_TRACE, "lru", "oracle"),
    (DEFAULT_TINY_TRACE, "lru", None),
    (DEFAULT_TINY_TRACE, "lru", "oracle"),
    (DEFAULT_TINY_TRACE, "lcp", "moepic"),
]


def main() -> None:
    hardware = resolve_profile("desktop-rtx4090")
    print(f"{'trace':<44} {'policy + prefetcher':<20} {'CPU s':>7} {'token-layers':>13} {'per CPU s':>10}")
    for path, policy, prefetcher in RUNS:
        trace = read_trace(path)
        meta = trace.meta
        start = time.process_time()
        simulate_timed(trace, hardware, policy, meta.num_expert_slots * meta.expert_bytes // 4, prefetcher=prefetcher)
        seconds = time.process_time() - start
        token_layers = len(trace.request) * meta.num_layers
        print(f"{path.name:<44} {policy + ' + ' + (prefetcher or 'none'):<20} {seconds:>7.2f} {token_layers:>13,} "
              f"{token_layers / seconds:>10,.0f}")


if __name__ == "__main__":
    main()
