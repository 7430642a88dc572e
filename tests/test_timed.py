"""The timed simulator and its transfer queue: timelines worked out by hand, queue order, pinning, the degenerate
cases that must agree with the replay, serving arrivals, and the `simulate --timed` command.

Unless a test says otherwise the hardware is the one of ``profile()``: one link host -> gpu of 100 B/s with
0.5 s latency, so one expert of 100 B takes 0.5 + 100/100 = 1.5 s; attention 1 s and router 0.25 s per
layer, 2 s per expert, LM head 0.5 s. One decode iteration that needs nothing from the link takes
L * (1 + 0.25) + (experts run) * 2 + 0.5 seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from moe_offload.cli.main import main
from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile, Link
from moe_offload.policies import POLICIES, ModelSpec, PolicyInfo, default_policies
from moe_offload.policies.lru import LRU
from moe_offload.prefetch import PREFETCHERS
from moe_offload.prefetch.base import Prefetcher
from moe_offload.prefetch.search_cost import TimedSearch
from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.simulator.timed import Arrivals, layer_needs, simulate_timed, timed_grid
from moe_offload.simulator.transfers import TransferQueue
from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta, write_trace
from moe_offload.trace.synthetic import zipf_trace

E = 100  # bytes of one expert in the hand-made traces


def profile(*, bandwidth=100.0, latency=0.5, attention=1.0, attention_per_token=0.0, router=0.25, expert=2.0,
            expert_per_token=0.0, lm_head=0.5, lm_head_per_token=0.0, gpu=10**9, host=10**12, ssd=None,
            ssd_bandwidth=50.0, ssd_latency=0.5, slowdown_while_loading=1.0,
            slowdown_while_computing=1.0) -> HardwareProfile:
    tiers = [{"name": "gpu", "capacity_bytes": gpu}, {"name": "host", "capacity_bytes": host}]
    links = [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": bandwidth, "latency_s": latency,
              "slowdown_while_computing": slowdown_while_computing}]
    if ssd is not None:
        tiers.append({"name": "ssd", "capacity_bytes": ssd})
        links.append({"from": "ssd", "to": "host", "bandwidth_bytes_per_s": ssd_bandwidth, "latency_s": ssd_latency})
    return HardwareProfile.from_dict({
        "name": "test", "tiers": tiers, "links": links,
        "compute": {"attention": {"fixed_s": attention, "per_token_s": attention_per_token},
                    "router": {"fixed_s": router},
                    "expert": {"fixed_s": expert, "per_token_s": expert_per_token},
                    "lm_head": {"fixed_s": lm_head, "per_token_s": lm_head_per_token},
                    "slowdown_while_loading": slowdown_while_loading},
        # the host computes a bypassed expert as fast as the GPU: only placements bypass here
        "host": {"expert": {"fixed_s": expert, "per_token_s": expert_per_token}}})


def hand_trace(experts, *, layers, num_experts=4, request=None, phase=None, iteration=None) -> Trace:
    """``experts[token][layer]`` lists the token's experts of that layer (top-k = its length)."""
    experts = np.asarray(experts)
    meta = TraceMeta(model="hand", num_layers=layers, num_experts=num_experts, top_k=experts.shape[2],
                     expert_bytes=E)
    return Trace.build(meta, experts, request=request, phase=phase, iteration=iteration)


def spec_of(trace: Trace) -> ModelSpec:
    return ModelSpec(trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k)


def transfers(result):
    """(link, kind, key, start, end) of every transfer in the result's timeline, in start order."""
    events = [e for e in result.timeline["events"] if "->" in e["lane"]]
    return [(e["lane"], e["kind"], e["expert"], round(e["start_s"], 9), round(e["end_s"], 9))
            for e in sorted(events, key=lambda e: (e["start_s"], e["lane"]))]


class Proposing(Prefetcher):
    """A test prefetcher: ``plan[(hook, layer_now)]`` lists the (key, priority) it proposes at that hook."""

    name = "test-plan"
    summary = "proposes what the test says"
    source = "tests"

    def __init__(self, spec, plan):
        super().__init__(spec)
        self.plan = plan

    def on_iteration_start(self, view):
        return self.plan.get(("start", view.iteration), [])

    def on_layer_routed(self, view):
        return self.plan.get(("routed", view.iteration, view.layer_now), [])


class NextLayerTruth(Prefetcher):
    """Proposes the true experts of the next layer (the oracle with distance 1)."""

    name = "test-next"
    summary = "the next layer's true experts"
    source = "tests"

    def _next(self, view):
        layer = view.layer_now + 1
        if layer >= self.spec.num_layers:
            return []
        return [(layer * self.spec.num_experts + int(e), 1.0) for e in np.unique(view.oracle_selected(layer))]

    on_iteration_start = on_layer_routed = _next


# ------------------------------------------------------------------------------------------ the transfer queue


def test_prefetches_go_by_priority_and_a_new_proposal_replaces_the_old_one():
    queue = TransferQueue(Link("host", "gpu", 100.0, 0.5), destination=set())
    assert queue.propose(1, priority=1.0, nbytes=E)
    assert queue.propose(2, priority=3.0, nbytes=E)
    assert queue.propose(3, priority=2.0, nbytes=E)
    assert queue.propose(4, priority=2.0, nbytes=E)   # ties: in the order of the latest proposal
    assert queue.propose(1, priority=5.0, nbytes=E)   # replaces expert 1's priority; still one entry
    assert queue.waiting_prefetches() == [1, 2, 3, 4]
    started = queue.start(now=10.0)
    assert (started.key, started.start_s, started.end_s) == (1, 10.0, 11.5)  # 0.5 s + 100 B / 100 B/s
    assert not queue.propose(1, priority=9.0, nbytes=E)  # on the wire: never duplicated
    assert queue.next_transfer(0.0) is None              # one transfer at a time
    assert queue.finish().key == 1 and queue.on_wire is None
    assert [queue.start(0).key, queue.finish().key] == [2, 2]
    queue.destination.add(3)                             # 3 became resident meanwhile: dropped, not sent
    assert not queue.propose(3, priority=9.0, nbytes=E)
    assert queue.start(0).key == 4
    assert queue.bytes_moved == 3 * E and queue.transfers_started == 3


