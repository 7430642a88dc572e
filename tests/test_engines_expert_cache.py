"""llama.cpp PR #27861's GPU cache of host-resident experts (simulator/timed/uploads.py), against sequences worked
out by hand from the PR's llama_moe_cache_step: misses run on the host, up to ``inserts`` of a one-token pass's
misses per layer are uploaded after it (most recent first, a resident one still counting), each into the
layer's empty slot or its least recently used one (hits and publications count as uses), published at the first
step after it lands; passes of more tokens run every expert on the host and teach the cache nothing."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.engines import PlacementContext
from moe_offload.engines.base import run_setting
from moe_offload.engines.llamacpp import settings as llama_settings
from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import ModelSpec
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.uploads import UploadsBetweenPasses
from moe_offload.trace.format import Trace, TraceMeta

E = 100  # bytes per expert


def hardware(bandwidth: float = 1e6, latency: float = 0.0) -> HardwareProfile:
    return HardwareProfile.from_dict({
        "name": "test", "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": bandwidth, "latency_s": latency}],
        "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.25}, "expert": {"fixed_s": 2.0},
                    "lm_head": {"fixed_s": 0.5}},
        "host": {"expert": {"fixed_s": 2.0}}})


def one_layer(experts, iteration=None, request=None) -> Trace:
    """One layer of 6 experts, top-2; ``experts[row]`` the row's two experts."""
    meta = TraceMeta(model="hand", num_layers=1, num_experts=6, top_k=2, expert_bytes=E)
    return Trace.build(meta, np.asarray(experts)[:, None, :], iteration=iteration, request=request)


def run(trace: Trace, slots: int = 2, inserts: int = 2):
    return simulate_timed(trace, hardware(), "lru-dist", slots * trace.meta.num_layers * E,
                          uploads=UploadsBetweenPasses(inserts))


DECODE = [[0, 1], [0, 2], [3, 0], [1, 3], [2, 4], [3, 1], [4, 2]]


def test_two_inserts_per_step_by_hand():
    # step after t0: pending [0, 1], walked back: upload 1, then 0 (both slots free).
    # t1 [0, 2]: 0 and 1 are on the wire: both miss. Step: publish 1 then 0 (LRU: 1, 0); walk [2, 0]: 2 evicts 1,
    #   0 is resident (it still costs an insert).
    # t2 [3, 0]: 0 hits. Step: publish 2 (LRU: 0, 2); walk [3]: 3 evicts 0.
    # t3 [1, 3]: both miss (3 on the wire). Step: publish 3 (LRU: 2, 3); walk [3, 1]: 3 resident, 1 evicts 2.
    # t4 [2, 4]: both miss. Step: publish 1 (LRU: 3, 1); walk [4, 2]: 4 evicts 3, 2 evicts 1: both slots in flight.
    # t5 [3, 1]: both miss. Step: publish 4, 2 (LRU: 4, 2); walk [1, 3]: 1 evicts 4, 3 evicts 2.
    # t6 [4, 2]: both miss. Step: publish 1, 3; walk [2, 4]: 2 evicts 1, 4 evicts 3 (never published).
    rule = UploadsBetweenPasses(2)
    result = simulate_timed(one_layer(DECODE), hardware(), "lru-dist", 2 * E, uploads=rule)
    assert (result.accesses, result.hits, result.bypassed) == (14, 1, 13)
    assert (rule.uploads, rule.published) == (11, 9) and result.bytes_loaded == 11 * E


def test_one_insert_per_step_by_hand():
    # t0: upload 1. t1 [0, 2]: step publishes 1, uploads 2 (a free slot). t2 [3, 0]: publish 2 (LRU 1, 2), upload 0
    # over 1. t3 [1, 3]: publish 0 (LRU 2, 0), upload 3 over 2. t4 [2, 4]: publish 3 (LRU 0, 3), upload 4 over 0.
    # t5 [3, 1]: 3 hits; publish 4 (LRU 3, 4), upload 1 over 3. t6 [4, 2]: 4 hits; publish 1, upload 2 over 4.
    rule = UploadsBetweenPasses(1)
    result = simulate_timed(one_layer(DECODE), hardware(), "lru-dist", 2 * E, uploads=rule)
    assert result.hits == 2 and result.per_layer_hits == [2]
    assert (rule.uploads, rule.published) == (7, 6) and result.bytes_loaded == 7 * E


def test_each_layer_has_its_own_slots_and_inserts():
    # two layers routing the same experts: each layer's cache follows the one-layer sequence on its own
    meta = TraceMeta(model="hand", num_layers=2, num_experts=6, top_k=2, expert_bytes=E)
    routes = np.asarray(DECODE)
    trace = Trace.build(meta, np.stack([routes, routes], axis=1))
    rule = UploadsBetweenPasses(1)
    result = simulate_timed(trace, hardware(), "lru-dist", 4 * E, uploads=rule)
    assert result.per_layer_hits == [2, 2] and rule.uploads == 14


