"""`moe-offload simulate`: replay traces through eviction policies and compare them with Belady OPT, or with
--timed run them on a hardware profile with prefetchers and report TTFT, TPOT and where the time goes."""

from __future__ import annotations

import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from moe_offload.bundled import DEFAULT_TRACE, DEFAULT_TRACE_NAME, trace_path
from moe_offload.cli.options import (PREFETCH_OPTION, add_expert_bytes, add_fetch_or_compute, add_hardware, add_policy,
                                     add_prefetch, add_replay_runs, add_split, policy_options_of)
from moe_offload.errors import ConfigError
from moe_offload.outputs import check_output, write_atomically
from moe_offload.policies import default_policies, policy_info
from moe_offload.simulator.replay import ENGINES
from moe_offload.trace.format import TraceMeta, read_trace
from moe_offload.values import cache_sizes, integer, jobs, parse_bytes
from moe_offload.values.options import check_options_used, component_options

DEFAULT_CACHE_SIZES = "12.5%,25%,50%"
DEFAULT_TIMED_CACHE_SIZES = "25%"
DEFAULT_TIMED_POLICIES = "lru"
# options of the timed simulation and their defaults: given without --timed they are refused
TIMED_DEFAULTS = {"hardware": None, "prefetch": "none", "prefetch_option": [], "history": None, "expert_bytes": None,
                  "arrivals": "trace", "max_batch": 8, "timed_json": None, "plot_cdf": None, "plot_timeline": None,
                  "timeline_iteration": None, "split_config": None, "reconfigure_every": None, "granularity": 0.01}


