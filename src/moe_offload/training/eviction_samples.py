"""The training rows of FlashMoE's eviction network (paper 003, section 3.2 and Fig. 4): Belady's view of
every resident expert at sampled eviction moments.

Dataset. The training rows of one or more traces (of any model shape) are replayed at several cache sizes
by a policy whose cache states are sampled (``states``: Belady's OPT by default, the paper's reading) on
the project's ExpertCache, in the replay simulator's request order. At every eviction moment, every expert
resident in that cache becomes one sample (the paper's "masked targets": only the cached experts are
labelled): its features exactly as the policy computes them at that point
(moe_offload.policies.learned_model.features: 1/r and f / max f) and, as target, Belady's view of it, its
"routing distance" to its next request, in a form that keeps the order of the residents' next uses at any
cache size (learned_model.TARGETS):

* ``log-distance`` (the default): ln(d / (L*K)), d the requests until its next request, in tokens' worth of
  requests. The highest score is the resident Belady evicts from that cache.
* ``rank``: its rank among the residents by next request, averaged over ties, scaled to [0, 1] (Belady's
  victim, the furthest, has 1): the same scale at every cache size.

The paper says "assuming Belady's optimal cache replacement algorithm, masked target data indicating which
experts should be evicted at each time step were generated", which reads as Belady's own cache states.
A running online policy keeps experts Belady would long have dropped, so ``states`` may name other
policies (``lru``: LRU's states, each resident still labelled with its next use, i.e. Belady's choice
from that state). On the bundled OLMoE trace (rows 0:150 trained, 150:299 held out, one network) Belady's
states did better at every size: 0.711, 0.877, 0.987 and 1.019 of LRU's misses at 64, 128, 256 and 512
experts, against 0.727, 0.909, 1.097 and 1.215 from LRU's states and 0.719, 0.895, 1.067 and 1.170 from
both; the ``rank`` target did worse than ``log-distance`` with either (README, "The learned policy").

An expert not requested again within the rows is as far as any (log-distance: d is the requests left to
the end of the rows, a lower bound; rank: tied at the top), and the moments of the last
``CENSOR_TOKENS`` tokens of the rows, where that happens to most residents, are left out. Version 1 capped
the distance at two tokens: at 256 and 512 cached OLMoE experts 49% and 66% of Belady's residents shared
the capped target and the network could not tell Belady's victim apart. A large cache evicts less often
but has more residents, so each (trace, cache size, state policy) gives at most ``max_samples`` samples,
from eviction moments drawn at random (seeded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies import policy_info
from moe_offload.policies.base import AccessContext, EvictionPolicy, ModelSpec
from moe_offload.policies.learned_model import TARGETS, features
from moe_offload.simulator.cache import ExpertCache
from moe_offload.trace.flatten import NEVER, flatten
from moe_offload.trace.format import Trace
from moe_offload.values import integer

CENSOR_TOKENS = 16   # eviction moments this close to the end of the rows are left out (module doc)


@dataclass
class TrainingSource:
    """Rows ``rows`` (start, end) of ``trace``, replayed with Belady at each of ``cache_sizes`` (experts)."""

    trace: Trace
    rows: tuple[int, int]
    cache_sizes: list[int]

    @property
    def name(self) -> str:
        return Path(self.trace.path).name if self.trace.path != "<memory>" else "<memory>"


_FIELDS = ("recency", "freq", "max_freq", "distance", "remaining", "layer", "moment", "token", "clock", "chosen",
           "cache_size", "source")


@dataclass
class BeladySamples:
    """One entry per (eviction moment, resident expert) of the replays whose cache states are sampled."""

    recency: np.ndarray     # int64, r (0: never routed)
    freq: np.ndarray        # int64, f
    max_freq: np.ndarray    # int64, max f at that moment
    distance: np.ndarray    # int64, requests until the expert's next request (-1: none in these rows)
    remaining: np.ndarray   # int64, requests from the moment to the end of the rows
    layer: np.ndarray       # int64, the expert's MoE layer
    moment: np.ndarray      # int64, index of the eviction moment (unique over sources and cache sizes)
    token: np.ndarray       # int64, token (row within the source's rows) of the eviction moment
    clock: np.ndarray       # int64, request index of the eviction moment
    chosen: np.ndarray      # bool, the victim of the policy whose states these are
    cache_size: np.ndarray  # int64
    source: np.ndarray      # int64, index of the TrainingSource
    per_token: np.ndarray   # int64, L*K of the source: requests per token

    def __len__(self) -> int:
        return int(self.recency.shape[0])

    @property
    def moments(self) -> int:
        return int(np.unique(self.moment).size)

    def select(self, mask: np.ndarray) -> "BeladySamples":
        return BeladySamples(**{name: getattr(self, name)[mask] for name in (*_FIELDS, "per_token")})

    @classmethod
    def concatenate(cls, parts: list["BeladySamples"]) -> "BeladySamples":
        return cls(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in (*_FIELDS, "per_token")})

    def inputs(self) -> np.ndarray:
        out = np.empty((len(self), 2), dtype=np.float32)
        # features() takes one max f; the rows here have many, so apply it per distinct max f.
        for value in np.unique(self.max_freq).tolist():
            rows = self.max_freq == value
            out[rows] = features(self.recency[rows], self.freq[rows], value)
        return out

    def targets(self, kind: str) -> np.ndarray:
        """The training target of every sample (learned_model.TARGETS; higher = requested later)."""
        if kind == "log-distance":
            d = np.where(self.distance < 0, self.remaining + 1, self.distance).astype(np.float64)
            return np.log(d / self.per_token)
        if kind != "rank":
            raise ConfigError(f"unknown target {kind!r}; choose from {', '.join(TARGETS)}")
        far = np.where(self.distance < 0, np.iinfo(np.int64).max, self.distance)
        order = np.lexsort((far, self.moment))
        moment, far = self.moment[order], far[order]
        starts = np.r_[True, moment[1:] != moment[:-1]]
        group = np.cumsum(starts) - 1
        first = np.flatnonzero(starts)
        position = np.arange(order.size) - first[group]
        tie = np.cumsum(np.r_[True, (moment[1:] != moment[:-1]) | (far[1:] != far[:-1])]) - 1
        mean_position = np.bincount(tie, weights=position) / np.bincount(tie)
        size = np.bincount(group)
        out = np.empty(order.size, dtype=np.float64)
        out[order] = mean_position[tie] / np.maximum(size[group] - 1, 1)
        return out


class _Recorder(EvictionPolicy):
    """Drives ``inner`` (the behaviour policy whose cache states are sampled) and tracks the learned
    policy's features by the same rules as LearnedEviction.on_access; at each of the inner policy's
    evictions it records every resident expert's features and its distance to its next request."""

    def __init__(self, spec: ModelSpec, inner: EvictionPolicy, num_keys: int):
        super().__init__(spec)
        self.inner = inner
        self.last_token = np.full(num_keys, -1, dtype=np.int64)
        self.freq = np.zeros(num_keys, dtype=np.int64)
        self.next_use = np.full(num_keys, NEVER, dtype=np.int64)
        self.resident = np.zeros(num_keys, dtype=bool)
        self.max_freq = 0
        self.records: list[tuple] = []

    def on_access(self, key, ctx):
        self.inner.on_access(key, ctx)
        if self.last_token[key] != ctx.token:  # several requests in one token are one routing
            self.last_token[key] = ctx.token
            freq = int(self.freq[key]) + 1
            self.freq[key] = freq
            self.max_freq = max(self.max_freq, freq)
        self.next_use[key] = ctx.next_use

    def on_insert(self, key, ctx):
        self.inner.on_insert(key, ctx)
        self.resident[key] = True

    def on_evict(self, key):
        self.inner.on_evict(key)
        self.resident[key] = False

    def victim(self, ctx):
        chosen = self.inner.victim(ctx)
        keys = np.flatnonzero(self.resident)
        last = self.last_token[keys]
        nxt = self.next_use[keys]
        self.records.append((keys, np.where(last >= 0, ctx.token - last + 1, 0), self.freq[keys],
                             np.where(nxt == NEVER, -1, nxt - ctx.clock), chosen, ctx.token, self.max_freq, ctx.clock))
        return chosen