def test_a_demand_load_overtakes_waiting_prefetches_but_not_the_transfer_on_the_wire():
    queue = TransferQueue(Link("host", "gpu", 100.0, 0.5), destination=set())
    queue.propose(1, 1.0, E)
    queue.propose(2, 2.0, E)
    assert queue.start(0.0).key == 2      # the highest priority goes on the wire
    assert queue.demand(7, E)
    assert queue.demand(1, E)             # a waiting prefetch becomes a demand load, behind the first one
    assert not queue.demand(7, E) and not queue.demand(2, E)  # already waiting / on the wire
    assert queue.next_transfer(0.0) is None  # the wire is busy: the prefetch on it completes first
    assert queue.finish().key == 2
    order = []
    while queue.next_transfer(0.0) is not None:
        order.append((queue.start(0.0).key, queue.on_wire.demand))
        queue.finish()
    assert order == [(7, True), (1, True)]
    assert queue.withdraw(1) is False


def test_an_announced_demand_load_lets_only_prefetches_start_that_end_before_it_can_arrive():
    # host -> gpu: one expert takes 0.5 + 100/100 = 1.5 s. A demand load of 9 is on the ssd wire until 2.0.
    queue = TransferQueue(Link("host", "gpu", 100.0, 0.5), destination=set())
    queue.propose(5, 1.0, E)
    queue.announce_demand(9, not_before=2.0)
    assert queue.next_transfer(1.0) is None       # 1.0 + 1.5 > 2.0: the prefetch would delay the demand load
    assert queue.next_transfer(0.5).key == 5      # 0.5 + 1.5 = 2.0: off the wire when 9 can arrive
    queue.demand(9, E)                            # 9 arrived: it goes first, and the announcement is over
    assert queue.start(2.0).key == 9
    queue.finish()
    assert queue.start(9.0).key == 5


def test_a_prefetch_from_host_memory_runs_while_a_demand_load_is_still_on_the_ssd_link():
    # gpu 2 experts, host 4 (a cache of ssd); ssd -> host 2.5 s, host -> gpu 1.5 s. Tokens need keys (1, 4),
    # (2, 5), (0, 4): the first two each load both of their experts from ssd (4.0 s of stall per layer) and
    # end at 15.0 and 30.0, leaving 2 and 5 in the gpu and 1, 4, 2, 5 in host memory.
    #   token 2, router of layer 0 at 31.25: 0 misses, ssd -> host 31.25 -> 33.75 (evicting 1 from host);
    #     the prefetcher proposes key 4, in host memory: 31.25 + 1.5 = 32.75 <= 33.75, the earliest time the
    #     demand load can reach host -> gpu, so the prefetch runs at once, 31.25 -> 32.75, and the demand
    #     load follows, 33.75 -> 35.25; expert 0 -> 37.25; layer 1 router at 38.5: 4 hits; -> 40.5; LM head
    #     -> 41.0. (Times below are from iteration 2's start, 30.0.)
    trace = hand_trace([[[1], [0]], [[2], [1]], [[0], [0]]], layers=2)
    plan = Proposing(spec_of(trace), {("routed", 2, 0): [(4, 1.0)]})
    result = simulate_timed(trace, profile(gpu=2 * E, host=4 * E, ssd=10**12), "lru", 2 * E, prefetcher=plan,
                            timeline_iteration=2)
    assert transfers(result) == [("host->gpu", "prefetch", 4, 1.25, 2.75), ("ssd->host", "demand", 0, 1.25, 3.75),
                                 ("host->gpu", "demand", 0, 3.75, 5.25)]
    assert (result.prefetches_used, result.total_seconds) == (1, pytest.approx(41.0))


# ------------------------------------------------------------------------------------------ hand-made timelines


def test_one_layer_one_link_demand_loads_by_hand():
    # One layer, top-1, a cache of one expert; tokens need experts 0, 0, 1.
    #   token 0: attention 0 -> 1, router -> 1.25, expert 0 misses: load 1.25 -> 2.75 (stall 1.5),
    #            expert 2.75 -> 4.75, LM head -> 5.25                                     TTFT = 5.25
    #   token 1: attention -> 6.25, router -> 6.5, expert 0 hits: 6.5 -> 8.5, LM head -> 9.0
    #   token 2: attention -> 10, router -> 10.25, expert 1 misses (evicts 0): 10.25 -> 11.75 (stall 1.5),
    #            expert -> 13.75, LM head -> 14.25                TPOT = (14.25 - 5.25) / 2 = 4.5
    trace = hand_trace([[[0]], [[0]], [[1]]], layers=1)
    result = simulate_timed(trace, profile(), "lru", 1 * E, timeline_iteration=2)
    assert result.ttft_seconds == pytest.approx(5.25)
    assert result.tpot_seconds == pytest.approx(4.5)
    assert result.token_latency_seconds == pytest.approx([3.75, 5.25])
    assert result.total_seconds == pytest.approx(14.25)
    assert result.per_layer_stall_seconds == pytest.approx([3.0]) and result.stall_seconds == pytest.approx(3.0)
    assert (result.accesses, result.hits, result.misses, result.on_demand_loads) == (3, 1, 2, 2)
    assert result.bytes_per_link == {"host->gpu": 2 * E} and result.bytes_loaded == 2 * E
    assert result.prefetches_issued is None and result.prefetch_precision is None
    assert transfers(result) == [("host->gpu", "demand", 1, 1.25, 2.75)]  # from iteration 2's start, 9.0
    # All experts resident: every token takes 1 + 0.25 + 2 + 0.5 = 3.75 s.
    bound = simulate_timed(trace, profile(), all_resident=True)
    assert (bound.ttft_seconds, bound.tpot_seconds, bound.stall_seconds) == pytest.approx((3.75, 3.75, 0.0))
    assert bound.bytes_loaded == 0 and bound.hits == 3


