"""`moe-offload simulate`: replay traces through eviction policies and compare them with Belady OPT."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, policy_info
from moe_offload.trace.format import TraceMeta, read_trace

DEFAULT_CACHE_SIZES = "12.5%,25%,50%"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay traces through eviction policies (table, JSON, plot)",
        description="Replay routing traces through expert-cache eviction policies (access-level demand paging, "
                    "the model of paper 001) and report hits, misses and misses relative to Belady OPT.")
    parser.add_argument("traces", nargs="*", metavar="TRACE",
                        help=f"trace files (default: the bundled OLMoE trace, {DEFAULT_TRACE.name})")
    parser.add_argument("--policy", default="all",
                        help="comma-separated policy names, or 'all' (default); see `moe-offload policies`")
    parser.add_argument("--cache-size", default=DEFAULT_CACHE_SIZES,
                        help="comma-separated cache sizes: experts (64), a percentage (25%%) or a fraction (0.25) of "
                             f"all L*J experts (default {DEFAULT_CACHE_SIZES})")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="also sweep cache sizes and plot misses against them")
    parser.add_argument("--plot-points", type=int, default=16, metavar="N",
                        help="cache sizes in the plot's sweep, evenly spaced from top-k to L*J (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the randomized policies (default 0)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="worker processes (default: up to 2)")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY.NAME=VALUE",
                        help="a policy parameter, e.g. lcp.rho=0.5 or learned.model_path=model.npz (repeatable)")
    parser.set_defaults(run=run)


def parse_policies(text: str) -> list[str]:
    if text.strip() == "all":
        return list(POLICIES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--policy names no policy")
    for name in names:
        policy_info(name)
    return names


def parse_cache_sizes(text: str, meta: TraceMeta) -> list[int]:
    """Experts, percentages or fractions of L*J, resolved for one trace's model."""
    total = meta.num_expert_slots
    sizes = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            if item.endswith("%"):
                size = round(float(item[:-1]) / 100 * total)
            elif any(c in item for c in ".eE"):
                fraction = float(item)
                if not 0 < fraction <= 1:
                    raise ValueError
                size = round(fraction * total)
            else:
                size = int(item)
        except ValueError:
            raise ConfigError(f"--cache-size {item!r} is neither a number of experts, a percentage nor a "
                              "fraction in (0, 1]") from None
        if size < 1:
            raise ConfigError(f"--cache-size {item!r} gives {size} experts for a model with {total}")
        sizes.append(min(size, total))
    if not sizes:
        raise ConfigError("--cache-size names no size")
    return sorted(set(sizes))


def parse_policy_options(items: list[str]) -> dict[str, dict]:
    options: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        policy, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--policy-option {item!r} is not POLICY.NAME=VALUE")
        policy_info(policy)
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value  # a plain string such as a path
        options.setdefault(policy, {})[name.replace("-", "_")] = parsed
    return options


def sweep_sizes(meta: TraceMeta, points: int) -> list[int]:
    if points < 2:
        raise ConfigError("--plot-points must be at least 2")
    return sorted({int(round(x)) for x in np.linspace(meta.top_k, meta.num_expert_slots, points)})


def learned_training_note(trace_path: str, learned_options: dict) -> str | None:
    """A warning when the learned policy's model was trained on (part of) the trace it is evaluated on."""
    from moe_offload.bundled import DEFAULT_LEARNED_MODEL
    from moe_offload.policies.learned_model import load_model

    training = load_model(learned_options.get("model_path") or DEFAULT_LEARNED_MODEL).metadata.get("training", {})
    digest = hashlib.sha256(Path(trace_path).read_bytes()).hexdigest()
    if training.get("trace_sha256") != digest:
        return None
    return (f"learned: its model was trained on rows {training.get('rows', '?')} of this trace; "
            "only the other rows are unseen")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moe_offload.reporting.tables import print_replay_tables
    from moe_offload.simulator.replay import ReplayInput, replay_grid

    policies = parse_policies(args.policy)
    options = parse_policy_options(args.policy_option)
    paths = args.traces or [str(DEFAULT_TRACE)]
    if args.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    inputs, plans = [], []
    for path in paths:  # read and check everything before the first run
        trace = read_trace(path)
        table_sizes = parse_cache_sizes(args.cache_size, trace.meta)
        sizes = sorted(set(table_sizes) | set(sweep_sizes(trace.meta, args.plot_points) if args.plot else ()))
        inputs.append(ReplayInput.of(trace, name=path if args.traces else Path(path).name))
        plans.append((table_sizes, sizes))

    stderr = Console(stderr=True)
    results, skipped, table_results = [], [], []
    total = sum(len(data.sequence) * len(sizes) * (len(policies) + ("belady" not in policies))
                for data, (_, sizes) in zip(inputs, plans))
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
        task = bar.add_task("replaying requests", total=total)
        for data, (table_sizes, sizes) in zip(inputs, plans):
            grid = replay_grid(data, policies, sizes, seed=args.seed, options=options, jobs=args.jobs,
                               progress=lambda n: bar.advance(task, n))
            results += grid.results
            skipped += grid.skipped
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
    else:
        out = Console()
        if not out.is_terminal:
            out.width = 110  # files and pipes: wide enough for a table row and its title
        shown = {r.cache_size for r in table_results}
        print_replay_tables(table_results, out,
                            skipped=[f"{policy} at {size}: {why}" for policy, size, why in skipped if size in shown])
    sys.stdout.flush()
    if args.plot:
        from moe_offload.reporting.plots import plot_misses

        out = plot_misses(results, args.plot)
        stderr.print(f"plot written to {out}")
    return 0
