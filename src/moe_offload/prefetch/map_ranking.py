"""How the Expert Map Store's searches rank the stored entries: ``best_entries`` (the highest score, ties
within TIE_TOLERANCE to the most recently stored), and one step of the pruned trajectory search
(expert_map_store.IterationSearch.observe with ``candidates``), compiled with Numba when it is installed;
and the gather of the candidates' float16 maps as float32 that a pruned search starts with.

Why a kernel. A pruned step does little arithmetic (B x M x J multiply-adds, M = 32 candidates) but takes a
dozen NumPy calls of a microsecond each, once per layer per token; compiled, the whole step is one call of
about a microsecond (benchmarks/map_search.py). Numba is optional (the ``fast`` extra): without it the NumPy
form below runs, with the same result bit for bit, since both do the same float32 operations in the same
order (test: tests/test_map_search.py):

* the query's squared norm gains probs[b, j]^2 for j = 0, 1, ... in turn; the running dot product of every
  candidate gains maps[b, m, j] * probs[b, j] in the same order (each product rounded to float32, then the
  sum: no fused multiply-add, which Numba does not emit without ``fastmath``);
* cosine = dot * (1 / prefix norm) / max(sqrt(squared norm), 1e-30);
* the best column: the first of highest cosine, or, if others are within TIE_TOLERANCE of it (in float32),
  the one of them stored last (highest stamp), as ``best_entries``.

The NumPy form loops over the J experts (one vectorised operation over the B x M candidates per expert), so
it is slower than a matrix product for large J; it is the reference and the fallback, not the fast path.

Why the float16 gather is compiled too. A store with ``map_dtype="float16"`` converts its candidates' maps
to float32 once per iteration (M x L x J values: 196,608 for 32 candidates of a 48 x 128 model). Router
distributions over many experts are mostly tiny probabilities, which float16 holds as subnormals (17% of the
values of the benchmark's maps), and NumPy converts those one at a time: about 1 ms per iteration on this
machine, against 0.15 ms for the kernel below, which converts the bits as IEEE 754 defines them (half to
single is exact: the same value, subnormals normalised; infinities and NaN keep their sign and payload).
Numba has no float16 type, so the kernel reads the maps' bits as uint16. Without Numba the NumPy
conversion runs (the same values: test).
"""

from __future__ import annotations

import functools

import numpy as np

from moe_offload.compiled import njit_cached, numba_available

TIE_TOLERANCE = 1e-6  # float32 cosines this close are a tie
TINY = np.float32(1e-30)  # the smallest norm divided by: a zero vector has cosine 0 with anything
SIGNATURE = ("void(float32[:, :, ::1], float32[:, ::1], float32[:, ::1], float32[::1], float32[:, ::1], "
             "int64[:, ::1], int64[::1], float32[::1])")
HALF_GATHER_SIGNATURE = "void(uint16[:, :, ::1], int64[:, ::1], float32[:, :, :, ::1])"
_TOLERANCE = np.float32(TIE_TOLERANCE)


