"""Train FlashMoE's eviction network (paper 003, section 3.2 and Fig. 4) from Belady's decisions.

Three steps, one file each: eviction_samples.py replays the training rows at several cache sizes and
turns every resident expert at sampled eviction moments into one row (its features, and Belady's view of
its next request as target); eviction_fit.py fits the paper's network to those rows (one, or one per MoE
layer); this file runs both, records the provenance that goes into the model file, and replays held-out
rows with the trained policy beside LRU and Belady (``evaluate_policies``).
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moe_offload.simulator.replay import ReplayInput, replay
from moe_offload.version import __version__
from moe_offload import inputs
from moe_offload.errors import ConfigError
from moe_offload.models import require_model_stack
from moe_offload.policies import policy_info
from moe_offload.policies.learned_model import TARGETS, LearnedModel, save_model
from moe_offload.trace.format import Trace
from moe_offload.training.eviction_fit import MergedRows, fit_network
from moe_offload.training.eviction_samples import (CENSOR_TOKENS, BeladySamples, TrainingSource, agreement,
                                                   check_sources, collect_belady_samples)
from moe_offload.values import integer, number

__all__ = ["BeladySamples", "TrainingResult", "TrainingSource", "check_sources", "collect_belady_samples",
           "evaluate_policies", "file_sha256", "train_learned_eviction"]


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
    """The SHA-256 of a training trace, None where it cannot be read (the model records it when it can)."""
    try:
        return inputs.file_sha256(path)
    except OSError:
        return None


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
        train_m = MergedRows.of(train_x[train_rows], train_y[train_rows])
        val_m = MergedRows.of(val_x[val_rows], val_y[val_rows])
        if train_m.x.shape[0] == 0 or val_m.x.shape[0] == 0:
            raise ConfigError(f"layer {network} has no training or no validation samples: use more rows")
        say(f"{'layer %d: ' % network if per_layer else ''}{int(train_m.w.sum())} train / "
            f"{int(val_m.w.sum())} validation samples, {train_m.x.shape[0]} / {val_m.x.shape[0]} distinct inputs")
        # the time left is shared equally by the networks still to train
        now = time.perf_counter()
        share = None if deadline is None else now + (deadline - now) / (networks - network)
        fits.append(fit_network(torch, train_m, val_m, epochs=epochs, patience=patience, batch_size=batch_size,
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
    data = ReplayInput.of(trace)
    out: dict[int, dict[str, int]] = {}
    for size in cache_sizes:
        out[size] = {}
        for policy in policies:
            options = {"model": model} if policy == "learned" else None
            out[size][policy] = replay(data, policy, size, options=options).misses
    return out
