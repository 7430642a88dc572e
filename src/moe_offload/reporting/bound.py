"""The bound: how far the online policies are from Belady's OPT at a budget, and what budget OPT needs.

Belady's OPT (evict the expert requested furthest in the future) has the fewest misses of any demand-paging
policy on a sequence, so its hit rate at a budget is the most any policy can get there: the gap between it
and the best online policy is what a better policy could win, and OPT's own hit rate is what a better policy
cannot exceed. Every run is the replay `moe-offload simulate` makes (simulator/replay.py, the compiled kernels
where a policy has one), so the numbers are simulate's.

The budget OPT needs for a hit rate h is read off OPT's hit rate at every cache size, measured in one pass
(OPT is a stack algorithm, Mattson et al. 1970: simulator/stack_distances.py): the smallest size whose hits
reach h, so OPT at that size reaches h and one expert fewer does not. A hit rate above every cache's (all
requests but the first of each expert) is unreachable and said so.

On a trace of more than ``sample_above`` expert requests the curve is measured on a spatial sample of the
experts (SHARDS: every request of one expert in ``sample_above / requests`` of them, at least
MIN_SAMPLE_RATE) and the sizes it gives are estimates, so said; its error is measured where the exact
answer is at hand, at the budget, against the Belady replay of the whole trace (``opt_error``).

On a trace of more than ``replay_sample_above`` requests (REPLAY_SAMPLE_ABOVE: the whole sequence's ids, clocks
and next uses, 24 bytes a request, would pass a few gigabytes) every replay runs on one spatial sample of the
experts at the rate OPT's curve would have, flattened a piece at a time, with the budget scaled by it; OPT's curve is the sample's
own. What that costs in accuracy is measured and said: LRU's hit rate on the sample against its exact hit rate
on the whole trace, which the reuse distances give (working_set.py, streamed over the whole trace). The -dist
policies are the exception: their cache is split among the layers, and a sample leaves each layer a few experts
(154 of a 1,536 budget at 10% are 3 a layer of 48), and a cache of 3 does not behave as a cache of 32 scaled
down (a spatial sample scales a cache well only where it holds many experts). Each of their layers is a cache
of its own, served the layer's requests, which the replay reads off the trace a layer at a time without the
whole sequence (simulator/replay.py ``layer_requests``): so they replay the whole trace at the budget itself,
exactly, and the ranking compares hit rates; a sampled row and an exact one within the sample's error (LRU's)
of each other are not told apart, and the verdict names both.

Policies without a compiled kernel run their Python objects, about a hundred times slower: on a trace of more
requests than PYTHON_REPLAY_REQUESTS they replay its first rows only (up to that many requests; the whole trace
where ``python_prefix`` is off, as `report --exact` asks), beside OPT and LRU on the same rows, and the report
says so, with LRU's hit rate there against its exact one on the whole trace: how far the first rows are from it;
those replays run on a thread of their own while the whole trace's replays run (the kernels release the GIL),
so a core the kernels leave idle is not wasted. So do the placements when the replays are sampled: a placement
chosen from the whole trace would hold experts the sample lacks.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, default_policies, make_policy
from moe_offload.results import RunResult
from moe_offload.reporting.working_set import WorkingSet
from moe_offload.simulator.grid import replay_grid
from moe_offload.simulator.replay import ReplayInput, replay, replay_kernel
from moe_offload.simulator.stack_distances import HitCurve, lru_curve, opt_curve
from moe_offload.values import worker_count

TARGET_HIT_RATES = (0.5, 0.8, 0.9)
PYTHON_REPLAY_REQUESTS = 250_000
SAMPLE_ABOVE = 20_000_000  # expert requests above which OPT's curve is measured on a sample of the experts
REPLAY_SAMPLE_ABOVE = 100_000_000  # expert requests above which every replay runs on a sample of the experts
MIN_SAMPLE_RATE = 0.1      # at least this share of the experts: a few thousand experts leave a few hundred
# Verdict thresholds: below NO_POLICY_HELPS even OPT misses most requests; at or above POLICY_CLOSE of OPT's
# hits the online policy is near the bound, so memory, not the policy, is the lever.
NO_POLICY_HELPS = 0.30
POLICY_CLOSE = 0.90


@dataclass
class Bound:
    cache_size: int
    belady: RunResult
    online: list[RunResult]                 # the runs at the budget, the highest hit rate first
    sampled: list[RunResult] = field(default_factory=list)  # Python policies on the first rows (see above)
    sampled_belady: RunResult | None = None
    sampled_lru: RunResult | None = None    # LRU on the same first rows: how far they are from the whole trace
    sampled_tokens: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (policy, why it did not run)
    needed: dict[float, int | None] = field(default_factory=dict)  # target hit rate -> OPT's size, None: never
    max_hit_rate: float = 1.0
    opt: HitCurve | None = None  # OPT's hit rate at every size (sampled where opt.rate < 1)
    replay_rate: float = 1.0     # below 1: every replay ran on a sample of the experts at this rate (see above)
    replay_size: int = 0         # the budget those replays had: cache_size scaled by replay_rate
    lru_error: float | None = None  # sampled replays: LRU's sampled hit rate less its exact one, whole trace
    lru_exact: float | None = None  # LRU's exact hit rate on the whole trace at the budget (reuse distances)
    layer_by_layer: list[str] = field(default_factory=list)  # -dist policies replayed whole beside the sample

    @property
    def opt_error(self) -> float | None:
        """The sampled OPT curve's hit rate at the budget less the Belady replay's on the whole trace (None
        when the curve is exact, or when the replays were sampled too)."""
        if self.opt is None or self.opt.exact or self.replay_rate < 1:
            return None
        return self.opt.hit_rate(self.cache_size) - self.belady.hit_rate

    def replayed_on(self, policy: str = "belady") -> str:
        """What ``policy``'s replay at the budget ran on, in words."""
        if self.replay_rate == 1 or policy in self.layer_by_layer:
            return "whole trace"
        return f"{self.replay_rate:.1%} of the experts, at {self.replay_size:,}"

    def sampling_text(self) -> str:
        """How OPT's curve was measured, in words, with its error where it was sampled."""
        if self.replay_rate < 1:
            return (f"on a sample of {self.replay_rate:.1%} of the experts (every request of each, "
                    f"{self.belady.accesses:,} requests; SHARDS), as every replay at the budget"
                    + (" but the -dist policies' (whole trace, a layer at a time)" if self.layer_by_layer else "")
                    + f", which ran with {self.replay_size:,} experts: its sizes and hit rates are estimates; LRU's "
                    f"hit rate on the sample is {self.lru_error * 100:+.2f} points from its exact one on the whole "
                    "trace" + ("; the ranking puts the sample's hit rates beside the -dist policies' exact ones, so "
                               "read a sampled row with that error" if self.layer_by_layer else ""))
        if self.opt is None or self.opt.exact:
            return "exact: every request"
        return (f"on a sample of {self.opt.rate:.1%} of the experts (every request of each, "
                f"{self.opt.requests:,} requests; SHARDS), so its sizes are estimates: at the budget its hit rate "
                f"is {self.opt_error * 100:+.2f} points from the exact replay's")

    def prefix_text(self) -> str | None:
        """What the runs on the first rows are, in words, with how far those rows are from the whole trace:
        LRU's hit rate on them against its exact one on the whole trace (None: no run on the first rows)."""
        if self.sampled_lru is None:
            return None
        return (f"{', '.join(r.policy for r in self.sampled)} ran on the first {self.sampled_tokens:,} tokens only "
                f"(`--exact`: the whole trace); there LRU hits {self.sampled_lru.hit_rate:.2%}, "
                f"{(self.sampled_lru.hit_rate - self.lru_exact) * 100:+.2f} points from its {self.lru_exact:.2%} "
                "on the whole trace: read them against LRU's and OPT's rows on the same tokens")

    @property
    def best(self) -> RunResult | None:
        """The online policy with the most hits: a placement chosen from this very trace (in hindsight) is
        a bound like OPT, not a policy a user can run on traffic to come."""
        return next((r for r in self.online if not r.in_hindsight), None)

    def result(self, policy: str) -> RunResult | None:
        return next((r for r in self.online + self.sampled if r.policy == policy), None)


