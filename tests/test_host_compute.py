"""Host compute in the timed simulator, on hand-computed timelines: a bypassed expert runs on the host while
the GPU computes the layer's resident experts, and the layer is done when both are; Fiddler's
fetch-or-compute rule picks the cheaper side per expert and batch; a prefill's bypassed expert is many
tokens of host compute."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile
from moe_offload.hardware.profile import resolve_profile
from moe_offload.simulator.timed import simulate_timed
from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta

E = 1000  # bytes per expert


def profile(*, expert=2.0, host_expert=5.0, host_per_token=0.0, latency=0.5, bandwidth=100.0, host=True):
    data = {
        "name": "hand",
        "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": bandwidth, "latency_s": latency}],
        "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.25}, "lm_head": {"fixed_s": 0.5},
                    "expert": {"fixed_s": expert, "per_token_s": 0.0}}}
    if host:
        data["host"] = {"expert": {"fixed_s": host_expert, "per_token_s": host_per_token}}
    return HardwareProfile.from_dict(data)


def trace(rows, phase=None, iteration=None) -> Trace:
    """One layer of four experts; ``rows[token]`` lists the token's experts."""
    experts = np.asarray(rows)[:, None, :]
    meta = TraceMeta(model="hand", num_layers=1, num_experts=4, top_k=experts.shape[2], expert_bytes=E)
    return Trace.build(meta, experts, phase=phase, iteration=iteration)


# Three decoding tokens, each routed to experts 0, 1 and 2; 0 and 1 come most often (1 also in the first
# row twice is impossible: top-k distinct), so hand the tie to the lower keys: static-freq with room for two
# keeps 0 and 1 resident and bypasses 2.
ROWS = [[0, 1, 2]] * 3


@pytest.mark.parametrize("host_expert, layer", [
    (5.0, 0.5 + 5.0 + 0.5),   # host side: hidden states over (latency 0.5), expert 5, back (0.5) > GPU 2 x 2
    (2.0, 2 * 2.0),           # GPU side: two resident experts, 4 > 0.5 + 2 + 0.5
])
def test_a_layer_takes_the_longer_of_the_gpu_and_the_host(host_expert, layer):
    result = simulate_timed(trace(ROWS), profile(host_expert=host_expert), "static-freq", 2 * E)
    iteration = 1.0 + 0.25 + layer + 0.5  # attention, router, the layer's experts, LM head
    assert result.tpot_seconds == pytest.approx(iteration)
    assert result.ttft_seconds == pytest.approx(iteration)  # resident from the start: no load in the first pass
    assert (result.hits, result.misses, result.bypassed) == (6, 0, 3)
    assert result.host_compute_seconds == pytest.approx(3 * host_expert)
    assert result.bytes_loaded == 0
    host = [e for e in result.timeline["events"] if e["lane"] == "host"]
    assert [(e["expert"], e["start_s"], e["end_s"]) for e in host] == [
        (2, pytest.approx(1.25 + 0.5), pytest.approx(1.25 + 0.5 + host_expert))]


def test_fetch_or_compute_fetches_when_that_is_faster():
    # fetch: latency 0.5 + 1000 B / 100 B/s = 10.5, + GPU 2 = 12.5 against host 0.5 + 5 + 0.5 = 6: bypass
    slow_link = simulate_timed(trace(ROWS), profile(), "lru", 3 * E, fetch_or_compute=True)
    assert slow_link.bypassed == 9 and slow_link.misses == 0
    # a link of 10^6 B/s: fetch 0.5 + 0.001 + 2 = 2.501 < 6: every miss is fetched, then hits
    fast_link = simulate_timed(trace(ROWS), profile(bandwidth=1e6), "lru", 3 * E, fetch_or_compute=True)
    assert (fast_link.misses, fast_link.bypassed, fast_link.hits) == (3, 0, 6)


