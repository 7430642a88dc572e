"""FIFO: evict the expert that entered the cache first; hits do not reorder."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_remove, lists_new
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

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: one linked list in insertion order."""
        order = lists_new(num_layers * num_experts, 1)
        resident = np.zeros(num_layers * num_experts, np.bool_)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if resident[key]:
                key_hits[key] += 1
                continue
            if size == capacity:
                victim = list_head(order, 0)
                list_remove(order, 0, victim)
                resident[victim] = False
                size -= 1
            list_append(order, 0, key)
            resident[key] = True
            size += 1
