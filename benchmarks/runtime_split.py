"""MoEpic's split in the runtime, with and without its speculative prefetch, against the unsplit runtime at equal
fast memory, on the bundled tiny Mixtral, measured in one run (ratios; the machine may be shared and noisy).

    python benchmarks/runtime_split.py [--budgets 16,32] [--uniform 0.25,0.5] [--prompts 2]
        [--max-new-tokens 16] [--reps 3] [--device cpu|cuda] [--hardware PROFILE] [--threads N] [--json FILE]

For each VRAM budget V_e (experts' worth, `configure --vram-budget`), the split configurations are what
`moe-offload configure tiny --vram-budget V_e --hardware desktop-rtx4090 --json` writes, and, per ratio theta of
``--uniform``, every layer caching round(V_e / L / theta) tops of ratio theta. Each split run's fast memory
(its tops and the buffer of K experts) is the unsplit run's fast budget. Each configuration runs three ways:
split with MoEpic's speculative prefetch (`--prefetch moepic`: Y_i from `configure`'s file, top-k for the
uniform ones, which give no Y), split without prefetching, and unsplit without prefetching; all use LRU and
generate greedily for the same prompts, the three alternating ``--reps`` times (fresh engines, cold fast
memory): TPOT is the median over repetitions of the mean over prompts. Every split run's tokens are checked
against the all-resident model computing with the same split, every unsplit run's against the all-resident
model; the table also says whether the split reference's tokens equal the unsplit model's and its largest
logit difference. Threads: ``--threads`` (default: 1 on a CPU, leaving a core to the readers, as
benchmarks/simulator_fidelity.py does; PyTorch's defaults with CUDA).

Beside each run, the timed simulator's prediction (`simulate --timed`, with and without `--split`) of the same
three runs on the routing the runtime sees (recorded from the unsplit model: the split reference's tokens are the
same where the table says so) and on ``--hardware``: by default this machine measured with the page cache as the
slow tier (`moe-offload hardware measure`, 2 repeats), which every engine is also given, so that MoEpic's Y is
the same in both (the configuration's, else the loads that fit each layer's window).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def configured(budget: int) -> "SplitConfig":  # noqa: F821
    from moe_offload.simulator.split import read_split_config

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "split.json"
        out = subprocess.run([sys.executable, "-m", "moe_offload.cli.main", "configure", "tiny", "--vram-budget",
                              str(budget), "--hardware", "desktop-rtx4090", "--json"], capture_output=True, text=True,
                             check=True).stdout
        path.write_text(out)
        return read_split_config(path)


def uniform(budget: int, theta: float, layers: int, experts: int):
    """Every layer caching round(V_e / L / theta) tops of ratio theta; None when a layer has too few experts."""
    from moe_offload.simulator.split import LayerSplitPlan, SplitConfig

    cached = max(1, round(budget / layers / theta))
    return SplitConfig((LayerSplitPlan(cached, theta),) * layers) if cached <= experts else None


def on_a_thread_of_its_own(fn, *args):
    """``fn(*args)`` on a thread that ends with it. The all-resident reference computes there, so that its
    OpenMP team ends with it: the engines' computing thread keeps the only team while they are timed
    (runtime/cpu_threads.py)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def reference(model, adapter, tokenizer, prompts, max_new_tokens, rows):
    """Tokens and logits of the all-resident model (in the split at ``rows``, or unsplit for None)."""
    import torch

    from moe_offload.models.experts import use_project_experts

    use_project_experts(adapter, None, rows)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, return_dict_in_generate=True, output_logits=True,
                                 pad_token_id=tokenizer.eos_token_id)
        out.append((gen.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in gen.logits]))
    return out


def read_costs(manifest, theta: float, repeats: int = 100) -> tuple[float, float]:
    """Seconds to read a whole expert with the pack's chunk reads, and its bottom at ``theta`` as the split runtime
    reads it (the manifest's byte ranges), from the page cache, on one layer's experts in turn."""
    import torch

    from moe_offload.runtime.split import bottom_ranges
    from moe_offload.runtime.storage import ExpertStore

    store = ExpertStore(manifest)
    intermediate = next(t for t in manifest.tensors if t.name == "down_proj").shape[1]
    runs, nbytes = bottom_ranges(manifest, round(theta * intermediate))
    scratch = torch.empty(manifest.expert_bytes, dtype=torch.uint8).numpy()
    costs = []
    for read in (lambda e: store.read(0, e, lambda a, b: memoryview(scratch[a:b])),
                 lambda e: store.read_runs(0, e, runs, memoryview(scratch[:nbytes]))):
        read(0)
        started = time.perf_counter()
        for i in range(repeats):
            read(i % manifest.num_experts)
        costs.append((time.perf_counter() - started) / repeats)
    store.close()
    return costs[0], costs[1]


