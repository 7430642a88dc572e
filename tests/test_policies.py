"""Every policy, on hand-built sequences of about a dozen requests, evicts what its formula says."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, AccessContext, ModelSpec, default_policies
from moe_offload.policies.lcp import LCP
from moe_offload.policies.moe_infinity import EPSILON, MoEInfinity
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.partitioned_cache import PartitionedCache
from policy_driver import drive

ONE_LAYER = ModelSpec(num_layers=1, num_experts=6, top_k=1)


def single_layer(*experts):
    return [(0, e) for e in experts]


def test_lru_evicts_least_recently_requested():
    _, evicted = drive("lru", single_layer(0, 1, 2, 0, 3, 4), 3, ONE_LAYER)
    assert evicted[4] == [1]  # 0 was refreshed at t=3, so 1 is the oldest
    assert evicted[5] == [2]


def test_fifo_ignores_hits():
    _, evicted = drive("fifo", single_layer(0, 1, 2, 0, 3, 4), 3, ONE_LAYER)
    assert evicted[4] == [0]  # first in, although just hit
    assert evicted[5] == [1]


def test_lifo_evicts_the_newest_resident():
    _, evicted = drive("lifo", single_layer(0, 1, 2, 0, 3, 4), 3, ONE_LAYER)
    assert evicted[4] == [2]  # the last one in; the hit on 0 changes nothing
    assert evicted[5] == [3]  # 3 came in last: 0 and 1 stay for good


def test_neighbor_aware_ages_and_evicts_neighbors_together():
    # groups of 2: {0, 1}, {2, 3}, {4, 5}. At the request of 4 the cache holds 0, 2, 1: group {0, 1} was last
    # requested at t=2 (expert 1), group {2, 3} at t=1, so 2 goes where LRU evicts 0.
    _, evicted = drive("neighbor-aware", single_layer(0, 2, 1, 4, 3, 5), 3, ONE_LAYER)
    assert evicted[3] == [2]
    assert drive("lru", single_layer(0, 2, 1, 4, 3, 5), 3, ONE_LAYER)[1][3] == [0]
    assert evicted[4] == [0]  # {0, 1} (t=2) is now older than {4} (t=3): its lower member first
    assert evicted[5] == [1]  # ... then the rest of the group, although {2, 3} was requested later
    _, one = drive("neighbor-aware", single_layer(0, 2, 1, 4, 3, 5), 3, ONE_LAYER, options={"group": 1})
    assert one == drive("lru", single_layer(0, 2, 1, 4, 3, 5), 3, ONE_LAYER)[1]


def test_moe_infinity_fills_the_cache_layer_by_layer_when_asked():
    # Paper 002, section 6.1: the GPU cache starts with the experts in topological order, layer by layer.
    from moe_offload.simulator.replay import ReplayInput, replay
    from moe_offload.trace.format import Trace, TraceMeta

    spec = ModelSpec(num_layers=3, num_experts=2, top_k=1)
    policy = POLICIES["moe-infinity"].policy(spec, fill="layers")
    assert policy.placement(3, None) == [0, 1, 2] and policy.placement(9, None) == list(range(6))
    assert POLICIES["moe-infinity"].policy(spec).placement(3, None) == []
    # One token routed to expert 1 of layer 0, then 0 of layer 1, then 1 of layer 2, in a cache of 3: filled,
    # it starts with (0, 0), (0, 1), (1, 0): two hits; (2, 1) misses and evicts (0, 0), whose ratio is 0.
    trace = Trace.build(TraceMeta("hand", 3, 2, 1), np.array([[[1], [0], [1]]]))
    filled = replay(ReplayInput.of(trace), "moe-infinity", 3, options={"fill": "layers"})
    assert filled.hits == 2 and replay(ReplayInput.of(trace), "moe-infinity", 3).hits == 0
    with pytest.raises(ConfigError, match="fill must be one of empty, layers"):
        POLICIES["moe-infinity"].policy(spec, fill="gpu")


def test_lfu_evicts_fewest_requests_ties_to_least_recent():
    hits, evicted = drive("lfu", single_layer(0, 0, 1, 1, 1, 2, 3, 2), 3, ONE_LAYER)
    assert evicted[6] == [2]  # frequencies 0:2, 1:3, 2:1
    assert evicted[7] == [3]  # 0:2, 1:3, 3:1 -> 3; the count of 2 restarted when it was evicted
    assert hits == 3


def test_lfu_resets_count_on_eviction():
    # 0 is requested 3 times, evicted once, and must not keep its old count when it comes back.
    _, evicted = drive("lfu", single_layer(0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 0, 4), 2, ONE_LAYER)
    assert evicted[7] == [0]
    assert evicted[11] == [1] and evicted[12] == [3]  # 1 and 2 tie at 4: 1 is older; then 3 (count 1)
    assert evicted[13] == [0]  # 0 came back with count 1, below 2's 4


def test_random_is_seeded_and_uniform():
    spec = ModelSpec(1, 40, 1)
    requests = single_layer(*range(40))
    first = drive("random", requests, 10, spec)[1]
    assert first == drive("random", requests, 10, spec)[1]
    counts = np.zeros(10)
    for seed in range(2000):
        policy = POLICIES["random"].policy(spec, seed=seed)
        cache = ExpertCache(10, policy)
        ctx = AccessContext()
        for key in range(11):
            before = set(cache.resident)
            cache.request(key, ctx)
        counts[(before - set(cache.resident)).pop()] += 1
    assert counts.min() > 150 and counts.max() < 250  # 200 expected for each of the 10


def test_marking_evicts_only_unmarked_and_starts_phases():
    spec = ModelSpec(1, 6, 1)
    for seed in range(20):
        policy = POLICIES["marking"].policy(spec, seed=seed)
        cache = ExpertCache(3, policy)
        ctx = AccessContext()
        for key in (0, 1, 2):
            cache.request(key, ctx)
        cache.request(3, ctx)  # all marked: a new phase, a random one of 0, 1, 2 goes
        gone = ({0, 1, 2} - set(cache.resident)).pop()
        survivors = sorted({0, 1, 2} - {gone})
        cache.request(survivors[0], ctx)  # marked again in the new phase
        cache.request(4, ctx)  # the only unmarked expert is survivors[1]
        assert set(cache.resident) == {survivors[0], 3, 4}


def test_belady_evicts_furthest_next_use():
    _, evicted = drive("belady", single_layer(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3), 3, ONE_LAYER)
    assert evicted[3] == [2]  # next uses: 0@4, 1@5, 2@6
    assert evicted[6] == [1]  # at t=6 resident 0@8, 1@9, 3@7


def optimal_misses(keys, capacity):
    """Exhaustive search over every eviction choice: an implementation of OPT independent of Belady's rule."""
    states = {frozenset(): 0}
    for key in keys:
        nxt = {}
        for state, misses in states.items():
            if key in state:
                options = [(state, misses)]
            elif len(state) < capacity:
                options = [(state | {key}, misses + 1)]
            else:
                options = [((state - {v}) | {key}, misses + 1) for v in state]
            for s, m in options:
                if nxt.get(s, math.inf) > m:
                    nxt[s] = m
        states = nxt
    return min(states.values())


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_optimal_against_exhaustive_search(seed):
    rng = random.Random(seed)
    keys = [rng.randrange(6) for _ in range(14)]
    capacity = rng.choice([2, 3, 4])
    hits, _ = drive("belady", single_layer(*keys), capacity, ModelSpec(1, 6, 1))
    assert len(keys) - hits == optimal_misses(keys, capacity)


