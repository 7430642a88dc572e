"""Train FlashMoE's eviction network (paper 003, section 3.2 and Fig. 4) from Belady's decisions.

Dataset. The training rows of a trace are replayed with Belady's OPT (the project's Belady policy on the
project's ExpertCache, in the replay simulator's request order) at one or more cache sizes. At every
eviction moment, every expert resident in Belady's cache at that moment becomes one sample: its features
exactly as the policy computes them at that point (moe_offload.policies.learned_model.features: 1/r and
f / max f) and, as target, its distance to its next request d (in requests), normalised as
min(d, H) / H with a horizon H of a few tokens' worth of requests; an expert not requested again in the
training rows gets 1. Only resident experts at eviction moments are samples (the paper's masked targets):
the network learns which resident is furthest from reuse, so its argmax imitates Belady's victim.

Training. The features are integers in disguise (r, f, max f), so many samples share an input; samples
with equal inputs are merged into one row weighted by their count with their mean target, which leaves
the MSE and its gradient unchanged and makes an epoch cheap. Network: 2 -> 128 -> 128 -> 1 with SiLU
(Table 1), MSE loss, AdamW lr 1e-3, weight decay 1e-2, fixed seed, early stopping on a validation split
(the eviction moments of the last ``val_fraction`` of the training tokens). CPU, PyTorch imported here only.
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
from moe_offload.values import integer, number
from moe_offload.models import require_model_stack
from moe_offload.policies.base import AccessContext, ModelSpec
from moe_offload.policies.belady import Belady
from moe_offload.policies.learned_model import FEATURE_NAMES, LearnedModel, features, save_model
from moe_offload.simulator.cache import ExpertCache
from moe_offload.trace.flatten import NEVER, flatten
from moe_offload.trace.format import Trace

HIDDEN = (128, 128)  # paper 003, Table 1: 3 linear layers, hidden size 128


# ------------------------------------------------------------------------------------------------ dataset

@dataclass
class BeladySamples:
    """One entry per (eviction moment, resident expert) of Belady's replay."""

    recency: np.ndarray    # int64, r (0: never routed)
    freq: np.ndarray       # int64, f
    max_freq: np.ndarray   # int64, max f at that moment
    distance: np.ndarray   # int64, requests until the expert's next request (-1: none in these rows)
    moment: np.ndarray     # int64, index of the eviction moment (over all cache sizes)
    token: np.ndarray      # int64, token of the eviction moment
    clock: np.ndarray      # int64, request index of the eviction moment
    chosen: np.ndarray     # bool, Belady's victim
    cache_size: np.ndarray  # int32
    moments: int = 0

    def __len__(self) -> int:
        return int(self.recency.shape[0])

    def select(self, mask: np.ndarray) -> "BeladySamples":
        return BeladySamples(*(getattr(self, name)[mask] for name in
                               ("recency", "freq", "max_freq", "distance", "moment", "token", "clock",
                                "chosen", "cache_size")), moments=int(np.unique(self.moment[mask]).size))

    def inputs(self) -> np.ndarray:
        out = np.empty((len(self), 2), dtype=np.float32)
        # features() takes one max f; the rows here have many, so apply it per distinct max f.
        for value in np.unique(self.max_freq).tolist():
            rows = self.max_freq == value
            out[rows] = features(self.recency[rows], self.freq[rows], value)
        return out

    def targets(self, horizon: int) -> np.ndarray:
        d = self.distance
        return np.where(d < 0, 1.0, np.minimum(d, horizon) / horizon).astype(np.float64)


