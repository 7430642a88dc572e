"""Synthetic traces: Zipf sampling law, determinism, and the exact sequences of paper 001's theorems."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.trace.flatten import flatten
from moe_offload.trace.synthetic import cyclic_trace, fixed_partition_trace, zipf_probabilities, zipf_trace


def assert_frequencies_match(observed_ids: np.ndarray, expected: np.ndarray) -> None:
    """Empirical frequencies within 5 standard errors of the expected probabilities (deterministic seed)."""
    samples = observed_ids.size
    observed = np.bincount(observed_ids.ravel(), minlength=expected.size) / samples
    tolerance = 5 * np.sqrt(expected * (1 - expected) / samples) + 1e-9
    assert (np.abs(observed - expected) <= tolerance).all(), (observed, expected)


def test_zipf_probabilities_follow_the_law():
    p = zipf_probabilities(6, a=1.5, b=0.7)
    j = np.arange(1, 7)
    np.testing.assert_allclose(p, (j + 0.7) ** -1.5 / ((j + 0.7) ** -1.5).sum())
    np.testing.assert_allclose(zipf_probabilities(4, a=0.0, b=0.0), [0.25] * 4)


def test_zipf_is_deterministic_per_seed():
    first = zipf_trace(4, 8, 2, 500, a=1.0, b=0.0, seed=7)
    again = zipf_trace(4, 8, 2, 500, a=1.0, b=0.0, seed=7)
    other = zipf_trace(4, 8, 2, 500, a=1.0, b=0.0, seed=8)
    np.testing.assert_array_equal(first.experts, again.experts)
    assert not np.array_equal(first.experts, other.experts)


def test_zipf_top1_frequencies_match_the_law():
    trace = zipf_trace(num_layers=4, num_experts=10, top_k=1, length=50_000, a=1.2, b=0.5, seed=1)
    assert_frequencies_match(trace.experts, zipf_probabilities(10, 1.2, 0.5))


def test_zipf_ranks_are_successive_draws_without_replacement():
    J, a, b = 6, 1.0, 1.0
    p = zipf_probabilities(J, a, b)
    trace = zipf_trace(num_layers=3, num_experts=J, top_k=3, length=40_000, a=a, b=b, seed=2)
    # Rank 0 is the first draw: exactly the Zipf law.
    assert_frequencies_match(trace.experts[:, :, 0], p)
    # Rank 1 is the second draw: P(j) = sum over first draws i != j of p_i * p_j / (1 - p_i).
    second = np.array([sum(p[i] * p[j] / (1 - p[i]) for i in range(J) if i != j) for j in range(J)])
    assert_frequencies_match(trace.experts[:, :, 1], second)


def test_zipf_experts_of_a_layer_are_distinct():
    trace = zipf_trace(num_layers=5, num_experts=6, top_k=4, length=3000, a=3.0, b=0.0, seed=3)
    ordered = np.sort(trace.experts, axis=2)
    assert (np.diff(ordered, axis=2) > 0).all()
    # top_k = J: every row is a permutation of all experts, even under strong skew.
    every = zipf_trace(num_layers=2, num_experts=5, top_k=5, length=2000, a=4.0, b=0.0, seed=4)
    assert (np.sort(every.experts, axis=2) == np.arange(5)).all()


def test_zipf_shuffle_gives_layers_their_own_popular_expert():
    trace = zipf_trace(num_layers=6, num_experts=8, top_k=1, length=5000, a=2.0, b=0.0, seed=5, shuffle=True)
    order = np.array(trace.meta.extra["popularity_order"])
    assert sorted(order[0]) == list(range(8))
    for layer in range(6):
        counts = np.bincount(trace.experts[:, layer, 0], minlength=8)
        assert counts.argmax() == order[layer, 0]
    assert len(set(order[:, 0].tolist())) > 1, "every layer got the same popular expert"
    plain = zipf_trace(num_layers=6, num_experts=8, top_k=1, length=5000, a=2.0, b=0.0, seed=5)
    assert "popularity_order" not in plain.meta.extra
    assert (np.bincount(plain.experts[:, :, 0].ravel()).argmax()) == 0


def test_zipf_metadata_describes_the_generator():
    trace = zipf_trace(num_layers=2, num_experts=4, top_k=2, length=10, a=1.5, b=0.5, seed=9)
    meta = trace.meta
    assert meta.model == "synthetic-zipf"
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (2, 4, 2)
    for fragment in ("zipf_trace", "a=1.5", "b=0.5", "seed=9", "length=10"):
        assert fragment in meta.source
    assert trace.probs is None and trace.weights is None
    assert trace.experts.dtype == np.uint8


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(top_k=9), "top_k=9 exceeds"),
    (dict(a=-1.0), "exponent a"),
    (dict(b=-1.0), "offset b"),
    (dict(length=0), "length"),
    (dict(num_layers=0), "num_layers"),
])
def test_zipf_rejects_impossible_parameters(kwargs, fragment):
    arguments = dict(num_layers=2, num_experts=8, top_k=2, length=10, a=1.0, b=0.0, seed=0) | kwargs
    with pytest.raises(ConfigError, match=fragment):
        zipf_trace(**arguments)


def test_cyclic_trace_is_theorem_3_3():
    L, k, rounds = 3, 8, 10
    n = (k + 1) // L
    trace = cyclic_trace(num_layers=L, cache_size=k, rounds=rounds)
    assert (trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k) == (L, n, 1)
    for i, layer in itertools.product(range(rounds), range(L)):
        assert trace.experts[i, layer, 0] == i % n
    # As a request sequence: p_1^(1..L), p_2^(1..L), ..., p_n^(1..L), p_1^(1..L), ... over k+1 distinct pages.
    expected = [layer * n + i % n for i in range(rounds) for layer in range(L)]
    assert flatten(trace).expert_id.tolist() == expected
    assert len(set(expected)) == k + 1
    assert trace.meta.model == "synthetic-cyclic" and "cache_size=8" in trace.meta.source


def test_cyclic_trace_needs_layers_to_divide_cache_plus_one():
    with pytest.raises(ConfigError, match="divide"):
        cyclic_trace(num_layers=3, cache_size=7, rounds=5)


def test_fixed_partition_trace_is_theorem_3_1():
    L, n, rounds, z = 4, 3, 9, 2
    trace = fixed_partition_trace(num_layers=L, num_experts=n, rounds=rounds, cycling_layer=z)
    assert (trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k) == (L, n, 1)
    for i, layer in itertools.product(range(rounds), range(L)):
        assert trace.experts[i, layer, 0] == (i % n if layer == z else 0)
    # n + L - 1 distinct experts are requested in all: a cache that large never misses after warm-up.
    assert np.unique(flatten(trace).expert_id).size == n + L - 1
    assert trace.meta.model == "synthetic-fixed-partition" and "cycling_layer=2" in trace.meta.source


def test_fixed_partition_default_cycles_layer_zero():
    trace = fixed_partition_trace(num_layers=2, num_experts=4, rounds=6)
    np.testing.assert_array_equal(trace.experts[:, 0, 0], [0, 1, 2, 3, 0, 1])
    assert (trace.experts[:, 1, 0] == 0).all()


def test_fixed_partition_rejects_a_missing_layer():
    with pytest.raises(ConfigError, match="cycling_layer"):
        fixed_partition_trace(num_layers=2, num_experts=4, rounds=6, cycling_layer=2)
