"""A keyed min-priority queue with O(log n) updates, shared by the policies that rank by a score, and its
twin for the compiled replay kernels."""

from __future__ import annotations

import heapq
from itertools import count

import numpy as np

from moe_offload.policies.base import NoEvictableExpert


class RankedKeys:
    """Keys ordered by score, lowest first; among equal scores the key whose score was set earliest comes
    first. ``set`` re-scores a key in O(log n) by pushing a fresh entry and forgetting the old one
    (lazy deletion); the heap is rebuilt when stale entries outnumber live ones."""

    __slots__ = ("_heap", "_stamp", "_counter")

    def __init__(self):
        self._heap: list = []
        self._stamp: dict = {}  # key -> stamp of its live entry
        self._counter = count()

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key) -> bool:
        return key in self._stamp

    def set(self, key, score) -> None:
        stamp = next(self._counter)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (score, stamp, key))
        if len(self._heap) > 2 * len(self._stamp) + 64:
            self._heap = [entry for entry in self._heap if self._stamp.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)

    def rescore_all(self, score_of) -> None:
        """Give every key the score ``score_of(key)``, keeping, among equal scores, the order in which their
        scores were last set."""
        keys = sorted(self._stamp, key=self._stamp.get)
        self._heap, self._stamp = [], {}
        for key in keys:
            self.set(key, score_of(key))

    def discard(self, key) -> None:
        self._stamp.pop(key, None)

    def lowest(self, pinned=()):
        """(score, key) of the lowest-scored key not in ``pinned``, or None if there is none."""
        heap, stamp = self._heap, self._stamp
        skipped = []
        found = None
        while heap:
            entry = heap[0]
            if stamp.get(entry[2]) != entry[1]:
                heapq.heappop(heap)  # stale
                continue
            if entry[2] in pinned:
                skipped.append(heapq.heappop(heap))
                continue
            found = (entry[0], entry[2])
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def victim(self, pinned=()):
        """The lowest-scored key not in ``pinned``: a ranking policy's victim; NoEvictableExpert if none."""
        lowest = self.lowest(pinned)
        if lowest is None:
            raise NoEvictableExpert
        return lowest[1]


# ------------------------------------------------------------------------------------- the kernels' twin
# The same order for the compiled replay kernels (simulator/kernels.py), in the subset of Python that Numba
# compiles: an indexed binary min-heap over flat expert ids, ordered by (score, stamp). The kernels stamp a
# key with the clock of the request that set its score, so "among equal scores the earliest set first" is
# RankedKeys' order exactly. A heap is four arrays, (keys in heap order, their scores, their stamps, each
# key's position or -1), that heap_new makes and the functions take one by one: passed as one tuple, unpacked
# in every step of a sift, they made a heap-ranked kernel 1.7x slower (measured in one process). The caller keeps
# the size (in the kernels, the number of resident experts). Sifting moves a hole rather than swapping, which
# halves the writes.


def heap_new(capacity, num_keys):
    """An empty heap for up to ``capacity`` of the keys 0 .. num_keys-1: (keys, scores, stamps, position)."""
    return (np.empty(max(capacity, 1), np.int64), np.empty(max(capacity, 1), np.float64),
            np.empty(max(capacity, 1), np.int64), np.full(num_keys, -1, np.int64))


def _heap_place(keys, scores, stamps, position, i, key, score, stamp):
    keys[i] = key
    scores[i] = score
    stamps[i] = stamp
    position[key] = i


def _heap_sift(keys, scores, stamps, position, size, i, key, score, stamp):
    """Put (key, score, stamp) in the hole at ``i`` of a heap of ``size``, moving it up or down to its place."""
    moved = False
    while i > 0:
        parent = (i - 1) // 2
        if not (score < scores[parent] or (score == scores[parent] and stamp < stamps[parent])):
            break
        _heap_place(keys, scores, stamps, position, i, keys[parent], scores[parent], stamps[parent])
        i = parent
        moved = True
    while not moved:
        child = 2 * i + 1
        if child >= size:
            break
        right = child + 1
        if right < size and (scores[right] < scores[child]
                             or (scores[right] == scores[child] and stamps[right] < stamps[child])):
            child = right
        if not (scores[child] < score or (scores[child] == score and stamps[child] < stamp)):
            break
        _heap_place(keys, scores, stamps, position, i, keys[child], scores[child], stamps[child])
        i = child
    _heap_place(keys, scores, stamps, position, i, key, score, stamp)


def heap_push(keys, scores, stamps, position, size, key, score, stamp):
    """Add ``key`` to a heap of ``size`` keys (then ``size + 1``); ``stamp`` exceeds every earlier stamp."""
    _heap_sift(keys, scores, stamps, position, size + 1, size, key, score, stamp)


def heap_update(keys, scores, stamps, position, size, key, score, stamp):
    """Give ``key``, in a heap of ``size`` keys, a new score, stamped ``stamp``."""
    _heap_sift(keys, scores, stamps, position, size, position[key], key, score, stamp)


def heap_settle(keys, scores, stamps, position, size, score_of, stamp_of):
    """The first key of a heap whose entries may lag their keys: re-keys the first key to (``score_of[key]``,
    ``stamp_of[key]``) until its entry is current, and returns it. When keys' scores and stamps only grow and
    are re-keyed lazily (a hit raises the key's count and stamp, not its entry), every entry is a lower bound of
    its key; a first entry that is current is then at most every entry and so every key: the lowest, as if
    every key had been re-keyed at once. A key is re-keyed once however many hits it had since."""
    key = keys[0]
    while scores[0] != score_of[key] or stamps[0] != stamp_of[key]:
        _heap_sift(keys, scores, stamps, position, size, 0, key, score_of[key], stamp_of[key])
        key = keys[0]
    return key


def heap_pop(keys, scores, stamps, position, size):
    """Remove and return the first key of a heap of ``size`` keys (then ``size - 1``): the lowest score, the
    earliest stamp among equals."""
    first = keys[0]
    last = size - 1
    _heap_sift(keys, scores, stamps, position, last, 0, keys[last], scores[last], stamps[last])
    position[first] = -1  # after the sift, which puts the last key back at 0 when it was the only one
    return first


def heap_replace_first(keys, scores, stamps, position, size, key, score, stamp):
    """Take the first key out of a full heap of ``size`` keys and add ``key`` (not in it) with (``score``,
    ``stamp``): one sift from the root, where a pop and a push would sift the last key down and the new one
    up. Returns the key taken out. A replay's miss in a full cache: the victim leaves, the request enters."""
    first = keys[0]
    position[first] = -1
    position[key] = 0
    _heap_sift(keys, scores, stamps, position, size, 0, key, score, stamp)
    return first


def heap_remove(keys, scores, stamps, position, size, key):
    """Take ``key`` out of a heap of ``size`` keys (then ``size - 1``): the last entry fills its hole."""
    i = position[key]
    position[key] = -1
    last = size - 1
    if i < last:
        _heap_sift(keys, scores, stamps, position, last, i, keys[last], scores[last], stamps[last])