class _RecordingBelady(Belady):
    """Belady's OPT that also tracks the learned policy's features (the same rules as
    LearnedEviction.on_access) and records, at each of its evictions, every resident expert's features
    and its distance to its next request."""

    def __init__(self, spec: ModelSpec, num_keys: int, moment_base: int):
        super().__init__(spec)
        self.last_token = np.full(num_keys, -1, dtype=np.int64)
        self.freq = np.zeros(num_keys, dtype=np.int64)
        self.next_use = np.full(num_keys, NEVER, dtype=np.int64)
        self.resident = np.zeros(num_keys, dtype=bool)
        self.max_freq = 0
        self.moment = moment_base
        self.records: list[tuple] = []

    def on_access(self, key, ctx):
        super().on_access(key, ctx)
        if self.last_token[key] != ctx.token:  # several requests in one token are one routing
            self.last_token[key] = ctx.token
            freq = int(self.freq[key]) + 1
            self.freq[key] = freq
            self.max_freq = max(self.max_freq, freq)
        self.next_use[key] = ctx.next_use

    def on_insert(self, key, ctx):
        super().on_insert(key, ctx)
        self.resident[key] = True

    def on_evict(self, key):
        super().on_evict(key)
        self.resident[key] = False

    def victim(self, ctx):
        chosen = super().victim(ctx)
        keys = np.flatnonzero(self.resident)
        last = self.last_token[keys]
        nxt = self.next_use[keys]
        self.records.append((
            np.where(last >= 0, ctx.token - last + 1, 0),
            self.freq[keys],
            np.where(nxt == NEVER, -1, nxt - ctx.clock),
            keys == chosen,
            self.moment, ctx.token, self.max_freq, ctx.clock,
        ))
        self.moment += 1
        return chosen


def collect_belady_samples(trace: Trace, cache_sizes: Sequence[int]) -> BeladySamples:
    """Replay ``trace`` (in the replay simulator's request order) with Belady on the project's cache at
    each of ``cache_sizes`` and record every eviction moment."""
    seq = flatten(trace)
    L, J, K = trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k
    spec = ModelSpec(L, J, K)
    keys, tokens, next_use = seq.expert_id.tolist(), seq.token.tolist(), seq.next_use.tolist()
    records: list[tuple] = []
    moment = 0
    for size in cache_sizes:
        if size < K:
            raise ConfigError(f"cache size {size} is smaller than top-k = {K}")
        policy = _RecordingBelady(spec, L * J, moment)
        cache = ExpertCache(size, policy)
        ctx = AccessContext()
        for t, key in enumerate(keys):
            ctx.clock = t
            ctx.token = tokens[t]
            ctx.layer = t % L
            ctx.next_use = next_use[t]
            cache.request(key, ctx)
        moment = policy.moment
        records.extend((*rec, size) for rec in policy.records)
    if not records:
        empty = np.zeros(0, dtype=np.int64)
        return BeladySamples(empty, empty, empty, empty, empty, empty, empty, np.zeros(0, bool),
                             np.zeros(0, np.int32))
    counts = [rec[0].shape[0] for rec in records]
    rep = lambda i, dtype: np.repeat(np.array([rec[i] for rec in records], dtype=dtype), counts)  # noqa: E731
    return BeladySamples(
        recency=np.concatenate([rec[0] for rec in records]).astype(np.int64),
        freq=np.concatenate([rec[1] for rec in records]).astype(np.int64),
        distance=np.concatenate([rec[2] for rec in records]).astype(np.int64),
        chosen=np.concatenate([rec[3] for rec in records]),
        moment=rep(4, np.int64), token=rep(5, np.int64), max_freq=rep(6, np.int64), clock=rep(7, np.int64),
        cache_size=rep(8, np.int32),
        moments=len(records))


