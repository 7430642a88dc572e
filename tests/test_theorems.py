"""The results of paper 001 (layered paging), reproduced by the replay simulator."""

from __future__ import annotations

import pytest

from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.synthetic import cyclic_trace, fixed_partition_trace, zipf_trace


def misses(trace, policy, cache_size):
    return replay(ReplayInput.of(trace), policy, cache_size).misses


@pytest.mark.parametrize("num_layers,cache_size", [(4, 11), (3, 8), (1, 9), (6, 11)])
def test_theorem_3_3_lru_misses_every_request_opt_once_every_k(num_layers, cache_size):
    rounds = 2400 // num_layers
    trace = cyclic_trace(num_layers, cache_size, rounds)
    requests = rounds * num_layers
    assert misses(trace, "lru", cache_size) == requests
    # OPT: k cold misses, then one miss every k requests (it evicts the page requested last).
    opt = misses(trace, "belady", cache_size)
    expected = cache_size + (requests - cache_size) / cache_size
    assert abs(opt - expected) <= 1
    # After the cold start, LRU misses k times as often as OPT: the ratio of Theorem 3.3.
    assert (requests - cache_size) / (opt - cache_size) == pytest.approx(cache_size, rel=0.02)


def test_theorem_3_1_fixed_partition_keeps_missing_while_opt_stops():
    num_layers, num_experts, cache_size = 4, 4, 10  # n + L - 1 <= k < nL and k > n + L - 1
    for rounds in (100, 400):
        trace = fixed_partition_trace(num_layers, num_experts, rounds, cycling_layer=0)
        distinct = (num_layers - 1) + num_experts
        assert misses(trace, "belady", cache_size) == distinct  # OPT holds every page after filling up
        assert misses(trace, "lru", cache_size) == distinct      # so does the shared LRU
        # LRU-Dist gives the cycling layer 3 slots for 4 pages: LRU then misses it in every round.
        assert misses(trace, "lru-dist", cache_size) >= rounds
        # Even the optimal split policy misses at least once every n rounds.
        assert misses(trace, "belady-dist", cache_size) >= rounds / num_experts


@pytest.mark.parametrize("num_layers,num_experts", [(4, 8), (8, 4), (8, 8), (16, 4)])
def test_opt_dist_misses_clearly_more_than_opt_on_zipf(num_layers, num_experts):
    # Figure 6(a): Zipf a = 2, k = 16, layer count and experts per layer varied, where not everything fits.
    trace = zipf_trace(num_layers, num_experts, top_k=1, length=3000, a=2.0, b=0.0, seed=1, shuffle=True)
    opt = misses(trace, "belady", 16)
    opt_dist = misses(trace, "belady-dist", 16)
    assert opt_dist >= 1.15 * opt


def test_opt_dist_equals_opt_when_everything_fits():
    trace = zipf_trace(2, 4, top_k=1, length=500, a=2.0, b=0.0, seed=1)
    assert misses(trace, "belady-dist", 16) == misses(trace, "belady", 16) == 8