def test_a_pass_of_several_tokens_neither_reads_nor_teaches_the_cache():
    # iteration 0 [0, 1]: upload 1, 0. iteration 1 [0, 1]: both on the wire, miss; the step publishes 1, 0 and
    # walks [1, 0]: both resident. Iteration 2 decodes two requests, [0, 1] each: the cache is not read (no
    # hit), the accesses (one per expert of the pass) run on the host. Iteration 3 [0, 1]: both hit.
    trace = one_layer([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1]], iteration=[0, 1, 2, 2, 3], request=[0, 0, 0, 1, 0])
    result = run(trace)
    assert (result.accesses, result.hits, result.bypassed) == (8, 2, 6)
    assert result.bytes_loaded == 2 * E


def test_an_upload_is_published_only_after_it_lands():
    # each upload takes 100 s, every pass under 6 s: nothing lands before the run ends, so nothing hits
    slow = hardware(bandwidth=1.0)
    rule = UploadsBetweenPasses(2)
    result = simulate_timed(one_layer(DECODE), slow, "lru-dist", 2 * E, uploads=rule)
    assert result.hits == 0 and rule.published == 0 and rule.uploads == 2  # the other slots wait in flight
    fast = run(one_layer(DECODE))
    assert fast.hits == 1


def test_uploads_leave_the_compute_stream_alone():
    # the same decode steps with and without uploads: every miss runs on the host either way (the cache's misses
    # are computed there), so the passes before the first hit take the same time
    trace = one_layer(DECODE[:2])
    with_uploads = run(trace)
    none = simulate_timed(trace, hardware(), "static-experts", 2 * E, policy_options={"experts": []})
    assert with_uploads.hits == none.hits == 0
    assert with_uploads.ttft_seconds == pytest.approx(none.ttft_seconds)
    assert with_uploads.tpot_seconds == pytest.approx(none.tpot_seconds)


def test_the_rule_refuses_what_the_pr_cannot_run():
    trace = one_layer(DECODE)
    with pytest.raises(ConfigError, match="-dist policy"):
        simulate_timed(trace, hardware(), "lru", 2 * E, uploads=UploadsBetweenPasses())
    with pytest.raises(ConfigError, match="no prefetcher"):
        simulate_timed(trace, hardware(), "lru-dist", 2 * E, uploads=UploadsBetweenPasses(), prefetcher="topk")
    with pytest.raises(ConfigError, match="inserts"):
        UploadsBetweenPasses(0)


def test_the_llama_cpp_setting_counts_the_zero_slot(tiny_trace):
    meta = tiny_trace.meta
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    hardware_profile = hardware()
    # 8 layers: room for 24 experts gives 3 per layer, 2 slots and the zero slot
    context = PlacementContext(spec, 24, tiny_trace, hardware_profile, E)
    cached = {s.label: s for s in llama_settings(context) if s.uploads is not None}
    # 7 host layers and the last kept whole: 8 + 7 x (1 + 1) = 22 experts of VRAM; 6 host layers: 16 + 6 x 1
    # leave no slot
    assert list(cached) == ["--n-cpu-moe 7 --moe-expert-cache 1 (PR #27861)",
                            "--cpu-moe --moe-expert-cache 2 (PR #27861)"]
    setting = cached["--cpu-moe --moe-expert-cache 2 (PR #27861)"]
    assert setting.flags[-3:] == ["--cpu-moe", "--moe-expert-cache", "2"]
    assert setting.cache_slots == 16 and setting.policy == "lru-dist" and setting.uploads == 2
    assert setting.options == {"whole_layers": []}
    result = run_setting(setting, tiny_trace.select(slice(0, 40)), context)
    assert result.cache_size == 16 and result.admission == "uploads-between-passes"
    combined = cached["--n-cpu-moe 7 --moe-expert-cache 1 (PR #27861)"]
    assert combined.flags[-4:] == ["--n-cpu-moe", "7", "--moe-expert-cache", "1"]
    assert combined.options == {"whole_layers": [7]} and combined.resident == list(range(56, 64))
    assert combined.cache_slots == 15
    result = run_setting(combined, tiny_trace.select(slice(0, 40)), context)
    assert result.per_layer_hits[7] == result.per_layer_accesses[7] > 0  # kept in VRAM: never a miss
    # room for 15 experts: one slot per layer would need 16
    assert not [s for s in llama_settings(PlacementContext(spec, 15, tiny_trace, hardware_profile, E))
                if s.uploads is not None]


