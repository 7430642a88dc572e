"""The placement policies against their rules: static-freq in hindsight serves exactly the C most requested
experts (counted here by hand, row by row), static-layers the last whole layers, pinned-lru and lfu-decay
on hand-built sequences."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, AccessContext, ModelSpec, make_policy
from moe_offload.simulator.cache import BYPASSED, HIT, LOADED, ExpertCache
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.importers import import_routes_json

PLACEMENTS = ("static-freq", "static-layers", "pinned-lru", "lfu-decay")


def top_c_by_hand(trace, capacity: int) -> int:
    """The requests of the C most requested experts: every (token, layer, rank) is one request."""
    counts = Counter()
    J = trace.meta.num_experts
    for row in trace.experts.tolist():
        for layer, chosen in enumerate(row):
            for expert in chosen:
                counts[layer * J + expert] += 1
    return sum(sorted(counts.values(), reverse=True)[:capacity])


@pytest.mark.parametrize("capacity", [8, 32, 100])
def test_static_freq_in_hindsight_serves_the_top_c_of_the_bundled_trace(tiny_trace, capacity):
    result = replay(ReplayInput.of(tiny_trace, "tiny"), "static-freq", capacity)
    assert result.hits == top_c_by_hand(tiny_trace, capacity)
    assert result.misses == 0 and result.bypassed == result.accesses - result.hits


def test_static_freq_in_hindsight_serves_the_top_c_of_a_shared_trace(qwen_folder):
    trace = import_routes_json(qwen_folder / "history_2.json")
    capacity = trace.meta.num_expert_slots // 4
    result = replay(ReplayInput.of(trace), "static-freq", capacity)
    assert result.hits == top_c_by_hand(trace, capacity)
    # a fixed set can do no better than Belady, which may change its set
    assert result.fast_misses >= replay(ReplayInput.of(trace), "belady", capacity).misses


def test_static_freq_per_layer_and_with_a_profile(tiny_trace, tmp_path):
    spec = ModelSpec(tiny_trace.meta.num_layers, tiny_trace.meta.num_experts, tiny_trace.meta.top_k)
    J, L = spec.num_experts, spec.num_layers
    policy = make_policy("static-freq", spec, options={"per_layer": True})
    chosen = policy.placement(L + 1, tiny_trace)  # one per layer, two in layer 0
    assert [sum(1 for key in chosen if key // J == layer) for layer in range(L)] == [2] + [1] * (L - 1)
    with pytest.raises(ConfigError, match="static-freq.profile"):
        make_policy("static-freq", spec, options={"profile": str(tmp_path / "absent.parquet")})


def test_static_layers_keeps_the_last_whole_layers(tiny_trace):
    meta = tiny_trace.meta
    J, L = meta.num_experts, meta.num_layers
    result = replay(ReplayInput.of(tiny_trace), "static-layers", 2 * J + J - 1)  # two whole layers fit
    assert result.per_layer_hits[:L - 2] == [0] * (L - 2)
    assert result.per_layer_hits[L - 2:] == result.per_layer_accesses[L - 2:]
    spec = ModelSpec(L, J, meta.top_k)
    one = make_policy("static-layers", spec, options={"fast_layers": 1})
    assert one.placement(3 * J, tiny_trace) == list(range((L - 1) * J, L * J))
    with pytest.raises(ConfigError, match="fast_layers 3"):
        make_policy("static-layers", spec, options={"fast_layers": 3}).placement(2 * J, tiny_trace)


class Routed:
    """A trace-like profile: ``experts`` [tokens, L, K] is all ``expert_counts`` reads."""

    def __init__(self, rows):
        self.experts = np.asarray(rows, dtype=np.int64)


def test_pinned_lru_never_evicts_its_pinned_half():
    spec = ModelSpec(num_layers=1, num_experts=8, top_k=1)
    profile = Routed([[[0]], [[0]], [[0]], [[1]], [[1]], [[2]]])  # hottest: 0, then 1
    cache = ExpertCache(4, make_policy("pinned-lru", spec))
    ctx = AccessContext()
    cache.preload(profile, ctx)
    assert set(cache.resident) == {0, 1}  # pinned: floor(0.5 * 4) = 2 hottest
    outcomes = []
    for clock, key in enumerate([5, 6, 7, 5, 0, 6, 1]):
        ctx.clock = clock
        outcomes.append(cache.serve(key, ctx))
    # 5, 6 fill the LRU half; 7 evicts 5 (the oldest unpinned); 5 evicts 6; 0 hits; 6 evicts 7; 1 hits
    assert outcomes == [LOADED, LOADED, LOADED, LOADED, HIT, LOADED, HIT]
    assert set(cache.resident) == {0, 1, 5, 6}


def test_lfu_decay_forgets_old_frequency():
    spec = ModelSpec(num_layers=1, num_experts=8, top_k=1)
    policy = make_policy("lfu-decay", spec, options={"half_life": 2})
    cache = ExpertCache(2, policy)
    ctx = AccessContext()
    # 0 requested three times at clocks 0-2, 1 once at clock 7: s_0(7) = 2^-2.5 + 2^-3 + 2^-3.5 = 0.389 < s_1 = 1
    for clock, key in enumerate([0, 0, 0, 3, 3, 3, 3, 1]):
        ctx.clock = clock
        cache.serve(key, ctx)
    assert policy.score(0, 7) == pytest.approx(2 ** -2.5 + 2 ** -3 + 2 ** -3.5)
    ctx.clock = 8
    # resident {3, 1}: s_3(8) = 2^-2.5 + 2^-2 + 2^-1.5 + 2^-1 = 1.28 > s_1(8) = 2^-0.5 = 0.71: 1 goes
    assert cache.serve(2, ctx) == LOADED and set(cache.resident) == {3, 2}
    # plain LFU (huge half-life) would have kept 3 too, but LRU would have evicted 3
    ctx.clock = 9
    assert cache.serve(0, ctx) == LOADED and 2 not in cache.resident  # s_2 = 2^-0.5 < s_3


@pytest.mark.parametrize("policy", PLACEMENTS)
def test_every_placement_is_listed_and_replays_next_to_belady(tiny_trace, policy):
    assert policy in POLICIES
    data = ReplayInput.of(tiny_trace)
    result = replay(data, policy, 24)
    assert result.hits + result.misses + (result.bypassed or 0) == result.accesses
    assert result.fast_misses >= replay(data, "belady", 24).misses
