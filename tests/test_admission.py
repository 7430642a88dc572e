"""Admission in the shared cache, by hand: a bypassed miss is served where the expert lives and changes
nothing in the cache; a static placement is loaded before the first access; the replay counts bypassed
requests apart from hits and misses."""

from __future__ import annotations

from moe_offload.policies import AccessContext, ModelSpec
from moe_offload.policies.lru import LRU
from moe_offload.simulator.cache import BYPASSED, HIT, LOADED, ExpertCache
from moe_offload.simulator.partitioned_cache import PartitionedCache

SPEC = ModelSpec(num_layers=2, num_experts=4, top_k=1)


class OddOnly(LRU):
    """LRU that admits only odd keys and places key 1 before the first access: a test double."""

    places_or_bypasses = True

    def admit(self, key, ctx):
        return key % 2 == 1

    def placement(self, slots, trace):
        return [1][:slots]


def test_a_bypassed_miss_changes_nothing_and_is_counted():
    cache = ExpertCache(2, OddOnly(SPEC))
    ctx = AccessContext()
    cache.preload(None, ctx)
    assert set(cache.resident) == {1} and cache.used == 1
    outcomes = [cache.serve(key, ctx) for key in (1, 2, 3, 2, 5, 1)]
    # 1 hit; 2 even: bypassed; 3 loaded (room); 2 bypassed again; 5 loaded, evicting LRU 1 (3 is newer)
    assert outcomes == [HIT, BYPASSED, LOADED, BYPASSED, LOADED, LOADED]
    assert cache.bypasses == 2 and cache.evictions == 2 and set(cache.resident) == {5, 1}


def test_the_drivers_rule_is_asked_after_the_policy():
    asked = []

    def rule(key, ctx):
        asked.append(key)
        return key != 3

    cache = ExpertCache(4, OddOnly(SPEC), admission=rule)
    ctx = AccessContext()
    assert [cache.admits(key, ctx) for key in (2, 3, 5)] == [False, False, True]
    assert asked == [3, 5] and cache.bypasses == 2


def test_the_partitioned_cache_admits_and_counts_per_layer():
    cache = PartitionedCache(4, SPEC.num_layers, lambda: OddOnly(SPEC), SPEC.num_experts)
    ctx = AccessContext()
    assert [cache.serve(key, ctx) for key in (0, 4, 5)] == [BYPASSED, BYPASSED, LOADED]
    assert cache.bypasses == 2