@dataclass
class _Merged:
    """Samples with equal inputs merged: x [U, 2], mean target y [U], count w [U]; ``index`` maps each
    sample to its row; ``within`` is the sum of squared deviations from the row means (the part of the
    MSE no network can remove)."""

    x: np.ndarray
    y: np.ndarray
    w: np.ndarray
    index: np.ndarray
    within: float

    @classmethod
    def of(cls, inputs: np.ndarray, targets: np.ndarray) -> "_Merged":
        packed = np.ascontiguousarray(inputs, dtype=np.float32).view(np.int64)[:, 0]  # both floats, exactly
        unique, first, index = np.unique(packed, return_index=True, return_inverse=True)
        index = index.reshape(-1)
        w = np.bincount(index, minlength=unique.size).astype(np.float64)
        y = np.bincount(index, weights=targets, minlength=unique.size) / w
        within = float(((targets - y[index]) ** 2).sum())
        return cls(x=inputs[first], y=y, w=w, index=index, within=within)

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
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (epoch, train MSE, val MSE)

    def save(self, path) -> Path:
        return save_model(path, self.model.layers, target=self.target, training=self.training)


def _file_sha256(path) -> str | None:
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


def train_learned_eviction(trace: Trace, *, rows: tuple[int, int] | None = None,
                           cache_sizes: Sequence[int] = (64, 128, 256, 512), horizon_tokens: float = 2.0,
                           epochs: int = 200, patience: int = 20, val_fraction: float = 0.2,
                           batch_size: int = 512, seed: int = 0, threads: int | None = None,
                           time_limit: float | None = 300.0,
                           log: Callable[[str], None] | None = None) -> TrainingResult:
    """Build the Belady dataset on ``trace`` rows ``rows`` (all rows by default) and fit the network.

    The validation split is the eviction moments in the last ``val_fraction`` of the training tokens.
    ``time_limit`` (seconds, for the whole run) stops training early, as if the patience ran out."""
    require_model_stack("training the learned eviction", ("torch",))
    import torch

    say = log or (lambda message: None)
    n = trace.num_tokens
    start, end = rows if rows is not None else (0, n)
    if not 0 <= start < end <= n:
        raise ConfigError(f"training rows {start}:{end} are not within the trace's {n} rows")
    val_fraction = number(val_fraction, "the validation fraction (--val-fraction)", low=0, high=1, low_open=True,
                          high_open=True)
    epochs = integer(epochs, "epochs (--epochs)", low=1)
    patience = integer(patience, "patience (--patience)", low=1)
    horizon_tokens = number(horizon_tokens, "the horizon (--horizon)", low=0, low_open=True)
    seed = integer(seed, "seed (--seed)", low=0)
    if threads is not None:
        threads = integer(threads, "threads (--threads)", low=1)
    meta = trace.meta
    cache_sizes = sorted(set(integer(c, "cache size (--cache-sizes)", low=1) for c in cache_sizes))
    if not cache_sizes:
        raise ConfigError("give at least one cache size")
    for size in cache_sizes:
        if not meta.top_k <= size < meta.num_expert_slots:
            raise ConfigError(f"cache size {size} must be at least top-k = {meta.top_k} and below the "
                              f"{meta.num_expert_slots} experts of the model (a cache that holds them all never "
                              "evicts)")
    train_trace = trace.select(slice(start, end))
    per_token = meta.num_layers * meta.top_k
    horizon = max(1, int(round(horizon_tokens * per_token)))
    split_token = int(math.floor((end - start) * (1.0 - val_fraction)))
    if threads:
        torch.set_num_threads(threads)
    began = time.perf_counter()
    deadline = None if time_limit is None else began + time_limit

    samples = collect_belady_samples(train_trace, cache_sizes)
    # Within H requests of the end of the rows an expert not requested again might be requested soon
    # after: its target would be a guess, so those moments are left out (elsewhere min(d, H) is exact).
    kept = samples.select(samples.clock <= (end - start) * per_token - horizon)
    is_val = kept.token >= split_token
    train_s, val_s = kept.select(~is_val), kept.select(is_val)
    if len(train_s) == 0 or len(val_s) == 0:
        raise ConfigError(f"rows {start}:{end} at cache sizes {cache_sizes} leave no Belady eviction moments for "
                          "training or for validation: use more rows or smaller caches")
    train_m = _Merged.of(train_s.inputs(), train_s.targets(horizon))
    val_m = _Merged.of(val_s.inputs(), val_s.targets(horizon))
    say(f"dataset: {samples.moments} Belady eviction moments at cache sizes {cache_sizes} on rows {start}:{end}: "
        f"{len(kept)} samples ({len(train_s)} train / {len(val_s)} validation from tokens >= {start + split_token}; "
        f"{len(samples) - len(kept)} in the last H requests left out), {train_m.x.shape[0]} / {val_m.x.shape[0]} "
        f"distinct inputs; horizon H = {horizon} requests ({horizon_tokens:g} tokens); "
        f"{time.perf_counter() - began:.1f} s")
    fit = _fit(torch, train_m, val_m, epochs=epochs, patience=patience, batch_size=batch_size, seed=seed,
               deadline=deadline, say=say)
    model = LearnedModel(layers=fit.layers)
    val_agree = agreement(val_s, model.forward(val_s.inputs()).astype(np.float64))
    say(f"{fit.stopped} after {fit.epochs_run} epochs; best epoch {fit.best_epoch}: train MSE {fit.train_loss:.6f}, "
        f"validation MSE {fit.validation_loss:.6f}; the highest score is as far from reuse as Belady's victim at "
        f"{val_agree:.1%} of validation evictions ({time.perf_counter() - began:.1f} s)")

    target = {
        "kind": "next-use distance d (requests) of every expert resident in Belady's cache at each of its "
                "evictions",
        "normalisation": "min(d, H) / H, 1 when not requested again in the training rows; moments in the "
                         "last H requests of the rows are left out (their targets would be censored)",
        "horizon_requests": horizon,
        "horizon_tokens": horizon_tokens,
        "loss": "MSE",
    }
    training = {
        "trace": Path(trace.path).name if trace.path != "<memory>" else "<memory>",
        "trace_sha256": _file_sha256(trace.path) if trace.path != "<memory>" else None,
        "trace_model": meta.model,
        "trace_shape": {"num_layers": meta.num_layers, "num_experts": meta.num_experts, "top_k": meta.top_k},
        "rows": f"{start}:{end}",
        "validation_rows": f"{start + split_token}:{end}",
        "cache_sizes": cache_sizes,
        "eviction_moments": samples.moments,
        "samples": len(kept),
        "censored_samples_dropped": len(samples) - len(kept),
        "train_samples": len(train_s),
        "validation_samples": len(val_s),
        "distinct_train_inputs": int(train_m.x.shape[0]),
        "seed": seed,
        "optimizer": "AdamW",
        "learning_rate": 1e-3,
        "weight_decay": 1e-2,
        "batch_size": batch_size,
        "max_epochs": epochs,
        "epochs_run": fit.epochs_run,
        "best_epoch": fit.best_epoch,
        "patience": patience,
        "stopped": fit.stopped,
        "train_loss": fit.train_loss,
        "validation_loss": fit.validation_loss,
        "validation_agreement_with_belady": val_agree,
        "torch_version": str(torch.__version__),
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "moe_offload_version": __version__,
    }
    model.metadata = {"target": target, "training": training}
    return TrainingResult(model=model, target=target, training=training,
                          history=fit.history)


# ---------------------------------------------------------------------------------------------- evaluation

def evaluate_policies(trace: Trace, cache_sizes: Sequence[int], model_path,
                      policies: Sequence[str] = ("learned", "lru", "lfu", "belady")) -> dict[int, dict[str, int]]:
    """Misses of each policy at each cache size on ``trace`` (the held-out rows), learned with
    ``model_path``."""
    from moe_offload.simulator.replay import ReplayInput, replay

    data = ReplayInput.of(trace)
    out: dict[int, dict[str, int]] = {}
    for size in cache_sizes:
        out[size] = {}
        for policy in policies:
            options = {"model_path": str(model_path)} if policy == "learned" else None
            out[size][policy] = replay(data, policy, size, options=options).misses
    return out
