"""`moe-offload train-eviction`: train FlashMoE's learned eviction network (paper 003) on traces."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_offload.errors import ConfigError

DEFAULT_CACHE_SIZES = "6.25%,12.5%,25%,50%"  # 64, 128, 256, 512 of OLMoE's 1,024 experts


def register(subparsers) -> None:
    from moe_offload.policies.learned_model import TARGETS

    parser = subparsers.add_parser(
        "train-eviction",
        help="train the learned eviction policy (paper 003) from Belady's decisions on traces",
        description="Replay the training rows of each TRACE with Belady's OPT at each cache size, learn to rank "
                    "every resident expert by its next request from its recency and frequency (FlashMoE, paper "
                    "003), and write the network to MODEL.npz (use it with `moe-offload simulate --policy learned "
                    "--policy-option learned.model_path=MODEL.npz`). Then compare the misses of the trained policy, "
                    "LRU and Belady on held-out rows, and keep them in the model file. Needs PyTorch (CPU is "
                    "enough).")
    parser.add_argument("traces", nargs="+", metavar="TRACE[@START:END]",
                        help="training traces (files, or olmoe / tiny / tiny-history), each with the rows to train on "
                             "(default: all rows), e.g. olmoe@0:150")
    parser.add_argument("-o", "--output", metavar="MODEL.npz", required=True, help="model file to write")
    parser.add_argument("--eval", nargs="+", default=None, metavar="TRACE[@START:END]",
                        help="held-out traces and rows to compare on (default: the rows of each training trace not "
                             "trained on)")
    parser.add_argument("--cache-sizes", metavar="SIZES", default=DEFAULT_CACHE_SIZES,
                        help="comma-separated cache sizes for Belady's replays and the comparison: experts, "
                             f"percentages or fractions of each trace's L*J experts (default {DEFAULT_CACHE_SIZES})"
                             .replace("%", "%%"))
    parser.add_argument("--target", choices=sorted(TARGETS), default="log-distance",
                        help="what the network learns to predict (default: log-distance): " +
                             "; ".join(f"{name}: {text}" for name, text in TARGETS.items()).replace("%", "%%"))
    parser.add_argument("--states", metavar="POLICIES", default="belady",
                        help="comma-separated policies whose cache states are sampled, each resident labelled by "
                             "its next use (default: belady, the paper's reading; lru: the states of a running "
                             "online policy)")
    parser.add_argument("--per-layer", action="store_true",
                        help="one network per MoE layer (paper 003's per-layer FFN); all traces need the same layers "
                             "(measured: fewer hits than one shared network, benchmarks/learned_per_layer.py)")
    parser.add_argument("--epochs", metavar="N", type=int, default=200, help="maximum epochs (default: 200)")
    parser.add_argument("--patience", metavar="N", type=int, default=20,
                        help="stop after N epochs without validation improvement (default: 20)")
    parser.add_argument("--val-fraction", metavar="F", type=float, default=0.2,
                        help="last fraction of each trace's training rows whose evictions validate (default: 0.2)")
    parser.add_argument("--max-samples", metavar="N", type=int, default=50_000,
                        help="samples drawn per trace and cache size (default: 50000)")
    parser.add_argument("--time-limit", metavar="SECONDS", type=float, default=600.0,
                        help="stop training after this long, as if the patience ran out; 0: no limit, for a result "
                             "that does not depend on the machine's speed (default: 600)")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--threads", metavar="N", type=int, default=None, help="PyTorch CPU threads")
    parser.set_defaults(run=run)


def split_trace_argument(text: str) -> tuple[Path, str | None]:
    """``TRACE[@START:END]`` -> (trace path, rows text or None); a file whose name holds '@' is taken whole."""
    from moe_offload.bundled import trace_path

    if "@" in text and not Path(text).exists():
        name, rows = text.rsplit("@", 1)
        return trace_path(name), rows
    return trace_path(text), None


def read_trace_rows(text: str, traces: dict):
    """(trace, (start, end)) of a ``TRACE[@START:END]`` argument; ``traces`` caches the files read."""
    from moe_offload.trace.format import read_trace
    from moe_offload.values import row_range

    path, rows = split_trace_argument(text)
    key = str(path)
    if key not in traces:
        traces[key] = read_trace(path)
    trace = traces[key]
    return trace, row_range(rows, trace.num_tokens, f"{path} rows")


def held_out_rows(total: int, rows: tuple[int, int]) -> tuple[int, int] | None:
    """The rows after the training rows, or before them if none follow."""
    start, end = rows
    if end < total:
        return end, total
    if start > 0:
        return 0, start
    return None


def trace_cache_sizes(text: str, trace) -> list[int]:
    """--cache-sizes resolved for one trace's L*J experts."""
    from moe_offload.values import cache_sizes

    return cache_sizes(text, f"{trace.path}: --cache-sizes", trace.meta.num_expert_slots)