def test_llru_evicts_largest_round_index_then_largest_layer_distance():
    spec = ModelSpec(num_layers=3, num_experts=2, top_k=1)
    # clock:   0       1       2       3 (hit)  4       5       6
    requests = [(0, 0), (1, 0), (2, 0), (0, 0), (1, 1), (2, 1), (0, 1)]
    _, evicted = drive("llru", requests, 5, spec)
    # At t=6 (layer 0): R = floor((6 - tau) / 3) is 1 for tau in {1, 2, 3}, 0 for tau in {4, 5};
    # D = (layer - 0) mod 3 is 1 for (1,0), 2 for (2,0), 0 for (0,0): evict (2,0), flat id 4.
    assert evicted[6] == [2 * 2 + 0]
    _, lru_evicted = drive("lru", requests, 5, spec)
    assert lru_evicted[6] == [1 * 2 + 0]  # plain LRU takes the oldest, (1,0)


def test_moe_infinity_priority_follows_algorithm_2():
    spec = ModelSpec(num_layers=2, num_experts=3, top_k=1)
    requests = [(0, 0), (0, 0), (0, 1), (1, 0), (1, 2)]
    _, evicted = drive("moe-infinity", requests, 3, spec)
    # EAM after the request of (1,2): row 0 = [2, 1, 0], row 1 = [1, 0, 1].
    # p(0,0) = (2/3 + eps) * 1, p(0,1) = (1/3 + eps) * 1, p(1,0) = (1/2 + eps) * (1 - 1/2): (1,0) goes.
    assert evicted[4] == [1 * 3 + 0]
    policy = MoEInfinity(spec)
    cache = ExpertCache(3, policy)
    ctx = AccessContext()
    for clock, (layer, expert) in enumerate(requests[:4]):
        ctx.clock, ctx.layer = clock, layer
        cache.request(layer * 3 + expert, ctx)
    assert policy.priority(0) == pytest.approx(2 / 3 + EPSILON)
    assert policy.priority(3) == pytest.approx((1 + EPSILON) * 0.5)


