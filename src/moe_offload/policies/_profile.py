"""The activation profile the placement policies choose their resident experts from: how often each expert
was routed in a trace (a profile recorded beforehand, or the run's own trace in hindsight)."""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.policies.base import ModelSpec
from moe_offload.trace.format import Trace, read_trace
from moe_offload.values import text


def load_profile_trace(path, spec: ModelSpec, what: str):
    """The trace at ``path``, or ``path`` itself when it is a Trace already (from Python), refused unless its
    model has ``spec``'s layers and experts; ``what`` names the option in errors."""
    if isinstance(path, Trace):
        trace = path
    else:
        try:
            trace = read_trace(text(path, what))
        except TraceError as exc:
            raise ConfigError(f"{what}: {exc}") from None
    meta = trace.meta
    if (meta.num_layers, meta.num_experts) != (spec.num_layers, spec.num_experts):
        raise ConfigError(f"{what} {path}: a trace of {meta.num_layers} layers x {meta.num_experts} experts cannot "
                          f"profile a model of {spec.num_layers} x {spec.num_experts}")
    return trace


def expert_counts(trace, spec: ModelSpec) -> np.ndarray:
    """How many times each flat expert id (``layer * J + expert``) was selected over the trace's tokens:
    the number of replay requests of that key."""
    # a layer at a time: no temporary of the trace's size (16 bytes a request as flat int64 ids)
    return np.concatenate([np.bincount(trace.experts[:, layer, :].ravel(), minlength=spec.num_experts)
                           for layer in range(spec.num_layers)]).astype(np.int64)


def most_frequent(counts: np.ndarray, slots: int, spec: ModelSpec, per_layer: bool = False) -> list[int]:
    """The ``slots`` keys of highest count (ties: the lower key). ``per_layer``: each layer gets
    ``slots // L`` of its own most frequent, the first ``slots % L`` layers one more (the cache split of
    simulator/partitioned_cache.py's PartitionedCache)."""
    slots = min(slots, counts.size)
    by_count = np.argsort(-counts, kind="stable")  # stable: equal counts keep the lower key first
    if not per_layer:
        return sorted(by_count[:slots].tolist())
    base, extra = divmod(slots, spec.num_layers)
    chosen = []
    J = spec.num_experts
    for layer in range(spec.num_layers):
        layer_counts = counts[layer * J:(layer + 1) * J]
        take = min(J, base + (layer < extra))
        chosen += (np.argsort(-layer_counts, kind="stable")[:take] + layer * J).tolist()
    return sorted(chosen)
