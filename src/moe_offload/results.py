"""The one result record every simulator and the runtime fill; tables, JSON and plots read only this."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunResult:
    """Outcome of one run (one policy at one cache size on one trace).

    Counts are of expert requests: hits + misses + bypassed = accesses. A miss is loaded into the fast tier; a
    bypassed request is served (computed) in the tier that holds the expert, without loading it
    (simulator/cache.py: Admission); ``bypassed`` is None for a driver without admission. Fields a driver
    cannot measure stay None (the replay simulator has no clock, so no stall time or latency). The timed
    simulator (moe_offload.simulator.timed) fills the rest: its hits are experts resident in the fast tier
    when the router asks for them, its misses the others, of which ``on_demand_loads`` needed a demand
    transfer (the rest were already on the wire as a prefetch); prefetches issued are prefetch transfers into
    the GPU, used when requested before being evicted.
    Latencies are in seconds; percentiles are over requests."""

    trace: str
    policy: str
    cache_size: int                 # in experts
    accesses: int
    hits: int
    misses: int
    per_layer_accesses: list[int] = field(default_factory=list)
    per_layer_hits: list[int] = field(default_factory=list)
    bypassed: int | None = None                # misses served where the expert lives, not loaded
    per_layer_bypassed: list[int] | None = None
    host_compute_seconds: float | None = None  # timed: the host's compute of the bypassed experts
    admission: str | None = None               # the driver's admission rule, if any ("fetch-or-compute")
    in_hindsight: bool = False                 # a placement chosen from the run's own trace: not online
    opt_misses: int | None = None   # Belady OPT on the same sequence and cache size
    bytes_loaded: int | None = None  # misses x expert size, when the trace gives the size
    prefetches_issued: int | None = None
    prefetches_used: int | None = None
    stall_seconds: float | None = None
    ttft_seconds: float | None = None   # mean over requests
    tpot_seconds: float | None = None   # mean over requests (of each request's mean time per output token)
    prefetcher: str | None = None
    hardware: str | None = None
    cache_bytes: int | None = None
    on_demand_loads: int | None = None
    prefetches_wasted: int | None = None     # issued and never requested before the run ended
    prefetch_search_seconds: float | None = None  # the prefetcher's history searches, on or off the inference path
    policy_decisions: int | None = None  # evictions the policy chose (timed: every tier's; runtime: the fast tier's)
    policy_decision_seconds: float | None = None  # their time: timed, charged (timed/decisions.py); runtime, measured
    per_layer_stall_seconds: list[float] | None = None
    bytes_per_link: dict[str, int] | None = None  # link name ("host->gpu") -> bytes put on the wire
    tier_requests: dict[str, int] | None = None  # runtime: tier -> expert accesses it served (host: fast misses)
    tier_hits: dict[str, int] | None = None      # runtime: tier -> of those, resident in the tier
    ttft_percentiles: dict[str, float] | None = None  # "p50", "p90", "p99"
    tpot_percentiles: dict[str, float] | None = None
    request_ttft_seconds: list[float] | None = None
    request_tpot_seconds: list[float] | None = None
    token_latency_seconds: list[float] | None = None  # every output token after each request's first: its gap
    total_seconds: float | None = None        # first arrival to last token
    timeline: dict | None = None              # one iteration's compute, transfers and stalls (simulator/timed)
    reconfigurations: list[dict] | None = None  # MoEpic's online configurator: what each reconfiguration chose
    configuration: dict | None = None  # the Plan the run was made from (plan/plan.py, Plan.describe)
    notes: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def fast_misses(self) -> int:
        """Requests the fast tier did not serve: the misses, loaded or bypassed (what OPT's misses compare to)."""
        return self.misses + (self.bypassed or 0)

    @property
    def misses_vs_opt(self) -> float | None:
        """(misses + bypassed) / OPT misses: 1.0 is optimal."""
        if self.opt_misses is None:
            return None
        missed = self.fast_misses
        return missed / self.opt_misses if self.opt_misses else (1.0 if missed == 0 else float("inf"))

    @property
    def per_layer_hit_rate(self) -> list[float]:
        return [h / a if a else 0.0 for h, a in zip(self.per_layer_hits, self.per_layer_accesses)]

    @property
    def prefetch_precision(self) -> float | None:
        """Prefetches used / prefetches issued."""
        if not self.prefetches_issued:
            return None
        return self.prefetches_used / self.prefetches_issued

    @property
    def prefetch_recall(self) -> float | None:
        """Of the loads the computation needed (prefetches used + on-demand loads), the share a prefetch
        delivered: paper 002's prefetch accuracy (Figure 10)."""
        if self.prefetches_used is None or self.on_demand_loads is None:
            return None
        needed = self.prefetches_used + self.on_demand_loads
        return self.prefetches_used / needed if needed else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["misses_vs_opt"] = self.misses_vs_opt
        out["per_layer_hit_rate"] = self.per_layer_hit_rate
        out["prefetch_precision"] = self.prefetch_precision
        out["prefetch_recall"] = self.prefetch_recall
        return out
