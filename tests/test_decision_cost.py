"""The eviction policy's own time (simulator/timed/decisions.py): where a decision's cost d comes from, timelines
worked out by hand with it, the profile's ``[decision_s]`` table, and the cache's timing of each decision.

The hardware is the one of tests/test_timed.py: one link host -> gpu of 100 B/s with 0.5 s latency (an expert of
100 B takes 1.5 s), attention 1 s, router 0.25 s, 2 s per expert, LM head 0.5 s; one layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile
from moe_offload.policies import ModelSpec, make_policy
from moe_offload.policies.base import AccessContext
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.decisions import decision_seconds
from moe_offload.trace.format import Trace, TraceMeta

E = 100


def profile(decision_s: dict | None = None, host_flops: float | None = None, link_slowdown: float = 1.0
            ) -> HardwareProfile:
    data = {
        "name": "test",
        "tiers": [{"name": "gpu", "capacity_bytes": 10**9}, {"name": "host", "capacity_bytes": 10**12}],
        "links": [{"from": "host", "to": "gpu", "bandwidth_bytes_per_s": 100.0, "latency_s": 0.5,
                   "slowdown_while_computing": link_slowdown}],
        "compute": {"attention": {"fixed_s": 1.0}, "router": {"fixed_s": 0.25}, "expert": {"fixed_s": 2.0},
                    "lm_head": {"fixed_s": 0.5}},
    }
    if host_flops is not None:
        data["host"] = {"flops_per_s": host_flops, "memory_bandwidth_bytes_per_s": 1e12}
    if decision_s is not None:
        data["decision_s"] = decision_s
    return HardwareProfile.from_dict(data)


def one_layer_trace(experts) -> Trace:
    experts = np.asarray(experts)
    meta = TraceMeta(model="hand", num_layers=1, num_experts=4, top_k=experts.shape[2], expert_bytes=E)
    return Trace.build(meta, experts)


def lanes(result, lane):
    return [(e["kind"], e["expert"], round(e["start_s"], 9), round(e["end_s"], 9))
            for e in result.timeline["events"] if e["lane"] == lane]


def test_one_miss_with_a_decision_cost_makes_its_layer_d_later_by_hand():
    # A cache of one expert; tokens need 0, 0, 1 (tests/test_timed.py works out the run without a cost: TTFT 5.25,
    # TPOT 4.5, total 14.25). Token 0's miss finds the cache empty: no decision. Token 2 starts at 9.0, its
    # router ends at 10.25, expert 1 misses and 0 must go: the decision runs 10.25 -> 10.65 (d = 0.4), the load
    # 10.65 -> 12.15, the expert -> 14.15, the LM head -> 14.65: the layer, and the token, are d later.
    trace = one_layer_trace([[[0]], [[0]], [[1]]])
    plain = simulate_timed(trace, profile(), "lru", 1 * E, timeline_iteration=2)
    result = simulate_timed(trace, profile({"lru": 0.4}), "lru", 1 * E, timeline_iteration=2)
    assert (plain.total_seconds, plain.policy_decisions, plain.policy_decision_seconds) == pytest.approx((14.25, 1, 0))
    assert result.total_seconds == pytest.approx(14.25 + 0.4)
    assert result.ttft_seconds == pytest.approx(5.25)
    assert result.tpot_seconds == pytest.approx((14.65 - 5.25) / 2)
    assert result.stall_seconds == pytest.approx(plain.stall_seconds + 0.4)
    assert (result.policy_decisions, result.policy_decision_seconds) == (1, pytest.approx(0.4))
    assert lanes(result, "policy") == [("decision", 1, 1.25, 1.65)]  # from the iteration's start, 9.0
    assert lanes(result, "host->gpu") == [("demand", 1, 1.65, 3.15)]
    assert "policy" in result.timeline["lanes"] and "policy" not in plain.timeline["lanes"]


def test_the_next_decision_of_a_layer_runs_while_the_previous_load_is_on_the_wire_by_hand():
    # Top-2, a cache of two experts; token 0 needs 0 and 1 (loaded into empty room: no decision), token 1 needs 2
    # and 3, each evicting one. Token 0 ends at 7.25 (1.25 router, loads 1.25 -> 2.75 -> 4.25, experts 2.75 ->
    # 4.75 -> 6.75, LM head). Token 1: router ends 8.5; decision for 2: 8.5 -> 8.9, its load 8.9 -> 10.4; the
    # decision for 3 runs 8.9 -> 9.3 while 2's bytes move, so 3 loads 10.4 -> 11.9 as soon as the link is free;
    # experts 10.4 -> 12.4 -> 14.4, LM head -> 14.9: d later in all, not 2d (paper 003: decisions overlap loads).
    trace = one_layer_trace([[[0, 1]], [[2, 3]]])
    result = simulate_timed(trace, profile({"lru": 0.4}), "lru", 2 * E, timeline_iteration=1)
    plain = simulate_timed(trace, profile(), "lru", 2 * E)
    assert plain.total_seconds == pytest.approx(14.5)
    assert result.total_seconds == pytest.approx(14.9)
    assert lanes(result, "policy") == [("decision", 2, 1.25, 1.65), ("decision", 3, 1.65, 2.05)]
    assert lanes(result, "host->gpu") == [("demand", 2, 1.65, 3.15), ("demand", 3, 3.15, 4.65)]
    assert (result.policy_decisions, result.policy_decision_seconds) == (2, pytest.approx(0.8))


def test_decision_cost_from_the_profile_or_the_policys_flops_rule():
    spec = ModelSpec(1, 4, 1)
    learned, lru = make_policy("learned", spec), make_policy("lru", spec)
    # the paper's network: 2 * (2*128 + 128*128 + 128*1) = 33,536 FLOPs per resident
    assert learned.decision_flops(5) == 5 * 33_536 and lru.decision_flops(5) == 0
    # the rule: 5 residents at a host of 10 * 33,536 FLOP/s take 0.5 s; LRU's bookkeeping 0
    assert decision_seconds(profile(host_flops=10 * 33_536), "learned", learned, 5) == pytest.approx(0.5)
    assert decision_seconds(profile(host_flops=10 * 33_536), "lru", lru, 5) == 0.0
    # a measured entry wins over the rule, for any policy
    measured = profile({"learned": 1e-4, "lru": 2e-6}, host_flops=10 * 33_536)
    assert decision_seconds(measured, "learned", learned, 5) == 1e-4
    assert decision_seconds(measured, "lru", lru, 5) == 2e-6
    # no rate anywhere (linear costs only): the rule cannot apply
    assert decision_seconds(profile(), "learned", learned, 5) == 0.0


def test_the_edge_flashmoe_preset_carries_the_papers_measured_decision_time():
    from moe_offload.hardware import resolve_profile

    assert dict(resolve_profile("edge-flashmoe").decision_s) == {"learned": 158e-6}  # paper 003 section 3.1
    assert resolve_profile("desktop-rtx4090").decision_s == ()


@pytest.mark.parametrize("table, problem", [
    ({"nope": 1e-6}, "key 'decision_s.nope': no policy of that name"),
    ({"learned": -1.0}, "key 'decision_s.learned'"),
    ({"learned": "fast"}, "key 'decision_s.learned'"),
])
def test_a_bad_decision_s_table_names_the_key(table, problem):
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        profile(table)
    with pytest.raises(ConfigError, match="key 'decision_s': must be a table"):
        profile(1.0)


def test_the_cache_times_each_decision_only_when_asked():
    spec = ModelSpec(1, 4, 1)
    cache = ExpertCache(2, make_policy("lru", spec))
    ctx = AccessContext()
    seen = []
    for clock, key in enumerate([0, 1, 2]):
        ctx.clock = ctx.token = clock
        cache.request(key, ctx)
    assert cache.evictions == 1 and not seen  # no callback: nothing timed
    cache.on_decision = seen.append
    for clock, key in enumerate([3, 0, 0], start=3):
        ctx.clock = ctx.token = clock
        cache.request(key, ctx)
    assert cache.evictions == 3 and len(seen) == 2 and all(0 <= s < 1 for s in seen)



def test_a_transfer_waiting_for_its_decision_is_slowed_only_once_its_bytes_move():
    # The link runs 2x slower while compute runs. Top-2, a cache of two; token 0 needs 0 and 1 (no eviction),
    # token 1 needs 0 (a hit) and 2 (a miss evicting 1). Token 0 is the same in both runs and ends at 7.75 (load
    # 0: 1.25 -> 2.75; load 1 from 2.75, slowed while expert 0 computes 2.75 -> 4.75, lands 5.25; expert 1 ->
    # 7.25; LM head). Token 1: router ends 9.0, expert 0 computes 9.0 -> 11.0.
    #   without a cost: 2's bytes from 9.0, slowed until 11.0 (1.0 s of its 1.5 s done), land 11.5; expert 2
    #                   -> 13.5, LM head -> 14.0
    #   d = 0.4:        the decision 9.0 -> 9.4, the bytes from 9.4, slowed until 11.0 (0.8 s done), land 11.7;
    #                   -> 14.2 (slowing the wait for the decision as well would land them at 11.9: 14.4)
    trace = one_layer_trace([[[0, 1]], [[0, 2]]])
    plain = simulate_timed(trace, profile(link_slowdown=2.0), "lru", 2 * E)
    result = simulate_timed(trace, profile({"lru": 0.4}, link_slowdown=2.0), "lru", 2 * E, timeline_iteration=1)
    assert plain.total_seconds == pytest.approx(14.0)
    assert result.total_seconds == pytest.approx(14.2)
    assert lanes(result, "host->gpu") == [("demand", 2, 1.65, 3.95)]  # from the iteration's start, 7.75
