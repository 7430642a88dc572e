"""KTransformers' layerwise prefill and dynamic expert update (simulator/timed/layerwise.py), against sequences worked
out by hand from kt_ep_wrapper.py: a pass of at least T tokens brings each layer's whole expert set over the link
and computes every routed expert on the GPU; with the update the layer's GPU experts then become that pass's n most
routed (ties and the unrouted fill to the lower id); shorter passes use the GPU experts and compute the rest on the
host."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.engines import PlacementContext
from moe_offload.engines.ktransformers import median_prompt_pass
from moe_offload.engines.ktransformers import settings as kt_settings
from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import ModelSpec
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.layerwise import LayerwisePrefill
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
    rule = LayerwisePrefill(threshold, update)
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
    assert LayerwisePrefill.most_routed([6, 7, 8, 9], [1, 1, 1, 1], 2, 1, 6) == [6, 7]
    # fewer routed experts than GPU slots: the unrouted fill from the lowest id
    assert LayerwisePrefill.most_routed([4, 5], [3, 3], 3, 0, 6) == [0, 4, 5]
    result, rule = run(3, True, prompt=[[4, 5], [4, 5], [4, 5]], decode=[[4, 0]], start=(1, 2))
    assert rule.replaced == 2 and result.hits == 1  # 4 and 5 kept; decode [4, 0]: 4 hits


def test_the_rule_needs_a_static_placement():
    with pytest.raises(ConfigError, match="static-experts"):
        simulate_timed(trace_of(PROMPT, DECODE_ROWS), hardware(), "lru", 2 * E, layerwise=LayerwisePrefill(3))
    with pytest.raises(ConfigError, match="threshold"):
        LayerwisePrefill(0)


def test_the_dynamic_setting_starts_from_frequency_and_names_its_flags(tiny_trace):
    meta = tiny_trace.meta
    context = PlacementContext(ModelSpec(meta.num_layers, meta.num_experts, meta.top_k), 16, tiny_trace,
                               hardware(), E)
    by_label = {s.label: s for s in kt_settings(context)}
    threshold = median_prompt_pass(tiny_trace)
    dynamic = by_label[f"frequency, dynamic update at {threshold}+ token passes"]
    assert dynamic.flags[-3:] == ["--kt-gpu-prefill-token-threshold", str(threshold),
                                  "--kt-enable-dynamic-expert-update"]
    assert dynamic.resident == by_label["frequency"].resident and dynamic.layerwise == (threshold, True)
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
