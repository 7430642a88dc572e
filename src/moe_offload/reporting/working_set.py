"""The working set of a trace, measured against a budget of fast memory: is the traffic cacheable at all?

Three measures, each exact over the whole trace (no sampling), each computed by a kernel written in the
subset of Python that Numba compiles (compiled when Numba is installed and the trace is long enough to pay for
the compile, compiled.py ``compile_pays``; plain Python otherwise):

* **Distinct experts per layer over sliding windows.** For a window of W consecutive tokens (trace rows, in
  the order the engine ran them), the number of distinct experts layer l selects inside it, averaged over
  every window position (W <= N: N - W + 1 positions) and its maximum. A window's distinct experts are what a
  cache must hold to serve those W tokens without a miss after the first use; when the mean over a short
  window already exceeds the layer's share of the budget, no policy can keep the layer's traffic resident.
  One pass per window size: a count per expert of its uses inside the window, updated as the window slides.

* **Reuse distance** (Mattson's stack distance) of every expert request of the replay's flattened sequence
  (trace/flatten.py): the number of distinct *other* experts requested since the previous request of the same
  expert; a first request has none (a cold miss). LRU keeps the C most recently used experts, so a request
  hits an LRU cache of C experts exactly when its reuse distance is below C (Mattson et al. 1970, LRU is a
  stack algorithm): the distribution is LRU's hit rate at every budget at once, and the tests check it
  against the replay. simulator/stack_distances.py computes it, beside OPT's stack distances; a trace of more
  than SPLIT_ABOVE requests in two halves at once, on two threads, joined exactly (``LruStack.followed_by``).

* **Skew per layer**: each layer's request counts per expert, sorted; the share of the layer's requests that
  its hottest m experts take is what pinning those m experts (chosen in hindsight) would serve, the
  frequency-pinning oracle of hand-written replayers.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from moe_offload.compiled import compile_pays, njit_cached
from moe_offload.simulator.stack_distances import HitCurve, LruStack
from moe_offload.trace.flatten import AccessSequence, flattened_pieces
from moe_offload.trace.format import Trace

SPLIT_ABOVE = 8_000_000  # requests above which LRU's distances are measured in two halves at once, on two threads
# Window lengths in tokens: powers of 4 from one token, the last one at most the trace's length.
WINDOW_BASE = 4


def window_lengths(num_tokens: int) -> list[int]:
    """1, 4, 16, ... tokens, up to the trace's length (at least one window)."""
    lengths, length = [], 1
    while length <= num_tokens:
        lengths.append(length)
        length *= WINDOW_BASE
    return lengths


def sliding_distinct_kernel(experts, num_experts, window, distinct_sum, distinct_max):
    """For every layer l of ``experts`` ([N, L, K] integer ids), add over each window of ``window`` consecutive rows
    the number of distinct experts of layer l in it to ``distinct_sum[l]`` and keep the largest in
    ``distinct_max[l]``."""
    num_tokens, num_layers, top_k = experts.shape
    counts = np.zeros(num_experts, np.int64)
    for layer in range(num_layers):
        counts[:] = 0
        distinct = 0
        for row in range(num_tokens):
            for rank in range(top_k):
                expert = experts[row, layer, rank]
                if counts[expert] == 0:
                    distinct += 1
                counts[expert] += 1
            if row >= window:  # the row leaving the window
                for rank in range(top_k):
                    expert = experts[row - window, layer, rank]
                    counts[expert] -= 1
                    if counts[expert] == 0:
                        distinct -= 1
            if row >= window - 1:
                distinct_sum[layer] += distinct
                if distinct > distinct_max[layer]:
                    distinct_max[layer] = distinct


# Expert requests below which the sliding windows run in plain Python (compiled.py compile_pays): 0.22 s for
# the bundled OLMoE trace's 38,272 (its five window lengths), against about 1 s of CPU for the kernel's first
# compile (measured on a loaded 2-core machine).
SLIDING_PYTHON_BELOW = 150_000


@functools.cache
def _sliding_kernel(dtype: str):
    """sliding_distinct_kernel compiled by Numba (which must be installed) for expert ids of ``dtype``
    (read-only or not, as Parquet's are)."""
    from numba import types

    experts = types.Array(getattr(types, dtype), 3, "C", readonly=True)
    totals = types.Array(types.int64, 1, "C")
    return njit_cached(sliding_distinct_kernel, types.void(experts, types.int64, types.int64, totals, totals))


