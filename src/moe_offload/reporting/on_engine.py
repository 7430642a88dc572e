"""The report's "on your engine" section: each setting an engine can express at the budget, scored on traffic
its placement never saw, beside the best dynamic policy and Belady on the same traffic.

The traffic is split (engines/heldout.py): the profile chooses every placement chosen from traffic, the scored
part's leading iterations (simulator/timed/schedule.py ``leading_iterations``, decoding included) are what every
run replays, at the trace's own batches (its concurrency). Per setting: the share of expert requests served from
fast memory, the bytes over the link and the experts computed on the host per token, TTFT and TPOT from the
timed simulator on the hardware profile. The best setting of an engine is the one of least TPOT (TTFT where the
sample decodes no second token); what the engine's limits cost is its TPOT against that of the best dynamic
policy (the bound's best online policy, without a prefetcher) and of Belady's, on the same sample and budget.

A placement chosen from traffic is also chosen on the scored part itself, in hindsight: its share served
there is shown beside the held-out one, and the held-out placement's share over time windows of the scored
part shows the drift. The hindsight figure is never a setting the section recommends.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace

from moe_offload.engines import ENGINES, PlacementContext, Setting, run_setting, served_share, split_trace
from moe_offload.engines.heldout import window_hit_rates
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.models.hub import HUB_ID
from moe_offload.policies import ModelSpec
from moe_offload.results import RunResult
from moe_offload.simulator.timed import simulate_timed
from moe_offload.simulator.timed.schedule import describe_sample, leading_iterations
from moe_offload.trace.format import Trace

DRIFT_WINDOWS = 8


def model_name(model: str) -> str:
    """The trace's model as the engines' ``--model`` takes it: its hub id when it names one, else MODEL (the
    user's checkpoint); a GGUF file is always the user's (MODEL.gguf)."""
    return model if HUB_ID.fullmatch(model) else "MODEL"


@dataclass
class SettingScore:
    setting: Setting
    result: RunResult | None         # the timed run on the scored sample (None: the hardware cannot host it)
    served: float | None             # share of expert requests served from fast memory (None: not scored)
    bytes_per_token: float | None
    host_per_token: float | None
    heldout_served: float | None = None    # its share of the whole scored part (chosen on the profile)
    hindsight_served: float | None = None  # the same rule chosen on the scored part itself
    windows: list[float] | None = None     # served share over windows of the scored part

    @property
    def ttft(self) -> float | None:
        return self.result.ttft_seconds if self.result is not None else None

    @property
    def tpot(self) -> float | None:
        return self.result.tpot_seconds if self.result is not None else None

    def speed_key(self) -> tuple:
        return (self.tpot if self.tpot is not None else self.ttft, self.ttft)


@dataclass
class EngineScores:
    name: str
    command: str
    source: str
    limits: str
    scores: list[SettingScore]

    @property
    def best(self) -> SettingScore | None:
        timed = [s for s in self.scores if s.result is not None]
        return min(timed, key=SettingScore.speed_key) if timed else None


@dataclass
class OnEngine:
    split: str                       # how the traffic was split
    replayed: str                    # which part of the scored traffic the runs replayed
    hardware: str
    cache_size: int
    dynamic: RunResult | None        # the best dynamic policy on the same sample
    belady: RunResult | None
    engines: list[EngineScores]
    notes: list[str] = field(default_factory=list)


def _per_token(value: float | int | None, tokens: int) -> float:
    return (value or 0) / tokens if tokens else 0.0


def score(setting: Setting, sample: Trace, scored: Trace, context: PlacementContext, runs: dict) -> SettingScore:
    """``setting`` on the scored sample; ``runs`` keeps the timed runs by (policy, options), so that a placement
    two engines express alike (SGLang's kt backend is KTransformers) runs once."""
    spec = context.spec
    if setting.cannot_host is not None:  # listed with its reason, nothing about it measured
        return SettingScore(setting, None, None, None, None)
    key = setting.run_key()
    if key not in runs:
        runs[key] = run_setting(setting, sample, context)
    result = runs[key]
    entry = SettingScore(setting, result, result.hit_rate, _per_token(result.bytes_loaded, sample.num_tokens),
                         _per_token(result.bypassed, sample.num_tokens))
    if setting.from_traffic:
        entry.heldout_served = served_share(scored, setting.resident, spec)
        entry.windows = window_hit_rates(scored, setting.resident, spec, DRIFT_WINDOWS)
    return entry


def add_hindsight(scores: list[SettingScore], engine, context: PlacementContext, scored: Trace) -> None:
    """Each traffic-chosen setting's rule applied to the scored part itself: the share it would serve there."""
    if not any(entry.setting.from_traffic for entry in scores):
        return
    twins = {s.kind: s for s in engine.settings(replace(context, profile=scored)) if s.from_traffic}
    for entry in scores:
        twin = twins.get(entry.setting.kind) if entry.setting.from_traffic else None
        if twin is not None:
            entry.hindsight_served = served_share(scored, twin.resident, context.spec)


def measure_on_engine(trace: Trace, hardware: HardwareProfile, cache_size: int, expert_bytes: int,
                      engines: list[str], dynamic_policy: str | None, *, profile: Trace | None = None,
                      profile_name: str | None = None, timed_tokens: int, seed: int = 0) -> OnEngine:
    """Every engine of ``engines`` scored as the module doc says."""
    meta = trace.meta
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    split = split_trace(trace, profile, profile_name)
    sample = leading_iterations(split.scored, timed_tokens)
    context = PlacementContext(spec, cache_size, split.profile, hardware, expert_bytes, seed, timed_tokens)
    cache_bytes = cache_size * expert_bytes
    dynamic = (simulate_timed(sample, hardware, dynamic_policy, cache_bytes, expert_bytes=expert_bytes, seed=seed)
               if dynamic_policy is not None else None)
    belady = simulate_timed(sample, hardware, "belady", cache_bytes, expert_bytes=expert_bytes, seed=seed)
    sections, runs = [], {}
    for name in engines:
        engine = ENGINES[name]
        scores = [score(setting, sample, split.scored, context, runs) for setting in engine.settings(context)]
        add_hindsight(scores, engine, context, split.scored)
        command = re.sub(r" MODEL(?= |$)", f" {model_name(meta.model)}", engine.command)
        sections.append(EngineScores(name, command, engine.source, engine.limits, scores))
    return OnEngine(split=split.how, replayed=describe_sample(sample, split.scored), hardware=hardware.name,
                    cache_size=cache_size, dynamic=dynamic, belady=belady, engines=sections)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def setting_rows(section: EngineScores) -> list[tuple[str, ...]]:
    best = section.best
    rows = []
    for entry in section.scores:
        label = entry.setting.label + ("  <- best" if entry is best else "")
        if entry.served is None:
            rows.append((label, "-", "-", "-", "-", "-"))
            continue
        rows.append((label, f"{entry.served:.2%}", _bytes(entry.bytes_per_token), f"{entry.host_per_token:.2f}",
                     ms(entry.ttft), ms(entry.tpot)))
    return rows


def command_line(section: EngineScores, entry: SettingScore) -> str:
    return " ".join(filter(None, (section.command, shlex.join(entry.setting.flags))))


def _shared_reason(section: EngineScores) -> str | None:
    """The one reason every setting of the engine is not timed, when they share one."""
    reasons = {entry.setting.cannot_host for entry in section.scores}
    return next(iter(reasons)) if len(reasons) == 1 else None


def no_timed_setting(section: EngineScores, cache_size: int) -> str:
    """Why an engine has no best setting: none fits the budget, or none that fits is timed (with the reason,
    when they share one)."""
    count = len(section.scores)
    if count:
        which = "its one setting" if count == 1 else f"none of its {count} settings"
        shared = _shared_reason(section)
        return (f"{section.name}: {which} at {cache_size:,} experts {'is not' if count == 1 else 'is'} timed"
                + (f" ({shared.removeprefix('not timed: ')})" if shared else ""))
    return (f"{section.name}: no setting it can express fits {cache_size:,} experts"
            + (f" ({section.limits})" if section.limits else ""))


def setting_notes(section: EngineScores) -> list[tuple[str, str]]:
    """(label, what it is) of each setting that says more about itself than its label (the page lists them)."""
    return [(entry.setting.label, entry.setting.note) for entry in section.scores if entry.setting.note]


def untimed_lines(section: EngineScores) -> list[str]:
    """A line for each setting not timed: why the hardware cannot host it (none when every setting shares the
    reason, which ``no_timed_setting`` says once)."""
    if _shared_reason(section) is not None:
        return []
    return [f"{entry.setting.label}: {entry.setting.cannot_host}" for entry in section.scores
            if entry.setting.cannot_host is not None]


def section_lines(on_engine: OnEngine, trace_name: str, fast_memory: str) -> dict[str, list[str]]:
    """Per engine: the sentences under its table (best setting, its command, its cost, hindsight and drift)."""
    out = {}
    for section in on_engine.engines:
        lines = []
        best = section.best
        if best is None:
            lines.append(no_timed_setting(section, on_engine.cache_size))
            lines.extend(untimed_lines(section))
            out[section.name] = lines
            continue
        lines.append(f"best: {best.setting.label}: {command_line(section, best)}")
        if best.setting.export_name:
            lines.append(f"the file it reads: moe-offload placement {trace_name} --engine {section.name} "
                         f"--fast-memory {fast_memory} -o {best.setting.export_name}")
        for name, other in (("the best dynamic policy", on_engine.dynamic), ("Belady", on_engine.belady)):
            if other is None or other.tpot_seconds is None or best.tpot is None:
                continue
            lines.append(f"against {name} ({other.policy}, {other.hit_rate:.2%} served, TPOT "
                         f"{ms(other.tpot_seconds)} ms): {best.tpot / other.tpot_seconds:.2f}x its TPOT")
        for entry in section.scores:
            if entry.hindsight_served is None:
                continue
            gap = entry.hindsight_served - entry.heldout_served
            verdict = (f"the profile's choice serves {gap * 100:.1f} points less than hindsight: the hot set drifts"
                       if gap > 0 else "the profile's choice loses nothing to hindsight")
            lines.append(f"{entry.setting.label}: of all the scored traffic it serves {entry.heldout_served:.2%} "
                         f"held-out, {entry.hindsight_served:.2%} chosen in hindsight (never recommended): "
                         f"{verdict}")
            if entry.windows:
                lines.append("  drift, served per window of the scored traffic: "
                             + " ".join(f"{share:.0%}" for share in entry.windows))
        lines.extend(untimed_lines(section))
        if section.limits:
            lines.append(f"limits: {section.limits}")
        out[section.name] = lines
    return out


HEADER = ("setting", "served from fast memory", "over the link / token", "host experts / token", "TTFT ms", "TPOT ms")


def print_on_engine(on_engine: OnEngine, console, trace_name: str, fast_memory: str) -> None:
    from rich.table import Table

    console.print(f"\n[bold]on your engine[/]: {on_engine.split}; runs replay {on_engine.replayed} on "
                  f"{on_engine.hardware}", highlight=False)
    lines = section_lines(on_engine, trace_name, fast_memory)
    for section in on_engine.engines:
        table = Table(title=f"{section.name} at {on_engine.cache_size:,} experts ({section.source})",
                      title_justify="left")
        for column in HEADER:
            table.add_column(column, justify="left" if column == "setting" else "right")
        for row in setting_rows(section):
            table.add_row(*row)
        console.print(table)
        for line in lines[section.name]:
            console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
