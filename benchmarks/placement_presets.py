"""Dynamic caching against static placement plus host compute: TPOT of the best of each family on the hardware
presets, for an OLMoE-sized and a Mixtral-sized trace, at 12.5%, 25% and 50% of the experts in the GPU.

    python benchmarks/placement_presets.py                 # small default: 32 decode steps, < 1 minute
    python benchmarks/placement_presets.py --tokens 0      # every step of both traces (a few minutes)
        [--presets desktop-rtx4090,server-a100-pcie4,server-h100-pcie5,edge-flashmoe] [--budgets 0.125,0.25,0.5]
        [--json FILE]

Families (every run in the timed simulator, batch 1, the trace's own iterations):

* dynamic: the GPU is a cache; lru, lfu-decay and pinned-lru (its pinned half profiled on the history
  rows), each without a prefetcher and with traced-topk (BrainStorm's popularity prefetcher), each with and
  without Fiddler's fetch-or-compute rule (a miss computed on the host when that is predicted faster than
  loading it: a dynamic cache that also uses the host);
* static + host: a fixed set in the GPU, every other expert computed by the host CPU from host memory:
  static-freq (most frequent experts overall, profiled on the history rows), static-freq per layer, and
  static-layers (llama.cpp's --n-cpu-moe: the last whole layers).

Traces. OLMoE-1B-7B: the bundled trace (one request of 299 decode steps, 16 layers x 64 experts, top-8,
12.6 MB experts); history = rows 0:150 (static-freq's profile), run = the rows after. Mixtral-8x7B-shaped:
a synthetic trace (32 layers x 8 experts, top-2, Zipf a = 0.5 popularity, a random order per layer) with
Mixtral's bf16 expert size, 3 x 4096 x 14336 x 2 B = 352 MB, and hidden size 4096; its own first half is the
history. The presets' attention and LM head costs are written for OLMoE-sized layers, so the Mixtral rows
compare the expert paths (transfers against host compute), not whole Mixtral steps.

Why one family wins: a missed expert costs a load of E bytes over the host link (PCIe) or a read of E bytes
at the host CPU's memory bandwidth; the column "host / link" is that ratio of bandwidths. Above 1 the host
computes a decoding token's expert faster than the link delivers it, and a static placement that never loads
anything pays only that; a dynamic cache wins where its hit rate gain outweighs its loads, or the host is
slow against the link (an SSD home: edge-flashmoe keeps ~1 GiB of experts in RAM, the rest on the SSD).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from rich.console import Console
from rich.table import Table

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.hardware import resolve_profile
from moe_offload.outputs import write_atomically
from moe_offload.simulator.timed import Arrivals, simulate_timed
from moe_offload.trace import read_trace
from moe_offload.trace.synthetic import zipf_trace
from moe_offload.values import integer, number

PRESETS = ("desktop-rtx4090", "server-a100-pcie4", "server-h100-pcie5", "edge-flashmoe")
BUDGETS = (0.125, 0.25, 0.5)
MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2
DYNAMIC_POLICIES = ("lru", "lfu-decay", "pinned-lru")
PREFETCHERS = (None, "traced-topk")


def workloads(tokens: int):
    """(name, run trace, history trace) of the two model sizes, the run cut to ``tokens`` steps (0: all)."""
    olmoe = read_trace(DEFAULT_TRACE)
    mixtral = zipf_trace(num_layers=32, num_experts=8, top_k=2, length=300, a=0.5, b=1.0, seed=0, shuffle=True)
    mixtral.meta = dataclasses.replace(mixtral.meta, model="Mixtral-8x7B-shaped (synthetic Zipf routing)",
                                       expert_bytes=MIXTRAL_EXPERT_BYTES, hidden_size=4096)
    out = []
    for name, trace in (("OLMoE-1B-7B", olmoe), ("Mixtral-8x7B-sized", mixtral)):
        half = trace.num_tokens // 2
        end = trace.num_tokens if not tokens else min(trace.num_tokens, half + tokens)
        out.append((name, trace.select(slice(half, end)), trace.select(slice(0, half))))
    return out


def runs(history):
    """(family, label, simulate_timed keywords) of every setup compared."""
    setups = []
    for policy in DYNAMIC_POLICIES:
        # pinned-lru pins the history's hottest experts, as static-freq places them: neither sees the run
        options = {"profile": history} if policy == "pinned-lru" else None
        for prefetcher in PREFETCHERS:
            for fetch_or_compute in (False, True):
                label = policy + (f" + {prefetcher}" if prefetcher else "") + (" + f-or-c" if fetch_or_compute else "")
                setups.append(("dynamic", label, dict(policy=policy, prefetcher=prefetcher, policy_options=options,
                                                      fetch_or_compute=fetch_or_compute)))
    setups.append(("static", "static-freq", dict(policy="static-freq", policy_options={"profile": history})))
    setups.append(("static", "static-freq per layer", dict(policy="static-freq",
                                                           policy_options={"profile": history, "per_layer": True})))
    setups.append(("static", "static-layers", dict(policy="static-layers")))
    return setups


def best_of(trace, history, hardware, cache_bytes):
    """{family: (TPOT, label, hit rate)} of the fastest setup of each family; None where the budget exceeds
    the GPU."""
    if cache_bytes > hardware.tiers[0].capacity_bytes:
        return None
    best = {}
    for family, label, options in runs(history):
        result = simulate_timed(trace, hardware, cache_bytes=cache_bytes, arrivals=Arrivals(), **options)
        if family not in best or result.tpot_seconds < best[family][0]:
            best[family] = (result.tpot_seconds, label, result.hit_rate)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32", help="decode steps of each run trace (0: all; default 32)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS),
                        help="shares of all experts' bytes in the GPU")
    parser.add_argument("--json", metavar="FILE", help="also write the table's rows as JSON")
    args = parser.parse_args()
    tokens = integer(args.tokens, "--tokens", low=0)
    budgets = [number(b, "--budgets", low=0, high=1, low_open=True) for b in args.budgets.split(",")]
    presets = [resolve_profile(name) for name in args.presets.split(",")]
    for hardware in presets:
        if hardware.host is None:
            raise ConfigError(f"--presets: {hardware.name} has no [host] compute to run a static placement with")

    started = time.perf_counter()
    table = Table(title="TPOT in ms: best dynamic setup vs best static placement + host compute (timed simulator)")
    for column in ("trace", "hardware", "budget", "host / link", "best dynamic", "TPOT", "best static + host",
                   "TPOT ", "winner"):
        table.add_column(column, justify="right" if column.startswith(("TPOT", "host", "budget")) else "left")
    rows = []
    for name, trace, history in workloads(tokens):
        total = trace.meta.num_expert_slots * trace.meta.expert_bytes
        for hardware in presets:
            ratio = hardware.host.roofline.memory_bandwidth_bytes_per_s / hardware.link_from(1).bandwidth_bytes_per_s
            for budget in budgets:
                best = best_of(trace, history, hardware, int(budget * total))
                if best is None:
                    table.add_row(name, hardware.name, f"{budget:.1%}", f"{ratio:.1f}", "-", "-", "-", "-",
                                  "does not fit the GPU")
                    continue
                (dyn, dyn_label, dyn_hits), (stat, stat_label, stat_hits) = best["dynamic"], best["static"]
                winner = "static + host" if stat < dyn else "dynamic"
                table.add_row(name, hardware.name, f"{budget:.1%}", f"{ratio:.1f}",
                              f"{dyn_label} ({dyn_hits:.0%} hits)", f"{dyn * 1e3:.2f}", f"{stat_label} ({stat_hits:.0%} hits)", f"{stat * 1e3:.2f}",
                              f"{winner} ({max(dyn, stat) / min(dyn, stat):.2f}x)")
                rows.append({"trace": name, "hardware": hardware.name, "budget": budget, "host_over_link": ratio,
                             "dynamic": dyn_label, "dynamic_tpot_s": dyn, "dynamic_hit_rate": dyn_hits,
                             "static": stat_label, "static_tpot_s": stat, "static_hit_rate": stat_hits,
                             "winner": winner})
    console = Console(width=200)
    console.print(table)
    console.print(f"{len(rows)} comparisons in {time.perf_counter() - started:.0f} s"
                  + (f" ({tokens} decode steps per trace)" if tokens else ""))
    if args.json:
        write_atomically(args.json, json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
