"""The shared cache's rules, by hand: a prefetched expert is held until it is used, prefetches
never evict held experts, demand loads always make progress, and no policy's ranking changes any of it."""

from __future__ import annotations

import pytest

from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import resolve_profile
from moe_offload.policies import POLICIES, AccessContext, ModelSpec, default_policies
from moe_offload.simulator.cache import ExpertCache, predicted_no_later_than
from moe_offload.simulator.partitioned_cache import PartitionedCache
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.schedule import leading_iterations

SPEC = ModelSpec(num_layers=2, num_experts=8, top_k=1)
ONLINE = [name for name in default_policies() if not POLICIES[name].offline and name != "learned"]


def fill(cache: ExpertCache, keys, ctx: AccessContext) -> None:
    for key in keys:
        assert cache.request(key, ctx) is False
        ctx.clock += 1
        ctx.token += 1


def prefetch(cache, key, ctx) -> bool:
    ctx.prefetch = True
    try:
        room = cache.reserve(key, ctx, 1)
    finally:
        ctx.prefetch = False
    if room:
        cache.complete(key, ctx)
    return room


@pytest.mark.parametrize("policy", ONLINE)
def test_a_held_prefetch_is_never_the_victim_whatever_the_policy(policy):
    # LCP ranks a newcomer with mu = 0 lowest and fMoE one with freq = 0: without the hold rule a prefetch is
    # their first victim. Cache of 3: demand 0, 1; prefetch 2 (held); a demand miss of 3 must evict 0 or 1.
    cache = ExpertCache(3, POLICIES[policy].policy(SPEC, seed=0))
    ctx = AccessContext()
    fill(cache, [0, 1], ctx)
    assert prefetch(cache, 2, ctx)
    assert list(cache.held) == [2]
    for miss in (3, 4, 5):
        cache.request(miss, ctx)
        ctx.clock += 1
        ctx.token += 1
        assert 2 in cache, f"{policy} evicted the held prefetch on the miss of {miss}"
    assert cache.touch(2, ctx)  # used: the hold ends
    assert not cache.held


def test_a_prefetch_waits_rather_than_evict_a_held_prefetch():
    cache = ExpertCache(2, POLICIES["lru"].policy(SPEC))
    ctx = AccessContext()
    assert prefetch(cache, 0, ctx) and prefetch(cache, 1, ctx)
    assert not prefetch(cache, 2, ctx)  # the only victims would be held: nothing is evicted, nothing reserved
    assert set(cache.resident) == {0, 1} and not cache.reserved and cache.used == 2
    cache.release(0)                   # its layer was routed without it: an ordinary resident now
    assert prefetch(cache, 2, ctx)
    assert set(cache.resident) == {1, 2} and list(cache.held) == [1, 2]


def test_the_policys_fixed_experts_are_never_room_for_another():
    # pinned-lru's hot set is never a victim: with 2 of 3 units fixed and the third pinned by the step, a
    # demand load cannot make room and evicts nothing; the count of the fixed units follows loads, evictions
    # and a change of their size
    class Fixed(POLICIES["pinned-lru"].policy):  # its hot set given, not counted from a trace
        def placement(self, slots, trace):
            self.fixed = frozenset({0, 1})
            return [0, 1]

    cache = ExpertCache(3, Fixed(SPEC))
    ctx = AccessContext()
    cache.preload(None, ctx)
    fill(cache, [2], ctx)
    ctx.pinned = frozenset({2})
    with pytest.raises(ConfigError, match="full of pinned experts"):
        cache.request(3, ctx)
    assert set(cache.resident) == {0, 1, 2}
    ctx.pinned = frozenset()
    assert cache.request(3, ctx) is False and set(cache.resident) == {0, 1, 3}  # 2, the only one not fixed
    cache.evict(1)  # a fixed expert can still be evicted by hand: its unit is room again
    fill(cache, [4], ctx)
    ctx.pinned = frozenset({3})
    assert cache.request(5, ctx) is False and set(cache.resident) == {0, 3, 5}
    ctx.pinned = frozenset()
    cache.resize(6, ctx, entry_size=2)  # 0, 3 and 5 now take 2 units each, 0's fixed
    assert cache.reserve(6, ctx, 5) is False and set(cache.resident) == {0, 3, 5}  # 2 stuck: 4 is the most
    assert cache.reserve(6, ctx, 4) and set(cache.resident) == {0}


def test_which_predicted_residents_a_prefetch_protects():
    # 3 layers of 4 experts, layer 1 just routed: layers ahead are 2, then 0 and 1 of the next iteration.
    predicted = {9, 1, 5}  # layer 2, layer 0, layer 1
    assert predicted_no_later_than(predicted, 10, layer_now=1, num_experts=4, num_layers=3) == {9}
    assert predicted_no_later_than(predicted, 2, layer_now=1, num_experts=4, num_layers=3) == {9, 1}
    assert predicted_no_later_than(predicted, 6, layer_now=1, num_experts=4, num_layers=3) == {9, 1, 5}


