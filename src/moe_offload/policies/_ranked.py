"""A keyed min-priority queue with O(log n) updates, shared by the policies that rank by a score."""

from __future__ import annotations

import heapq
from itertools import count


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
