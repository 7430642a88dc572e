"""`moe-offload hardware`: the hardware presets of the timed simulator, and what one profile says."""

from __future__ import annotations

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.hardware import DEFAULT_PRESET, format_bytes, parse_bytes, preset_names, resolve_profile


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


def _console():
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        out.width = 130  # files and pipes: one line per link and per source
    return out


def _link_summary(profile) -> str:
    return ", ".join(f"{link.name} {format_bytes(link.bandwidth_bytes_per_s)}/s" for link in profile.links)


def run_list(args) -> int:
    from rich.table import Table

    table = Table(title=f"hardware presets (use the name with --hardware; default {DEFAULT_PRESET})",
                  title_justify="left")
    for column in ("name", "tiers", "links", "description"):
        table.add_column(column, style="bold" if column == "name" else None)
    for name in preset_names():
        profile = resolve_profile(name)
        tiers = ", ".join(f"{t.name} {format_bytes(t.capacity_bytes)}" for t in profile.tiers)
        table.add_row(name + (" (default)" if name == DEFAULT_PRESET else ""), tiers, _link_summary(profile),
                      profile.description)
    _console().print(table)
    return 0


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
        out.print(profile.description)
    out.print("tiers, fastest first:")
    for tier in profile.tiers:
        out.print(f"  {tier.name:<8} {format_bytes(tier.capacity_bytes):>10}")
    out.print("links:")
    for link in profile.links:
        out.print(f"  {link.name:<12} {format_bytes(link.bandwidth_bytes_per_s):>10}/s  latency "
                  f"{link.latency_s * 1e6:.1f} us  ({example}, {format_bytes(expert_bytes)}: "
                  f"{link.transfer_seconds(expert_bytes) * 1e3:.3f} ms)")
    compute = profile.compute
    out.print("compute (n = tokens in the iteration):")
    for label, cost in (("attention / layer", compute.attention), ("router / layer", compute.router),
                        ("LM head", compute.lm_head)):
        out.print(f"  {label:<18} {cost.fixed_s * 1e6:.1f} us + {cost.per_token_s * 1e6:.3f} us x n")
    if compute.expert is not None:
        out.print(f"  {'expert':<18} {compute.expert.fixed_s * 1e6:.1f} us + "
                  f"{compute.expert.per_token_s * 1e6:.3f} us x n")
    else:
        roof = compute.roofline
        out.print(f"  {'expert':<18} roofline: {roof.flops_per_s / 1e12:.1f} TFLOP/s, "
                  f"{format_bytes(roof.memory_bandwidth_bytes_per_s)}/s, {roof.bytes_per_param:g} bytes/parameter, "
                  f"+{roof.expert_overhead_s * 1e6:.1f} us")
    out.print(f"  {example}: {compute.expert_seconds(1, expert_bytes) * 1e6:.1f} us for 1 token, "
              f"{compute.expert_seconds(64, expert_bytes) * 1e6:.1f} us for 64")
    if profile.sources:
        out.print("sources:")
        for source in profile.sources:
            out.print(f"  - {source}")
    return 0