def test_a_prefetch_hides_part_of_each_load_by_hand():
    # The same trace with a prefetcher that proposes the true experts of layer 0 before each iteration.
    #   token 0: prefetch 0 at 0 -> 1.5; router ends 1.25, expert 0 is on the wire (a late prefetch): stall
    #            1.25 -> 1.5, expert -> 3.5, LM head -> 4.0                                  TTFT = 4.0
    #   token 1: expert 0 is resident, nothing is proposed: 4.0 -> 7.75
    #   token 2: prefetch 1 at 7.75 -> 9.25 (evicting 0); router ends 9.0: stall 0.25; expert -> 11.25,
    #            LM head -> 11.75                                        TPOT = (11.75 - 4.0) / 2 = 3.875
    trace = hand_trace([[[0]], [[0]], [[1]]], layers=1)
    for prefetcher in (NextLayerTruth(spec_of(trace)), "oracle"):
        result = simulate_timed(trace, profile(), "lru", 1 * E, prefetcher=prefetcher)
        assert result.ttft_seconds == pytest.approx(4.0)
        assert result.tpot_seconds == pytest.approx(3.875)
        assert result.stall_seconds == pytest.approx(0.5)
        assert (result.hits, result.misses, result.on_demand_loads) == (1, 2, 0)
        assert (result.prefetches_issued, result.prefetches_used, result.prefetches_wasted) == (2, 2, 0)
        assert result.prefetch_precision == 1.0 and result.prefetch_recall == 1.0


def test_compute_slowed_while_a_prefetch_is_on_the_wire_by_hand():
    # The trace above with the oracle, compute twice as slow while a transfer runs (a CPU's shared cores).
    #   token 0: prefetch 0 at 0 -> 1.5; attention (1 s of work) at half speed until 1.5: 0.75 done, the rest
    #            -> 1.75; router -> 2.0; expert 0 resident: -> 4.0; LM head -> 4.5                TTFT = 4.5
    #   token 1: nothing moves: 4.5 -> 8.25
    #   token 2: prefetch 1 at 8.25 -> 9.75; attention 0.75 done by 9.75, -> 10.0; router -> 10.25; expert
    #            -> 12.25; LM head -> 12.75; no stall                       TPOT = (12.75 - 4.5) / 2 = 4.125
    trace = hand_trace([[[0]], [[0]], [[1]]], layers=1)
    result = simulate_timed(trace, profile(slowdown_while_loading=2.0), "lru", 1 * E, prefetcher="oracle",
                            timeline_iteration=2)
    assert (result.ttft_seconds, result.tpot_seconds, result.stall_seconds) == pytest.approx((4.5, 4.125, 0.0))
    assert transfers(result) == [("host->gpu", "prefetch", 1, 0.0, 1.5)]  # from iteration 2's start, 8.25
    # demand loads run while the run waits for them, not while it computes: nothing is slowed
    demand = simulate_timed(trace, profile(slowdown_while_loading=2.0), "lru", 1 * E)
    assert (demand.ttft_seconds, demand.tpot_seconds) == pytest.approx((5.25, 4.5))


def test_a_transfer_slowed_while_compute_runs_by_hand():
    # The same, the link twice as slow while compute runs. A transfer needs 1.5 s of the wire at full speed.
    #   token 0: prefetch 0 from 0; attention and router compute 0 -> 1.25 (0.625 of the wire's work done),
    #            the rest at full speed -> 2.125: a stall of 0.875; expert -> 4.125; LM head -> 4.625
    #   token 1: -> 8.375
    #   token 2: prefetch 1 from 8.375; computing until 9.625, then 0.875 more -> 10.5 (stall 0.875); expert
    #            -> 12.5; LM head -> 13.0                              TPOT = (13.0 - 4.625) / 2 = 4.1875
    trace = hand_trace([[[0]], [[0]], [[1]]], layers=1)
    result = simulate_timed(trace, profile(slowdown_while_computing=2.0), "lru", 1 * E, prefetcher="oracle",
                            timeline_iteration=2)
    assert (result.ttft_seconds, result.tpot_seconds, result.stall_seconds) == pytest.approx((4.625, 4.1875, 1.75))
    assert transfers(result) == [("host->gpu", "prefetch", 1, 0.0, 2.125)]  # from iteration 2's start, 8.375
    demand = simulate_timed(trace, profile(slowdown_while_computing=2.0), "lru", 1 * E)
    assert (demand.ttft_seconds, demand.tpot_seconds) == pytest.approx((5.25, 4.5))


def test_a_demand_load_overtakes_queued_prefetches_and_the_wire_completes_first():
    # Two layers; the token needs expert 0 of layer 0 (key 0) and expert 2 of layer 1 (key 6). Before the
    # iteration the prefetcher proposes keys 6 (priority 2) and 7 (priority 1), both for layer 1.
    #   0 -> 1.5     prefetch 6 (the higher priority) goes on the wire; 7 waits
    #   1.25         router of layer 0: key 0 misses, a demand load
    #   1.5 -> 3.0   demand 0: the prefetch on the wire completed first, the demand jumped over 7
    #   3.0 -> 4.5   prefetch 7
    #   layer 0 stalls 1.25 -> 3.0 = 1.75; expert 0 3.0 -> 5.0; layer 1: attention -> 6, router -> 6.25,
    #   key 6 hits; expert -> 8.25; LM head -> 8.75 = TTFT. Key 7 was never needed: wasted.
    trace = hand_trace([[[0], [2]]], layers=2)
    plan = Proposing(spec_of(trace), {("start", 0): [(6, 2.0), (7, 1.0)]})
    result = simulate_timed(trace, profile(), "lru", 3 * E, prefetcher=plan)
    assert transfers(result) == [("host->gpu", "prefetch", 6, 0.0, 1.5), ("host->gpu", "demand", 0, 1.5, 3.0),
                                 ("host->gpu", "prefetch", 7, 3.0, 4.5)]
    assert result.per_layer_stall_seconds == pytest.approx([1.75, 0.0])
    assert result.ttft_seconds == pytest.approx(8.75)
    assert (result.prefetches_issued, result.prefetches_used, result.prefetches_wasted) == (2, 1, 1)
    assert result.prefetch_precision == 0.5 and result.prefetch_recall == 0.5  # used 1 of 1 + 1 on-demand


