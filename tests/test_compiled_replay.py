"""The compiled replay (simulator/kernels.py) against its reference, the Python policy objects: every policy that
has a kernel makes exactly the same misses, layer by layer, on real and synthetic traces; the kernels also
run uncompiled (how they are checked without Numba); engine choice, errors, and compiling without a cache."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from conftest import QWEN_FILES
from moe_offload.bundled import DEFAULT_TRACE
from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, default_policies
from moe_offload.simulator import kernels
from moe_offload.simulator.grid import replay_grid
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.format import read_trace
from moe_offload.trace.importers import import_routes_json, import_topk_jsonl
from moe_offload.trace.synthetic import cyclic_trace, fixed_partition_trace, zipf_trace


# every policy with a kernel that runs without options (static-experts needs its experts: tested with them below)
COMPILED = [name for name in default_policies() if POLICIES[name].policy.replay_kernel is not None]
SEEDED = ("random", "marking", "lecar")  # the policies whose victims the seed draws
needs_numba = pytest.mark.skipif(not kernels.numba_available(), reason="Numba is not installed")


def test_the_policies_of_the_issue_have_kernels():
    assert {"lru", "fifo", "lfu", "belady", "lru-dist", "belady-dist", "llru", "marking", "lcp", "random",
            "fmoe"} <= set(COMPILED)


def assert_same(data: ReplayInput, sizes, seeds=(0,), engine="compiled"):
    """Both ways give the same RunResult (misses, hits per layer, ...); the seeded policies at every seed."""
    for policy in COMPILED:
        for size in sizes:
            if POLICIES[policy].partitioned and size < data.spec.num_layers:
                continue
            for seed in seeds if POLICIES[policy].policy.name in SEEDED else seeds[:1]:
                reference = replay(data, policy, size, seed=seed, engine="python")
                fast = replay(data, policy, size, seed=seed, engine=engine)
                assert reference.to_dict() == fast.to_dict(), (policy, size, seed)


@pytest.fixture(scope="module")
def olmoe():
    return ReplayInput.of(read_trace(DEFAULT_TRACE))


@needs_numba
def test_bundled_olmoe_trace(olmoe):
    assert_same(olmoe, (8, 96, 512), seeds=(0, 7))


@needs_numba
def test_qwen_traces(qwen_folder):
    trace = import_routes_json([qwen_folder / f"{name}.json" for name in QWEN_FILES[:2]], num_experts=60)
    assert_same(ReplayInput.of(trace), (24, 360))


@needs_numba
def test_bundled_tiny_trace(tiny_trace):
    # several requests, prefill and decode: tokens (LCP's activations) are not rounds here
    assert_same(ReplayInput.of(tiny_trace.select(slice(0, 1500))), (16,), seeds=(3,))


@needs_numba
@pytest.mark.parametrize("layers,experts,top_k,a", [(8, 16, 1, 0.8), (6, 10, 3, 1.2), (3, 64, 8, 2.0)])
def test_zipf_traces(layers, experts, top_k, a):
    trace = zipf_trace(layers, experts, top_k, 400, a=a, b=1.0, seed=5, shuffle=True)
    assert_same(ReplayInput.of(trace), (top_k, max(top_k, layers), layers * experts // 3, layers * experts), seeds=(0, 1))


@needs_numba
def test_adversarial_sequences_of_paper_001():
    assert_same(ReplayInput.of(cyclic_trace(num_layers=4, cache_size=11, rounds=60)), (4, 11, 12))
    assert_same(ReplayInput.of(fixed_partition_trace(num_layers=4, num_experts=5, rounds=60)), (4, 8, 12))


def with_router_probabilities(trace, seed: int):
    """``trace`` with random full router distributions, a twentieth of them 0 (below fmoe's floor)."""
    rng = np.random.default_rng(seed)
    shape = (trace.num_tokens, trace.meta.num_layers, trace.meta.num_experts)
    probs = np.exp(3 * rng.normal(size=shape))
    probs /= probs.sum(axis=-1, keepdims=True)
    probs[rng.random(shape) < 0.05] = 0
    return dataclasses.replace(trace, probs=probs.astype(np.float16))


@pytest.mark.parametrize("compiled", [True, False])
def test_fmoe_kernel_reads_the_router_probabilities(monkeypatch, compiled):
    """fmoe's kernel scans the residents for the lowest p * freq, p the trace's floored probabilities; without
    them it runs LFU's kernel (a uniform p orders as LFU does). Both as the object does, compiled or not."""
    if compiled and not kernels.numba_available():
        pytest.skip("Numba is not installed")
    if not compiled:
        monkeypatch.setattr(kernels, "compiled_kernel", lambda policy_class: policy_class.replay_kernel)
    for trace in (zipf_trace(6, 10, 3, 300 if compiled else 80, a=1.2, b=1.0, seed=5, shuffle=True),
                  zipf_trace(3, 64, 8, 300 if compiled else 60, a=2.0, b=1.0, seed=5, shuffle=True)):
        uniform, observed = ReplayInput.of(trace), ReplayInput.of(with_router_probabilities(trace, 3))
        for size in (trace.meta.top_k, 8, trace.meta.num_layers * trace.meta.num_experts // 3):
            for data in (uniform, observed):
                reference = replay(data, "fmoe", size, engine="python")
                assert replay(data, "fmoe", size, engine="compiled").to_dict() == reference.to_dict(), size
            assert replay(uniform, "fmoe", size).misses == replay(uniform, "lfu", size).misses
            assert replay(observed, "fmoe", size).misses != replay(uniform, "fmoe", size).misses


def test_kernels_run_uncompiled_with_the_same_results(monkeypatch):
    """The kernels are plain Python too: run as such they make the reference's misses (this is also what checks
    them where Numba is not installed)."""
    monkeypatch.setattr(kernels, "compiled_kernel", lambda policy_class: policy_class.replay_kernel)
    trace = zipf_trace(4, 8, 2, 150, a=1.0, b=1.0, seed=2, shuffle=True)
    assert_same(ReplayInput.of(trace), (2, 5, 12), seeds=(0, 4))


@needs_numba
def test_auto_uses_the_kernel_and_python_forces_the_objects(olmoe, monkeypatch, uncompiled_policy):
    calls = []
    original = kernels.compiled_kernel

    def spy(policy_class):
        calls.append(policy_class.name)
        return original(policy_class)

    monkeypatch.setattr(kernels, "compiled_kernel", spy)
    replay(olmoe, "lru", 64)
    replay(olmoe, "lru", 64, engine="python")
    replay(olmoe, uncompiled_policy, 64)  # no kernel: the object, whatever the engine
    assert calls == ["lru", uncompiled_policy]


@needs_numba
def test_grid_results_do_not_depend_on_the_engine(olmoe):
    policies = ["lru", "marking", "belady-dist", "moe-infinity"]
    compiled = replay_grid(olmoe, policies, [32, 512], jobs=2)
    python = replay_grid(olmoe, policies, [32, 512], engine="python")
    assert [r.to_dict() for r in compiled.results] == [r.to_dict() for r in python.results]


def test_engine_errors(olmoe, monkeypatch, uncompiled_policy):
    with pytest.raises(ConfigError, match="engine 'fast' is not one of auto, compiled, python"):
        replay(olmoe, "lru", 64, engine="fast")
    with pytest.raises(ConfigError, match=f"{uncompiled_policy} has no compiled kernel"):
        replay(olmoe, uncompiled_policy, 64, engine="compiled")
    monkeypatch.setattr(kernels, "compiled_kernel", lambda policy_class: None)  # as without Numba
    with pytest.raises(ConfigError, match=r"pip install 'moe-offload\[fast\]'"):
        replay(olmoe, "lru", 64, engine="compiled")
    assert replay(olmoe, "lru", 64).misses == replay(olmoe, "lru", 64, engine="python").misses


def test_replays_without_numba():
    """With Numba not importable the package imports, replays through the policy objects, and says how to get the
    compiled replay when it is asked for."""
    script = """
import sys
sys.modules["numba"] = None  # import numba now raises ImportError
from moe_offload.errors import ConfigError
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.trace.synthetic import zipf_trace
data = ReplayInput.of(zipf_trace(4, 8, 2, 100, a=1.0, b=1.0, seed=0))
print(replay(data, "lru", 8).misses, replay(data, "lru", 8, engine="python").misses)
try:
    replay(data, "lru", 8, engine="compiled")
except ConfigError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    first, second = out[0].split()
    assert first == second
    assert out[1] == "the compiled replay of lru needs Numba: install Numba for the compiled replay: " \
                     "pip install 'moe-offload[fast]'"


@needs_numba
def test_compiles_where_no_cache_folder_is_writable(monkeypatch, olmoe):
    """A read-only install with no writable home: Numba finds no folder for its cache, and the kernel is compiled
    in memory instead of failing."""
    from numba.core import config

    # Only the locator of zipped packages, which declines our file: what Numba sees when no folder is writable.
    monkeypatch.setattr(config, "CACHE_LOCATOR_CLASSES", "ZipCacheLocator")
    kernels.compiled_kernel.cache_clear()
    try:
        kernel = kernels.compiled_kernel(POLICIES["fifo"].policy)
        assert kernel is not None and kernel._cache.__class__.__name__ == "NullCache"
        assert replay(olmoe, "fifo", 64).misses == replay(olmoe, "fifo", 64, engine="python").misses
    finally:
        kernels.compiled_kernel.cache_clear()  # the next test compiles (or loads from the cache) again


def test_simulate_prints_the_same_whatever_the_engine(capsys):
    from moe_offload.cli.main import main

    outputs = []
    for engine in ("python", "auto"):
        assert main(["simulate", "--policy", "lru,llru,lru-dist,random", "--cache-size", "64,25%", "--jobs", "1",
                     "--engine", engine]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "lru-dist" in outputs[0]
    assert main(["simulate", "--timed", "--engine", "python"]) == 2
    assert "the timed simulator runs the policy objects" in capsys.readouterr().err


def test_partition_capacities_are_the_caches():
    from moe_offload.simulator.partitioned_cache import PartitionedCache

    assert PartitionedCache.capacities(10, 4) == [3, 3, 2, 2]
    parts = PartitionedCache(10, 4, lambda: POLICIES["lru"].policy(None), 5).parts
    assert [part.capacity for part in parts] == [3, 3, 2, 2]


@pytest.mark.parametrize("numpy_below", [10**9, 0])  # NumPy's sort, and the compiled pass where Numba is there
def test_next_use_times_match_a_direct_scan(monkeypatch, numpy_below):
    from moe_offload.trace import flatten as flatten_module
    from moe_offload.trace.flatten import NEVER, next_use_times

    monkeypatch.setattr(flatten_module, "NEXT_USE_NUMPY_BELOW", numpy_below)
    rng = np.random.default_rng(0)
    for keys in (rng.integers(0, 40, 500), rng.integers(0, 2**40, 300), np.array([3, 3, 3]), np.zeros(0, np.int64)):
        expected = [next((j for j in range(i + 1, len(keys)) if keys[j] == keys[i]), NEVER) for i in range(len(keys))]
        assert next_use_times(keys).tolist() == expected


# ------------------------------------------------------------------------ the kernels of ARC, LeCaR, lfu-decay,
# neighbor-aware: with their options, on the other shared traces, on uniform random sequences

KERNEL_OPTIONS = {
    "arc": [{}],
    "lecar": [{}, {"history_size": 1}, {"history_size": 7, "learning_rate": 2.0}, {"learning_rate": 0.0}],
    "lfu-decay": [{}, {"half_life": 0.5}, {"half_life": 7}, {"half_life": 1e9}],
    "neighbor-aware": [{}, {"group": 1}, {"group": 3}, {"group": 64}],
}


def test_the_policies_of_issue_32_have_kernels():
    assert set(KERNEL_OPTIONS) | {"moe-infinity", "static-freq", "static-layers"} <= set(COMPILED)
    assert POLICIES["static-experts"].policy.replay_kernel is not None


def assert_same_with_options(data: ReplayInput, sizes, seeds=(0,), engine="compiled", defaults=True):
    for policy, variants in KERNEL_OPTIONS.items():
        for options in variants if defaults else variants[1:]:
            for size in sizes:
                for seed in seeds if policy in SEEDED else seeds[:1]:
                    reference = replay(data, policy, size, seed=seed, options=options, engine="python")
                    fast = replay(data, policy, size, seed=seed, options=options, engine=engine)
                    assert reference.to_dict() == fast.to_dict(), (policy, options, size, seed)


@needs_numba
def test_options_on_the_bundled_olmoe_trace(olmoe):
    # the defaults run on the whole trace with every kernel above
    assert_same_with_options(ReplayInput.of(olmoe.trace.select(slice(0, 150))), (8, 100, 700), seeds=(0, 5),
                             defaults=False)


@needs_numba
def test_the_granite_and_gpt_oss_traces(shared_traces):
    gpt = ReplayInput.of(import_topk_jsonl(shared_traces / "gpt-oss-120b" / "chat_149_tokens.jsonl",
                                           num_experts=128))
    granite = ReplayInput.of(import_topk_jsonl(shared_traces / "granite-3.0-1b-a400m" / "sglang_8_requests.jsonl",
                                               num_experts=32).select(slice(0, 120)))
    for data in (gpt, granite):
        spec = data.spec
        assert_same_with_options(data, (spec.top_k, spec.num_layers * spec.num_experts // 4), seeds=(0, 2))


@needs_numba
@pytest.mark.parametrize("seed", range(4))
def test_uniform_random_sequences(seed):
    data = ReplayInput.of(zipf_trace(3, 7, 2, 300, a=0.0, b=1.0, seed=seed))  # a = 0: uniform, many ties
    assert_same_with_options(data, (2, 3, 9, 20), seeds=(seed, seed + 11))


def test_new_kernels_run_uncompiled_with_the_same_results(monkeypatch):
    monkeypatch.setattr(kernels, "compiled_kernel", lambda policy_class: policy_class.replay_kernel)
    trace = zipf_trace(3, 6, 2, 120, a=1.0, b=1.0, seed=9, shuffle=True)
    assert_same_with_options(ReplayInput.of(trace), (2, 7), seeds=(0, 3))


def test_lecar_seeds_draw_other_victims():
    """The seed decides LeCaR's choices (else the seeded comparisons above could not fail on the draw)."""
    data = ReplayInput.of(zipf_trace(4, 8, 2, 400, a=0.8, b=1.0, seed=1, shuffle=True))
    assert len({replay(data, "lecar", 10, seed=seed, engine="python").misses for seed in range(6)}) > 1


def test_the_generators_draws_are_pythons():
    import random

    from moe_offload.policies._seeded import mt_random, rng_state

    for seed in (0, 1, 12345):
        rng = random.Random(seed)
        state = rng_state(rng)
        assert [mt_random(state) for _ in range(1500)] == [rng.random() for _ in range(1500)]  # 2 refills


def test_heap_remove_keeps_the_order():
    """Random pushes, updates, removals, pops and replacements of the first key on the kernels' heap against a
    sorted list of (score, stamp, key)."""
    from moe_offload.policies._ranked import (heap_new, heap_pop, heap_push, heap_remove, heap_replace_first,
                                              heap_update)

    rng = np.random.default_rng(3)
    keys, scores, stamps, position = heap_new(40, 60)
    live: dict = {}  # key -> (score, stamp)
    for stamp in range(3000):
        key = int(rng.integers(60))
        score = float(rng.integers(5))  # few scores: the stamps break the ties
        action = rng.random()
        if key in live and action < 0.3:
            heap_remove(keys, scores, stamps, position, len(live), key)
            del live[key]
        elif key in live:
            heap_update(keys, scores, stamps, position, len(live), key, score, stamp)
            live[key] = (score, stamp)
        elif len(live) < 40:
            heap_push(keys, scores, stamps, position, len(live), key, score, stamp)
            live[key] = (score, stamp)
        else:  # full: the first key leaves and this one enters, as a replay's miss does
            expected = min(live, key=lambda k: live[k])
            assert heap_replace_first(keys, scores, stamps, position, len(live), key, score, stamp) == expected
            del live[expected]
            live[key] = (score, stamp)
        if live and action > 0.9:
            expected = min(live, key=lambda k: live[k])
            assert heap_pop(keys, scores, stamps, position, len(live)) == expected
            del live[expected]
        assert sorted(keys[:len(live)].tolist()) == sorted(live)
        assert all(position[k] >= 0 for k in live) and (position >= 0).sum() == len(live)


def test_a_heap_settled_lazily_gives_the_key_an_eager_heap_gives():
    """Counts raised by hits without touching the heap, as LFU's and LeCaR's kernels do: heap_settle then pop
    takes the lowest current (count, last set) of a sorted list, and each key is re-keyed at most once per hit."""
    from moe_offload.policies import _ranked
    from moe_offload.policies._ranked import heap_new, heap_pop, heap_push, heap_settle

    rng = np.random.default_rng(4)
    keys, scores, stamps, position = heap_new(30, 50)
    count, last_set = np.zeros(50, np.int64), np.zeros(50, np.int64)
    live, hits, rekeys = set(), 0, []
    sift = _ranked._heap_sift

    def counting(*args):
        rekeys.append(args[6])
        sift(*args)

    _ranked._heap_sift = counting
    try:
        for clock in range(4000):
            key = int(rng.integers(50))
            if key in live:  # a hit: the entry stays behind
                count[key] += 1
                last_set[key] = clock
                hits += 1
                continue
            if len(live) == 30:
                expected = min(live, key=lambda k: (count[k], last_set[k]))
                rekeys.clear()
                assert heap_settle(keys, scores, stamps, position, len(live), count, last_set) == expected
                assert len(rekeys) == len(set(rekeys))  # none twice in one settling
                heap_pop(keys, scores, stamps, position, len(live))
                live.remove(expected)
            count[key], last_set[key] = 1, clock
            heap_push(keys, scores, stamps, position, len(live), key, 1, clock)
            live.add(key)
    finally:
        _ranked._heap_sift = sift
    assert hits > 1000


# ------------------------------------------------------------ MoE-Infinity: the sequences' EAMs, by request

MOE_INFINITY_OPTIONS = [{}, {"eam": "request"}, {"fill": "layers"}, {"eam": "request", "fill": "layers"}]


def interleaved_trace(seed, requests=5, rows=240):
    """A Zipf trace whose rows belong to ``requests`` sequences, interleaved at random as a continuous batch
    would (each sequence's rows in order; sequences start and end at different rows)."""
    trace = zipf_trace(4, 8, 2, rows, a=1.0, b=1.0, seed=seed, shuffle=True)
    rng = np.random.default_rng(seed)
    owner = rng.integers(0, requests, rows)
    owner[:requests] = np.arange(requests)  # every sequence has a row
    owner = np.sort(owner) if seed % 2 else owner  # one after the other, or interleaved
    return type(trace).build(trace.meta, trace.experts, request=owner * 7 + 3)  # ids need not be dense


def assert_moe_infinity_same(data: ReplayInput, sizes, variants=MOE_INFINITY_OPTIONS):
    for options in variants:
        for size in sizes:
            reference = replay(data, "moe-infinity", size, options=options, engine="python")
            fast = replay(data, "moe-infinity", size, options=options, engine="compiled")
            assert reference.to_dict() == fast.to_dict(), (options, size)


@needs_numba
@pytest.mark.parametrize("seed", range(4))
def test_moe_infinity_on_interleaved_sequences(seed):
    assert_moe_infinity_same(ReplayInput.of(interleaved_trace(seed)), (2, 5, 13, 31))


@needs_numba
def test_moe_infinity_options_on_real_traces(olmoe, tiny_trace, qwen_folder, shared_traces):
    """The default options run on these traces with every kernel above; here the others, on their first rows."""
    others = MOE_INFINITY_OPTIONS[1:]
    assert_moe_infinity_same(ReplayInput.of(olmoe.trace.select(slice(0, 120))), (8, 96), others)
    tiny = tiny_trace.select(slice(0, 600))
    assert len(set(tiny.request.tolist())) > 1
    assert_moe_infinity_same(ReplayInput.of(tiny), (4, 24), others)  # several requests, prefills and decodes
    qwen = import_routes_json([qwen_folder / f"{QWEN_FILES[0]}.json"], num_experts=60)
    assert_moe_infinity_same(ReplayInput.of(qwen.select(slice(0, 150))), (120,), others)
    granite = import_topk_jsonl(shared_traces / "granite-3.0-1b-a400m" / "sglang_8_requests.jsonl", num_experts=32)
    assert_moe_infinity_same(ReplayInput.of(granite.select(slice(0, 100))), (8, 100), others)


def test_moe_infinity_kernel_runs_uncompiled(monkeypatch):
    monkeypatch.setattr(kernels, "compiled_kernel", lambda policy_class: policy_class.replay_kernel)
    assert_moe_infinity_same(ReplayInput.of(interleaved_trace(1, requests=3, rows=60)), (2, 9))
    assert_moe_infinity_same(ReplayInput.of(interleaved_trace(2, requests=3, rows=60)), (2, 9))


# ------------------------------------------------------------------ the static placements: hits, and bypasses

STATIC_OPTIONS = [("static-freq", {}), ("static-freq", {"per_layer": True}), ("static-layers", {}),
                  ("static-layers", {"fast_layers": 1}), ("static-layers", {"cpu_layers": [0, 3]}),
                  ("static-experts", {"experts": []}), ("static-experts", {"experts": [0, 5, 77, 1000]})]


@needs_numba
def test_static_placements_hit_and_bypass_as_the_objects(olmoe):
    for policy, options in STATIC_OPTIONS:
        for size in (8, 200, 960, 1024):
            if policy == "static-layers" and (size < 64 or (options.get("cpu_layers") and size < 14 * 64)):
                continue  # the placement does not fit: refused alike (below)
            reference = replay(olmoe, policy, size, options=options, engine="python")
            fast = replay(olmoe, policy, size, options=options, engine="compiled")
            assert reference.to_dict() == fast.to_dict(), (policy, options, size)
            assert fast.misses == 0 and fast.bypassed == fast.accesses - fast.hits
    result = replay(olmoe, "static-experts", 8, options={"experts": [0, 5, 77, 1000]})
    keys = olmoe.sequence.expert_id
    assert result.hits == int(np.isin(keys, [0, 5, 77, 1000]).sum()) > 0  # counted independently
    assert result.per_layer_bypassed[0] == int((olmoe.sequence.layer == 0).sum()) - int(np.isin(keys, [0, 5]).sum())


@needs_numba
def test_static_placements_that_do_not_fit_are_refused_by_both_engines(olmoe):
    for engine in ("python", "compiled"):
        with pytest.raises(ConfigError, match="static-layers.cpu_layers: the 14 other layers' experts"):
            replay(olmoe, "static-layers", 200, options={"cpu_layers": [0, 3]}, engine=engine)
        with pytest.raises(ConfigError, match="static-experts.experts: 4 experts do not fit in a cache of 3"):
            replay(olmoe, "static-experts", 3, options={"experts": [0, 5, 77, 1000]}, engine=engine)


@needs_numba
@pytest.mark.parametrize("a", [0.0, 1.2])
def test_lfru_kernel_on_long_sequences(a):
    """The LFRU kernel's frequency groups and its early stop (policies/lfru.py) against the object's scan of
    every resident, on sequences long enough for many counts of uses among the residents, at sizes from
    top-k to all experts but one."""
    data = ReplayInput.of(zipf_trace(4, 24, 2, 3000, a=a, b=1.0, seed=3, shuffle=True))
    for policy in ("lfru", "lfru-dist"):
        for size in (4, 13, 48, 95):
            assert replay(data, policy, size, engine="python").to_dict() == \
                replay(data, policy, size, engine="compiled").to_dict(), (policy, size)


# ------------------------------------------------------------------- Belady's kernel: next uses a chunk at a time,
# residents as a set of positions; a sample's layers replayed from copies

def test_next_uses_a_chunk_at_a_time_are_next_use_times(monkeypatch):
    from moe_offload.trace import flatten as flatten_module
    from moe_offload.trace.flatten import NEVER, fill_next_uses, next_use_marks, next_use_times

    rng = np.random.default_rng(1)
    for keys in (rng.integers(0, 9, 100).astype(np.int32), np.array([4, 4, 4], np.int32), np.zeros(0, np.int32)):
        expected = next_use_times(keys).tolist()
        for chunk in (1, 3, 8, 1000):
            marks = next_use_marks(keys, 9, chunk)
            found = []
            for first in range(0, keys.size, chunk):
                stop = min(keys.size, first + chunk)
                ahead = np.zeros(stop - first, np.int32)
                fill_next_uses(keys, marks, first // chunk, first, stop, np.zeros(9, np.int32), ahead)
                found += ahead.tolist()
            assert found == expected, (keys.size, chunk)
        assert keys.size == 0 or expected[-1] == NEVER
    monkeypatch.setattr(flatten_module, "NEXT_USE_CHUNK", 4)
    assert flatten_module.next_use_chunk(10) == 4 and flatten_module.next_use_chunk(4 * 256 + 1) == 5


def test_the_set_of_positions_is_a_set():
    """Belady's set of positions (policies/belady.py) against a Python set, as plain Python and compiled, across
    the sizes where it gains a level (64, 64**2)."""
    from moe_offload.compiled import highest_bit, highest_bit_by_halving, numba_available
    from moe_offload.policies.belady import position_add, position_largest, position_levels, position_remove

    def drive(n, operations):
        """Adds (a position) and removals (-1 - position), then the largest (-1: empty) and whether any bit is set."""
        levels = position_levels(n)
        bits = np.zeros(levels[-1], np.uint64)
        for position in operations:
            if position >= 0:
                position_add(bits, levels, position)
            else:
                position_remove(bits, levels, -position - 1)
        return (position_largest(bits, levels) if bits[levels[-2]] else -1), bool(bits.any())

    rng = np.random.default_rng(2)
    for n in (1, 63, 64, 65, 4096, 4097, 300_000):
        members = set()
        operations = []
        for _ in range(200):
            if members and rng.random() < 0.4:
                position = int(rng.choice(sorted(members)))
                members.discard(position)
                operations.append(-position - 1)
            else:
                position = int(rng.integers(0, n))
                if position not in members:
                    members.add(position)
                    operations.append(position)
        found, any_bits = drive(n, operations)
        assert found == (max(members) if members else -1) and any_bits == bool(members), n
    for word in (1, 2, 3, 2**31, 2**40 + 7, 2**63, 2**64 - 1):
        assert highest_bit(np.uint64(word)) == highest_bit_by_halving(np.uint64(word)) == word.bit_length() - 1
    if numba_available():
        from moe_offload.compiled import compiled_twin

        twin = compiled_twin(highest_bit)
        assert [twin(np.uint64(word)) for word in (1, 3, 2**40 + 7, 2**64 - 1)] == [0, 1, 40, 63]


def test_belady_across_chunks_and_ties_makes_the_objects_misses(monkeypatch):
    """Belady's kernel, run as plain Python with chunks of a few requests, on sequences whose experts stop being
    requested (ties among them, which go first, earliest first): the objects' misses, whole and per layer."""
    from moe_offload.trace import flatten as flatten_module

    monkeypatch.setattr(kernels, "compiled_kernel", lambda policy_class: policy_class.replay_kernel)
    monkeypatch.setattr(flatten_module, "NEXT_USE_CHUNK", 5)
    data = ReplayInput.of(zipf_trace(4, 8, 2, 150, a=1.0, b=1.0, seed=5, shuffle=True))
    for policy in ("belady", "belady-dist"):
        for size in (4, 7, 16, 31):
            reference = replay(data, policy, size, engine="python")
            assert replay(data, policy, size, engine="compiled").to_dict() == reference.to_dict(), (policy, size)


@needs_numba
def test_a_sample_replays_the_same_compiled(olmoe):
    """On a spatial sample of the experts, whose layers' requests fall anywhere (they are copied out for the
    -dist policies), every compiled policy gives the objects' results."""
    assert_same(ReplayInput.sampled(olmoe.trace, 0.5, "half of the experts"), (32, 128))


@needs_numba
def test_the_cache_name_of_a_kernel_follows_the_constants_its_helpers_read(monkeypatch):
    """Numba freezes a module constant into the machine code, and its on-disk cache notices changes to the
    kernel's own file only: the compiled name (kernels.py's digest) changes when a constant that a helper in
    another file reads changes, as coact's COUNT_LIMIT in _coact_tokens.py, and not when nothing changed."""
    import numba

    from moe_offload.policies import _coact_tokens
    from moe_offload.policies.coact import CoActivation

    def name():
        helpers: dict = {}
        kernels._link(CoActivation.replay_kernel, numba, helpers)
        return kernels._digest(CoActivation.replay_kernel, helpers, kernels.SIGNATURE)

    first = name()
    assert name() == first
    monkeypatch.setattr(_coact_tokens, "COUNT_LIMIT", _coact_tokens.COUNT_LIMIT / 2)
    assert name() != first
