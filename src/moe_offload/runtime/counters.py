"""What the runtime counts while it runs, and the RunResult record it becomes (the simulators' record)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_offload.results import RunResult


@dataclass
class Counters:
    accesses: int = 0
    hits: int = 0
    on_demand_loads: int = 0
    host_hits: int = 0  # demand loads and bypasses that found the expert in the host tier
    bypassed: int = 0   # misses the fast tier did not admit: computed on the host (models/host_experts.py)
    host_compute_seconds: float = 0.0  # the compute thread computing bypassed experts
    prefetches_issued: int = 0
    prefetches_used: int = 0
    prefetches_wasted: int = 0
    stall_seconds: float = 0.0
    per_layer_accesses: list = field(default_factory=list)
    per_layer_hits: list = field(default_factory=list)
    per_layer_stall_seconds: list = field(default_factory=list)
    per_layer_bypassed: list = field(default_factory=list)
    bytes_per_link: dict = field(default_factory=dict)
    link_busy_seconds: dict = field(default_factory=dict)  # link -> seconds a transfer was on it
    policy_decisions: int = 0              # the fast tier's evictions: each a victim call of the policy
    policy_decision_seconds: float = 0.0   # their time, measured around each call (simulator/cache.py)

    @classmethod
    def zero(cls, num_layers: int) -> "Counters":
        return cls(per_layer_accesses=[0] * num_layers, per_layer_hits=[0] * num_layers,
                   per_layer_stall_seconds=[0.0] * num_layers, per_layer_bypassed=[0] * num_layers)

    def reset(self) -> None:
        """Zero every count in place (the data path and the runner keep a reference to this object)."""
        self.__dict__.update(Counters.zero(len(self.per_layer_accesses)).__dict__)

    def copy(self) -> "Counters":
        return Counters(**{k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                           for k, v in self.__dict__.items()})

    def minus(self, before: "Counters") -> "Counters":
        out = self.copy()
        for name, value in self.__dict__.items():
            old = getattr(before, name)
            if isinstance(value, list):
                setattr(out, name, [a - b for a, b in zip(value, old)])
            elif isinstance(value, dict):
                setattr(out, name, {k: v - old.get(k, 0) for k, v in value.items()})
            else:
                setattr(out, name, value - old)
        return out

    def count_access(self, layer: int, hit: bool, demand: bool, prefetch_used: bool, from_host: bool,
                     bypassed: bool = False) -> None:
        """One expert access of one request (the runner's per-request counters)."""
        self.host_hits += from_host
        self.accesses += 1
        self.per_layer_accesses[layer] += 1
        if hit:
            self.hits += 1
            self.per_layer_hits[layer] += 1
        elif bypassed:
            self.bypassed += 1
            self.per_layer_bypassed[layer] += 1
        elif demand:
            self.on_demand_loads += 1
        if prefetch_used:
            self.prefetches_used += 1

    def stalled(self, layer: int, seconds: float) -> None:
        """The compute thread waited ``seconds`` for layer ``layer``'s experts."""
        self.stall_seconds += seconds
        self.per_layer_stall_seconds[layer] += seconds

    def moved(self, link: str, nbytes: int, seconds: float) -> None:
        self.bytes_per_link[link] = self.bytes_per_link.get(link, 0) + nbytes
        self.link_busy_seconds[link] = self.link_busy_seconds.get(link, 0.0) + seconds

    def decided(self, seconds: float) -> None:
        """The policy chose a victim in ``seconds`` (ExpertCache.on_decision; called under the data path's lock)."""
        self.policy_decisions += 1
        self.policy_decision_seconds += seconds


def run_result(engine, c: Counters, ttft=None, tpot=None, total=None) -> RunResult:
    """The RunResult of counts ``c`` of ``engine`` (runtime/engine.py): the same record the simulators fill,
    with the engine's Plan as its configuration (a request's own counts for the batching scheduler's results)."""
    prefetching = engine.prefetcher is not None
    places, split, fast = engine.places, engine.split, engine.tiers[0]
    has_host = len(engine.tiers) > 1
    plan = engine.plan
    return RunResult(
        trace=f"runtime:{engine.manifest.directory.name}", policy=plan.policy,
        cache_size=sum(split.cached_experts) if split else fast.pool.slots,
        accesses=c.accesses,
        hits=c.hits, misses=c.accesses - c.hits - c.bypassed, per_layer_accesses=list(c.per_layer_accesses),
        bypassed=c.bypassed if places else None,
        per_layer_bypassed=list(c.per_layer_bypassed) if places else None,
        host_compute_seconds=c.host_compute_seconds if places else None, admission=plan.admission,
        per_layer_hits=list(c.per_layer_hits), prefetches_issued=c.prefetches_issued if prefetching else None,
        prefetches_used=c.prefetches_used if prefetching else None,
        prefetches_wasted=c.prefetches_wasted if prefetching else None, stall_seconds=c.stall_seconds,
        per_layer_stall_seconds=list(c.per_layer_stall_seconds), ttft_seconds=ttft, tpot_seconds=tpot,
        total_seconds=total, prefetcher=plan.prefetch, hardware=f"runtime ({engine.device.type})",
        cache_bytes=split.memory_bytes if split else fast.cache.capacity,
        on_demand_loads=c.on_demand_loads,
        policy_decisions=c.policy_decisions, policy_decision_seconds=c.policy_decision_seconds,
        bytes_per_link=dict(c.bytes_per_link),
        tier_requests={"fast": c.accesses, **({"host": c.on_demand_loads + c.bypassed} if has_host else {})},
        tier_hits={"fast": c.hits, **({"host": c.host_hits} if has_host else {})},
        bytes_loaded=sum(v for k, v in c.bytes_per_link.items() if k.endswith("->fast")),
        configuration=plan.describe())
