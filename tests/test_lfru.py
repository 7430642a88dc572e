"""LFRU (vLLM PR #37190's expert cache policy, policies/lfru.py) on a sequence worked by hand from its rule:
evict the resident of least uses / (clock - last use + 1), the clock advancing on each hit and insertion, ties
to the expert cached longest."""

from policy_driver import drive

from moe_offload.policies import POLICIES, ModelSpec

SPEC = ModelSpec(num_layers=1, num_experts=4, top_k=1)


def test_lfru_matches_the_hand_worked_sequence():
    # capacity 2, requests 0 0 0 1 2 1 0; (uses, last use) after each step and the clock T:
    #  0 miss  -> 0:(1,1)                        T=1
    #  0 hit   -> 0:(2,2)                        T=2
    #  0 hit   -> 0:(3,3)                        T=3
    #  1 miss  -> 1:(1,4)                        T=4   room left
    #  2 miss  at T=4: 0 scores 3/2 = 1.5, 1 scores 1/1 = 1    -> evict 1 (LRU would evict 0); 2:(1,5) T=5
    #  1 miss  at T=5: 0 scores 3/3 = 1,   2 scores 1/1 = 1    -> tie: 0 entered first, evict 0;  1:(1,6) T=6
    #  0 miss  at T=6: 2 scores 1/2 = 0.5, 1 scores 1/1 = 1    -> evict 2
    hits, evicted = drive("lfru", [(0, e) for e in (0, 0, 0, 1, 2, 1, 0)], 2, SPEC)
    assert hits == 2
    assert evicted == [[], [], [], [], [1], [0], [2]]
    lru_hits, lru_evicted = drive("lru", [(0, e) for e in (0, 0, 0, 1, 2, 1, 0)], 2, SPEC)
    assert lru_evicted[4] == [0] and lru_hits == 3  # the sequence tells the two apart


def test_lfru_dist_keeps_one_clock_per_layer():
    """The per-layer cache of the PR: layer 1's accesses do not age layer 0's experts."""
    spec = ModelSpec(num_layers=2, num_experts=4, top_k=1)
    # layer 0 gets slots 1 (2 // 2), layer 1 one; the same hand sequence per layer, interleaved
    requests = [(0, 0), (1, 0), (0, 0), (1, 1), (0, 1)]
    hits, evicted = drive("lfru-dist", requests, 2, spec)
    assert hits == 1 and evicted == [[], [], [], [4], [0]]


def test_lfru_is_listed_with_its_source():
    assert "37190" in POLICIES["lfru"].source and POLICIES["lfru-dist"].partitioned
