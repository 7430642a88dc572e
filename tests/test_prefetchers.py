"""Every prefetcher, on hand-built tiny traces, proposes what its formula says; none but the oracle sees the
future; a trace without a column a prefetcher needs is refused with a message that says how to get it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.policies.moe_infinity import EPSILON
from moe_offload.prefetch import (PREFETCHERS, ModelSpec, Proposal, RoutingView, check_trace_columns,
                                  make_prefetcher, prefetcher_info, prefetcher_options, search_latency)
from moe_offload.prefetch.eam import EAMCollection, build_eamc, eam_distance, sequence_eams
from moe_offload.prefetch.expert_map_store import ExpertMapStore
from moe_offload.prefetch.fmoe import FMoEPrefetcher
from moe_offload.prefetch.fmoe_sets import compiled_set_functions
from moe_offload.trace.format import Trace, TraceMeta


def make_trace(experts, **columns) -> Trace:
    experts = np.asarray(experts)
    _, L, K = experts.shape
    J = columns.pop("num_experts")
    return Trace.build(TraceMeta("hand-built", L, J, K), experts, **columns)


def drive(prefetcher, trace: Trace, view_type=RoutingView) -> list[list[list[Proposal]]]:
    """Run the hooks as the driver does, iteration by iteration; per iteration the proposals of
    [on_iteration_start, on_layer_routed(0), ..., on_layer_routed(L-1)]."""
    L = trace.meta.num_layers
    out = []
    for iteration in np.unique(trace.iteration):
        view = view_type(trace, int(iteration), np.flatnonzero(trace.iteration == iteration))
        hooks = [prefetcher.on_iteration_start(view)]
        for layer in range(L):
            view.layer_now = layer
            hooks.append(prefetcher.on_layer_routed(view))
        prefetcher.on_iteration_end(view)
        out.append(hooks)
    return out


def as_dict(proposals) -> dict[int, float]:
    keys = [p.key for p in proposals]
    assert len(keys) == len(set(keys)), "one proposal per expert"
    return {p.key: p.priority for p in proposals}


def random_full_trace(seed=0, L=4, J=6, K=2, tokens=24, requests=4, D=5) -> Trace:
    """Every optional column, router-consistent: the selected experts are the top-K of ``probs``."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(J, 0.5), size=(tokens, L))
    experts = np.argsort(-probs, axis=2, kind="stable")[:, :, :K]
    request = np.arange(tokens) % requests
    return make_trace(experts, num_experts=J, request=request, iteration=np.arange(tokens) // requests,
                      position=np.arange(tokens) // requests, probs=probs,
                      embedding=rng.normal(size=(requests, D))[request],
                      gate_prediction=np.clip(probs[:, 1:] + rng.normal(0, 0.05, probs[:, 1:].shape), 0, 1))


# ---------------------------------------------------------------------------------------------- registry


def test_registry_names_and_descriptions():
    assert list(PREFETCHERS) == ["topk", "traced-topk", "moe-infinity", "fmoe", "moepic", "mixtral-offloading",
                                 "pre-gated", "oracle"]
    for name, cls in PREFETCHERS.items():
        assert cls.name == name and cls.summary and cls.source
        assert set(cls.requires) <= {"probs", "embedding", "gate_prediction", "weights"}
    assert PREFETCHERS["fmoe"].requires == ("probs", "embedding")
    assert PREFETCHERS["moepic"].requires == ("gate_prediction",)


def test_unknown_prefetcher_and_option_are_config_errors():
    with pytest.raises(ConfigError, match="unknown prefetcher 'lru'.*topk, traced-topk, moe-infinity, fmoe"):
        prefetcher_info("lru")
    with pytest.raises(ConfigError, match="has no option depth; it takes distance=3"):
        make_prefetcher("oracle", ModelSpec(2, 4, 1), {"depth": 2})
    with pytest.raises(ConfigError, match="topk.k 0: must be a whole number from 1 to 4"):
        make_prefetcher("topk", ModelSpec(2, 4, 1), {"k": 0})
    assert prefetcher_options("fmoe") == {"capacity": None, "distance": 3, "search_seconds": None,
                                         "semantic": "iteration",
                                          "embedding_dims": None, "candidates": None, "map_dtype": "float32",
                                          "lists": None, "probes": 8, "seed": 0}


def test_fmoe_store_capacity_follows_the_papers_sizing_guidance():
    # Paper 000: 2LJ maps bound the similarity at 75%, 1/2 LJ ln(LJ) at 98%; the default is the larger.
    assert make_prefetcher("fmoe", ModelSpec(16, 64, 8)).capacity == 3549  # OLMoE: 512 * ln(1024) = 3549.1
    assert make_prefetcher("fmoe", ModelSpec(32, 8, 2)).capacity == 710    # Mixtral: 128 * ln(256) = 709.8 > 512
    assert make_prefetcher("fmoe", ModelSpec(4, 6, 2)).capacity == 48      # 12 * ln(24) = 38.1 < 2LJ = 48
    assert make_prefetcher("fmoe", ModelSpec(4, 6, 2), {"capacity": 5}).capacity == 5


@pytest.mark.parametrize("name, column, hint", [
    ("fmoe", "probs", "record the trace with full router probabilities"),
    ("fmoe", "embedding", "record the trace with `moe-offload record`"),
    ("moepic", "gate_prediction", "record the trace with next-layer gate predictions"),
])
def test_missing_column_is_refused_with_how_to_get_it(name, column, hint):
    full = random_full_trace()
    trace = Trace.build(full.meta, full.experts, request=full.request, iteration=full.iteration,
                        position=full.position, **{c: getattr(full, c) for c in ("probs", "embedding",
                                                                                  "gate_prediction") if c != column},
                        path="no-column.parquet")
    cls = prefetcher_info(name)
    with pytest.raises(ConfigError) as error:
        check_trace_columns(cls, trace)
    message = str(error.value)
    assert f"prefetcher {name!r}" in message and f"column {column!r}" in message and hint in message
    assert "no-column.parquet" in message
    prefetcher = make_prefetcher(name, ModelSpec(4, 6, 2))
    with pytest.raises(ConfigError, match=column):  # the hooks refuse too, rather than propose nothing
        drive(prefetcher, trace)
    if name == "fmoe":
        with pytest.raises(ConfigError, match=column):
            prefetcher.fit(trace)
    check_trace_columns(cls, full)  # a complete trace passes


