"""`moe-offload configure`: MoEpic's per-layer VRAM budget, expert split ratio and cache size for a trace."""

from __future__ import annotations

import json
import sys

from moe_offload.cli.options import add_expert_bytes, add_granularity, add_hardware
from moe_offload.errors import ConfigError
from moe_offload.values import expert_amount, format_bytes, integer


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "configure", help="MoEpic's per-layer VRAM budget and expert split ratio for a trace",
        description="Choose, per layer, how much VRAM caches experts, how many experts' top segments are "
                    "cached and which fraction of an expert the top segment is (paper 004, MoEpic: the "
                    "fixed-point divide-and-conquer of Algorithm 1 on the latency model of equations 5-11), "
                    "from the trace's LCP hit rates and next-layer gate prediction accuracy. Needs a trace "
                    "with the gate_prediction column.")
    parser.add_argument("trace", metavar="TRACE",
                        help="trace file with gate_prediction, or 'tiny' (the bundled model's recording)")
    parser.add_argument("--vram-budget", required=True, metavar="EXPERTS|BYTES|FRACTION",
                        help="VRAM for experts (without non-expert weights): a number of full experts (240), bytes "
                             "with a unit (6GB, 5.5GiB) or a fraction (0.25) or percentage (25%%) of all L*J "
                             "experts; the prefetch buffer of top-k experts is taken from it and the rest (V_e) "
                             "caches segments, so the configuration runs at the same budget (`generate "
                             "--fast-budget`)")
    add_hardware(parser, "hardware preset or profile file whose GPU link and compute times give the timings not "
                         "given below (`moe-offload hardware list`)")
    parser.add_argument("--expert-load-ms", type=float, metavar="MS",
                        help="time to load one full expert into VRAM (required without --hardware)")
    parser.add_argument("--expert-compute-ms", type=float, metavar="MS",
                        help="time to compute one expert for a token (required without --hardware)")
    parser.add_argument("--attention-ms", type=float, metavar="MS",
                        help="one layer's attention time (required without --hardware)")
    parser.add_argument("--moe-ms", type=float, metavar="MS",
                        help="one layer's whole MoE module (default: top-k x the expert compute time; more with "
                             "shared experts)")
    parser.add_argument("--head-ms", type=float, metavar="MS",
                        help="LM head time, which opens layer 0's prefetch window (default: the hardware's, else "
                             "0; layer 0 is predicted from the previous token's last layer when the trace has "
                             "next_token_gate_prediction)")
    add_expert_bytes(parser, "bytes of one expert, for budgets in bytes (default: the trace's metadata)")
    add_granularity(parser)
    parser.add_argument("--lcp-omega", type=float, default=128.0, metavar="OMEGA",
                        help="LCP observation window of the measured cache (default 128)")
    parser.add_argument("--lcp-rho", type=float, default=0.25, metavar="RHO",
                        help="LCP balance of frequency and recency (default 0.25)")
    parser.add_argument("--json", action="store_true",
                        help="print the configuration as JSON (`simulate --timed --split-config FILE` runs it)")
    parser.set_defaults(run=run)


