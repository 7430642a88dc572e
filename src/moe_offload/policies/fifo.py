"""FIFO: evict the expert that entered the cache first; hits do not reorder."""

from __future__ import annotations

from collections import OrderedDict

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class FIFO(EvictionPolicy):
    name = "fifo"
    summary = "first in, first out: evict the expert resident the longest"
    source = "classic"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._order: OrderedDict = OrderedDict()  # insertion order

    def on_insert(self, key, ctx):
        self._order[key] = None

    def on_evict(self, key):
        del self._order[key]

    def victim(self, ctx):
        for key in self._order:
            if key not in ctx.pinned:
                return key
        raise NoEvictableExpert