def test_history_of_another_model_is_refused():
    with pytest.raises(ConfigError, match="3 layers x 6 experts, the model served has 4 x 6"):
        make_prefetcher("traced-topk", ModelSpec(4, 6, 2)).fit(random_full_trace(L=3))


# ---------------------------------------------------------------------------------------------- the future


class NoOracleView(RoutingView):
    def oracle_selected(self, layer):
        raise AssertionError("a real prefetcher looked at the future")


def test_only_the_bounds_read_the_future():
    assert [n for n, cls in PREFETCHERS.items() if cls.reads_future] == ["pre-gated", "oracle"]


@pytest.mark.parametrize("name", [n for n in PREFETCHERS if not PREFETCHERS[n].reads_future])
def test_real_prefetchers_never_see_the_future(name):
    trace = random_full_trace(seed=1)
    prefetcher = make_prefetcher(name, ModelSpec(4, 6, 2), {"capacity": 4} if "capacity" in
                                 prefetcher_options(name) else None)
    prefetcher.fit(random_full_trace(seed=2))
    drive(prefetcher, trace, NoOracleView)

    # Stronger: changing what layers after l do in the last iteration cannot change any proposal up to l.
    cut = 1
    last = trace.iteration == trace.iteration.max()
    rng = np.random.default_rng(3)
    changed = {c: getattr(trace, c).copy() for c in ("experts", "probs", "gate_prediction")}
    changed["probs"][last, cut + 1:] = rng.dirichlet(np.ones(6), size=(last.sum(), 4 - cut - 1))
    changed["experts"][last, cut + 1:] = np.argsort(-changed["probs"][last, cut + 1:], axis=2)[:, :, :2]
    changed["gate_prediction"][last, cut + 1:] = rng.random((last.sum(), 4 - 1 - cut - 1, 6))
    other = Trace.build(trace.meta, changed["experts"], request=trace.request, iteration=trace.iteration,
                        position=trace.position, probs=changed["probs"], embedding=trace.embedding,
                        gate_prediction=changed["gate_prediction"])
    runs = []
    for source in (trace, other):
        fresh = make_prefetcher(name, ModelSpec(4, 6, 2), {"capacity": 4} if "capacity" in
                                prefetcher_options(name) else None)
        fresh.fit(random_full_trace(seed=2))
        runs.append(drive(fresh, source)[-1][:cut + 2])  # start and layers 0..cut of the last iteration
    assert runs[0] == runs[1]


def test_the_oracle_does_see_the_future():
    oracle = make_prefetcher("oracle", ModelSpec(4, 6, 2))
    with pytest.raises(AssertionError):
        drive(oracle, random_full_trace(), NoOracleView)


# ---------------------------------------------------------------------------------------------- oracle


def test_oracle_proposes_the_true_experts_of_the_next_layers():
    # one iteration of two tokens, L = 4, J = 6
    experts = [[[0, 1], [2, 3], [4, 5], [0, 5]],
               [[1, 2], [2, 4], [4, 0], [1, 5]]]
    trace = make_trace(experts, num_experts=6, iteration=[0, 0], request=[0, 1], position=[0, 0])
    start, *after = drive(make_prefetcher("oracle", ModelSpec(4, 6, 2), {"distance": 2}), trace)[0]
    assert as_dict(start) == {0: 1.0, 1: 1.0, 2: 1.0, 6 + 2: 0.5, 6 + 3: 0.5, 6 + 4: 0.5}
    assert as_dict(after[1]) == {12 + 4: 1.0, 12 + 5: 1.0, 12 + 0: 1.0, 18 + 0: 0.5, 18 + 5: 0.5, 18 + 1: 0.5}
    assert as_dict(after[2]) == {18 + 0: 1.0, 18 + 1: 1.0, 18 + 5: 1.0}
    assert after[3] == []
    assert [p.priority for p in start] == sorted((p.priority for p in start), reverse=True)


# ---------------------------------------------------------------------------------------------- TopK, Traced-TopK


def test_topk_takes_the_lowest_ids_of_the_next_layer():
    trace = make_trace([[[5, 4], [5, 4], [5, 4]]], num_experts=6)
    start, l0, l1, l2 = drive(make_prefetcher("topk", ModelSpec(3, 6, 2)), trace)[0]
    assert start == [Proposal(0, 1.0), Proposal(1, 0.5)]
    assert l0 == [Proposal(6, 1.0), Proposal(7, 0.5)]
    assert l1 == [Proposal(12, 1.0), Proposal(13, 0.5)]
    assert l2 == []
    assert [p.key for p in drive(make_prefetcher("topk", ModelSpec(3, 6, 2), {"k": 3}), trace)[0][1]] == [6, 7, 8]


def test_traced_topk_counts_popularity_on_history_and_online():
    spec = ModelSpec(2, 5, 1)
    # history: layer 1 selects 3, 3, 3, 2, 2, 4 -> popularity 3 > 2 > 4
    history = make_trace([[[0], [e]] for e in (3, 3, 3, 2, 2, 4)], num_experts=5)
    prefetcher = make_prefetcher("traced-topk", spec, {"k": 2})
    prefetcher.fit(history)
    # the run: layer 1 selects 2 three times more; after it, 2 (5 counts) overtakes 3 (3 counts)
    run = make_trace([[[1], [2]]] * 3, num_experts=5)
    hooks = drive(prefetcher, run)
    assert hooks[0][1] == [Proposal(5 + 3, 3 / 6), Proposal(5 + 2, 2 / 6)]
    assert hooks[1][1] == [Proposal(5 + 2, 3 / 7), Proposal(5 + 3, 3 / 7)]  # tie: lower id first
    assert hooks[2][1] == [Proposal(5 + 2, 4 / 8), Proposal(5 + 3, 3 / 8)]
    assert hooks[0][0] == [Proposal(0, 1.0), Proposal(1, 0.0)]  # layer 0: only expert 0 was ever used
    assert prefetcher.counts[1].tolist() == [0, 0, 5, 3, 1]


