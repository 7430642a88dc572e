"""Timed simulation runs: check a configuration, run it, fill the RunResult; a Plan's prediction; a grid of runs over
processes."""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import HardwareProfile
from moe_offload.plan import Plan, Reconfiguration
from moe_offload.policies import ModelSpec, policy_info
from moe_offload.prefetch import Prefetcher, check_trace_columns, make_prefetcher, prefetcher_info, search_latency
from moe_offload.prefetch.budget import budget_from_hardware
from moe_offload.results import RunResult
from moe_offload.simulator.replay import check_cache_size
from moe_offload.simulator.split import SplitConfig, read_split_config
from moe_offload.simulator.timed.reconfigure import OnlineConfigurator
from moe_offload.simulator.timed.run import TimedRun
from moe_offload.simulator.timed.schedule import Arrivals
from moe_offload.simulator.timed.layerwise import StreamedLayers
from moe_offload.simulator.timed.timeline import iteration_timeline
from moe_offload.simulator.timed.uploads import UploadsBetweenPasses, check_uploads
from moe_offload.simulator.transfers import home_tier
from moe_offload.trace.format import Trace, read_trace
from moe_offload.values import format_bytes, format_seconds, worker_count

ALL_RESIDENT = "all-resident"
ORACLE = "oracle"
PERCENTILES = (50, 90, 99)


def latency_summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}


def starting_split(trace: Trace, cache_bytes: int | None, expert_bytes: int, split: SplitConfig | None,
                   reconfiguration: Reconfiguration | None) -> SplitConfig | None:
    """The split configuration a run starts with: ``split``, or, when it reconfigures online without one,
    Algorithm 1's uniform start on ``cache_bytes`` of VRAM less the prefetch buffer of K experts."""
    if split is not None or reconfiguration is None:
        return split
    meta = trace.meta
    buffer = SplitConfig.buffer_bytes(meta.top_k, expert_bytes)
    if cache_bytes is None or cache_bytes <= buffer:
        raise ConfigError(f"MoEpic's online configuration splits {format_bytes(cache_bytes or 0)} of VRAM into top "
                          f"segments and a buffer of {meta.top_k} experts ({format_bytes(buffer)}): give more")
    return SplitConfig.uniform((cache_bytes - buffer) / expert_bytes, meta.num_layers, meta.num_experts)


# The timed simulator keeps Python objects for every expert of every tier (caches, policies, the all-resident
# bound's GPU): 2^18 experts took 2.3 GB and 4 minutes for one policy on a 2-core machine. 2^16 is four
# times DeepSeek-V3's 61 x 256.
MAX_TIMED_EXPERTS = 2**16


