"""`moe-offload train-eviction`: train FlashMoE's learned eviction network (paper 003) on a trace."""

from __future__ import annotations

import argparse
import sys



def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-eviction",
        help="train the learned eviction policy (paper 003) from Belady's decisions on a trace",
        description="Replay the training rows of TRACE with Belady's OPT at each cache size, learn to predict "
                    "every resident expert's distance to its next request from its recency and frequency "
                    "(FlashMoE, paper 003), and write the network to MODEL.npz (use it with `moe-offload simulate "
                    "--policy learned --policy-option learned.model_path=MODEL.npz`). "
                    "Then compare misses of the trained policy, LRU, LFU and Belady on the held-out rows. "
                    "Needs PyTorch (CPU is enough).")
    parser.add_argument("trace", metavar="TRACE", help="routing trace (.parquet), or a bundled trace's name")
    parser.add_argument("-o", "--output", metavar="MODEL.npz", required=True, help="model file to write")
    parser.add_argument("--rows", metavar="START:END", default=None,
                        help="trace rows to train on (default: all); the others are held out for the comparison")
    parser.add_argument("--eval-rows", metavar="START:END", default=None,
                        help="rows for the final comparison (default: the rows after the training rows, or "
                             "before them if none follow)")
    parser.add_argument("--cache-sizes", metavar="N", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="cache sizes (experts) Belady is replayed at (default: 64 128 256 512)")
    parser.add_argument("--horizon", metavar="TOKENS", type=float, default=2.0,
                        help="distance at which the target saturates, in tokens' worth of requests (default: 2)")
    parser.add_argument("--epochs", metavar="N", type=int, default=200, help="maximum epochs (default: 200)")
    parser.add_argument("--patience", metavar="N", type=int, default=20,
                        help="stop after N epochs without validation improvement (default: 20)")
    parser.add_argument("--val-fraction", metavar="F", type=float, default=0.2,
                        help="last fraction of the training rows whose evictions validate (default: 0.2)")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--threads", metavar="N", type=int, default=None, help="PyTorch CPU threads")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moe_offload.bundled import trace_path
    from moe_offload.models import require_model_stack
    from moe_offload.outputs import check_output
    from moe_offload.trace.format import read_trace
    from moe_offload.values import row_range
    from moe_offload.training.learned_eviction import evaluate_policies, train_learned_eviction

    require_model_stack("training the learned eviction", ("torch",))  # before reading anything
    check_output(args.output, inputs=[trace_path(args.trace)], what="model")
    trace = read_trace(args.trace)
    n = trace.num_tokens
    start, end = row_range(args.rows, n, "--rows")
    if args.eval_rows is not None:
        eval_rows = row_range(args.eval_rows, n, "--eval-rows")
    elif end < n:
        eval_rows = (end, n)
    elif start > 0:
        eval_rows = (0, start)
    else:
        eval_rows = None

    def log(message: str) -> None:
        print(message, flush=True)

    result = train_learned_eviction(trace, rows=(start, end), cache_sizes=args.cache_sizes,
                                    horizon_tokens=args.horizon, epochs=args.epochs, patience=args.patience,
                                    val_fraction=args.val_fraction, seed=args.seed, threads=args.threads, log=log)
    path = result.save(args.output)
    print(f"wrote {path}")
    if eval_rows is None:
        print("no held-out rows (all rows trained on): no comparison", file=sys.stderr)
        return 0
    lo, hi = eval_rows
    overlap = max(0, min(hi, end) - max(lo, start))
    note = f" (overlaps {overlap} training rows)" if overlap else " (held out)"
    print(f"misses on rows {lo}:{hi}{note}, {(hi - lo) * trace.meta.num_layers * trace.meta.top_k} requests:")
    policies = ("learned", "lru", "lfu", "belady")
    table = evaluate_policies(trace.select(slice(lo, hi)), sorted(set(args.cache_sizes)), path, policies)
    print(f"{'cache':>7} " + " ".join(f"{p:>9}" for p in policies) + "   learned/LRU")
    for size, misses in table.items():
        ratio = misses["learned"] / misses["lru"] if misses["lru"] else float("nan")
        print(f"{size:>7} " + " ".join(f"{misses[p]:>9}" for p in policies) + f"   {ratio:.3f}")
    return 0
