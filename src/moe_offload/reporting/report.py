"""`moe-offload report`: one trace and one budget of fast memory in, the answer to "policy or working set?"
out: the working set (reporting/working_set.py), the bound and the verdict (bound.py), the latency on a hardware
profile (latency.py), what to run (recommend.py); printed here for the terminal, rendered by html.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from rich.console import Console
from rich.table import Table

from moe_offload.engines import ENGINES
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import POLICIES
from moe_offload.reporting.bound import (REPLAY_SAMPLE_ABOVE, SAMPLE_ABOVE, TARGET_HIT_RATES, Bound, measure_bound,
                                         verdict)
from moe_offload.reporting.latency import Latency, measure_latency
from moe_offload.reporting.on_engine import OnEngine, measure_on_engine, print_on_engine
from moe_offload.reporting.recommend import command_lines, commands
from moe_offload.reporting.tables import binary_bytes, run_label
from moe_offload.reporting.working_set import WorkingSet, count_windows, measure_working_set
from moe_offload.simulator.replay import ReplayInput
from moe_offload.trace.format import TraceMeta
from moe_offload.trace.importers.engine_trace import prompt_tokens_text


@dataclass
class Report:
    trace: str
    meta: TraceMeta
    tokens: int
    requests: int
    cache_size: int                  # experts
    expert_bytes: int | None
    hardware: str
    working_set: WorkingSet
    bound: Bound
    verdict: str
    latency: Latency | None
    commands: list[str]
    notes: list[str] = field(default_factory=list)
    on_engine: OnEngine | None = None
    fast_memory: str = ""            # the budget as given (--fast-memory), for the commands printed

    @property
    def total_experts(self) -> int:
        return self.meta.num_expert_slots

    @property
    def per_layer_budget(self) -> float:
        return self.cache_size / self.meta.num_layers

    def budget_text(self) -> str:
        size = f" = {binary_bytes(self.cache_size * self.expert_bytes)}" if self.expert_bytes else ""
        return (f"{self.cache_size:,} experts of {self.total_experts:,} ({self.cache_size / self.total_experts:.1%})"
                f"{size}, {self.per_layer_budget:.3g} per layer")

    def size_text(self, size: int | None) -> str:
        """A size OPT needs: exact, or marked "about" where its curve was sampled."""
        if size is None:
            return "unreachable"
        memory = f", {binary_bytes(size * self.expert_bytes)}" if self.expert_bytes else ""
        about = "" if self.bound.opt is None or self.bound.opt.exact else "about "
        return f"{about}{size:,} experts ({size / self.total_experts:.1%}{memory})"


def build_report(data: ReplayInput, trace_name: str, cache_size: int, hardware: HardwareProfile,
                 expert_bytes: int | None, *, timed_tokens: int, seed: int = 0, jobs: int = 1, engine: str = "auto",
                 step=None, engines: tuple[str, ...] = (), profile=None, profile_name: str | None = None,
                 fast_memory: str = "", sample_above: int | None = SAMPLE_ABOVE,
                 replay_sample_above: int | None = REPLAY_SAMPLE_ABOVE, python_prefix: bool = True) -> Report:
    """Measure everything, the timed runs on the first ``timed_tokens`` rows (latency.py), OPT's curve on a
    sample of the experts above ``sample_above`` requests and every replay above ``replay_sample_above``
    (bound.py; None: never), the policies without a kernel on the first rows unless ``python_prefix`` is off,
    and the settings of
    ``engines`` on the held-out traffic (on_engine.py; ``profile``, a trace, chooses their placements instead
    of the trace's first half); ``step(text)`` is told what runs next (a progress line)."""
    step = step or (lambda text: None)
    trace = data.trace
    step("working set: sliding windows and reuse distances, beside the bound")
    requests = trace.num_tokens * trace.meta.num_layers * trace.meta.top_k
    whole = replay_sample_above is None or requests <= replay_sample_above  # else never flattened whole
    # the working set's kernels release the GIL: measured on a thread of its own while the bound's replays run,
    # its sliding windows (from the trace's rows) while this thread flattens the requests
    with ThreadPoolExecutor(max_workers=1) as side:
        counting = side.submit(count_windows, trace)
        sequence = data.sequence if whole else None  # flattened here, before the task that reads it
        measuring = side.submit(lambda: measure_working_set(trace, sequence, counting.result()))
        bound = measure_bound(data, cache_size, measuring, seed=seed, jobs=jobs, engine=engine,
                              sample_above=sample_above, replay_sample_above=replay_sample_above,
                              python_prefix=python_prefix, step=step)
        working_set = measuring.result()
    notes = [f"{policy} did not run: {why}" for policy, why in bound.skipped]
    if prompt_tokens_text(trace.meta.extra):
        notes.append(prompt_tokens_text(trace.meta.extra))
    latency = None
    if expert_bytes:
        step(f"latency on {hardware.name}: timed simulator")
        # a placement chosen from this very trace is a bound, never what to run (it would need the trace itself)
        latency = measure_latency(trace, hardware, cache_size, expert_bytes,
                                  [r.policy for r in bound.online if not r.in_hindsight],
                                  tokens=timed_tokens, seed=seed, jobs=jobs)
    else:
        notes.append("no latency: the trace does not give the size of an expert (give --expert-bytes)")
    best_policy = bound.best.policy if bound.best is not None else "lru"
    on_engine = None
    if engines and expert_bytes:
        step("on your engine: each setting on the held-out traffic")
        on_engine = measure_on_engine(trace, hardware, cache_size, expert_bytes, list(engines),
                                      bound.best.policy if bound.best is not None else None, profile=profile,
                                      profile_name=profile_name, timed_tokens=timed_tokens, seed=seed)
    elif engines:
        notes.append("no engine settings: their latency needs the size of an expert (give --expert-bytes)")
    unscored = [name for name in ENGINES if engines and name not in engines]
    if unscored:
        notes.append(f"engine settings scored for {', '.join(engines)} only: --engine all scores "
                     f"{', '.join(unscored)} too")
    lines = command_lines(commands(trace.meta, trace_name, hardware.name, cache_size, expert_bytes, latency,
                                   best_policy))
    if lines and "MODEL_DIR" in lines[-1]:
        notes.append(f"MODEL_DIR: the checkpoint directory of {trace.meta.model} (packed on first use)")
    return Report(trace=trace_name, meta=trace.meta, tokens=trace.num_tokens, requests=trace.num_requests,
                  cache_size=cache_size, expert_bytes=expert_bytes, hardware=hardware.name,
                  working_set=working_set, bound=bound,
                  verdict=like_with_like_verdict(bound, trace.meta.num_expert_slots),
                  latency=latency, commands=lines, notes=notes, on_engine=on_engine, fast_memory=fast_memory)


def places(result) -> bool:
    """Whether a run's policy is a placement (policies/base.py ``places_or_bypasses``): its experts are resident
    before the first request and what it does not hold is computed where it lives. It is not compared with
    Belady's OPT, which pays a miss for every first request and serves every request from fast memory: a
    placement can serve more from fast memory than OPT (all of it, at a budget of every expert)."""
    info = POLICIES.get(result.policy)
    return bool(info is not None and info.policy.places_or_bypasses)


def like_with_like_verdict(bound: Bound, total_experts: int) -> str:
    """The verdict (bound.py) among the policies that page on demand as OPT does, and the placements apart:
    the best of them as requests served from fast memory, a hindsight one marked as a bound."""
    paging = replace(bound, online=[r for r in bound.online if not places(r)])
    text = verdict(paging, total_experts)
    placed = [r for r in bound.online if places(r)]
    if placed:
        top = max(placed, key=lambda r: (1 - r.fast_misses / max(1, r.accesses), not r.in_hindsight))
        served = 1 - top.fast_misses / max(1, top.accesses)
        text += (f". Placed apart (experts resident before the first request, the rest computed where they live): "
                 f"{_label(top)} serves {served:.1%} of the requests from fast memory"
                 + (", a bound: its placement was chosen from this trace" if top.in_hindsight else ""))
    return text


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def working_set_rows(report: Report) -> list[tuple[str, ...]]:
    """Per window length: mean and largest distinct experts of a layer (mean over layers; the largest over
    layers and windows), and how the mean compares with the per-layer budget."""
    ws, budget = report.working_set, report.per_layer_budget
    return [(f"{window:,}", f"{ws.distinct_mean[i].mean():.2f}", f"{ws.distinct_max[i].max():,}",
             f"{ws.distinct_mean[i].mean() / budget:.2f}x") for i, window in enumerate(ws.windows)]


def policy_rows(report: Report) -> list[tuple[str, ...]]:
    bound = report.bound
    opt = bound.belady
    rows = [("belady (OPT)", f"{opt.hit_rate:.2%}", "100%", f"{opt.misses:,}", bound.replayed_on())]
    for result in bound.online:
        rows.append((_label(result), f"{result.hit_rate:.2%}", _of_opt(result, opt), f"{result.fast_misses:,}",
                     bound.replayed_on(result.policy)))
    if bound.sampled:
        sample_opt = bound.sampled_belady
        rows.append(("belady (OPT)", f"{sample_opt.hit_rate:.2%}", "100%", f"{sample_opt.misses:,}",
                     f"first {bound.sampled_tokens:,} tokens"))
        lru = [] if any(r.policy == "lru" for r in bound.sampled) else [bound.sampled_lru]  # the reference
        for result in sorted(bound.sampled + lru, key=lambda r: (-r.hits, r.policy)):
            rows.append((_label(result), f"{result.hit_rate:.2%}", _of_opt(result, sample_opt),
                         f"{result.fast_misses:,}", f"first {bound.sampled_tokens:,} tokens"))
    return rows


def _of_opt(result, opt) -> str:
    """The run's hits as a share of OPT's, for a policy that pages on demand; a placement is not compared."""
    return "placed apart" if places(result) else f"{result.hit_rate / opt.hit_rate if opt.hits else 0:.0%}"


def _label(result) -> str:
    """A policy's name, marked when its placement was chosen from this trace (a bound, never the verdict's)."""
    return f"{result.policy} (hindsight, a bound)" if result.in_hindsight else result.policy


def latency_rows(latency: Latency) -> list[tuple[str, ...]]:
    best = latency.best()
    runs = [latency.all_resident] + latency.candidates() + [r for r in latency.runs if r.prefetcher == "oracle"]
    rows = []
    for run in runs:
        label = run_label(run) + (" (split experts)" if run is latency.moepic else "")
        if run is best:
            label += "  <- fastest"
        rows.append((label, ms(run.ttft_seconds), ms(run.tpot_seconds), f"{run.hit_rate:.2%}",
                     f"{run.stall_seconds * 1e3:.1f}"))
    return rows


def print_report(report: Report, console: Console) -> None:
    meta = report.meta
    console.print(f"[bold]{report.trace}[/]: {meta.model}, {meta.num_layers} layers x {meta.num_experts} experts, "
                  f"top-{meta.top_k}; {report.tokens:,} tokens in {plural(report.requests, 'request')}; "
                  f"{report.working_set.requests:,} expert requests")
    console.print(f"fast memory: {report.budget_text()}")
    console.print(f"\n[bold]verdict[/]: {report.verdict}\n")

    table = Table(title="working set: distinct experts of a layer in a window of tokens", title_justify="left")
    for column in ("window (tokens)", "mean", "max", "mean / budget per layer"):
        table.add_column(column, justify="right")
    for row in working_set_rows(report):
        table.add_row(*row)
    console.print(table)
    ws = report.working_set
    per_layer = max(1, int(report.per_layer_budget))
    shares = ws.hottest_share(per_layer)
    console.print(f"reuse distance below the budget (LRU's hit rate): {ws.lru_hit_rate(report.cache_size):.2%}; "
                  f"first requests (cold misses of any cache): {ws.cold_requests / ws.requests:.2%}")
    console.print(f"skew: the {per_layer} hottest experts of a layer take {shares.mean():.1%} of its requests "
                  f"(layers from {shares.min():.1%} to {shares.max():.1%}); pinning the {report.cache_size:,} "
                  f"hottest experts in hindsight would serve {ws.pinned_hit_rate(report.cache_size):.2%}")

    table = Table(title=f"the bound: hit rate at {report.cache_size:,} experts", title_justify="left")
    for column in ("policy", "hit rate", "of OPT's hits", "not served from fast memory", "replayed on"):
        table.add_column(column, justify="left" if column in ("policy", "replayed on") else "right")
    for row in policy_rows(report):
        table.add_row(*row)
    console.print(table)
    needed = ", ".join(f"{target:.0%}: {report.size_text(report.bound.needed[target])}" for target in TARGET_HIT_RATES)
    console.print(f"Belady needs, for a hit rate of {needed} (no cache hits more than "
                  f"{report.bound.max_hit_rate:.2%}); OPT at every size: {report.bound.sampling_text()}")
    if report.bound.prefix_text() is not None:
        console.print(report.bound.prefix_text())

    latency = report.latency
    if latency is not None:
        table = Table(title=f"latency on {latency.hardware}, {binary_bytes(latency.cache_bytes)} of experts in the "
                            f"GPU (timed simulator, {latency.replayed}; ms)", title_justify="left")
        for column in ("run", "TTFT", "TPOT", "hit rate", "stall ms"):
            table.add_column(column, justify="left" if column == "run" else "right")
        for row in latency_rows(latency):
            table.add_row(*row)
        console.print(table)
        if latency.moepic_config is not None:
            config = latency.moepic_config
            console.print(f"MoEpic's split of {config['budget_experts']:,} experts (plus its buffer of {meta.top_k}): "
                          + ", ".join(f"L{i} {layer['cache_size']}x{layer['split_ratio']:.2f}"
                                      for i, layer in enumerate(config["layers"]))
                          + " (cached experts x split ratio per layer)")
    if report.on_engine is not None:
        print_on_engine(report.on_engine, console, report.trace, report.fast_memory)
    console.print("\n[bold]what to run[/]:")
    for line in report.commands:
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    for note in report.notes + (latency.notes if latency is not None else []):
        console.print(f"note: {note}", markup=False, highlight=False)
