"""Neighbor-aware caching, paper 002's third caching baseline (section 8.4): "an approach adopted by
ZeRO-Infinity which enforces the neighbors of experts to be cached together".

ZeRO-Infinity moves parameters in contiguous partitions, so an expert's neighbors are the experts stored next
to it: here the ``group`` consecutive expert ids of one layer that share ``expert // group`` (with the
default 2: experts 0 and 1 of a layer, 2 and 3, ...). Being cached together means aging together: the
recency of a group is that of its most recently requested member, a request of any member refreshes the whole
group, and a miss evicts a member of the least recently requested group that has one resident (the next miss
takes its other members first, so a group leaves as it entered: as one). With ``group=1`` this is LRU.

The compiled replay (``replay_kernel``) numbers the groups layer * ceil(J / group) + expert // group, keeps
those with a resident member in one linked list by recency (policies/_linked.py) and counts each one's
resident members; the lowest resident member is found by walking the group's ids up from its first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import integer


class NeighborAware(EvictionPolicy):
    name = "neighbor-aware"
    summary = "ZeRO-Infinity's neighbor-aware LRU: neighboring experts age together and leave together"
    source = "paper 002, section 8.4 (neighbor-aware caching baseline)"
    replay_cost = 2.7  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0, group: int = 2):
        super().__init__(spec, seed)
        self.group = integer(group, f"{self.name}.group", low=1)
        self._groups: OrderedDict = OrderedDict()  # group -> its resident keys, least recently requested first

    def _group_of(self, key):
        layer, expert = divmod(key, self.spec.num_experts)
        return layer, expert // self.group

    def on_access(self, key, ctx):
        group = self._group_of(key)
        if group in self._groups:
            self._groups.move_to_end(group)

    def on_insert(self, key, ctx):
        group = self._group_of(key)
        self._groups.setdefault(group, set()).add(key)
        self._groups.move_to_end(group)

    def on_evict(self, key):
        group = self._group_of(key)
        members = self._groups[group]
        members.discard(key)
        if not members:
            del self._groups[group]

    def victim(self, ctx):
        for members in self._groups.values():
            free = [key for key in members if key not in ctx.pinned]
            if free:
                return min(free)
        raise NoEvictableExpert

    def kernel_arguments(self):
        return np.zeros(0, np.float64), np.array([self.group], np.int64)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: the groups with a resident member in a linked list,
        least recently requested first, and the count of each one's resident members; ``ints[0]`` is the
        group size."""
        group = ints[0]
        per_layer = (num_experts + group - 1) // group
        groups = lists_new(num_layers * per_layer, 1)
        members = np.zeros(num_layers * per_layer, np.int64)
        resident = np.zeros(num_layers * num_experts, np.bool_)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            layer = key // num_experts
            own = layer * per_layer + (key - layer * num_experts) // group
            if members[own] > 0:  # a request of any member refreshes the group, hit or miss
                list_move_to_tail(groups, 0, own)
            if resident[key]:
                key_hits[key] += 1
                continue
            if size == capacity:
                oldest = list_head(groups, 0)
                victim = (oldest // per_layer) * num_experts + (oldest % per_layer) * group
                while not resident[victim]:
                    victim += 1
                resident[victim] = False
                members[oldest] -= 1
                if members[oldest] == 0:
                    list_remove(groups, 0, oldest)
                size -= 1
            if members[own] == 0:
                list_append(groups, 0, own)
            else:
                list_move_to_tail(groups, 0, own)
            members[own] += 1
            resident[key] = True
            size += 1
