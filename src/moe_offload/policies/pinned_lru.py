"""Pinned hot set plus LRU: the most frequent experts of a profile are resident for the whole run and never
evicted; the rest of the cache is an LRU cache of the other experts (the "pin the hottest half" variant
that users of llama.cpp's and ktransformers' static placements try).

The rule. With room for C experts and a pinned share s, the P = floor(s * C) keys of largest profile count
(the run's own trace in hindsight when ``profile`` is not given; ties: the lower key) are loaded before the
first access and never leave; the other C - P slots run LRU: a miss is always admitted and evicts the
unpinned resident whose last request is the oldest. s = 0 is LRU; s = 1 is static-freq, except that with
C - P = 0 no slot is left for a miss to be loaded into, so s must leave one (P < C).
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies._profile import expert_counts, load_profile_trace, most_frequent
from moe_offload.policies.base import NoEvictableExpert
from moe_offload.policies.lru import LRU
from moe_offload.values import number


class PinnedLRU(LRU):
    name = "pinned-lru"
    summary = "the most frequent experts of a profile pinned (pinned_share of the cache), LRU for the rest"
    source = "the 'pin the hottest experts' variant of llama.cpp / ktransformers static placement, plus LRU"
    places_or_bypasses = True  # LRU's kernel, given the hot set (run_kernel_arguments), starts from it

    def __init__(self, spec, seed=0, profile=None, pinned_share=0.5):
        super().__init__(spec, seed)
        self.pinned_share = number(pinned_share, "pinned-lru.pinned_share", low=0.0, high=1.0, high_open=True)
        self.profile = None if profile is None else load_profile_trace(profile, spec, "pinned-lru.profile")

    @property
    def in_hindsight(self):
        return self.profile is None

    def placement(self, slots, trace):
        pinned = int(self.pinned_share * slots)
        if pinned >= slots:
            raise ConfigError(f"pinned-lru.pinned_share {self.pinned_share}: pinning {pinned} of {slots} experts "
                              "leaves no slot for the LRU part")
        source = self.profile if self.profile is not None else trace
        self.fixed = frozenset(most_frequent(expert_counts(source, self.spec), pinned, self.spec))
        return sorted(self.fixed)

    def on_insert(self, key, ctx):
        if key not in self.fixed:  # the pinned set is outside the LRU order: never a victim
            super().on_insert(key, ctx)

    def on_evict(self, key):
        self._order.pop(key, None)

    def victim(self, ctx):
        for key in self._order:
            if key not in ctx.pinned:
                return key
        raise NoEvictableExpert
