"""The bound: how far the online policies are from Belady's OPT at a budget, and what budget OPT needs.

Belady's OPT (evict the expert requested furthest in the future) has the fewest misses of any demand-paging
policy on a sequence, so its hit rate at a budget is the most any policy can get there: the gap between it
and the best online policy is what a better policy could win, and OPT's own hit rate is what a better policy
cannot exceed. Every run is the replay `moe-offload simulate` makes (simulator/replay.py, the compiled kernels
where a policy has one), so the numbers are simulate's.

The budget OPT needs for a hit rate h is found by searching the cache size: OPT is a stack algorithm
(the contents of a cache of C experts are always among those of a cache of C + 1, Mattson et al. 1970), so
its hits do not decrease with the size. The search runs between top-k and the smallest size at which LRU
already reaches h (LRU's hits never exceed OPT's at the same size, and LRU's curve is known from the reuse
distances for free: reporting/working_set.py), its steps alternately the point where the line between the
bracket's ends reaches h (the curve is smooth, so this is usually close) and the bracket's middle (so it is
never slower than twice a bisection). A hit rate above every cache's (all requests but the first
of each expert) is unreachable and said so.

Policies without a compiled kernel run their Python objects, about a hundred times slower: on a trace of more
requests than PYTHON_REPLAY_REQUESTS they replay its first rows only (up to that many requests), beside OPT on
the same rows, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_offload.errors import ConfigError
from moe_offload.policies import POLICIES, make_policy
from moe_offload.results import RunResult
from moe_offload.reporting.working_set import WorkingSet
from moe_offload.simulator.replay import ReplayInput, replay, replay_grid, replay_kernel

TARGET_HIT_RATES = (0.5, 0.8, 0.9)
PYTHON_REPLAY_REQUESTS = 250_000
# Verdict thresholds: below NO_POLICY_HELPS even OPT misses most requests; at or above POLICY_CLOSE of OPT's
# hits the online policy is near the bound, so memory, not the policy, is the lever.
NO_POLICY_HELPS = 0.30
POLICY_CLOSE = 0.90


@dataclass
class Bound:
    cache_size: int
    belady: RunResult
    online: list[RunResult]                 # full-trace runs, most hits first
    sampled: list[RunResult] = field(default_factory=list)  # Python policies on the first rows (see above)
    sampled_belady: RunResult | None = None
    sampled_tokens: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (policy, why it did not run)
    needed: dict[float, int | None] = field(default_factory=dict)  # target hit rate -> OPT's size, None: never
    max_hit_rate: float = 1.0

    @property
    def best(self) -> RunResult | None:
        """The online policy with the most hits: a placement chosen from this very trace (in hindsight) is
        a bound like OPT, not a policy a user can run on traffic to come."""
        return next((r for r in self.online if not r.in_hindsight), None)

    def result(self, policy: str) -> RunResult | None:
        return next((r for r in self.online + self.sampled if r.policy == policy), None)


def online_policies() -> list[str]:
    return [name for name, info in POLICIES.items() if not info.offline]


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


def measure_bound(data: ReplayInput, cache_size: int, working_set: WorkingSet, *, seed: int = 0, jobs: int = 1,
                  engine: str = "auto", policies: list[str] | None = None) -> Bound:
    """Every online policy (or ``policies``) and OPT at ``cache_size`` experts, and OPT's sizes for
    TARGET_HIT_RATES (module docstring)."""
    policies, skipped = runnable(data, policies or online_policies(), seed)
    compiled = [p for p in policies if replay_kernel(p, engine) is not None]
    slow = [p for p in policies if p not in compiled]
    sample = None
    if slow and len(data.sequence) > PYTHON_REPLAY_REQUESTS:
        rows = prefix_rows(data, PYTHON_REPLAY_REQUESTS)
        sample = ReplayInput.of(data.trace.select(slice(0, rows)), name=f"first {rows:,} tokens")
    full_policies = compiled + ([] if sample is not None else slow)
    grid = replay_grid(data, ["belady"] + full_policies, [cache_size], seed=seed, jobs=jobs, engine=engine)
    skipped += [(policy, why) for policy, _, why in grid.skipped]
    belady = next(r for r in grid.results if r.policy == "belady")
    online = sorted((r for r in grid.results if r.policy != "belady"), key=lambda r: (-r.hits, r.policy))
    bound = Bound(cache_size=cache_size, belady=belady, online=online, skipped=skipped,
                  max_hit_rate=working_set.max_hit_rate())
    if sample is not None:
        sampled = replay_grid(sample, ["belady"] + slow, [cache_size], seed=seed, jobs=jobs, engine=engine)
        bound.skipped += [(policy, why) for policy, _, why in sampled.skipped]
        bound.sampled_belady = next(r for r in sampled.results if r.policy == "belady")
        bound.sampled = sorted((r for r in sampled.results if r.policy != "belady"), key=lambda r: (-r.hits, r.policy))
        bound.sampled_tokens = sample.trace.num_tokens
    known = {cache_size: belady.hits}
    for target in TARGET_HIT_RATES:
        bound.needed[target] = belady_size_for(data, target, working_set, known, engine)
    return bound


def belady_size_for(data: ReplayInput, target: float, working_set: WorkingSet, known: dict[int, int],
                    engine: str = "auto") -> int | None:
    """The smallest cache size at which OPT hits at least ``target`` of the requests, or None when no cache
    does; ``known`` (size -> OPT's hits) is read and extended, so several targets share their runs."""
    meta = data.trace.meta
    requests = len(data.sequence)
    if working_set.max_hit_rate() < target:
        return None

    def reaches(size: int) -> bool:
        if size not in known:
            known[size] = replay(data, "belady", size, engine=engine).hits
        return known[size] >= target * requests

    # the bracket: above the largest size known to fall short (or top-k), at most the smallest known to reach
    # it (or where LRU reaches it)
    goal = target * requests
    low = max([size for size, hits in known.items() if hits < goal], default=meta.top_k)
    high = min([size for size, hits in known.items() if hits >= goal]
               + [next((size for size in range(low, meta.num_expert_slots + 1)
                        if working_set.lru_hit_rate(size) >= target), meta.num_expert_slots)])
    if low == meta.top_k and reaches(low):
        return low
    known.setdefault(meta.top_k - 1, 0)  # a cache smaller than top-k hits nothing: an end for interpolating
    interpolate = True
    while high - low > 1:  # reaches(high), not reaches(low)
        middle = (low + high) // 2
        if interpolate and high in known:  # the size where the line between the ends reaches the goal
            share = (goal - known[low]) / max(1, known[high] - known[low])
            middle = min(high - 1, max(low + 1, round(low + share * (high - low))))
        interpolate = not interpolate  # every other step halves the bracket: never slower than bisection x 2
        if reaches(middle):
            high = middle
        else:
            low = middle
    return high


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
    share = best.hits / belady.hits if belady.hits else 1.0
    head = f"{best.policy} reaches {share:.0%} of the hits Belady reaches at {budget}"
    gap = (belady.hits - best.hits) / belady.accesses
    if share >= POLICY_CLOSE:
        target = next((t for t in TARGET_HIT_RATES if t > belady.hit_rate and bound.needed.get(t)), None)
        memory = (f"; OPT needs {bound.needed[target]:,} experts for {target:.0%} hits" if target is not None else "")
        return (f"{head}: the policy leaves only {gap:.1%} of the requests on the table; the working set, not the "
                f"policy, limits the hits{memory}")
    return (f"{head}: the policy leaves {gap:.1%} of the requests ({belady.hits - best.hits:,} hits of "
            f"{belady.accesses:,}) on the table; a better policy, or a prefetcher, can win them")