def trace_labels(traces: list[str]) -> list[str]:
    """The names the tables and results give the traces: as the command line wrote them (``tiny``, not the
    bundled file's path), as a sweep file's names are kept; the bundled OLMoE trace when none is given."""
    return list(traces) or [DEFAULT_TRACE_NAME]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay traces through eviction policies (table, JSON, plot)",
        description="Replay routing traces through expert-cache eviction policies (access-level demand paging, "
                    "the model of paper 001) and report hits, misses and misses relative to Belady OPT. With "
                    "--timed, run them on a hardware profile with prefetchers (discrete-event timed simulator) "
                    "and report TTFT, TPOT, stalls and traffic, beside an all-resident run and the oracle "
                    "prefetcher.")
    parser.add_argument("traces", nargs="*", metavar="TRACE",
                        help=f"trace files, or 'olmoe' / 'tiny' for the bundled traces (default: olmoe, "
                             f"{DEFAULT_TRACE.name}; tiny is the bundled model's recording with every column)")
    add_policy(parser, many=True, help="comma-separated policy names, or 'all'; see `moe-offload policies` "
                                       f"(default: all; with --timed {DEFAULT_TIMED_POLICIES})")
    parser.add_argument("--cache-size", default=None,
                        help="comma-separated cache sizes: experts (64), a percentage (25%) or a fraction (0.25) of "
                             "all L*J experts, or with --timed bytes with a unit (4GiB, 512MB) "
                             f"(default {DEFAULT_CACHE_SIZES}; with --timed {DEFAULT_TIMED_CACHE_SIZES})"
                             .replace("%", "%%"))  # argparse formats help with %
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="also sweep cache sizes and plot misses against them")
    parser.add_argument("--plot-points", type=int, default=16, metavar="N",
                        help="cache sizes in the plot's sweep, evenly spaced from top-k to L*J (default 16)")
    add_replay_runs(parser, ENGINES, "how the replay runs, never what it finds: 'compiled' runs the policies' "
                                     "Numba kernels (the `fast` extra), 'python' the policy objects, 'auto' (default) "
                                     "the kernel where a policy has one and Numba is installed")
    timed = parser.add_argument_group("timed simulation (--timed)")
    timed.add_argument("--timed", action="store_true",
                       help="run the discrete-event timed simulator instead of the replay")
    add_hardware(timed, "hardware preset or profile file (default desktop-rtx4090; `moe-offload hardware list`)")
    add_prefetch(timed, many=True, help="comma-separated prefetchers, 'none' for demand loading only (default none); "
                                        "the all-resident run and the oracle prefetcher are always added as bounds")
    timed.add_argument("--history", metavar="TRACE",
                       help="past traffic for the prefetchers that learn from it (their fit): a training split")
    add_expert_bytes(timed)
    timed.add_argument("--arrivals", default=TIMED_DEFAULTS["arrivals"], metavar="trace|poisson:RATE|times:T,...",
                       help="the trace's iterations as recorded (default), Poisson arrivals of RATE requests per "
                            "second (seeded by --seed), or the requests' arrival times in seconds; the last two are "
                            "served with continuous batching")
    timed.add_argument("--max-batch", type=int, default=TIMED_DEFAULTS["max_batch"], metavar="N",
                       help="most requests in one iteration when serving arrivals (default 8)")
    timed.add_argument("--timed-json", metavar="FILE", help="also write the timed results as JSON to FILE")
    timed.add_argument("--plot-cdf", metavar="FILE.png", help="plot the CDF of token latency and TTFT")
    timed.add_argument("--plot-timeline", metavar="FILE.png",
                       help="plot one iteration: compute, transfers per link and stalls, layer by layer")
    timed.add_argument("--timeline-iteration", type=int, metavar="N",
                       help="the iteration of the timeline (default: the decode iteration of median duration)")
    add_fetch_or_compute(timed, "compute a missed expert on the host CPU (the profile's [host]) instead of loading "
                                "it when that is predicted faster, per expert and batch (Fiddler's rule)")
    add_split(timed, granularity_default=TIMED_DEFAULTS["granularity"],
              split_help="run MoEpic's split experts as `moe-offload configure --json` chose them: per layer, the top "
                         "segments of cache_size experts cached, split_ratio of an expert each, and a buffer of top-k "
                         "experts for the missing segments (replaces --cache-size)",
              reconfigure_help="MoEpic's online configurator (paper 004, Algorithm 1): rerun the split configuration "
                               "every TAU tokens from the statistics gathered so far and resize the running caches "
                               "(the paper's tau is 5000); starts from --split-config, or from the uniform allocation "
                               "with split ratio 0.5 on each --cache-size (less the buffer of top-k experts)")
    parser.set_defaults(run=run)


def parse_policies(text: str) -> list[str]:
    if text.strip() == "all":
        return default_policies()
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--policy names no policy")
    for name in names:
        policy_info(name)
    return names


def check_components(meta: TraceMeta, policies, options: dict, seed: int, prefetchers=(),
                     prefetch_options: dict | None = None) -> None:
    """Build every policy and prefetcher once with its options, so a bad value is refused before any run."""
    from moe_offload.policies import ModelSpec, make_policy
    from moe_offload.prefetch import make_prefetcher

    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    for policy in policies:
        make_policy(policy, spec, seed=seed, options=options.get(policy))
    for prefetcher in prefetchers:
        make_prefetcher(prefetcher, spec, (prefetch_options or {}).get(prefetcher))


def check_some_run_possible(path: str, meta: TraceMeta, policies: list[str], sizes: list[int]) -> None:
    """Refuse a table in which no policy can run at any size (a -dist policy below one expert per layer):
    there would be nothing to show. Cells that cannot run beside others that can are reported as skipped."""
    from moe_offload.policies import ModelSpec
    from moe_offload.simulator.grid import grid_runs

    runs, skipped = grid_runs(ModelSpec(meta.num_layers, meta.num_experts, meta.top_k), policies, sizes)
    if skipped and not any(policy in policies for policy, _ in runs):
        _, _, why = skipped[0]
        raise ConfigError(f"{path}: --cache-size {','.join(map(str, sizes))}: nothing can run: {why}")


