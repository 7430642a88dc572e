"""TPOT of every eviction policy and prefetcher on the real traces of ../shared/traces, on two hardware presets,
relative to the all-resident bound and to the oracle prefetcher.

    python benchmarks/timed_policies.py [--quick] [--json FILE] [--presets desktop-rtx4090,edge-flashmoe]
        [--cache-fractions 0.25,0.5] [--policies ...] [--prefetchers ...] [--qwen-experiments same_domain_moe]
        [--search-us 21] [--jobs 2]

Workloads (each a history to fit the prefetchers that learn from past traffic, and a held-out trace to run):

* OLMoE-1B-7B, the bundled trace (src/moe_offload/data, converted from
  ../shared/traces/olmoe-1b-7b/decode_299.jsonl): one request of 299 decode steps. History = rows 0:150, run
  = rows 150:299. Rows 0:150 are the rows the shipped learned eviction model was trained on, so the learned
  policy is evaluated on rows it has not seen, like the prefetchers.
* Qwen1.5-MoE-A2.7B, ../shared/traces/qwen1.5-moe-a2.7b: the splits of its manifest.json (default the
  same-domain split ml_moe_1 + ml_moe_2 -> ml_moe_3); each request is a 45-63 token prefill and 128 decode
  steps. Routing only: the expert size is the bf16 size of the model's experts (--qwen-expert-bytes), the
  size the presets' compute costs are written for.

Every (policy, prefetcher, cache size) runs in the timed simulator (moe_offload.simulator.timed) with the
trace's own iterations (batch 1); per workload and preset, the all-resident bound runs once. TPOT / oracle
divides by the oracle prefetcher's TPOT with the same eviction policy and cache, so it isolates what the
prediction loses. Prefetchers that need trace columns the real traces lack (fMoE: router probabilities and
embeddings; MoEpic: next-layer gate predictions) are skipped with the reason.

On 2 cores (--jobs 2) the default run (284 timed runs) takes about 4 minutes, --quick (52) about 1 minute;
MoE-Infinity's prefetcher is the slow one (it proposes every expert of every later layer after each layer).

MoE-Infinity's search time is modelled (default 21 us per search, paper 002's figure for an EAMC of 300
EAMs) rather than measured (moe_offload.prefetch.search_cost), so every number repeats from run to run and
does not depend on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_offload.bundled import DEFAULT_LEARNED_MODEL, DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.hardware import resolve_profile
from moe_offload.policies import policy_info
from moe_offload.policies.learned_model import load_model
from moe_offload.prefetch import PREFETCHERS, check_trace_columns, prefetcher_info, prefetcher_options
from moe_offload.simulator.timed import ALL_RESIDENT, ORACLE, Arrivals, check_timed_run, timed_grid
from moe_offload.simulator.transfers import home_tier
from moe_offload.trace import read_trace
from moe_offload.trace.format import Trace
from moe_offload.trace.importers import import_routes_json
from moe_offload.values import format_bytes

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
QWEN_FOLDER = SHARED_TRACES / "qwen1.5-moe-a2.7b"

PRESETS = ("desktop-rtx4090", "edge-flashmoe")
POLICIES = ("lru", "lfu", "llru", "lcp", "moe-infinity", "learned", "belady")
NO_PREFETCH = "none"
PREFETCHER_NAMES = (NO_PREFETCH, *PREFETCHERS)  # fmoe and moepic are listed so that their skip is reported
CACHE_FRACTIONS = (0.25, 0.5)
QWEN_EXPERIMENTS = ("same_domain_moe",)

# --quick: the classic baseline, the best online policy of the replay and the optimum; no prefetch, the two
# history-based prefetchers and the bound; one cache size. About a quarter of the full run's time.
QUICK_POLICIES = ("lru", "learned", "belady")
QUICK_PREFETCHERS = (NO_PREFETCH, "traced-topk", "moe-infinity", ORACLE)
QUICK_CACHE_FRACTIONS = (0.25,)

# Paper 002, section 8: MoE-Infinity searches an EAMC of 300 EAMs in 21 us.
MOE_INFINITY_SEARCH_SECONDS = 21e-6
# Qwen1.5-MoE-A2.7B (config.json): hidden 2048, moe_intermediate_size 1408; gate, up and down projections in
# bf16. The traces were recorded with a 4-bit build, which changes the weights' size, not the routing.
QWEN_EXPERT_BYTES = 3 * 2048 * 1408 * 2
# The rows of the bundled trace the shipped learned model was trained on (data/NOTICE.md): the history.
OLMOE_HISTORY_ROWS = 150

# Fields of RunResult left out of --json: one iteration's event timeline and every token's gap are large and
# are what `moe-offload simulate --timed --timed-json` is for; the means and percentiles stay.
BULKY_FIELDS = ("timeline", "token_latency_seconds")


@dataclass
class Workload:
    name: str          # short, for tables and JSON
    description: str   # model, what is run and what the prefetchers were fitted on
    trace: Trace       # the held-out trace that is run
    history: Trace     # past traffic for the prefetchers' fit()


def olmoe_workload(console: Console) -> Workload:
    full = read_trace(DEFAULT_TRACE)
    training_rows = load_model(DEFAULT_LEARNED_MODEL).rows_trained_on(
        hashlib.sha256(DEFAULT_TRACE.read_bytes()).hexdigest())
    if any(rows != f"0:{OLMOE_HISTORY_ROWS}" for rows in training_rows):
        console.print(f"note: the learned model was trained on rows {', '.join(training_rows)} of the OLMoE trace, "
                      f"not 0:{OLMOE_HISTORY_ROWS}; on OLMoE its rows are not all held out")
    return Workload(
        name="olmoe",
        description=(f"OLMoE-1B-7B (bundled trace, {full.meta.num_layers}x{full.meta.num_experts} top-"
                     f"{full.meta.top_k}): run rows {OLMOE_HISTORY_ROWS}:{full.num_tokens} (decode), history rows "
                     f"0:{OLMOE_HISTORY_ROWS} of the same request (1 sequence, so MoE-Infinity's EAMC holds one EAM)"),
        trace=full.select(slice(OLMOE_HISTORY_ROWS, None)), history=full.select(slice(0, OLMOE_HISTORY_ROWS)))


def qwen_workloads(experiments: list[str], expert_bytes: int, console: Console) -> list[Workload]:
    manifest_path = QWEN_FOLDER / "manifest.json"
    if not manifest_path.is_file():
        console.print(f"[bold]skipped Qwen1.5-MoE[/]: no manifest at {manifest_path} (the shared traces are not here)")
        return []
    manifest = {e["name"]: e for e in json.loads(manifest_path.read_text())["experiments"]}
    if experiments == ["all"]:
        experiments = list(manifest)
    unknown = [name for name in experiments if name not in manifest]
    if unknown:
        raise ConfigError(f"--qwen-experiments: {', '.join(unknown)} not in {manifest_path}; choose from "
                          f"{', '.join(manifest)}")
    def load(ids: list[str]) -> Trace:
        return import_routes_json([QWEN_FOLDER / f"{group}.json" for group in ids], expert_bytes=expert_bytes)

    precision = " (bf16)" if expert_bytes == QWEN_EXPERT_BYTES else ""
    workloads = []
    for name in experiments:
        split = manifest[name]
        train, test = split["train_ids"], split["test_ids"]
        trace = load(test)
        workloads.append(Workload(
            name=f"qwen:{name}",
            description=(f"Qwen1.5-MoE-A2.7B ({trace.meta.num_layers}x{trace.meta.num_experts} top-{trace.meta.top_k}"
                         f", manifest split {name}): run {'+'.join(test)}, history {'+'.join(train)} "
                         f"({len(train)} sequence(s), so MoE-Infinity's EAMC holds {len(train)} EAM(s)); "
                         f"expert {format_bytes(expert_bytes)}{precision}"),
            trace=trace, history=load(train)))
    return workloads


def cache_experts(fraction: float, trace: Trace) -> int:
    """Whole experts, rounded as the replay rounds a percentage of L*J (cli/simulate_cmd.py)."""
    return max(1, min(round(fraction * trace.meta.num_expert_slots), trace.meta.num_expert_slots))


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f}"


def ratio(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def divide(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def runnable_prefetchers(names: list[str], trace: Trace) -> tuple[list[str | None], list[str]]:
    """The prefetchers this trace can feed (None for no prefetch) and, for the others, why not."""
    runnable, skipped = [], []
    for name in names:
        if name == NO_PREFETCH:
            runnable.append(None)
            continue
        try:
            check_trace_columns(prefetcher_info(name), trace)
        except ConfigError as problem:
            skipped.append(str(problem))
            continue
        runnable.append(name)
    return runnable, skipped


def modelled_search_options(names: list[str | None], search_seconds: float) -> dict[str, dict]:
    """``search_seconds`` for every prefetcher that searches a history (the ones that take the option)."""
    return {name: {"search_seconds": search_seconds} for name in names
            if name is not None and "search_seconds" in prefetcher_options(name)}


def print_scenario_table(console: Console, workload: Workload, preset: str, fraction: float, experts: int,
                         cache_bytes: int, rows: list[dict], all_resident) -> None:
    table = Table(title=f"{workload.name} on {preset}, cache {fraction:.0%} of the experts = {experts} experts "
                        f"({format_bytes(cache_bytes)})",
                  caption=f"all-resident: TPOT {ms(all_resident.tpot_seconds)} ms, TTFT "
                          f"{ms(all_resident.ttft_seconds)} ms; * fastest online pair (offline policies and the "
                          "oracle excluded)",
                  title_justify="left", caption_justify="left")
    for column in ("policy", "prefetcher", "TPOT ms", "TTFT ms", "TPOT / all-resident", "TPOT / oracle",
                   "hit rate", "stall s"):
        table.add_column(column, justify="left" if column in ("policy", "prefetcher") else "right")
    online = [row for row in rows if not row["offline"] and row["prefetcher"] != ORACLE]
    fastest = min(online, key=lambda row: row["tpot_seconds"]) if online else None
    previous_policy = None
    for row in rows:
        if previous_policy is not None and row["policy"] != previous_policy:
            table.add_section()
        previous_policy = row["policy"]
        # a star as well as bold: the mark must survive a pipe or a log file, where rich drops the styles
        cells = [row["policy"] + (" (offline)" if row["offline"] else ""), row["prefetcher"],
                 ms(row["tpot_seconds"]) + (" *" if row is fastest else "  "), ms(row["ttft_seconds"]), ratio(row["tpot_vs_all_resident"]),
                 ratio(row["tpot_vs_oracle"]), f"{row['hit_rate']:.1%}", f"{row['stall_seconds']:.2f}"]
        table.add_row(*cells, style="bold" if row is fastest else None)
    console.print(table)


def print_summary(console: Console, rows: list[dict], prefetchers: list[str]) -> None:
    """One row per scenario: for each prefetcher the geometric mean of TPOT / oracle over the online eviction
    policies; the fastest online pair and how far it is from all-resident and from its oracle; and the
    fastest offline run (Belady, any prefetcher), the limit of this cache size."""
    scenarios = list(dict.fromkeys((r["workload"], r["hardware"], r["cache_fraction"]) for r in rows))
    table = Table(title="summary: TPOT / oracle (same policy), geometric mean over the online eviction policies; "
                        "the fastest online and offline runs",
                  title_justify="left")
    for column in ("workload", "preset, cache", *prefetchers, "fastest online", "/ all-resident", "/ oracle",
                   "offline limit / all-resident"):
        text = column in ("workload", "preset, cache", "fastest online")
        table.add_column(column, justify="left" if text else "right", no_wrap=text or column in prefetchers)
    for scenario in scenarios:
        in_scenario = [r for r in rows if (r["workload"], r["hardware"], r["cache_fraction"]) == scenario]
        cells = []
        for prefetcher in prefetchers:
            ratios = [r["tpot_vs_oracle"] for r in in_scenario
                      if r["prefetcher"] == prefetcher and not r["offline"] and r["tpot_vs_oracle"]]
            cells.append(ratio(math.exp(sum(map(math.log, ratios)) / len(ratios))) if ratios else "-")
        online = [r for r in in_scenario if not r["offline"] and r["prefetcher"] != ORACLE]
        offline = [r for r in in_scenario if r["offline"]]
        best = min(online, key=lambda r: r["tpot_seconds"]) if online else None
        limit = min(offline, key=lambda r: r["tpot_seconds"]) if offline else None
        cells += [f"{best['policy']} + {best['prefetcher']}" if best else "-",
                  ratio(best["tpot_vs_all_resident"]) if best else "-",
                  ratio(best["tpot_vs_oracle"]) if best else "-",
                  ratio(limit["tpot_vs_all_resident"]) if limit else "-"]
        workload, hardware, fraction = scenario
        table.add_row(workload, f"{hardware} {fraction:.0%}", *cells)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer combinations: policies {','.join(QUICK_POLICIES)}, prefetchers "
                             f"{','.join(QUICK_PREFETCHERS)}, cache {','.join(map(str, QUICK_CACHE_FRACTIONS))} "
                             "(options given explicitly still win)")
    parser.add_argument("--json", metavar="FILE", help="also write every run and the settings as JSON to FILE")
    parser.add_argument("--presets", default=",".join(PRESETS), help="hardware presets (default %(default)s)")
    parser.add_argument("--cache-fractions", default=None,
                        help=f"fractions of all expert bytes, in whole experts (default "
                             f"{','.join(map(str, CACHE_FRACTIONS))})")
    parser.add_argument("--policies", default=None, help=f"eviction policies (default {','.join(POLICIES)})")
    parser.add_argument("--prefetchers", default=None,
                        help=f"prefetchers, 'none' for demand loading only (default {','.join(PREFETCHER_NAMES)}); "
                             "the oracle is always added, it is the reference of TPOT / oracle")
    parser.add_argument("--qwen-experiments", default=",".join(QWEN_EXPERIMENTS),
                        help="splits of the Qwen manifest to run, 'all' or 'none' (default %(default)s)")
    parser.add_argument("--qwen-expert-bytes", type=int, default=QWEN_EXPERT_BYTES,
                        help="bytes of one Qwen1.5-MoE expert (default %(default)s: bf16)")
    parser.add_argument("--search-us", type=float, default=MOE_INFINITY_SEARCH_SECONDS * 1e6,
                        help="modelled time of one history search in microseconds (default %(default)g)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="worker processes (default %(default)s); results do not depend on it")
    args = parser.parse_args()

    def listed(text: str | None, default: tuple) -> list[str]:
        return [item.strip() for item in text.split(",") if item.strip()] if text else list(default)

    policies = listed(args.policies, QUICK_POLICIES if args.quick else POLICIES)
    prefetchers = listed(args.prefetchers, QUICK_PREFETCHERS if args.quick else PREFETCHER_NAMES)
    if ORACLE not in prefetchers:
        prefetchers.append(ORACLE)
    try:
        fractions = [float(f) for f in listed(args.cache_fractions, QUICK_CACHE_FRACTIONS if args.quick
                                              else CACHE_FRACTIONS)]
    except ValueError:
        raise ConfigError(f"--cache-fractions {args.cache_fractions!r}: write fractions such as 0.25,0.5") from None
    if any(not 0 < f <= 1 for f in fractions):
        raise ConfigError(f"--cache-fractions must lie in (0, 1], not {fractions}")
    presets = listed(args.presets, PRESETS)
    search_seconds = args.search_us * 1e-6

    console = Console(width=160)
    for name in policies:
        policy_info(name)  # an unknown name fails here, before any run
    for name in prefetchers:
        if name != NO_PREFETCH:
            prefetcher_info(name)
    hardware = {name: resolve_profile(name) for name in presets}

    experiments = [] if args.qwen_experiments == "none" else listed(args.qwen_experiments, QWEN_EXPERIMENTS)
    workloads = [olmoe_workload(console)] + qwen_workloads(experiments, args.qwen_expert_bytes, console)

    console.print(f"[bold]timed simulation, real traces[/]: policies {', '.join(policies)}; prefetchers "
                  f"{', '.join(prefetchers)}; cache {', '.join(f'{f:.0%}' for f in fractions)} of the expert bytes; "
                  f"presets {', '.join(presets)}; the trace's iterations as recorded (batch 1)")
    for workload in workloads:
        console.print(f"  {workload.name}: {workload.description}")
    runnable_of, searching = {}, set()
    for workload in workloads:
        runnable_of[workload.name] = runnable_prefetchers(prefetchers, workload.trace)
        searching |= set(modelled_search_options(runnable_of[workload.name][0], search_seconds))
    notes = []
    if searching:
        notes.append(f"search cost: the prefetchers that search a history ({', '.join(sorted(searching))}) are "
                     f"charged a modelled {args.search_us:g} us per search (paper 002: 21 us for 300 EAMs), not "
                     "the measured CPU time, so the numbers repeat run to run; MoE-Infinity's search sits on "
                     "the inference path (paper 002, Algorithm 1), once after every layer but the last")
    if "learned" in policies:
        notes.append("learned: the shipped model was trained on OLMoE rows 0:150; olmoe runs the held-out rows "
                     "150:299, and on Qwen it is a model of another model's trace (its features, recency and "
                     "frequency, are normalised)")
    notes.append("TTFT: for olmoe the first decode step after the history rows, from a cold cache; for Qwen the "
                 "prompt's prefill")
    for preset, profile in hardware.items():
        for workload in workloads:
            total = workload.trace.meta.num_expert_slots * workload.trace.meta.expert_bytes
            home = home_tier(profile, total)
            if home is not None and home > 1:
                notes.append(f"{preset}, {workload.name}: the experts ({format_bytes(total)}) live in "
                             f"{profile.tiers[home].name}; " + ", ".join(
                                 f"{tier.name} caches {format_bytes(tier.capacity_bytes)}"
                                 for tier in profile.tiers[1:home]))
    for note in notes:
        console.print(f"note: {note}")

    skipped, rows = [], []
    started = time.perf_counter()
    run_count = 0
    for workload in workloads:
        trace = workload.trace
        runnable, refused = runnable_of[workload.name]
        for reason in refused:
            skipped.append(f"{workload.name}: {reason}")
            console.print(f"[bold]skipped[/] on {workload.name}: {reason}")
        options = modelled_search_options(runnable, search_seconds)
        experts_of = {fraction: cache_experts(fraction, trace) for fraction in fractions}
        for preset, profile in hardware.items():
            sizes, fraction_of_size = [], {}
            for fraction, experts in experts_of.items():
                size = experts * trace.meta.expert_bytes
                try:
                    for policy in policies:
                        check_timed_run(trace, profile, policy, size, trace.meta.expert_bytes, Arrivals())
                except ConfigError as problem:
                    skipped.append(f"{workload.name} on {preset} at {fraction:.0%}: {problem}")
                    console.print(f"[bold]skipped[/] {workload.name} on {preset} at {fraction:.0%}: {problem}")
                    continue
                sizes.append(size)
                fraction_of_size[size] = fraction
            if not sizes:
                continue
            scenario_start = time.perf_counter()
            results = timed_grid(trace, profile, policies, runnable, sizes, history=workload.history,
                                 prefetcher_options=options, name=workload.name, jobs=args.jobs)
            run_count += len(results)
            console.print(f"{workload.name} on {preset}: {len(results)} runs in "
                          f"{time.perf_counter() - scenario_start:.1f} s", style="dim")
            all_resident = next(r for r in results if r.policy == ALL_RESIDENT)
            oracle_tpot = {(r.policy, r.cache_bytes): r.tpot_seconds for r in results if r.prefetcher == ORACLE}
            for size in sizes:
                scenario_rows = []
                for result in results:
                    if result.policy == ALL_RESIDENT or result.cache_bytes != size:
                        continue
                    record = {key: value for key, value in result.to_dict().items() if key not in BULKY_FIELDS}
                    record.update(
                        workload=workload.name, cache_fraction=fraction_of_size[size],
                        prefetcher=result.prefetcher or NO_PREFETCH, offline=policy_info(result.policy).offline,
                        all_resident_tpot_seconds=all_resident.tpot_seconds,
                        all_resident_ttft_seconds=all_resident.ttft_seconds,
                        tpot_vs_all_resident=divide(result.tpot_seconds, all_resident.tpot_seconds),
                        tpot_vs_oracle=divide(result.tpot_seconds, oracle_tpot.get((result.policy, size))))
                    scenario_rows.append(record)
                # policies in the order asked for, each with its prefetchers in the order asked for
                order = {name: i for i, name in enumerate(prefetchers)}
                scenario_rows.sort(key=lambda r: (policies.index(r["policy"]), order.get(r["prefetcher"], 99)))
                print_scenario_table(console, workload, preset, fraction_of_size[size], size // trace.meta.expert_bytes,
                                     size, scenario_rows, all_resident)
                rows += scenario_rows
    elapsed = time.perf_counter() - started
    if rows:
        print_summary(console, rows, [p for p in prefetchers if any(r["prefetcher"] == p for r in rows)])
    # the full refusals scroll away above the tables: repeat them in one line each
    not_run = {name: [workload.name for workload in workloads if name not in runnable_of[workload.name][0]]
               for name in prefetchers if name != NO_PREFETCH}
    for name, missing_on in not_run.items():
        if missing_on:
            columns = ", ".join(prefetcher_info(name).requires)
            console.print(f"not run: prefetcher {name} needs trace column(s) {columns}, which "
                          f"{', '.join(missing_on)} lack(s): the real traces record only the selected experts "
                          "(and, for Qwen, their router weights)")
    console.print(f"{run_count} timed runs in {elapsed:.1f} s with {args.jobs} worker process(es)")

    if args.json:
        target = Path(args.json)
        target.parent.mkdir(parents=True, exist_ok=True)
        settings = dict(policies=policies, prefetchers=prefetchers, cache_fractions=fractions, presets=presets,
                        search_seconds=search_seconds, qwen_experiments=experiments,
                        qwen_expert_bytes=args.qwen_expert_bytes, olmoe_history_rows=OLMOE_HISTORY_ROWS,
                        workloads={w.name: w.description for w in workloads}, quick=args.quick)
        target.write_text(json.dumps({"settings": settings, "notes": notes, "skipped": skipped, "runs": rows},
                                     indent=1) + "\n")
        console.print(f"results written to {target}")


if __name__ == "__main__":
    from script import run

    run(main)
