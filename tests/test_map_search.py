"""fMoE's Expert Map Store as rewritten for speed: its exhaustive mode proposes exactly what the previous
implementation proposed (tests/fmoe_reference.py) on the bundled recordings of the tiny model, one
request at a time and batched; the compact and pruned modes search what they say they search."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from fmoe_reference import ReferenceFMoE

from moe_offload.bundled import TINY_HISTORY_TRACE
from moe_offload.compiled import numba_available
from moe_offload.errors import ConfigError
from moe_offload.policies.base import ModelSpec
from moe_offload.prefetch.base import RoutingView
from moe_offload.prefetch.coarse_index import MIN_KEYS_PER_LIST, CoarseIndex
from moe_offload.prefetch.eam import EAMCollection, sequence_eams
from moe_offload.prefetch.expert_map_store import ExpertMapStore
from moe_offload.prefetch.fmoe import FMoEPrefetcher
from moe_offload.prefetch.fmoe_sets import compiled_set_functions, ranked_proposals, similarity_aware_set
from moe_offload.prefetch import map_ranking
from moe_offload.prefetch.map_ranking import (compiled_half_gather, compiled_trajectory_step, gather_half_maps,
                                             gather_half_maps_numpy, trajectory_step, trajectory_step_numpy)
from moe_offload.prefetch.moe_infinity import MoEInfinityPrefetcher
from moe_offload.trace import read_trace
from moe_offload.trace.format import PREFILL, Trace

CAPACITY = 300  # below the history's entries, so that every insert deduplicates


@pytest.fixture(scope="module")
def history():
    """The first 16 requests of tiny-history: about 1,000 entries for a store of CAPACITY."""
    trace = read_trace(TINY_HISTORY_TRACE)
    return trace.select(trace.request < np.unique(trace.request)[16])


@pytest.fixture(scope="module")
def fitted(history):
    """fMoE (exhaustive, the default) and the reference, each filled from ``history``."""
    spec = spec_of(history)
    fast, reference = FMoEPrefetcher(spec, capacity=CAPACITY), ReferenceFMoE(spec, capacity=CAPACITY)
    fast.fit(history)
    reference.fit(history)
    return fast, reference


def spec_of(trace: Trace) -> ModelSpec:
    return ModelSpec(trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k)


def batched(trace: Trace, requests) -> Trace:
    """``requests`` of ``trace`` served together: iteration s runs step s of each (its prefill first, then one
    decode token each), as a batch-recorded trace has them."""
    rows, iteration = [], []
    for request in requests:
        own = np.flatnonzero(trace.request == request)
        prefill = own[trace.phase[own] == PREFILL]
        steps = [prefill] + [own[[i]] for i in range(prefill.size, own.size)]
        for step, step_rows in enumerate(steps):
            rows.extend(step_rows.tolist())
            iteration.extend([step] * step_rows.size)
    order = np.argsort(np.asarray(iteration), kind="stable")
    rows, iteration = np.asarray(rows)[order], np.asarray(iteration)[order]
    return dataclasses.replace(trace.select(rows), iteration=iteration.astype(np.int32))


def run_hooks(prefetcher, trace: Trace, iterations: int):
    """Per iteration: the proposals of every hook and the predicted map after each."""
    L = trace.meta.num_layers
    out = []
    for iteration in np.unique(trace.iteration)[:iterations]:
        view = RoutingView(trace, int(iteration), np.flatnonzero(trace.iteration == iteration))
        hooks = [(prefetcher.on_iteration_start(view), copy_or_none(prefetcher.predicted_map()))]
        for layer in range(L):
            view.layer_now = layer
            hooks.append((prefetcher.on_layer_routed(view), copy_or_none(prefetcher.predicted_map())))
        prefetcher.on_iteration_end(view)
        out.append(hooks)
    return out


def copy_or_none(array):
    return None if array is None else np.array(array)


def assert_same_run(got, expected):
    assert len(got) == len(expected)
    for iteration, (hooks, reference) in enumerate(zip(got, expected)):
        for hook, ((proposals, predicted), (ref_proposals, ref_predicted)) in enumerate(zip(hooks, reference)):
            where = f"iteration {iteration}, hook {hook}"
            assert proposals == ref_proposals, where
            assert (predicted is None) == (ref_predicted is None), where
            if predicted is not None:
                assert np.array_equal(predicted, ref_predicted), where


@pytest.mark.parametrize("batch", [1, 4], ids=["one-request", "batched"])
def test_exhaustive_search_proposes_exactly_what_the_previous_implementation_did(tiny_trace, fitted, batch):
    run = tiny_trace if batch == 1 else batched(tiny_trace, np.unique(tiny_trace.request)[:batch])
    fast, reference = copy.deepcopy(fitted)
    assert len(fast.store) == CAPACITY
    np.testing.assert_array_equal(fast.store.maps(np.arange(CAPACITY)), reference.store.maps(np.arange(CAPACITY)))
    assert_same_run(run_hooks(fast, run, 120), run_hooks(reference, run, 120))
    np.testing.assert_array_equal(fast.store.maps(np.arange(CAPACITY)), reference.store.maps(np.arange(CAPACITY)))


def reference_nearest(eams, current):
    """MoE-Infinity's nearest-EAM search as it was before (np.linalg.norm, q @ units.T)."""
    def unit_rows(x):
        x = np.asarray(x, dtype=np.float32)
        norms = np.linalg.norm(x, axis=-1, keepdims=True)
        return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    units = unit_rows(eams).reshape(eams.shape[0], -1)
    distance = 1.0 - (unit_rows(current).reshape(current.shape[0], -1) @ units.T) / eams.shape[1]
    index = distance.argmin(axis=1)
    return index, distance[np.arange(index.size), index]


