"""How long fMoE's expert-map search and MoE-Infinity's nearest-EAM search take, beside the floor an
exhaustive search cannot beat (streaming the store's bytes once through memory) and the TPOT they must hide
behind.

    python benchmarks/map_search.py [--sizes 1000,50000] [--tokens 40] [--batch 8] [--distance 3]
                                    [--embedding-dims 32] [--candidates 32] [--lists 224] [--probes 8]
                                    [--models 32x8,48x128]

Bandwidth: this machine's memory bandwidth, measured first in the same run as the best of several
matrix-vector products over a 512 MiB float32 matrix (the operation the semantic search is), one BLAS thread.
The floor of a search is the bytes it must read per token over that bandwidth (ExpertMapStore.bytes_searched):
the whole store (every stored embedding and map) for the exhaustive search; the projection matrix, the
embeddings and the candidates' maps with compaction and pruning; with IVF the projection, the centroids, P / N
of the embeddings and the candidates' maps.

Two model shapes: 32 layers x 8 experts with a 4096-wide embedding (Mixtral-8x7B) and 48 x 128 with a
2048-wide one (Qwen3-30B-A3B). Stores of random expert maps (peaked random distributions) and random
embeddings, filled to capacity; the searched iterations are random too (search time does not depend on
the values). Per store and mode (``exhaustive``, the default, which returns exactly the previous
implementation's results; ``compact + pruned``: embeddings projected to --embedding-dims, float16 maps,
trajectory and deduplication over the --candidates best semantic entries; ``+ IVF``: the same with the
semantic search through a coarse quantizer, lists=N (--lists) probing P (--probes); below 8 N maps the index
is not trained and the search is the pruned one):

* the matcher per token: the FMoEPrefetcher hooks of one decode iteration of one request, 1 semantic
  search + (L - d) trajectory steps + the similarity-aware sets and their proposals, and the store update
  as the iteration ends (deduplication into the full store), as the hooks' ``last_search_seconds`` add up
  (this thread's CPU time, what the timed simulator charges: median and p99; on a machine shared with other
  work it is what the search costs on a core of its own) and by the wall clock (mean);
* the same per request for a batch of --batch requests in one iteration (one matrix-matrix product);
* the floor, and the CPU time per token over it; per token as a fraction of a 20 ms offloaded TPOT.

MoE-Infinity: one nearest-EAM search in an EAMC of 300 EAMs (paper 002's 21 us measurement) and of each
size, mean and p99, per token (L - 1 searches, Algorithm 1 searches after every layer but the last); and the
incremental search (``search="incremental"``: the routed layer's cosines recomputed, the L layers' added),
per token L steps.

Every number comes from this one run, on this machine, with one BLAS thread (OPENBLAS_NUM_THREADS, when set,
decides instead).
"""

from __future__ import annotations

import argparse
import gc
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

MODELS = {"32x8": ("32x8 (Mixtral-8x7B)", 32, 8, 2, 4096), "48x128": ("48x128 (Qwen3-30B-A3B)", 48, 128, 8, 2048)}
TPOT = 0.020
MOE_INFINITY_REFERENCE = (300, 21e-6)  # paper 002, section 8: 21 us to search an EAMC of 300 EAMs
FILL_CHUNK = 2000
BANDWIDTH_BYTES = 512 << 20


def random_maps(rng, count, L, J) -> np.ndarray:
    """[count, L, J] peaked random distributions (float32)."""
    maps = rng.random((count, L, J), dtype=np.float32) ** 4
    return maps / maps.sum(axis=2, keepdims=True)


