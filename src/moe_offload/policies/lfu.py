"""LFU: evict the expert requested least often since it entered the cache (ties: least recently)."""

from __future__ import annotations

import numpy as np

from moe_offload.policies._ranked import RankedKeys, heap_new, heap_push, heap_replace_first, heap_settle
from moe_offload.policies.base import EvictionPolicy


class LFU(EvictionPolicy):
    name = "lfu"
    summary = "least frequently used: evict the expert with the fewest requests while cached, ties by LRU"
    source = "classic; baseline of papers 002 and 003 (counts reset on eviction, as paper 002 describes)"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._freq: dict = {}
        self._ranked = RankedKeys()

    def on_access(self, key, ctx):
        freq = self._freq.get(key)
        if freq is not None:
            self._freq[key] = freq + 1
            self._ranked.set(key, freq + 1)

    def on_insert(self, key, ctx):
        freq = 0 if ctx.prefetch else 1  # a demand miss is the first use; a prefetch is not a use
        self._freq[key] = freq
        self._ranked.set(key, freq)

    def on_evict(self, key):
        del self._freq[key]
        self._ranked.discard(key)

    def victim(self, ctx):
        return self._ranked.victim(ctx.pinned)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: the same (count, last set) order in a heap whose
        entries a hit leaves behind, settled when a victim is taken (_ranked.heap_settle)."""
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        freq = np.zeros(num_keys, np.int64)  # 0: not resident
        last_set = np.zeros(num_keys, np.int64)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if freq[key] > 0:
                key_hits[key] += 1
                freq[key] += 1
                last_set[key] = t
                continue
            freq[key] = 1
            last_set[key] = t
            if size == capacity:  # the victim leaves and the request enters in one sift
                heap_settle(order, scores, stamps, position, size, freq, last_set)
                freq[heap_replace_first(order, scores, stamps, position, size, key, 1, t)] = 0
            else:
                heap_push(order, scores, stamps, position, size, key, 1, t)
                size += 1
