"""fMoE's similarity-aware prefetch sets and the proposals made of them (paper 000, "Expert Prefetching"),
as two functions in the subset of Python that Numba compiles.

Why compiled. The prefetcher chooses a set after every layer and re-ranks the sets of the d layers ahead:
a handful of arithmetic per expert, but in NumPy and Python a few dozen calls of a microsecond or more each,
once per layer per token, which made up most of the matcher's time per token once the store's searches
were fast (measured per hook on benchmarks/map_search.py's stores: about 20 us of a 32 x 8 model, 50 us of
a 48 x 128 one). Compiled, each is one call (the 32 x 8 hook: about 16 us, the rest being the search's step
and Python around it). Numba is optional (the ``fast`` extra): without it the same functions run as
plain Python, with the same results and more slowly, as the compiled replay's kernels do
(simulator/kernels.py); the tests run them both ways.

``similarity_aware_set(rows, scores, min_experts, offset, keys, wanted)``: the batch's set for one target
layer. Per request b, from its predicted distribution rows[b] [J] searched with similarity scores[b]:
delta = clip(1 - score, 0, 1); the experts by decreasing probability (ties: lower id first), as many as
it takes for their summed probability (in float64, in that order) to reach delta, and at least
``min_experts``. Over the batch an expert keeps the highest probability any request's set gives it. Writes
the union into ``keys`` (flat ids: ``offset`` + expert) and ``wanted`` (that probability) by decreasing
probability, ties lower key first, and returns its size.

``ranked_proposals(set_keys, set_wanted, set_sizes, now, last, keys, priorities)``: the sets of the
target layers now + 1 .. last (rows of ``set_keys`` / ``set_wanted``, ``set_sizes`` long) with priority
p / (t - now), highest first, ties lower key first; returns how many it wrote. The keys of different
targets are different layers' experts, so no key repeats.
"""

from __future__ import annotations

import functools

import numpy as np

from moe_offload.compiled import njit_cached, numba_available

SET_SIGNATURE = "int64(float32[:, ::1], float64[::1], int64, int64, int64[::1], float64[::1])"
PROPOSALS_SIGNATURE = "int64(int64[:, ::1], float64[:, ::1], int64[::1], int64, int64, int64[::1], float64[::1])"


def similarity_aware_set(rows, scores, min_experts, offset, keys, wanted):
    """The batch's prefetch set of one target layer (module docstring). Numba's subset of Python."""
    experts = rows.shape[1]
    highest = np.full(experts, -1.0)  # the highest p a request's set gives each expert; -1: in no set
    for b in range(rows.shape[0]):
        delta = min(max(1.0 - scores[b], 0.0), 1.0)
        order = np.argsort(-rows[b], kind="mergesort")  # stable: equal probabilities, lower id first
        total = 0.0
        count = experts
        for rank in range(experts):
            total += np.float64(rows[b, order[rank]])
            if total >= delta:  # the first rank whose sum reaches delta closes the set
                count = rank + 1
                break
        count = min(max(count, min_experts), experts)
        for rank in range(count):
            expert = order[rank]
            p = np.float64(rows[b, expert])
            if p > highest[expert]:
                highest[expert] = p
    chosen = np.flatnonzero(highest >= 0.0)  # ascending ids, so the stable sort below breaks ties by id
    ranked = chosen[np.argsort(-highest[chosen], kind="mergesort")]
    for i in range(ranked.shape[0]):
        keys[i] = offset + ranked[i]
        wanted[i] = highest[ranked[i]]
    return ranked.shape[0]


def ranked_proposals(set_keys, set_wanted, set_sizes, now, last, keys, priorities):
    """The proposals of the targets now + 1 .. last (module docstring). Numba's subset of Python."""
    count = 0
    for target in range(now + 1, last + 1):
        ahead = np.float64(target - now)
        for i in range(set_sizes[target]):
            keys[count] = set_keys[target, i]
            priorities[count] = set_wanted[target, i] / ahead
            count += 1
    by_key = np.argsort(keys[:count], kind="mergesort")
    order = by_key[np.argsort(-priorities[:count][by_key], kind="mergesort")]
    keys[:count] = keys[:count][order]
    priorities[:count] = priorities[:count][order]
    return count


@functools.cache
def compiled_set_functions():
    """(similarity_aware_set, ranked_proposals), compiled (or loaded from Numba's cache), or the plain
    functions without Numba."""
    if not numba_available():
        return similarity_aware_set, ranked_proposals
    return njit_cached(similarity_aware_set, SET_SIGNATURE), njit_cached(ranked_proposals, PROPOSALS_SIGNATURE)
