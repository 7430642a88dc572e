"""Neighbor-aware caching, paper 002's third caching baseline (section 8.4): "an approach adopted by
ZeRO-Infinity which enforces the neighbors of experts to be cached together".

ZeRO-Infinity moves parameters in contiguous partitions, so an expert's neighbors are the experts stored next
to it: here the ``group`` consecutive expert ids of one layer that share ``expert // group`` (with the
default 2: experts 0 and 1 of a layer, 2 and 3, ...). Being cached together means aging together: the
recency of a group is that of its most recently requested member, a request of any member refreshes the whole
group, and a miss evicts a member of the least recently requested group that has one resident (the next miss
takes its other members first, so a group leaves as it entered: as one). With ``group=1`` this is LRU.
"""

from __future__ import annotations

from collections import OrderedDict

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import integer


class NeighborAware(EvictionPolicy):
    name = "neighbor-aware"
    summary = "ZeRO-Infinity's neighbor-aware LRU: neighboring experts age together and leave together"
    source = "paper 002, section 8.4 (neighbor-aware caching baseline)"

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
