"""Which sample of a MoE trace keeps OPT's hit-rate curve: the error of each against the exact curve.

    python benchmarks/opt_sampling.py [--tokens 20000] [--rates 0.5,0.25,0.1,0.05] [--shared ../shared/traces]

For each trace (the bundled OLMoE trace, the shared Qwen1.5-MoE routes files when --shared holds them, and a
synthetic Qwen3-30B-A3B-shaped Zipf trace of --tokens tokens: 48 layers, top-8 of 128, Zipf a = 1.2 per layer,
as benchmarks/report_scale.py builds it) it measures OPT's hit rate at every cache size exactly
(simulator/stack_distances.py) and from five samples of about the same share of the requests:

* experts: SHARDS' spatial sampling (every request of a hashed share of the experts, sizes scaled by it), what
  `moe-offload report` does above --sample-above;
* experts by requests: every request of a systematic share of the experts ranked by their requests (the
  middle one of each run of 1/rate in the ranking), sizes scaled by it: a stratified sample, which takes hot
  and cold experts in their proportions where a hash may take more of either;
* layers: every request of every s-th layer (sizes scaled by 1/s);
* prefix: the first tokens;
* windows: ten windows of consecutive tokens spread over the trace, their stack distances added (each window
  starts with an empty cache).

and prints, per trace, rate and sample, the largest error of the hit rate over all sizes from top-k to L*J,
the error at 25% of the experts, the error (in experts) of OPT's size for 50/80/90% hits, and the seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

WINDOWS = 10


def curves(data, rate: float):
    """{sample: (hit rate at each size 0..D, seconds)} for ``data`` at ``rate``."""
    from moe_offload.simulator.stack_distances import HitCurve, opt_curve

    meta, seq = data.trace.meta, data.sequence
    D, L = meta.num_expert_slots, meta.num_layers
    keys = seq.expert_id
    per_token = L * meta.top_k
    tokens = len(keys) // per_token
    out = {}

    def timed(name, function):
        start = time.perf_counter()
        rates = function()
        out[name] = (rates, time.perf_counter() - start)

    timed("experts", lambda: opt_curve(keys, D, rate=rate).hit_rates())

    def popular():
        by_requests = np.argsort(-np.bincount(keys, minlength=D), kind="stable")
        chosen = np.zeros(D, np.bool_)
        chosen[by_requests[np.arange(0.5 / rate, D, 1 / rate).astype(np.int64)]] = True
        return HitCurve(opt_curve(keys[chosen[keys]], D).histogram, rate=chosen.mean()).hit_rates()

    timed("experts by requests", popular)
    step = max(1, round(1 / rate))

    def layers():
        kept = keys[seq.layer % step == 0]
        return HitCurve(opt_curve(kept, D).histogram, rate=len(range(0, L, step)) / L).hit_rates()

    timed("layers", layers)

    def prefix():
        kept = keys[:max(1, round(rate * tokens)) * per_token]
        return opt_curve(kept, D).hit_rates()

    timed("prefix", prefix)

    def windows():
        length = max(1, round(rate * tokens / WINDOWS))
        histogram = np.zeros(D + 1, np.int64)
        for start in np.linspace(0, tokens - length, WINDOWS).astype(int):
            kept = keys[start * per_token:(start + length) * per_token]
            histogram += opt_curve(kept, D).histogram
        return HitCurve(histogram).hit_rates()

    timed("windows", windows)
    return out


def smallest(rates: np.ndarray, target: float) -> int | None:
    size = int(np.searchsorted(rates, target, side="left"))
    return size if size < len(rates) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--rates", default="0.5,0.25,0.1,0.05")
    parser.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))
    args = parser.parse_args()

    from report_scale import synthetic_trace

    from moe_offload.bundled import DEFAULT_TRACE
    from moe_offload.simulator.replay import ReplayInput
    from moe_offload.simulator.stack_distances import opt_curve
    from moe_offload.trace.format import read_trace

    traces = {"olmoe (bundled)": read_trace(DEFAULT_TRACE)}
    qwen = Path(args.shared) / "qwen1.5-moe-a2.7b"
    if qwen.is_dir():
        from moe_offload.trace.importers import import_routes_json

        traces["qwen1.5-moe (shared, 6 files)"] = import_routes_json(sorted(qwen.glob("*_[0-9].json")),
                                                                    num_experts=60)
    traces[f"synthetic 48x128 top-8, {args.tokens:,} tokens"] = synthetic_trace(args.tokens, 48, 128, 8, None)
    console = Console(width=160)
    for name, trace in traces.items():
        data = ReplayInput.of(trace)
        meta = trace.meta
        D = meta.num_expert_slots
        start = time.perf_counter()
        exact = opt_curve(data.sequence.expert_id, D).hit_rates()
        exact_s = time.perf_counter() - start
        sizes = slice(meta.top_k, D + 1)
        table = Table(title=f"{name}: {len(data.sequence):,} requests, {D:,} experts; exact OPT curve {exact_s:.2f} s",
                      title_justify="left")
        for column in ("rate", "sample", "largest error (points)", "error at 25%", "50% size error",
                       "80% size error", "90% size error", "seconds"):
            table.add_column(column, justify="left" if column == "sample" else "right")
        for rate in (float(text) for text in args.rates.split(",")):
            for sample, (rates, seconds) in curves(data, rate).items():
                errors = []
                for target in (0.5, 0.8, 0.9):
                    want, got = smallest(exact, target), smallest(rates, target)
                    errors.append("-" if want is None or got is None else f"{got - want:+,}")
                table.add_row(f"{rate:g}", sample, f"{np.abs(rates[sizes] - exact[sizes]).max() * 100:.2f}",
                              f"{(rates[D // 4] - exact[D // 4]) * 100:+.2f}", *errors, f"{seconds:.2f}")
        console.print(table)
    return 0


if __name__ == "__main__":
    from script import run

    run(main)