def serve_sequences(policy, capacity, accesses, ends=()):
    """Serve ``accesses`` [(request, key, routed or None), ...] on a cache of ``capacity`` with ``policy``;
    ``ends`` maps an access index to the requests that end after it. Returns the keys each access evicted."""
    cache, ctx, evicted = ExpertCache(capacity, policy), AccessContext(), []
    for clock, (request, key, routed) in enumerate(accesses):
        ctx.clock, ctx.request, ctx.routed = clock, request, routed
        before = set(cache.resident)
        cache.request(key, ctx)
        evicted.append(sorted(before - set(cache.resident)))
        for ended in dict(ends).get(clock, ()):
            cache.end_request(ended)
    return evicted


def test_moe_infinity_keeps_one_eam_per_running_sequence():
    spec = ModelSpec(num_layers=1, num_experts=4, top_k=1)
    # Sequences 0 and 1 interleaved (a batch-recorded trace): 0 uses expert 0 three times, 1 experts 1, 2, 2.
    interleaved = [(0, 0, None), (1, 1, None), (0, 0, None), (1, 2, None), (0, 0, None), (1, 2, None)]
    policy = MoEInfinity(spec)
    serve_sequences(policy, 4, interleaved)
    assert policy.sequences.eam(0) == [[3, 0, 0, 0]] and policy.sequences.eam(1) == [[0, 1, 2, 0]]
    assert policy.sequences.running == [[3, 1, 2, 0]]
    # A batched access carries several tokens of several requests (ctx.routed): each EAM gains its own.
    policy = MoEInfinity(spec)
    serve_sequences(policy, 4, [(0, 3, {0: 2, 1: 5}), (0, 1, {1: 1})])
    assert policy.sequences.eam(0) == [[0, 0, 0, 2]] and policy.sequences.eam(1) == [[0, 1, 0, 5]]
    assert policy.priority(3) == pytest.approx(7 / 8 + EPSILON)


def test_moe_infinity_ranks_by_the_running_sequences_and_forgets_ended_ones():
    spec = ModelSpec(num_layers=1, num_experts=4, top_k=1)
    # Sequence 0 uses expert 0 three times and ends; sequence 1 starts from an empty EAM, where 0 counts nothing.
    accesses = [(0, 0, None)] * 3 + [(0, 1, None), (1, 2, None), (1, 2, None), (1, 3, None)]
    evicted = serve_sequences(MoEInfinity(spec), 2, accesses, ends={3: [0]})
    # At t=4 (sequence 1, 2 requested): counts 0:0, 1:0, 2:1 -> 0 and 1 tie at 0; 0's count changed first.
    assert evicted[4] == [0]
    assert evicted[6] == [1]  # counts 1:0, 2:2, 3:1
    # Without the end, sequence 0 still runs: its three tokens on expert 0 keep it, and 1 goes.
    policy = MoEInfinity(spec)
    evicted = serve_sequences(policy, 2, accesses)
    assert evicted[4] == [1]
    assert policy.sequences.running == [[3, 1, 2, 1]]
    policy.on_request_end(0)
    policy.on_request_end(1)
    assert policy.sequences.by_request == {} and policy.sequences.running == [[0] * 4]  # nothing left