def test_eamc_search_returns_exactly_what_it_returned_before(history, tiny_trace):
    """Every prefix (after each iteration and layer) of the tiny trace's sequences, searched in an EAMC of
    tiny-history's sequences: the same EAM at the same distance, bit for bit."""
    _, eams = sequence_eams(history)
    eamc = EAMCollection(eams)
    L = tiny_trace.meta.num_layers
    queries = []
    for request in np.unique(tiny_trace.request)[:6]:
        counts = np.zeros((L, tiny_trace.meta.num_experts), dtype=np.int64)
        for row in np.flatnonzero(tiny_trace.request == request)[:60]:
            for layer in range(L):
                np.add.at(counts[layer], tiny_trace.experts[row, layer], 1)
                queries.append(counts.copy())
    queries = np.asarray(queries)
    for batch in (1, 5):
        for first in range(0, len(queries) - batch, 7):
            got = eamc.nearest(queries[first:first + batch])
            expected = reference_nearest(eams, queries[first:first + batch])
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])


def test_incremental_eam_search_equals_the_exhaustive_one(history, tiny_trace):
    """Per-layer cosines kept per sequence give the exhaustive search's distances (to float32 rounding), and on
    the tiny traces, batched, the same proposals at every layer."""
    _, eams = sequence_eams(history)
    eamc = EAMCollection(eams)
    rng = np.random.default_rng(3)
    current = rng.integers(0, 4, size=(20, *eams.shape[1:]))
    current[:, 5:] = 0  # layers not reached yet
    by_layer = np.stack([eamc.layer_similarities(layer, current[:, layer]) for layer in range(eams.shape[1])], axis=1)
    index, distance = eamc.nearest_from_layers(by_layer)
    exact_index, exact_distance = eamc.nearest(current)
    np.testing.assert_allclose(distance, exact_distance, atol=1e-6)
    np.testing.assert_array_equal(index, exact_index)
    run = batched(tiny_trace, np.unique(tiny_trace.request)[:3])
    spec = spec_of(run)
    exhaustive, incremental = (MoEInfinityPrefetcher(spec, search=search) for search in ("exhaustive", "incremental"))
    exhaustive.fit(history)
    incremental.fit(history)
    got, expected = run_hooks(incremental, run, 40), run_hooks(exhaustive, run, 40)
    assert [[proposals for proposals, _ in hooks] for hooks in got] == \
        [[proposals for proposals, _ in hooks] for hooks in expected]
    with pytest.raises(ConfigError, match="search must be one of exhaustive, incremental"):
        MoEInfinityPrefetcher(spec, search="fast")


