"""The runtime applies a prefetcher's proposals where the timed simulator does (simulator/timed/run.py): after the
routed layer has counted its accesses, pinned its experts and queued its demand loads, so that a prefetch for
a later layer never evicts an expert the routed layer is about to compute, nor goes on the wire ahead of its
demand loads."""

from __future__ import annotations

import torch

from moe_offload.bundled import DEFAULT_TINY_TRACE
from moe_offload.runtime.datapath import DataPath
from moe_offload.plan import make_plan
from moe_offload.runtime.engine import OffloadEngine
from moe_offload.runtime.pack_cache import packed_directory
from moe_offload.trace.format import read_trace


def test_proposals_after_a_router_wait_for_its_layer_to_pin_and_demand(monkeypatch):
    calls = []  # ("routed", layer) and ("propose", routed layer, the pinned experts then)
    propose, layer_routed = DataPath.propose, DataPath.layer_routed

    def recording_propose(self, proposals, routed_layer):
        if proposals:
            calls.append(("propose", routed_layer, frozenset(self.pinned)))
        return propose(self, proposals, routed_layer)

    def recording_layer_routed(self, layer, keys):
        calls.append(("routed", layer, frozenset(keys)))
        return layer_routed(self, layer, keys)

    monkeypatch.setattr(DataPath, "propose", recording_propose)
    monkeypatch.setattr(DataPath, "layer_routed", recording_layer_routed)
    torch.manual_seed(0)
    with OffloadEngine(make_plan(packed_directory("tiny"), replay=read_trace(DEFAULT_TINY_TRACE), replay_weights="trace",
                                 fast_budget="25%", policy="lru", prefetch="topk")) as engine:
        engine.generate_replayed(0, 3)
    proposals = [call for call in calls if call[0] == "propose" and call[1] >= 0]
    assert len(proposals) >= engine.spec.num_layers  # topk proposes after every router
    for index, call in enumerate(calls):
        if call[0] != "propose" or call[1] < 0:
            continue
        previous = calls[index - 1]
        # right after its own layer was routed, with every expert that layer computes still pinned
        assert previous[:2] == ("routed", call[1]), (index, previous, call)
        assert call[2] == previous[2]


def test_under_a_replay_moepic_proposes_what_the_timed_simulator_proposes(monkeypatch):
    """A replay forces the routers to the trace's experts; MoEpic's gate predictions are then the trace's too
    (runtime/replay.py), so the runtime's proposals equal the timed simulator's on the same rows and profile:
    the model's own predictions, from hidden states that are not the recording's, proposed other experts."""
    from moe_offload.hardware import resolve_profile
    from moe_offload.runtime.packing import read_manifest
    from moe_offload.runtime.replay import replay_rows
    from moe_offload.simulator.timed import simulate_timed
    from moe_offload.simulator.timed.tiers import TierNetwork

    trace, packed, hardware = read_trace(DEFAULT_TINY_TRACE), packed_directory("tiny"), resolve_profile("edge-flashmoe")
    manifest = read_manifest(packed)
    running, simulated = [], []
    propose, network_propose = DataPath.propose, TierNetwork.propose

    def recording_propose(self, proposals, routed_layer):
        running.append(sorted(int(key) for key, _ in proposals))
        return propose(self, proposals, routed_layer)

    def recording_network_propose(self, proposals):
        proposals = list(proposals)
        simulated.append(sorted(int(key) for key, _ in proposals))
        return network_propose(self, proposals)

    monkeypatch.setattr(DataPath, "propose", recording_propose)
    monkeypatch.setattr(TierNetwork, "propose", recording_network_propose)
    new_tokens = 4
    with OffloadEngine(make_plan(packed, replay=trace, replay_weights="trace", fast_budget="25%", policy="lru",
                                 prefetch="moepic", hardware=hardware)) as engine:
        engine.generate_replayed(0, new_tokens)
    simulate_timed(trace.select(replay_rows(trace, 0, new_tokens)), hardware, "lru", 16 * manifest.expert_bytes,
                   expert_bytes=manifest.expert_bytes, prefetcher="moepic")
    running, simulated = [keys for keys in running if keys], [keys for keys in simulated if keys]
    assert len(running) >= new_tokens
    assert running == simulated
