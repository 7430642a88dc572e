"""The offloaded runtime at real sizes under real access patterns: random weights, a real trace's routing.

    python benchmarks/runtime_gpu.py [--device cuda|cpu] [--model wide|small|olmoe|mixtral-8x7b] [--quick]
        [--budgets 25,50] [--policies lru,lcp,fmoe] [--prefetchers none,moepic,oracle] [--tokens N]
        [--expert-dtype float16|int8|int4] [--expert-compute auto|per-use|on-arrival|kernel] [--json FILE]

A model of a real architecture and size is built from its transformers config with random weights (float16),
saved and packed once into a folder under the pack cache. Its routers are forced to a trace's experts
(routing replay, runtime/replay.py), so it moves experts exactly as the traced model did:

- ``wide`` (the default): Mixtral, 8 layers x 8 experts, top-2, hidden 2048, expert width 4096 (48 MiB per
  expert in float16, 3 GiB in all), replaying the bundled tiny Mixtral's recording (same 8 x 8 x top-2
  shape, 60 prompt tokens then 63 decode steps of its first request);
- ``olmoe``: OLMoE-1B-7B's dimensions (16 layers x 64 experts, top-8, hidden 2048, expert width 1024),
  replaying the bundled OLMoE trace (299 decode steps; it has no weights, so the router's own);
- ``mixtral-8x7b``: Mixtral-8x7B's layer dimensions (hidden 4096, expert width 14336: 336 MiB per expert)
  on 8 layers, replaying the tiny Mixtral's recording (a GPU with 80 GB; 21 GiB of experts);
- ``small``: the wide model's shape at hidden 256, expert width 512 (256 KiB per expert): its compute is so
  small that the all-resident TPOTs are each implementation's per-token overhead (Python, hooks, kernel
  launches), which is what the engine adds to transformers;
- ``--quick`` (CPU machines without much RAM): the wide model at half the width (hidden 1024, expert width
  2048: 12 MiB per expert, 768 MiB in all) and 24 new tokens.

TPOT here is the median gap between consecutive output tokens (robust to bursts of other work on a shared
machine; the mean is in the JSON). Measured in one run, on one device: the raw rates (the reader pool reading experts, the float32 conversion on
a CPU; pinned memcpy and host -> GPU with CUDA), the data path's own stream rate, the all-resident TPOT of
transformers with each experts implementation it offers (eager, batched_mm, grouped_mm) and of this project's
experts function without the engine, the engine all-resident, then per configuration (budget x policy x
prefetcher): TPOT, TPOT / all-resident, TPOT / transformers' best, bytes moved into the fast tier and the
rate achieved while the link was busy against the raw bound, hit rate, prefetch precision and recall, and
the timed simulator's prediction on the profile `hardware measure` writes for this machine and model
(measured in this run, page cache kept as the runtime reads here), with its error. Every engine run is
checked to produce the tokens of the all-resident engine on the same device and dtype (lossless), which must equal
transformers' run with the project's experts function; the agreement of transformers' own implementations is
reported (bit-identical in float32 on a CPU, not in float16 on a GPU, where their kernels round differently).

``--expert-dtype int8|int4`` packs the same model's experts quantized (group-wise, `pack --expert-dtype`) and
runs the configurations on that pack: a budget is the same share of the float16 experts' memory, so more
quantized experts fit in it (as `generate --fast-budget` counts it), the data path moves the quantized bytes,
and ``--expert-compute`` says how the fast tier computes with them (default: the engine's choice). Lossless is
then against the all-resident engine on the quantized pack (the same stored experts); the agreement of its
tokens with the float16 model's is reported beside the transformers implementations', and the profile and
the simulator's predictions are measured on the quantized pack.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

MODELS = {
    # name: (config class, config kwargs, bundled trace, replay weights)
    "wide": ("MixtralConfig", dict(num_hidden_layers=8, hidden_size=2048, intermediate_size=4096, num_local_experts=8,
                                   num_experts_per_tok=2, num_attention_heads=16, num_key_value_heads=4,
                                   vocab_size=4096, max_position_embeddings=4096), "tiny", "trace"),
    "wide-quick": ("MixtralConfig", dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=2048,
                                         num_local_experts=8, num_experts_per_tok=2, num_attention_heads=8,
                                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=4096),
                   "tiny", "trace"),
    "small": ("MixtralConfig", dict(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_local_experts=8,
                                    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=4096, max_position_embeddings=4096), "tiny", "trace"),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=1024, num_experts=64,
                                  num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16,
                                  vocab_size=50304, max_position_embeddings=4096), "olmoe", "router"),
    "mixtral-8x7b": ("MixtralConfig", dict(num_hidden_layers=8, hidden_size=4096, intermediate_size=14336,
                                           num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
                     "tiny", "trace"),
}
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def build_packed(name: str, expert_dtype: str | None = None) -> Path:
    """The model's pack in the pack cache, built once (random weights, seed 0, float16); its experts stored as
    ``expert_dtype`` (None: float16) in a pack of their own beside it."""
    import torch
    import transformers

    from moe_offload.models.tiny import cache_root
    from moe_offload.runtime.packing import FORMAT_VERSION, MANIFEST, pack_model

    config_class, kwargs, _, _ = MODELS[name]
    target = cache_root() / "benchmarks" / f"{name}-v{FORMAT_VERSION}"
    packed = target / ("packed" if expert_dtype in (None, "float16") else f"packed-{expert_dtype}")
    if (packed / MANIFEST).is_file():
        return packed
    if (target / "model").is_dir():  # the float16 model is there: pack its experts in this dtype
        pack_model(target / "model", packed, expert_dtype=expert_dtype)
        return packed
    print(f"building {name} with random weights into {target} (once)", flush=True)
    config = getattr(transformers, config_class)(**kwargs, dtype="float16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, config.architectures[0] if config.architectures else
                        config_class.replace("Config", "ForCausalLM"))(config).to(torch.float16)
    model.save_pretrained(target / "model")
    del model
    gc.collect()
    pack_model(target / "model", packed, expert_dtype=expert_dtype)
    return packed


def replay_trace(name: str):
    from moe_offload.bundled import BUNDLED_TRACES
    from moe_offload.trace.format import read_trace

    return read_trace(BUNDLED_TRACES[MODELS[name][2]])


def resident_tpots(packed: Path, trace, weights: str, tokens: int, device, dtype, readers, rounds: int,
                   implementations=IMPLEMENTATIONS, expert_compute: str | None = None) -> dict:
    """All-resident TPOT of the plain transformers model (every weight loaded) with each experts implementation
    it offers, of this project's experts function without an engine (``moe_offload``), and of the engine with
    every expert preloaded (``engine``), routing replayed. The runs alternate, ``rounds`` times, and each TPOT
    is the median of all its per-token gaps: a burst of other work on a shared machine then hits every
    implementation alike instead of one. Returns name -> {"tpot_s", "tokens"}; an implementation that fails
    here (no kernel for this device) is left out with a note."""
    import torch

    from moe_offload.models.adapters import load_model
    from moe_offload.models.experts import use_project_experts
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine, TimingStreamer
    from moe_offload.runtime.replay import RoutingReplay

    model, adapter = load_model(packed.parent / "model", dtype=dtype, experts_implementation="eager")
    model.to(device)
    replay = RoutingReplay(trace, adapter, weights)
    replay.install()
    engine = OffloadEngine(make_plan(packed, device=device, replay=trace, replay_weights=weights, fast_budget="100%",
                                     preload=True, readers=readers, expert_compute=expert_compute))
    gaps: dict[str, list] = {}
    tokens_of: dict[str, list] = {}
    failed: set = set()

    def run_plain(implementation: str) -> tuple[list, list]:
        if implementation == "moe_offload":
            use_project_experts(adapter)
        else:
            model.set_experts_implementation(implementation)
        prompt, new = replay.plan(0, tokens)
        ids = torch.tensor([[i % model.config.vocab_size for i in range(prompt)]], device=device)
        streamer = TimingStreamer(None, None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, streamer=streamer, pad_token_id=0)
        times = streamer.token_times
        return [b - a for a, b in zip(times, times[1:])], out[0, prompt:].tolist()

    try:
        for round_ in range(rounds + 1):  # round 0 warms every implementation up
            for implementation in (*dict.fromkeys(("eager", *implementations)), "moe_offload", "engine"):
                if implementation in failed:
                    continue
                try:
                    if implementation == "engine":
                        result = engine.generate_replayed(0, tokens)
                        run = result.stats.token_latency_seconds, result.token_ids
                    else:
                        run = run_plain(implementation)
                except (RuntimeError, NotImplementedError, KeyError) as exc:
                    print(f"  transformers {implementation}: unavailable here ({str(exc).splitlines()[0]})")
                    failed.add(implementation)
                    continue
                if round_:
                    gaps.setdefault(implementation, []).extend(run[0])
                tokens_of[implementation] = run[1]
    finally:
        engine.close()
        replay.remove()
    gc.collect()
    return {name: {"tpot_s": statistics.median(values), "tokens": tokens_of[name]} for name, values in gaps.items()}


def engine_run(packed: Path, trace, weights: str, tokens: int, device, **options) -> dict:
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    with OffloadEngine(make_plan(packed, device=device, replay=trace, replay_weights=weights, **options)) as engine:
        result = engine.generate_replayed(0, tokens)
        counters = engine.counters.copy()
        stats = result.stats
        fast_slots = engine.tiers[0].pool.memory.shape[0]
    fast_link = next((link for link in counters.bytes_per_link if link.endswith("->fast")), None)
    moved = counters.bytes_per_link.get(fast_link, 0) if fast_link else 0
    busy = counters.link_busy_seconds.get(fast_link, 0.0) if fast_link else 0.0
    return {"tokens": result.token_ids, "tpot_s": statistics.median(stats.token_latency_seconds),
            "tpot_mean_s": stats.tpot_seconds, "ttft_s": stats.ttft_seconds,
            "hit_rate": stats.hit_rate, "prefetch_precision": stats.prefetch_precision,
            "prefetch_recall": stats.prefetch_recall, "stall_s": stats.stall_seconds, "bytes_to_fast": moved,
            "link_busy_s": busy, "link_rate": moved / busy if busy else None,
            "on_demand_loads": stats.on_demand_loads, "prefetches_issued": stats.prefetches_issued,
            "fast_slots": fast_slots}


def profile_resident(packed: Path, trace, weights: str, tokens: int, device, readers) -> None:
    """The all-resident engine's replayed generation under the PyTorch profiler: the operators by self time,
    and how much of the wall time no operator accounts for (Python: generate loop, hooks, the engine)."""
    from torch.profiler import ProfilerActivity, profile

    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with OffloadEngine(make_plan(packed, device=device, replay=trace, replay_weights=weights, fast_budget="100%",
                                 preload=True, readers=readers)) as engine:
        engine.generate_replayed(0, tokens)  # warm-up
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            engine.generate_replayed(0, tokens)
        wall = time.perf_counter() - started
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    operators = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"profiled: {wall * 1e3:.0f} ms of wall time, {operators * 1e3:.0f} ms of it in operators (self CPU time), "
          f"{(wall - operators) * 1e3:.0f} ms ({(wall - operators) / wall:.0%}) elsewhere: Python, the generate "
          "loop, hooks, the engine (and the profiler's own cost)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--model", default="wide", choices=sorted(m for m in MODELS if m != "wide-quick"))
    parser.add_argument("--quick", action="store_true", help="the wide model at half width, 24 new tokens, "
                                                             "lru and lcp, none and oracle, 25%% and 50%%")
    parser.add_argument("--budgets", default="25,50")
    parser.add_argument("--policies", default="lru,lcp,fmoe")
    parser.add_argument("--prefetchers", default="none,topk,oracle",
                        help="under replay, prefetchers that read the model's own hidden states (moepic) predict "
                             "the random routers, not the trace: use the oracle and history- or id-based ones")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per run (default: the trace's)")
    parser.add_argument("--readers", type=int, default=None, help="reader threads (default: the runtime's)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the all-resident runs")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                        help="transformers experts implementations to time all-resident (eager is always run: "
                             "its tokens are the reference)")
    parser.add_argument("--oracle-distance", type=int, default=None,
                        help="layers the oracle looks ahead (default: the prefetcher's, 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on a CPU, leaving a core to the readers; as is on CUDA)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the all-resident engine's decode with the PyTorch profiler: where the time goes")
    parser.add_argument("--expert-dtype", default="float16", choices=("float16", "int8", "int4"),
                        help="the experts' stored dtype (default float16; int8/int4: quantized, see the docstring)")
    parser.add_argument("--expert-compute", default=None, choices=("auto", "per-use", "on-arrival", "kernel"),
                        help="how the fast tier computes with int8/int4 experts (default: the engine's choice)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    import torch

    from moe_offload.hardware.profile import HardwareProfile
    from moe_offload.models import quiet_transformers
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.runtime import measure
    from moe_offload.runtime.engine_setup import resolve_device
    from moe_offload.runtime.packing import read_manifest
    from moe_offload.runtime.replay import replay_rows
    from moe_offload.simulator.timed import simulate_timed

    quiet_transformers()
    if args.json:
        check_output(args.json, suffixes=(".json",), what="results")
    device = resolve_device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    name, tokens = args.model, args.tokens
    budgets, policies, prefetchers = args.budgets, args.policies, args.prefetchers
    if args.quick:
        name = "wide-quick" if name == "wide" else name
        tokens = tokens or 24
        budgets, policies, prefetchers = "25,50", "lru,lcp", "none,oracle"
    started = time.perf_counter()
    quantized = args.expert_dtype != "float16"
    packed = build_packed(name, args.expert_dtype)
    manifest = read_manifest(packed)
    trace = replay_trace(name)
    weights = MODELS[name][3]
    stored = getattr(torch, manifest.dtype)
    dtype = torch.float32 if device.type == "cpu" else stored
    print(f"{name}: {manifest.num_layers} layers x {manifest.num_experts} experts, top-{manifest.top_k}, "
          f"{manifest.expert_bytes / 2**20:.1f} MiB per expert ({args.expert_dtype}); compute in "
          f"{str(dtype).removeprefix('torch.')} on {device}; replaying {trace.path} (request 0)", flush=True)

    # 1. raw rates and the data path's stream, then the profile `hardware measure` writes (page cache kept)
    keys = measure.sample_experts(manifest, 16)
    read_rate, convert_rate = measure.measure_raw_rates(manifest, keys, 3, False, args.readers)
    raw = {"parallel_read": read_rate}
    if device.type == "cpu":
        raw["convert"] = convert_rate
    else:
        raw["pinned_copy"] = measure.measure_pinned_copy(manifest.expert_bytes, 3)
        raw["host_to_device"] = measure.measure_host_to_gpu(device, manifest.expert_bytes, 3)[1]
    bound = min(raw["parallel_read"], raw.get("convert") or raw["host_to_device"])
    # on a CPU the read and the conversion run on the same cores, one after the other for each chunk: the rate
    # they can reach together is their harmonic composition, not the smaller of the two (a GPU's copy engine
    # overlaps the copy with the reads, so there min(...) is the bound)
    serial = 1 / (1 / raw["parallel_read"] + 1 / raw["convert"]) if "convert" in raw else bound
    measured = measure.measure_hardware(packed, repeats=3, bypass_page_cache=False, device=device,
                                        readers=args.readers, model_name=name)
    profile = HardwareProfile.from_dict(measured, path="<measured>")
    link = profile.links[-1]
    print("raw rates: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in raw.items())
          + f"; bound min(...) {bound / 1e9:.2f} GB/s"
          + (f", read then convert {serial / 1e9:.2f} GB/s" if device.type == "cpu" else "") + f"; profile link {link.name} {link.bandwidth_bytes_per_s / 1e9:.2f}"
            f" GB/s + {link.latency_s * 1e6:.0f} us, {link.slowdown_while_computing:.3g}x slower while computing; compute "
            f"{profile.compute.slowdown_while_loading:.3g}x slower while loading", flush=True)

    # 2. all-resident: transformers' implementations, this project's function, the engine (alternating)
    resident = resident_tpots(packed, trace, weights, tokens, device, dtype, args.readers, args.rounds,
                              args.implementations.split(","), args.expert_compute)
    for name_, run in resident.items():
        print(f"  {name_:<12} all-resident TPOT {run['tpot_s'] * 1e3:8.2f} ms", flush=True)
    best_name = min((k for k in resident if k in IMPLEMENTATIONS), key=lambda k: resident[k]["tpot_s"])
    best = resident[best_name]["tpot_s"]
    engine_resident = resident.pop("engine")
    # Lossless means: the offloaded engine computes exactly what the all-resident model computes with the same
    # experts function on the same device and dtype. transformers' own implementations agree bit for bit in
    # float32 on a CPU; in float16 on a GPU their kernels round differently, so their tokens are reported.
    # Quantized experts: the reference is the all-resident engine on the same pack; transformers runs the
    # float16 model, so its agreement is what quantizing costs, not a check.
    reference = engine_resident["tokens"]
    if not quantized and resident["moe_offload"]["tokens"] != reference:
        raise SystemExit("LOSSLESS VIOLATION: the all-resident engine's tokens differ from transformers' run with "
                         "the project's experts function")
    agreement = {k: sum(a == b for a, b in zip(v["tokens"], reference)) / len(reference) for k, v in resident.items()}
    print(f"  engine all-resident TPOT {engine_resident['tpot_s'] * 1e3:.2f} ms = "
          f"{engine_resident['tpot_s'] / best:.2f}x transformers' best ({best_name}); tokens equal to the engine's: "
          + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items()), flush=True)

    if args.profile:
        profile_resident(packed, trace, weights, tokens, device, args.readers)

    # 3. the configurations, each beside the timed simulator's prediction on the measured profile
    sim_trace = trace.select(replay_rows(trace, 0, tokens))
    rows = []
    for budget in [int(b) for b in budgets.split(",")]:
        for policy in policies.split(","):
            for prefetch in prefetchers.split(","):
                pf = None if prefetch == "none" else prefetch
                options = {"distance": args.oracle_distance} if pf == "oracle" and args.oracle_distance else None
                run = engine_run(packed, trace, weights, tokens, device, fast_budget=f"{budget}%", policy=policy,
                                 prefetch=pf, prefetch_options=options, readers=args.readers,
                                 expert_compute=args.expert_compute)
                if run["tokens"] != reference:
                    raise SystemExit(f"LOSSLESS VIOLATION: {policy} + {prefetch} at {budget}% changed the tokens")
                # the engine's slots in the budget (more for quantized experts), each moved as its stored bytes
                slots = run.pop("fast_slots")
                predicted = simulate_timed(sim_trace, profile, policy, cache_bytes=slots * manifest.expert_bytes,
                                           expert_bytes=manifest.expert_bytes, prefetcher=pf,
                                           prefetcher_options=options)
                row = {"budget_pct": budget, "policy": policy, "prefetcher": prefetch, "fast_slots": slots,
                       **{k: v for k, v in run.items() if k != "tokens"},
                       "tpot_vs_resident": run["tpot_s"] / engine_resident["tpot_s"],
                       "tpot_vs_transformers_best": run["tpot_s"] / best,
                       "link_utilisation": run["link_rate"] / bound if run["link_rate"] else None,
                       "link_utilisation_of_serial_bound": run["link_rate"] / serial if run["link_rate"] else None,
                       "tpot_predicted_s": predicted.tpot_seconds,
                       "tpot_error": predicted.tpot_seconds / run["tpot_s"] - 1,
                       "hit_rate_predicted": predicted.hit_rate}
                rows.append(row)
                rate = (f"{row['link_rate'] / 1e9:5.2f} GB/s = {row['link_utilisation']:4.0%} of min"
                        + (f", {row['link_utilisation_of_serial_bound']:4.0%} of read+convert" if device.type == "cpu"
                           else "") if row["link_rate"] else "no transfers")
                precision = (f"precision {row['prefetch_precision']:.0%} recall {row['prefetch_recall']:.0%}"
                             if row["prefetch_precision"] is not None else "")
                print(f"{budget:>3}% {policy:<5} {prefetch:<7} TPOT {run['tpot_s'] * 1e3:8.2f} ms "
                      f"({row['tpot_vs_resident']:5.2f}x resident, {row['tpot_vs_transformers_best']:5.2f}x best), "
                      f"{run['bytes_to_fast'] / 1e9:6.2f} GB moved at {rate}, hit {run['hit_rate']:.1%} {precision}; "
                      f"simulator {predicted.tpot_seconds * 1e3:8.2f} ms ({row['tpot_error']:+.0%})", flush=True)
    errors = [abs(r["tpot_error"]) for r in rows]
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores at the end")
    print(f"simulator TPOT error: mean {statistics.mean(errors):.1%}, worst {max(errors):.1%} over {len(rows)} "
          f"configurations; every run's tokens equal the all-resident engine's "
          f"({time.perf_counter() - started:.0f} s)")
    for budget in sorted({r["budget_pct"] for r in rows}):
        for policy in policies.split(","):
            by = {r["prefetcher"]: r for r in rows if r["budget_pct"] == budget and r["policy"] == policy}
            if "oracle" in by and "none" in by:
                print(f"{budget}% {policy}: oracle TPOT / no prefetch {by['oracle']['tpot_s'] / by['none']['tpot_s']:.2f}")
    if args.json:
        write_atomically(args.json, json.dumps({
            "model": name, "expert_dtype": args.expert_dtype, "expert_compute": args.expert_compute,
            "device": str(device), "tokens": tokens, "load_average": load, "raw_rates": raw, "bound": bound, "serial_bound": serial,
            "profile": measured,
            "resident": {k: v["tpot_s"] for k, v in resident.items()}, "transformers_best": best_name,
            "token_agreement_with_engine": agreement,
            "engine_resident_tpot_s": engine_resident["tpot_s"], "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