def timed(packed, prompts, max_new_tokens, device, **options):
    from moe_offload.plan import make_plan
    from moe_offload.runtime.engine import OffloadEngine

    with OffloadEngine(make_plan(packed, device=device, policy="lru", **options)) as engine:
        results = [engine.generate(prompt, max_new_tokens=max_new_tokens) for prompt in prompts]
        stats = engine.stats
        memory = engine.split.memory_bytes if engine.split else stats.cache_bytes
    prefetch = (stats.prefetches_used, stats.prefetches_issued) if stats.prefetches_issued is not None else None
    return ([r.token_ids for r in results], statistics.mean(r.stats.tpot_seconds for r in results),
            stats.hit_rate, sum(stats.bytes_per_link.values()), memory, prefetch, stats.cache_size)


def predicted(trace, profile, expert_bytes: int, **options) -> dict:
    """The timed simulator's run of ``trace`` on ``profile`` with LRU (``options``: simulate_timed's)."""
    from moe_offload.simulator.timed import simulate_timed

    result = simulate_timed(trace, profile, "lru", expert_bytes=expert_bytes, **options)
    return {"tpot_s": result.tpot_seconds, "hit_rate": result.hit_rate, "prefetches_used": result.prefetches_used,
            "prefetches_issued": result.prefetches_issued}


def hardware_profile(name, packed, threads):
    """``--hardware``'s profile, or this machine measured on ``packed`` with the page cache as the slow tier and
    ``threads`` compute threads (None: PyTorch's)."""
    from moe_offload.hardware import HardwareProfile, resolve_profile
    from moe_offload.runtime.measure import measure_hardware

    if name is not None:
        return resolve_profile(name)
    return HardwareProfile.from_dict(measure_hardware(packed, repeats=2, bypass_page_cache=False, model_name="tiny",
                                                      threads=threads), path="<measured>")


