"""Train FlashMoE's eviction network (paper 003, section 3.2 and Fig. 4) from Belady's decisions.

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

Training. The features are integers in disguise (r, f, max f), so many samples share an input; samples
with equal inputs are merged into one row weighted by their count with their mean target, which leaves
the MSE and its gradient unchanged and makes an epoch cheap. Network: 2 -> 128 -> 128 -> 1 with SiLU
(Table 1), MSE loss, AdamW lr 1e-3, weight decay 1e-2, batches of 4,096 merged rows, fixed seed, early
stopping on a validation split (the eviction moments of the last ``val_fraction`` of each trace's kept
tokens). ``per_layer`` trains one network per MoE layer on the samples of that layer's experts (the
paper's "per-layer ML cache FFN"; targets still ranked over the whole cache, so that the networks' scores
compare), all traces then needing the same number of layers. CPU, PyTorch imported here only.
"""

from __future__ import annotations

import hashlib
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moe_offload import __version__
from moe_offload.errors import ConfigError
from moe_offload.models import require_model_stack
from moe_offload.policies import policy_info
from moe_offload.policies.base import AccessContext, EvictionPolicy, ModelSpec
from moe_offload.policies.learned_model import FEATURE_NAMES, TARGETS, LearnedModel, features, save_model
from moe_offload.simulator.cache import ExpertCache
from moe_offload.trace.flatten import NEVER, flatten
from moe_offload.trace.format import Trace
from moe_offload.values import integer, number

HIDDEN = (128, 128)  # paper 003, Table 1: 3 linear layers, hidden size 128
CENSOR_TOKENS = 16   # eviction moments this close to the end of the rows are left out (module doc)


# ------------------------------------------------------------------------------------------------ dataset

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


@dataclass
class _Merged:
    """Samples with equal inputs merged: x [U, 2], mean target y [U], count w [U]; ``within`` is the sum of
    squared deviations from the row means (the part of the MSE no network can remove)."""

    x: np.ndarray
    y: np.ndarray
    w: np.ndarray
    within: float

    @classmethod
    def of(cls, inputs: np.ndarray, targets: np.ndarray) -> "_Merged":
        packed = np.ascontiguousarray(inputs, dtype=np.float32).view(np.int64)[:, 0]  # both floats, exactly
        unique, first, index = np.unique(packed, return_index=True, return_inverse=True)
        index = index.reshape(-1)
        w = np.bincount(index, minlength=unique.size).astype(np.float64)
        y = np.bincount(index, weights=targets, minlength=unique.size) / w
        within = float(((targets - y[index]) ** 2).sum())
        return cls(x=inputs[first], y=y, w=w, within=within)

    def mse(self, prediction: np.ndarray) -> float:
        """The MSE over the original samples of a prediction per merged row."""
        return float(((prediction - self.y) ** 2 * self.w).sum() + self.within) / float(self.w.sum())


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


# ------------------------------------------------------------------------------------------------ training

@dataclass
class TrainingResult:
    model: LearnedModel
    target: dict
    training: dict
    history: list[list[tuple[int, float, float]]] = field(default_factory=list)  # per network: (epoch, train, val)

    def save(self, path) -> Path:
        return save_model(path, self.model.layers, per_layer=self.model.per_layer, target=self.target,
                          training=self.training)


def file_sha256(path) -> str | None:
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as source:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    except OSError:
        return None


@dataclass
class _Fit:
    layers: list
    history: list
    best_epoch: int
    train_loss: float
    validation_loss: float
    epochs_run: int
    stopped: str