def sweep_sizes(meta: TraceMeta, points) -> list[int]:
    """``points`` cache sizes from top-k to L*J for the plot: at least 2, at most the distinct sizes."""
    distinct = meta.num_expert_slots - meta.top_k + 1
    points = integer(points, "--plot-points", low=2, high=max(2, distinct),
                     why=f"the cache sizes from top-k = {meta.top_k} to all {meta.num_expert_slots:,} experts")
    return sorted({int(round(x)) for x in np.linspace(meta.top_k, meta.num_expert_slots, points)})


def check_outputs(args, inputs: list[str]) -> None:
    """Every file the command will write, checked before it reads or runs anything."""
    from moe_offload.reporting.plots import PLOT_SUFFIXES

    written = []  # no output over another one either
    for flag, suffixes in (("plot", PLOT_SUFFIXES), ("plot_cdf", PLOT_SUFFIXES), ("plot_timeline", PLOT_SUFFIXES),
                           ("timed_json", ())):
        target = getattr(args, flag, None)
        if target:
            check_output(target, inputs=[*inputs, *written], suffixes=suffixes,
                         what=f"--{flag.replace('_', '-')} file")
            written.append(target)


def learned_training_note(trace_path: str, learned_options: dict) -> str | None:
    """A warning when the learned policy's model was trained on (part of) the trace it is evaluated on."""
    from moe_offload.bundled import DEFAULT_LEARNED_MODEL
    from moe_offload.policies.learned_model import load_model

    model = load_model(learned_options.get("model_path") or DEFAULT_LEARNED_MODEL)
    rows = model.rows_trained_on(hashlib.sha256(Path(trace_path).read_bytes()).hexdigest())
    if not rows:
        return None
    return f"learned: its model was trained on rows {', '.join(rows)} of this trace; only the other rows are unseen"


def run(args) -> int:
    if args.timed:
        return run_timed(args)
    given = [name for name, default in TIMED_DEFAULTS.items() if getattr(args, name) != default]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} belongs to the timed simulation: add --timed")
    from moe_offload.simulator.grid import replay_grid
    from moe_offload.simulator.replay import ReplayInput, load_kernels

    args.policy = args.policy or "all"
    args.cache_size = args.cache_size or DEFAULT_CACHE_SIZES
    policies = parse_policies(args.policy)
    options = policy_options_of(args, policies)
    paths = [str(trace_path(name)) for name in args.traces] or [str(DEFAULT_TRACE)]
    check_outputs(args, paths)
    args.jobs, args.seed = jobs(args.jobs), integer(args.seed, "--seed", low=0)
    inputs, plans, traces = [], [], []
    with ThreadPoolExecutor(max_workers=1) as loader:
        kernels = loader.submit(load_kernels, policies, args.engine)  # while the traces are read (replay.py)
        for path in paths:  # read and check everything before the first run
            trace = read_trace(path)
            check_components(trace.meta, policies, options, args.seed)
            table_sizes = cache_sizes(args.cache_size, "--cache-size", trace.meta.num_expert_slots)
            check_some_run_possible(path, trace.meta, policies, table_sizes)
            sizes = sorted(set(table_sizes) | set(sweep_sizes(trace.meta, args.plot_points) if args.plot else ()))
            traces.append(trace)
            plans.append((table_sizes, sizes))
        from moe_offload.reporting.progress import progress_bar  # Rich, while the kernels load

        kernels.result()
    for trace, label in zip(traces, trace_labels(args.traces)):
        inputs.append(ReplayInput.of(trace, name=label, checked=True))  # read_trace checked it
    del traces

    results, skipped, table_results = [], [], []  # skipped: lines saying which table cell cannot run and why
    total = sum(data.requests() * len(sizes) * (len(policies) + ("belady" not in policies))
                for data, (_, sizes) in zip(inputs, plans))
    with progress_bar() as bar:
        task = bar.add_task("replaying requests", total=total)
        for data, (table_sizes, sizes) in zip(inputs, plans):
            grid = replay_grid(data, policies, sizes, seed=args.seed, options=options, jobs=args.jobs,
                               progress=lambda n: bar.advance(task, n), engine=args.engine)
            results += grid.results
            where = f"{data.name}: " if len(inputs) > 1 else ""
            skipped += [f"{where}{policy} at {size}: {why}" for policy, size, why in grid.skipped
                        if size in table_sizes]
            table_results += [r for r in grid.results if r.cache_size in table_sizes]

    if "learned" in policies:
        for data in inputs:
            note = learned_training_note(data.trace.path, options.get("learned", {}))
            if note:
                for result in results:
                    if result.trace == data.name and result.policy == "learned":
                        result.notes.append(note)

    if args.json:
        json.dump([r.to_dict() for r in results], sys.stdout, indent=1)
        sys.stdout.write("\n")
        for line in skipped:  # on stderr, so that stdout stays the JSON document
            print(f"skipped: {line}", file=sys.stderr)
    else:
        from rich.console import Console

        from moe_offload.reporting.tables import print_replay_tables

        out = Console()
        if not out.is_terminal:
            out.width = 110  # files and pipes: wide enough for a table row and its title
        print_replay_tables(table_results, out, skipped=skipped)
    sys.stdout.flush()
    if args.plot:
        from moe_offload.reporting.plots import plot_misses

        print(f"plot written to {plot_misses(results, args.plot)}", file=sys.stderr)
    return 0


