"""The one interface every prefetcher implements, and the view of the routing it may look at.

A prefetcher proposes; the transfer queue decides. Each call returns proposals (flat expert id, priority;
a higher priority is fetched sooner). The queue of a link keeps one entry per expert: a new proposal for
an expert already queued replaces its priority (MoE-Infinity resubmits its whole set at every layer, paper
002 section 5.3), an expert already resident or on the wire is ignored, and queued prefetches for layers
the computation has passed are dropped. On-demand loads always come first.

The driver (the timed simulator now, the runtime later) calls, for every iteration (forward pass):

    on_iteration_start(view)    view.layer_now == -1: only what is known before layer 0 runs
    on_layer_routed(view)       for l = 0 .. L-1, right after layer l's router ran (view.layer_now == l)
    on_iteration_end(view)      the iteration is over; history may be updated
    on_request_end(request)     after the last iteration of a request: its per-sequence state may go

and ``predicted_map()`` whenever an eviction policy asks for the prefetcher's expert map (fMoE's
eviction priority uses it). Proposals made after the last layer's router (``on_layer_routed`` with
view.layer_now == L-1) are for the next iteration: every layer is ahead again (MoEpic predicts layer 0 of
the next token there). Before the run, and whenever a configuration changes what the link may carry, the
driver also calls ``set_budget(budget)`` with what the link into the fast tier can move for each layer
(moe_offload.prefetch.budget); a driver that knows no timing never calls it.
"""

from __future__ import annotations

from itertools import repeat
from typing import ClassVar, NamedTuple

import numpy as np

from moe_offload.policies.base import ModelSpec
from moe_offload.prefetch.budget import PrefetchBudget
from moe_offload.prefetch.requirements import check_trace_columns
from moe_offload.trace.format import Trace


class Proposal(NamedTuple):
    key: int          # flat expert id, layer * J + expert
    priority: float   # higher is fetched sooner


def proposal_list(keys: list[int], priorities: list[float]) -> list[Proposal]:
    """Proposals of ``keys`` with ``priorities``, in that order. Built by ``tuple.__new__``: the NamedTuple's
    own ``_make`` also checks each one's length, which makes a list of a few dozen 1.5 times as slow."""
    return list(map(tuple.__new__, repeat(Proposal), zip(keys, priorities)))


class RoutingView:
    """The current iteration as the serving side sees it after layer ``layer_now`` was routed.

    Only layers <= layer_now can be read through ``selected``, ``probs`` and ``gate_prediction``: the
    future is hidden, except through the ``oracle_selected`` method that only the oracle prefetcher may
    call. ``rows`` are the trace rows (tokens) of the iteration, in trace order.
    """

    def __init__(self, trace: Trace, iteration: int, rows: np.ndarray):
        self.trace = trace
        self.iteration = iteration
        self.rows = rows
        self.layer_now = -1

    @property
    def source(self) -> str:
        """Where the routing comes from, for error messages: the trace file."""
        return self.trace.path

    def require(self, prefetcher: type["Prefetcher"]) -> None:
        """Raise ConfigError when the routing lacks a column the prefetcher cannot work without."""
        check_trace_columns(prefetcher, self.trace)

    @property
    def requests(self) -> np.ndarray:
        return self.trace.request[self.rows]

    @property
    def is_prefill(self) -> bool:
        return bool((self.trace.phase[self.rows] == 0).any())

    def _check(self, layer: int) -> None:
        if not 0 <= layer <= self.layer_now:
            raise LookupError(f"layer {layer} has not been routed yet (now at layer {self.layer_now})")

    def selected(self, layer: int) -> np.ndarray:
        """[tokens, K] experts the router selected at ``layer``."""
        self._check(layer)
        return self.trace.experts[self.rows, layer]

    def probs(self, layer: int) -> np.ndarray | None:
        """[tokens, J] router distribution at ``layer``, or None when the trace has none."""
        self._check(layer)
        return None if self.trace.probs is None else self.trace.probs[self.rows, layer].astype(np.float32)

    def gate_prediction(self, layer: int) -> np.ndarray | None:
        """[tokens, J]: the router of the next layer in pass order applied to layer ``layer``'s hidden state
        (MoEpic): layer ``layer + 1`` of the same token, or, for the last layer, layer 0 of each token's
        successor in its request (the trace's next_token_gate_prediction). None when the trace lacks it."""
        self._check(layer)
        trace = self.trace
        if layer == trace.meta.num_layers - 1:
            predicted = trace.next_token_gate_prediction
            return None if predicted is None else predicted[self.rows].astype(np.float32)
        if trace.gate_prediction is None:
            return None
        return trace.gate_prediction[self.rows, layer].astype(np.float32)

    @property
    def positions(self) -> np.ndarray:
        """[tokens] position of each token in its request."""
        return self.trace.position[self.rows]

    def embedding(self) -> np.ndarray | None:
        """[tokens, D] the model's input embedding of each token this iteration feeds it (known before layer
        0): the embedding layer's output for the prompt's tokens in prefill, for the one new token in decode."""
        return None if self.trace.embedding is None else self.trace.embedding[self.rows].astype(np.float32)

    def oracle_selected(self, layer: int) -> np.ndarray:
        """The true future: for the oracle prefetcher (the bound), never for a real one."""
        return self.trace.experts[self.rows, layer]


class Prefetcher:
    """Base class: subclasses set the class attributes and override the hooks they need."""

    name: ClassVar[str]
    summary: ClassVar[str]
    source: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()  # trace columns it cannot work without: probs, embedding, ...
    needs_history: ClassVar[bool] = False     # predicts nothing until fit() gave it past sequences
    reads_future: ClassVar[bool] = False      # calls view.oracle_selected: a bound for simulators, not a runtime
    # What the last hook call's search of history cost, and whether that time delays inference
    # (moe_offload.prefetch.search_cost); prefetchers that search nothing keep these defaults.
    search_on_inference_path: ClassVar[bool] = False
    last_search_seconds: float = 0.0

    def __init__(self, spec: ModelSpec, **options):
        self.spec = spec

    def fit(self, history: Trace) -> None:
        """Learn from past traffic (a training split), for the prefetchers that keep history."""

    def on_iteration_start(self, view: RoutingView) -> list[Proposal]:
        return []

    def on_layer_routed(self, view: RoutingView) -> list[Proposal]:
        return []

    def on_iteration_end(self, view: RoutingView) -> None:
        """The iteration is over: every layer of ``view`` can be read."""

    def set_budget(self, budget: PrefetchBudget) -> None:
        """What the link into the fast tier can carry for each layer (see the module doc); prefetchers whose
        proposals do not depend on it ignore it."""

    def on_request_end(self, request: int) -> None:
        """Request ``request`` has run its last iteration: no view will show it again."""

    def predicted_map(self) -> np.ndarray | None:
        """[L, J] predicted probabilities of the current iteration, or None."""
        return None