def collect_belady_samples(source: TrainingSource, *, behaviour: str = "belady", source_index: int = 0,
                           moment_base: int = 0, max_samples: int | None = None,
                           rng: np.random.Generator | None = None) -> BeladySamples:
    """Replay ``source``'s rows (in the replay simulator's request order) on the project's cache at each of
    its cache sizes, evicting by the policy named ``behaviour``, and record the eviction moments, every
    resident labelled with its next request; at most ``max_samples`` samples per size, from moments drawn
    with ``rng``."""
    trace = source.trace.select(slice(*source.rows))
    seq = flatten(trace)
    L, J, K = trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k
    spec = ModelSpec(L, J, K)
    keys, tokens, next_use = seq.expert_id.tolist(), seq.token.tolist(), seq.next_use.tolist()
    n = len(keys)
    parts = []
    moment = moment_base
    for size in source.cache_sizes:
        inner = policy_info(behaviour).policy(spec)
        policy = _Recorder(spec, inner, L * J)
        cache = ExpertCache(size, policy)
        ctx = AccessContext()
        for t, key in enumerate(keys):
            ctx.clock = t
            ctx.token = tokens[t]
            ctx.layer = t % L
            ctx.next_use = next_use[t]
            cache.request(key, ctx)
        records = policy.records
        if max_samples is not None and records and len(records) * size > max_samples:
            keep = max(1, max_samples // size)
            picked = np.sort((rng or np.random.default_rng(0)).choice(len(records), size=keep, replace=False))
            records = [records[i] for i in picked.tolist()]
        if not records:
            continue
        counts = np.array([rec[0].shape[0] for rec in records])
        resident = np.concatenate([rec[0] for rec in records])
        rep = lambda i: np.repeat(np.array([rec[i] for rec in records], dtype=np.int64), counts)  # noqa: E731
        clock = rep(7)
        parts.append(BeladySamples(
            recency=np.concatenate([rec[1] for rec in records]).astype(np.int64),
            freq=np.concatenate([rec[2] for rec in records]).astype(np.int64),
            max_freq=rep(6),
            distance=np.concatenate([rec[3] for rec in records]).astype(np.int64),
            remaining=n - clock,
            layer=resident // J,
            moment=np.repeat(np.arange(moment, moment + len(records), dtype=np.int64), counts),
            token=rep(5), clock=clock,
            chosen=resident == rep(4),
            cache_size=np.full(resident.size, size, dtype=np.int64),
            source=np.full(resident.size, source_index, dtype=np.int64),
            per_token=np.full(resident.size, L * K, dtype=np.int64)))
        moment += len(records)
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return BeladySamples(**{name: (np.zeros(0, bool) if name == "chosen" else empty)
                                for name in (*_FIELDS, "per_token")})
    return BeladySamples.concatenate(parts)


def agreement(samples: BeladySamples, scores: np.ndarray) -> float:
    """Fraction of eviction moments where the highest-scored resident is as far from reuse as Belady's
    victim (ties in Belady's choice count as agreement)."""
    if len(samples) == 0:
        return float("nan")
    order = np.lexsort((-scores, samples.moment))  # per moment, best score first
    moment = samples.moment[order]
    first = np.flatnonzero(np.r_[True, moment[1:] != moment[:-1]])
    far = np.where(samples.distance < 0, np.iinfo(np.int64).max, samples.distance)[order]
    best_far = np.maximum.reduceat(far, first)
    return float((far[first] == best_far).mean())


def pair_order_accuracy(samples: BeladySamples, scores: np.ndarray, seed: int = 0) -> float:
    """Fraction of resident pairs, at the same eviction moment and with different next uses, that ``scores``
    order as their next uses (the later one scored higher; equal scores count half). One pair per sample: the
    sample and a partner drawn uniformly from its moment (seeded), so a moment's weight is its residents."""
    if len(samples) == 0:
        return float("nan")
    order = np.argsort(samples.moment, kind="stable")
    moment = samples.moment[order]
    starts = np.flatnonzero(np.r_[True, moment[1:] != moment[:-1]])
    sizes = np.diff(np.r_[starts, moment.size])
    group = np.repeat(np.arange(starts.size), sizes)
    partner = starts[group] + (np.random.default_rng(seed).random(moment.size) * sizes[group]).astype(np.int64)
    far = np.where(samples.distance < 0, np.iinfo(np.int64).max, samples.distance)[order]
    score = np.asarray(scores, dtype=np.float64)[order]
    later = np.sign(far - far[partner])
    valid = later != 0
    if not valid.any():
        return float("nan")
    agree = np.sign(score - score[partner])[valid] * later[valid]
    return float(np.mean(np.where(agree == 0, 0.5, agree > 0)))


def check_sources(sources: Sequence[TrainingSource], per_layer: bool) -> None:
    """ConfigError for rows, cache sizes or (per layer) model shapes that cannot be trained on."""
    if not sources:
        raise ConfigError("give at least one training trace")
    for source in sources:
        meta, (start, end) = source.trace.meta, source.rows
        n = source.trace.num_tokens
        if not 0 <= start < end <= n:
            raise ConfigError(f"{source.trace.path}: training rows {start}:{end} are not within its {n} rows")
        if end - start <= CENSOR_TOKENS:
            raise ConfigError(f"{source.trace.path}: training rows {start}:{end} hold no more than the "
                              f"{CENSOR_TOKENS} tokens at their end that are left out: give more rows")
        if not source.cache_sizes:
            raise ConfigError(f"{source.trace.path}: give at least one cache size")
        for size in source.cache_sizes:
            size = integer(size, f"{source.trace.path}: cache size (--cache-sizes)", low=1)
            if not meta.top_k <= size < meta.num_expert_slots:
                raise ConfigError(f"{source.trace.path}: cache size {size} must be at least top-k = {meta.top_k} and "
                                  f"below its {meta.num_expert_slots} experts (a cache that holds them all never "
                                  "evicts)")
    layers = {source.trace.meta.num_layers for source in sources}
    if per_layer and len(layers) > 1:
        raise ConfigError(f"per-layer networks need traces with the same number of MoE layers, these have "
                          f"{', '.join(map(str, sorted(layers)))}")
