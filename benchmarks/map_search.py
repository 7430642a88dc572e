"""How long fMoE's expert-map search and MoE-Infinity's nearest-EAM search take, beside the TPOT they must
hide behind.

    python benchmarks/map_search.py [--sizes 1000,50000] [--tokens 100] [--distance 3]

Two model shapes: 32 layers x 8 experts with a 4096-wide embedding (Mixtral-8x7B) and 48 x 128 with a
2048-wide one (Qwen3-30B-A3B). Stores of random expert maps (peaked random distributions) and random
embeddings, filled to capacity; the searched iterations are random too (search time does not depend on
the values). Per store:

* fMoE, raw searches (B = 1 request): one semantic search (cosine against every stored embedding) and one
  trajectory step (the incremental cosine over the observed prefix, one per layer), mean and p99;
* fMoE, the matcher per token: the FMoEPrefetcher hooks of one decode iteration, 1 semantic search +
  (L - d) trajectory steps + the similarity-aware sets and their proposals (the sum of the hooks'
  ``last_search_seconds``), and the store update as the iteration ends (deduplication into a full store);
* MoE-Infinity: one nearest-EAM search in an EAMC of as many EAMs (random counts), mean and p99, and per
  token (L - 1 searches, Algorithm 1 searches after every layer but the last); also at 300 EAMs, the size
  of paper 002's 21 us measurement.

The per-token times are printed as fractions of a typical offloaded TPOT of 20 ms and 100 ms: fMoE's
matcher runs asynchronously and must finish within the TPOT to be hidden; MoE-Infinity's search is on
the inference path and adds to it. Every number comes from this one run, on this machine, with one BLAS
thread (OPENBLAS_NUM_THREADS, when set, decides instead).
"""

from __future__ import annotations

import argparse
import os
import time

# The matcher is one thread beside the inference process: one BLAS thread, unless the caller says otherwise.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402  (after the thread settings, which NumPy reads when it loads)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from moe_offload.policies.base import ModelSpec  # noqa: E402
from moe_offload.prefetch.base import RoutingView  # noqa: E402
from moe_offload.prefetch.eam import EAMCollection  # noqa: E402
from moe_offload.prefetch.fmoe import FMoEPrefetcher  # noqa: E402
from moe_offload.trace.format import Trace, TraceMeta  # noqa: E402

MODELS = (("32x8 (Mixtral-8x7B)", 32, 8, 2, 4096), ("48x128 (Qwen3-30B-A3B)", 48, 128, 8, 2048))
TPOTS = (0.020, 0.100)
MOE_INFINITY_REFERENCE = (300, 21e-6)  # paper 002, section 8: 21 us to search an EAMC of 300 EAMs
FILL_CHUNK = 2000


def random_maps(rng, count, L, J) -> np.ndarray:
    """[count, L, J] peaked random distributions (float32)."""
    maps = rng.random((count, L, J), dtype=np.float32) ** 4
    return maps / maps.sum(axis=2, keepdims=True)


def stats(seconds) -> tuple[float, float]:
    seconds = np.asarray(seconds)
    return float(seconds.mean()), float(np.percentile(seconds, 99))


def us(value: float) -> str:
    return f"{value * 1e6:,.0f}" if value >= 1e-4 else f"{value * 1e6:,.1f}"


def pair(mean_p99: tuple[float, float]) -> str:
    return f"{us(mean_p99[0])} / {us(mean_p99[1])}"


def ratio(value: float, tpot: float) -> str:
    return f"{value / tpot:.3f}"