def check_timed_run(trace: Trace, hardware: HardwareProfile, policy: str, cache_bytes: int | None,
                    expert_bytes: int, arrivals: Arrivals, split: SplitConfig | None = None,
                    split_source: str = "the split configuration",
                    reconfiguration: Reconfiguration | None = None, prefetcher: str | None = None,
                    fetch_or_compute: bool = False, uploads: UploadsBetweenPasses | None = None,
                    layerwise: StreamedLayers | None = None) -> None:
    """Raise ConfigError when this run cannot be made: a cache that holds no expert, exceeds the GPU or
    is below what the policy needs (with ``split``, a split configuration the model or the GPU cannot run,
    named ``split_source`` in the message; ``cache_bytes`` is then unused); experts with no tier to live
    in; a middle tier too small for one expert; an offline policy with serving arrivals; an online
    reconfiguration (``reconfiguration``) without gate predictions, with bad options or a free link."""
    meta = trace.meta
    if meta.num_expert_slots > MAX_TIMED_EXPERTS:
        raise ConfigError(f"{trace.path}: {meta.num_layers:,} layers x {meta.num_experts:,} experts is more experts "
                          f"than the timed simulator models (at most {MAX_TIMED_EXPERTS:,}: it keeps Python state "
                          "for every expert of every tier); replay it without --timed")
    arrivals.check_clock(trace.num_requests, trace.path)
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    total = meta.num_expert_slots * expert_bytes
    gpu = hardware.tiers[0]
    if reconfiguration is not None:
        from moe_offload.simulator.configurator import require_gate_prediction, timings_from_profile

        reconfiguration.check()
        require_gate_prediction(trace)
        timings_from_profile(hardware, expert_bytes, meta.top_k).check(meta.top_k)
        split = starting_split(trace, cache_bytes, expert_bytes, split, reconfiguration)
    if split is not None:
        split.check(meta.num_layers, meta.num_experts, meta.top_k, expert_bytes, f"{hardware.name}'s {gpu.name}",
                    gpu.capacity_bytes, split_source)
    else:
        if cache_bytes is None or cache_bytes < expert_bytes:
            raise ConfigError(f"a GPU expert cache of {cache_bytes} bytes cannot hold one expert of {expert_bytes}")
        if cache_bytes > gpu.capacity_bytes:
            raise ConfigError(f"a cache of {format_bytes(cache_bytes)} does not fit in the "
                              f"{format_bytes(gpu.capacity_bytes)} of {hardware.name}'s {gpu.name}")
        check_cache_size(policy, min(cache_bytes, total) // expert_bytes, spec)
    home = home_tier(hardware, total)
    if home is None:
        raise ConfigError(f"hardware {hardware.name}: no tier after {gpu.name} holds all {meta.num_expert_slots} "
                          f"experts ({format_bytes(total)}), so they have nowhere to live")
    for tier in hardware.tiers[1:home]:
        if tier.capacity_bytes < expert_bytes:
            raise ConfigError(f"hardware {hardware.name}: tier {tier.name} ({format_bytes(tier.capacity_bytes)}) "
                              f"cannot hold one expert of {format_bytes(expert_bytes)}")
    policy_class = policy_info(policy).policy
    if layerwise is not None:
        layerwise.check(policy_class.static, policy_info(policy).partitioned, home, hardware.name, meta.num_layers,
                        gpu.capacity_bytes - (cache_bytes or 0), meta.num_experts * expert_bytes)
    if uploads is not None:
        check_uploads(policy_class.static, policy_info(policy).partitioned, prefetcher, home, hardware.name)
    bypassing = policy_class.static or fetch_or_compute or uploads is not None
    if bypassing and hardware.host is None:
        raise ConfigError(f"hardware {hardware.name} has no [host] compute: "
                          + (f"{policy} computes its misses on the host" if policy_class.static
                             else "the fetch-or-compute rule needs the host's time per expert" if fetch_or_compute
                             else "uploads between passes compute the misses on the host"))
    if bypassing and len(hardware.tiers) < 2:
        raise ConfigError(f"hardware {hardware.name} has no host tier for bypassed experts to live in")
    if policy_class.places_or_bypasses and (split is not None or reconfiguration is not None):
        raise ConfigError(f"{policy} places its own experts: it runs on a cache of whole experts, not split ones")
    if policy_class.static and prefetcher is not None:
        raise ConfigError(f"{policy} is a static placement: it loads nothing after the start, so there is "
                          f"nothing for the prefetcher {prefetcher} to prefetch")
    if policy_info(policy).offline and arrivals.kind != "trace":
        raise ConfigError(f"{policy} is offline: it needs the future access order, which a serving run decides "
                          "while it runs (batches depend on timing); use it with --arrivals trace")


def simulate_timed(trace: Trace, hardware: HardwareProfile, policy: str = "lru", cache_bytes: int | None = None, *,
                   expert_bytes: int | None = None, prefetcher: str | Prefetcher | None = None,
                   prefetcher_options: dict | None = None, history: Trace | None = None,
                   arrivals: Arrivals = Arrivals(), seed: int = 0, policy_options: dict | None = None,
                   timeline_iteration: int | None = None, name: str | None = None,
                   all_resident: bool = False, split: SplitConfig | None = None,
                   reconfiguration: Reconfiguration | None = None, fetch_or_compute: bool = False,
                   uploads: UploadsBetweenPasses | None = None,
                   layerwise: StreamedLayers | None = None) -> RunResult:
    """Run ``trace`` on ``hardware`` with ``policy`` on a GPU expert cache of ``cache_bytes`` and an optional
    prefetcher (a registry name, or an instance); ``all_resident`` runs the bound with every expert in the
    GPU from the start (no transfers; ``policy``, ``cache_bytes``, ``prefetcher``, ``split`` and
    ``reconfiguration`` are ignored). With ``split`` (MoEpic's split experts, simulator/split.py) the GPU holds
    per-layer caches of top segments and a buffer instead of a cache of ``cache_bytes``, which is then
    ignored. With ``reconfiguration`` (reconfigure.py, e.g. ``Reconfiguration(every=5000)``) MoEpic's
    configurator reruns online every tau tokens, from ``split`` or, without one, from Algorithm 1's uniform
    start on ``cache_bytes``. The prefetcher is told what the GPU's link carries per layer (prefetch/budget.py),
    and the split configuration's Y when it gives them. ``fetch_or_compute`` bypasses a miss whenever the
    host computes it faster than it is fetched (Fiddler's rule, policies/fetch_or_compute.py); a static
    placement (static-freq, static-layers) bypasses every miss. Bypassed experts run on the profile's
    ``[host]`` (run.py: Host compute). ``uploads`` (a fresh UploadsBetweenPasses, uploads.py) is llama.cpp PR
    #27861's admission: misses run on the host and some are uploaded between passes. ``layerwise`` (a fresh
    StreamedLayers, layerwise.py) streams whole layers beside a static placement: KTransformers' full-GPU
    fallback for long passes and its dynamic update of the GPU experts, or vLLM's and SGLang's offloaded
    layers copied a few layers ahead in every pass."""
    meta = trace.meta
    expert_bytes = expert_bytes or meta.expert_bytes
    if not expert_bytes:
        raise ConfigError(f"{trace.path}: the trace's metadata gives no expert size; give it (--expert-bytes)")
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    total = meta.num_expert_slots * expert_bytes
    notes = []
    if all_resident:  # the policy never has to choose: any will do
        policy, policy_options, cache_bytes, prefetcher, split, reconfiguration = "lru", None, total, None, None, None
    else:
        check_timed_run(trace, hardware, policy, cache_bytes, expert_bytes, arrivals, split,
                        reconfiguration=reconfiguration,
                        prefetcher=prefetcher if isinstance(prefetcher, str) or prefetcher is None
                        else prefetcher.name, fetch_or_compute=fetch_or_compute, uploads=uploads, layerwise=layerwise)
        split = starting_split(trace, cache_bytes, expert_bytes, split, reconfiguration)
        if split is not None:
            cache_bytes = split.memory_bytes(meta.top_k, expert_bytes)
            notes.append(f"split experts: layer i caches the top segments (theta_i of an expert) of C_i experts, "
                         f"{format_bytes(split.cache_bytes(expert_bytes))} in all, and a buffer of {meta.top_k} "
                         f"experts ({format_bytes(split.buffer_bytes(meta.top_k, expert_bytes))}) takes the missing "
                         f"segments: {format_bytes(cache_bytes)} of VRAM, the cache size reported")
        if policy_info(policy).policy.needs_probs and trace.probs is None:
            notes.append(f"{policy}: the trace has no router probabilities, so p comes from the prefetcher's map "
                         "when it has one, else is uniform (fmoe then ranks like LFU)")
    instance = None
    if isinstance(prefetcher, str):
        check_trace_columns(prefetcher_info(prefetcher), trace)
        instance = make_prefetcher(prefetcher, spec, prefetcher_options)
        if history is not None:
            instance.fit(history)
    elif prefetcher is not None:
        check_trace_columns(type(prefetcher), trace)
        instance = prefetcher
    if instance is not None:
        instance.set_budget(budget_from_hardware(hardware, expert_bytes, meta.num_layers, meta.top_k,
                                                 split.prefetches if split is not None else None))
    online = None
    if reconfiguration is not None:
        online = OnlineConfigurator(reconfiguration, split, hardware, meta.num_layers, meta.num_experts, meta.top_k,
                                    expert_bytes)
    sim = TimedRun(trace, hardware, policy, cache_bytes, expert_bytes, instance, arrivals, seed, policy_options,
                   all_resident, split, online, fetch_or_compute and not all_resident,
                   None if all_resident else uploads, None if all_resident else layerwise)
    if sim.net.home > 1 and not all_resident:
        notes.append(f"{hardware.name}: the experts live in {hardware.tiers[sim.net.home].name}; "
                     + ", ".join(f"{t.name} caches {format_bytes(t.capacity_bytes)}"
                                 for t in hardware.tiers[1:sim.net.home]))
    outcome = sim.run()
    if online is not None:
        spent = sum(r["seconds"] for r in sim.reconfigurations)
        notes.append(f"MoEpic's configurator reran online every {reconfiguration.every} tokens: "
                     f"{len(sim.reconfigurations)} times, {spent * 1e3:.3f} ms in all waiting for the link and "
                     "loading each layer's top-C_i segments by priority")
    if sim.search_seconds:
        where = "on the inference path" if search_latency(instance)[1] else "on its own matcher timeline"
        notes.append(f"{instance.name}: {sim.search_seconds * 1e3:.1f} ms of history search in all, charged {where}")
    if sim.decisions.total:
        notes.append(f"{policy}: {sim.decisions.count} eviction decisions took {format_seconds(sim.decisions.total)} "
                     f"({format_seconds(sim.decisions.total / sim.decisions.count)} each, decisions.py), each before "
                     "its load")
    arrival, token_times = outcome["arrival"], outcome["token_times"]
    ttft = [token_times[r][0] - arrival[r] for r in arrival]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    gaps = [b - a for t in token_times.values() for a, b in zip(t, t[1:])]
    misses = sim.accesses - sim.hits - sim.bypassed
    fetch_or_compute = fetch_or_compute and not all_resident and not policy_info(policy).policy.static  # else moot
    if fetch_or_compute:
        notes.append("fetch-or-compute: a miss is computed on the host when that is predicted faster than "
                     "fetching it (Fiddler's rule)")
    uploads = None if all_resident else uploads
    layerwise = None if all_resident else layerwise
    if layerwise is not None and layerwise.prefetch_step:
        notes.append(f"{layerwise.source}: every pass copied the experts of layers "
                     f"{', '.join(map(str, layerwise.layers))} from host memory, {layerwise.prefetch_step} offloaded "
                     f"layer(s) ahead, into {layerwise.prefetch_step} GPU buffer(s) of a layer")
    elif layerwise is not None:
        notes.append(f"layerwise prefill (KTransformers): {layerwise.passes} passes of at least {layerwise.threshold} "
                     "tokens brought every layer's experts to the GPU"
                     + (f"; the dynamic update replaced {layerwise.replaced} GPU experts" if layerwise.dynamic_update
                        else ""))
    if uploads is not None:
        notes.append(f"uploads between passes (llama.cpp PR #27861): misses ran on the host; {uploads.uploads} "
                     f"uploads scheduled (at most {uploads.inserts} per layer per pass), {uploads.published} "
                     f"published; passes of more than {uploads.max_pass_tokens} token(s) ran every expert on the host")
    bypassing = (fetch_or_compute or uploads is not None
                 or policy_info(policy).policy.places_or_bypasses) and not all_resident
    return RunResult(
        trace=name or trace.path, policy=ALL_RESIDENT if all_resident else policy,
        # a split run's memory is fractional experts (tops of theta_i E bytes): the nearest whole number
        cache_size=(round(cache_bytes / expert_bytes) if split is not None
                    else min(cache_bytes, total) // expert_bytes),
        accesses=sim.accesses, hits=sim.hits, misses=misses,
        per_layer_accesses=sim.per_layer_accesses, per_layer_hits=sim.per_layer_hits,
        bypassed=sim.bypassed if bypassing else None,
        per_layer_bypassed=sim.per_layer_bypassed if bypassing else None,
        host_compute_seconds=sim.host_seconds if bypassing else None,
        admission="fetch-or-compute" if fetch_or_compute else uploads.name if uploads is not None else None,
        bytes_loaded=sim.net.queues[1].bytes_moved if sim.net.queues else 0,
        prefetches_issued=sim.net.issued if instance is not None else None,
        prefetches_used=sim.used if instance is not None else None,
        prefetches_wasted=sim.net.issued - sim.used if instance is not None else None,
        stall_seconds=sum(sim.per_layer_stall), ttft_seconds=float(np.mean(ttft)),
        tpot_seconds=float(np.mean(tpot)) if tpot else None,
        prefetcher=instance.name if instance is not None else None, hardware=hardware.name, cache_bytes=cache_bytes,
        on_demand_loads=sim.on_demand, prefetch_search_seconds=sim.search_seconds if instance is not None else None,
        policy_decisions=sim.decisions.count, policy_decision_seconds=sim.decisions.total,
        per_layer_stall_seconds=sim.per_layer_stall,
        bytes_per_link={q.link.name: q.bytes_moved for q in sim.net.queues.values()},
        ttft_percentiles=latency_summary(ttft), tpot_percentiles=latency_summary(tpot),
        request_ttft_seconds=ttft, request_tpot_seconds=tpot, token_latency_seconds=gaps,
        total_seconds=max(t[-1] for t in token_times.values()) - min(arrival.values()),
        timeline=iteration_timeline(sim.events, [q.link.name for q in sim.net.queues.values()],
                                    outcome["spans"], timeline_iteration), notes=notes,
        reconfigurations=sim.reconfigurations if online is not None else None)


def simulate_plan(trace: Trace, plan: Plan, *, expert_bytes: int | None = None, arrivals: Arrivals = Arrivals(),
                  history: Trace | None = None, timeline_iteration: int | None = None,
                  name: str | None = None) -> RunResult:
    """The timed simulator's prediction of the run ``plan`` describes (plan/plan.py), on the plan's hardware
    profile: its policy and options, prefetcher and options (fitted on ``history``, else on the plan's),
    MoEpic's split and online loop, Fiddler's rule, and a fast tier of the whole experts of ``expert_bytes``
    (default: the trace's) its fast budget holds, as the runtime rounds it. The runtime's host tier is the
    profile's here: the plan's ``host_budget`` sizes the runtime's only. The result reports the plan back
    (``configuration``), as the runtime's does."""
    meta = trace.meta
    expert_bytes = expert_bytes or meta.expert_bytes
    if not expert_bytes:
        raise ConfigError(f"{trace.path}: the trace's metadata gives no expert size; give it (--expert-bytes)")
    hardware = plan.profile()
    split = plan.split_config
    if split is not None and not isinstance(split, SplitConfig):
        split = read_split_config(split)
    if history is None and plan.history is not None:
        history = read_trace(plan.history)
    cache_bytes = plan.fast_experts(expert_bytes, meta.num_expert_slots) * expert_bytes
    result = simulate_timed(trace, hardware, plan.policy, cache_bytes, expert_bytes=expert_bytes,
                            prefetcher=plan.prefetch, prefetcher_options=plan.prefetch_options, history=history,
                            arrivals=arrivals, seed=plan.seed, policy_options=plan.policy_options,
                            timeline_iteration=timeline_iteration, name=name, split=split,
                            reconfiguration=plan.reconfiguration, fetch_or_compute=plan.fetch_or_compute)
    result.configuration = plan.describe()
    return result


_GRID: tuple | None = None  # (trace, hardware, history) of the worker processes, set once per process


def _init_worker(trace: Trace, hardware: HardwareProfile, history: Trace | None) -> None:
    global _GRID
    _GRID = (trace, hardware, history)


def _run_task(task: dict) -> RunResult:
    trace, hardware, history = _GRID
    return simulate_timed(trace, hardware, history=history, **task)


def timed_runs(policies: list[str], prefetchers: list[str | None], cache_sizes: list[int],
               with_oracle: bool = True) -> list[tuple[str, str | None, int | None]]:
    """The (policy, prefetcher, cache bytes) runs of a timed grid: the all-resident bound first
    (ALL_RESIDENT, None, None), then every policy with every prefetcher at every size, then the oracle
    prefetcher with every policy at every size (unless asked for anyway, or not ``with_oracle``). A static
    placement, which loads nothing after the start, runs without a prefetcher only."""
    def fits(policy, prefetcher):
        return prefetcher is None or not policy_info(policy).policy.static

    runs = [(ALL_RESIDENT, None, None)]
    runs += [(policy, prefetcher, size) for size in cache_sizes for policy in policies for prefetcher in prefetchers
             if fits(policy, prefetcher)]
    if with_oracle and ORACLE not in prefetchers:
        runs += [(policy, ORACLE, size) for size in cache_sizes for policy in policies if fits(policy, ORACLE)]
    return runs


def timed_grid(trace: Trace, hardware: HardwareProfile, policies: list[str], prefetchers: list[str | None],
               cache_sizes: list[int], *, expert_bytes: int | None = None, arrivals: Arrivals = Arrivals(),
               seed: int = 0, policy_options: dict[str, dict] | None = None,
               prefetcher_options: dict[str, dict] | None = None, history: Trace | None = None,
               timeline_iteration: int | None = None, with_oracle: bool = True, name: str | None = None,
               jobs: int = 1, progress=None, split: SplitConfig | None = None,
               reconfiguration: Reconfiguration | None = None, fetch_or_compute: bool = False) -> list[RunResult]:
    """Every (policy, prefetcher, cache size in bytes) and the bounds to compare them with: the all-resident
    run (first) and, for every policy and size, the oracle prefetcher (unless asked for anyway). With
    ``split`` every run but the all-resident one runs that split configuration (give one cache size: it is
    unused); with ``reconfiguration`` every such run reconfigures it online; with ``fetch_or_compute`` every
    such run computes on the host the misses that Fiddler's rule bypasses (simulate_timed).

    Runs are independent, so ``jobs`` > 1 spreads them over processes; results do not depend on it.
    ``progress`` is called after each run."""
    shared = dict(expert_bytes=expert_bytes, arrivals=arrivals, seed=seed, timeline_iteration=timeline_iteration,
                  name=name)
    tasks = [dict(all_resident=True, **shared) if policy == ALL_RESIDENT else
             dict(policy=policy, cache_bytes=size, prefetcher=prefetcher, split=split, reconfiguration=reconfiguration,
                  fetch_or_compute=fetch_or_compute,
                  prefetcher_options=(prefetcher_options or {}).get(prefetcher),
                  policy_options=(policy_options or {}).get(policy), **shared)
             for policy, prefetcher, size in timed_runs(policies, prefetchers, cache_sizes, with_oracle)]
    jobs = worker_count(jobs, len(tasks))
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker,
                                 initargs=(trace, hardware, history)) as pool:
            results = []
            for result in pool.map(_run_task, tasks):
                results.append(result)
                if progress is not None:
                    progress()
        return results
    _init_worker(trace, hardware, history)
    results = []
    for task in tasks:
        results.append(_run_task(task))
        if progress is not None:
            progress()
    return results