def run(args: argparse.Namespace) -> int:
    from moe_offload.models import require_model_stack
    from moe_offload.outputs import check_output
    from moe_offload.policies import policy_info
    from moe_offload.training.learned_eviction import (TrainingSource, check_sources, evaluate_policies,
                                                       file_sha256, train_learned_eviction)
    from moe_offload.values import number

    require_model_stack("training the learned eviction", ("torch",))  # before reading anything
    inputs = [split_trace_argument(text)[0] for text in args.traces + (args.eval or [])]
    output = check_output(args.output, inputs=inputs, suffixes=(".npz",), what="model")
    time_limit = number(args.time_limit, "--time-limit", low=0)
    states = [name.strip() for name in args.states.split(",") if name.strip()]
    for name in states:
        policy_info(name)
    traces: dict = {}
    sources = []
    for text in args.traces:
        trace, rows = read_trace_rows(text, traces)
        sources.append(TrainingSource(trace, rows, trace_cache_sizes(args.cache_sizes, trace)))
    if args.eval is not None:
        evaluations = [read_trace_rows(text, traces) for text in args.eval]
    else:
        evaluations = [(s.trace, held) for s in sources if (held := held_out_rows(s.trace.num_tokens, s.rows))]
    check_sources(sources, args.per_layer)
    for trace, _ in evaluations:
        trace_cache_sizes(args.cache_sizes, trace)
        if args.per_layer and trace.meta.num_layers != sources[0].trace.meta.num_layers:
            raise ConfigError(f"{trace.path}: {trace.meta.num_layers} layers, but per-layer networks are trained "
                              f"for {sources[0].trace.meta.num_layers}")

    def log(message: str) -> None:
        print(message, flush=True)

    result = train_learned_eviction(sources, target=args.target, per_layer=args.per_layer, states=states,
                                    epochs=args.epochs, patience=args.patience, val_fraction=args.val_fraction,
                                    max_samples=args.max_samples, seed=args.seed, threads=args.threads,
                                    time_limit=time_limit or None, log=log)
    trained = {}  # sha256 -> the row ranges trained on
    for entry in result.training["traces"]:
        trained.setdefault(entry["sha256"], []).append(tuple(map(int, entry["rows"].split(":"))))
    held_out = []
    for trace, (lo, hi) in evaluations:
        sizes = [size for size in trace_cache_sizes(args.cache_sizes, trace)
                 if trace.meta.top_k <= size < trace.meta.num_expert_slots]
        overlap = sum(max(0, min(hi, b) - max(lo, a)) for a, b in trained.get(file_sha256(trace.path), []))
        table = evaluate_policies(trace.select(slice(lo, hi)), sizes, result.model)
        for size, misses in table.items():
            held_out.append({"trace": Path(trace.path).name, "rows": f"{lo}:{hi}", "rows_trained_on": overlap,
                             "cache_size": size, **{f"{p}_misses": m for p, m in misses.items()}})
    result.training["held_out"] = held_out
    path = result.save(output)
    print(f"wrote {path}")
    if not held_out:
        print("no held-out rows (all rows trained on): no comparison")
        return 0
    print("misses on held-out rows (learned / LRU and learned / OPT below 1 are better):")
    header = (f"{'trace':<36} {'rows':>11} {'cache':>6} {'learned':>8} {'lru':>8} {'belady':>8} "
              f"{'learned/LRU':>11} {'learned/OPT':>11} {'LRU/OPT':>8}")
    print(header)
    for row in held_out:
        learned, lru, opt = row["learned_misses"], row["lru_misses"], row["belady_misses"]
        rows = row["rows"] + ("*" if row["rows_trained_on"] else "")
        print(f"{row['trace']:<36} {rows:>11} {row['cache_size']:>6} {learned:>8} {lru:>8} {opt:>8} "
              f"{learned / lru if lru else float('nan'):>11.3f} {learned / opt if opt else float('nan'):>11.3f} "
              f"{lru / opt if opt else float('nan'):>8.3f}")
    if any(row["rows_trained_on"] for row in held_out):
        print("* these rows overlap the rows trained on: not held out")
    return 0