# ---------------------------------------------------------------------------------------------- MoE-Infinity


def test_eam_distance_is_equation_1():
    m1 = np.array([[2, 0], [1, 1]])
    m2 = np.array([[1, 1], [0, 3]])
    # per layer: cos((1, 0), (.5, .5)) = 1/sqrt(2); cos((.5, .5), (0, 1)) = 1/sqrt(2)
    assert eam_distance(m1, m2) == pytest.approx(1 - 1 / math.sqrt(2))
    assert eam_distance(m1, m1) == pytest.approx(0.0)
    assert eam_distance(m1, 7 * m1) == pytest.approx(0.0)  # independent of the number of tokens
    rng = np.random.default_rng(0)
    eams = rng.integers(0, 5, size=(7, 3, 4))
    eams[:, :, 0] += 1  # no empty row in the collection
    current = rng.integers(0, 5, size=(2, 3, 4))
    index, distance = EAMCollection(eams).nearest(current)
    for b in range(2):
        exact = [eam_distance(e, current[b]) for e in eams]
        assert index[b] == int(np.argmin(exact)) and distance[b] == pytest.approx(min(exact), abs=1e-6)


def test_sequence_eams_count_tokens_per_expert():
    trace = make_trace([[[0, 1], [2, 0]], [[0, 2], [2, 1]], [[1, 2], [0, 1]]], num_experts=3,
                       request=[7, 7, 9], iteration=[0, 1, 2], position=[0, 1, 0])
    requests, eams = sequence_eams(trace)
    assert requests.tolist() == [7, 9]
    assert eams[0].tolist() == [[2, 1, 1], [1, 1, 2]]
    assert eams[1].tolist() == [[0, 1, 1], [1, 1, 0]]


def test_eamc_kmeans_keeps_the_member_nearest_each_centroid_and_is_seeded():
    # three clear groups of one-layer EAMs over 3 experts; in each, the pure one is nearest the centroid
    groups = [[[10, 0, 0]], [[9, 1, 0]], [[9, 0, 1]],
              [[0, 10, 0]], [[1, 9, 0]], [[0, 9, 1]],
              [[0, 0, 10]], [[1, 0, 9]], [[0, 1, 9]]]
    eams = np.array(groups)
    for seed in range(5):
        chosen = build_eamc(eams, 3, seed=seed)
        assert sorted(chosen.tolist()) == [0, 3, 6]
    rng = np.random.default_rng(1)
    many = rng.integers(0, 6, size=(40, 4, 5))
    many[:, :, 0] += 1
    first = build_eamc(many, 6, seed=7)
    assert first.tolist() == build_eamc(many, 6, seed=7).tolist()
    assert len(first) == 6 == len(set(first.tolist()))
    assert build_eamc(many[:5], 6).tolist() == [0, 1, 2, 3, 4]  # fewer EAMs than the capacity: all of them
    assert len(build_eamc(np.repeat(many[:1], 10, axis=0), 4)) == 1  # identical EAMs: one cluster


def test_moe_infinity_priorities_follow_algorithm_1():
    L, J = 3, 4
    spec = ModelSpec(L, J, 1)
    # history: sequence 0 always routes to expert 0, sequence 1 mostly to 3 (and twice to 2 in layer 2)
    history = make_trace([[[0], [0], [0]]] * 4 + [[[3], [3], [3]]] * 2 + [[[3], [3], [2]]] * 2, num_experts=J,
                         request=[0] * 4 + [1] * 4, iteration=list(range(8)), position=[0, 1, 2, 3] * 2)
    prefetcher = make_prefetcher("moe-infinity", spec, {"capacity": 2})
    prefetcher.fit(history)
    # the run: one sequence routing to 3, then to 0
    run = make_trace([[[3], [3], [1]], [[0], [0], [0]]], num_experts=J, request=[5, 5], iteration=[0, 1])
    hooks = drive(prefetcher, run)
    assert hooks[0][0] == []  # Algorithm 1 prefetches only after a layer is routed

    def expected(eam, layer):
        return {fl * J + e: (eam[fl][e] / sum(eam[fl]) + EPSILON) * (1 - fl / L)
                for fl in range(layer + 1, L) for e in range(J)}

    seq0 = [[4, 0, 0, 0], [4, 0, 0, 0], [4, 0, 0, 0]]
    seq1 = [[0, 0, 0, 4], [0, 0, 0, 4], [0, 0, 2, 2]]
    assert prefetcher.eamc.eams.tolist() == [seq0, seq1]  # no more sequences than the capacity: all, in order
    got = as_dict(hooks[0][1])
    assert got.keys() == expected(seq1, 0).keys()
    for key, priority in expected(seq1, 0).items():
        assert got[key] == pytest.approx(priority, rel=1e-12)
    assert got[2 * J + 2] == pytest.approx((0.5 + EPSILON) * (1 / 3))
    assert as_dict(hooks[0][3]) == {}  # the last layer: nothing later
    # second iteration, token (0, 0, 0); the sequence's EAM so far is [0,0,0,1], [0,0,0,1], [0,1,0,0].
    # After layer 0, row 0 = [1,0,0,1]: cosine 1/sqrt2 with both sequences' row 0, but row 1 still matches
    # only sequence 1, which stays the nearest ...
    assert prefetcher.current_eam(5)[0].tolist() == [1, 0, 0, 1]
    assert as_dict(hooks[1][1]) == pytest.approx(expected(seq1, 0))
    # ... after layer 1, row 1 = [1,0,0,1] as well: both distances are 1 - (2/sqrt2 + 0)/3, a tie that the
    # first EAM of the EAMC wins (Algorithm 1 replaces the best only on a strictly smaller distance)
    assert as_dict(hooks[1][2]) == pytest.approx(expected(seq0, 1))


def test_moe_infinity_without_history_refuses_to_run():
    with pytest.raises(ConfigError, match="moe-infinity has no EAMC to search.*give it a history"):
        drive(make_prefetcher("moe-infinity", ModelSpec(4, 6, 2)), random_full_trace())


