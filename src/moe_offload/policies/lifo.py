"""LIFO: evict the expert that entered the cache last; hits do not reorder.

FlashMoE (paper 003) lists it beside FIFO among its baselines. The newest resident that may be evicted goes,
so the experts that filled the cache first stay for good and every later miss cycles through the remaining
slot(s): a stack. When the newest is pinned (the current layer computes with it), the next newest goes.
"""

from __future__ import annotations

import numpy as np

from moe_offload.policies._linked import list_append, list_remove, lists_new
from moe_offload.policies.base import NoEvictableExpert
from moe_offload.policies.fifo import FIFO


class LIFO(FIFO):
    """FIFO's insertion order (its hooks), evicting from the other end."""

    name = "lifo"
    summary = "last in, first out: evict the expert that entered the cache most recently"
    source = "classic; baseline of paper 003"

    def victim(self, ctx):
        for key in reversed(self._order):
            if key not in ctx.pinned:
                return key
        raise NoEvictableExpert

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: one linked list in insertion order, evicting
        at its tail."""
        order = lists_new(num_layers * num_experts, 1)
        ends = order[2]
        resident = np.zeros(num_layers * num_experts, np.bool_)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if resident[key]:
                key_hits[key] += 1
                continue
            if size == capacity:
                victim = ends[0, 1]
                list_remove(order, 0, victim)
                resident[victim] = False
                size -= 1
            list_append(order, 0, key)
            resident[key] = True
            size += 1
