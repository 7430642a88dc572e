"""How well the timed simulator predicts the real runtime: the same prompts, policies, prefetchers and budgets,
once measured in the runtime and once simulated with the hardware profile measured on this machine.

    python benchmarks/simulator_fidelity.py [--quick] [--budgets 25,50,75] [--policies lru,lfu,lcp]
        [--prefetchers none,topk,moepic] [--prompts 4] [--max-new-tokens 32] [--threads N] [--json FILE]

1. ``moe-offload hardware measure`` (moe_offload.runtime.measure) times this machine on the packed bundled
   model: expert file reads, conversion, expert compute, attention, router and LM head.
2. The recorder runs the bundled model on the benchmark prompts (batch 1, greedy), which gives the trace of
   exactly the routing the runtime will see (generation is lossless, so the tokens are the same).
3. For each configuration the runtime generates (benchmarks/runtime_tpot.py's ``run_config``) and the timed
   simulator replays the recorded trace on the measured profile with the same policy, prefetcher and number
   of experts in the fast tier. Reported: TPOT and stall time, measured and predicted, and the relative
   error (predicted - measured) / measured of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runtime_tpot import benchmark_prompts, run_config  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="25,50,75")
    parser.add_argument("--policies", default="lru,lcp")
    parser.add_argument("--prefetchers", default="none,topk,fmoe,moepic")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each hardware measurement")
    parser.add_argument("--quick", action="store_true", help="lru, lcp; none, moepic; 25 and 75%%; 2 prompts")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 without CUDA, leaving a core to the readers, as "
                             "runtime_gpu.py does; as they are with CUDA)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from moe_offload.bundled import TINY_HISTORY_TRACE
    from moe_offload.hardware.profile import HardwareProfile
    from moe_offload.models import quiet_transformers
    from moe_offload.models.recorder import record
    from moe_offload.models.tiny import load
    from moe_offload.runtime.measure import measure_hardware
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.runtime.packing import read_manifest
    from moe_offload.simulator.timed import simulate_timed
    from moe_offload.text.prompts import Prompt
    from moe_offload.trace.format import read_trace

    quiet_transformers()
    import torch

    from moe_offload import values

    if args.threads is not None or not torch.cuda.is_available():
        # Two threads on two cores: every parallel operation of the decode waits while a reader holds a core, a
        # stall the profile's processor sharing does not model (README, "The simulator on this CPU").
        threads = 1 if args.threads is None else args.threads
        torch.set_num_threads(values.integer(threads, "--threads", low=1, high=values.cores()))
    budgets = [int(b) for b in args.budgets.split(",")]
    policies, prefetchers, count = args.policies.split(","), args.prefetchers.split(","), args.prompts
    if args.quick:
        budgets, policies, prefetchers, count = [25, 75], ["lru", "lcp"], ["none", "moepic"], 2
    started = time.perf_counter()
    packed = packed_directory("tiny")
    manifest = read_manifest(packed)
    profile = HardwareProfile.from_dict(measure_hardware(packed, repeats=args.repeats, model_name="tiny"),
                                        path="<measured>")
    prompts = benchmark_prompts(count)
    model, adapter, tokenizer = load("tiny")
    trace = record(model, adapter, tokenizer, [Prompt(p, f"bench:{i}") for i, p in enumerate(prompts)],
                   model_name="moe-offload/tiny-mixtral", max_new_tokens=args.max_new_tokens, batch_size=1).trace
    del model
    history = read_trace(TINY_HISTORY_TRACE)
    experts = manifest.num_layers * manifest.num_experts
    print(f"measured profile: {profile.links[0].name} {profile.links[0].bandwidth_bytes_per_s / 1e6:.0f} MB/s + "
          f"{profile.links[0].latency_s * 1e6:.0f} us, attention and framework overhead "
          f"{profile.compute.attention.fixed_s * 1e3:.2f} ms per layer; recorded {trace.num_tokens} tokens of "
          f"{len(prompts)} prompts", flush=True)

    resident = run_config(packed, prompts, args.max_new_tokens, fast_budget="100%", preload=True)
    bound = simulate_timed(trace, profile, all_resident=True)
    print(f"all-resident: TPOT {resident['tpot_s'] * 1e3:.2f} ms measured, {bound.tpot_seconds * 1e3:.2f} predicted "
          f"({bound.tpot_seconds / resident['tpot_s'] - 1:+.0%})", flush=True)
    rows = []
    for budget in budgets:
        slots = int(experts * budget / 100)
        for policy in policies:
            for prefetch in prefetchers:
                name = None if prefetch == "none" else prefetch
                measured = run_config(packed, prompts, args.max_new_tokens, fast_budget=f"{budget}%", policy=policy,
                                      prefetch=name, prefetch_history=history if name else None,
                                      bypass_page_cache=True)  # as the profile's reads
                predicted = simulate_timed(trace, profile, policy, cache_bytes=slots * manifest.expert_bytes,
                                           expert_bytes=manifest.expert_bytes, prefetcher=name,
                                           history=history if name else None)
                row = {"budget_pct": budget, "policy": policy, "prefetcher": prefetch,
                       "tpot_measured_s": measured["tpot_s"], "tpot_predicted_s": predicted.tpot_seconds,
                       "stall_measured_s": measured["stall_s"], "stall_predicted_s": predicted.stall_seconds,
                       "hit_rate_measured": measured["hit_rate"], "hit_rate_predicted": predicted.hit_rate}
                row["tpot_error"] = row["tpot_predicted_s"] / row["tpot_measured_s"] - 1
                row["stall_error"] = (row["stall_predicted_s"] / row["stall_measured_s"] - 1
                                      if row["stall_measured_s"] > 0 else None)
                rows.append(row)
                print(f"{budget:>3}% {policy:<6} {prefetch:<13} TPOT {row['tpot_measured_s'] * 1e3:6.2f} ms measured, "
                      f"{row['tpot_predicted_s'] * 1e3:6.2f} predicted ({row['tpot_error']:+.0%}); stall "
                      f"{row['stall_measured_s'] * 1e3:6.1f} / {row['stall_predicted_s'] * 1e3:6.1f} ms; hit "
                      f"{row['hit_rate_measured']:.1%} / {row['hit_rate_predicted']:.1%}", flush=True)
    tpot_errors = [abs(r["tpot_error"]) for r in rows]
    print(f"\nTPOT: mean absolute error {statistics.mean(tpot_errors):.1%}, worst {max(tpot_errors):.1%} over "
          f"{len(rows)} configurations ({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"profile": profile.name, "resident_measured_s": resident["tpot_s"],
                       "resident_predicted_s": bound.tpot_seconds, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