def test_moe_infinity_eam_request_ranks_by_the_served_sequence():
    spec = ModelSpec(num_layers=1, num_experts=4, top_k=1)
    # Running: 0 has expert 0 twice, 1 has expert 1 once and 2 once; then 1 needs expert 3.
    accesses = [(0, 0, None), (1, 1, None), (0, 0, None), (1, 2, None), (1, 3, None)]
    # The running sum 0:2, 1:1, 2:1 evicts 1 (count 1, changed before 2); sequence 1's own EAM (0:0, 1:1,
    # 2:1) evicts 0, the least recently used of the lowest.
    assert serve_sequences(MoEInfinity(spec), 3, accesses)[4] == [1]
    assert serve_sequences(MoEInfinity(spec, eam="request"), 3, accesses)[4] == [0]
    with pytest.raises(ConfigError, match="moe-infinity: eam must be one of running, request, not 'batch'"):
        MoEInfinity(spec, eam="batch")


def test_moe_infinity_tiers_of_a_run_share_the_sequence_eams():
    spec = ModelSpec(num_layers=2, num_experts=3, top_k=1)
    make = POLICIES["moe-infinity"].policy.run_factory(spec)
    gpu, host = ExpertCache(1, make()), ExpertCache(2, make())
    assert gpu.policy.sequences is host.policy.sequences
    ctx = AccessContext()
    for clock, key in enumerate([0, 1, 1, 1, 0]):
        ctx.clock = clock
        if not gpu.request(key, ctx):  # the host is shown the same access on a GPU miss (the timed simulator)
            host.request(key, ctx)
    assert host.policy.sequences.running == [[2, 3, 0], [0, 0, 0]]  # each access counted once
    # The host saw 0 twice and 1 once, but ranks by every access: 1 (3 tokens) stays, 0 goes.
    assert host.policy.victim(ctx) == 0


def test_fmoe_evicts_lowest_probability_times_frequency():
    spec = ModelSpec(num_layers=1, num_experts=4, top_k=1)
    probs = np.array([[[0.1, 0.6, 0.2, 0.1]]] * 4)
    _, evicted = drive("fmoe", single_layer(0, 0, 1, 2), 2, spec, probs=probs)
    # p * freq: expert 0 = 0.1 * 2 = 0.2, expert 1 = 0.6 * 1 = 0.6 -> expert 0 goes (LFU would keep it).
    assert evicted[3] == [0]
    predicted = np.array([[0.9, 0.05, 0.05, 0.0]])
    _, evicted = drive("fmoe", single_layer(0, 0, 1, 2), 2, spec, probs=probs, predicted=predicted)
    assert evicted[3] == [1]  # the prefetcher's map wins over the observed one: 0.9 * 2 > 0.05 * 1


def test_lcp_evicts_lowest_cache_priority():
    spec = ModelSpec(num_layers=1, num_experts=4, top_k=1)
    options = {"omega": 1.0, "rho": 0.5}
    _, evicted = drive("lcp", single_layer(0, 0, 0, 1, 2), 2, spec, options=options)
    # At token 4: expert 0 has mu=3, nu=2 -> 3 * 0.5**2 = 0.75; expert 1 has mu=1, nu=1 -> 0.5.
    assert evicted[4] == [1]
    _, evicted = drive("lcp", single_layer(0, 0, 1, 3, 3, 3, 2), 2, spec, options=options)
    assert evicted[3] == [0]  # at token 3: P(0) = 2 * 0.5**2 = 0.5 = P(1) = 1 * 0.5**1; 0's score is older
    assert evicted[6] == [1]  # at token 6: P(1) = 1 * 0.5**4, P(3) = 3 * 0.5**1


@pytest.mark.parametrize("seed", range(5))
def test_lcp_victim_is_argmin_of_equation_4(seed):
    rng = random.Random(seed)
    spec = ModelSpec(num_layers=1, num_experts=12, top_k=1)
    policy = LCP(spec, omega=4.0, rho=0.3)
    cache = ExpertCache(5, policy)
    ctx = AccessContext()
    for t in range(200):
        key = min(int(rng.expovariate(0.3)), 11)
        ctx.clock = ctx.token = t
        policy.on_access(key, ctx)
        if key in cache:
            continue
        if len(cache) == 5:
            priorities = {k: policy.priority(k, t) for k in cache.resident}
            victim = policy.victim(ctx)
            assert priorities[victim] == pytest.approx(min(priorities.values()), rel=1e-9)
            cache.evict(victim)
        cache.resident[key] = 1
        cache.used += 1
        policy.on_insert(key, ctx)