@pytest.mark.parametrize("with_next_token", [True, False])
def test_moepic_prefetches_layer_0_of_the_next_token_after_the_last_layer_by_hand(with_next_token):
    # Paper 004 follows AdapMoE: layer 0 of token t+1 is predicted from token t's last layer. Two layers of 4
    # experts, top-1, an LRU cache of 2 experts; token 0 routes (0, 0), token 1 routes (1, 1); layer 1 is
    # predicted right, and token 0's last layer predicts expert 1 for layer 0 of token 1. One prefetch a layer.
    #   token 0: router 1.25: key 0 on demand 1.25 -> 2.75, computes -> 4.75; key 4 (layer 1) prefetched
    #            2.75 -> 4.25; layer 1 router 6.0: a hit; then key 1 (layer 0 of the next pass) 6.0 -> 7.5,
    #            evicting key 0; layer 1 computes -> 8.0, LM head -> 8.5                        TTFT 8.5
    #   token 1: router 9.75: key 1 is resident, a hit, computes -> 11.75; key 5 prefetched 9.75 -> 11.25
    #            (evicting 4); layer 1 router 13.0: a hit, computes -> 15.0, LM head -> 15.5      TPOT 7.0
    # Without the prediction of layer 0, key 1 loads on demand 9.75 -> 11.25 and key 5 waits behind it
    # (11.25 -> 12.75): token 1 computes layer 0 11.25 -> 13.25, layer 1 14.5 -> 16.5, LM head -> 17.0.
    L, J = 2, 4
    gate = np.zeros((2, L - 1, J))
    gate[0, 0, 0] = gate[1, 0, 1] = 1.0
    next_token = np.array([[0.1, 0.6, 0.2, 0.1], [0.25] * 4]) if with_next_token else None
    meta = TraceMeta(model="hand", num_layers=L, num_experts=J, top_k=1, expert_bytes=E)
    trace = Trace.build(meta, np.array([[[0], [0]], [[1], [1]]]), gate_prediction=gate,
                        next_token_gate_prediction=next_token)
    result = simulate_timed(trace, profile(), "lru", 2 * E, prefetcher="moepic",
                            prefetcher_options={"prefetches": 1})
    assert result.ttft_seconds == pytest.approx(8.5)
    if with_next_token:
        assert result.tpot_seconds == pytest.approx(7.0)
        # token 1's last layer predicts a token the trace never feeds: that prefetch (13.0 -> 14.5) is wasted
        assert (result.hits, result.on_demand_loads, result.prefetches_issued, result.prefetches_used) == (3, 1, 4, 3)
    else:
        assert result.tpot_seconds == pytest.approx(8.5)
        assert (result.hits, result.on_demand_loads, result.prefetches_issued, result.prefetches_used) == (2, 2, 2, 2)


def test_pinned_experts_are_never_evicted_by_a_prefetch():
    # Two layers, top-2, a cache of two experts. Layer 0 needs 0 and 1 (cold), layer 1 needs keys 4 and 5;
    # after layer 0 is routed the prefetcher proposes key 4.
    #   1.25 -> 2.75  demand 0; 2.75 -> 4.25 demand 1 (the prefetch waits: a demand load is waiting)
    #   expert 0 runs 2.75 -> 4.75 (layer 0 stalled 1.25 -> 2.75)
    #   4.25          the link is free but the cache holds 0 (running) and 1 (not run yet): both pinned, so
    #                 the prefetch of 4 must wait; an unpinned cache would have evicted one of them
    #   4.75 -> 6.25  prefetch 4, evicting 0 once it has run; expert 1 runs 4.75 -> 6.75, no stall
    #   layer 1: attention -> 7.75, router -> 8.0: 4 hits, 5 misses: demand 8.0 -> 9.5 (evicts 1);
    #   expert 4 runs 8.0 -> 10.0, expert 5 10.0 -> 12.0, LM head -> 12.5 = TTFT
    trace = hand_trace([[[0, 1], [0, 1]]], layers=2)
    plan = Proposing(spec_of(trace), {("routed", 0, 0): [(4, 1.0)]})
    result = simulate_timed(trace, profile(), "lru", 2 * E, prefetcher=plan)
    assert transfers(result) == [("host->gpu", "demand", 0, 1.25, 2.75), ("host->gpu", "demand", 1, 2.75, 4.25),
                                 ("host->gpu", "prefetch", 4, 4.75, 6.25), ("host->gpu", "demand", 5, 8.0, 9.5)]
    assert result.per_layer_stall_seconds == pytest.approx([1.5, 0.0])
    assert result.ttft_seconds == pytest.approx(12.5)
    assert (result.on_demand_loads, result.prefetches_issued, result.prefetches_used) == (3, 1, 1)


class MostRecentlyUsed(LRU):
    """Evicts the most recent expert that is not pinned: without pinning it would evict exactly the experts a
    layer has just been routed to."""

    name = "test-mru"

    def victim(self, ctx):
        for key in reversed(self._order):
            if key not in ctx.pinned:
                return key
        return super().victim(ctx)


