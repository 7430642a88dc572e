"""MoEpic's cache configurator (paper 004, section 3.4): the statistics, equations 5-11, Algorithm 1, the CLI.

Line numbers in comments are those of the plain text of paper 004 (Yan et al., "Accelerating Mixture-of-Expert
Inference with Adaptive Expert Split Mechanism")."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import astuple, replace

import numpy as np
import pytest

from moe_offload.bundled import DEFAULT_TINY_TRACE, DEFAULT_TRACE
from moe_offload.cli.main import main
from moe_offload.simulator.configurator import (MoepicStatistics, Timings, configure, expert_split, layer_latency,
                                      measure_statistics, solve_layer, timings_from_hardware)
from moe_offload.errors import ConfigError
from moe_offload.policies.base import AccessContext, ModelSpec
from moe_offload.policies.lcp import LCP
from moe_offload.simulator.partitioned_cache import PartitionedCache
from moe_offload.simulator.timed.schedule import leading_iterations
from moe_offload.trace.format import Trace, TraceMeta, read_trace, write_trace
from moe_offload.trace.synthetic import zipf_trace


def routed_trace(seed: int = 0, tokens: int = 200, expert_bytes: int | None = 4096) -> Trace:
    """Six layers of 16 experts, top-2, each layer with its own Zipf skew, and a gate prediction whose
    accuracy differs by layer: a mix of the true next-layer selection and noise."""
    skews = (0.3, 1.5, 0.8, 1.2, 0.5, 2.0)
    signal = np.array((0.9, 0.5, 0.7, 0.3, 0.8))  # weight of the truth in layers 1..5's prediction
    rng = np.random.default_rng(seed)
    experts = np.stack([zipf_trace(num_layers=1, num_experts=16, top_k=2, length=tokens, a=a, b=1.0,
                                   seed=seed * 10 + layer, shuffle=True).experts[:, 0]
                        for layer, a in enumerate(skews)], axis=1)
    truth = np.zeros((tokens, 6, 16))
    np.put_along_axis(truth, experts.astype(np.intp), 1.0, axis=2)
    prediction = signal[:, None] * truth[:, 1:] + (1 - signal[:, None]) * rng.random((tokens, 5, 16))
    prediction /= prediction.sum(axis=2, keepdims=True)
    meta = TraceMeta(model="synthetic", num_layers=6, num_experts=16, top_k=2, expert_bytes=expert_bytes)
    return Trace.build(meta, experts, gate_prediction=prediction)


@pytest.fixture(scope="module")
def measured():
    return measure_statistics(routed_trace())


TIMINGS = Timings(expert_load=0.6e-3, expert_compute=0.1e-3, attention=0.3e-3, moe=0.2e-3, head=0.2e-3)


# ----------------------------------------------------------------------------------------------- statistics

def hand_trace() -> Trace:
    """Two layers of 3 experts, top-1, five tokens; layer 1 is predicted from layer 0 (gate_prediction[:, 0])."""
    experts = np.array([[0, 2], [0, 2], [1, 1], [2, 2], [0, 0]]).reshape(5, 2, 1)
    scores = np.array([[0.1, 0.2, 0.7],     # order 2, 1, 0
                       [0.6, 0.3, 0.1],     # order 0, 1, 2
                       [0.2, 0.5, 0.3],     # order 1, 2, 0
                       [0.25, 0.25, 0.5],   # order 2, 0, 1 (tie: lower id first)
                       [0.3, 0.4, 0.3]])    # order 1, 0, 2
    meta = TraceMeta(model="hand", num_layers=2, num_experts=3, top_k=1)
    return Trace.build(meta, experts, gate_prediction=scores[:, None, :])


def test_statistics_equal_hand_counts():
    stats = measure_statistics(hand_trace())
    # Over five tokens rho^(nu/omega) stays within [0.25^(4/128), 1] = [0.957, 1], so LCP evicts the expert
    # activated least often, and among equals the least recent.
    #
    # Layer 0 requests 0, 0, 1, 2, 0. The cache before each token (what the router finds) and the hits:
    #   C=1: {} {0}* {0} {1} {2}                               1 hit  -> H = 1/5
    #   C=2: {} {0}* {0} {0,1} {0,2}*  (at token 3, mu(0)=2 beats mu(1)=1, although 1 is more recent:
    #        LRU would evict 0 and miss token 4)                  2 hits -> H = 2/5
    #   C=3: {} {0}* {0} {0,1} {0,1,2}*                         2 hits -> H = 2/5
    assert stats.hit_rate[0].tolist() == pytest.approx([0, 0.2, 0.4, 0.4])
    # Layer 1 requests 2, 2, 1, 2, 0:
    #   C=1: {} {2}* {2} {1} {2}                               1 hit  -> 1/5
    #   C=2: {} {2}* {2} {1,2}* {1,2}                          2 hits -> 2/5 (C=3: the same caches)
    assert stats.hit_rate[1].tolist() == pytest.approx([0, 0.2, 0.4, 0.4])

    # P_1(y): is the y-th predicted expert the activated one?
    #   orders (2,1,0) (0,1,2) (1,2,0) (2,0,1) (1,0,2) against 2, 2, 1, 2, 0
    #   y=1: 2=2 0 1=1 2=2 1   -> 3/5;  y=2: only token 4 (0=0) -> 1/5;  y=3: only token 1 (2=2) -> 1/5
    assert stats.prediction_accuracy[1].tolist() == pytest.approx([0.6, 0.2, 0.2])
    # PH_1(y, C): is the y-th predicted expert in the cache the router finds?
    #   C=1 caches {} {2} {2} {1} {2}:  y=1: 2 0 1 2 1 -> none;  y=2: 1 1 2 0 0 -> token 2;
    #                                   y=3: 0 2 0 1 2 -> tokens 1, 3, 4
    #   C=2 (= C=3) caches {} {2} {2} {1,2} {1,2}:  y=1 -> tokens 3, 4;  y=2 -> token 2;  y=3 -> tokens 1, 3, 4
    assert stats.prediction_hit_rate[1, :, 1].tolist() == pytest.approx([0.0, 0.2, 0.6])
    assert stats.prediction_hit_rate[1, :, 2].tolist() == pytest.approx([0.4, 0.2, 0.6])
    assert stats.prediction_hit_rate[1, :, 3].tolist() == pytest.approx([0.4, 0.2, 0.6])
    # Layer 0 has no prediction in a trace (the paper's comes from the previous token's last layer).
    assert stats.predicted.tolist() == [False, True]
    assert not stats.prediction_accuracy[0].any() and not stats.prediction_hit_rate[0].any()
    assert stats.num_tokens == 5


def test_statistics_sum_rules(measured):
    trace = routed_trace()
    q, K, N = 200, 2, 16
    # Every activated expert has some predicted rank: sum_y P_i(y) = K.
    assert measured.prediction_accuracy[1:].sum(axis=1) == pytest.approx(np.full(5, K))
    # sum_y PH_i(y, C) is the mean number of cached experts, at most C.
    for size in range(1, N + 1):
        assert (measured.prediction_hit_rate[1:, :, size].sum(axis=1) <= size + 1e-9).all()
    # A cache of all N experts misses only first activations: H_i(N) = 1 - distinct / (q K).
    for layer in range(6):
        distinct = len(np.unique(trace.experts[:, layer]))
        assert measured.hit_rate[layer, N] == pytest.approx(1 - distinct / (q * K))
    # LCP is a stack algorithm (statistics.py): a larger cache holds what a smaller one holds, and hits as often.
    assert (np.diff(measured.hit_rate, axis=1) >= 0).all()
    assert (np.diff(measured.prediction_hit_rate, axis=2) >= 0).all()


def shadow_statistics(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """H_i(C) and PH_i(y, C) counted the long way, as a second implementation: one LCP cache of the shared
    cache (simulator/cache.py) for every size C, each fed every request, read before each token's own (layers
    1.. predicted from the layer before; layer 0 not predicted)."""
    L, J, K = trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k
    spec = ModelSpec(L, J, K)
    caches = [PartitionedCache(size * L, L, lambda: LCP(spec), J) for size in range(1, J + 1)]
    hits, resident_rank = np.zeros((L, J + 1)), np.zeros((L, J, J + 1))
    order = np.full((trace.num_tokens, L, J), -1)
    if trace.gate_prediction is not None:
        order[:, 1:] = np.argsort(-trace.gate_prediction.astype(np.float32), axis=-1, kind="stable")
    ctx, clock = AccessContext(), 0
    for token in range(trace.num_tokens):
        experts = trace.experts[token].astype(np.intp)
        ctx.token = token
        for size, cache in enumerate(caches, start=1):
            found = np.zeros((L, J), dtype=bool)
            for part in cache.parts:
                for key in part.resident:
                    found[key // J, key % J] = True
            for layer in range(L):
                hits[layer, size] += found[layer, experts[layer]].sum()
                if order[token, layer, 0] >= 0:
                    resident_rank[layer, :, size] += found[layer, order[token, layer]]
            for n, key in enumerate((experts + (np.arange(L) * J)[:, None]).reshape(-1).tolist()):
                ctx.clock, ctx.layer = clock + n, key // J
                cache.request(key, ctx)
        clock += experts.size
    return hits, resident_rank


@pytest.mark.parametrize("trace", [routed_trace(seed=3), leading_iterations(read_trace(DEFAULT_TINY_TRACE), 300)],
                         ids=["synthetic", "tiny"])
def test_every_size_from_one_stack_is_a_shadow_lcp_cache_of_that_size(trace):
    stats = measure_statistics(trace)
    hits, resident_rank = shadow_statistics(trace)
    q, K = trace.num_tokens, trace.meta.top_k
    np.testing.assert_array_equal(np.rint(stats.hit_rate * q * K), hits)
    # layers 1.. are predicted from the layer before in every token (layer 0's prediction, from the request's
    # previous token, is the same code before and after the stack)
    np.testing.assert_array_equal(np.rint(stats.prediction_hit_rate[1:] * q), resident_rank[1:])


def test_statistics_refuse_a_trace_without_gate_prediction():
    trace = zipf_trace(num_layers=2, num_experts=4, top_k=1, length=10, a=1.0, b=1.0, seed=0)
    with pytest.raises(ConfigError, match="no gate_prediction column"):
        measure_statistics(trace)


# -------------------------------------------------------------------------------------- equations 5 to 11

def hand_statistics() -> MoepicStatistics:
    """N = 4 experts, K = 2; both layers have the same H, layer 1 also a prediction (layer 0 none)."""
    hit_rate = [0, 0.375, 0.625, 0.75, 0.875]                  # H(C), C = 0..4
    accuracy = [0.75, 0.5, 0.5, 0.25]                          # P(y), y = 1..4, sums to K
    prediction_hit_rate = [[0, 0.5, 0.75, 0.75, 1],            # PH(y, C): row y, column C
                           [0, 0.25, 0.5, 0.75, 1],
                           [0, 0, 0.25, 0.5, 1],
                           [0, 0, 0, 0.25, 1]]
    return MoepicStatistics(num_tokens=8, top_k=2, hit_rate=np.array([hit_rate, hit_rate]),
                            prediction_accuracy=np.array([[0.0] * 4, accuracy]),
                            prediction_hit_rate=np.array([np.zeros((4, 5)), prediction_hit_rate]),
                            predicted=np.array([False, True]))


HAND_TIMINGS = Timings(expert_load=1.0, expert_compute=0.25, attention=0.5, moe=0.5, head=0.25)


def test_layer_latency_equations_5_to_7():
    # K = 4, T_exp = 0.5, T_load = 2, T_moe = 2, T_att = 1.
    timings = Timings(expert_load=2.0, expert_compute=0.5, attention=1.0, moe=2.0, head=0.0)
    # m = 3: T_hide = 3 * 0.5 = 1.5; T_miss = (4 - 3) * 2 = 2; exposed = 2 - 1.5 = 0.5;
    # next window = 2 - min(1.5, 2) + 1 = 1.5
    assert astuple(layer_latency(3.0, timings, 4)) == pytest.approx((1.5, 2.0, 0.5, 1.5))
    # m = 3.5: T_hide = 1.75; T_miss = 1; nothing exposed; next window = 2 - 1 + 1 = 2
    assert astuple(layer_latency(3.5, timings, 4)) == pytest.approx((1.75, 1.0, 0.0, 2.0))


def test_sub_problem_of_equation_11_by_hand():
    stats = hand_statistics()
    # V = 1.5, so C >= 2 (theta <= 1); window 1.0, T_load = 1.
    # C=2, theta=0.75: A_cache = 2 * 0.625 * 0.75 = 0.9375
    #   eq 9: T_pref(1) = 1 - 0.75*0.75 = 0.4375, T_pref(2) = 1 - 0.5*0.75 = 0.625: 0.4375 fits, 1.0625 not: Y = 1
    #   eq 10: A_pref(1) = 0.4375 * 0.75 = 0.328125           m = 1.265625
    # C=3, theta=0.5: A_cache = 2 * 0.75 * 0.5 = 0.75; T_pref = 0.625, 0.625: Y = 1; A_pref = 0.625*0.75 = 0.46875
    #                                                         m = 1.21875
    # C=4, theta=0.375: A_cache = 2 * 0.875 * 0.375 = 0.65625; T_pref = 0.625 each: Y = 1; A_pref = 0.46875
    #                                                         m = 1.125
    split = solve_layer(1.5, 1.0, stats, 1, HAND_TIMINGS)
    assert (split.cache_size, split.split_ratio, split.prefetches) == (2, 0.75, 1)
    assert split.loaded == pytest.approx(1.265625)
    assert split.hit_rate == 0.625
    # eqs 5-7: T_hide = 1.265625 * 0.25 = 0.31640625; T_miss = (2 - 1.265625) * 1 = 0.734375;
    # exposed = 0.41796875
    assert (split.hide, split.miss, split.exposed) == pytest.approx((0.31640625, 0.734375, 0.41796875))

    # A window of 2.5: C=2: T_pref 0.4375, 0.625, 0.8125 (sum 1.875), the 4th (1) does not fit: Y = 3,
    #   A_pref = 0.328125 + 0.625*0.5 + 0.8125*0.5 = 1.046875, m = 0.9375 + 1.046875 = 1.984375
    # C=3: T_pref 0.625, 0.625, 0.75 (2.0), then 0.875: Y = 3, A_pref = 0.46875 + 0.3125 + 0.375, m = 1.90625
    # C=4: T_pref 0.625 x 4 = 2.5 fits exactly: Y = 4, A_pref = 0.625 * 2 = 1.25, m = 0.65625 + 1.25 = 1.90625
    split = solve_layer(1.5, 2.5, stats, 1, HAND_TIMINGS)
    assert (split.cache_size, split.prefetches, split.loaded) == (2, 3, pytest.approx(1.984375))
    split = solve_layer(3.0, 2.5, stats, 1, HAND_TIMINGS)
    # V = 3: C=3, theta=1: A_cache = 2 * 0.75 = 1.5; T_pref = 0.25, 0.25, 0.5, 0.75 (sum 1.75): Y = 4,
    #   A_pref = 0.25*0.75 + 0.25*0.5 + 0.5*0.5 + 0.75*0.25 = 0.75, 1.5 + 0.75 = 2.25 -> m = K = 2 (line 171)
    assert (split.cache_size, split.split_ratio, split.prefetches, split.loaded) == (3, 1.0, 4, 2.0)
    assert split.exposed == 0.0

    # Layer 0 has no prediction: m = A_cache alone. C=2: 0.9375, C=3: 0.75, C=4: 0.65625.
    split = solve_layer(1.5, 1.0, stats, 0, HAND_TIMINGS)
    assert (split.cache_size, split.prefetches, split.loaded) == (2, 0, 0.9375)


def test_expert_split_chains_the_windows_of_equation_7():
    stats = hand_statistics()
    layers = expert_split([1.5, 1.5], stats, HAND_TIMINGS)
    # Layer 0: T_wind^1 = T_head + T_att = 0.25 + 0.5 = 0.75; m = 0.9375 (no prediction);
    #   T_hide = 0.234375, T_miss = 1.0625, exposed = 0.828125; T_wind^2 = 0.5 - 0.234375 + 0.5 = 0.765625
    # Layer 1, window 0.765625: C=2: 0.4375 fits, 1.0625 not -> m = 1.265625, exposed 0.41796875 (as above)
    assert [split.window for split in layers] == pytest.approx([0.75, 0.765625])
    assert [split.exposed for split in layers] == pytest.approx([0.828125, 0.41796875])
    assert layers[1].cache_size == 2


def brute_force_sub_problem(budget, window, hit_rate, accuracy, prediction_hit_rate, top_k, load):
    """Eq (11) literally: every cache size, prefetches added one by one while they fit the window."""
    best = None
    for size in range(1, len(accuracy) + 1):
        if size < budget:
            continue
        theta = budget / size
        spent = gained = 0.0
        for y in range(len(accuracy)):
            time = (1 - prediction_hit_rate[y][size] * theta) * load
            if spent + time > window:
                break
            spent += time
            gained += (1 - prediction_hit_rate[y][size] * theta) * accuracy[y]
        loaded = min(top_k, top_k * hit_rate[size] * theta + gained)
        if best is None or loaded > best[1]:
            best = (size, loaded)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_sub_problem_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(2, 9))
    K = int(rng.integers(1, N + 1))
    hit_rate = np.concatenate([[0.0], np.sort(rng.random(N))])
    accuracy = rng.dirichlet(np.ones(N)) * K
    accuracy = np.minimum(accuracy, 1.0)
    prediction_hit_rate = np.concatenate([np.zeros((N, 1)), np.sort(rng.random((N, N)), axis=1)], axis=1)
    stats = MoepicStatistics(num_tokens=1, top_k=K, hit_rate=hit_rate[None], prediction_accuracy=accuracy[None],
                             prediction_hit_rate=prediction_hit_rate[None], predicted=np.array([True]))
    timings = Timings(expert_load=float(rng.uniform(0.5, 2)), expert_compute=0.1, attention=0.1, moe=0.1 * K,
                      head=0.0)
    for budget in (float(rng.uniform(0.01, N)), float(rng.integers(1, N + 1)), float(N)):
        window = float(rng.uniform(0, N * timings.expert_load))
        split = solve_layer(budget, window, stats, 0, timings)
        size, loaded = brute_force_sub_problem(budget, window, hit_rate, accuracy, prediction_hit_rate, K,
                                               timings.expert_load)
        assert (split.cache_size, split.loaded) == (size, pytest.approx(loaded))
        assert split.split_ratio == pytest.approx(budget / size)


# ------------------------------------------------------------------------------------------- Algorithm 1

@pytest.mark.parametrize("budget, timings", [
    (20.0, TIMINGS),
    (48.0, TIMINGS),
    (6.0, TIMINGS),
    (12.0, Timings(expert_load=2e-3, expert_compute=0.2e-3, attention=0.5e-3, moe=0.4e-3, head=0.0)),
    (30.0, Timings(expert_load=0.3e-3, expert_compute=0.1e-3, attention=0.1e-3, moe=0.3e-3, head=0.1e-3)),
    (72.0, Timings(expert_load=1e-3, expert_compute=0.05e-3, attention=1e-3, moe=0.1e-3, head=0.0)),
])
def test_algorithm_1_lowers_the_total_conserves_the_budget_and_ends(measured, budget, timings):
    config = configure(measured, timings, budget, granularity=0.01)
    history = config.history
    assert config.moves > 0  # these inputs do move budget, so the checks below are not vacuous
    assert history[0] == pytest.approx(config.uniform_total_exposed)
    assert all(later < earlier for earlier, later in zip(history, history[1:]))   # every move lowers it
    assert config.total_exposed == pytest.approx(history[-1]) and config.total_exposed <= history[0]
    budgets = [split.budget for split in config.layers]
    assert sum(budgets) == pytest.approx(budget, rel=1e-12)
    assert all(0 < value <= 16 + 1e-9 for value in budgets)
    # Each budget is the uniform share plus whole steps of zeta * V_e.
    steps = (np.array(budgets) - budget / 6) / (0.01 * budget)
    assert steps == pytest.approx(np.round(steps), abs=1e-6)
    # The reported layers are ExpertSplit of the final budgets, and theta_i C_i = V_i.
    assert [s.exposed for s in config.layers] == pytest.approx([s.exposed for s in expert_split(budgets, measured,
                                                                                                   timings)])
    for split in config.layers:
        assert split.split_ratio * split.cache_size == pytest.approx(split.budget)
        assert 0 < split.split_ratio <= 1


def symmetric_statistics(num_layers: int) -> MoepicStatistics:
    """Identical layers without prediction (so the windows cannot tell them apart), N = 8, K = 2, and a
    hit rate that rises 1/8 per expert up to 4 experts, then 1/16."""
    hit_rate = np.array([0, 2, 4, 6, 8, 9, 10, 11, 12]) / 16
    return MoepicStatistics(num_tokens=1, top_k=2, hit_rate=np.tile(hit_rate, (num_layers, 1)),
                            prediction_accuracy=np.zeros((num_layers, 8)),
                            prediction_hit_rate=np.zeros((num_layers, 8, 9)),
                            predicted=np.zeros(num_layers, dtype=bool))


def test_algorithm_1_moves_by_hand():
    # Three layers without prediction, N = 8, K = 2, T_load = 1 and free computation: a layer's exposed
    # latency is K - m = 2 - 2 H(V) (a concave H makes C = V, theta = 1 the best at an integer budget V),
    # so the profit of one more expert is 2 (H(V+1) - H(V)) and the cost of one less 2 (H(V) - H(V-1)).
    increments = np.array([[4, 3, 2, 2, 2, 1, 1, 1],     # H(C) - H(C-1), in sixteenths
                           [3, 3, 3, 1, 1, 1, 1, 1],
                           [5, 4, 3, 1, 0, 0, 0, 0]]) / 16
    hit_rate = np.concatenate([np.zeros((3, 1)), np.cumsum(increments, axis=1)], axis=1)
    stats = replace(symmetric_statistics(3), hit_rate=hit_rate)
    timings = Timings(expert_load=1.0, expert_compute=0.0, attention=0.0, moe=0.0, head=0.0)
    config = configure(stats, timings, 12.0, granularity=1 / 12)   # V_i = 4, steps of one expert
    # Start (4, 4, 4): H = 11, 10, 13 sixteenths, total 6 - 2 * 34/16 = 1.75.
    # Move 1: profits 2/16 * (2, 1, 0) -> receiver 0; costs of layers 1, 2: 2/16 * (1, 1) -> giver 1 (first);
    #   (5, 3, 4): H = 13, 9, 13, total 6 - 2 * 35/16 = 1.625 < 1.75, kept.
    # Move 2: profits 2/16 * (1, 1, 0) -> receiver 0 (first); costs of layers 1, 2: 2/16 * (3, 1) -> giver 2;
    #   (6, 3, 3): H = 14, 9, 12, total 1.625 again: no profit, rolled back (Algorithm 1 line 23: >= 0).
    assert config.history == [1.75, 1.625]
    assert [split.budget for split in config.layers] == [5.0, 3.0, 4.0]
    assert [split.cache_size for split in config.layers] == [5, 3, 4]


def test_algorithm_1_keeps_the_uniform_allocation_of_a_symmetric_model():
    stats = symmetric_statistics(4)
    timings = Timings(expert_load=1.0, expert_compute=0.25, attention=0.5, moe=0.5, head=0.5)
    # V_e = 16, zeta = 1/16: V_i = 4 and steps of one expert. At an integer budget V the best C is V
    # (theta = 1), m = 2 H(V), exposed = (2 - m) - 0.25 m = 2 - 1.25 m:
    #   V = 3: m = 0.75, exposed 1.0625;  V = 4: m = 1, exposed 0.75;  V = 5: m = 1.125, exposed 0.59375
    # moving one expert: profit 0.75 - 0.59375 = 0.15625 < cost 1.0625 - 0.75 = 0.3125: rolled back.
    config = configure(stats, timings, 16.0, granularity=1 / 16)
    assert [split.budget for split in config.layers] == [4.0] * 4
    assert config.moves == 0 and config.total_exposed == pytest.approx(3.0)
    # ...and no allocation on the lattice does better.
    best = min(sum(split.exposed for split in expert_split(budgets, stats, timings))
               for budgets in itertools.product(range(1, 9), repeat=4) if sum(budgets) == 16)
    assert best == pytest.approx(3.0)


def test_algorithm_1_rolls_back_a_move_that_only_ties():
    # H(C) = C / 8: m = 2 V / 8 whatever C, exposed = 2 - 1.25 m is linear in V, so moving one expert
    # gains exactly what it costs (0.3125 each way); Algorithm 1 line 23 rolls back on a zero total profit.
    stats = replace(symmetric_statistics(3), hit_rate=np.tile(np.arange(9) / 8, (3, 1)))
    timings = Timings(expert_load=1.0, expert_compute=0.25, attention=0.5, moe=0.5, head=0.5)
    config = configure(stats, timings, 6.0, granularity=1 / 6)
    assert [split.budget for split in config.layers] == pytest.approx([2.0] * 3) and config.moves == 0


def test_algorithm_1_with_a_single_layer_or_all_the_memory(measured):
    config = configure(symmetric_statistics(1), HAND_TIMINGS, 5.0)
    assert config.layers[0].budget == 5.0 and config.moves == 0
    everything = configure(measured, TIMINGS, 96.0)
    assert all(split.budget == pytest.approx(16) and split.split_ratio == pytest.approx(1)
               and split.cache_size == 16 for split in everything.layers)


@pytest.mark.parametrize("budget, granularity, message", [
    (0.0, 0.01, "VRAM budget must be in"), (97.0, 0.01, "VRAM budget must be in"),
    (math.nan, 0.01, "VRAM budget"), (10.0, 0.0, "granularity"), (10.0, 1.0, "granularity"),
])
def test_configure_refuses_impossible_inputs(measured, budget, granularity, message):
    with pytest.raises(ConfigError, match=message):
        configure(measured, TIMINGS, budget, granularity)


def test_timings_from_hardware_and_their_checks():
    # T_load = latency + U_e / B = 10 us + 16 MB / 32 GB/s = 0.51 ms; T_moe = K T_exp = 8 * 0.1 ms.
    timings = timings_from_hardware(expert_bytes=16e6, bandwidth_bytes_per_s=32e9, transfer_latency_s=1e-5,
                                    expert_compute_s=1e-4, attention_s=3e-4, head_s=1e-3, top_k=8)
    assert timings == Timings(expert_load=pytest.approx(5.1e-4), expert_compute=1e-4, attention=3e-4,
                              moe=pytest.approx(8e-4), head=1e-3)
    with pytest.raises(ConfigError, match="shorter than computing"):
        replace(timings, moe=5e-4).check(8)
    with pytest.raises(ConfigError, match="load time must be positive"):
        replace(timings, expert_load=0.0).check(8)
    with pytest.raises(ConfigError, match="expert_compute"):
        replace(timings, expert_compute=-1.0).check(8)
    with pytest.raises(ConfigError, match="bandwidth"):
        timings_from_hardware(expert_bytes=1, bandwidth_bytes_per_s=0, expert_compute_s=0, attention_s=0, top_k=1)


# ------------------------------------------------------------------------------------------------------ CLI

@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return str(write_trace(routed_trace(tokens=120), tmp_path_factory.mktemp("configure") / "routed.parquet"))


TIMING_ARGS = ["--expert-load-ms", "0.6", "--expert-compute-ms", "0.1", "--attention-ms", "0.3"]


def assert_one_line_error(code: int, err: str, *fragments) -> None:
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("moe-offload: error: "), err
    for fragment in fragments:
        assert fragment in err, err


def test_configure_prints_a_table(trace_file, capsys):
    assert main(["configure", trace_file, "--vram-budget", "25%", *TIMING_ARGS]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())  # the title wraps at the temporary path's length
    for fragment in ("MoEpic configuration for 24.00 experts of VRAM (96 KiB): 22.00 cache segments, 2 are the "
                     "prefetch buffer, zeta = 0.01", "theta", "cached C",
                     "exposed ms", "budget moves", "uniform allocation", "layer 0 is configured without prefetching"):
        assert fragment in text, out
    assert len([line for line in out.splitlines() if line.startswith("│")]) == 6


def test_configure_json_matches_the_library(trace_file, capsys):
    assert main(["configure", trace_file, "--vram-budget", "96KiB", "--granularity", "0.02", "--json",
                 *TIMING_ARGS, "--moe-ms", "0.25", "--head-ms", "0.1"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["vram_budget_experts"] == 24.0  # 96 KiB of 4096-byte experts
    assert document["budget_experts"] == 22.0  # less the prefetch buffer of top-k = 2 experts
    assert document["timings_seconds"] == pytest.approx({"expert_load": 6e-4, "expert_compute": 1e-4,
                                                         "attention": 3e-4, "moe": 2.5e-4, "head": 1e-4})
    layers = document["layers"]
    assert len(layers) == 6 and sum(layer["budget"] for layer in layers) == pytest.approx(22.0)
    assert sum(layer["exposed"] for layer in layers) == pytest.approx(document["total_exposed_seconds"])
    assert all(layer["budget_bytes"] == round(layer["budget"] * 4096) for layer in layers)
    from moe_offload.trace.format import read_trace
    config = configure(measure_statistics(read_trace(trace_file)),
                       Timings(expert_load=6e-4, expert_compute=1e-4, attention=3e-4, moe=2.5e-4, head=1e-4),
                       22.0, 0.02)
    assert [layer["cache_size"] for layer in layers] == [split.cache_size for split in config.layers]
    assert document["total_exposed_seconds"] == pytest.approx(config.total_exposed)


def test_configure_refuses_a_trace_without_gate_prediction(capsys):
    code = main(["configure", str(DEFAULT_TRACE), "--vram-budget", "25%", *TIMING_ARGS])
    assert_one_line_error(code, capsys.readouterr().err, str(DEFAULT_TRACE), "no gate_prediction column")


@pytest.mark.parametrize("budget, message", [
    ("0", "must be positive"), ("-3", "must be positive"), ("0.0", "a fraction must be in (0, 1]"),
    ("1.5", "a fraction must be in (0, 1]"), ("150%", "a percentage must be in (0, 100]"),
    ("97", "more than the model's 96"), ("1GB", "more than the model's 96"), ("lots", "neither a number"),
    ("12 experts", "neither a number"), ("nan", "a fraction must be in (0, 1]"),
])
def test_configure_refuses_bad_budgets(trace_file, capsys, budget, message):
    code = main(["configure", trace_file, "--vram-budget", budget, *TIMING_ARGS])
    assert_one_line_error(code, capsys.readouterr().err, f"--vram-budget {budget!r}", message)


def test_configure_needs_the_expert_size_for_bytes(tmp_path, capsys):
    path = str(write_trace(routed_trace(tokens=20, expert_bytes=None), tmp_path / "sizeless.parquet"))
    code = main(["configure", path, "--vram-budget", "64KiB", *TIMING_ARGS])
    assert_one_line_error(code, capsys.readouterr().err, "give --expert-bytes")
    assert main(["configure", path, "--vram-budget", "64KiB", "--expert-bytes", "8192", "--json",
                 *TIMING_ARGS]) == 0
    assert json.loads(capsys.readouterr().out)["vram_budget_experts"] == 8.0


@pytest.mark.parametrize("args, message", [
    (["--expert-load-ms", "0.6"], "give --expert-compute-ms, --attention-ms"),
    ([*TIMING_ARGS, "--granularity", "1.5"], "granularity zeta must be in (0, 1)"),
    ([*TIMING_ARGS, "--moe-ms", "0.1"], "shorter than computing its top-k = 2 experts"),
    (["--expert-load-ms", "0", "--expert-compute-ms", "0.1", "--attention-ms", "0.3"], "load time must be positive"),
    ([*TIMING_ARGS, "--lcp-rho", "1.5"], "lcp.rho 1.5: must be a number in (0, 1)"),
])
def test_configure_refuses_bad_options(trace_file, capsys, args, message):
    code = main(["configure", trace_file, "--vram-budget", "20", *args])
    assert_one_line_error(code, capsys.readouterr().err, message)
