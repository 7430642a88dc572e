"""`moe-offload report`: is a trace's expert cache limited by its policy or by its working set, what would
the alternatives give on a hardware profile, and what to run (reporting/report.py); terminal and HTML."""

from __future__ import annotations

from pathlib import Path

from moe_offload.cli.options import add_expert_bytes, add_hardware, add_replay_runs
from moe_offload.errors import ConfigError
from moe_offload.trace.counts import is_counts_file

HTML_SUFFIXES = (".html", ".htm")
# rows of the trace the timed simulator runs (reporting/latency.py): about 20 s of its runs for 32 layers
DEFAULT_TIMED_TOKENS = 1024


def register(subparsers) -> None:
    from moe_offload.hardware import DEFAULT_PRESET
    from moe_offload.reporting.bound import MIN_SAMPLE_RATE, PYTHON_REPLAY_REQUESTS, REPLAY_SAMPLE_ABOVE, SAMPLE_ABOVE
    from moe_offload.simulator.replay import ENGINES

    parser = subparsers.add_parser(
        "report", help="policy or working set? one trace and one budget of fast memory, answered on one page",
        description="Answer, for a routing trace and a budget of fast memory, whether the expert cache's misses are "
                    "the policy's or the working set's: distinct experts per layer over sliding windows, reuse "
                    "distances and skew against the budget; Belady's hit rate at the budget, the budget it needs "
                    "for 50/80/90% hits, every online policy beside it, and a one-sentence verdict; the timed "
                    "simulator's TTFT and TPOT on a hardware profile for the best policies with the prefetchers "
                    "the trace's columns allow, and MoEpic's split; and the `generate`/`serve` options to run. "
                    "Printed, and with -o written as a self-contained HTML page.")
    parser.add_argument("trace", metavar="TRACE",
                        help="trace file, or 'olmoe' / 'tiny' for the bundled traces; or a table of expert counts "
                             "(.csv, .json, .npy, SGLang's .pt dump) for the static answers only")
    parser.add_argument("--fast-memory", required=True, metavar="SIZE",
                        help="the fast tier's room for experts: a number of experts (64), a percentage (25%%) or "
                             "fraction (0.25) of all L*J experts, or bytes with a unit (4GiB)")
    add_hardware(parser, f"hardware preset or profile file of the latency section (default {DEFAULT_PRESET}; "
                         "`moe-offload hardware list`)", default=DEFAULT_PRESET)
    parser.add_argument("-o", "--output", metavar="FILE.html", help="also write the report as an HTML page")
    add_expert_bytes(parser, "bytes of one expert (default: the trace's metadata; without either, no latency)")
    parser.add_argument("--timed-tokens", default=str(DEFAULT_TIMED_TOKENS), metavar="N",
                        help=f"the timed simulator runs the trace's first whole iterations up to N rows (default "
                             f"{DEFAULT_TIMED_TOKENS}); the replay runs the whole trace, or, for the policies "
                             f"without a compiled kernel, its first {PYTHON_REPLAY_REQUESTS:,} expert requests "
                             "(all with --exact)")
    add_replay_runs(parser, ENGINES, "how the replay runs (as `simulate --engine`); never what it finds",
                    engine_flag="--replay-engine")
    parser.add_argument("--sample-above", default=str(SAMPLE_ABOVE), metavar="N",
                        help=f"above N expert requests (default {SAMPLE_ABOVE:,}), OPT's hit rate at every size is "
                             f"measured on a sample of the experts (N / requests of them, at least "
                             f"{MIN_SAMPLE_RATE:.0%}) and its sizes are estimates, said so with their error at the "
                             "budget; every replay at the budget stays exact".replace("%", "%%"))
    parser.add_argument("--replay-sample-above", default=str(REPLAY_SAMPLE_ABOVE), metavar="N",
                        help=f"above N expert requests (default {REPLAY_SAMPLE_ABOVE:,}), every replay at the budget "
                             "too runs on a sample of the experts (at the rate --sample-above gives), with the budget "
                             "scaled, in memory that does not grow with the trace; the report states LRU's error "
                             "there against its exact hit rate")
    parser.add_argument("--exact", action="store_true",
                        help="never sample: OPT's curve and every replay from every request, however long the "
                             "trace, the policies without a compiled kernel too (learned's Python replay: hours on "
                             "a day of traffic)")
    parser.add_argument("--engine", default="all", metavar="ENGINE",
                        help="the serving engine whose settings to score on the held-out traffic: llama.cpp, "
                             "ktransformers, vllm, sglang or all (default all)")
    parser.add_argument("--profile", metavar="TRACE",
                        help="the traffic that chooses the engines' placements (default: the trace's first half of "
                             "requests chooses and the second half scores)")
    parser.set_defaults(run=run)