def test_lru_dist_confines_evictions_to_the_layer():
    spec = ModelSpec(num_layers=2, num_experts=3, top_k=1)
    requests = [(0, 0), (1, 0), (0, 1), (1, 0), (0, 2)]
    _, evicted = drive("lru-dist", requests, 4, spec)
    assert evicted[4] == [0]  # layer 0 holds 2 of the 4 slots: its own LRU (0,0) goes, though slots are free
    _, shared = drive("lru", requests, 4, spec)
    assert shared[4] == []


def test_lcp_dist_ranks_by_priority_within_the_layer_share():
    # 2 layers, 4 slots: 2 per layer. Layer 0 holds expert 0 (mu 2, last token 2) and 1 (mu 1, last token 4)
    # when (0, 2) misses at token 6; layer 1's 3 and 4 are the lowest in the shared cache.
    spec = ModelSpec(num_layers=2, num_experts=3, top_k=1)
    requests = [(0, 0), (1, 0), (0, 0), (1, 1), (0, 1), (1, 2), (0, 2)]
    _, evicted = drive("lcp-dist", requests, 4, spec)
    assert evicted[5] == [3]  # layer 1: 3 (mu 1, token 1) below 4 (mu 1, token 3)
    # P = mu * rho^(nu / omega): 2 * 0.25^(4/128) = 1.915 > 1 * 0.25^(2/128) = 0.979
    assert evicted[6] == [1]
    # with omega = 1 the interval dominates: 2 * 0.25^4 = 0.0078 < 0.25^2 = 0.0625
    _, evicted = drive("lcp-dist", requests, 4, spec, options={"omega": 1.0})
    assert evicted[6] == [0]
    _, shared = drive("lcp", requests, 4, spec)
    assert shared[6] == [4]  # the shared cache's lowest is layer 1's 4 (mu 1, token 3)


def test_marking_dist_is_marking_within_each_layer_share():
    # Paper 001: "Marker-Dist", marking "on each layer with a specific cache of size k/l per layer".
    spec = ModelSpec(num_layers=2, num_experts=4, top_k=1)
    requests = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    for seed in range(10):
        policy = POLICIES["marking-dist"].policy
        cache = PartitionedCache(4, 2, lambda: policy(spec, seed=seed), spec.num_experts)
        ctx = AccessContext()
        for layer, expert in requests:
            cache.request(layer * 4 + expert, ctx)
        # layer 0's two slots held 0 and 1, both marked: a new phase in layer 0 only, one of them goes;
        # layer 1 keeps both of its experts
        assert {4, 5} <= set(cache.parts[1].resident)
        assert len(set(cache.parts[0].resident) & {0, 1}) == 1 and 2 in cache.parts[0].resident
        cache.request(3, ctx)  # in layer 0's new phase 2 is marked: the other survivor is the only victim
        assert set(cache.parts[0].resident) == {2, 3}
        assert set(cache.parts[1].resident) == {4, 5}
    _, shared = drive("marking", requests, 4, spec)
    assert shared[4] == [5]  # the shared cache's new phase draws among all four: here layer 1's (1, 1)


