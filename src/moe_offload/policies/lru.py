"""LRU: evict the expert whose last request is the oldest."""

from __future__ import annotations

from collections import OrderedDict

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class LRU(EvictionPolicy):
    name = "lru"
    summary = "least recently used: evict the expert requested longest ago"
    source = "classic; baseline of papers 001-004 (mixtral-offloading's policy)"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._order: OrderedDict = OrderedDict()  # oldest first

    def on_access(self, key, ctx):
        if key in self._order:
            self._order.move_to_end(key)

    def on_insert(self, key, ctx):
        self._order[key] = None

    def on_evict(self, key):
        del self._order[key]

    def victim(self, ctx):
        for key in self._order:
            if key not in ctx.pinned:
                return key
        raise NoEvictableExpert
