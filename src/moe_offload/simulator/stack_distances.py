"""Hit rates at every cache size from one pass: LRU's and OPT's stack distances.

LRU and Belady's OPT are stack algorithms (Mattson, Gecsei, Slutz and Traiger, "Evaluation techniques for storage
hierarchies", IBM Systems Journal 9(2), 1970): at every moment the contents of a cache of C experts are the top C
entries of one ordering of the experts seen so far, the *stack*, the same for every C. A request hits a cache of
C experts exactly when its expert's position in the stack before the request (its *stack distance*, counted
from 0) is below C, so the histogram of stack distances gives the hits at every size at once: the hits with C
experts are the requests of distance below C, and a first request (no position yet) misses at every size. Both
hold for the replay of simulator/replay.py exactly: its cache starts empty, loads every miss of these two
policies, and pins nothing (the replay never sets ``AccessContext.pinned``), which is Mattson's demand paging;
the tests check every size against the replay.

**LRU** keeps the stack in order of last use, so the distance of a request is the number of distinct other
experts requested since its expert's previous request (its reuse distance). Each request takes the next of
4D last-use slots (D experts) and marks it, unmarking its expert's previous slot: the distance is the marks
after that slot, the set bits above it in its 64-slot word plus the marks of the later words, summed from a
count per word (a contiguous sum, which the compiler vectorises: on MoE traces most reuses are recent, a few
words back, and even a uniform one over 14,848 experts ran faster than a Fenwick tree's O(log D) walks). The
slots are renumbered (compacted) in one pass over them when they run out, at most once every 3D requests, so
memory stays O(D).

A long sequence splits into parts measured at once, on threads (``LruStack.followed_by``): a part measured
from an empty stack gets every distance right but those of its first request of each expert, and each of
those is fixed by what came before. The i-th expert the later part requests first, k, was last requested
before the part at depth d of the earlier stack (d experts requested since); since then come the i experts the
later part requested first before k, and the d above k in the earlier stack, less those counted in both.

**OPT**'s distances come from the requests before each one, by Bilardi, Ekanadham and Pattnaik's critical
stack algorithm, in O(log D) a request (simulator/opt_stack.py, which derives it); a sequence passes in pieces
there too (``OptStack``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moe_offload.compiled import compile_pays
from moe_offload.simulator.opt_stack import KERNEL_SIGNATURE, OptStack, opt_stack_kernel
from moe_offload.trace.flatten import COLUMN, in_sample


@dataclass(frozen=True)
class HitCurve:
    """The stack distances of one sequence under one policy: its hits at every cache size. A curve measured on
    a sample of the experts (``rate`` < 1, see ``sample_keys``) stands for the whole trace's by scaling the
    sizes: the whole trace's hit rate with C experts is estimated as the sample's with C * rate."""

    histogram: np.ndarray  # [D + 1]: requests per stack distance 0..D-1, then first requests
    rate: float = 1.0      # the share of the experts sampled (1: the exact curve)

    @property
    def exact(self) -> bool:
        return self.rate == 1.0

    @property
    def requests(self) -> int:
        return int(self.histogram.sum())

    @property
    def cold_requests(self) -> int:
        """First requests of an expert: misses of every cache that starts empty."""
        return int(self.histogram[-1])

    def hits_by_size(self) -> np.ndarray:
        """[D + 1]: the hits of a cache of 0, 1, ..., D experts (of the sampled requests if sampled)."""
        return np.concatenate([[0], np.cumsum(self.histogram[:-1])])

    def hits(self, cache_size: int) -> int:
        """The hits with ``cache_size`` experts of an exact curve."""
        if not self.exact:
            raise ValueError("a sampled curve gives hit rates, not hits")
        return int(self.histogram[:max(0, min(cache_size, len(self.histogram) - 1))].sum())

    def hit_rate(self, cache_size: int) -> float:
        return float(self.hit_rates()[max(0, min(cache_size, len(self.histogram) - 1))])

    def hit_rates(self) -> np.ndarray:
        """[D + 1]: the hit rate of a cache of 0, 1, ..., D experts; a sampled curve's at C * rate, between two
        sizes of the sample linearly."""
        hits = self.hits_by_size()
        if self.exact:
            return hits / max(1, self.requests)
        scaled = np.minimum(np.arange(len(hits)) * self.rate, len(hits) - 1)
        return np.interp(scaled, np.arange(len(hits)), hits) / max(1, self.requests)

    def smallest_size(self, target: float) -> int | None:
        """The fewest experts whose cache hits at least ``target`` of the requests, or None when none does: read
        off the curve, which never decreases with the size (the first size at which it reaches the target).
        Exact for an exact curve; an estimate for a sampled one."""
        if self.exact:  # in whole hits: the first size whose hits reach target * requests
            curve, goal = self.hits_by_size(), target * self.requests
        else:
            curve, goal = self.hit_rates(), target
        size = int(np.searchsorted(curve, goal, side="left"))
        return size if size < len(curve) else None


def sample_keys(keys: np.ndarray, rate: float) -> np.ndarray:
    """The requests of ``keys`` whose expert is in a spatial sample of the experts at ``rate`` (SHARDS, Waldspurger
    et al., FAST 2015; trace/flatten.py ``in_sample``): every request of a sampled expert is kept and none of the
    others, so the sample's stack distances are the whole trace's scaled by ``rate`` (HitCurve)."""
    return keys[in_sample(keys, rate)]


SLOTS_PER_KEY = 4  # last-use slots per expert: renumbered every 3 D requests or so (a pass over 4 D slots)


def _marks(word):
    """The set bits of a 64-bit word (uint64), by adding neighbouring counts in place."""
    word = word - ((word >> np.uint64(1)) & np.uint64(0x5555555555555555))
    word = (word & np.uint64(0x3333333333333333)) + ((word >> np.uint64(2)) & np.uint64(0x3333333333333333))
    word = (word + (word >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    word = word + (word >> np.uint64(8))
    word = word + (word >> np.uint64(16))
    word = word + (word >> np.uint64(32))
    return np.int64(word & np.uint64(0x7F))


def reuse_distance_kernel(keys, num_keys, histogram, bits, count, last, owner, state, firsts):
    """Add each request of ``keys`` (flat expert ids in [0, num_keys)) to ``histogram[distance]``, its LRU stack
    (reuse) distance, or to ``histogram[num_keys]`` for a first request; the module docstring derives the
    method. ``bits`` (words of 64 slots, SLOTS_PER_KEY * num_keys slots at least), ``count`` (the marks of each
    word), ``last`` (num_keys times -1), ``owner`` (one per slot: the key whose last use it marks) and ``state``
    ([0]: the slot the next request takes, [1]: the distinct keys seen) carry the stack from one call to the
    next: a long sequence is passed in pieces; ``firsts`` lists the keys in the order of their first request.
    Slots are taken in order, so the marks after a key's slot are those above it in its word and every mark of
    the words after, up to the newest."""
    slots = bits.shape[0] * 64
    following = state[0]
    distinct = state[1]
    one = np.uint64(1)
    for position in range(keys.shape[0]):
        key = keys[position]
        previous = last[key]
        if previous < 0:
            histogram[num_keys] += 1
            firsts[distinct] = key
            distinct += 1
        else:
            word = previous >> 6
            offset = np.uint64(previous & 63)
            marks = _marks((bits[word] >> offset) >> one)
            for later in range(word + 1, ((following - 1) >> 6) + 1):
                marks += count[later]
            histogram[marks] += 1
            bits[word] &= ~(one << offset)
            count[word] -= 1
        if following == slots:  # renumber the live slots 0, 1, ... in their order
            bits[:] = 0
            count[:] = 0
            following = 0
            for slot in range(slots):
                expert = owner[slot]
                if expert >= 0 and last[expert] == slot and expert != key:
                    last[expert] = following
                    owner[following] = expert
                    bits[following >> 6] |= one << np.uint64(following & 63)
                    count[following >> 6] += 1
                    following += 1
            owner[following:] = -1
        last[key] = following
        owner[following] = key
        bits[following >> 6] |= one << np.uint64(following & 63)
        count[following >> 6] += 1
        following += 1
    state[0] = following
    state[1] = distinct


# Requests below which LRU's distances run in plain Python (compiled.py compile_pays): about 7 us a request
# there, so 0.26 s for the bundled OLMoE trace's 38,272, against 0.5 s for its first compile with Numba
# imported, on a quiet 2-core AMD EPYC machine (more on a loaded one). OPT's plain Python takes about 43 us a
# request (1.6 s on that trace), its first compile 4.4 s (2-core AMD EPYC).
REUSE_PYTHON_BELOW = 200_000
OPT_PYTHON_BELOW = 100_000


@functools.cache
def _reuse_kernel():
    """reuse_distance_kernel compiled by Numba (which must be installed)."""
    from moe_offload.simulator.kernels import compile_linked

    return compile_linked(reuse_distance_kernel,
                          "void(int32[::1], int64, int64[::1], uint64[::1], int64[::1], int64[::1], int64[::1], "
                          "int64[::1], int64[::1])")


@functools.cache
def _opt_kernel():
    """opt_stack_kernel compiled by Numba (which must be installed)."""
    from moe_offload.simulator.kernels import compile_linked

    return compile_linked(opt_stack_kernel, KERNEL_SIGNATURE)


class LruStack:
    """LRU's stack distances of a sequence passed in pieces (``add``), in memory that does not grow with it;
    ``requests``, the sequence's length where it is known, chooses the kernel (REUSE_PYTHON_BELOW)."""

    def __init__(self, num_keys: int, requests: int | None = None):
        self.num_keys = num_keys
        self.histogram = np.zeros(num_keys + 1, np.int64)
        words = (SLOTS_PER_KEY * num_keys + 63) // 64
        self._bits = np.zeros(words, np.uint64)
        self._count = np.zeros(words, np.int64)
        self._last = np.full(num_keys, -1, np.int64)
        self._owner = np.full(64 * words, -1, np.int64)
        self._state = np.zeros(2, np.int64)
        self._firsts = np.zeros(num_keys, np.int64)
        compiled = compile_pays(REUSE_PYTHON_BELOW if requests is None else requests, REUSE_PYTHON_BELOW)
        self._kernel = _reuse_kernel() if compiled else reuse_distance_kernel

    def add(self, keys: np.ndarray) -> None:
        """The next requests of the sequence (flat expert ids below ``num_keys``)."""
        self._kernel(np.ascontiguousarray(keys, COLUMN), self.num_keys, self.histogram, self._bits, self._count,
                     self._last, self._owner, self._state, self._firsts)

    def curve(self) -> HitCurve:
        return HitCurve(self.histogram.copy())

    def followed_by(self, later: "LruStack") -> np.ndarray:
        """The histogram of this stack's sequence followed by ``later``'s, ``later`` measured from an empty
        stack (the module docstring derives it): ``later``'s first requests resolved against this stack, in
        O(D log D) over a Fenwick tree of this stack's depths."""
        num_keys = self.num_keys
        histogram = self.histogram + later.histogram
        firsts = later._firsts[:later._state[1]]
        histogram[num_keys] -= firsts.size
        seen = np.flatnonzero(self._last >= 0)
        depth = np.full(num_keys, -1, np.int64)
        depth[seen[np.argsort(-self._last[seen])]] = np.arange(seen.size)  # 0: the last requested (slots differ)
        tree = [0] * (seen.size + 1)  # at depth + 1: 1 where the later part requested that expert already
        for i, d in enumerate(depth[firsts].tolist()):
            if d < 0:  # never requested before the part: a first request of the whole sequence
                histogram[num_keys] += 1
                continue
            above, j = 0, d  # of the d experts above it, those the later part requested before it
            while j > 0:
                above += tree[j]
                j -= j & -j
            histogram[i + d - above] += 1
            j = d + 1
            while j <= seen.size:
                tree[j] += 1
                j += j & -j
        return histogram


def lru_curve(keys: np.ndarray, num_keys: int) -> HitCurve:
    """LRU's hits at every size on the request sequence ``keys`` (flat expert ids below ``num_keys``)."""
    stack = LruStack(num_keys, len(keys))
    stack.add(keys)
    return stack.curve()


def opt_curve(keys: np.ndarray, num_keys: int, rate: float = 1.0) -> HitCurve:
    """OPT's hits at every size on ``keys``; with ``rate`` below 1, on the spatial sample of the experts at that
    rate (``sample_keys``)."""
    if rate < 1.0:
        keys = sample_keys(keys, rate)
    stack = OptStack(num_keys, _opt_kernel() if compile_pays(len(keys), OPT_PYTHON_BELOW) else opt_stack_kernel)
    stack.add(keys)
    return HitCurve(stack.histogram, rate=rate)
