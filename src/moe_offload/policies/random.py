"""Random: evict a uniformly random resident expert (seeded, so runs repeat)."""

from __future__ import annotations

import random as _random

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class RandomEviction(EvictionPolicy):
    name = "random"
    summary = "evict a uniformly random resident expert (seeded)"
    source = "classic; the RND baseline of paper 004"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._rng = _random.Random(seed)
        self._keys: list = []
        self._index: dict = {}  # key -> position in _keys, for O(1) removal

    def on_insert(self, key, ctx):
        self._index[key] = len(self._keys)
        self._keys.append(key)

    def on_evict(self, key):
        position = self._index.pop(key)
        last = self._keys.pop()
        if last != key:
            self._keys[position] = last
            self._index[last] = position

    def victim(self, ctx):
        keys, pinned = self._keys, ctx.pinned
        for _ in range(16):  # pinned experts are few; rejection sampling stays uniform over the others
            key = keys[self._rng.randrange(len(keys))]
            if key not in pinned:
                return key
        candidates = [key for key in keys if key not in pinned]
        if not candidates:
            raise NoEvictableExpert
        return self._rng.choice(candidates)
