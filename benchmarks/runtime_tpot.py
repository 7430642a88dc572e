"""TPOT of the bundled tiny Mixtral in the real runtime, per fast budget, eviction policy and prefetcher,
as ratios to the all-resident model and to on-demand LRU (the mixtral-offloading baseline), measured in one run.

    python benchmarks/runtime_tpot.py [--quick] [--budgets 25,50,75] [--policies lru,lfu,...]
        [--prefetchers none,topk,...] [--max-new-tokens 32] [--json FILE] [--device cpu|cuda]

Every configuration is a fresh engine (cold fast tier, experts in the packed files) that generates greedily
for the same prompts: ShareGPT first turns and HumanEval prompts that the bundled recorded trace does not
contain, nor its history trace (from which MoE-Infinity's and fMoE's prefetchers learn). TPOT is the mean over
prompts of each prompt's (last token - first token) / (tokens - 1). The all-resident row preloads every
expert before the first token. Every run checks that its tokens equal the all-resident run's (lossless).

On a 2-core CPU machine the slow tier is the page cache or a local disk and the fast tier a RAM budget of
float32 tensors; copying an expert costs a read and a float16 -> float32 conversion, on the same cores as the
compute. Ratios therefore say how much the policy and prefetcher save on this machine, not on a GPU server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from moe_offload.policies import POLICIES

DEFAULT_PREFETCHERS = ["none", "topk", "traced-topk", "moe-infinity", "fmoe", "moepic"]


def benchmark_prompts(count: int) -> list[str]:
    """Prompts not in the bundled recorded trace (which takes the first ShareGPT and HumanEval prompts)."""
    from moe_offload.text.prompts import load_prompts

    sharegpt = load_prompts("sharegpt", limit=200)[100:]
    humaneval = load_prompts("humaneval", limit=164)[100:]
    half = max(1, count // 2)
    return [p.text for p in sharegpt[:half]] + [p.text for p in humaneval[:count - half]]


def run_config(packed, prompts, max_new_tokens, *, device=None, **engine_options) -> dict:
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    with OffloadEngine(make_plan(packed, device=device, **engine_options)) as engine:
        results = [engine.generate(prompt, max_new_tokens=max_new_tokens) for prompt in prompts]
        total = engine.stats
    tpots = [r.stats.tpot_seconds for r in results if r.stats.tpot_seconds is not None]
    return {
        "tokens": [r.token_ids for r in results],
        "tpot_s": statistics.mean(tpots),
        "ttft_s": statistics.mean(r.stats.ttft_seconds for r in results),
        "hit_rate": total.hit_rate,
        "stall_s": total.stall_seconds,
        "on_demand_loads": total.on_demand_loads,
        "prefetch_precision": total.prefetch_precision,
        "prefetch_recall": total.prefetch_recall,
        "bytes_per_link": total.bytes_per_link,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--budgets", default="25,50,75", help="fast budgets, %% of all expert bytes")
    parser.add_argument("--policies", default=None, help="comma-separated (default: every online policy)")
    parser.add_argument("--prefetchers", default=",".join(DEFAULT_PREFETCHERS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="lru, lfu, lcp; none, topk, moepic; 2 prompts")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from moe_offload.bundled import TINY_HISTORY_TRACE
    from moe_offload.models import quiet_transformers
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.trace.format import read_trace

    quiet_transformers()
    policies = args.policies.split(",") if args.policies else [n for n, i in POLICIES.items() if not i.offline]
    prefetchers = args.prefetchers.split(",")
    prompt_count = args.prompts
    if args.quick:
        policies, prefetchers, prompt_count = ["lru", "lfu", "lcp"], ["none", "topk", "moepic"], 2
    budgets = [int(b) for b in args.budgets.split(",")]
    packed = packed_directory(args.model)
    prompts = benchmark_prompts(prompt_count)
    history = read_trace(TINY_HISTORY_TRACE) if args.model == "tiny" else None
    started = time.perf_counter()

    run_config(packed, prompts[:1], 4, device=args.device, fast_budget="100%", preload=True)  # warm-up
    resident = run_config(packed, prompts, args.max_new_tokens, device=args.device, fast_budget="100%", preload=True)
    rows = []
    print(f"all-resident TPOT {resident['tpot_s'] * 1e3:.2f} ms, TTFT {resident['ttft_s'] * 1e3:.1f} ms "
          f"({len(prompts)} prompts x {args.max_new_tokens} tokens)", flush=True)
    for budget in budgets:
        baseline = None
        for policy in policies:
            for prefetch in prefetchers:
                name = None if prefetch == "none" else prefetch
                result = run_config(packed, prompts, args.max_new_tokens, device=args.device,
                                    fast_budget=f"{budget}%", policy=policy, prefetch=name,
                                    prefetch_history=history if name else None)
                if result["tokens"] != resident["tokens"]:
                    raise SystemExit(f"LOSSLESS VIOLATION: {policy} + {prefetch} at {budget}% changed the tokens")
                if policy == "lru" and name is None:
                    baseline = result
                rows.append({"budget_pct": budget, "policy": policy, "prefetcher": prefetch,
                             **{k: v for k, v in result.items() if k != "tokens"},
                             "tpot_vs_resident": result["tpot_s"] / resident["tpot_s"]})
                print(f"{budget:>3}%  {policy:<13} {prefetch:<13} TPOT {result['tpot_s'] * 1e3:7.2f} ms  "
                      f"x{result['tpot_s'] / resident['tpot_s']:.2f} resident  hit {result['hit_rate']:.1%}  "
                      f"stall {result['stall_s'] * 1e3:7.1f} ms", flush=True)
        for row in rows:
            if row["budget_pct"] == budget and baseline is not None:
                row["tpot_vs_lru_on_demand"] = row["tpot_s"] / baseline["tpot_s"]

    print()
    print(f"{'budget':>6} {'policy':<13} {'prefetch':<13} {'TPOT ms':>8} {'/resident':>9} {'/LRU':>6} {'hit':>6}")
    for row in rows:
        print(f"{row['budget_pct']:>5}% {row['policy']:<13} {row['prefetcher']:<13} {row['tpot_s'] * 1e3:8.2f} "
              f"{row['tpot_vs_resident']:9.2f} {row.get('tpot_vs_lru_on_demand', float('nan')):6.2f} "
              f"{row['hit_rate']:6.1%}")
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s; every run's tokens equal the all-resident run's")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"resident": {k: v for k, v in resident.items() if k != "tokens"}, "runs": rows,
                       "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
