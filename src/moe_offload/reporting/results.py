"""The one result record every simulator and the runtime fill; tables, JSON and plots read only this."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunResult:
    """Outcome of one run (one policy at one cache size on one trace).

    Counts are of expert requests. Fields a driver cannot measure stay None (the replay simulator has no
    clock, so no stall time or latency)."""

    trace: str
    policy: str
    cache_size: int                 # in experts
    accesses: int
    hits: int
    misses: int
    per_layer_accesses: list[int] = field(default_factory=list)
    per_layer_hits: list[int] = field(default_factory=list)
    opt_misses: int | None = None   # Belady OPT on the same sequence and cache size
    bytes_loaded: int | None = None  # misses x expert size, when the trace gives the size
    prefetches_issued: int | None = None
    prefetches_used: int | None = None
    stall_seconds: float | None = None
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def misses_vs_opt(self) -> float | None:
        """misses / OPT misses: 1.0 is optimal."""
        if self.opt_misses is None:
            return None
        return self.misses / self.opt_misses if self.opt_misses else (1.0 if self.misses == 0 else float("inf"))

    @property
    def per_layer_hit_rate(self) -> list[float]:
        return [h / a if a else 0.0 for h, a in zip(self.per_layer_hits, self.per_layer_accesses)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["misses_vs_opt"] = self.misses_vs_opt
        out["per_layer_hit_rate"] = self.per_layer_hit_rate
        return out