def test_a_prefill_on_the_host_is_many_tokens_of_host_compute():
    # 100 prompt tokens all routed to 0, 1, 2 in one pass, then one decoding token: expert 2 on the host costs
    # 5 + 0.1 x 100 = 15 for the prompt (TTFT), 5.1 for the decoding token
    rows = [[0, 1, 2]] * 101
    phase = np.array([PREFILL] * 100 + [DECODE])
    iteration = np.array([0] * 100 + [1])
    result = simulate_timed(trace(rows, phase, iteration), profile(host_per_token=0.1), "static-freq", 2 * E)
    assert result.ttft_seconds == pytest.approx(1.0 + 0.25 + 0.5 + 15.0 + 0.5 + 0.5)
    assert result.tpot_seconds == pytest.approx(1.0 + 0.25 + 0.5 + 5.1 + 0.5 + 0.5)


def test_bypassing_needs_the_hosts_compute_and_no_prefetcher():
    with pytest.raises(ConfigError, match=r"no \[host\] compute"):
        simulate_timed(trace(ROWS), profile(host=False), "static-freq", 2 * E)
    with pytest.raises(ConfigError, match="nothing for the prefetcher"):
        simulate_timed(trace(ROWS), profile(), "static-layers", 2 * E, prefetcher="oracle")


def test_every_preset_has_the_hosts_compute():
    for name in ("desktop-rtx4090", "server-a100-pcie4", "server-h100-pcie5", "edge-flashmoe"):
        host = resolve_profile(name).host
        # one OLMoE expert (12.6 MB of bf16) on one token is bound by the host's memory bandwidth
        assert host.expert_seconds(1, 12_582_912) == pytest.approx(
            host.roofline.expert_overhead_s + 12_582_912 / host.roofline.memory_bandwidth_bytes_per_s)


def test_an_expert_read_from_the_ssd_for_the_host_stays_in_host_memory():
    # experts live on an SSD (the host tier is a cache of it): the first pass reads expert 2 from the SSD
    # (latency 0.5 + 1000 B / 1000 B/s = 1.5) before the host computes it, the second finds it in host memory
    hardware = HardwareProfile.from_dict({
        "name": "hand-ssd",
        "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": 2 * E},
                  {"name": "ssd", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": 100.0, "latency_s": 0.5},
                  {"from": "ssd", "to": "host", "bandwidth_bytes_per_s": 1000.0, "latency_s": 0.5}],
        "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.25}, "lm_head": {"fixed_s": 0.5},
                    "expert": {"fixed_s": 2.0}},
        "host": {"expert": {"fixed_s": 5.0}}})
    result = simulate_timed(trace(ROWS[:2]), hardware, "static-freq", 2 * E)
    assert result.ttft_seconds == pytest.approx(1.0 + 0.25 + 0.5 + 1.5 + 5.0 + 0.5 + 0.5)
    assert result.tpot_seconds == pytest.approx(1.0 + 0.25 + 0.5 + 5.0 + 0.5 + 0.5)


@pytest.mark.parametrize("host, problem", [
    ({}, r"key 'host.expert': missing"),
    ({"expert": {"fixed_s": 1.0}, "threads": 4}, r"key 'host.threads': unknown key"),
    ({"flops_per_s": 1e12, "memory_bandwidth_bytes_per_s": -1}, r"host.memory_bandwidth_bytes_per_s"),
])
def test_a_bad_host_table_is_a_one_line_error_naming_the_key(host, problem):
    data = {"name": "bad", "tiers": [{"name": "gpu", "capacity_bytes": 10**9}],
            "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.25}, "lm_head": {"fixed_s": 0.5},
                        "expert": {"fixed_s": 2.0}}, "host": host}
    with pytest.raises(ConfigError, match=problem):
        HardwareProfile.from_dict(data, "bad.toml")


def test_the_timeline_plot_draws_the_hosts_lane(tmp_path):
    pytest.importorskip("matplotlib")
    from moe_offload.reporting.plots import plot_timeline

    result = simulate_timed(trace(ROWS), profile(), "static-freq", 2 * E)
    assert "host" in result.timeline["lanes"]
    assert plot_timeline([result], tmp_path / "timeline.png").stat().st_size > 0
