"""`moe-offload placement`: the best setting of one engine at a budget, as the flags to pass it or the file it
reads (reporting/on_engine.py scores the settings, as `report` does, on traffic the placement never saw)."""

from __future__ import annotations

import json

from moe_offload.cli.options import add_expert_bytes, add_hardware
from moe_offload.errors import ConfigError

SUFFIXES = (".pt", ".json")


def register(subparsers) -> None:
    from moe_offload.cli.report_cmd import DEFAULT_TIMED_TOKENS
    from moe_offload.hardware import DEFAULT_PRESET

    parser = subparsers.add_parser(
        "placement", help="the best setting of llama.cpp, KTransformers, vLLM or SGLang at a budget: flags or file",
        description="Score every setting ENGINE can express at the budget on the held-out traffic (the first half "
                    "of the requests chooses, the second half scores; --profile chooses instead), as `report` does, "
                    "and print the best one's command line. With -o FILE.pt write the activation counts "
                    "KTransformers' frequency strategy reads (--init-expert-location); with -o FILE.json the flags "
                    "and the experts each layer keeps in fast memory.")
    parser.add_argument("trace", metavar="TRACE", help="trace file, or 'olmoe' / 'tiny' for the bundled traces")
    parser.add_argument("--engine", required=True, metavar="ENGINE",
                        help="llama.cpp, ktransformers, vllm or sglang")
    parser.add_argument("--fast-memory", required=True, metavar="SIZE",
                        help="the GPU's room for experts: a number of experts, a percentage or fraction of all "
                             "experts, or bytes with a unit (4GiB)")
    add_hardware(parser, f"hardware preset or profile file the settings are timed on (default {DEFAULT_PRESET})",
                 default=DEFAULT_PRESET)
    parser.add_argument("--profile", metavar="TRACE", help="the traffic that chooses the placements")
    add_expert_bytes(parser)
    parser.add_argument("--timed-tokens", default=str(DEFAULT_TIMED_TOKENS), metavar="N",
                        help=f"rows of the scored traffic the timed runs replay (default {DEFAULT_TIMED_TOKENS})")
    parser.add_argument("--seed", default="0", help="seed of the randomized policies (default 0)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write FILE.pt (KTransformers' counts) or FILE.json")
    parser.set_defaults(run=run)


def neutral_document(engine: str, command: str, setting, num_layers: int, num_experts: int) -> dict:
    """The setting as JSON: its flags and, per layer, the experts it keeps in fast memory (a dynamic cache keeps
    none from the start)."""
    layers = [[] for _ in range(num_layers)]
    for key in setting.resident:
        layers[key // num_experts].append(key % num_experts)
    return {"engine": engine, "setting": setting.label, "command": command, "flags": setting.flags,
            "resident_experts_per_layer": layers}


def run(args) -> int:
    from pathlib import Path

    from moe_offload.bundled import trace_path
    from moe_offload.cli.report_cmd import fast_memory_experts
    from moe_offload.engines import ENGINES, engine_names
    from moe_offload.hardware import resolve_profile
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.reporting.on_engine import command_line, measure_on_engine, no_timed_setting, untimed_lines
    from moe_offload.simulator.timed import Arrivals, check_timed_run
    from moe_offload.trace.format import read_trace
    from moe_offload.values import integer, parse_bytes

    if args.engine == "all":
        raise ConfigError("--engine all: `placement` writes one engine's setting; name one of llama.cpp, "
                          "ktransformers, vllm, sglang")
    engine = engine_names(args.engine)[0]
    path = trace_path(args.trace)
    if args.output:
        check_output(args.output, inputs=[path], suffixes=SUFFIXES, what="placement")
        if Path(args.output).suffix == ".pt" and not ENGINES[engine].reads_files:
            raise ConfigError(f"-o {args.output}: no {engine} setting reads a file; write FILE.json for the best "
                              "one's flags and resident experts")
    seed = integer(args.seed, "--seed", low=0)
    timed_tokens = integer(args.timed_tokens, "--timed-tokens", low=1)
    hardware = resolve_profile(args.hardware)
    profile = read_trace(trace_path(args.profile)) if args.profile else None
    trace = read_trace(path)
    meta = trace.meta
    expert_bytes = parse_bytes(args.expert_bytes, "--expert-bytes") if args.expert_bytes else meta.expert_bytes
    if not expert_bytes:
        raise ConfigError(f"{path}: the trace's metadata gives no expert size, which the settings are timed with: "
                          "give --expert-bytes")
    cache_size = fast_memory_experts(args.fast_memory, meta.num_expert_slots, meta.top_k, expert_bytes)
    check_timed_run(trace, hardware, "lru", cache_size * expert_bytes, expert_bytes, Arrivals())
    on_engine = measure_on_engine(trace, hardware, cache_size, expert_bytes, [engine], None, profile=profile,
                                  profile_name=args.profile, timed_tokens=timed_tokens, seed=seed)
    section = on_engine.engines[0]
    best = section.best
    untimed = untimed_lines(section)
    if best is None:
        raise ConfigError(no_timed_setting(section, cache_size) + "".join(f"; {line}" for line in untimed))
    line = command_line(section, best)
    timed = sum(entry.result is not None for entry in section.scores)
    print(f"# {engine} at {cache_size:,} experts: {best.setting.label}, the least TPOT of "
          f"{timed} setting{'s' if timed != 1 else ''} timed on {hardware.name} ({on_engine.split})")
    for reason in untimed:
        print(f"# {reason}")
    print(line)
    if args.output:
        if Path(args.output).suffix == ".pt":
            if best.setting.export is None:
                raise ConfigError(f"-o {args.output}: {engine}'s best setting here ({best.setting.label}) reads no "
                                  "file; write FILE.json for its flags and resident experts")
            best.setting.export(args.output)
        else:
            document = neutral_document(engine, line, best.setting, meta.num_layers, meta.num_experts)
            write_atomically(args.output, json.dumps(document, indent=1) + "\n")
        print(f"written to {args.output}")
    return 0