@dataclass
class WorkingSet:
    """The three measures of one trace (module docstring). Shapes: L layers, J experts per layer, D = L * J."""

    windows: list[int]               # window lengths in tokens
    distinct_mean: np.ndarray        # [len(windows), L] mean distinct experts of a layer in a window
    distinct_max: np.ndarray         # [len(windows), L]
    reuse_histogram: np.ndarray      # [D + 1] requests per reuse distance 0..D-1, then first requests
    layer_counts: np.ndarray         # [L, J] requests per expert of each layer
    top_k: int

    @property
    def requests(self) -> int:
        return int(self.reuse_histogram.sum())

    @property
    def lru(self) -> HitCurve:
        """LRU's hits at every cache size."""
        return HitCurve(self.reuse_histogram)

    @property
    def cold_requests(self) -> int:
        """First requests of an expert: misses of every cache that starts empty."""
        return int(self.reuse_histogram[-1])

    def lru_hit_rate(self, cache_size: int) -> float:
        """LRU's hit rate with ``cache_size`` experts: the share of requests of reuse distance below it."""
        return float(self.reuse_histogram[:min(cache_size, len(self.reuse_histogram) - 1)].sum()) / self.requests

    def max_hit_rate(self) -> float:
        """Any cache's hit rate when it holds every expert: all but the first requests hit."""
        return (self.requests - self.cold_requests) / self.requests

    def hottest_share(self, experts_per_layer: int) -> np.ndarray:
        """[L]: the share of each layer's requests that its ``experts_per_layer`` hottest experts take."""
        ranked = -np.sort(-self.layer_counts, axis=1)
        totals = ranked.sum(axis=1)
        return ranked[:, :max(0, experts_per_layer)].sum(axis=1) / np.maximum(totals, 1)

    def pinned_hit_rate(self, cache_size: int) -> float:
        """The share of all requests the hottest experts take when the cache holds the ``cache_size``
        most requested experts of the whole model (pinned, chosen in hindsight)."""
        counts = np.sort(self.layer_counts.ravel())[::-1]
        return float(counts[:cache_size].sum()) / max(1, int(counts.sum()))


@dataclass
class WindowCounts:
    """The measures that the trace's rows give without flattening them: distinct experts per window (the
    sliding windows) and requests per expert."""

    windows: list[int]
    distinct_mean: np.ndarray
    distinct_max: np.ndarray
    layer_counts: np.ndarray


def count_windows(trace: Trace) -> WindowCounts:
    """The sliding windows and the requests per expert of ``trace``, from its rows."""
    meta = trace.meta
    experts = np.ascontiguousarray(trace.experts)  # in their own id type: no copy of the trace
    requests = trace.num_tokens * meta.num_layers * meta.top_k
    sliding = (_sliding_kernel(experts.dtype.name) if compile_pays(requests, SLIDING_PYTHON_BELOW)
               else sliding_distinct_kernel)
    windows = window_lengths(trace.num_tokens)
    distinct_mean = np.zeros((len(windows), meta.num_layers))
    distinct_max = np.zeros((len(windows), meta.num_layers), np.int64)
    for index, window in enumerate(windows):
        total = np.zeros(meta.num_layers, np.int64)
        largest = np.zeros(meta.num_layers, np.int64)
        sliding(experts, meta.num_experts, window, total, largest)
        distinct_mean[index] = total / (trace.num_tokens - window + 1)
        distinct_max[index] = largest
    # a layer at a time: a bincount of the whole sequence would copy it to 8-byte ids first
    layer_counts = np.stack([np.bincount(experts[:, layer, :].ravel(), minlength=meta.num_experts)
                             for layer in range(meta.num_layers)]).astype(np.int64)
    return WindowCounts(windows=windows, distinct_mean=distinct_mean, distinct_max=distinct_max,
                        layer_counts=layer_counts)


def measure_working_set(trace: Trace, sequence: AccessSequence | None = None,
                        counts: WindowCounts | None = None) -> WorkingSet:
    """The working set of ``trace``; ``sequence`` is its flattened request sequence (ReplayInput's), or None to
    flatten it here a piece at a time, in memory that does not grow with the trace; ``counts`` its
    ``count_windows``, or None to count them here."""
    counts = count_windows(trace) if counts is None else counts
    meta = trace.meta
    per_row = meta.num_layers * meta.top_k

    def measure(first: int, stop: int) -> LruStack:  # rows first .. stop-1, from an empty stack
        stack = LruStack(meta.num_expert_slots, (stop - first) * per_row)
        for keys in ([sequence.expert_id[first * per_row:stop * per_row]] if sequence is not None
                     else flattened_pieces(trace.select(slice(first, stop)))):
            stack.add(keys)
        return stack

    if trace.num_tokens * per_row <= SPLIT_ABOVE:
        histogram = measure(0, trace.num_tokens).histogram
    else:  # the two halves at once, the kernel releasing the GIL (stack_distances.py: LruStack.followed_by)
        middle = trace.num_tokens // 2
        with ThreadPoolExecutor(max_workers=1) as beside:
            later = beside.submit(measure, middle, trace.num_tokens)
            histogram = measure(0, middle).followed_by(later.result())
    return WorkingSet(windows=counts.windows, distinct_mean=counts.distinct_mean, distinct_max=counts.distinct_max,
                      reuse_histogram=histogram, layer_counts=counts.layer_counts, top_k=meta.top_k)