def memory_bandwidth(repeats: int = 7) -> float:
    """Bytes per second of the best of ``repeats`` float32 matrix-vector products over BANDWIDTH_BYTES (CPU
    time of this thread, so that other processes' turns on the cores do not count)."""
    matrix = np.ones((BANDWIDTH_BYTES // 4096, 1024), dtype=np.float32)
    vector = np.ones(1024, dtype=np.float32)
    best = np.inf
    for _ in range(repeats):
        start = time.thread_time()
        matrix @ vector
        best = min(best, time.thread_time() - start)
    return matrix.nbytes / best


def us(value: float) -> str:
    return f"{value * 1e6:,.0f}" if value >= 1e-4 else f"{value * 1e6:,.1f}"


def bench_fmoe(rng, L, J, K, D, capacity, tokens, distance, batch, options):
    """(matcher per token: wall seconds, CPU seconds as the hooks report them; the same per request at
    ``batch``; bytes read per token)."""
    prefetcher = FMoEPrefetcher(ModelSpec(L, J, K), capacity=capacity, distance=distance, **options)
    for start in range(0, capacity, FILL_CHUNK):
        count = min(FILL_CHUNK, capacity - start)
        prefetcher.store.add(random_maps(rng, count, L, J), rng.normal(size=(count, D)).astype(np.float32))
    rows = tokens * (1 + batch)
    probs = random_maps(rng, rows, L, J)
    trace = Trace.build(TraceMeta("benchmark", L, J, K), np.argsort(-probs, axis=2)[:, :, :K], probs=probs,
                        embedding=rng.normal(size=(rows, D)), request=np.r_[np.zeros(tokens), 1 + np.arange(
                            tokens * batch) % batch], iteration=np.r_[np.arange(tokens), tokens + np.arange(
                                tokens * batch) // batch])
    streamed = prefetcher.store.bytes_searched()

    def iteration(rows_of_iteration):
        view = RoutingView(trace, int(trace.iteration[rows_of_iteration[0]]), rows_of_iteration)
        wall = time.perf_counter()
        prefetcher.on_iteration_start(view)
        charged = prefetcher.last_search_seconds
        for layer in range(L):
            view.layer_now = layer
            prefetcher.on_layer_routed(view)
            charged += prefetcher.last_search_seconds
        prefetcher.on_iteration_end(view)
        charged += prefetcher.last_search_seconds
        return time.perf_counter() - wall, charged

    single = np.array([iteration(np.array([token])) for token in range(tokens)])
    batched = np.array([iteration(tokens + np.arange(step * batch, (step + 1) * batch)) for step in range(tokens)])
    return single[:, 0], single[:, 1], batched[:, 0] / batch, batched[:, 1] / batch, streamed


def bench_eamc(rng, L, J, size, searches):
    """(wall seconds of each exhaustive search, mean CPU seconds per exhaustive search, the same two for the
    incremental search: one layer's cosines recomputed, the L layers' summed)."""
    eamc = EAMCollection(rng.integers(0, 50, size=(size, L, J), dtype=np.int32))
    current = rng.integers(0, 50, size=(searches, 1, L, J), dtype=np.int32)
    by_layer = np.stack([eamc.layer_similarities(layer, current[0, :, layer]) for layer in range(L)], axis=1)
    out = []
    for search in (lambda i, query: eamc.nearest(query),
                   lambda i, query: (eamc.layer_similarities(i % L, query[:, i % L]),
                                     eamc.nearest_from_layers(by_layer))):
        times = []
        cpu = time.thread_time()
        for i, query in enumerate(current):
            begin = time.perf_counter()
            search(i, query)
            times.append(time.perf_counter() - begin)
        out += [np.asarray(times), (time.thread_time() - cpu) / searches]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,50000", help="store / EAMC sizes (comma-separated)")
    parser.add_argument("--tokens", type=int, default=40, help="searched iterations per store and mode")
    parser.add_argument("--batch", type=int, default=8, help="requests of the batched iterations")
    parser.add_argument("--distance", type=int, default=3, help="fMoE's prefetch distance d")
    parser.add_argument("--embedding-dims", type=int, default=32, help="compact mode: projected embedding size")
    parser.add_argument("--candidates", type=int, default=32, help="pruned mode: candidates per request")
    parser.add_argument("--lists", type=int, default=224, help="IVF mode: the coarse quantizer's lists")
    parser.add_argument("--probes", type=int, default=8, help="IVF mode: lists probed per search")
    parser.add_argument("--models", default=",".join(MODELS), help=f"model shapes among {', '.join(MODELS)}")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
    rng = np.random.default_rng(0)
    console = Console(width=200)
    bandwidth = memory_bandwidth()
    console.print(f"memory bandwidth (best float32 matrix-vector product over {BANDWIDTH_BYTES >> 20} MiB, one "
                  f"thread): {bandwidth / 1e9:.1f} GB/s")
    compact = {"embedding_dims": args.embedding_dims, "candidates": args.candidates, "map_dtype": "float16"}
    modes = (("exhaustive", {}),
             (f"compact + pruned (D'={args.embedding_dims}, float16 maps, M={args.candidates})", compact),
             (f"+ IVF (N={args.lists}, P={args.probes})", {**compact, "lists": args.lists, "probes": args.probes}))

    fmoe = Table(title="fMoE's matcher per token (1 semantic search, L - d trajectory steps, sets and proposals, "
                       "store update): CPU us as median / p99, wall us as mean; floor = bytes read / bandwidth")
    for column in ("model", "maps", "mode", "CPU", "wall", "floor", "CPU / floor", "CPU / 20 ms",
                   f"per request, batch {args.batch}: CPU", "batch / floor"):
        fmoe.add_column(column, justify="right")
    eamc = Table(title="MoE-Infinity nearest-EAM search, B = 1 sequence: wall us as mean / p99, CPU us as mean; "
                       "per token = L - 1 searches; floor = the EAMC's float32 bytes / bandwidth")
    for column in ("model", "EAMs", "wall", "CPU", f"CPU / paper's {MOE_INFINITY_REFERENCE[1] * 1e6:.0f} us",
                   "floor", "per token (CPU)", "per token / 20 ms", "incremental: wall", "CPU", "per token / 20 ms"):
        eamc.add_column(column, justify="right")

    for label, L, J, K, D in (MODELS[name] for name in args.models.split(",")):
        for size in sizes:
            for mode, options in modes:
                console.print(f"fMoE {label}, {size:,} maps, {mode} ...")
                wall, cpu, batch_wall, batch_cpu, streamed = bench_fmoe(
                    rng, L, J, K, D, size, args.tokens, args.distance, args.batch, options)
                floor = streamed / bandwidth
                fmoe.add_row(label, f"{size:,}", mode, f"{us(np.median(cpu))} / {us(np.percentile(cpu, 99))}",
                             us(wall.mean()), us(floor), f"{np.median(cpu) / floor:.2f}x",
                             f"{np.median(cpu) / TPOT:.3f}", us(np.median(batch_cpu)),
                             f"{np.median(batch_cpu) / floor:.2f}x")
                gc.collect()
        for size in sorted({MOE_INFINITY_REFERENCE[0], *sizes}):
            wall, cpu, step_wall, step_cpu = bench_eamc(rng, L, J, size, 500)
            per_token = cpu * (L - 1)
            eamc.add_row(label, f"{size:,}", f"{us(wall.mean())} / {us(np.percentile(wall, 99))}", us(cpu),
                         f"{cpu / MOE_INFINITY_REFERENCE[1]:.2f}x", us(size * L * J * 4 / bandwidth), us(per_token),
                         f"{per_token / TPOT:.3f}", f"{us(step_wall.mean())} / {us(np.percentile(step_wall, 99))}",
                         us(step_cpu), f"{step_cpu * L / TPOT:.3f}")
    console.print(fmoe)
    console.print(eamc)


if __name__ == "__main__":
    main()
