"""A coarse quantizer over the Expert Map Store's semantic keys (an inverted-file index, IVF), so that the
semantic search reads a fraction of the keys instead of all of them.

Why. The exhaustive semantic search reads every stored key once per iteration, so its time cannot drop below
the store's key bytes over the memory bandwidth (benchmarks/map_search.py prints that floor): at 50,000 maps
with 32-wide keys, 6.4 MB, about 0.4 ms here. The index partitions the keys into N lists, one per centroid
of a spherical k-means over the keys (every key in the list of its nearest centroid by cosine); a search
scores the N centroids and reads only the keys of the ``probes`` lists whose centroids are nearest the query
(more, in that order, until at least ``minimum`` keys are read): about probes / N of the keys, plus the N
centroids. It is approximate: the best key may sit in a list it does not probe (the README measures what
that costs in predictions).

Training. The centroids are the k-means centroids of the keys stored at the time: N seeds drawn without
replacement by a generator seeded with ``seed`` (so one seed and one store give one index), then
TRAIN_ITERATIONS Lloyd iterations, each centroid the normalised sum of its members (an empty list keeps its
centroid), over a sample of at most SAMPLE_PER_LIST * N keys. It runs when the store first holds
MIN_KEYS_PER_LIST * N keys and again whenever the store has doubled since (at most log2(capacity) times,
each a one-off of a few products of the sample with the centroids); until then the caller searches
exhaustively. Between trainings each written key joins the list of its nearest centroid, leaving its
previous list when it replaces a stored key.

Layout. Each list keeps its slots and a copy of their keys side by side ([N, width] and [N, width, D], width
grown by doubling, a list's members in its first ``count`` columns), so a search streams P contiguous blocks
of keys: gathering the same keys from the store's slot order would be some thousand random reads, slower
than streaming all of them. The copy costs the keys' memory again, times the padding up to the longest list.
"""

from __future__ import annotations

import numpy as np

MIN_KEYS_PER_LIST = 8
SAMPLE_PER_LIST = 64
TRAIN_ITERATIONS = 10


def _unit_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.sqrt((vectors * vectors).sum(axis=1, keepdims=True))
    return np.divide(vectors, norms, out=vectors.copy(), where=norms > 0)


class CoarseIndex:
    """The lists of the slots of a store's unit keys; see the module docstring."""

    def __init__(self, lists: int, probes: int, seed: int):
        self.lists, self.probes, self.seed = lists, probes, seed
        self.trained_size = 0  # store size at the last training (0: never trained)
        self.centroids: np.ndarray | None = None  # [N, D] unit
        self._list_of = np.full(0, -1, dtype=np.int64)  # per slot: its list, -1 for none
        self._position = np.zeros(0, dtype=np.int64)  # per slot: its column in its list's row of _members
        self._members = np.zeros((lists, 0), dtype=np.int64)  # [N, width]: the slots of each list
        self._keys = np.zeros((lists, 0, 0), dtype=np.float32)  # [N, width, D]: their keys
        self._counts = np.zeros(lists, dtype=np.int64)

    def due(self, size: int) -> bool:
        """Whether a store of ``size`` keys should (re)train its index now."""
        return size >= max(MIN_KEYS_PER_LIST * self.lists, 2 * self.trained_size)

    def train(self, keys: np.ndarray) -> None:
        """Rebuild the centroids and the lists from every stored key, ``keys`` [size, D] (slot order)."""
        size = keys.shape[0]
        rng = np.random.default_rng(self.seed)
        sample = keys
        if size > SAMPLE_PER_LIST * self.lists:
            sample = keys[np.sort(rng.choice(size, SAMPLE_PER_LIST * self.lists, replace=False))]
        centroids = sample[rng.choice(sample.shape[0], self.lists, replace=False)].copy()
        membership = np.zeros((self.lists, sample.shape[0]), dtype=np.float32)
        for _ in range(TRAIN_ITERATIONS):
            assignment = (sample @ centroids.T).argmax(axis=1)
            membership[:] = 0.0
            membership[assignment, np.arange(sample.shape[0])] = 1.0
            sums = membership @ sample
            filled = membership.any(axis=1)
            centroids[filled] = _unit_rows(sums[filled])
        self.centroids = centroids
        self.trained_size = size
        assignment = (keys @ centroids.T).argmax(axis=1)
        self._counts = np.bincount(assignment, minlength=self.lists)
        self._members = np.zeros((self.lists, max(int(self._counts.max()), 1)), dtype=np.int64)
        order = np.argsort(assignment, kind="stable")
        starts = np.r_[0, np.cumsum(self._counts)[:-1]]
        self._list_of = assignment.astype(np.int64)
        self._position = np.empty(size, dtype=np.int64)
        self._position[order] = np.arange(size) - np.repeat(starts, self._counts)
        self._members[self._list_of[order], self._position[order]] = order
        self._keys = np.zeros(self._members.shape + (keys.shape[1],), dtype=np.float32)
        self._keys[self._list_of[order], self._position[order]] = keys[order]

    def assign(self, slot: int, key: np.ndarray) -> None:
        """Key ``key`` [D] (unit) was written to ``slot``: it joins its nearest list (no-op before training)."""
        if self.centroids is None:
            return
        if slot >= self._list_of.size:
            grown = max(slot + 1, 2 * self._list_of.size)
            self._list_of = np.r_[self._list_of, np.full(grown - self._list_of.size, -1, dtype=np.int64)]
            self._position = np.r_[self._position, np.zeros(grown - self._position.size, dtype=np.int64)]
        new, old = int((self.centroids @ key).argmax()), int(self._list_of[slot])
        if new == old:
            self._keys[new, self._position[slot]] = key
            return
        if old >= 0:  # the last member of the old list takes the leaving slot's column
            last = int(self._counts[old]) - 1
            moved = int(self._members[old, last])
            column = int(self._position[slot])
            self._members[old, column] = moved
            self._keys[old, column] = self._keys[old, last]
            self._position[moved] = column
            self._counts[old] = last
        if self._counts[new] == self._members.shape[1]:
            self._members = np.concatenate([self._members, np.zeros_like(self._members)], axis=1)
            self._keys = np.concatenate([self._keys, np.zeros_like(self._keys)], axis=1)
        self._members[new, self._counts[new]] = slot
        self._keys[new, self._counts[new]] = key
        self._position[slot] = self._counts[new]
        self._counts[new] += 1
        self._list_of[slot] = new

    def search(self, key: np.ndarray, minimum: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots, their cosines with ``key`` [D] (unit)) over the keys a search reads: those of the ``probes``
        lists of nearest centroid, and of the next nearest until there are at least ``minimum`` (all keys if
        the store has fewer)."""
        order = np.argsort(-(self.centroids @ key), kind="stable")
        reached = np.cumsum(self._counts[order])
        count = max(self.probes, int(np.searchsorted(reached, minimum)) + 1)
        counts, members, keys = self._counts, self._members, self._keys
        rows = [(row, counts[row]) for row in order[:count].tolist()]
        return (np.concatenate([members[row, :size] for row, size in rows]),
                np.concatenate([keys[row, :size] @ key for row, size in rows]))

    def expected_fraction(self) -> float:
        """The fraction of the keys a search reads on average if the lists were of equal size: probes / N."""
        return min(1.0, self.probes / self.lists)