def _fit(torch, train_m: _Merged, val_m: _Merged, *, epochs: int, patience: int, batch_size: int, seed: int,
         deadline: float | None, say: Callable[[str], None]) -> _Fit:
    """Weighted-MSE training of the paper's network on merged rows, early stopping on ``val_m``."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    widths = (len(FEATURE_NAMES), *HIDDEN, 1)
    modules = []
    for i in range(len(widths) - 1):
        modules.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            modules.append(torch.nn.SiLU())
    net = torch.nn.Sequential(*modules)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)

    x = torch.from_numpy(train_m.x)
    y = torch.from_numpy(train_m.y.astype(np.float32))
    w = torch.from_numpy(train_m.w.astype(np.float32))
    rows = x.shape[0]
    scale = float(rows) / float(train_m.w.sum())  # E[batch loss] = the MSE over all samples
    xv = torch.from_numpy(val_m.x)

    def predict(inputs) -> np.ndarray:
        with torch.no_grad():
            return net(inputs)[:, 0].double().numpy()

    best_loss, best_epoch, best_state = math.inf, 0, None
    history = []
    epoch = 0
    stopped = "maximum epochs reached"
    for epoch in range(1, epochs + 1):
        net.train()
        order = torch.randperm(rows, generator=generator)
        for first in range(0, rows, batch_size):
            batch = order[first:first + batch_size]
            err = net(x[batch])[:, 0] - y[batch]
            loss = (w[batch] * err * err).sum() * (scale / batch.shape[0])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        net.eval()
        train_mse, val_mse = train_m.mse(predict(x)), val_m.mse(predict(xv))
        history.append((epoch, train_mse, val_mse))
        if val_mse < best_loss - 1e-7:
            best_loss, best_epoch = val_mse, epoch
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if epoch == 1 or epoch % 10 == 0:
            say(f"epoch {epoch:4d}  train MSE {train_mse:.6f}  validation MSE {val_mse:.6f}")
        if epoch - best_epoch >= patience:
            stopped = f"early stop, no validation improvement in {patience} epochs"
            break
        if deadline is not None and time.perf_counter() > deadline:
            stopped = "time limit reached"
            break
    if best_state is None:  # the validation loss was never finite
        raise ConfigError("training diverged: the validation loss is not a finite number")
    net.load_state_dict(best_state)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().numpy().astype(np.float32), m.bias.detach().numpy().astype(np.float32))
              for m in linears]
    return _Fit(layers=layers, history=history, best_epoch=best_epoch, train_loss=history[best_epoch - 1][1],
                validation_loss=best_loss, epochs_run=epoch, stopped=stopped)


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


def train_learned_eviction(sources: Sequence[TrainingSource], *, target: str = "log-distance",
                           per_layer: bool = False, states: Sequence[str] = ("belady",),
                           epochs: int = 200, patience: int = 20, val_fraction: float = 0.2,
                           max_samples: int | None = 50_000, batch_size: int = 4096, seed: int = 0,
                           threads: int | None = None, time_limit: float | None = 600.0,
                           log: Callable[[str], None] | None = None) -> TrainingResult:
    """Build the Belady dataset on every source and fit the network (one, or one per MoE layer).

    The validation split is the eviction moments in the last ``val_fraction`` of each source's kept
    tokens. ``time_limit`` (seconds, for the whole run) stops training early, as if the patience ran out."""
    require_model_stack("training the learned eviction", ("torch",))
    import torch

    say = log or (lambda message: None)
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
    val_fraction = number(val_fraction, "the validation fraction (--val-fraction)", low=0, high=1, low_open=True,
                          high_open=True)
    epochs = integer(epochs, "epochs (--epochs)", low=1)
    patience = integer(patience, "patience (--patience)", low=1)
    seed = integer(seed, "seed (--seed)", low=0)
    if threads is not None:
        threads = integer(threads, "threads (--threads)", low=1)
    if max_samples is not None:
        max_samples = integer(max_samples, "the samples per trace and cache size (--max-samples)", low=1)
    if time_limit is not None:
        time_limit = number(time_limit, "the time limit (--time-limit)", low=0, low_open=True)
    sources = list(sources)
    check_sources(sources, per_layer)
    states = list(states)
    for name in states:
        if policy_info(name).partitioned:
            raise ConfigError(f"{name} splits the cache per layer; sample the states of a shared-cache policy")
    if not states:
        raise ConfigError("give at least one policy whose cache states are sampled")
    if threads:
        torch.set_num_threads(threads)
    began = time.perf_counter()
    deadline = None if time_limit is None else began + time_limit
    rng = np.random.default_rng(seed)

    parts, described, moment = [], [], 0
    for index, source in enumerate(sources):
        start, end = source.rows
        collected = []
        for behaviour in states:
            collected.append(collect_belady_samples(source, behaviour=behaviour, source_index=index,
                                                    moment_base=moment, max_samples=max_samples, rng=rng))
            moment += collected[-1].moments
        samples = BeladySamples.concatenate(collected)
        kept_tokens = end - start - CENSOR_TOKENS
        samples = samples.select(samples.token < kept_tokens)
        split = int(math.floor(kept_tokens * (1.0 - val_fraction)))
        parts.append(samples)
        described.append({
            "trace": source.name,
            "sha256": file_sha256(source.trace.path) if source.trace.path != "<memory>" else None,
            "model": source.trace.meta.model,
            "shape": {"num_layers": source.trace.meta.num_layers, "num_experts": source.trace.meta.num_experts,
                      "top_k": source.trace.meta.top_k},
            "rows": f"{start}:{end}",
            "validation_rows": f"{start + split}:{start + kept_tokens}",
            "cache_sizes": list(source.cache_sizes),
            "eviction_moments": samples.moments,
            "samples": len(samples),
        })
        say(f"{source.name} rows {start}:{end}, cache sizes {', '.join(map(str, source.cache_sizes))}: "
            f"{samples.moments} eviction moments of {', '.join(map(str, states))}, {len(samples)} samples "
            f"(moments of the last {CENSOR_TOKENS} tokens left out; validation from row {start + split}); "
            f"{time.perf_counter() - began:.1f} s")
    samples = BeladySamples.concatenate(parts)
    splits = np.array([int(math.floor((s.rows[1] - s.rows[0] - CENSOR_TOKENS) * (1.0 - val_fraction)))
                       for s in sources])
    is_val = samples.token >= splits[samples.source]
    train_s, val_s = samples.select(~is_val), samples.select(is_val)
    if len(train_s) == 0 or len(val_s) == 0:
        raise ConfigError("the training rows at these cache sizes leave no Belady eviction moments for training or "
                          "for validation: use more rows or smaller caches")
    train_y, val_y = train_s.targets(target), val_s.targets(target)
    train_x, val_x = train_s.inputs(), val_s.inputs()

    networks = sources[0].trace.meta.num_layers if per_layer else 1
    fits = []
    for network in range(networks):
        train_rows = train_s.layer == network if per_layer else slice(None)
        val_rows = val_s.layer == network if per_layer else slice(None)
        train_m = _Merged.of(train_x[train_rows], train_y[train_rows])
        val_m = _Merged.of(val_x[val_rows], val_y[val_rows])
        if train_m.x.shape[0] == 0 or val_m.x.shape[0] == 0:
            raise ConfigError(f"layer {network} has no training or no validation samples: use more rows")
        say(f"{'layer %d: ' % network if per_layer else ''}{int(train_m.w.sum())} train / "
            f"{int(val_m.w.sum())} validation samples, {train_m.x.shape[0]} / {val_m.x.shape[0]} distinct inputs")
        # the time left is shared equally by the networks still to train
        now = time.perf_counter()
        share = None if deadline is None else now + (deadline - now) / (networks - network)
        fits.append(_fit(torch, train_m, val_m, epochs=epochs, patience=patience, batch_size=batch_size,
                         seed=seed + network, deadline=share, say=say))
    layers = [(np.stack([fit.layers[i][0] for fit in fits]), np.stack([fit.layers[i][1] for fit in fits]))
              for i in range(len(fits[0].layers))]
    model = LearnedModel(layers=layers, metadata={"architecture": {"per_layer": per_layer}})
    val_agree = agreement(val_s, model.forward(val_x, val_s.layer).astype(np.float64))
    train_loss = float(np.mean([fit.train_loss for fit in fits]))
    val_loss = float(np.mean([fit.validation_loss for fit in fits]))
    say(f"{'; '.join(sorted({fit.stopped for fit in fits}))} after {max(fit.epochs_run for fit in fits)} epochs; "
        f"train MSE {train_loss:.6f}, validation MSE {val_loss:.6f}; the highest score is as far from reuse as "
        f"Belady's victim at {val_agree:.1%} of validation evictions ({time.perf_counter() - began:.1f} s)")

    target_meta = {
        "kind": target,
        "definition": TARGETS[target],
        "samples": f"every expert resident in the cache of {', '.join(states)} at each of its evictions (sampled "
                   "moments), labelled with its next request",
        "censored": f"moments of the last {CENSOR_TOKENS} tokens of each trace's rows left out; an expert not "
                    "requested again within the rows is as far as any",
        "loss": "MSE",
    }
    training = {
        "traces": described,
        "states": states,
        "per_layer": per_layer,
        "max_samples_per_trace_and_size": max_samples,
        "train_samples": len(train_s),
        "validation_samples": len(val_s),
        "seed": seed,
        "optimizer": "AdamW",
        "learning_rate": 1e-3,
        "weight_decay": 1e-2,
        "batch_size": batch_size,
        "max_epochs": epochs,
        "epochs_run": [fit.epochs_run for fit in fits],
        "best_epoch": [fit.best_epoch for fit in fits],
        "patience": patience,
        "stopped": sorted({fit.stopped for fit in fits}),
        "train_loss": train_loss,
        "validation_loss": val_loss,
        "validation_agreement_with_belady": val_agree,
        "seconds": round(time.perf_counter() - began, 1),
        "torch_version": str(torch.__version__),
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "moe_offload_version": __version__,
    }
    model.metadata = {"architecture": {"per_layer": per_layer}, "target": target_meta, "training": training}
    return TrainingResult(model=model, target=target_meta, training=training, history=[fit.history for fit in fits])


# ---------------------------------------------------------------------------------------------- evaluation

def evaluate_policies(trace: Trace, cache_sizes: Sequence[int], model: LearnedModel,
                      policies: Sequence[str] = ("learned", "lru", "belady")) -> dict[int, dict[str, int]]:
    """Misses of each policy at each cache size on ``trace`` (the held-out rows), learned with ``model``."""
    from moe_offload.simulator.replay import ReplayInput, replay

    data = ReplayInput.of(trace)
    out: dict[int, dict[str, int]] = {}
    for size in cache_sizes:
        out[size] = {}
        for policy in policies:
            options = {"model": model} if policy == "learned" else None
            out[size][policy] = replay(data, policy, size, options=options).misses
    return out
