"""What several prefetchers share: turning candidate arrays into proposals, grouping an iteration's rows by
request, and checking that a history trace is of the model a prefetcher was built for."""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies.base import ModelSpec
from moe_offload.prefetch.base import Proposal, proposal_list
from moe_offload.trace.format import Trace
from moe_offload.values import integer


def proposals(keys: np.ndarray, priorities: np.ndarray, distinct: bool = False) -> list[Proposal]:
    """One proposal per distinct key with the highest of its priorities, highest priority first (ties: lower
    key first, so the order never depends on how a queue breaks ties). ``distinct``: the caller knows that
    no key repeats, which saves the deduplication.

    A batch's requests each propose their own experts; an expert wanted by several requests is wanted as
    urgently as its most urgent request wants it.
    """
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    priorities = np.asarray(priorities, dtype=np.float64).reshape(-1)
    order = np.lexsort((keys, -priorities))
    keys, priorities = keys[order].tolist(), priorities[order].tolist()
    if not distinct:
        # The first occurrence of a key has its highest priority. A dict over the few dozen proposals of a
        # hook call is several times faster than np.unique's sort, and hooks run at every layer of every pass.
        highest: dict[int, float] = {}
        for key, priority in zip(keys, priorities):
            if key not in highest:
                highest[key] = priority
        keys, priorities = list(highest), list(highest.values())
    return proposal_list(keys, priorities)


class RequestGroups:
    """The rows (tokens) of one iteration grouped by request: ``requests[b]`` is the b-th distinct request
    (ascending id), ``mean(values)`` averages a [tokens, ...] array over each request's tokens."""

    def __init__(self, request_of_row: np.ndarray):
        self.requests, inverse = np.unique(request_of_row, return_inverse=True)
        self.inverse = inverse.reshape(-1)
        self._one_row_each = self.requests.size == self.inverse.size
        # decode with the rows in request order (one request, or a batch as recorded): the rows are the means
        self._rows_are_requests = self._one_row_each and bool((np.diff(self.inverse) > 0).all())
        if not self._one_row_each:
            # Averaging by a [requests, tokens] matrix product: one BLAS call instead of a Python loop.
            membership = (self.inverse[None, :] == np.arange(self.requests.size)[:, None]).astype(np.float32)
            self._averaging = membership / membership.sum(axis=1, keepdims=True)

    def __len__(self) -> int:
        return int(self.requests.size)

    def mean(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float32)
        if self._rows_are_requests:
            return values
        if self._one_row_each:  # decode: one token per request
            out = np.empty_like(values)
            out[self.inverse] = values
            return out
        return (self._averaging @ values.reshape(values.shape[0], -1)).reshape((len(self),) + values.shape[1:])


def check_same_model(spec: ModelSpec, trace: Trace, who: str) -> None:
    """Raise ConfigError when ``trace`` routes a different model shape than ``spec``."""
    meta = trace.meta
    if (meta.num_layers, meta.num_experts) != (spec.num_layers, spec.num_experts):
        raise ConfigError(f"{who}: the history {trace.path} has {meta.num_layers} layers x {meta.num_experts} "
                          f"experts, the model served has {spec.num_layers} x {spec.num_experts}")


def experts_per_layer_option(who: str, k, spec) -> int:
    """The ``k`` option of the prefetchers that propose k experts per layer: the model's top-k by default,
    at most the layer's expert count."""
    if k is None:
        return spec.top_k
    return integer(k, f"{who}.k", low=1, high=spec.num_experts, why="the experts of a layer")
