"""Belady's OPT: evict the expert whose next request is furthest in the future (offline, optimal)."""

from __future__ import annotations

import numpy as np

from moe_offload.policies._ranked import RankedKeys, heap_new, heap_push, heap_replace_first, heap_update
from moe_offload.policies.base import EvictionPolicy


class Belady(EvictionPolicy):
    name = "belady"
    summary = "Belady's OPT: evict the expert requested again furthest in the future (offline bound)"
    source = "Belady 1966; the OPT of paper 001, the target of paper 003's learned policy"
    offline = True

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._ranked = RankedKeys()  # score = -next_use, so the furthest comes first

    def on_access(self, key, ctx):
        if key in self._ranked:
            self._ranked.set(key, -ctx.next_use)

    def on_insert(self, key, ctx):
        self._ranked.set(key, -ctx.next_use)

    def on_evict(self, key):
        self._ranked.discard(key)

    def victim(self, ctx):
        return self._ranked.victim(ctx.pinned)

    @staticmethod
    def replay_kernel(keys, clocks, tokens, next_use, capacity, num_layers, num_experts, floats, ints,
                      layer_hits):
        """The hooks above as the compiled replay runs them: the same (-next use, last set) order in a heap.
        A next use is below 2**53, so its float is exact; experts never used again (NEVER) tie, as above."""
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        resident = np.zeros(num_keys, np.bool_)
        size = 0
        for t in clocks:
            key = keys[t]
            score = -float(next_use[t])
            if resident[key]:
                layer_hits[key // num_experts] += 1
                heap_update(order, scores, stamps, position, size, key, score, t)
                continue
            resident[key] = True
            if size == capacity:  # the victim leaves and the request enters in one sift
                resident[heap_replace_first(order, scores, stamps, position, size, key, score, t)] = False
            else:
                heap_push(order, scores, stamps, position, size, key, score, t)
                size += 1