def best_entries(scores: np.ndarray, stamps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``scores`` [B, n]: (column of the highest score, that score), ties within TIE_TOLERANCE
    going to the highest ``stamps`` (broadcast to [B, n]: the most recently stored entry)."""
    if scores.shape[0] == 1:  # one request: the same, without the per-row bookkeeping
        row = scores[0]
        first = row.argmax()
        best = row[first]
        if np.count_nonzero(row >= best - TIE_TOLERANCE) == 1:
            return first.reshape(1), best.reshape(1)
    rows = np.arange(scores.shape[0])
    first = scores.argmax(axis=1)
    best = scores[rows, first]
    tied = scores >= (best - TIE_TOLERANCE)[:, None]
    if np.count_nonzero(tied) == scores.shape[0]:  # one per row: the argmax itself
        return first, best
    index = np.where(tied, stamps, -1).argmax(axis=1)
    return index, scores[rows, index]


def trajectory_step(maps, probs, dots, query_sq, inverse_norms, stamps, best, score):
    """Add one layer: ``maps`` [B, M, J] (the candidates' rows of that layer), ``probs`` [B, J] (the observed
    distributions); updates ``dots`` [B, M] and ``query_sq`` [B] in place and writes, per request, the best
    column ``best`` [B] and its cosine ``score`` [B] (``inverse_norms`` [B, M]: 1 / the candidates' prefix
    norms up to this layer; ``stamps`` [B, M]: their insertion counters). Numba's subset of Python."""
    batch, count, experts = maps.shape
    cosines = np.empty(count, dtype=np.float32)
    for b in range(batch):
        for j in range(experts):
            query_sq[b] += probs[b, j] * probs[b, j]
        norm = max(np.sqrt(query_sq[b]), TINY)
        first = 0
        for m in range(count):
            dot = dots[b, m]
            for j in range(experts):
                dot += maps[b, m, j] * probs[b, j]
            dots[b, m] = dot
            cosines[m] = dot * inverse_norms[b, m] / norm
            if cosines[m] > cosines[first]:
                first = m
        floor = cosines[first] - _TOLERANCE
        pick = first
        for m in range(count):
            if cosines[m] >= floor and stamps[b, m] > stamps[b, pick]:
                pick = m
        best[b] = pick
        score[b] = cosines[pick]


def trajectory_step_numpy(maps, probs, dots, query_sq, inverse_norms, stamps, best, score):
    """``trajectory_step`` with NumPy operations over the B x M candidates, expert by expert (the same float32
    operations in the same order: the same result bit for bit)."""
    for j in range(maps.shape[2]):
        query_sq += probs[:, j] * probs[:, j]
    for j in range(maps.shape[2]):
        dots += maps[:, :, j] * probs[:, j, None]
    cosines = dots * inverse_norms / np.maximum(np.sqrt(query_sq), TINY)[:, None]
    best[:], score[:] = best_entries(cosines, stamps)


@functools.cache
def compiled_trajectory_step():
    """``trajectory_step`` compiled (or loaded from Numba's cache), or the NumPy form without Numba."""
    if not numba_available():
        return trajectory_step_numpy
    return njit_cached(trajectory_step, SIGNATURE)


def gather_half_maps(bits, candidates, out):
    """``out[l, b, m]`` = layer l of the map of stored entry ``candidates[b, m]``, as float32, from ``bits``
    [C, L, J]: the store's float16 maps viewed as uint16 (module docstring). Numba's subset of Python."""
    layers, experts = bits.shape[1], bits.shape[2]
    for b in range(candidates.shape[0]):
        for m in range(candidates.shape[1]):
            entry = candidates[b, m]
            for layer in range(layers):
                row = out[layer, b, m].view(np.uint32)
                for j in range(experts):
                    half = np.uint32(bits[entry, layer, j])
                    sign = (half & 0x8000) << 16
                    exponent = (half >> 10) & 0x1F
                    mantissa = half & 0x3FF
                    if exponent == 0x1F:  # infinity or NaN
                        row[j] = sign | 0x7F800000 | (mantissa << 13)
                    elif exponent != 0:  # normal: rebias the exponent from 15 to 127
                        row[j] = sign | ((exponent + 112) << 23) | (mantissa << 13)
                    elif mantissa == 0:  # signed zero
                        row[j] = sign
                    else:  # subnormal: shift the leading 1 into the implicit bit, lowering the exponent
                        exponent = np.uint32(113)
                        while (mantissa & 0x400) == 0:
                            mantissa <<= 1
                            exponent -= 1
                        row[j] = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13)


def gather_half_maps_numpy(bits, candidates, out):
    """``gather_half_maps`` with NumPy's conversion (the same values)."""
    out[...] = bits.view(np.float16)[candidates].transpose(2, 0, 1, 3)


@functools.cache
def compiled_half_gather():
    """``gather_half_maps`` compiled (or loaded from Numba's cache), or the NumPy form without Numba."""
    if not numba_available():
        return gather_half_maps_numpy
    return njit_cached(gather_half_maps, HALF_GATHER_SIGNATURE)