def test_no_pinned_expert_is_lost_under_an_adversarial_policy_and_prefetcher(monkeypatch):
    # MRU evicts what was just requested; a prefetcher proposing every later expert keeps the link busy. If a
    # routed expert were not pinned, a prefetch would evict it before it ran and the layer would wait forever
    # (the simulator raises); every layer must instead compute each of its experts once.
    monkeypatch.setitem(POLICIES, "test-mru", PolicyInfo("test-mru", MostRecentlyUsed))

    class Everything(Prefetcher):
        name, summary, source = "test-everything", "every expert of every later layer", "tests"

        def _all(self, view):
            J = self.spec.num_experts
            return [(key, 1.0 / (1 + key)) for key in range((view.layer_now + 1) * J, self.spec.num_layers * J)]

        on_iteration_start = on_layer_routed = _all

    trace = zipf_trace(num_layers=4, num_experts=8, top_k=2, length=40, a=0.8, b=1.0, seed=5, shuffle=True)
    trace.meta = dataclasses.replace(trace.meta, expert_bytes=E)
    for size in (2, 3, 5):
        result = simulate_timed(trace, profile(), "test-mru", size * E, prefetcher=Everything(spec_of(trace)))
        assert result.accesses == 40 * 4 * 2
        computed = [e for e in result.timeline["events"] if e["kind"] == "expert"]
        assert sorted(e["expert"] for e in computed) == sorted(
            layer_needs(trace.experts, np.array([result.timeline["iteration"]]), layer, 8)[0][rank]
            for layer in range(4) for rank in range(2))


def test_a_miss_is_served_from_host_memory_or_from_ssd_through_it_by_hand():
    # Three tiers: gpu (1 expert), host (2 experts, a cache), ssd (everything). ssd -> host: 0.5 s + 100 B at
    # 50 B/s = 2.5 s; host -> gpu 1.5 s. Tokens need experts 0, 1, 0.
    #   token 0: router ends 1.25; 0 comes from ssd: 1.25 -> 3.75 -> 5.25 (stall 4.0); expert -> 7.25;
    #            LM head -> 7.75 = TTFT
    #   token 1: router ends 9.0; 1 from ssd: 9.0 -> 11.5 -> 13.0 (stall 4.0); expert -> 15; LM head -> 15.5
    #   token 2: router ends 16.75; 0 is still in host memory: 16.75 -> 18.25 (stall 1.5); expert -> 20.25;
    #            LM head -> 20.75                                    TPOT = (20.75 - 7.75) / 2 = 6.5
    trace = hand_trace([[[0]], [[1]], [[0]]], layers=1)
    hardware = profile(host=2 * E, ssd=10**12)
    result = simulate_timed(trace, hardware, "lru", 1 * E)
    assert result.ttft_seconds == pytest.approx(7.75)
    assert result.tpot_seconds == pytest.approx(6.5)
    assert result.stall_seconds == pytest.approx(9.5)
    assert result.bytes_per_link == {"host->gpu": 3 * E, "ssd->host": 2 * E}
    assert any("live in ssd" in note for note in result.notes)


def test_hops_of_different_experts_overlap_on_the_ssd_host_gpu_pipeline():
    # One layer, top-2, both experts on ssd only. FIFO demand loads, one queue per link:
    #   ssd->host 0: 1.25 -> 3.75, then host->gpu 0: 3.75 -> 5.25 while ssd->host 1: 3.75 -> 6.25,
    #   host->gpu 1: 6.25 -> 7.75. Expert 0 runs 5.25 -> 7.25 (stall 1.25 -> 5.25), expert 1 waits until
    #   7.75 (stall 0.5) and runs -> 9.75; LM head -> 10.25 = TTFT.
    trace = hand_trace([[[0, 1]]], layers=1)
    result = simulate_timed(trace, profile(gpu=2 * E, host=2 * E, ssd=10**12), "lru", 2 * E)
    assert transfers(result) == [("ssd->host", "demand", 0, 1.25, 3.75), ("host->gpu", "demand", 0, 3.75, 5.25),
                                 ("ssd->host", "demand", 1, 3.75, 6.25), ("host->gpu", "demand", 1, 6.25, 7.75)]
    assert result.stall_seconds == pytest.approx(4.5)
    assert result.ttft_seconds == pytest.approx(10.25)


def test_a_prefill_routes_the_union_of_its_tokens_with_per_expert_token_counts():
    # One prefill iteration of 3 tokens selecting experts 0, 0, 1, everything resident, costs per token:
    # attention 1 + 0.1 * 3 = 1.3; expert 0 has 2 tokens: 1 + 0.5 * 2 = 2; expert 1: 1.5; LM head 0.5 + 0.1 * 3
    # = 0.8; router 0. TTFT = 1.3 + 2 + 1.5 + 0.8 = 5.6; two accesses (the union), not three.
    trace = hand_trace([[[0]], [[0]], [[1]]], layers=1, phase=[PREFILL] * 3, iteration=[0, 0, 0])
    hardware = profile(attention_per_token=0.1, router=0.0, expert=1.0, expert_per_token=0.5, lm_head_per_token=0.1)
    result = simulate_timed(trace, hardware, all_resident=True)
    assert result.ttft_seconds == pytest.approx(5.6)
    assert result.accesses == 2 and result.tpot_seconds is None


def test_serving_arrivals_with_continuous_batching_by_hand():
    # Request A: a prefill of 2 tokens (experts 0, 1), then one decode token (0). Request B: a prefill of one
    # token (2), then one decode token (3). Everything resident; attention 1 s, router 0, 1 s per expert, no
    # LM head: an iteration costs 1 + (distinct experts). A arrives at 0, B at 2.5.
    #   0 -> 3   A's prefill {0, 1}                          TTFT A = 3
    #   3 -> 6   A's decode {0} with B's prefill {2}         TTFT B = 6 - 2.5 = 3.5; TPOT A = 3
    #   6 -> 8   B's decode {3}                              TPOT B = 2
    # One request at a time (max batch 1): A's decode 3 -> 5, B's prefill 5 -> 7 (TTFT 4.5), decode 7 -> 9.
    # The trace's own order runs its four iterations back to back: 0 -> 3, -> 5, -> 7 (B arrives at 5), -> 9.
    trace = hand_trace([[[0]], [[1]], [[0]], [[2]], [[3]]], layers=1, request=[0, 0, 0, 1, 1],
                       phase=[PREFILL, PREFILL, DECODE, PREFILL, DECODE], iteration=[0, 0, 1, 2, 3])
    hardware = profile(router=0.0, expert=1.0, lm_head=0.0)
    batched = simulate_timed(trace, hardware, all_resident=True, arrivals=Arrivals("times", times=(0.0, 2.5)))
    assert batched.request_ttft_seconds == pytest.approx([3.0, 3.5])
    assert batched.request_tpot_seconds == pytest.approx([3.0, 2.0])
    assert batched.total_seconds == pytest.approx(8.0)
    one_at_a_time = simulate_timed(trace, hardware, all_resident=True,
                                   arrivals=Arrivals("times", times=(0.0, 2.5), max_batch=1))
    assert one_at_a_time.request_ttft_seconds == pytest.approx([3.0, 4.5])
    assert one_at_a_time.request_tpot_seconds == pytest.approx([2.0, 2.0])
    recorded = simulate_timed(trace, hardware, all_resident=True)
    assert recorded.request_ttft_seconds == pytest.approx([3.0, 2.0])
    assert recorded.total_seconds == pytest.approx(9.0)
    assert recorded.ttft_percentiles == pytest.approx({"p50": 2.5, "p90": 2.9, "p99": 2.99})