def small_store(**options):
    rng = np.random.default_rng(7)
    L, J, C, D = 4, 6, 40, 16
    store = ExpertMapStore(L, J, capacity=C, distance=1, **options)
    maps = rng.dirichlet(np.ones(J), size=(C, L)).astype(np.float32)
    embeddings = rng.normal(size=(C, D)).astype(np.float32)
    store.add(maps, embeddings)
    return store, maps, embeddings, rng


def cosines(matrix, vector):
    return matrix @ vector / (np.linalg.norm(matrix, axis=1) * np.linalg.norm(vector))


def test_pruned_search_ranks_only_the_best_semantic_candidates():
    store, maps, embeddings, rng = small_store(candidates=5)
    query = rng.normal(size=(2, embeddings.shape[1])).astype(np.float32)
    observed = rng.dirichlet(np.ones(maps.shape[2]), size=(2, maps.shape[1])).astype(np.float32)
    search = store.search(query)
    for b in range(2):
        semantic = cosines(embeddings, query[b])
        assert sorted(search.candidates[b].tolist()) == sorted(np.argsort(-semantic)[:5].tolist())
        assert search.index[b] == int(np.argmax(semantic))  # the semantic search itself still sees every entry
    for layer in range(maps.shape[1]):
        index, score = search.observe(layer, observed[:, layer])
        for b in range(2):
            among = search.candidates[b]
            trajectory = cosines(maps[among, :layer + 1].reshape(5, -1), observed[b, :layer + 1].reshape(-1))
            assert index[b] == among[int(np.argmax(trajectory))]
            assert score[b] == pytest.approx(trajectory.max(), abs=1e-6)
    # the insert replaces, for each new entry, its most redundant candidate (RDY over the whole map)
    search.maps[:] = observed
    rdy = [0.25 * cosines(embeddings[search.candidates[b]], query[b])
           + 0.75 * cosines(maps[search.candidates[b]].reshape(5, -1), observed[b].reshape(-1)) for b in range(2)]
    first = search.candidates[0][int(np.argmax(rdy[0]))]
    second = search.candidates[1][[i for i in np.argsort(-rdy[1]) if search.candidates[1][i] != first][0]]
    store.add(search.maps, query, search)
    np.testing.assert_allclose(store.maps([first, second]), observed, rtol=1e-6)


def test_projected_embeddings_and_half_precision_maps():
    store, maps, embeddings, rng = small_store(embedding_dims=4, candidates=8, map_dtype="float16", seed=3)
    projection = np.random.default_rng(3).standard_normal((embeddings.shape[1], 4), dtype=np.float32)
    query = rng.normal(size=(1, embeddings.shape[1])).astype(np.float32)
    np.testing.assert_allclose(store.semantic_scores(query)[0], cosines(embeddings @ projection, query[0] @ projection),
                               atol=1e-6)
    assert store._maps.dtype == np.float16 and store.bytes_searched() == 16 * 4 * 4 + 40 * 4 * 4 + 8 * 4 * 6 * 2
    np.testing.assert_allclose(store.maps(np.arange(40)), maps, atol=1e-3)
    with pytest.raises(ConfigError, match="map_dtype=float16 needs candidates=M"):
        ExpertMapStore(4, 6, capacity=10, distance=1, map_dtype="float16")
    with pytest.raises(ConfigError, match="embedding_dims=16 does not reduce embeddings of size 16"):
        small_store(embedding_dims=16)
    with pytest.raises(ConfigError, match="fmoe.candidates 0: must be a whole number of at least 1"):
        FMoEPrefetcher(ModelSpec(4, 6, 1), candidates=0)


