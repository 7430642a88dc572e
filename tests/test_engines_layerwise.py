"""Whole layers streamed over the link (simulator/timed/layerwise.py), against timelines worked out by hand.

KTransformers' layerwise prefill and dynamic expert update, from kt_ep_wrapper.py: a pass of at least T tokens
brings each layer's whole expert set over the link and computes every routed expert on the GPU; with the update
the layer's GPU experts then become that pass's n most routed (ties and the unrouted fill to the lower id);
shorter passes use the GPU experts and compute the rest on the host.

vLLM's and SGLang's layer offloaders, from their prefetch.py and offloader.py: every pass copies each offloaded
layer's experts into one of s buffers, the copy of the (k + s)-th offloaded layer starting once the k-th has run,
one copy at a time; the compute waits for a layer's copy before its attention (vLLM) or its experts (SGLang)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.engines import PlacementContext, run_setting
from moe_offload.engines.ktransformers import median_prompt_pass
from moe_offload.engines.ktransformers import settings as kt_settings
from moe_offload.engines.vllm import offload_groups, offloaded_layers
from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import ModelSpec
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.layerwise import StreamedLayers
from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta
from test_engines_expert_cache import small_host_memory

E = 100


def hardware() -> HardwareProfile:
    # 100 bytes per second: one expert takes 1 s on the link, a layer of 6 takes 6 s
    return HardwareProfile.from_dict({
        "name": "test", "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": 100.0, "latency_s": 0.0}],
        "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.0}, "expert": {"fixed_s": 2.0},
                    "lm_head": {"fixed_s": 0.0}},
        "host": {"expert": {"fixed_s": 3.0}}})


def trace_of(prompt, decode) -> Trace:
    """One layer of 6 experts, top-2: one request, its prompt ``prompt`` (one pass) then ``decode`` one by one."""
    rows = list(prompt) + list(decode)
    meta = TraceMeta(model="hand", num_layers=1, num_experts=6, top_k=2, expert_bytes=E)
    iteration = [0] * len(prompt) + list(range(1, len(decode) + 1))
    phase = [PREFILL] * len(prompt) + [DECODE] * len(decode)
    return Trace.build(meta, np.asarray(rows)[:, None, :], iteration=iteration, phase=np.asarray(phase, np.uint8))


PROMPT = [[2, 3], [2, 4], [3, 2]]  # counts: 2 three times, 3 twice, 4 once
DECODE_ROWS = [[2, 5], [0, 3]]


def run(threshold, update, prompt=PROMPT, decode=DECODE_ROWS, start=(0, 1)):
    rule = StreamedLayers(threshold, update)
    result = simulate_timed(trace_of(prompt, decode), hardware(), "static-experts", 2 * E,
                            policy_options={"experts": list(start)}, layerwise=rule)
    return result, rule


def test_the_update_keeps_the_prompts_most_routed_experts():
    # the prompt (3 tokens >= 3) brings all 6 experts (6 s on the link) and runs 2, 3, 4 on the GPU: none was
    # resident. The update keeps 2 and 3. Decode [2, 5]: 2 hits, 5 on the host; [0, 3]: 3 hits, 0 on the host.
    result, rule = run(3, True)
    assert (result.accesses, result.hits, result.bypassed) == (7, 2, 2)
    assert result.bytes_loaded == 6 * E and (rule.passes, rule.replaced) == (1, 2)
    # the prompt: attention 1 s, the layer 6 s, three experts 2 s each on the GPU
    assert result.ttft_seconds == pytest.approx(1 + 6 + 3 * 2)


def test_without_the_update_the_static_placement_stays():
    # same fallback prompt, then decode with 0, 1 on the GPU: [2, 5] both host, [0, 3] 0 hits
    result, rule = run(3, False)
    assert (result.hits, result.bypassed) == (1, 3) and rule.replaced == 0
    assert result.bytes_loaded == 6 * E


def test_a_prompt_below_the_threshold_takes_the_static_path():
    # 3 tokens < 4: no fallback, no update; 2, 3, 4 run on the host; decode as the static placement
    result, rule = run(4, True)
    assert rule.passes == 0 and result.bytes_loaded == 0
    assert (result.hits, result.bypassed) == (1, 6)


def test_ties_and_unrouted_experts_go_to_the_lower_id():
    assert StreamedLayers.most_routed([6, 7, 8, 9], [1, 1, 1, 1], 2, 1, 6) == [6, 7]
    # fewer routed experts than GPU slots: the unrouted fill from the lowest id
    assert StreamedLayers.most_routed([4, 5], [3, 3], 3, 0, 6) == [0, 4, 5]
    result, rule = run(3, True, prompt=[[4, 5], [4, 5], [4, 5]], decode=[[4, 0]], start=(1, 2))
    assert rule.replaced == 2 and result.hits == 1  # 4 and 5 kept; decode [4, 0]: 4 hits


def test_the_rule_needs_a_static_placement():
    with pytest.raises(ConfigError, match="static-experts"):
        simulate_timed(trace_of(PROMPT, DECODE_ROWS), hardware(), "lru", 2 * E, layerwise=StreamedLayers(3))
    with pytest.raises(ConfigError, match="threshold"):
        StreamedLayers(0)


def test_the_dynamic_setting_starts_from_frequency_and_names_its_flags(tiny_trace):
    meta = tiny_trace.meta
    context = PlacementContext(ModelSpec(meta.num_layers, meta.num_experts, meta.top_k), 16, tiny_trace,
                               hardware(), E)
    by_label = {s.label: s for s in kt_settings(context)}
    threshold = median_prompt_pass(tiny_trace)
    dynamic = by_label[f"frequency, dynamic update at {threshold}+ token passes"]
    assert dynamic.flags[-3:] == ["--kt-gpu-prefill-token-threshold", str(threshold),
                                  "--kt-enable-dynamic-expert-update"]
    assert dynamic.resident == by_label["frequency"].resident
    assert dynamic.layerwise == {"threshold": threshold, "dynamic_update": True}
    prompts = [int((tiny_trace.iteration == i).sum()) for i in np.unique(tiny_trace.iteration[tiny_trace.phase == PREFILL])]
    assert threshold == int(np.median(prompts))


def test_no_setting_is_timed_where_host_memory_cannot_hold_every_expert(tiny_trace):
    # kt-kernel loads every expert into host memory, the GPU's too: on a host that cannot hold them all, the
    # server does not fit, whichever placement
    meta = tiny_trace.meta
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    every = spec.num_layers * spec.num_experts * E
    listed = kt_settings(PlacementContext(spec, 16, tiny_trace, small_host_memory(every - 1), E))
    assert len(listed) == 5 and {s.cannot_host for s in listed} == {
        "not timed: kt-kernel loads every expert into host memory, those on the GPU too (kvcache-ai/ktransformers "
        "issue #2084), and the 64 experts (6.4 kB) do not fit small-host's host tier (6.4 kB)"}
    assert all(s.cannot_host is None for s in kt_settings(PlacementContext(spec, 16, tiny_trace,
                                                                           small_host_memory(every), E)))


def offload_trace(tokens=2) -> Trace:
    """4 layers of 6 experts, top-2, one request decoding ``tokens`` tokens, each layer routing 0 and 1."""
    meta = TraceMeta(model="hand", num_layers=4, num_experts=6, top_k=2, expert_bytes=E)
    rows = np.tile(np.array([[0, 1]]), (tokens, 4, 1))
    return Trace.build(meta, rows, iteration=list(range(tokens)), phase=np.full(tokens, DECODE, np.uint8))


def offloaded(step, before_attention, layers=(1, 3), tokens=2):
    rule = StreamedLayers(layers=layers, prefetch_step=step, before_attention=before_attention, source="offloader")
    result = simulate_timed(offload_trace(tokens), hardware(), "static-layers", 12 * E,
                            policy_options={"cpu_layers": list(layers)}, layerwise=rule)
    return result, rule


def test_vllm_waits_for_an_offloaded_layer_before_its_attention():
    # a layer's experts take 6 s on the link; attention 1 s, each expert 2 s. Layer 1 was copied at the start.
    # Pass 0: layer 0 ends at 5; layer 1 at 10, then layer 3's copy runs 10-16; layer 2 ends at 15; layer 3
    # waits to 16 before its attention, ends at 21, then layer 1's copy runs 21-27. Pass 1: layer 0 ends at 26,
    # layer 1 waits to 27, ends at 32 (layer 3's copy 32-38), layer 2 ends at 37, layer 3 waits to 38, ends at 43.
    result, rule = offloaded(1, True)
    assert result.ttft_seconds == pytest.approx(21) and result.tpot_seconds == pytest.approx(43 - 21)
    assert result.stall_seconds == pytest.approx(1 + 1 + 1)
    # the offloaded layers' routed experts came with their layers: misses, none bypassed
    assert (result.accesses, result.hits, result.bypassed) == (16, 8, 0)
    assert result.bytes_loaded == 4 * 6 * E  # four copies, the last one for a pass that never comes


def test_sglang_waits_for_it_before_its_experts():
    # the same copies, awaited after the attention: layer 3's copy (10-16) lands as its attention ends at 16
    result, _ = offloaded(1, False)
    assert result.ttft_seconds == pytest.approx(20) and result.tpot_seconds == pytest.approx(20)
    assert result.stall_seconds == pytest.approx(0)


def test_two_buffers_copy_two_offloaded_layers_ahead():
    # layers 1 and 3 copied at the start. With two buffers for two offloaded layers each
    # layer's copy for the next pass starts once it has run: layer 1's at 10 (lands 16), layer 3's at 20 (26).
    # Pass 0 ends at 20 with no wait; in pass 1 layer 1 starts at 25 and layer 3 at 35, both copies landed.
    result, _ = offloaded(2, True)
    assert result.ttft_seconds == pytest.approx(20) and result.tpot_seconds == pytest.approx(20)
    assert result.stall_seconds == pytest.approx(0) and result.bytes_loaded == 4 * 6 * E


def test_offloader_settings_that_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="more than the 2 offloaded layers"):
        StreamedLayers(layers=[1, 3], prefetch_step=3, source="offloader")
    with pytest.raises(ConfigError, match="every pass"):
        StreamedLayers(threshold=4, layers=[1], prefetch_step=1, source="offloader")
    with pytest.raises(ConfigError, match="layer 5 streamed, but the model has 4"):
        offloaded(1, True, layers=(1, 5))
    with pytest.raises(ConfigError, match="buffer"):
        simulate_timed(offload_trace(), hardware(), "static-layers", 10**9 - 5 * E,
                       policy_options={"cpu_layers": [1, 3]},
                       layerwise=StreamedLayers(layers=[1, 3], prefetch_step=1, source="offloader"))


def test_the_prefetch_backend_offloads_the_last_layers_of_each_group():
    # prefetch.py: decoder layer i is offloaded when i % G >= G - n
    assert offloaded_layers(8, 4, 1) == [3, 7] and offloaded_layers(8, 3, 2) == [1, 2, 4, 5, 7]
    # the fewest layers that fit, then the widest smallest gap round the pass: 12 of 48 one in four; 13 of 48
    # cannot all be two apart (n = 1 gives 48 // G), so two of each group of 7, the last group's one
    assert offload_groups(48, 12) == (4, 1) and offload_groups(48, 13) == (7, 2)
    assert offloaded_layers(48, 7, 2) == [5, 6, 12, 13, 19, 20, 26, 27, 33, 34, 40, 41, 47]
    assert offload_groups(16, 5) == (3, 1) and offload_groups(16, 17) is None


def test_vllm_lists_the_prefetch_backend_at_the_budget_and_streams_every_pass():
    from moe_offload.engines.vllm import settings as vllm_settings

    trace = offload_trace(tokens=3)
    # room for 3 of the 4 layers' experts: one buffer needs 2 layers offloaded (1 and 3), two buffers 3 (1, 2, 3)
    context = PlacementContext(ModelSpec(4, 6, 2), 18, trace, hardware(), E)
    listed = [s for s in vllm_settings(context) if s.layerwise is not None]
    assert [s.flags for s in listed] == [
        ["--offload-group-size", "2", "--offload-num-in-group", "1", "--offload-prefetch-step", "1",
         "--offload-params", "experts"],
        ["--offload-group-size", "4", "--offload-num-in-group", "3", "--offload-prefetch-step", "2",
         "--offload-params", "experts"]]
    one, two = listed
    assert one.options == {"cpu_layers": [1, 3]} and one.resident == list(range(6)) + list(range(12, 18))
    assert two.options == {"cpu_layers": [1, 2, 3]} and two.resident == list(range(6))
    assert one.cache_slots + 6 == two.cache_slots + 2 * 6 == 18  # the buffers within the budget
    # three passes, each copying every offloaded layer whole; the VRAM layers hit, the others came with them
    result = run_setting(one, trace, context)
    assert result.bytes_loaded == 3 * 2 * 6 * E and result.bypassed == 0
    assert result.per_layer_hits == [6, 0, 6, 0] and result.per_layer_accesses == [6] * 4
    assert run_setting(one, trace, context).tpot_seconds == pytest.approx(22)  # as timed by hand above
    # a budget below one layer beside a buffer lists none
    assert not [s for s in vllm_settings(PlacementContext(ModelSpec(4, 6, 2), 6, trace, hardware(), E))
                if s.layerwise is not None]
