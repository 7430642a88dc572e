"""The latency a user would see: the timed simulator's TTFT and TPOT on a hardware profile for the best few
policy and prefetcher pairs, and MoEpic's split configuration at the same budget.

The candidates: the online policies with the most replay hits at the budget (reporting/bound.py), LRU among
them (every engine's default, the baseline), each without a prefetcher and with every prefetcher the
trace's columns allow (prefetch/requirements.py) that a runtime can run (it reads no future) and that needs
no history of past traffic (the report has one trace; a prefetcher fit on the trace it runs on would see its
own future). The timed grid adds its bounds:
all experts resident, and the oracle prefetcher with each policy (simulator/timed/simulate.py).

When the trace has next-layer gate predictions, MoEpic's configurator (paper 004, Algorithm 1:
simulator/configurator/moepic.py) splits the budget less its prefetch buffer of top-k experts into per-layer top
segments from the trace's LCP statistics and the hardware's timings, and the timed simulator runs that split
with LCP and MoEpic's prefetcher.

The timed simulator runs every layer of every iteration in Python: 2,700 (OLMoE's decode, one token a pass,
with the oracle prefetcher) to 32,000 (the tiny trace's batched prefill, no prefetcher) token-layers a CPU
second, by `python benchmarks/timed_throughput.py` on a loaded 2-core machine. So a trace of more than
``tokens`` rows (`report --timed-tokens`) runs its first whole iterations up to that many rows, batches as
recorded and decoding included (simulator/timed/schedule.py ``leading_iterations``: a prompt longer than that
is followed by decode passes), and the report says which part it replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.prefetch import PREFETCHERS
from moe_offload.prefetch.requirements import has_column
from moe_offload.results import RunResult
from moe_offload.simulator.configurator import check_inputs, configure, measure_statistics, timings_from_profile
from moe_offload.simulator.split import SplitConfig
from moe_offload.simulator.timed import ALL_RESIDENT, ORACLE, Arrivals, check_timed_run, simulate_timed, timed_grid
from moe_offload.simulator.timed.schedule import describe_sample, leading_iterations
from moe_offload.trace.format import Trace

CANDIDATE_POLICIES = 1  # the best online policies by replay hits, besides LRU
BASELINE_POLICY = "lru"
MOEPIC_POLICY = "lcp"  # the cache policy of MoEpic's split experts (paper 004, section 3.2)
MOEPIC_LABEL = "lcp + moepic (split experts)"


@dataclass
class Latency:
    hardware: str
    cache_bytes: int
    tokens: int                      # rows of the trace the runs replayed
    sampled: bool                    # whether they are its first rows only
    runs: list[RunResult]            # the grid: all-resident first, then the pairs and the oracle bounds
    moepic: RunResult | None = None
    moepic_config: dict | None = None  # configure --json's document
    notes: list[str] = field(default_factory=list)
    replayed: str = ""               # which iterations the runs replayed, prefill and decode tokens, batch sizes

    @property
    def all_resident(self) -> RunResult:
        return next(r for r in self.runs if r.policy == ALL_RESIDENT)

    def candidates(self) -> list[RunResult]:
        """The runs a user can make (no oracle, not all resident), fastest TPOT first."""
        runs = [r for r in self.runs if r.policy != ALL_RESIDENT and r.prefetcher != ORACLE]
        if self.moepic is not None:
            runs.append(self.moepic)
        return sorted(runs, key=lambda r: (r.tpot_seconds if r.tpot_seconds is not None else r.ttft_seconds,
                                           r.ttft_seconds))

    def best(self) -> RunResult | None:
        candidates = self.candidates()
        return candidates[0] if candidates else None


def usable_prefetchers(trace: Trace) -> tuple[list[str], list[str]]:
    """The prefetchers the report runs on ``trace``, and why each other one does not run."""
    usable, why = [], []
    for name, cls in PREFETCHERS.items():
        if name in (ORACLE, "moepic"):  # the oracle is a bound; moepic runs with its split configuration
            continue
        if cls.reads_future:
            why.append(f"{name} reads the experts a layer will select before it is routed: a bound, not a runtime")
            continue
        if cls.needs_history:
            why.append(f"{name} learns from past traffic (a history trace), which the report does not take")
            continue
        missing = [column for column in cls.requires if not has_column(trace, column)]
        if missing:
            why.append(f"{name} needs the trace column(s) {', '.join(missing)}, which this trace lacks")
            continue
        usable.append(name)
    return usable, why


def candidate_policies(ranked: list[str], trace: Trace, hardware: HardwareProfile, cache_bytes: int,
                       expert_bytes: int) -> list[str]:
    """LRU and the best ``CANDIDATE_POLICIES`` others of ``ranked`` (most replay hits first) that the
    timed simulator can run at this budget."""
    chosen = [BASELINE_POLICY]
    for policy in ranked:
        if len(chosen) > CANDIDATE_POLICIES:
            break
        if policy in chosen:
            continue
        try:
            check_timed_run(trace, hardware, policy, cache_bytes, expert_bytes, Arrivals())
        except ConfigError:
            continue
        chosen.append(policy)
    return chosen


def measure_latency(trace: Trace, hardware: HardwareProfile, cache_size: int, expert_bytes: int,
                    ranked_policies: list[str], *, tokens: int, seed: int = 0, jobs: int = 1,
                    progress=None) -> Latency:
    """The timed runs of the module docstring on ``cache_size`` experts of ``expert_bytes`` each."""
    cache_bytes = cache_size * expert_bytes
    sample = leading_iterations(trace, tokens)
    policies = candidate_policies(ranked_policies, sample, hardware, cache_bytes, expert_bytes)
    prefetchers, notes = usable_prefetchers(sample)
    runs = timed_grid(sample, hardware, policies, [None] + prefetchers, [cache_bytes], expert_bytes=expert_bytes,
                      seed=seed, jobs=jobs, progress=progress, name=trace.path)
    latency = Latency(hardware=hardware.name, cache_bytes=cache_bytes, tokens=sample.num_tokens,
                      sampled=sample.num_tokens < trace.num_tokens, runs=runs, notes=notes,
                      replayed=describe_sample(sample, trace))
    if sample.gate_prediction is None:
        latency.notes.append("MoEpic's split experts need the trace's gate_prediction column (next-layer router "
                             "predictions, which `moe-offload record` writes); this trace has none")
    else:
        moepic_split(latency, sample, hardware, cache_size, expert_bytes, seed)
    best = latency.best()
    if best is not None:  # what the other runs say differs only in their numbers (search times, say)
        latency.notes += best.notes
    return latency


def moepic_split(latency: Latency, trace: Trace, hardware: HardwareProfile, cache_size: int, expert_bytes: int,
                 seed: int) -> None:
    """MoEpic's configuration of ``cache_size`` experts less its buffer, and its timed run, into ``latency``."""
    meta = trace.meta
    budget = cache_size - meta.top_k  # the prefetch buffer holds top-k whole experts
    timings = timings_from_profile(hardware, expert_bytes, meta.top_k)
    try:
        if budget <= 0:
            raise ConfigError(f"the budget of {cache_size} experts leaves nothing beside MoEpic's buffer of "
                              f"{meta.top_k}")
        check_inputs(timings, budget, 0.01, meta.num_layers, meta.num_experts, meta.top_k)
        config = configure(measure_statistics(trace), timings, budget)
        split = SplitConfig.of(config.layers)
        latency.moepic = simulate_timed(trace, hardware, MOEPIC_POLICY, expert_bytes=expert_bytes, prefetcher="moepic",
                                        split=split, seed=seed, name=trace.path)
    except ConfigError as exc:
        latency.notes.append(f"MoEpic's split experts do not run here: {exc}")
        return
    latency.moepic_config = {"budget_experts": budget, "hardware": hardware.name, **config.to_dict()}