def test_moe_infinity_keeps_one_eam_per_sequence_and_refines_every_layer():
    L, J = 2, 3
    history = make_trace([[[0], [0]], [[2], [2]]], num_experts=J, request=[0, 1], iteration=[0, 1])
    prefetcher = make_prefetcher("moe-infinity", ModelSpec(L, J, 1))
    prefetcher.fit(history)
    # one batched iteration: request 8 routes like sequence 0, request 9 like sequence 1
    run = make_trace([[[0], [1]], [[2], [1]]], num_experts=J, request=[8, 9], iteration=[0, 0], position=[0, 0])
    hooks = drive(prefetcher, run)
    # layer 1 of the predicted EAMs: 0 -> expert 0, 1 -> expert 2; each wanted at (1 + eps)(1 - 1/2)
    assert as_dict(hooks[0][1]) == pytest.approx({3: (1 + EPSILON) / 2, 4: EPSILON / 2, 5: (1 + EPSILON) / 2})
    assert prefetcher.current_eam(8).tolist() == [[1, 0, 0], [0, 1, 0]]
    assert prefetcher.current_eam(9).tolist() == [[0, 0, 1], [0, 1, 0]]


def dataset_switch_trace(L=3, sequences=6):
    """Sequences of two decode iterations each, one at a time: the first half routes every layer to experts 0
    and 1 (dataset A), the second half to 4 and 5 (dataset B)."""
    experts, request, iteration = [], [], []
    for sequence in range(2 * sequences):
        pair = [0, 1] if sequence < sequences else [4, 5]
        for step in range(2):
            experts.append([pair] * L)
            request.append(sequence)
            iteration.append(2 * sequence + step)
    return make_trace(experts, num_experts=6, request=request, iteration=iteration,
                      position=[i % 2 for i in range(len(request))])


def first_choices_per_sequence(prefetcher, trace) -> list[set[int]]:
    """Per sequence, the two highest-priority proposals after layer 0 of its first iteration; the driver ends
    each sequence after its last iteration."""
    choices = []
    for iteration in np.unique(trace.iteration):
        rows = np.flatnonzero(trace.iteration == iteration)
        view = RoutingView(trace, int(iteration), rows)
        prefetcher.on_iteration_start(view)
        for layer in range(trace.meta.num_layers):
            view.layer_now = layer
            proposed = prefetcher.on_layer_routed(view)
            if layer == 0 and iteration % 2 == 0:
                choices.append({p.key for p in proposed[:2]})
        prefetcher.on_iteration_end(view)
        if iteration % 2 == 1:
            prefetcher.on_request_end(int(trace.request[rows[0]]))
    return choices


@pytest.mark.parametrize("search", ["exhaustive", "incremental"])
def test_moe_infinity_rebuilds_the_eamc_when_the_dataset_switches(search):
    # Paper 002, sections 4.3 and 8.5: sequences the EAMC covers badly are recorded and the EAMC is rebuilt
    # from the history and them. The history is dataset A only; the run switches to B halfway.
    J, spec = 6, ModelSpec(3, 6, 2)
    history = make_trace([[[0, 1]] * 3, [[0, 1]] * 3], num_experts=J, request=[0, 1], iteration=[0, 1])
    trace = dataset_switch_trace()
    a, b = {J + 0, J + 1}, {J + 4, J + 5}  # layer 1's experts of A and of B

    fixed = make_prefetcher("moe-infinity", spec, {"capacity": 2, "search": search})
    fixed.fit(history)
    assert first_choices_per_sequence(fixed, trace) == [a] * 12  # B is never predicted

    shifting = make_prefetcher("moe-infinity", spec, {"capacity": 2, "search": search, "rebuild_after": 2})
    shifting.fit(history)
    # A sequences are at distance 0 from the EAMC: not recorded. The first two B sequences are at distance 1
    # (no common expert: every cosine 0) > 0.5: recorded; the second triggers the rebuild, K-means of 2 A and
    # 2 B EAMs into 2 clusters, and from the third B sequence on B is predicted.
    assert first_choices_per_sequence(shifting, trace) == [a] * 6 + [a, a] + [b] * 4
    assert shifting.rebuilds == 1 and shifting.recorded == 0
    # one EAM of each dataset: a recorded B sequence (2 tokens) and a history A sequence (1 token)
    assert sorted(map(tuple, shifting.eamc.eams[:, 1].tolist())) == [(0, 0, 0, 0, 2, 2), (1, 1, 0, 0, 0, 0)]


# ---------------------------------------------------------------------------------------------- fMoE


def prefetch_sets(predicted: np.ndarray, scores, min_experts: int) -> np.ndarray:
    """[..., J] mask of the similarity-aware prefetch set (fmoe_sets.similarity_aware_set, one request) of each
    predicted distribution ``predicted`` [..., J] (as float32) searched with similarity ``scores`` [...]."""
    similarity_aware_set = compiled_set_functions()[0]
    rows = np.asarray(predicted, dtype=np.float32).reshape(-1, np.shape(predicted)[-1])
    scores = np.broadcast_to(np.asarray(scores, dtype=np.float64), np.shape(predicted)[:-1]).reshape(-1)
    mask = np.zeros(rows.shape, dtype=bool)
    keys, wanted = np.empty(rows.shape[1], dtype=np.int64), np.empty(rows.shape[1])
    for row, score, chosen in zip(rows, scores, mask):
        count = similarity_aware_set(row[None], np.array([score]), min_experts, 0, keys, wanted)
        chosen[keys[:count]] = True
    return mask.reshape(np.shape(predicted))


