"""Randomized Marking (Fiat, Karp, Luby, McGeoch, Sleator, Young 1991; paper 001's reference [13]).

A requested expert is marked. On a miss with every resident expert marked, a new phase starts and all
marks are cleared. The victim is chosen uniformly at random among the unmarked experts. H_k-competitive.
"""

from __future__ import annotations

import random as _random

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class Marking(EvictionPolicy):
    name = "marking"
    summary = "randomized marking: evict a random unmarked expert, unmark all when every one is marked"
    source = "paper 001 reference [13] (Fiat et al. 1991)"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._rng = _random.Random(seed)
        self._marked: set = set()
        self._unmarked: list = []
        self._index: dict = {}  # unmarked key -> position in _unmarked

    def _unmark_remove(self, key):
        position = self._index.pop(key)
        last = self._unmarked.pop()
        if last != key:
            self._unmarked[position] = last
            self._index[last] = position

    def on_access(self, key, ctx):
        if key in self._index:
            self._unmark_remove(key)
            self._marked.add(key)

    def on_insert(self, key, ctx):
        if ctx.prefetch:  # prefetched but not yet requested: not marked
            self._index[key] = len(self._unmarked)
            self._unmarked.append(key)
        else:
            self._marked.add(key)

    def on_evict(self, key):
        if key in self._index:
            self._unmark_remove(key)
        else:
            self._marked.discard(key)

    def victim(self, ctx):
        pinned = ctx.pinned
        candidates = [key for key in self._unmarked if key not in pinned] if pinned else self._unmarked
        if not candidates:  # every evictable expert is marked: a new phase begins
            for key in self._marked:
                self._index[key] = len(self._unmarked)
                self._unmarked.append(key)
            self._marked.clear()
            candidates = [key for key in self._unmarked if key not in pinned] if pinned else self._unmarked
            if not candidates:
                raise NoEvictableExpert
        return candidates[self._rng.randrange(len(candidates))]
