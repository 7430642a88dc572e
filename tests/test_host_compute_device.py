"""A host that is the compute device (``[host] on_compute_device``: a machine without a GPU, where the runtime
computes a bypassed expert on the cores that compute the resident ones, on the same thread): the timed
simulator runs its experts after the layer's resident ones on the compute stream, and no hidden states cross a
link; hand-computed timelines beside the GPU machine's (test_host_compute.py)."""

from __future__ import annotations

import pytest

from test_host_compute import E, ROWS, profile, trace

from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile
from moe_offload.simulator.timed import simulate_timed


def on_compute_device(**options) -> HardwareProfile:
    data = profile(**options)
    return HardwareProfile(**{**data.__dict__, "host": type(data.host)(data.host.expert, data.host.roofline, True)})


@pytest.mark.parametrize("host_expert", [5.0, 2.0])
def test_the_host_experts_run_after_the_resident_ones_with_no_link_crossed(host_expert):
    # two resident experts of 2 s each, then the bypassed one on the same stream: 2 + 2 + host, no hidden
    # states over the link (latency 0.5 each way on a GPU machine)
    result = simulate_timed(trace(ROWS), on_compute_device(host_expert=host_expert), "static-freq", 2 * E)
    assert result.tpot_seconds == pytest.approx(1.0 + 0.25 + 2 * 2.0 + host_expert + 0.5)
    assert result.host_compute_seconds == pytest.approx(3 * host_expert)
    assert result.stall_seconds == 0
    host = [e for e in result.timeline["events"] if e["kind"] == "host"]
    assert [(e["expert"], e["start_s"], e["end_s"]) for e in host] == [
        (2, pytest.approx(1.25 + 4.0), pytest.approx(1.25 + 4.0 + host_expert))]


def test_fetch_or_compute_on_the_compute_device_charges_no_hidden_states():
    # fetch-or-compute: fetch 0.5 + 1000 / 100 + 2 = 12.5 s against the host's 5 s and no link crossed: every
    # miss is computed on the host, so the cache stays empty and each layer is three host experts in a row
    result = simulate_timed(trace(ROWS), on_compute_device(), "lru", 3 * E, fetch_or_compute=True)
    assert (result.hits, result.misses, result.bypassed) == (0, 0, 9)
    assert result.tpot_seconds == pytest.approx(1.0 + 0.25 + 3 * 5.0 + 0.5)


def test_on_compute_device_must_be_a_boolean(tmp_path):
    from moe_offload.hardware.profile import load_profile

    path = tmp_path / "bad.toml"
    path.write_text('[[tiers]]\nname = "cpu"\ncapacity_bytes = 1000\n'
                    '[compute]\nattention = { fixed_s = 1 }\nrouter = { fixed_s = 1 }\nlm_head = { fixed_s = 1 }\n'
                    'expert = { fixed_s = 1 }\n[host]\nexpert = { fixed_s = 1 }\non_compute_device = "yes"\n')
    with pytest.raises(ConfigError, match=r"bad.toml: key 'host.on_compute_device': must be true or false"):
        load_profile(path)


def test_a_bypassed_expert_runs_while_the_layer_waits_for_its_loads(monkeypatch):
    from moe_offload.policies import POLICIES, PolicyInfo
    from moe_offload.policies.lru import LRU

    class LRUNeverTwo(LRU):  # the host computes expert 2: a layer with loads and a bypass at once
        name = "lru-never-two"
        places_or_bypasses = True

        def admit(self, key, ctx):
            return key != 2

    monkeypatch.setitem(POLICIES, LRUNeverTwo.name, PolicyInfo(LRUNeverTwo.name, LRUNeverTwo))
    result = simulate_timed(trace(ROWS), on_compute_device(), LRUNeverTwo.name, 3 * E)
    # first pass: routed at 1.25; experts 0 and 1 load one after the other (0.5 + 1000 / 100 = 10.5 s each:
    # 11.75, 22.25) while the host computes 2 (1.25 to 6.25) on the idle compute stream; 0 runs 11.75-13.75,
    # 1 22.25-24.25; LM head: 24.75. Were the host's expert run after the resident ones: 29.75
    assert result.ttft_seconds == pytest.approx(24.75)
    # then 0 and 1 are resident: 1.25 + 2 + 2 + 5 + 0.5
    assert result.tpot_seconds == pytest.approx(10.75)