def test_a_prefetch_never_evicts_a_protected_resident_but_a_demand_load_may():
    # LRU's victim would be 0, the oldest; the prefetch of 3 for a later layer must take 1 instead.
    cache = ExpertCache(3, POLICIES["lru"].policy(SPEC))
    ctx = AccessContext()
    fill(cache, [0, 1, 2], ctx)
    ctx.prefetch = True
    try:
        assert cache.reserve(3, ctx, 1, protect={0})
        assert set(cache.resident) == {0, 2} and 3 in cache.reserved
        assert not cache.reserve(4, ctx, 1, protect={0, 2})  # nothing else to evict: it waits, evicting nothing
        assert set(cache.resident) == {0, 2}
    finally:
        ctx.prefetch = False
    cache.complete(3, ctx)
    assert cache.reserve(5, ctx, 1, protect={0})  # a demand load ignores protect: LRU's victim is 0
    assert 0 not in cache.resident


def test_a_demand_load_releases_the_most_recent_holds_first():
    cache = ExpertCache(3, POLICIES["lru"].policy(SPEC))
    ctx = AccessContext()
    for key in (0, 1, 2):
        assert prefetch(cache, key, ctx)
    ctx.pinned = {7}
    assert cache.reserve(7, ctx, 1)  # a demand load: the newest hold (2) is released and, being LRU's only
    assert set(cache.resident) == {0, 1} and list(cache.held) == [0, 1]  # candidate, evicted
    cache.complete(7, ctx)


def test_a_demand_load_that_even_releasing_every_hold_cannot_serve_waits():
    cache = ExpertCache(2, POLICIES["lru"].policy(SPEC))
    ctx = AccessContext()
    fill(cache, [0], ctx)
    assert prefetch(cache, 1, ctx)
    ctx.pinned = {0}
    assert cache.reserve(5, ctx, 1)  # releases 1's hold and evicts it
    assert set(cache.reserved) == {5}
    assert not cache.reserve(6, ctx, 1)  # 0 pinned, 5 on its way: no room, and nothing changed
    assert set(cache.resident) == {0} and set(cache.reserved) == {5}


def test_a_prefetch_on_the_wire_is_held_from_its_reservation_and_a_failed_one_is_forgotten():
    cache = ExpertCache(2, POLICIES["lru"].policy(SPEC))
    ctx = AccessContext()
    ctx.prefetch = True
    assert cache.reserve(3, ctx, 1)
    ctx.prefetch = False
    assert list(cache.held) == [3]
    cache.cancel(3)
    assert not cache.held and cache.used == 0


def test_the_partitioned_cache_holds_per_layer():
    policy = POLICIES["lru"].policy
    cache = PartitionedCache(2, 2, lambda: policy(SPEC), SPEC.num_experts)
    ctx = AccessContext()
    assert prefetch(cache, 9, ctx)   # layer 1
    assert list(cache.held) == [9]
    cache.release(9)
    assert not cache.held


def test_with_the_oracle_every_prefetch_is_used_and_no_policy_makes_it_slower_than_no_prefetch(tiny_trace):
    """The bound the hold rule restores: before it, LCP, fMoE and LFU evicted 50-90% of the oracle's
    prefetches before their use and the oracle ran slower than no prefetching at all. On the trace's first
    whole requests (about a quarter of its rows, prompts and decoding): the rule is per access, not per length."""
    hardware = resolve_profile("desktop-rtx4090")
    total = tiny_trace.meta.num_expert_slots * tiny_trace.meta.expert_bytes
    trace = leading_iterations(tiny_trace, 2048)
    assert trace.num_requests >= 8
    for policy in ("lru", "lcp", "fmoe", "lfu"):
        for share in (0.25, 0.5):
            none = simulate_timed(trace, hardware, policy, int(total * share))
            oracle = simulate_timed(trace, hardware, policy, int(total * share), prefetcher="oracle")
            assert oracle.prefetch_precision == 1.0, (policy, share)
            assert oracle.tpot_seconds <= none.tpot_seconds, (policy, share)
            assert oracle.hit_rate >= none.hit_rate, (policy, share)


def test_whole_layers_take_every_expert_and_the_others_split_the_rest():
    # 30 slots, 4 layers of 8, layer 1 whole: 22 left for 3 layers, 8 for the first of them and 7 for the others
    assert PartitionedCache.capacities(30, 4, 8, [1]) == [8, 8, 7, 7]
    assert PartitionedCache.capacities(30, 4) == [8, 8, 7, 7]  # no whole layer: the equal split
    assert PartitionedCache.capacities(16, 2, 8, [0, 1]) == [8, 8]
    with pytest.raises(ConfigError, match="cannot hold 2 whole layers of 8 experts and one expert in each of the "
                                          "other 2 layers"):
        PartitionedCache.capacities(17, 4, 8, [0, 1])


def test_whole_layers_are_resident_before_the_first_request():
    spec = ModelSpec(2, 4, 1)
    cache = PartitionedCache(6, 2, lambda: POLICIES["lru"].policy(spec), 4, whole_layers=[1])
    ctx = AccessContext()
    cache.preload(None, ctx)
    assert len(cache) == 4 and all(key in cache for key in range(4, 8))
    for clock, key in enumerate([4, 5, 6, 7, 0, 1, 2, 5]):
        ctx.clock = clock
        cache.request(key, ctx)
    assert cache.parts[1].evictions == 0 and cache.parts[0].evictions == 1  # 2 slots for layer 0's 0, 1, 2