def test_similarity_aware_prefetch_set():
    p = np.array([0.16, 0.04, 0.12, 0.10, 0.08, 0.22, 0.28])
    # score 0.7 -> delta 0.3: 0.28 < 0.3, 0.28 + 0.22 >= 0.3: {6, 5}
    assert np.flatnonzero(prefetch_sets(p, 0.7, 1)).tolist() == [5, 6]
    assert np.flatnonzero(prefetch_sets(p, 0.7, 3)).tolist() == [0, 5, 6]  # at least K
    # score 0.3 -> delta 0.7: .28 + .22 + .16 + .12 = .78 is the first sum >= .7
    assert np.flatnonzero(prefetch_sets(p, 0.3, 1)).tolist() == [0, 2, 5, 6]
    assert np.flatnonzero(prefetch_sets(p, 1.0, 2)).tolist() == [5, 6]   # delta 0: K experts
    assert prefetch_sets(p, -0.5, 1).all()                               # delta clipped to 1: everything
    # ties go to the lower id; a batch of rows at once
    rows = prefetch_sets(np.array([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.32, 0.38]]), np.array([0.6, 0.6]), 1)
    assert rows.tolist() == [[True, True, False, False], [False, False, True, True]]


def semantic_embedding(score):
    """A 3-d embedding whose cosine with (1, 0, 0) is ``score`` and with (0, 0, 1) is 0."""
    return [score, math.sqrt(1 - score ** 2), 0.0]


def fmoe_with_store(L, J, K, maps, embeddings, **options):
    prefetcher = FMoEPrefetcher(ModelSpec(L, J, K), **options)
    prefetcher.store.add(np.asarray(maps, dtype=np.float32), np.asarray(embeddings, dtype=np.float32))
    return prefetcher


def test_fmoe_semantic_search_first_d_layers_then_trajectory():
    L, J, K, d = 4, 5, 1, 2
    # map A (embedding e1) prefers expert 0 in every layer, map B (embedding e3) expert 4
    map_a = np.tile([0.6, 0.1, 0.1, 0.1, 0.1], (L, 1))
    map_b = np.tile([0.1, 0.1, 0.1, 0.1, 0.6], (L, 1))
    prefetcher = fmoe_with_store(L, J, K, [map_a, map_b], [[1, 0, 0], [0, 0, 1]], distance=d)
    # the request's prompt resembles A's (score 0.7) but it routes like B
    probs = np.array([map_b])
    trace = make_trace(np.full((1, L, K), 4), num_experts=J, probs=probs, embedding=[semantic_embedding(0.7)])
    start, l0, l1, l2, l3 = drive(prefetcher, trace)[0]
    # before layer 0: layers 0 and 1 from A with delta = 0.3 -> {0} (0.6 >= 0.3); priority p / (l + 1)
    assert as_dict(start) == pytest.approx({0: 0.6 / 1, J + 0: 0.6 / 2})
    # after layer 0: trajectory (layer 0 of B observed exactly: score 1, delta 0 -> K = 1 expert) predicts
    # layer 2 from B; layer 1 keeps A's prediction, its priority now p / (1 - 0)
    assert as_dict(l0) == pytest.approx({J + 0: 0.6 / 1, 2 * J + 4: 0.6 / 2})
    assert as_dict(l1) == pytest.approx({2 * J + 4: 0.6 / 1, 3 * J + 4: 0.6 / 2})
    assert as_dict(l2) == pytest.approx({3 * J + 4: 0.6 / 1})
    assert l3 == []
    predicted = prefetcher.predicted_map()
    assert predicted[:2] == pytest.approx(map_a[:2]) and predicted[2:] == pytest.approx(map_b[2:])


def request_of_three_iterations():
    """Request 0: a prefill of two tokens, then two decode tokens, each token's input embedding its own axis
    of R^4; each iteration's router prefers expert 0, 1, 2 (every layer)."""
    L, J = 2, 4
    e = np.eye(4)
    probs = np.full((4, L, J), 0.1)
    for row, expert in enumerate([0, 0, 1, 2]):
        probs[row, :, expert] = 0.7
    return make_trace(np.argmax(probs, axis=2)[:, :, None], num_experts=J, request=[0] * 4,
                      iteration=[0, 0, 1, 2], position=[0, 1, 2, 3], phase=[0, 0, 1, 1], probs=probs, embedding=e)