def timings_from_args(args, top_k: int, expert_bytes: int | None):
    """The timings given in milliseconds; those not given come from --hardware: one token's expert, attention
    and LM head times and the GPU link's transfer time of one expert (timings_from_profile)."""
    from moe_offload.simulator.configurator import Timings, timings_from_profile

    given = {"expert_load": args.expert_load_ms, "expert_compute": args.expert_compute_ms,
             "attention": args.attention_ms, "moe": args.moe_ms, "head": args.head_ms}
    if args.hardware is not None:
        from moe_offload.hardware import resolve_profile

        hardware = resolve_profile(args.hardware)
        if not expert_bytes:
            raise ConfigError(f"--hardware {args.hardware}: the load and compute times of an expert depend on its "
                              "size, which the trace does not give: add --expert-bytes")
        derived = timings_from_profile(hardware, expert_bytes, top_k)
        seconds = {name: getattr(derived, name) if value is None else value / 1e3 for name, value in given.items()}
        if args.moe_ms is None:  # K times the expert time actually used, given or derived
            seconds["moe"] = top_k * seconds["expert_compute"]
        return Timings(**seconds)
    missing = [flag for flag, value in (("--expert-load-ms", args.expert_load_ms),
                                        ("--expert-compute-ms", args.expert_compute_ms),
                                        ("--attention-ms", args.attention_ms)) if value is None]
    if missing:
        raise ConfigError(f"configure needs the hardware's timings: give {', '.join(missing)}, or --hardware")
    moe_ms = top_k * args.expert_compute_ms if args.moe_ms is None else args.moe_ms
    head_ms = 0.0 if args.head_ms is None else args.head_ms
    return Timings(expert_load=args.expert_load_ms / 1e3, expert_compute=args.expert_compute_ms / 1e3,
                   attention=args.attention_ms / 1e3, moe=moe_ms / 1e3, head=head_ms / 1e3)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from moe_offload.simulator.configurator import check_inputs, configure, measure_statistics, require_gate_prediction
    from moe_offload.trace.format import read_trace

    trace = read_trace(args.trace, columns=("gate_prediction", "next_token_gate_prediction"))
    meta = trace.meta
    require_gate_prediction(trace)
    expert_bytes = integer(args.expert_bytes, "--expert-bytes", low=1) if args.expert_bytes is not None \
        else meta.expert_bytes
    vram = expert_amount(args.vram_budget, "--vram-budget", meta.num_expert_slots, expert_bytes)
    # The split run holds the prefetch buffer (U_b, K whole experts) beside the cached tops in the same VRAM
    # (simulator/split.py): V_e is what remains, so that the budget configured is the budget run.
    budget = vram - meta.top_k
    if budget <= 0:
        raise ConfigError(f"--vram-budget {args.vram_budget!r}: {vram:g} experts leave nothing to cache beside the "
                          f"prefetch buffer of top-k = {meta.top_k} experts; give more than {meta.top_k}")
    timings = timings_from_args(args, meta.top_k, expert_bytes)
    check_inputs(timings, budget, args.granularity, meta.num_layers, meta.num_experts, meta.top_k)

    stderr = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
        task = bar.add_task("replaying LCP caches", total=trace.num_tokens)
        stats = measure_statistics(trace, omega=args.lcp_omega, rho=args.lcp_rho,
                                   progress=lambda tokens: bar.advance(task, tokens))
    config = configure(stats, timings, budget, args.granularity)
    notes = ["latencies are MoEpic's model (equations 5-7 with alpha + beta theta ~ m), not a simulation"]
    if not stats.predicted[0]:
        notes.insert(0, "layer 0 is configured without prefetching: the trace has no next_token_gate_prediction "
                        "(the paper predicts layer 0 from the previous token's last layer), or no decode token")

    if args.json:
        document = {"trace": args.trace, "hardware": args.hardware, "model": meta.model,
                    "num_layers": meta.num_layers,
                    "num_experts": meta.num_experts, "top_k": meta.top_k, "tokens": stats.num_tokens,
                    "vram_budget_experts": vram, "buffer_experts": meta.top_k,
                    "expert_bytes": expert_bytes,
                    "timings_seconds": {name: getattr(timings, name) for name in
                                        ("expert_load", "expert_compute", "attention", "moe", "head")},
                    **config.to_dict(), "notes": notes}
        for layer in document["layers"]:
            layer["budget_bytes"] = round(layer["budget"] * expert_bytes) if expert_bytes else None
        json.dump(document, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0

    from rich.table import Table

    out = Console()
    if not out.is_terminal:
        out.width = 120
    bytes_text = f" ({format_bytes(vram * expert_bytes)})" if expert_bytes else ""
    table = Table(title=f"{args.trace}  -  MoEpic configuration for {vram:,.2f} experts of VRAM{bytes_text}: "
                        f"{budget:,.2f} cache segments, {meta.top_k} are the prefetch buffer, "
                        f"zeta = {args.granularity:g}", title_justify="left")
    for column in ("layer", "VRAM experts", "theta", "cached C", "hit rate", "prefetch Y", "loaded m",
                   "window ms", "exposed ms"):
        table.add_column(column, justify="right")
    for index, split in enumerate(config.layers):
        table.add_row(str(index), f"{split.budget:.2f}", f"{split.split_ratio:.3f}", str(split.cache_size),
                      f"{split.hit_rate:.2%}", str(split.prefetches), f"{split.loaded:.2f} / {meta.top_k}",
                      f"{split.window * 1e3:.3f}", f"{split.exposed * 1e3:.3f}")
    out.print(table)
    out.print("theta: the cached top segment's share of an expert; cached C: experts whose top segment stays in "
              "VRAM (theta C = VRAM); hit rate: H(C) under LCP; prefetch Y: predicted experts whose missing "
              "segment loads within the window; loaded m: activated experts in VRAM when the layer is routed")
    out.print(f"exposed loading latency per token: {config.total_exposed * 1e3:.3f} ms after {config.moves} "
              f"budget moves (uniform allocation: {config.uniform_total_exposed * 1e3:.3f} ms); "
              f"statistics of {stats.num_tokens:,} tokens")
    for note in notes:
        out.print(f"note: {note}")
    return 0
