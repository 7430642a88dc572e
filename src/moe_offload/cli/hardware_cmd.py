"""`moe-offload hardware`: the hardware presets of the timed simulator, what one profile says, and a profile
measured on this machine."""

from __future__ import annotations

import os
import sys

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.hardware import DEFAULT_PRESET, preset_names, resolve_profile
from moe_offload.values import format_bytes, parse_bytes

DEFAULT_MEASURED = "measured.toml"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "hardware", help="list the hardware presets or show one profile",
        description="Hardware profiles of the timed simulator (`simulate --timed --hardware NAME|FILE`): memory "
                    "tiers, links with bandwidth and latency, and compute costs. See "
                    "src/moe_offload/hardware/profile.py for the file format.")
    actions = parser.add_subparsers(dest="hardware_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="the presets, one line each")
    listing.set_defaults(run=run_list)
    show = actions.add_parser("show", help="one profile in full, with what an expert costs on it",
                              description="Print a preset or a profile file: tiers, links, compute costs, sources, "
                                          "and the time to move and to compute one expert.")
    show.add_argument("profile", metavar="NAME|FILE", help="a preset name or a profile file (.toml)")
    show.add_argument("--expert-bytes", default=None, metavar="BYTES",
                      help="expert size for the worked example (default: the bundled OLMoE trace's)")
    show.set_defaults(run=run_show)
    measure = actions.add_parser(
        "measure", help="micro-benchmark this machine and write a profile for `simulate --timed`",
        description="Time what the runtime does with an expert on this machine (read its file, check and "
                    "convert it, copy it to the GPU, compute it) and the rest of an iteration (attention, "
                    "router, LM head), on a packed model, and write the hardware profile they make. The "
                    "compute costs are the measured model's; the profile's sources say what was measured.")
    measure.add_argument("--model", default="tiny", metavar="tiny|DIR",
                         help="the bundled tiny model (default), a packed directory (`moe-offload pack`) or a "
                              "checkpoint directory (packed into a temporary directory first)")
    measure.add_argument("-o", "--output", default=DEFAULT_MEASURED, metavar="PROFILE.toml",
                         help=f"where to write the profile (default {DEFAULT_MEASURED}); its name is the file's stem")
    measure.add_argument("--repeats", type=int, default=5, metavar="N",
                         help="timed repetitions of every measurement; the profile holds medians (default 5)")
    measure.add_argument("--keep-page-cache", action="store_true",
                         help="read the expert files through the page cache instead of dropping them before "
                              "every read (measures RAM, not the disk, once the files are cached)")
    measure.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    measure.add_argument("--host-budget", default=None, metavar="SIZE|P%",
                         help="CUDA: profile the runtime with a host tier of this budget (gpu, host, ssd): experts, "
                              "a share or bytes with a unit, as generate's --fast-budget")
    measure.add_argument("--threads", type=int, default=None, metavar="N",
                         help="torch CPU threads while measuring (default: torch's, as the runtime runs)")
    measure.set_defaults(run=run_measure)


def _console():
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        out.width = 130  # files and pipes: one line per link and per source
    return out


def _link_summary(profile) -> str:
    from moe_offload.reporting.tables import binary_bytes

    return ", ".join(f"{link.name} {binary_bytes(link.bandwidth_bytes_per_s)}/s" for link in profile.links)


def run_list(args) -> int:
    from rich.table import Table

    from moe_offload.reporting.tables import binary_bytes

    table = Table(title=f"hardware presets (use the name with --hardware; default {DEFAULT_PRESET})",
                  title_justify="left")
    for column in ("name", "tiers", "links", "description"):
        table.add_column(column, style="bold" if column == "name" else None)
    for name in preset_names():
        profile = resolve_profile(name)
        tiers = ", ".join(f"{t.name} {binary_bytes(t.capacity_bytes)}" for t in profile.tiers)
        table.add_row(name + (" (default)" if name == DEFAULT_PRESET else ""), tiers, _link_summary(profile),
                      profile.description)
    _console().print(table)
    return 0


def _print_expert(out, label: str, cost, example: str, expert_bytes: int) -> None:
    """One expert's cost (the GPU's compute or the host's): its form, and its time for 1 and 64 tokens."""
    if cost.expert is not None:
        out.print(f"  {label:<18} {cost.expert.fixed_s * 1e6:.1f} us + {cost.expert.per_token_s * 1e6:.3f} us x n")
    else:
        roof = cost.roofline
        rate = (f"{roof.flops_per_s / 1e12:.1f} TFLOP/s" if roof.flops_per_s >= 1e12  # a measured CPU: GFLOP/s
                else f"{roof.flops_per_s / 1e9:.3g} GFLOP/s")
        out.print(f"  {label:<18} roofline: {rate}, "
                  f"{format_bytes(roof.memory_bandwidth_bytes_per_s)}/s, {roof.bytes_per_param:g} bytes/parameter, "
                  f"+{roof.expert_overhead_s * 1e6:.1f} us")
    out.print(f"  {example}: {cost.expert_seconds(1, expert_bytes) * 1e6:.1f} us for 1 token, "
              f"{cost.expert_seconds(64, expert_bytes) * 1e6:.1f} us for 64")


def run_show(args) -> int:
    from moe_offload.trace.format import read_trace

    profile = resolve_profile(args.profile)
    if args.expert_bytes is not None:
        expert_bytes = parse_bytes(args.expert_bytes, "--expert-bytes")
        example = "an expert"
    else:
        meta = read_trace(DEFAULT_TRACE, columns=()).meta
        expert_bytes, example = meta.expert_bytes, f"an expert of {meta.model}"
    out = _console()
    out.print(f"[bold]{profile.name}[/]  ({profile.path})")
    if profile.description:
        out.print(profile.description, markup=False)  # a profile's text is the user's: "[host]" is not a style
    out.print("tiers, fastest first:")
    for tier in profile.tiers:
        out.print(f"  {tier.name:<8} {format_bytes(tier.capacity_bytes):>10}")
    out.print("links:")
    for link in profile.links:
        out.print(f"  {link.name:<12} {format_bytes(link.bandwidth_bytes_per_s):>10}/s  latency "
                  f"{link.latency_s * 1e6:.1f} us  ({example}, {format_bytes(expert_bytes)}: "
                  f"{link.transfer_seconds(expert_bytes) * 1e3:.3f} ms)"
                  + (f"; {link.slowdown_while_computing:.3g}x slower while compute runs"
                     if link.slowdown_while_computing != 1 else ""))
    compute = profile.compute
    out.print("compute (n = tokens in the iteration):")
    for label, cost in (("attention / layer", compute.attention), ("router / layer", compute.router),
                        ("LM head", compute.lm_head)):
        out.print(f"  {label:<18} {cost.fixed_s * 1e6:.1f} us + {cost.per_token_s * 1e6:.3f} us x n")
    _print_expert(out, "expert", compute, example, expert_bytes)
    if profile.host is not None:
        _print_expert(out, "host expert", profile.host, example, expert_bytes)
        if profile.host.on_compute_device:
            out.print("  the host computes the fast tier's experts too: its experts run after those, no link crossed")
    else:
        out.print("  no [host] compute: no expert can be computed on the host (static placements, fetch-or-compute)",
                  markup=False)
    if compute.slowdown_while_loading != 1:
        out.print(f"  compute runs {compute.slowdown_while_loading:.3g}x slower while a transfer runs")
    for policy, seconds in profile.decision_s:
        out.print(f"  one eviction decision of {policy}: {seconds * 1e6:.1f} us (measured, [decision_s])", markup=False)
    if profile.runtime is not None:  # hardware/profile.py RuntimeChoices: what generate/serve --hardware take
        choices = profile.runtime
        out.print(f"runtime choices on {choices.device} (generate/serve --hardware, where --dtype and "
                  "--expert-compute are not given):")
        for expert_dtype, dtype in choices.dtype.items():
            form = choices.expert_compute.get(expert_dtype)
            out.print(f"  {expert_dtype} experts: --dtype {dtype}" + (f" --expert-compute {form}" if form else ""))
    if profile.sources:
        out.print("sources:")
        for source in profile.sources:
            out.print(f"  - {source}", markup=False)
    return 0


# --------------------------------------------------------------------------------------------------- measure
def _measured_table(m, profile: dict):
    from rich.table import Table

    from moe_offload.reporting.tables import binary_bytes
    from moe_offload.runtime.measure import expert_roofline, sharing

    table = Table(title=f"measured on {m.device_name} ({m.device}, {m.threads} threads, {m.repeats} repeats, "
                        f"{m.elapsed_s:.1f} s, load average up to {m.load_average:.1f} on {m.cores} cores); "
                        "medians, +-: the repeats' largest distance from them", title_justify="left")
    for column in ("what", "measured", "how"):
        table.add_column(column)
    cache = "page cache bypassed" if m.bypass_page_cache else "page cache kept"
    table.add_row("expert through the data path",
                  f"{m.link_seconds * 1e6:.1f} us +-{m.link_deviation:.0%}, alone {m.link_alone_s * 1e6:.1f} us",
                  f"{m.files_sampled} of {m.files_total} experts ({binary_bytes(m.expert_bytes)}) back to back x "
                  f"{m.repeats}, {m.readers} readers, {cache}")
    table.add_row("  raw: parallel read", f"{binary_bytes(m.parallel_read_bandwidth)}/s",
                  "the reader pool reading experts into mapped memory")
    if m.convert_bandwidth:
        table.add_row("  raw: conversion", f"{binary_bytes(m.convert_bandwidth)}/s", f"stored -> {m.compute_dtype}")
    for link in profile["links"]:
        table.add_row(f"link {link['from']}->{link['to']}",
                      f"{binary_bytes(link['bandwidth_bytes_per_s'])}/s + {link['latency_s'] * 1e6:.1f} us",
                      "in the profile" + (" (the data path)" if link["from"] == "ssd" else ""))
    table.add_row("memory read", f"{binary_bytes(m.memory_bandwidth)}/s", f"streaming sum on {m.device}")
    roof = expert_roofline(m)
    table.add_row("expert, 1 / 64 tokens",
                  f"{m.expert_seconds[1] * 1e6:.1f} us +-{m.expert_deviation.get(1, 0.0):.0%} / "
                  f"{m.expert_seconds[64] * 1e6:.1f} us +-{m.expert_deviation.get(64, 0.0):.0%}",
                  f"roofline: +{roof['expert_overhead_s'] * 1e6:.1f} us, {roof['flops_per_s'] / 1e9:.3g} GFLOP/s "
                  f"(peak {m.peak_flops / 1e9:,.4g})")
    for part, label in (("attention", "attention / layer"), ("router", "router / layer"), ("lm_head", "LM head")):
        cost = profile["compute"][part]
        table.add_row(label, f"{cost['fixed_s'] * 1e6:.1f} us + {cost['per_token_s'] * 1e6:.3f} us x n",
                      "skeleton forward, 1..64 tokens")
    if m.decode_step_s is not None:
        table.add_row("decode step, all resident", f"{m.decode_step_s * 1e3:.2f} ms", "the runtime, preloaded")
    if m.decode_step_streaming_s is not None:
        compute_slowdown, link_slowdown = sharing(m)
        table.add_row("  while experts stream", f"{m.decode_step_streaming_s * 1e3:.2f} ms",
                      f"compute {compute_slowdown:.3g}x slower while loading")
        table.add_row("expert streamed while decoding", f"{m.link_seconds_decoding * 1e6:.1f} us",
                      f"the link {link_slowdown:.3g}x slower while computing")
    for tier in profile["tiers"]:
        table.add_row(f"tier {tier['name']}", tier["capacity_bytes"], m.capacity_notes[tier["name"]])
    return table


def _warn_if_busy(threads: int | None) -> None:
    """A loaded machine slows every timing, and torch's thread pool most: its threads wait for each other at
    every operation while other processes hold the cores (tens of milliseconds per operation)."""
    import torch

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load >= cores and (threads or torch.get_num_threads()) > 1:
        print(f"note: the machine is busy (load {load:.1f} on {cores} cores); the timings will include waiting "
              "for the other work, most with several torch threads (try --threads 1)", file=sys.stderr)


def run_measure(args) -> int:
    from moe_offload.models import require_model_stack

    require_model_stack("hardware measure")  # it runs the packed model: before anything imports PyTorch
    from moe_offload.runtime import measure
    from moe_offload.runtime.pack_cache import model_files, packed_directory

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, not {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, not {args.threads}")
    from moe_offload.hardware.toml_writer import write_profile
    from moe_offload.outputs import check_output
    from moe_offload.runtime.engine_setup import resolve_device

    output = check_output(args.output, what="profile", inputs=model_files(args.model))
    resolve_device(args.device)
    packed = packed_directory(args.model)
    check_output(output, what="profile", inputs=model_files(str(packed)))  # the pack made from a checkpoint
    _warn_if_busy(args.threads)
    measurements = measure.measure(packed, repeats=args.repeats, bypass_page_cache=not args.keep_page_cache,
                                   threads=args.threads, model_name=args.model, device=args.device,
                                   host_budget=args.host_budget)
    profile = measure.profile_dict(measurements, name=output.stem)
    command = (f"moe-offload hardware measure --model {args.model} --repeats {args.repeats}"
               + (" --keep-page-cache" if args.keep_page_cache else "")
               + (f" --threads {args.threads}" if args.threads else "")
               + (f" --device {args.device}" if args.device else "")
               + (f" --host-budget {args.host_budget}" if args.host_budget else ""))
    header = (f"Measured on this machine by `{command}` on {measurements.date}.\n"
              "The sources below say what was timed and how; run the command again to refresh the numbers.")
    write_profile(profile, output, header)
    out = _console()
    out.print(_measured_table(measurements, profile))
    for note in measure.measurement_notes(measurements):
        out.print(f"note: {note}", highlight=False)
    out.print(f"profile written to {output} (use it with `moe-offload simulate --timed --hardware {output}`)")
    return 0