# ARC (Megiddo & Modha 2003), c = 3. The sequence and, worked out by hand with the pseudo-code in arc.py,
# the case of each request, the expert it evicts and p after it (T1, T2, B1, B2 LRU first):
ARC_CASES = [
    # t  x  case                                  evicted  p   T1 | T2 | B1 | B2 after
    (0, 0, "IV, not full", None, 0),            # [0]
    (1, 1, "IV, not full", None, 0),            # [0 1]
    (2, 2, "IV, not full", None, 0),            # [0 1 2]
    (3, 0, "I, hit: to T2", None, 0),           # [1 2] | [0]
    (4, 3, "IV.B, |T1| = 2 > p", 1, 0),         # [2 3] | [0] | [1]
    (5, 4, "IV.A, |T1|+|B1| = c: drop B1's 1", 2, 0),   # [3 4] | [0] | [2]
    (6, 2, "II, p += 1; |T1| = 2 > 1", 3, 1),   # [4] | [0 2] | [3]
    (7, 5, "IV.B, |T1| = 1 = p, 5 not in B2", 0, 1),    # [4 5] | [2] | [3] | [0]
    (8, 0, "III, p -= 1; |T1| = 2 > 0", 4, 0),  # [5] | [2 0] | [3 4]
    (9, 6, "IV.A, drop B1's 3", 5, 0),          # [6] | [2 0] | [4 5]
    (10, 4, "II, p = 1; |T1| = 1 = p", 2, 1),   # [6] | [0 4] | [5] | [2]
    (11, 2, "III, p = 0", 6, 0),                # [] | [0 4 2] | [5 6]
    (12, 7, "IV.B, T1 empty", 0, 0),            # [7] | [4 2] | [5 6] | [0]
    (13, 8, "IV.A, drop B1's 5", 7, 0),         # [8] | [4 2] | [6 7] | [0]
    (14, 6, "II, |B1| = 2 >= |B2|: p = 1", 4, 1),       # [8] | [2 6] | [7] | [0 4]
    (15, 7, "II, d1 = |B2|/|B1| = 2: p = 3", 2, 3),     # [8] | [6 7] | [] | [0 4 2]
    (16, 0, "III, p = 2; |T1| = 1 < 2", 6, 2),  # [8] | [7 0] | [] | [4 2 6]
    (17, 4, "III, p = 1; x in B2 and |T1| = p", 8, 1),  # [] | [7 0 4] | [8] | [2 6]
]


def test_arc_follows_its_pseudo_code_by_hand():
    policy = POLICIES["arc"].policy(ModelSpec(1, 10, 1))
    cache = ExpertCache(3, policy)
    ctx = AccessContext()
    for t, key, case, evicted, p in ARC_CASES:
        ctx.clock = ctx.token = t
        before = set(cache.resident)
        cache.request(key, ctx)
        gone = before - set(cache.resident)
        assert gone == ({evicted} if evicted is not None else set()), (t, case)
        assert policy.p == p, (t, case)
    assert (list(policy.t1), list(policy.t2), list(policy.b1), list(policy.b2)) == ([], [7, 0, 4], [8], [2, 6])


def test_arc_scan_leaves_no_ghosts_when_t1_fills_the_cache():
    # Case IV.A with |T1| = c: T1's LRU expert is evicted and not remembered, so a scan cannot flood B1.
    policy = POLICIES["arc"].policy(ModelSpec(1, 10, 1))
    cache = ExpertCache(3, policy)
    ctx = AccessContext()
    for key in range(6):
        cache.request(key, ctx)
    assert list(policy.t1) == [3, 4, 5] and not policy.b1 and not policy.b2 and not policy.t2
    cache.request(0, ctx)  # a plain miss, not a ghost hit: p does not move
    assert policy.p == 0 and list(policy.t1) == [4, 5, 0]


def test_arc_ghost_lists_stay_bounded_and_t1_t2_are_the_residents():
    rng = random.Random(3)
    for capacity in (2, 5, 9):
        policy = POLICIES["arc"].policy(ModelSpec(1, 30, 1))
        cache = ExpertCache(capacity, policy)
        ctx = AccessContext()
        for t in range(3000):
            ctx.clock = t
            cache.request(min(int(rng.expovariate(0.15)), 29), ctx)
            t1, t2, b1, b2 = (len(x) for x in (policy.t1, policy.t2, policy.b1, policy.b2))
            assert set(policy.t1) | set(policy.t2) == set(cache.resident)
            assert t1 + b1 <= capacity and t1 + t2 + b1 + b2 <= 2 * capacity
            assert not (set(policy.b1) | set(policy.b2)) & set(cache.resident)
            assert 0 <= policy.p <= capacity