def test_poisson_arrivals_are_seeded_exponential_gaps():
    arrivals = Arrivals.parse("poisson:4", max_batch=2, seed=7)
    expected = np.cumsum(np.random.default_rng(7).exponential(0.25, 3))
    assert arrivals.arrival_times(3) == pytest.approx(expected)
    trace = zipf_trace(num_layers=2, num_experts=4, top_k=1, length=30, a=1.0, b=1.0, seed=0)
    trace.request = np.repeat(np.arange(3, dtype=np.int32), 10)
    trace.meta = dataclasses.replace(trace.meta, expert_bytes=E)
    first = simulate_timed(trace, profile(), "lru", 2 * E, arrivals=arrivals)
    again = simulate_timed(trace, profile(), "lru", 2 * E, arrivals=arrivals)
    assert first.request_ttft_seconds == again.request_ttft_seconds and len(first.request_ttft_seconds) == 3
    with pytest.raises(ConfigError, match="offline"):
        simulate_timed(trace, profile(), "belady", 2 * E, arrivals=arrivals)
    for bad in ("poisson:fast", "poisson:-1", "uniform", "times:1,0"):
        with pytest.raises(ConfigError):
            Arrivals.parse(bad)


def test_search_time_on_the_inference_path_delays_compute_and_off_it_delays_proposals():
    # The token of the one-layer trace needs expert 0; the prefetcher proposes it before the iteration after a
    # search of 1.5 s.
    #   on the inference path (MoE-Infinity): search 0 -> 1.5, prefetch 1.5 -> 3.0; attention -> 2.5,
    #     router -> 2.75, a late prefetch: stall -> 3.0; expert -> 5.0; LM head -> 5.5 = TTFT
    #   off it (fMoE's asynchronous matcher): the router ends at 1.25 and 0 is a demand load, 1.25 -> 2.75;
    #     the proposal arrives at 1.5, for a layer already routed, and is ignored; expert 2.75 -> 4.75;
    #     LM head -> 5.25 = TTFT
    class Searching(TimedSearch, Prefetcher):
        name, summary, source = "test-search", "searches 1.5 s before each iteration", "tests"

        def __init__(self, spec, on_path):
            super().__init__(spec)
            self.search_on_inference_path = on_path

        def on_iteration_start(self, view):
            self.last_search_seconds = 1.5
            return [(0, 1.0)]

        def on_layer_routed(self, view):
            self.last_search_seconds = 0.0
            return []

        def on_iteration_end(self, view):
            self.last_search_seconds = 0.0

    trace = hand_trace([[[0]]], layers=1)
    on_path = simulate_timed(trace, profile(), "lru", E, prefetcher=Searching(spec_of(trace), True))
    assert on_path.ttft_seconds == pytest.approx(5.5)
    assert (on_path.prefetches_used, on_path.on_demand_loads, on_path.prefetch_search_seconds) == (1, 0, 1.5)
    off_path = simulate_timed(trace, profile(), "lru", E, prefetcher=Searching(spec_of(trace), False))
    assert off_path.ttft_seconds == pytest.approx(5.25)
    assert (off_path.prefetches_issued, off_path.on_demand_loads) == (0, 1)
    assert [e["lane"] for e in off_path.timeline["events"] if e["kind"] == "search"] == ["matcher"]


# ------------------------------------------------------------------------------------------ agreement with the replay


