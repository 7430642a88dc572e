"""TPOT of fMoE in the runtime with its matcher on the decode thread (``inline``) and on a thread of its own
(``async``, paper 000's asynchronous matcher; runtime/matcher.py), on the bundled tiny Mixtral with its history
trace, as ratios measured in one run; and the fraction of the asynchronous matcher's proposals that arrived
after their layer was routed (or their pass was over) and were dropped.

    python benchmarks/fmoe_matcher.py [--budget 50] [--prompts 4] [--max-new-tokens 32] [--rounds 3]

Every configuration is a fresh engine (cold fast tier) generating greedily for the same prompts (those of
benchmarks/runtime_tpot.py, which neither bundled trace contains); the modes alternate round by round, so that
a change in the machine's load hits both alike; the figures are medians over rounds of the mean TPOT over
prompts. Every run checks that its tokens equal the first run's (lossless).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from runtime_tpot import benchmark_prompts

MODES = ("none", "inline", "async")  # none: no prefetcher, for scale


def run_mode(packed, prompts, max_new_tokens, budget, mode, history) -> dict:
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    options = {} if mode == "none" else {"prefetch": "fmoe", "prefetch_history": history, "matcher": mode}
    with OffloadEngine(make_plan(packed, fast_budget=f"{budget}%", **options)) as engine:
        results = [engine.generate(prompt, max_new_tokens=max_new_tokens) for prompt in prompts]
        total = engine.stats
        late, arrived = engine.late_proposals
    return {"tokens": [r.token_ids for r in results],
            "tpot_s": statistics.mean(r.stats.tpot_seconds for r in results),
            "hit_rate": total.hit_rate, "late": late, "arrived": arrived}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=50, help="fast budget, %% of all expert bytes")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from moe_offload.bundled import TINY_HISTORY_TRACE
    from moe_offload.models import quiet_transformers
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.trace.format import read_trace

    quiet_transformers()
    packed = packed_directory("tiny")
    prompts = benchmark_prompts(args.prompts)
    history = read_trace(TINY_HISTORY_TRACE)
    started = time.perf_counter()
    run_mode(packed, prompts[:1], 4, args.budget, "async", history)  # warm-up
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    reference = None
    for round_ in range(args.rounds):
        for mode in MODES:
            result = run_mode(packed, prompts, args.max_new_tokens, args.budget, mode, history)
            reference = reference or result["tokens"]
            if result["tokens"] != reference:
                raise SystemExit(f"LOSSLESS VIOLATION: matcher {mode} changed the tokens")
            runs[mode].append(result)
            late = f"  late {result['late']}/{result['arrived']}" if mode == "async" else ""
            print(f"round {round_}  {mode:<7} TPOT {result['tpot_s'] * 1e3:7.2f} ms  hit {result['hit_rate']:.1%}"
                  f"{late}", flush=True)
    tpot = {mode: statistics.median(r["tpot_s"] for r in runs[mode]) for mode in MODES}
    late = sum(r["late"] for r in runs["async"])
    arrived = sum(r["arrived"] for r in runs["async"])
    print(f"\nfMoE at a {args.budget}% fast budget, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.rounds} rounds:")
    for mode in MODES:
        print(f"  {mode:<7} TPOT {tpot[mode] * 1e3:7.2f} ms  x{tpot[mode] / tpot['inline']:.3f} inline  "
              f"hit {statistics.median(r['hit_rate'] for r in runs[mode]):.1%}")
    print(f"  async matcher: {late} of {arrived} proposals arrived too late ({late / max(arrived, 1):.1%})")
    print(f"{sum(map(len, runs.values()))} runs in {time.perf_counter() - started:.0f} s; every run's tokens equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
