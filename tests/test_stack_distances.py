"""LRU's and OPT's hits at every cache size from one pass (simulator/stack_distances.py), checked against the replay
at every size, against libCacheSim's Belady, and against a hand-worked sequence."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import QWEN_FILES
from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.simulator import stack_distances
from moe_offload.simulator.opt_stack import OptStack
from moe_offload.simulator.stack_distances import HitCurve, opt_curve
from moe_offload.trace.flatten import write_oracle_general
from moe_offload.trace.format import read_trace
from moe_offload.trace.importers import import_routes_json
from moe_offload.trace.synthetic import zipf_trace


def assert_curve_is_the_replay(data: ReplayInput, sizes) -> None:
    meta = data.trace.meta
    curve = opt_curve(data.sequence.expert_id, meta.num_expert_slots)
    for size in sizes:
        assert curve.hits(size) == replay(data, "belady", size).hits, size


def test_opt_stack_distances_of_a_hand_worked_sequence():
    # a b c a d b a (keys 0 1 2 0 3 1 0): four first requests; a's second at distance 1 (only c came between),
    # b's second at distance 2 and a's third at distance 1 (a's next use, 6, is sooner than c's and d's, never)
    keys = np.array([0, 1, 2, 0, 3, 1, 0], np.int64)
    stack = OptStack(4)
    stack.add(keys)
    assert stack.histogram.tolist() == [0, 2, 1, 0, 4]
    # by hand, OPT with 2 slots: a b miss, c evicts b (used later than a), a hits, d evicts c, b evicts d, a hits;
    # with 3: a b c miss, a hits, d evicts c (never used again), b and a hit
    curve = HitCurve(stack.histogram)
    assert [curve.hits(size) for size in range(5)] == [0, 0, 2, 3, 3]


def test_opt_stack_distances_need_only_the_past():
    # the distances of a sequence passed in pieces, down to a request at a time, are those of the whole: no
    # request's distance reads what comes after it
    trace = zipf_trace(num_layers=4, num_experts=8, top_k=2, length=400, a=1.2, b=1.0, seed=7, shuffle=True)
    keys = ReplayInput.of(trace).sequence.expert_id
    whole = opt_curve(keys, 32).histogram
    for piece in (1, 7, 100):
        stack = OptStack(32)
        for first in range(0, len(keys), piece):
            stack.add(keys[first:first + piece])
        assert stack.histogram.tolist() == whole.tolist(), piece


def belady_hits_by_hand(keys: list, size: int) -> int:
    """Belady's MIN by its definition: on a miss with a full cache, evict the resident used furthest ahead."""
    resident, hits = set(), 0
    for t, key in enumerate(keys):
        if key in resident:
            hits += 1
            continue
        if len(resident) == size:
            ahead = {k: next((u for u in range(t + 1, len(keys)) if keys[u] == k), len(keys)) for k in resident}
            resident.remove(max(resident, key=lambda k: (ahead[k], k)))
        resident.add(key)
    return hits


def test_opt_stack_distances_are_belady_on_random_short_sequences():
    # few experts, so the slots run out and are renumbered many times; every size against MIN by hand
    rng = np.random.default_rng(0)
    for _ in range(60):
        num_keys = int(rng.integers(1, 9))
        weights = rng.random(num_keys) ** 3
        keys = rng.choice(num_keys, int(rng.integers(1, 150)), p=weights / weights.sum())
        curve = opt_curve(keys, num_keys)
        assert curve.requests == len(keys)
        for size in range(1, num_keys + 1):
            assert curve.hits(size) == belady_hits_by_hand(keys.tolist(), size), (keys.tolist(), size)


def test_the_compiled_opt_stack_is_the_plain_one(monkeypatch):
    pytest.importorskip("numba")
    trace = zipf_trace(num_layers=8, num_experts=16, top_k=2, length=600, a=1.2, b=1.0, seed=9, shuffle=True)
    keys = ReplayInput.of(trace).sequence.expert_id
    monkeypatch.setattr(stack_distances, "OPT_PYTHON_BELOW", 1)
    compiled = opt_curve(keys, 128).histogram
    monkeypatch.setattr(stack_distances, "OPT_PYTHON_BELOW", 1 << 62)
    assert opt_curve(keys, 128).histogram.tolist() == compiled.tolist()


def test_opt_curve_is_the_belady_replay_at_every_size_on_zipf_traces():
    for a, top_k in ((0.8, 1), (1.2, 2), (2.0, 4)):
        trace = zipf_trace(num_layers=8, num_experts=16, top_k=top_k, length=600, a=a, b=1.0, seed=5, shuffle=True)
        assert_curve_is_the_replay(ReplayInput.of(trace), range(top_k, 8 * 16 + 1))


def test_opt_curve_is_the_belady_replay_at_every_size_on_the_bundled_traces(tiny_trace):
    olmoe = ReplayInput.of(read_trace(DEFAULT_TRACE))
    assert_curve_is_the_replay(olmoe, range(8, 1025))
    tiny = ReplayInput.of(tiny_trace)
    assert_curve_is_the_replay(tiny, range(tiny_trace.meta.top_k, tiny_trace.meta.num_expert_slots + 1))


def test_opt_curve_is_the_belady_replay_at_every_size_on_the_shared_qwen_traces(qwen_folder):
    trace = import_routes_json([qwen_folder / f"{name}.json" for name in QWEN_FILES], num_experts=60)
    data = ReplayInput.of(trace)
    assert_curve_is_the_replay(data, range(trace.meta.top_k, trace.meta.num_expert_slots + 1, 7))


def test_opt_curve_agrees_with_libcachesims_belady(tmp_path):
    lcs = pytest.importorskip("libcachesim")
    trace = zipf_trace(num_layers=8, num_experts=16, top_k=2, length=1500, a=1.2, b=1.0, seed=11, shuffle=True)
    data = ReplayInput.of(trace)
    curve = opt_curve(data.sequence.expert_id, 128)
    path = write_oracle_general(data.sequence, tmp_path / "trace.oracleGeneral.bin", expert_bytes=None)
    for size in (2, 8, 16, 37, 64, 100):
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        miss_ratio, _ = lcs.Belady(size).process_trace(reader)
        assert len(data.sequence) - curve.hits(size) == round(miss_ratio * len(data.sequence)), size


def test_smallest_size_reaches_the_target_and_one_fewer_does_not():
    trace = zipf_trace(num_layers=8, num_experts=16, top_k=2, length=800, a=1.2, b=1.0, seed=3, shuffle=True)
    data = ReplayInput.of(trace)
    curve = opt_curve(data.sequence.expert_id, 128)
    requests = len(data.sequence)
    for target in (0.3, 0.5, 0.8, 0.9):
        size = curve.smallest_size(target)
        assert replay(data, "belady", size).hits >= target * requests
        assert size == 2 or replay(data, "belady", size - 1).hits < target * requests
    assert curve.smallest_size(1.0) is None  # the first request of each expert misses everywhere


def test_the_compiled_flattening_is_the_numpy_one(tiny_trace, monkeypatch):
    from moe_offload.trace import flatten as flatten_module

    compiled = flatten_module.flatten(tiny_trace)
    monkeypatch.setattr(flatten_module, "numba_available", lambda: False)
    plain = flatten_module.flatten(tiny_trace)
    for column in ("expert_id", "layer", "token", "next_use"):
        assert getattr(compiled, column).dtype == getattr(plain, column).dtype
        assert np.array_equal(getattr(compiled, column), getattr(plain, column)), column