def bench_fmoe(rng, L, J, K, D, capacity, tokens, distance):
    prefetcher = FMoEPrefetcher(ModelSpec(L, J, K), capacity=capacity, distance=distance)
    for start in range(0, capacity, FILL_CHUNK):
        count = min(FILL_CHUNK, capacity - start)
        prefetcher.store.add(random_maps(rng, count, L, J), rng.normal(size=(count, D)).astype(np.float32))
    probs = random_maps(rng, tokens, L, J)
    experts = np.argsort(-probs, axis=2)[:, :, :K]
    trace = Trace.build(TraceMeta("benchmark", L, J, K), experts, probs=probs,
                        embedding=rng.normal(size=(tokens, D)))
    store = prefetcher.store

    semantic, trajectory = [], []
    for token in range(tokens):
        query = trace.embedding[token:token + 1].astype(np.float32)
        begin = time.perf_counter()
        store.semantic_search(query)
        semantic.append(time.perf_counter() - begin)
        search = store.trajectory(1)
        for layer in range(L - distance):
            observed = trace.probs[token:token + 1, layer].astype(np.float32)
            begin = time.perf_counter()
            search.observe(layer, observed)
            trajectory.append(time.perf_counter() - begin)

    matcher, update = [], []
    for token in range(tokens):
        view = RoutingView(trace, token, np.array([token]))
        prefetcher.on_iteration_start(view)
        spent = prefetcher.last_search_seconds
        for layer in range(L):
            view.layer_now = layer
            prefetcher.on_layer_routed(view)
            spent += prefetcher.last_search_seconds
        matcher.append(spent)
        prefetcher.on_iteration_end(view)
        update.append(prefetcher.last_search_seconds)
    return stats(semantic), stats(trajectory), stats(matcher), stats(update)


def bench_eamc(rng, L, J, size, tokens):
    eamc = EAMCollection(rng.integers(0, 50, size=(size, L, J), dtype=np.int32))
    current = rng.integers(0, 50, size=(tokens, 1, L, J), dtype=np.int32)
    times = []
    for token in range(tokens):
        begin = time.perf_counter()
        eamc.nearest(current[token])
        times.append(time.perf_counter() - begin)
    return stats(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,50000", help="store / EAMC sizes (comma-separated)")
    parser.add_argument("--tokens", type=int, default=100, help="searched iterations per store")
    parser.add_argument("--distance", type=int, default=3, help="fMoE's prefetch distance d")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    console = Console(width=160)

    fmoe = Table(title="fMoE expert-map search, B = 1 request: times in us as mean / p99; "
                       "per token = matcher + store update, as a fraction of the TPOT")
    for column in ("model", "maps", "semantic search", "trajectory step", "matcher per token", "store update",
                   *(f"per token / {tpot * 1e3:.0f} ms" for tpot in TPOTS)):
        fmoe.add_column(column, justify="right")
    eamc = Table(title="MoE-Infinity nearest-EAM search, B = 1 sequence: times in us as mean / p99; per token = "
                       "L - 1 searches, as a fraction of the TPOT")
    for column in ("model", "EAMs", "search", f"mean / paper's {MOE_INFINITY_REFERENCE[1] * 1e6:.0f} us",
                   "per token", *(f"per token / {tpot * 1e3:.0f} ms" for tpot in TPOTS)):
        eamc.add_column(column, justify="right")

    for label, L, J, K, D in MODELS:
        for size in sizes:
            console.print(f"fMoE {label}, {size:,} maps ...")
            semantic, trajectory, matcher, update = bench_fmoe(rng, L, J, K, D, size, args.tokens, args.distance)
            per_token = matcher[0] + update[0]
            fmoe.add_row(label, f"{size:,}", pair(semantic), pair(trajectory), pair(matcher), pair(update),
                         *(ratio(per_token, t) for t in TPOTS))
        for size in sorted({MOE_INFINITY_REFERENCE[0], *sizes}):
            search = bench_eamc(rng, L, J, size, args.tokens)
            per_token = search[0] * (L - 1)
            eamc.add_row(label, f"{size:,}", pair(search), f"{search[0] / MOE_INFINITY_REFERENCE[1]:.1f}x",
                         us(per_token), *(ratio(per_token, t) for t in TPOTS))
    console.print(fmoe)
    console.print(eamc)


if __name__ == "__main__":
    main()