def multi_request(trace: Trace, requests: int) -> Trace:
    trace.request = np.repeat(np.arange(requests, dtype=np.int32), trace.num_tokens // requests)
    trace.meta = dataclasses.replace(trace.meta, expert_bytes=E)
    return trace


@pytest.mark.parametrize("policy", sorted(default_policies()))
def test_zero_compute_and_no_prefetch_miss_exactly_like_the_replay(policy):
    # Top-1 routing, one token per iteration: the timed access order (iteration, layer, expert) is the replay's
    # (token, rank, layer). With zero compute the cache sees the same requests in the same order, so every
    # policy, offline ones included, makes the same misses at every size.
    trace = multi_request(zipf_trace(num_layers=4, num_experts=8, top_k=1, length=120, a=1.0, b=1.0, seed=11,
                                     shuffle=True), requests=3)
    zero = profile(attention=0.0, router=0.0, expert=0.0, lm_head=0.0)
    data = ReplayInput.of(trace)
    for size in (4, 7, 13):
        timed = simulate_timed(trace, zero, policy, size * E)
        replayed = replay(data, policy, size)
        assert (timed.hits, timed.misses, timed.on_demand_loads) == (replayed.hits, replayed.misses, replayed.misses)
        assert (timed.bypassed, timed.per_layer_hits) == (replayed.bypassed, replayed.per_layer_hits)


@pytest.mark.parametrize("policy", sorted(name for name in default_policies() if not POLICIES[name].policy.static))
def test_infinite_bandwidth_and_zero_latency_cost_nothing(policy):
    # (a static placement computes its misses on the host, whose time free links do not remove)
    # Top-2, prefill and decode iterations of three requests, with and without a prefetcher, one tier or
    # host memory as a cache of ssd: every transfer takes no time, so no policy ever stalls and the latency
    # is that of the all-resident run.
    trace = multi_request(zipf_trace(num_layers=3, num_experts=8, top_k=2, length=60, a=0.9, b=1.0, seed=2,
                                     shuffle=True), requests=3)
    trace.phase = np.where(np.arange(60) % 20 < 4, PREFILL, DECODE).astype(np.uint8)
    trace.iteration = np.array([(i // 20) * 17 + max(i % 20 - 3, 0) for i in range(60)], dtype=np.int32)
    free = dict(bandwidth=math.inf, latency=0.0)
    bound = simulate_timed(trace, profile(**free), all_resident=True)
    for hardware, prefetcher in ((profile(**free), None), (profile(**free), "oracle"),
                                 (profile(**free, host=5 * E, ssd=10**12, ssd_bandwidth=math.inf, ssd_latency=0.0),
                                  NextLayerTruth(spec_of(trace)))):
        result = simulate_timed(trace, hardware, policy, 6 * E, prefetcher=prefetcher)
        assert result.stall_seconds == 0.0
        assert result.misses > 0
        assert result.request_ttft_seconds == pytest.approx(bound.request_ttft_seconds)
        assert result.request_tpot_seconds == pytest.approx(bound.request_tpot_seconds)


def test_the_access_order_and_context_the_policy_sees(monkeypatch):
    # A prefill of two tokens then one decode token; the policy records every access. Order: iteration by
    # iteration, layer by layer, a layer's experts in order of first appearance over the tokens (row order,
    # then rank); clock counts accesses; token and iteration count forward passes.
    seen = []

    class Spy(LRU):
        name = "test-spy"

        def on_access(self, key, ctx):
            seen.append((ctx.clock, ctx.iteration, ctx.token, ctx.layer, key, ctx.request, sorted(ctx.pinned)))
            super().on_access(key, ctx)

    monkeypatch.setitem(POLICIES, "test-spy", PolicyInfo("test-spy", Spy))
    trace = hand_trace([[[2, 1], [0, 3]], [[1, 0], [3, 2]], [[3, 2], [1, 0]]], layers=2, request=[4, 4, 4],
                       phase=[PREFILL, PREFILL, DECODE], iteration=[0, 0, 1])
    simulate_timed(trace, profile(), "test-spy", 8 * E)
    assert [(clock, it, token, layer, key) for clock, it, token, layer, key, *_ in seen] == [
        (0, 0, 0, 0, 2), (1, 0, 0, 0, 1), (2, 0, 0, 0, 0),              # layer 0 of the prefill: 2, 1, then 0
        (3, 0, 0, 1, 4), (4, 0, 0, 1, 7), (5, 0, 0, 1, 6),              # layer 1: 0, 3, 2 (keys 4 + expert)
        (6, 1, 1, 0, 3), (7, 1, 1, 0, 2), (8, 1, 1, 1, 5), (9, 1, 1, 1, 4)]
    assert {request for *_, request, _ in seen} == {4}
    assert seen[0][-1] == [0, 1, 2]  # the routed layer's experts are pinned while the policy is asked


def test_llru_counts_the_replays_rounds_in_the_timed_simulator(monkeypatch):
    # LLRU's R = floor((t - tau) / L) must count rounds (K requests per layer per token, batching included) as
    # the replay does. The clock the policy sees for each timed access, round * L + layer, is the replay's
    # clock (trace/flatten.py) of the first request of that key among the pass's tokens.
    from llru_clocks import first_request_clocks, spy_on_llru

    seen = spy_on_llru(monkeypatch)
    # a prefill of two tokens of request 0 (experts merge: 1 in layer 0), then a batch of requests 0 and 1
    trace = hand_trace([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[3, 2], [1, 0]], [[0, 2], [2, 1]]], layers=2,
                       request=[0, 0, 0, 1], phase=[PREFILL, PREFILL, DECODE, DECODE], iteration=[0, 0, 1, 1])
    simulate_timed(trace, profile(), "test-llru", 16 * E)
    expected = first_request_clocks(trace, enumerate([[0, 1], [2, 3]]))
    assert sorted(seen) == sorted(expected)
    # by hand for the prefill's layer 0: token 0's experts 0, 1 at clocks 0 and 2 (rounds 0, 1), token 1's
    # expert 2 at clock 6 (round 3); expert 1 of token 1 (clock 4) merged into the first request of 1
    assert [entry for entry in seen if entry[0] == 0 and entry[1] < 4] == [(0, 0, 0), (0, 1, 2), (0, 2, 6)]


def test_llru_evicts_in_the_timed_simulator_what_the_replay_evicts():
    # One top-2 token per pass, 2 layers, 6 slots, no prefetcher: the timed LLRU evicts what the replay's does.
    # Counting accesses / L instead (the clock of the timed access order) evicts 3, 1, 5, ...: one more.
    from policy_driver import drive

    from moe_offload.policies.llru import LLRU
    from moe_offload.trace.flatten import flatten

    experts = [[[3, 2], [3, 1]], [[0, 1], [1, 3]], [[2, 0], [0, 2]], [[2, 1], [2, 1]], [[1, 0], [1, 0]],
               [[1, 2], [1, 3]], [[3, 1], [0, 3]], [[2, 1], [2, 0]]]
    trace = hand_trace(experts, layers=2, request=[0] * 8, phase=[DECODE] * 8, iteration=list(range(8)))
    victims = []

    class Recording(LLRU):
        name = "test-llru"

        def victim(self, ctx):
            victims.append(super().victim(ctx))
            return victims[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(POLICIES, "test-llru", PolicyInfo("test-llru", Recording))
        simulate_timed(trace, profile(), "test-llru", 6 * E)
    flat = flatten(trace)
    _, evicted = drive("llru", list(zip(flat.layer.tolist(), (flat.expert_id % 4).tolist())), 6, spec_of(trace))
    assert victims == [key for keys in evicted for key in keys] == [3, 5, 7, 6, 0, 5]


def test_each_access_carries_its_tokens_by_request(monkeypatch):
    # A batch of two requests (rows 0, 1 of request 7; row 2 of request 9) in one iteration, top-2, one layer:
    # expert 1 serves two tokens of 7 and one of 9, expert 0 two tokens of 7, expert 3 one of 9.
    seen = {}

    class Spy(LRU):
        name = "test-spy"

        def on_access(self, key, ctx):
            seen[key] = dict(ctx.routed)
            super().on_access(key, ctx)

    monkeypatch.setitem(POLICIES, "test-spy", PolicyInfo("test-spy", Spy))
    trace = hand_trace([[[1, 0]], [[0, 1]], [[3, 1]]], layers=1, request=[7, 7, 9], phase=[PREFILL] * 3,
                       iteration=[0, 0, 0])
    simulate_timed(trace, profile(), "test-spy", 4 * E)
    assert seen == {1: {7: 2, 9: 1}, 0: {7: 2}, 3: {9: 1}}


# ------------------------------------------------------------------------------------------ configuration and CLI


def test_sizes_the_hardware_and_the_trace_must_allow():
    trace = hand_trace([[[0]]], layers=1)
    with pytest.raises(ConfigError, match="does not fit"):
        simulate_timed(trace, profile(gpu=2 * E), "lru", 3 * E)
    with pytest.raises(ConfigError, match="cannot hold one expert"):
        simulate_timed(trace, profile(), "lru", E // 2)
    with pytest.raises(ConfigError, match="no tier after gpu holds all"):
        simulate_timed(trace, profile(host=E), "lru", E)
    with pytest.raises(ConfigError, match="expert size"):
        simulate_timed(zipf_trace(1, 4, 1, 3, a=1.0, b=1.0, seed=0), profile(), "lru", E)


def test_the_grid_adds_the_all_resident_run_and_the_oracle_and_jobs_do_not_change_results():
    trace = multi_request(zipf_trace(num_layers=3, num_experts=8, top_k=2, length=40, a=1.0, b=1.0, seed=4),
                          requests=2)
    runs = dict(policies=["lru", "lfu"], prefetchers=[None, "topk"] if "topk" in PREFETCHERS else [None],
                cache_sizes=[4 * E, 8 * E])
    serial = timed_grid(trace, profile(), **runs)
    parallel = timed_grid(trace, profile(), **runs, jobs=2)
    assert [r.to_dict() for r in serial] == [r.to_dict() for r in parallel]
    assert serial[0].policy == "all-resident"
    assert {(r.policy, r.prefetcher, r.cache_bytes) for r in serial if r.prefetcher == "oracle"} == {
        (p, "oracle", s) for p in ("lru", "lfu") for s in (4 * E, 8 * E)}


@pytest.fixture
def small_trace_file(tmp_path):
    trace = multi_request(zipf_trace(num_layers=3, num_experts=8, top_k=2, length=40, a=1.0, b=1.0, seed=4),
                          requests=2)
    return str(write_trace(trace, tmp_path / "small.parquet"))


def test_simulate_timed_json_tables_and_plots(small_trace_file, tmp_path, capsys):
    out_json = tmp_path / "timed.json"
    cdf, timeline = tmp_path / "cdf.png", tmp_path / "timeline.png"
    assert main(["simulate", small_trace_file, "--timed", "--policy", "lru", "--cache-size", "8,1200B",
                 "--timed-json", str(out_json), "--plot-cdf", str(cdf), "--plot-timeline", str(timeline)]) == 0
    out = capsys.readouterr().out
    assert "TPOT / oracle" in out and "lru + oracle" in out and "all-resident" in out and "host->gpu moved" in out
    rows = json.loads(out_json.read_text())
    assert [(r["policy"], r["prefetcher"], r["cache_size"]) for r in rows] == [
        ("all-resident", None, 24), ("lru", None, 8), ("lru", None, 12), ("lru", "oracle", 8), ("lru", "oracle", 12)]
    for row in rows:
        assert {"ttft_seconds", "tpot_seconds", "ttft_percentiles", "tpot_percentiles", "stall_seconds",
                "per_layer_stall_seconds", "bytes_per_link", "on_demand_loads", "prefetch_precision",
                "prefetch_recall", "timeline"} <= set(row)
    assert cdf.stat().st_size > 10_000 and timeline.stat().st_size > 10_000
    assert main(["simulate", small_trace_file, "--timed", "--json", "--hardware", "edge-flashmoe"]) == 0
    assert {r["hardware"] for r in json.loads(capsys.readouterr().out)} == {"edge-flashmoe"}


def test_simulate_help_documents_the_timed_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["simulate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--timed" in out and "--hardware PRESET|FILE" in out and "(default 12.5%,25%,50%; with --timed 25%)" in out


def test_simulate_timed_refuses_what_cannot_run(small_trace_file, monkeypatch, capsys):
    class NeedsProbs(Prefetcher):
        name, summary, source = "test-probs", "needs the router's distributions", "tests"
        requires = ("probs",)

    monkeypatch.setitem(PREFETCHERS, "test-probs", NeedsProbs)
    cases = [(["--timed", "--prefetch", "test-probs"], "needs trace columns that .* lacks: column 'probs'"),
             (["--hardware", "edge-flashmoe"], "--hardware belongs to the timed simulation: add --timed"),
             (["--timed", "--plot", "x.png"], "--plot-cdf"),
             (["--timed", "--prefetch", "crystal-ball"], "unknown prefetcher 'crystal-ball'"),
             (["--timed", "--cache-size", "200GiB"], "does not fit"),
             (["--timed", "--policy", "belady", "--arrivals", "poisson:3"], "offline"),
             (["--timed", "--hardware", "laptop"], "unknown hardware preset")]
    for extra, message in cases:
        assert main(["simulate", small_trace_file, *extra]) == 2, extra
        assert re.search(message, capsys.readouterr().err), extra