def test_pruned_trajectory_step_compiled_and_numpy_agree_bit_for_bit():
    """map_ranking's trajectory step, compiled with Numba (or, without Numba, run as plain Python) and as NumPy
    operations: the same dot products, norms, best columns and cosines, bit for bit, over 40 steps of random
    batches, with ties made on purpose (duplicated candidate maps) and a zero map."""
    compiled = trajectory_step
    if numba_available():
        import numba

        compiled = numba.njit(trajectory_step)
    rng = np.random.default_rng(11)
    for batch, count, experts in ((1, 32, 8), (3, 17, 128)):
        maps = rng.random((batch, count, experts), dtype=np.float32) ** 4
        maps[:, 1] = maps[:, 0]  # a tie: the later stamp wins
        maps[:, 2] = 0.0  # a zero map: cosine 0
        inverse_norms = 1.0 / np.maximum(rng.random((batch, count), dtype=np.float32), np.float32(1e-30))
        inverse_norms[:, 1] = inverse_norms[:, 0]
        stamps = rng.permutation(batch * count).reshape(batch, count).astype(np.int64)
        state = [(np.zeros((batch, count), np.float32), np.zeros(batch, np.float32)) for _ in range(2)]
        for _ in range(40):
            probs = rng.dirichlet(np.ones(experts), size=batch).astype(np.float32)
            out = []
            for step, (dots, query_sq) in zip((compiled, trajectory_step_numpy), state):
                best, score = np.empty(batch, np.int64), np.empty(batch, np.float32)
                step(maps, probs, dots, query_sq, inverse_norms, stamps, best, score)
                out.append((best, score))
            np.testing.assert_array_equal(state[0][0], state[1][0])
            np.testing.assert_array_equal(state[0][1], state[1][1])
            np.testing.assert_array_equal(out[0][0], out[1][0])
            np.testing.assert_array_equal(out[0][1], out[1][1])
            cosines = state[1][0] * inverse_norms / np.sqrt(state[1][1])[:, None]
            for b in range(batch):  # against the definition: the best cosine, ties to the newest
                tied = np.flatnonzero(cosines[b] >= cosines[b].max() - np.float32(1e-6))
                assert out[1][0][b] == tied[np.argmax(stamps[b, tied])]


@pytest.mark.parametrize("options", [{"candidates": 8}, {"candidates": 8, "lists": 8, "probes": 2},
                                     {"candidates": 8, "map_dtype": "float16"}],
                         ids=["pruned", "pruned-ivf", "pruned-float16"])
def test_pruned_fmoe_proposes_the_same_with_and_without_the_compiled_step(history, tiny_trace, options):
    """The package without Numba: a pruned store running map_ranking's NumPy step, and the prefetch sets and
    proposals of fmoe_sets run as plain Python, propose exactly what the compiled functions propose (with
    Numba installed; without it both run the plain forms), batched."""
    run = batched(tiny_trace, np.unique(tiny_trace.request)[:3])
    spec = spec_of(run)
    compiled, numpy_only = (FMoEPrefetcher(spec, capacity=CAPACITY, **options) for _ in range(2))
    numpy_only.store._trajectory_step = trajectory_step_numpy
    if numpy_only.store._gather_half_maps is not None:
        numpy_only.store._gather_half_maps = gather_half_maps_numpy
    numpy_only._similarity_aware_set, numpy_only._ranked_proposals = similarity_aware_set, ranked_proposals
    for prefetcher in (compiled, numpy_only):
        prefetcher.fit(history)
    assert_same_run(run_hooks(compiled, run, 60), run_hooks(numpy_only, run, 60))
    np.testing.assert_array_equal(compiled.store.maps(np.arange(CAPACITY)), numpy_only.store.maps(np.arange(CAPACITY)))