@pytest.mark.parametrize("semantic, expected", [
    # paper 000: the semantic embedding of each inference iteration, from the embedding layer's output: the
    # mean over the prompt in prefill, the new token's in decode; it changes along the request
    ("iteration", [[0.5, 0.5, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]),
    # the other reading: the mean over every token the request has fed so far
    ("request", [[0.5, 0.5, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [0.25, 0.25, 0.25, 0.25]]),
])
def test_fmoe_records_a_semantic_embedding_per_iteration(semantic, expected):
    trace = request_of_three_iterations()
    prefetcher = make_prefetcher("fmoe", ModelSpec(2, 4, 1), {"semantic": semantic})
    drive(prefetcher, trace)
    store = prefetcher.store
    assert len(store) == 3  # one entry per iteration of the request, keyed by that iteration's embedding
    np.testing.assert_allclose(np.diag(store.semantic_scores(np.array(expected))), 1.0, rtol=1e-6)
    fitted = make_prefetcher("fmoe", ModelSpec(2, 4, 1), {"semantic": semantic})
    fitted.fit(trace)  # the history's entries pool the same way
    np.testing.assert_allclose(np.diag(fitted.store.semantic_scores(np.array(expected))), 1.0, rtol=1e-6)


def test_fmoe_a_decode_token_matches_history_by_its_own_input_not_its_request():
    # History holds one iteration whose input was the token of axis 3 and whose router chose expert 3. The
    # run's last decode token is that token: per iteration it matches the history with score 1 (delta 0:
    # K = 1 expert, 3). Pooled over the request, its best match is its own previous iteration (score 0.87:
    # (1,1,1,1)/4 against (1,1,1,0)/3; the history scores 0.5), whose map prefers expert 1 (delta 0.13).
    trace = request_of_three_iterations()
    probs = np.full((1, 2, 4), 0.1)
    probs[0, :, 3] = 0.7
    history = make_trace(np.full((1, 2, 1), 3), num_experts=4, request=[7], probs=probs, embedding=[np.eye(4)[3]])
    starts = {}
    for semantic in ("iteration", "request"):
        prefetcher = make_prefetcher("fmoe", ModelSpec(2, 4, 1), {"semantic": semantic, "distance": 1})
        prefetcher.fit(history)
        starts[semantic] = drive(prefetcher, trace)[2][0]  # on_iteration_start of the last iteration
    assert as_dict(starts["iteration"]) == pytest.approx({3: 0.7}, rel=1e-3)
    assert as_dict(starts["request"]) == pytest.approx({1: 0.7}, rel=1e-3)
    with pytest.raises(ConfigError, match="semantic must be one of iteration, request"):
        make_prefetcher("fmoe", ModelSpec(2, 4, 1), {"semantic": "prompt"})


def test_fmoe_threshold_widens_the_set_for_a_poor_match():
    L, J, K = 2, 4, 1
    stored = np.array([[0.5, 0.3, 0.15, 0.05]] * L)
    prefetcher = fmoe_with_store(L, J, K, [stored], [[1, 0, 0]], distance=2)
    trace = make_trace(np.zeros((1, L, K), int), num_experts=J, probs=[stored], embedding=[semantic_embedding(0.3)])
    start = drive(prefetcher, trace)[0][0]
    # score 0.3 -> delta 0.7: 0.5 + 0.3 >= 0.7, so experts 0 and 1 of both layers
    assert as_dict(start) == pytest.approx({0: 0.5, 1: 0.3, J: 0.25, J + 1: 0.15})


def test_fmoe_store_is_filled_from_history_and_by_the_run():
    trace = random_full_trace(tokens=12, requests=3)
    prefetcher = make_prefetcher("fmoe", ModelSpec(4, 6, 2), {"capacity": 100})
    assert drive(prefetcher, trace.select(slice(0, 3)))[0] == [[]] * 5  # empty store: nothing to search
    assert prefetcher.predicted_map() is None
    assert len(prefetcher.store) == 3  # ... but the iteration's three requests were stored as it ended
    prefetcher.fit(trace)
    assert len(prefetcher.store) == 3 + 12
    np.testing.assert_allclose(prefetcher.store.maps([3]),
                               trace.probs[:1].astype(np.float32), rtol=1e-6)
    # a prefill iteration: one entry per request, the mean of its tokens' distributions
    prefill = Trace.build(trace.meta, trace.experts[:4], request=[0, 0, 0, 1], iteration=[0] * 4,
                          position=[0, 1, 2, 0], phase=[0] * 4, probs=trace.probs[:4], embedding=trace.embedding[:4])
    fresh = make_prefetcher("fmoe", ModelSpec(4, 6, 2))
    fresh.fit(prefill)
    assert len(fresh.store) == 2
    np.testing.assert_allclose(fresh.store.maps([0])[0], trace.probs[:3].astype(np.float32).mean(axis=0), rtol=1e-5)


def test_fmoe_fit_in_chunks_and_batches_equals_one_entry_per_iteration_and_request(monkeypatch):
    import moe_offload.prefetch.fmoe as fmoe_module

    rng = np.random.default_rng(5)
    L, J, K, D = 3, 4, 1, 2
    # prefill iterations of several tokens next to decode iterations of a batch of two requests
    request = [0, 0, 0, 1, 1, 0, 1, 0, 1, 2, 2, 2, 2, 2]
    iteration = [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4]
    phase = [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # prefill, decode
    probs = rng.dirichlet(np.ones(J), size=(len(request), L))
    history = make_trace(np.argsort(-probs, axis=2)[:, :, :K], num_experts=J, request=request, iteration=iteration,
                         phase=phase, position=np.arange(len(request)), probs=probs,
                         embedding=rng.normal(size=(len(request), D)))
    groups = {}
    for row, key in enumerate(zip(iteration, request)):
        groups.setdefault(key, []).append(row)
    expected = np.stack([history.probs[rows].astype(np.float32).mean(axis=0) for rows in groups.values()])
    monkeypatch.setattr(fmoe_module, "FIT_CHUNK_ROWS", 4)
    monkeypatch.setattr(fmoe_module, "FIT_BATCH", 2)
    prefetcher = FMoEPrefetcher(ModelSpec(L, J, K), capacity=100)
    prefetcher.fit(history)
    assert len(prefetcher.store) == len(groups) == 7
    np.testing.assert_allclose(prefetcher.store.maps(np.arange(7)), expected, rtol=1e-5)


def test_store_deduplication_replaces_the_most_redundant_map():
    L, J = 4, 2
    e = np.eye(3, dtype=np.float32)
    map_x = np.tile([1.0, 0.0], (L, 1))
    map_y = np.tile([0.0, 1.0], (L, 1))
    # the new entry's prompt is X's (score_sem 1 vs 0) but its map is nearer Y's (score_map 0.96 vs 0.28)
    map_z = np.tile([0.28, 0.96], (L, 1))
    # RDY = d/L * score_sem + (L - d)/L * score_map against (X, Y)
    cases = {1: ([1 / 4 + 3 / 4 * 0.28, 3 / 4 * 0.96], "y"), 3: ([3 / 4 + 1 / 4 * 0.28, 1 / 4 * 0.96], "x")}
    for distance, (redundancy, replaced) in cases.items():
        store = ExpertMapStore(L, J, capacity=2, distance=distance)
        store.add(np.stack([map_x, map_y]), e[[0, 1]])
        np.testing.assert_allclose(store.redundancy(map_z[None], e[[0]]), [redundancy], rtol=1e-6)
        store.add(map_z[None], e[[0]])
        assert len(store) == 2
        expected = [map_z, map_y] if replaced == "x" else [map_x, map_z]
        np.testing.assert_allclose(store.maps([0, 1]), expected, rtol=1e-6)
    # a batch: each new entry replaces a different stored one, in batch order
    store = ExpertMapStore(L, J, capacity=2, distance=1)
    store.add(np.stack([map_x, map_y]), e[[0, 1]])
    store.add(np.stack([map_x, map_x]), e[[0, 0]])
    np.testing.assert_allclose(store.maps([0, 1]), [map_x, map_x])
    assert len(store) == 2


def test_trajectory_search_equals_the_cosine_over_the_observed_prefix():
    rng = np.random.default_rng(4)
    L, J, C, B = 5, 7, 30, 3
    maps = rng.dirichlet(np.ones(J), size=(C, L)).astype(np.float32)
    store = ExpertMapStore(L, J, capacity=C, distance=2)
    store.add(maps, rng.normal(size=(C, 4)))
    query = rng.dirichlet(np.ones(J), size=(B, L)).astype(np.float32)
    search = store.search(rng.normal(size=(B, 4)))
    for layer in range(L):
        index, score = search.observe(layer, query[:, layer])
        prefix = maps[:, :layer + 1].reshape(C, -1)
        for b in range(B):
            q = query[b, :layer + 1].reshape(-1)
            cosines = prefix @ q / (np.linalg.norm(prefix, axis=1) * np.linalg.norm(q))
            assert index[b] == int(np.argmax(cosines)) and score[b] == pytest.approx(cosines.max(), abs=1e-5)
    with pytest.raises(ValueError, match="in order"):
        store.search(rng.normal(size=(B, 4))).observe(1, query[:, 1])


def test_search_latency_is_measured_or_modelled():
    trace = random_full_trace()
    measured = make_prefetcher("fmoe", ModelSpec(4, 6, 2))
    measured.fit(trace)
    view = RoutingView(trace, 0, np.flatnonzero(trace.iteration == 0))
    measured.on_iteration_start(view)
    seconds, on_path = search_latency(measured)
    assert 0 < seconds < 1 and on_path is False
    modelled = make_prefetcher("moe-infinity", ModelSpec(4, 6, 2), {"search_seconds": 0.002})
    modelled.fit(trace)
    modelled.on_iteration_start(view)
    assert search_latency(modelled) == (0.0, True)  # nothing searched before layer 0
    view.layer_now = 0
    modelled.on_layer_routed(view)
    assert search_latency(modelled) == (0.002, True)
    assert search_latency(make_prefetcher("topk", ModelSpec(4, 6, 2))) == (0.0, False)
    with pytest.raises(ConfigError, match="fmoe.search_seconds -1: must be a number at least 0"):
        make_prefetcher("fmoe", ModelSpec(4, 6, 2), {"search_seconds": -1})


# ---------------------------------------------------------------------------------------------- MoEpic


def test_moepic_prefetches_the_top_predicted_experts_of_the_next_layer():
    L, J = 3, 5
    gate = np.zeros((2, L - 1, J))
    gate[0, 0] = [0.1, 0.5, 0.05, 0.3, 0.05]   # token 0 predicts layer 1: 1, 3
    gate[1, 0] = [0.4, 0.45, 0.05, 0.05, 0.05]  # token 1 predicts layer 1: 1, 0
    gate[:, 1] = [0.2, 0.2, 0.2, 0.2, 0.2]     # layer 2: a five-way tie, lower ids first
    trace = make_trace(np.zeros((2, L, 2), int) + [0, 1], num_experts=J, iteration=[0, 0], request=[0, 1],
                       position=[0, 0], gate_prediction=gate)
    start, l0, l1, l2 = drive(make_prefetcher("moepic", ModelSpec(L, J, 2)), trace)[0]
    assert start == [] and l2 == []  # no next_token_gate_prediction column: layer 0 is left to the cache
    # without a budget (no driver timing), top-k = 2 per token; the highest score any token gives the expert
    assert as_dict(l0) == pytest.approx({J + 1: 0.5, J + 0: 0.4, J + 3: 0.3}, rel=1e-3)
    assert [p.key for p in l0] == [J + 1, J + 0, J + 3]  # descending predicted score
    assert as_dict(l1) == pytest.approx({2 * J + 0: 0.2, 2 * J + 1: 0.2}, rel=1e-3)
    assert [p.key for p in drive(make_prefetcher("moepic", ModelSpec(L, J, 2), {"prefetches": 1}),
                                 trace)[0][1]] == [J + 1]


def test_mixtral_offloading_prefetches_the_guessed_top_k_of_the_next_layer_only():
    # Paper 004's Mixtral-offloading baseline: layer l+1's router on layer l's hidden state, its top-k per token;
    # no guess of the next token's layer 0 and no window budget (unlike MoEpic).
    from moe_offload.prefetch.budget import PrefetchBudget

    L, J = 3, 5
    gate = np.zeros((2, L - 1, J))
    gate[0, 0] = [0.1, 0.5, 0.05, 0.3, 0.05]   # token 0 guesses layer 1: 1, 3
    gate[1, 0] = [0.4, 0.45, 0.05, 0.05, 0.05]  # token 1 guesses layer 1: 1, 0
    gate[:, 1] = [0.1, 0.2, 0.3, 0.2, 0.2]     # layer 2: 2, then a tie of 1, 3, 4 to the lower id
    trace = make_trace(np.zeros((2, L, 2), int) + [0, 1], num_experts=J, iteration=[0, 0], request=[0, 1],
                       position=[0, 0], gate_prediction=gate, next_token_gate_prediction=np.full((2, J), 0.2))
    prefetcher = make_prefetcher("mixtral-offloading", ModelSpec(L, J, 2))
    prefetcher.set_budget(PrefetchBudget(expert_load_seconds=1.0, window_seconds=(9.0,) * L, prefetches=(5, 5, 5)))
    start, l0, l1, l2 = drive(prefetcher, trace)[0]
    assert start == [] and l2 == []  # layer 0 of the next token is not guessed
    assert as_dict(l0) == pytest.approx({J + 1: 0.5, J + 0: 0.4, J + 3: 0.3}, rel=1e-3)  # the highest a token gives
    assert [p.key for p in l0] == [J + 1, J + 0, J + 3]
    assert [p.key for p in l1] == [2 * J + 2, 2 * J + 1]
    one = drive(make_prefetcher("mixtral-offloading", ModelSpec(L, J, 2), {"k": 1}), trace)[0]
    assert [p.key for p in one[1]] == [J + 1] and [p.key for p in one[2]] == [2 * J + 2]
    with pytest.raises(ConfigError, match="gate_prediction"):
        check_trace_columns(PREFETCHERS["mixtral-offloading"],
                            make_trace(np.zeros((1, L, 2), int) + [0, 1], num_experts=J))


def test_pre_gated_prefetches_exactly_the_next_layers_selection():
    # Pre-gated MoE: layer l's pre-gate selects layer l+1's experts, so after layer l every expert layer l+1
    # selects (over the pass's tokens) is proposed, nothing further ahead, nothing for layer 0.
    L, J = 3, 6
    experts = np.array([[[0, 1], [2, 3], [4, 5]],
                        [[0, 2], [3, 5], [4, 1]]])
    trace = make_trace(experts, num_experts=J, iteration=[0, 0], request=[0, 1], position=[0, 0])
    start, l0, l1, l2 = drive(make_prefetcher("pre-gated", ModelSpec(L, J, 2)), trace)[0]
    assert start == [] and l2 == []
    assert as_dict(l0) == {J + 2: 1.0, J + 3: 1.0, J + 5: 1.0}
    assert as_dict(l1) == {2 * J + 1: 1.0, 2 * J + 4: 1.0, 2 * J + 5: 1.0}


def one_token_gate_trace(L=3, J=6):
    """One decode token whose prediction of layer 1 ranks experts 5, 4, 3, 2, 1, 0 and of layer 2 0, 1, ..."""
    gate = np.zeros((1, L - 1, J))
    gate[0, 0] = [0.01, 0.04, 0.1, 0.15, 0.3, 0.4]
    gate[0, 1] = [0.4, 0.3, 0.15, 0.1, 0.04, 0.01]
    return make_trace(np.zeros((1, L, 2), int) + [0, 1], num_experts=J, gate_prediction=gate)


def test_moepic_prefetches_y_greater_than_k_when_the_configuration_says_so():
    # Paper 004: experts are prefetched "one by one in descending order of their predicted scores" and the
    # configurator's Y (equation 11) counts how many fit in the window; it may exceed K = 2.
    from moe_offload.prefetch.budget import PrefetchBudget

    L, J = 3, 6
    prefetcher = make_prefetcher("moepic", ModelSpec(L, J, 2))
    prefetcher.set_budget(PrefetchBudget(expert_load_seconds=1.0, window_seconds=(9.0,) * L, prefetches=(0, 4, 3)))
    _, l0, l1, _ = drive(prefetcher, one_token_gate_trace(L, J))[0]
    assert [p.key for p in l0] == [J + 5, J + 4, J + 3, J + 2]   # Y_1 = 4 > K, in descending score
    assert [p.key for p in l1] == [2 * J + 0, 2 * J + 1, 2 * J + 2]  # Y_2 = 3
    assert [p.key for p in drive(make_prefetcher("moepic", ModelSpec(L, J, 2), {"prefetches": 9}),
                                 one_token_gate_trace(L, J))[0][1]] == [J + e for e in (5, 4, 3, 2, 1, 0)]


@pytest.mark.parametrize("window, load, expected", [(2.5, 1.0, 2), (3.0, 1.0, 3), (0.2, 1.0, 0), (9.0, 1.0, 6)])
def test_moepic_without_a_configuration_prefetches_until_the_window_is_spent(window, load, expected):
    # The loads that complete on an idle link before the router fires, floor(window / load): equation 11's Y
    # for unsplit experts; none when not one fits; at most the layer's 6 experts.
    from moe_offload.prefetch.budget import PrefetchBudget

    L, J = 3, 6
    prefetcher = make_prefetcher("moepic", ModelSpec(L, J, 2))
    prefetcher.set_budget(PrefetchBudget(expert_load_seconds=load, window_seconds=(window,) * L))
    l0 = drive(prefetcher, one_token_gate_trace(L, J))[0][1]
    assert [p.key for p in l0] == [J + e for e in (5, 4, 3, 2, 1, 0)][:expected]


def test_prefetch_budget_from_a_hardware_profile():
    from moe_offload.prefetch.budget import budget_from_hardware
    from test_timed import profile

    # test_timed's profile: 100 B/s, 0.5 s latency; attention 1 s, router 0.25 s, expert 2 s, LM head 0.5 s
    budget = budget_from_hardware(profile(), 100, num_layers=3, top_k=2)
    assert budget.expert_load_seconds == pytest.approx(1.5)
    assert budget.window_seconds == pytest.approx((0.5 + 1.25, 2 * 2 + 1.25, 2 * 2 + 1.25))
    assert [budget.loads_in_window(layer) for layer in range(3)] == [1, 3, 3]


def test_moepic_predicts_layer_0_of_the_next_token_from_the_last_layer():
    # AdapMoE's rule in paper 004: layer 0 of token t+1 is predicted from token t's last layer. A prefill of two
    # requests (positions 0-2 and 0-1), then one decode token each: after the last router of the prefill, each
    # request's *last* prompt token predicts layer 0 of its first decode token; the other rows' predictions
    # are of tokens the same pass already routed.
    L, J = 2, 4
    rows = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (1, 0, 3), (1, 1, 2)]  # iteration, request, pos
    iteration, request, position = (np.array(column) for column in zip(*rows))
    next_token = np.full((7, J), 0.25)
    next_token[2] = [0.1, 0.2, 0.3, 0.4]   # request 0's last prompt token: 3, 2
    next_token[4] = [0.7, 0.1, 0.1, 0.1]   # request 1's last prompt token: 0, then a tie 1, 2 -> 1
    next_token[0] = [0.0, 0.0, 0.0, 1.0]   # an earlier prompt token: not a prediction of the next pass
    trace = make_trace(np.zeros((7, L, 2), int) + [0, 1], num_experts=J, iteration=iteration, request=request,
                       position=position, phase=[0] * 5 + [1] * 2, gate_prediction=np.full((7, L - 1, J), 0.25),
                       next_token_gate_prediction=next_token)
    prefill = drive(make_prefetcher("moepic", ModelSpec(L, J, 2)), trace)[0]
    assert as_dict(prefill[2]) == pytest.approx({3: 0.4, 2: 0.3, 0: 0.7, 1: 0.1}, rel=1e-3)  # keys of layer 0
    view = RoutingView(trace, 1, np.array([5, 6]))
    view.layer_now = L - 1
    np.testing.assert_allclose(view.gate_prediction(L - 1), next_token[5:], rtol=1e-3)
