"""Belady's OPT: evict the expert whose next request is furthest in the future (offline, optimal)."""

from __future__ import annotations

from moe_offload.policies._ranked import RankedKeys
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


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
        lowest = self._ranked.lowest(ctx.pinned)
        if lowest is None:
            raise NoEvictableExpert
        return lowest[1]