def reference_sets(rows, scores, min_experts, offset):
    """fMoE's batch prefetch set as the formula reads, with Python's sort and dict: per request the fewest
    experts of highest p (ties: lower id) whose float64 sum reaches clip(1 - score, 0, 1), at least
    ``min_experts``; over the batch each expert's highest p; by decreasing p, ties lower key."""
    union = {}
    for row, score in zip(rows, scores):
        delta = min(max(1.0 - float(score), 0.0), 1.0)
        ranked = sorted(range(row.size), key=lambda e: (-float(row[e]), e))
        total, count = 0.0, row.size
        for rank, expert in enumerate(ranked):
            total += float(row[expert])
            if total >= delta:
                count = rank + 1
                break
        for expert in ranked[:min(max(count, min_experts), row.size)]:
            union[offset + expert] = max(union.get(offset + expert, -1.0), float(row[expert]))
    return sorted(union.items(), key=lambda item: (-item[1], item[0]))


@pytest.mark.parametrize("form", ["compiled", "plain"])
def test_prefetch_sets_and_proposals_follow_the_formula_with_ties(form):
    """fmoe_sets against reference_sets and a sort of (-p / (t - now), key) tuples: random batches of
    distributions drawn from a few values (so that probabilities tie within and across requests, and
    priorities across targets), every delta from 0 to 1."""
    set_of, proposals_of = compiled_set_functions() if form == "compiled" else (similarity_aware_set,
                                                                              ranked_proposals)
    rng = np.random.default_rng(3)
    L, J, d = 6, 7, 3
    for _ in range(200):
        batch, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        set_keys, set_wanted, sizes = np.zeros((L, J), np.int64), np.zeros((L, J)), np.zeros(L, np.int64)
        expected = {}
        for target in range(L):
            rows = rng.choice(np.float32([0.0, 0.05, 0.1, 0.2, 0.25]), size=(batch, J))
            scores = rng.choice([-0.5, 0.0, 0.3, 0.55, 0.9, 1.0, 1.2], size=batch)
            sizes[target] = set_of(rows, scores, k, target * J, set_keys[target], set_wanted[target])
            expected[target] = reference_sets(rows, scores, k, target * J)
            got = list(zip(set_keys[target, :sizes[target]].tolist(), set_wanted[target, :sizes[target]].tolist()))
            assert got == expected[target]
        for now in range(-1, L - 1):
            last = min(now + d, L - 1)
            keys, priorities = np.empty(d * J, np.int64), np.empty(d * J)
            count = proposals_of(set_keys, set_wanted, sizes, now, last, keys, priorities)
            reference = sorted((-p / (t - now), key) for t in range(now + 1, last + 1) for key, p in expected[t])
            assert list(zip(keys[:count].tolist(), priorities[:count].tolist())) == [(key, -n) for n, key in reference]


@pytest.mark.parametrize("form", ["compiled", "plain", "numpy"])
def test_the_float16_gather_converts_every_half_exactly(form):
    """All 65,536 float16 bit patterns, gathered in a shuffled candidate order: the value NumPy gives each
    (bit for bit: zeros keep their sign, subnormals normalised, infinities), NaN for NaN."""
    gather = {"compiled": compiled_half_gather(), "plain": gather_half_maps, "numpy": gather_half_maps_numpy}[form]
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 16, 16)
    candidates = np.random.default_rng(0).permutation(256).reshape(2, 128)
    out = np.full((16, 2, 128, 16), -1.0, dtype=np.float32)
    gather(bits, candidates, out)
    expected = bits.view(np.float16)[candidates].transpose(2, 0, 1, 3).astype(np.float32)
    nan = np.isnan(expected)
    assert np.count_nonzero(nan) == 2 * 1023 and np.isnan(out[nan]).all()
    np.testing.assert_array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def test_without_numba_a_pruned_store_takes_the_numpy_step(monkeypatch):
    monkeypatch.setattr(map_ranking, "numba_available", lambda: False)
    compiled_trajectory_step.cache_clear()
    try:
        assert ExpertMapStore(4, 6, capacity=10, distance=1, candidates=3)._trajectory_step is trajectory_step_numpy
    finally:
        compiled_trajectory_step.cache_clear()