def fast_memory_experts(value: str, total: int, top_k: int, expert_bytes: int | None) -> int:
    """--fast-memory as whole experts: a count, share or fraction as `simulate --cache-size` rounds it, bytes
    as the whole experts they hold."""
    from moe_offload.values import cache_sizes, expert_amount, is_byte_size

    if "," in str(value):
        raise ConfigError(f"--fast-memory {value!r}: give one size (the report is of one budget)")
    if is_byte_size(str(value)):
        experts = int(expert_amount(value, "--fast-memory", total, expert_bytes))
    else:
        experts = cache_sizes(value, "--fast-memory", total)[0]
    if experts < top_k:
        raise ConfigError(f"--fast-memory {value!r} holds {experts} experts, fewer than top-k = {top_k}: one "
                          "layer's selected experts could not be resident together")
    return experts


def run(args) -> int:
    from rich.console import Console

    from moe_offload.bundled import trace_path
    from moe_offload.cli.simulate_cmd import learned_training_note
    from moe_offload.engines import engine_names
    from moe_offload.engines.heldout import check_profile
    from moe_offload.hardware import resolve_profile
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.reporting.report import build_report, print_report
    from moe_offload.simulator.replay import ReplayInput
    from moe_offload.simulator.timed import Arrivals, check_timed_run
    from moe_offload.trace.format import read_trace
    from moe_offload.values import integer, jobs, parse_bytes

    if is_counts_file(args.trace):
        return run_counts(args)
    path = trace_path(args.trace)
    if args.output:
        check_output(args.output, inputs=[path], suffixes=HTML_SUFFIXES, what="report")
    seed = integer(args.seed, "--seed", low=0)
    workers = jobs(args.jobs)
    timed_tokens = integer(args.timed_tokens, "--timed-tokens", low=1)
    sample_above = None if args.exact else integer(args.sample_above, "--sample-above", low=1)
    replay_sample_above = None if args.exact else integer(args.replay_sample_above, "--replay-sample-above", low=1)
    hardware = resolve_profile(args.hardware)
    engines = engine_names(args.engine)
    profile = read_trace(trace_path(args.profile)) if args.profile else None
    trace = read_trace(path)
    if profile is not None:
        check_profile(trace, profile, args.profile)
    meta = trace.meta
    expert_bytes = parse_bytes(args.expert_bytes, "--expert-bytes") if args.expert_bytes else meta.expert_bytes
    cache_size = fast_memory_experts(args.fast_memory, meta.num_expert_slots, meta.top_k, expert_bytes)
    if expert_bytes:  # the budget must fit the GPU the latency runs on, before any run
        check_timed_run(trace, hardware, "lru", cache_size * expert_bytes, expert_bytes, Arrivals())

    stderr = Console(stderr=True)
    step = (lambda text: stderr.print(f"[dim]{text}...[/]")) if stderr.is_terminal else None
    name = args.trace if Path(args.trace) == path else path.name
    if args.output:  # the figures' library loads on a side thread while the replays keep both cores busy
        from concurrent.futures import ThreadPoolExecutor

        from moe_offload.reporting.html import load_pyplot

        side = ThreadPoolExecutor(max_workers=1)
        side.submit(load_pyplot)  # a failure shows again, with its message, where the figures are drawn
        side.shutdown(wait=False)
    report = build_report(ReplayInput.of(trace, name=name, checked=True), args.trace, cache_size, hardware, expert_bytes,
                          seed=seed, jobs=workers, engine=args.replay_engine, timed_tokens=timed_tokens, step=step,
                          engines=engines, profile=profile, profile_name=args.profile, fast_memory=args.fast_memory,
                          sample_above=sample_above, replay_sample_above=replay_sample_above,
                          python_prefix=not args.exact)
    if report.bound.result("learned") is not None:
        note = learned_training_note(str(path), {})
        if note:
            report.notes.append(note)
    out = Console()
    if not out.is_terminal:
        out.width = 120  # files and pipes: wide enough for the tables
    print_report(report, out)
    if args.output:
        from moe_offload.reporting.html import render_html

        write_atomically(args.output, render_html(report))
        out.print(f"report written to {args.output}")
    return 0


def run_counts(args) -> int:
    """The report of a counts-only table: its static answers (reporting/counts_report.py)."""
    from rich.console import Console

    from moe_offload.reporting.counts_report import print_counts_report
    from moe_offload.trace.counts import read_counts
    from moe_offload.values import parse_bytes

    if args.output:
        raise ConfigError(f"-o {args.output}: the HTML page is of a full trace's report; a table of expert counts "
                          "prints its static answers only")
    counts = read_counts(args.trace)
    expert_bytes = parse_bytes(args.expert_bytes, "--expert-bytes") if args.expert_bytes else None
    cache_size = fast_memory_experts(args.fast_memory, counts.num_expert_slots, 1, expert_bytes)
    out = Console()
    if not out.is_terminal:
        out.width = 120
    print_counts_report(counts, args.trace, cache_size, out)
    return 0