class Draws:
    """Stands in for LeCaR's random.Random: returns the given numbers in order."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def test_lecar_follows_its_pseudo_code_by_hand():
    # N = 2: histories of N // 2 = 1 key each, d = 0.005^(1/2), lambda = 0.45, w = (0.5, 0.5). The draws below
    # pick LRU when below w_LRU. By hand (C in LRU order with counts; H = (key, eviction time, count)):
    policy = POLICIES["lecar"].policy(ModelSpec(1, 8, 1))
    policy._rng = Draws(0.2, 0.9, 0.4, 0.7, 0.1, 0.95)
    cache = ExpertCache(2, policy)
    ctx = AccessContext()
    d, lam = 0.005 ** 0.5, 0.45
    w1 = 1 / (1 + math.exp(lam * d))                          # after t4: LRU regretted evicting 0
    w2 = w1 * math.exp(lam * d) / (w1 * math.exp(lam * d) + 1 - w1)  # after t5: LFU regretted evicting 1
    steps = [
        # t  key evicted  w_LRU after   C after; why
        (0, 0, None, 0.5),   # [0:1]
        (1, 0, None, 0.5),   # [0:2] hit
        (2, 1, None, 0.5),   # [0:2 1:1]
        (3, 2, 0, 0.5),      # draw 0.2 < 0.5: LRU evicts 0, H_LRU = (0, 3, 2); [1:1 2:1]
        (4, 0, 1, w1),       # 0 in H_LRU: w_LFU *= e^(lambda d^1); draw 0.9: LFU, counts 1 and 1, 1 older;
                             # H_LFU = (1, 4, 1); 0 returns with its count 2 + 1: [2:1 0:3]
        (5, 1, 2, w2),       # 1 in H_LFU: w_LRU *= e^(lambda d^1); draw 0.4 < w2: LRU evicts 2; [0:3 1:2]
        (6, 3, 1, w2),       # draw 0.7: LFU evicts 1 (count 2 < 3); H_LFU = (1, 6, 2); [0:3 3:1]
        (7, 4, 0, w2),       # draw 0.1: LRU evicts 0; H_LRU was full with 2: 2 is forgotten; [3:1 4:1]
        (8, 2, 3, w2),       # 2 is in no history: no update; draw 0.95: LFU, 3 and 4 tie at 1, 3 older
    ]
    for t, key, evicted, w_lru in steps:
        ctx.clock = ctx.token = t
        before = set(cache.resident)
        cache.request(key, ctx)
        assert before - set(cache.resident) == ({evicted} if evicted is not None else set()), t
        assert policy.w_lru == pytest.approx(w_lru, rel=1e-12) and policy.w_lru + policy.w_lfu == pytest.approx(1)
    assert policy.discount_rate == pytest.approx(d)
    assert dict(policy.h_lru) == {0: (7, 3)} and dict(policy.h_lfu) == {3: (8, 1)}
    assert w1 < 0.5 and w2 == pytest.approx(0.5)  # two regrets of the same age cancel


def test_lecar_with_all_weight_on_one_expert_is_that_expert():
    requests = single_layer(0, 0, 1, 1, 1, 2, 3, 2, 4, 0, 5, 3)
    for expert in ("lru", "lfu"):
        policy = POLICIES["lecar"].policy(ONE_LAYER, learning_rate=0.0)
        policy.w_lru = 1.0 if expert == "lru" else 0.0
        policy.w_lfu = 1.0 - policy.w_lru
        cache = ExpertCache(3, policy)
        ctx = AccessContext()
        evicted = []
        for t, (_, key) in enumerate(requests):
            ctx.clock = t
            before = set(cache.resident)
            cache.request(key, ctx)
            evicted.append(sorted(before - set(cache.resident)))
        if expert == "lru":
            assert evicted == drive("lru", requests, 3, ONE_LAYER)[1]
        else:
            # By hand: t6 evicts 2 (count 1) into H_LFU; at t7 2 comes back with its count 1 + 1 = 2 and 3
            # (count 1) goes; at t8 0 and 2 tie at 2 and 0 is older, where the project's LFU, which restarts a
            # count, evicts 2; then 4 (count 1), 2 (2 < 0's 2 + 1 = 3), 5 (1).
            assert sum(evicted, []) == [2, 3, 0, 4, 2, 5]
            assert drive("lfu", requests, 3, ONE_LAYER)[1][8] == [2]


@pytest.mark.parametrize("policy", sorted(default_policies()))
def test_every_policy_respects_pins_and_capacity(policy):
    spec = ModelSpec(num_layers=4, num_experts=6, top_k=2)
    info = POLICIES[policy]
    if info.partitioned:
        pytest.skip("pinning is tested on the shared cache")
    rng = random.Random(7)
    instance = info.policy(spec, seed=1)
    cache = ExpertCache(6, instance)
    ctx = AccessContext()
    ctx.probs = np.full((4, 6), 1 / 6)
    keys = [rng.randrange(24) for _ in range(400)]
    nxt = {}
    next_use = [0] * len(keys)
    for t in range(len(keys) - 1, -1, -1):
        next_use[t] = nxt.get(keys[t], 10**9)
        nxt[keys[t]] = t
    for t, key in enumerate(keys):
        ctx.clock, ctx.token, ctx.layer, ctx.next_use = t, t // 3, key // 6, next_use[t]
        ctx.pinned = frozenset(k for k in list(cache.resident)[:2])
        pinned_before = set(ctx.pinned)
        cache.request(key, ctx)
        assert pinned_before <= set(cache.resident)
        assert len(cache) <= 6


@pytest.mark.parametrize("policy", sorted(p for p in default_policies() if not POLICIES[p].offline))
def test_opt_is_a_lower_bound_for_every_policy(policy):
    rng = np.random.default_rng(3)
    spec = ModelSpec(num_layers=4, num_experts=8, top_k=1)
    requests = [(t % 4, int(min(rng.zipf(1.6) - 1, 7))) for t in range(600)]
    probs = np.full((600, 4, 8), 1 / 8)
    for capacity in (4, 8, 16):
        opt_hits, _ = drive("belady", requests, capacity, spec)
        hits, _ = drive(policy, requests, capacity, spec, tokens=[t // 4 for t in range(600)], probs=probs)
        assert hits <= opt_hits


def test_belady_dist_is_optimal_per_layer():
    spec = ModelSpec(num_layers=2, num_experts=4, top_k=1)
    rng = random.Random(5)
    requests = [(t % 2, rng.randrange(4)) for t in range(20)]
    hits, _ = drive("belady-dist", requests, 4, spec)
    per_layer = [[e for l, e in requests if l == layer] for layer in range(2)]
    expected_misses = sum(optimal_misses(keys, 2) for keys in per_layer)
    assert len(requests) - hits == expected_misses


def test_every_policy_is_listed_with_its_source():
    baselines = {"lifo", "lcp-dist", "neighbor-aware"}  # issue 25
    engines = {"lfru", "lfru-dist", "static-experts"}  # issue 31
    expected = {"lru", "lfu", "fifo", "random", "marking", "lru-dist", "marking-dist", "belady", "belady-dist",
                "llru", "arc", "lecar", "moe-infinity", "fmoe", "lcp", "learned", "lfu-decay", "pinned-lru",
                "static-freq", "static-layers", "coact"}
    assert set(POLICIES) == expected | baselines | engines
    for info in POLICIES.values():
        assert info.summary and info.source


def test_exhaustive_search_helper_sanity():
    assert optimal_misses([0, 1, 2, 0, 1, 2], 2) == 4
    assert optimal_misses(list(itertools.chain(*[[0, 1]] * 5)), 2) == 2


def test_lecar_refuses_bad_options():
    # the one validation layer (moe_offload.values): the same one-line error from Python and --policy-option
    with pytest.raises(ConfigError, match="lecar.learning_rate"):
        POLICIES["lecar"].policy(ONE_LAYER, learning_rate=-0.1)
    with pytest.raises(ConfigError, match="lecar.history_size"):
        POLICIES["lecar"].policy(ONE_LAYER, history_size=0)


def test_a_policy_that_needs_an_option_is_left_out_of_the_default_lists_and_refused_without_it():
    from moe_offload.errors import ConfigError
    from moe_offload.policies import make_policy

    assert POLICIES["static-experts"].needs_options == ["experts"]
    assert "static-experts" not in default_policies()
    assert set(default_policies()) == {name for name, info in POLICIES.items() if not info.needs_options}
    with pytest.raises(ConfigError, match="static-experts.*needs the option experts"):
        make_policy("static-experts", ONE_LAYER)
    assert make_policy("static-experts", ONE_LAYER, options={"experts": [1]}).placement(2, None) == [1]