def online_policies() -> list[str]:
    return [name for name in default_policies() if not POLICIES[name].offline]


def runnable(data: ReplayInput, policies: list[str], seed: int) -> tuple[list[str], list[tuple[str, str]]]:
    """The policies that can be built for this trace's model, and (policy, why) for the others (the learned
    policy's model is for another shape, say)."""
    ok, skipped = [], []
    for policy in policies:
        try:
            make_policy(policy, data.spec, seed=seed)
        except ConfigError as exc:
            skipped.append((policy, str(exc)))
        else:
            ok.append(policy)
    return ok, skipped


def prefix_rows(data: ReplayInput, requests: int) -> int:
    """How many first rows of the trace hold at most ``requests`` expert requests (at least one row)."""
    meta = data.trace.meta
    return max(1, requests // (meta.num_layers * meta.top_k))


def measure_bound(data: ReplayInput, cache_size: int, working_set: WorkingSet | Future, *, seed: int = 0, jobs: int = 1,
                  engine: str = "auto", policies: list[str] | None = None,
                  sample_above: int | None = SAMPLE_ABOVE,
                  replay_sample_above: int | None = REPLAY_SAMPLE_ABOVE, python_prefix: bool = True,
                  step=None) -> Bound:
    """Every online policy (or ``policies``) and OPT at ``cache_size`` experts, and OPT's sizes for
    TARGET_HIT_RATES, exact, or estimated on a sample of the experts above ``sample_above`` requests; every
    replay on a sample above ``replay_sample_above`` (None: never); the policies without a kernel on the first
    rows unless ``python_prefix`` is off (module docstring). ``working_set`` may
    still be measured on another thread (a Future of it): it is waited for only where it is read, after the
    replays. ``step(text)`` is told what runs next."""
    step = step or (lambda text: None)
    policies, skipped = runnable(data, policies or online_policies(), seed)
    meta = data.trace.meta
    requests = data.trace.num_tokens * meta.num_layers * meta.top_k
    replay_rate = 1.0  # sampled above replay_sample_above, at the rate of OPT's curve
    if replay_sample_above is not None and requests > replay_sample_above:
        replay_rate = sample_rate(requests, min(sample_above or replay_sample_above, replay_sample_above))
    if replay_rate < 1:
        target = ReplayInput.sampled(data.trace, replay_rate, name=f"{data.name} ({replay_rate:.1%} of the experts)")
        size = max(meta.top_k, round(cache_size * replay_rate))
    else:
        target, size = data, cache_size
    # a placement chosen from the whole trace would hold experts a sample lacks: placements join the prefix
    compiled = [p for p in policies if replay_kernel(p, engine) is not None
                and not (replay_rate < 1 and POLICIES[p].policy.places_or_bypasses)]
    slow = [p for p in policies if p not in compiled]
    # the -dist policies' layers replayed whole where the others are sampled (module docstring)
    layered = [p for p in compiled if replay_rate < 1 and POLICIES[p].partitioned]
    compiled = [p for p in compiled if p not in layered]
    sample = None
    if slow and python_prefix and requests > PYTHON_REPLAY_REQUESTS:
        rows = prefix_rows(data, PYTHON_REPLAY_REQUESTS)
        sample = ReplayInput.of(data.trace.select(slice(0, rows)), name=f"first {rows:,} tokens", checked=True)
    full_policies = compiled + ([] if sample is not None else slow)
    side = ThreadPoolExecutor(max_workers=1)  # the first rows' Python replays, beside everything below
    # LRU beside them says how far the first rows are from the whole trace (Bound.prefix_text)
    prefix = (side.submit(replay_grid, sample, ["belady", "lru"] + [p for p in slow if p != "lru"], [cache_size],
                          seed=seed, jobs=1, engine=engine) if sample is not None else None)
    with side:
        # told, where the Python replays run whole on a long trace: they are what the step waits for
        in_python = slow if sample is None and requests > PYTHON_REPLAY_REQUESTS else []
        bound = _measure_whole(data, target, size, cache_size, policies=full_policies, in_python=in_python,
                               skipped=skipped, replay_rate=replay_rate, sample_above=sample_above, seed=seed,
                               jobs=jobs, engine=engine, step=step)
        if layered:
            step(f"the bound: {', '.join(layered)} on the whole trace, a layer at a time")
            layered.sort(key=lambda p: -POLICIES[p].policy.replay_cost)  # the longest first, as replay_grid
            with ThreadPoolExecutor(max_workers=worker_count(jobs, len(layered))) as threads:
                whole = list(threads.map(lambda p: replay(data, p, cache_size, seed=seed, engine=engine), layered))
            bound.online = sorted(bound.online + whole, key=by_hit_rate)
            bound.layer_by_layer = layered
        for column in ("token", "layer"):
            target.sequence.forget(column)
        if prefix is not None:
            placed = [p for p in slow if replay_kernel(p, engine) is not None]  # kept off the sample (above)
            groups = (([p for p in slow if p not in placed], "no compiled kernel"),
                      (placed, "placements, not on a sample"))
            named = "; ".join(f"{', '.join(names)} ({why})" for names, why in groups if names)
            step(f"the bound: {named} on the first {sample.trace.num_tokens:,} tokens")
            sampled = prefix.result()
    if sample is not None:
        bound.skipped += [(policy, why) for policy, _, why in sampled.skipped]
        bound.sampled_belady = next(r for r in sampled.results if r.policy == "belady")
        bound.sampled_lru = next(r for r in sampled.results if r.policy == "lru")
        bound.sampled = sorted((r for r in sampled.results if r.policy in slow), key=by_hit_rate)
        bound.sampled_tokens = sample.trace.num_tokens
    if isinstance(working_set, Future):
        if not working_set.done():  # on a day of traffic its exact pass over every request can end last
            step("working set: the rest of its pass over every request")
        working_set = working_set.result()
    bound.max_hit_rate = working_set.max_hit_rate()
    bound.lru_exact = working_set.lru_hit_rate(cache_size)
    if bound.replay_rate < 1:
        lru = next((r.hit_rate for r in bound.online if r.policy == "lru"), None)
        if lru is None:
            lru = lru_curve(target.sequence.expert_id, meta.num_expert_slots).hit_rate(bound.replay_size)
        bound.lru_error = lru - bound.lru_exact
    for target_rate in TARGET_HIT_RATES:
        bound.needed[target_rate] = (bound.opt.smallest_size(target_rate)
                                     if bound.max_hit_rate >= target_rate else None)
    return bound


def _measure_whole(data: ReplayInput, target: ReplayInput, size: int, cache_size: int, *,
                   policies: list[str], in_python: list[str], skipped: list, replay_rate: float,
                   sample_above: int | None, seed: int, jobs: int, engine: str, step) -> Bound:
    """Belady, OPT's curve and ``policies`` on ``target`` (the whole trace, or its sample at ``replay_rate``) at
    ``size`` experts (``cache_size`` scaled by the rate); ``in_python``, those of them the step names as replayed
    in Python."""
    meta = data.trace.meta
    # OPT's curve on a thread beside Belady and then beside the policies (its kernel releases the GIL): Belady
    # alone left a core idle once the working set was done.

    def measure_opt() -> HitCurve:
        if replay_rate < 1:  # OPT's curve on the replays' sample: exact there, its sizes scaled by the rate
            curve = opt_curve(target.sequence.expert_id, meta.num_expert_slots)
            return HitCurve(curve.histogram, rate=replay_rate)
        return measure_opt_curve(data, sample_above)

    with ThreadPoolExecutor(max_workers=1) as beside:
        measuring = beside.submit(measure_opt)
        step("the bound: Belady at the budget, OPT at every size beside it")
        belady = replay_grid(target, ["belady"], [size], seed=seed, jobs=jobs, engine=engine).results[0]
        slow = (f" ({', '.join(in_python)} in Python, with no compiled kernel: about a hundred times slower)"
                if in_python else "")
        step(f"the bound: {len(policies)} online policies at the budget{slow}, OPT at every size beside them")
        grid = replay_grid(target, policies, [size], seed=seed, jobs=jobs, engine=engine, reference=belady)
        opt = measuring.result()
    skipped += [(policy, why) for policy, _, why in grid.skipped]
    online = sorted((r for r in grid.results if r.policy != "belady"), key=by_hit_rate)
    return Bound(cache_size=cache_size, belady=belady, online=online, skipped=skipped, opt=opt,
                 replay_rate=replay_rate, replay_size=size)


def by_hit_rate(result: RunResult) -> tuple:
    """The order of the policies' rows: the highest hit rate first (the most hits, on one sequence), then by name."""
    return -result.hit_rate, result.policy


def sample_rate(requests: int, sample_above: int | None) -> float:
    """The share of the experts OPT's curve is measured on (module docstring): 1 up to ``sample_above``."""
    if sample_above is None or requests <= sample_above:
        return 1.0
    return max(MIN_SAMPLE_RATE, sample_above / requests)


def measure_opt_curve(data: ReplayInput, sample_above: int | None = SAMPLE_ABOVE) -> HitCurve:
    """OPT's hit rate at every cache size on ``data``, sampled above ``sample_above`` requests."""
    sequence = data.sequence
    rate = sample_rate(len(sequence), sample_above)
    return opt_curve(sequence.expert_id, data.trace.meta.num_expert_slots, rate=rate)


def _within_sampling_error(bound: Bound, best: RunResult) -> str:
    """Where the -dist policies replayed every request and the others a sample, the best row of the other kind
    when its hit rate is within the sample's measured error (LRU's) of ``best``'s, in words: the numbers do not
    settle which of the two is ahead. "" otherwise."""
    if not bound.layer_by_layer or bound.lru_error is None:
        return ""
    exact = best.policy in bound.layer_by_layer
    other = next((r for r in bound.online if not r.in_hindsight and (r.policy in bound.layer_by_layer) != exact),
                 None)
    if other is None or best.hit_rate - other.hit_rate > abs(bound.lru_error):
        return ""
    return (f" (or {other.policy}, {other.hit_rate:.2%} {'on the sample' if exact else 'on every request'} "
            f"against {best.hit_rate:.2%}: within the sample's error, LRU's {bound.lru_error * 100:+.2f} points)")


def verdict(bound: Bound, total_experts: int) -> str:
    """One sentence that answers "policy or working set?", with its numbers."""
    belady, best = bound.belady, bound.best
    budget = f"{bound.cache_size:,} experts ({bound.cache_size / total_experts:.1%} of {total_experts:,})"
    needs = bound.needed.get(0.5)
    if belady.hit_rate < NO_POLICY_HELPS or best is None:
        more = (f"OPT needs {needs:,} experts for 50% hits" if needs is not None
                else "no cache reaches 50% hits on this trace")
        return (f"even Belady hits only {belady.hit_rate:.0%} at {budget}: no policy helps; buy memory or cut "
                f"traffic ({more})")
    share = best.hit_rate / belady.hit_rate if belady.hits else 1.0  # hits' shares: best may be of the whole trace
    rival = _within_sampling_error(bound, best)
    head = f"{best.policy}{rival} reaches {share:.0%} of the hits Belady reaches at {budget}"
    gap = belady.hit_rate - best.hit_rate
    if share >= POLICY_CLOSE:
        target = next((t for t in TARGET_HIT_RATES if t > belady.hit_rate and bound.needed.get(t)), None)
        memory = (f"; OPT needs {bound.needed[target]:,} experts for {target:.0%} hits" if target is not None else "")
        return (f"{head}: the policy leaves only {gap:.1%} of the requests on the table; the working set, not the "
                f"policy, limits the hits{memory}")
    counted = (f" ({belady.hits - best.hits:,} hits of {belady.accesses:,})" if best.accesses == belady.accesses
               else "")
    return (f"{head}: the policy leaves {gap:.1%} of the requests{counted} on the table; a better policy, or a "
            "prefetcher, can win them")

