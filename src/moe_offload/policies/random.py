"""Random: evict a uniformly random resident expert (seeded, so runs repeat)."""

from __future__ import annotations

import random as _random

import numpy as np

from moe_offload.policies._seeded import draw_below, mt_draw_below, rng_state
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class RandomEviction(EvictionPolicy):
    name = "random"
    seeded = True
    summary = "evict a uniformly random resident expert (seeded)"
    source = "classic; the RND baseline of paper 004"
    replay_cost = 1.5  # LRU replays a kernel run costs (base.py)

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
            key = keys[draw_below(self._rng, len(keys))]
            if key not in pinned:
                return key
        candidates = [key for key in keys if key not in pinned]
        if not candidates:
            raise NoEvictableExpert
        return candidates[draw_below(self._rng, len(candidates))]

    def kernel_arguments(self):
        return np.zeros(0, np.float64), rng_state(self._rng)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: the same list of residents (appended, removed by
        moving the last one into the gap) and the same draws from the generator whose state is ``ints``."""
        residents = np.empty(max(capacity, 1), np.int64)
        position = np.full(num_layers * num_experts, -1, np.int64)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if position[key] >= 0:
                key_hits[key] += 1
                continue
            if size == capacity:
                victim = residents[mt_draw_below(ints, size)]
                gap = position[victim]
                size -= 1
                residents[gap] = residents[size]
                position[residents[gap]] = gap
                position[victim] = -1
            residents[size] = key
            position[key] = size
            size += 1