def parse_prefetchers(text: str) -> list[str | None]:
    """Prefetcher names; 'none' (no prefetcher) is None."""
    from moe_offload.prefetch import prefetcher_info

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--prefetch names no prefetcher (use 'none' for demand loading only)")
    for name in names:
        if name != "none":
            prefetcher_info(name)
    return list(dict.fromkeys(None if name == "none" else name for name in names))


def run_timed(args) -> int:
    from rich.console import Console

    from moe_offload.hardware import resolve_profile
    from moe_offload.prefetch import check_trace_columns, prefetcher_info
    from moe_offload.reporting.progress import progress_bar
    from moe_offload.reporting.tables import print_timed_tables
    from moe_offload.simulator.split import read_split_config
    from moe_offload.simulator.timed import ORACLE, Arrivals, Reconfiguration, check_timed_run, timed_grid
    from moe_offload.simulator.timed.simulate import timed_runs

    if args.plot:
        raise ConfigError("--plot draws the replay's misses; with --timed use --plot-cdf and --plot-timeline")
    if args.engine != "auto":
        raise ConfigError("--engine chooses how the replay runs; the timed simulator runs the policy objects")
    policies = parse_policies(args.policy or DEFAULT_TIMED_POLICIES)
    options = policy_options_of(args, policies)
    prefetchers = parse_prefetchers(args.prefetch)
    running = [p for p in prefetchers if p is not None] + [ORACLE]  # the oracle always runs, as a bound
    prefetch_options = component_options(args.prefetch_option, "--prefetch-option", PREFETCH_OPTION, "prefetcher",
                                         prefetcher_info)
    check_options_used(prefetch_options, running, "--prefetch-option", "--prefetch")
    paths = [str(trace_path(name)) for name in args.traces] or [str(DEFAULT_TRACE)]
    profile = args.hardware if args.hardware and Path(args.hardware).is_file() else None  # not a preset's name
    check_outputs(args, paths + [trace_path(args.history) if args.history else None, args.split_config, profile])
    args.jobs, args.seed = jobs(args.jobs), integer(args.seed, "--seed", low=0)
    integer(args.max_batch, "--max-batch", low=1)
    hardware = resolve_profile(args.hardware)
    arrivals = Arrivals.parse(args.arrivals, args.max_batch, args.seed)
    learners = [name for name in running if prefetcher_info(name).needs_history]
    if learners and not args.history:
        raise ConfigError(f"--prefetch {learners[0]} predicts from past sequences: give it a training split "
                          "with --history TRACE")
    history = read_trace(args.history) if args.history else None
    if args.split_config and args.cache_size:
        raise ConfigError("--split-config sets the GPU's expert memory layer by layer: leave out --cache-size")
    split = read_split_config(args.split_config) if args.split_config else None
    if args.granularity != TIMED_DEFAULTS["granularity"] and args.reconfigure_every is None:
        raise ConfigError("--granularity belongs to the online configuration: add --reconfigure-every")
    reconfiguration = (Reconfiguration(args.reconfigure_every, args.granularity)
                       if args.reconfigure_every is not None else None)
    plans = []
    for path, label in zip(paths, trace_labels(args.traces)):  # read and check everything before the first run
        trace = read_trace(path)
        check_components(trace.meta, policies, options, args.seed, running, prefetch_options)
        expert_bytes = (parse_bytes(args.expert_bytes, "--expert-bytes") if args.expert_bytes
                        else trace.meta.expert_bytes)
        if not expert_bytes:
            raise ConfigError(f"{path}: the trace's metadata gives no expert size; give --expert-bytes")
        for name in running:
            check_trace_columns(prefetcher_info(name), trace)
        if args.timeline_iteration is not None:
            last = int(np.unique(trace.iteration).size) - 1 if arrivals.kind == "trace" else None
            integer(args.timeline_iteration, "--timeline-iteration", low=0, high=last,
                    why=f"the iterations of {path}" if last is not None else "")
        if split is not None:
            sizes = [split.memory_bytes(trace.meta.top_k, expert_bytes)]
        else:
            sizes = cache_sizes(args.cache_size or DEFAULT_TIMED_CACHE_SIZES, "--cache-size",
                                trace.meta.num_expert_slots, expert_bytes, in_bytes=True)
        for policy in policies:
            for size in sizes:
                check_timed_run(trace, hardware, policy, size, expert_bytes, arrivals, split, args.split_config,
                                reconfiguration, fetch_or_compute=args.fetch_or_compute)
        plans.append((label, trace, expert_bytes, sizes))

    results = []
    runs = sum(len(timed_runs(policies, prefetchers, sizes)) for *_, sizes in plans)
    with progress_bar() as bar:
        task = bar.add_task("timed runs", total=runs)
        for name, trace, expert_bytes, sizes in plans:
            results += timed_grid(trace, hardware, policies, prefetchers, sizes, expert_bytes=expert_bytes,
                                  arrivals=arrivals, seed=args.seed, policy_options=options,
                                  prefetcher_options=prefetch_options, history=history,
                                  timeline_iteration=args.timeline_iteration, name=name, jobs=args.jobs,
                                  progress=lambda: bar.advance(task), split=split, reconfiguration=reconfiguration,
                                  fetch_or_compute=args.fetch_or_compute)
    if "learned" in policies:
        for name, trace, *_ in plans:
            note = learned_training_note(trace.path, options.get("learned", {}))
            for result in results:
                if note and result.trace == name and result.policy == "learned":
                    result.notes.append(note)

    rows = [r.to_dict() for r in results]
    if args.timed_json:
        write_atomically(args.timed_json, json.dumps(rows, indent=1) + "\n")
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        out = Console()
        if not out.is_terminal:
            out.width = 150  # files and pipes: wide enough for a row of the latency table
        print_timed_tables(results, out, hardware=hardware, arrivals=arrivals.describe())
        if args.timed_json:
            out.print(f"timed results written to {args.timed_json}")
    sys.stdout.flush()
    if args.plot_cdf:
        from moe_offload.reporting.plots import plot_latency_cdf

        print(f"latency CDF written to {plot_latency_cdf(results, args.plot_cdf)}", file=sys.stderr)
    if args.plot_timeline:
        from moe_offload.reporting.plots import plot_timeline

        print(f"timeline written to {plot_timeline(results, args.plot_timeline)}", file=sys.stderr)
    return 0