def recorded(model, adapter, tokenizer, prompts, max_new_tokens):
    """The routing of the all-resident (unsplit) model generating greedily for ``prompts``, one at a time."""
    from moe_offload.models.recorder import record
    from moe_offload.text.prompts import Prompt

    return record(model, adapter, tokenizer, [Prompt(p, f"bench:{i}") for i, p in enumerate(prompts)],
                  model_name="moe-offload/tiny-mixtral", max_new_tokens=max_new_tokens, batch_size=1).trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="16,32", help="V_e in experts' worth (of 64)")
    parser.add_argument("--uniform", default="0.25,0.5", help="uniform split ratios to run besides configure's")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hardware", default=None, help="the simulator's and the engines' profile (default: measured)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on a CPU, PyTorch's with CUDA)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from runtime_tpot import benchmark_prompts

    from moe_offload import values
    from moe_offload.bundled import TINY_MODEL_DIR
    from moe_offload.models import quiet_transformers
    from moe_offload.models.adapters import load_model
    from moe_offload.runtime.pack_cache import packed_directory
    from moe_offload.runtime.packing import read_manifest
    from moe_offload.runtime.split import split_rows
    from transformers import AutoTokenizer

    quiet_transformers()
    import torch

    threads = args.threads if args.threads is not None else None if args.device == "cuda" else 1
    if threads is not None:
        # two threads on two cores: every parallel operation of the decode waits while a reader holds a core
        torch.set_num_threads(values.integer(threads, "--threads", low=1, high=values.cores()))
    packed = packed_directory("tiny")
    manifest = read_manifest(packed)
    intermediate = next(t for t in manifest.tensors if t.name == "down_proj").shape[1]
    prompts = benchmark_prompts(args.prompts)
    model, adapter = on_a_thread_of_its_own(load_model, TINY_MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    trace = on_a_thread_of_its_own(recorded, model, adapter, tokenizer, prompts, args.max_new_tokens)
    unsplit_reference = on_a_thread_of_its_own(reference, model, adapter, tokenizer, prompts, args.max_new_tokens,
                                               None)
    started = time.perf_counter()
    profile = hardware_profile(args.hardware, packed, threads)
    print(f"hardware: {profile.name}; link into the fast tier {profile.link_from(1).bandwidth_bytes_per_s / 1e6:.0f} "
          f"MB/s", flush=True)
    timed(packed, prompts[:1], 4, args.device, fast_budget="100%")  # warm-up
    whole_s, bottom_s = read_costs(manifest, 0.5)
    print(f"reads from the page cache: a whole expert {whole_s * 1e3:.3f} ms, its bottom at theta = 0.5 (half the "
          f"bytes) {bottom_s * 1e3:.3f} ms", flush=True)
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        configs = [("configure", configured(budget))]
        configs += [(f"theta={theta}", uniform(budget, float(theta), manifest.num_layers, manifest.num_experts))
                    for theta in args.uniform.split(",")]
        for name, config in configs:
            if config is None:
                print(f"V_e={budget:>3} {name:<11} skipped: it would cache more tops per layer than the layer's "
                      f"{manifest.num_experts} experts", flush=True)
                continue
            split_ref = on_a_thread_of_its_own(reference, model, adapter, tokenizer, prompts, args.max_new_tokens,
                                               split_rows(config, intermediate, name))
            same_tokens = [t for t, _ in split_ref] == [t for t, _ in unsplit_reference]
            logit_gap = max(float((a - b).abs().max()) for (_, la), (_, lb) in zip(split_ref, unsplit_reference)
                            for a, b in zip(la, lb))
            prefetch_tpots, split_tpots, unsplit_tpots = [], [], []
            for _ in range(args.reps):
                tokens, tpot, prefetch_hits, prefetch_bytes, _, (used, issued), _ = timed(
                    packed, prompts, args.max_new_tokens, args.device, fast_budget="100%", split_config=config,
                    prefetch="moepic", hardware=profile)
                if tokens != [t for t, _ in split_ref]:
                    raise SystemExit(f"LOSSLESS VIOLATION: split + moepic {name} at V_e={budget}")
                prefetch_tpots.append(tpot)
                tokens, tpot, split_hits, split_bytes, memory, _, _ = timed(packed, prompts, args.max_new_tokens,
                                                                            args.device, fast_budget="100%",
                                                                            split_config=config, hardware=profile)
                if tokens != [t for t, _ in split_ref]:
                    raise SystemExit(f"LOSSLESS VIOLATION: split {name} at V_e={budget}")
                split_tpots.append(tpot)
                tokens, tpot, unsplit_hits, unsplit_bytes, _, _, slots = timed(
                    packed, prompts, args.max_new_tokens, args.device, fast_budget=f"{memory}B", hardware=profile)
                if tokens != [t for t, _ in unsplit_reference]:
                    raise SystemExit(f"LOSSLESS VIOLATION: unsplit at {memory} bytes")
                unsplit_tpots.append(tpot)
            expert_bytes = manifest.expert_bytes
            simulated = {"split_prefetch": predicted(trace, profile, expert_bytes, split=config, prefetcher="moepic"),
                         "split": predicted(trace, profile, expert_bytes, split=config),
                         "unsplit": predicted(trace, profile, expert_bytes, cache_bytes=slots * expert_bytes)}
            split_tpot, unsplit_tpot = statistics.median(split_tpots), statistics.median(unsplit_tpots)
            prefetch_tpot = statistics.median(prefetch_tpots)
            row = {"vram_budget_experts": budget, "config": name,
                   "cached": [p.cached_experts for p in config.layers],
                   "ratios": [p.split_ratio for p in config.layers], "fast_bytes": memory,
                   "split_prefetch_tpot_s": prefetch_tpot, "split_tpot_s": split_tpot, "unsplit_tpot_s": unsplit_tpot,
                   "split_over_unsplit": split_tpot / unsplit_tpot,
                   "split_prefetch_over_unsplit": prefetch_tpot / unsplit_tpot,
                   "split_prefetch_hit_rate": prefetch_hits, "split_prefetch_bytes_moved": prefetch_bytes,
                   "prefetches_used": used, "prefetches_issued": issued,
                   "split_hit_rate": split_hits, "unsplit_hit_rate": unsplit_hits, "split_bytes_moved": split_bytes,
                   "unsplit_bytes_moved": unsplit_bytes, "reference_tokens_equal_unsplit": same_tokens,
                   "reference_max_logit_difference": logit_gap, "unsplit_slots": slots, "predicted": simulated}
            rows.append(row)
            print(f"V_e={budget:>3} {name:<11} fast {memory / 2**20:6.2f} MiB  TPOT split+moepic "
                  f"{prefetch_tpot * 1e3:6.2f} ms (x{row['split_prefetch_over_unsplit']:.2f}, prefetches used "
                  f"{used}/{issued}, hit {prefetch_hits:.0%}, moved {prefetch_bytes / 2**20:.0f} MiB)  split "
                  f"{split_tpot * 1e3:6.2f} ms  unsplit {unsplit_tpot * 1e3:6.2f} ms  "
                  f"x{row['split_over_unsplit']:.2f}  hit(top) "
                  f"{split_hits:.0%} vs {unsplit_hits:.0%}  moved {split_bytes / 2**20:.0f} vs "
                  f"{unsplit_bytes / 2**20:.0f} MiB  reference: tokens {'=' if same_tokens else '!='} unsplit, "
                  f"max |logit diff| {logit_gap:.2e}", flush=True)
            prefetching = simulated["split_prefetch"]
            print(f"{'':17} predicted: TPOT split+moepic {prefetching['tpot_s'] * 1e3:6.2f} ms (prefetches used "
                  f"{prefetching['prefetches_used']}/{prefetching['prefetches_issued']}, hit "
                  f"{prefetching['hit_rate']:.0%})  split {simulated['split']['tpot_s'] * 1e3:6.2f} ms  unsplit "
                  f"{simulated['unsplit']['tpot_s'] * 1e3:6.2f} ms ({slots} experts)  hit(complete) "
                  f"{simulated['split']['hit_rate']:.0%} vs {simulated['unsplit']['hit_rate']:.0%}", flush=True)
    print(f"\n{len(rows)} configurations x {args.reps} repetitions in {time.perf_counter() - started:.0f} s "
          f"({len(prompts)} prompts x {args.max_new_tokens} tokens, {args.device}); every run lossless")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "prompts": len(prompts), "hardware": profile.name,
                                               "max_new_tokens": args.max_new_tokens, "reps": args.reps}, indent=1))
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
