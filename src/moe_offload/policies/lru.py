"""LRU: evict the expert whose last request is the oldest."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
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

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: one linked list in request order. The experts of
        ``ints`` (pinned-lru's hot set; none for LRU) are resident from the start and never in the list."""
        order = lists_new(num_layers * num_experts, 1)
        resident = np.zeros(num_layers * num_experts, np.uint8)  # 1: in the list, 2: fixed
        for key in ints:
            resident[key] = 2
        size = ints.shape[0]
        for t in range(keys.shape[0]):
            key = keys[t]
            if resident[key]:
                key_hits[key] += 1
                if resident[key] == 1:
                    list_move_to_tail(order, 0, key)
                continue
            if size == capacity:
                victim = list_head(order, 0)
                list_remove(order, 0, victim)
                resident[victim] = 0
                size -= 1
            list_append(order, 0, key)
            resident[key] = 1
            size += 1
