"""The eviction policy's own time in the timed simulator: what each decision costs, and when a load waits for it.

A decision is one ``victim`` call (one eviction, simulator/cache.py). Its cost d, per tier, is

* the hardware profile's ``[decision_s]`` entry for the tier's policy, a measured time per decision (the
  edge-flashmoe preset carries paper 003's own: "On average, the FFN consumes 158 us per operation", section
  3.1; the runtime measures its policy's, RunResult.policy_decision_seconds / policy_decisions);
* else the policy's FLOPs rule, EvictionPolicy.decision_flops(residents) at the rate of the processor that runs
  it: the host CPU's roofline ``flops_per_s`` (``[host]``), or the GPU's when the profile gives the host none. The
  residents are the tier's capacity in experts, since a tier decides when it is full. The bookkeeping policies
  (LRU, LFU, ...) count 0 FLOPs; ``learned`` counts every resident through its network (Algorithm 1 scores the
  cache, then takes MaxDist): 512 residents x 33,536 FLOPs = 17.2 MFLOP, 8.3 us at the edge-flashmoe CPU's
  2.07 TFLOP/s. A FLOPs rule leaves out the framework's overhead per call, which is why the paper's measured
  158 us is 19 times that: give a measured d where one is known.

Where it sits (paper 003, Algorithm 1 and section 3.1). A miss's eviction precedes its load (``cache.evict``,
then ``cache.load``), and FlashMoE runs the policy asynchronously, overlapping it with expert loading. So each
tier has one policy thread running its decisions one after another: the decisions a load needs start once the
load is known (its layer routed, or its prefetch proposed) and the thread is free, and its bytes go on the wire
when its link is free and its decisions are made (the link waits for them, holding the load's place). One miss
into a full cache makes its layer d later; the next miss of the same layer is decided while the first one's bytes
move, so with d below a transfer's time only the first decision of a layer shows. With d = 0 (the default for
every policy without a FLOPs rule or a measured entry) runs are unchanged.
"""

from __future__ import annotations

from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import ModelSpec, policy_factory
from moe_offload.policies.base import EvictionPolicy


def decision_seconds(hardware: HardwareProfile, policy_name: str, policy: EvictionPolicy, residents: int) -> float:
    """d: the time of one decision of ``policy`` (named ``policy_name``) among ``residents`` experts on
    ``hardware`` (module doc)."""
    measured = dict(hardware.decision_s).get(policy_name)
    if measured is not None:
        return measured
    flops = policy.decision_flops(residents)
    if not flops:
        return 0.0
    host = hardware.host.roofline if hardware.host is not None else None
    roofline = host if host is not None else hardware.compute.roofline
    return flops / roofline.flops_per_s if roofline is not None else 0.0


class PolicyDecisions:
    """Each tier's policy thread: ``seconds[tier]`` per decision, the time it is next free, and the totals."""

    def __init__(self, seconds: list[float], events: list):
        self.seconds = seconds
        self.free = [0.0] * len(seconds)
        self.events = events  # the run's (lane, kind, start, end, layer, key) records
        self.count = 0        # decisions made, in every tier
        self.total = 0.0      # seconds they took

    def decide(self, tier: int, decisions: int, known_at: float, now: float, layer: int, key: int) -> float:
        """A load of ``key`` into ``tier``, known since ``known_at``, reserved its room at ``now`` with
        ``decisions`` evictions: when its bytes may start."""
        if not decisions:
            return now
        self.count += decisions
        cost = decisions * self.seconds[tier]
        if not cost:
            return now
        start = max(self.free[tier], known_at)
        self.free[tier] = end = start + cost
        self.total += cost
        self.events.append(("policy", "decision", start, end, layer, key))
        return max(now, end)


def tier_decisions(hardware: HardwareProfile, spec: ModelSpec, policy_name: str, make_policy, static: bool,
                   capacities: list[int], expert_bytes: int, events: list) -> PolicyDecisions:
    """The policy threads of a run's tiers of ``capacities`` bytes, the GPU first: each tier runs the run's
    policy (``make_policy`` builds one), except the middle tiers under a static placement, which keep LRU."""
    seconds = []
    for tier, capacity in enumerate(capacities):
        name = "lru" if tier and static else policy_name
        policy = policy_factory(name, spec)() if name != policy_name else make_policy()
        seconds.append(decision_seconds(hardware, name, policy, capacity // expert_bytes))
    return PolicyDecisions(seconds, events)