def test_coarse_index_lists_every_key_once_and_searches_the_nearest_lists():
    rng = np.random.default_rng(5)
    lists, dims = 4, 8
    index = CoarseIndex(lists, probes=2, seed=0)
    keys = rng.normal(size=(MIN_KEYS_PER_LIST * lists, dims)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    assert index.due(keys.shape[0]) and not index.due(keys.shape[0] - 1)
    index.train(keys)
    assert not index.due(keys.shape[0]) and index.due(2 * keys.shape[0])

    def check(keys):
        nearest = (keys @ index.centroids.T).argmax(axis=1)
        members = [sorted(index._members[row, :index._counts[row]].tolist()) for row in range(lists)]
        assert members == [sorted(np.flatnonzero(nearest == row).tolist()) for row in range(lists)]
        for row in range(lists):  # each list's copy of its keys
            count = index._counts[row]
            np.testing.assert_array_equal(index._keys[row, :count], keys[index._members[row, :count]])

    check(keys)
    for slot in (3, 0, 31, 32, 33):  # replaced keys move between lists; new slots join one
        key = rng.normal(size=dims).astype(np.float32)
        key /= np.linalg.norm(key)
        keys = np.vstack([keys, key]) if slot == keys.shape[0] else keys
        keys[slot] = key
        index.assign(slot, key)
        check(keys)
    query = keys[7]
    slots, cosines = index.search(query, minimum=1)
    ranked = np.argsort(-(index.centroids @ query), kind="stable")
    nearest = (keys @ index.centroids.T).argmax(axis=1)
    assert sorted(slots.tolist()) == sorted(np.flatnonzero(np.isin(nearest, ranked[:2])).tolist())
    np.testing.assert_allclose(cosines, keys[slots] @ query, rtol=1e-6)
    assert index.search(query, minimum=keys.shape[0])[0].size == keys.shape[0]  # more lists until the minimum


def test_pruned_store_with_a_coarse_index_searches_its_probed_candidates():
    """lists=N: the candidates are the M best of the probed lists' entries, the semantic result the best of
    them; the pruned trajectory and the insert work on them as without the index."""
    rng = np.random.default_rng(2)
    L, J, C, D = 3, 5, 200, 12
    store = ExpertMapStore(L, J, capacity=C, distance=1, candidates=6, lists=5, probes=2, seed=1)
    maps = rng.dirichlet(np.ones(J), size=(C, L)).astype(np.float32)
    embeddings = rng.normal(size=(C, D)).astype(np.float32)
    store.add(maps[:150], embeddings[:150])
    store.add(maps[150:], embeddings[150:])
    assert store._index.trained_size == 150  # the first add passed 5 x 8 keys; 200 is not yet twice 150
    query = rng.normal(size=(2, D)).astype(np.float32)
    search = store.search(query)
    keys = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    for b in range(2):
        unit = query[b] / np.linalg.norm(query[b])
        probed = store._index.search(unit, 6)[0]
        expected = probed[np.argsort(-(keys[probed] @ unit))[:6]]
        assert sorted(search.candidates[b].tolist()) == sorted(expected.tolist())
        assert search.index[b] == expected[0]
    observed = rng.dirichlet(np.ones(J), size=(2, L)).astype(np.float32)
    for layer in range(L):
        index, _ = search.observe(layer, observed[:, layer])
        for b in range(2):
            among = search.candidates[b]
            trajectory = cosines(maps[among, :layer + 1].reshape(6, -1), observed[b, :layer + 1].reshape(-1))
            assert index[b] == among[int(np.argmax(trajectory))]
    # the centroids, 2 of 5 lists' keys were they of equal size, the candidates' maps
    assert store.bytes_searched() == 5 * D * 4 + 2 / 5 * C * D * 4 + 6 * L * J * 4
    with pytest.raises(ConfigError, match="lists=4 needs candidates=M"):
        ExpertMapStore(L, J, capacity=C, distance=1, lists=4)
    with pytest.raises(ConfigError, match="probes=9 must be between 1 and lists=4"):
        ExpertMapStore(L, J, capacity=C, distance=1, candidates=3, lists=4, probes=9)