def test_layers_kept_in_vram_are_computed_there_in_every_pass():
    # layer 0 is cached (2 slots) and follows the one-layer sequence by hand; layer 1 is kept whole: every
    # access hits, in the decode steps and in the pass of two tokens, where layer 0 runs all on the host
    meta = TraceMeta(model="hand", num_layers=2, num_experts=6, top_k=2, expert_bytes=E)
    routes = np.asarray(DECODE + [[0, 1], [0, 1]])
    trace = Trace.build(meta, np.stack([routes, routes], axis=1), iteration=[0, 1, 2, 3, 4, 5, 6, 7, 7],
                        request=[0, 0, 0, 0, 0, 0, 0, 0, 1])
    rule = UploadsBetweenPasses(2)
    result = simulate_timed(trace, hardware(), "lru-dist", (2 + 6) * E, uploads=rule,
                            policy_options={"whole_layers": [1]})
    assert result.per_layer_accesses == [16, 16]  # the pass of two tokens accesses each of its experts once
    assert result.per_layer_hits == [1, 16] and result.per_layer_bypassed == [15, 0]
    assert rule.uploads == 11  # layer 0's, as in test_two_inserts_per_step_by_hand; layer 1 never misses


def test_n_cpu_moe_with_the_cache_at_olmoes_shape(tiny_trace):
    # 16 layers x 64 experts, room for 512: 8 whole layers fill it, so the least N with a slot each is 9
    # (7 x 64 + 9 x (6 + 1) = 511), halfway 12 (4 x 64 + 12 x 21 = 508), and every layer cached (16 x 32)
    spec = ModelSpec(16, 64, 8)
    context = PlacementContext(spec, 512, tiny_trace, hardware(), None)
    cached = [s for s in llama_settings(context) if s.uploads is not None]
    assert [s.flags[-4:] for s in cached] == [["--n-cpu-moe", "9", "--moe-expert-cache", "6"],
                                             ["--n-cpu-moe", "12", "--moe-expert-cache", "20"],
                                             ["999", "--cpu-moe", "--moe-expert-cache", "31"]]
    for setting, host, slots in zip(cached, (9, 12, 16), (6, 20, 31)):
        assert setting.options["whole_layers"] == list(range(host, 16))
        assert setting.cache_slots == host * slots + (16 - host) * 64
        assert setting.cache_slots + host <= 512  # each cached layer's zero slot


def small_host_memory(host_bytes: int) -> HardwareProfile:
    """``hardware()`` with ``host_bytes`` of host memory and an SSD behind it that holds every expert."""
    return HardwareProfile.from_dict({
        "name": "small-host",
        "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": host_bytes},
                  {"name": "ssd", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": 1e6, "latency_s": 0.0},
                  {"from": "ssd", "to": "host", "bandwidth_bytes_per_s": 1e5, "latency_s": 0.0}],
        "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.25}, "expert": {"fixed_s": 2.0},
                    "lm_head": {"fixed_s": 0.5}},
        "host": {"expert": {"fixed_s": 2.0}}})


def test_the_pr_cache_is_listed_not_timed_where_host_memory_cannot_hold_the_experts(tiny_trace):
    from moe_offload.reporting.on_engine import measure_on_engine, section_lines, setting_rows

    meta = tiny_trace.meta
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    every = spec.num_layers * spec.num_experts * E  # 64 experts: 6,400 bytes
    fits = PlacementContext(spec, 24, tiny_trace, small_host_memory(every), E)
    assert all(s.cannot_host is None for s in llama_settings(fits))
    short = PlacementContext(spec, 24, tiny_trace, small_host_memory(every // 2), E)
    cached = [s for s in llama_settings(short) if s.uploads is not None]
    assert len(cached) == 2
    for setting in cached:
        assert setting.cannot_host == ("not timed: PR #27861 uploads experts from host memory, and the 64 experts "
                                       "(6.4 kB) do not fit small-host's host tier (3.2 kB)")
    assert all(s.cannot_host is None for s in llama_settings(short) if s.uploads is None)
    # the engine's section scores the others and lists these with the reason, where the run used to be refused
    on_engine = measure_on_engine(tiny_trace, small_host_memory(every // 2), 24, E, ["llama.cpp"], None,
                                  timed_tokens=16)
    section = on_engine.engines[0]
    untimed = [entry for entry in section.scores if entry.setting.uploads is not None]
    assert [entry.served for entry in untimed] == [None, None] and section.best.setting.uploads is None
    rows = {row[0]: row[1:] for row in setting_rows(section)}
    assert all(rows[entry.setting.label] == ("-",) * 5 for entry in untimed)
    lines = section_lines(on_engine, "tiny", "24")["llama.cpp"]
    assert [line for line in lines if "not timed" in line] == [f"{s.label}: {s.cannot_host}" for s in cached]
