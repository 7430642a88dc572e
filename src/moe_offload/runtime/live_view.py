"""The prefetchers' view of a forward pass that is running now (the runtime's RoutingView).

It answers the same questions as :class:`moe_offload.prefetch.base.RoutingView` does for a trace, from the
routers as they run: after MoE layer l's router, ``selected``, ``probs`` and ``gate_prediction`` of layers
<= l; from the start, each row's request (a packed pass holds several requests' rows) and its token's input
embedding: the output of the model's embedding layer for the token this pass feeds (the prompt's tokens in
prefill, the new token in decode), the trace's ``embedding`` column as the recorder writes it
(models/recorder.py), from which fMoE pools each iteration's semantic embedding. The
future does not exist yet, so ``oracle_selected`` refuses, except under a routing replay
(runtime/replay.py), whose trace is the future (``future(layer)``).
"""

from __future__ import annotations

import copy

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies.base import ModelSpec

LIVE_COLUMNS = ("probs", "embedding", "gate_prediction", "weights")


class LiveRoutingView:
    def __init__(self, spec: ModelSpec, iteration: int, requests: np.ndarray, positions: np.ndarray,
                 is_prefill: bool, embedding: np.ndarray | None, source: str, future=None):
        """``requests``: each row's (token's) request; ``positions``: each row's position in its request;
        ``embedding``: each row's token input embedding [T, D], or None when no prefetcher reads it."""
        self.spec = spec
        self.iteration = iteration
        self.layer_now = -1
        self.is_prefill = is_prefill
        self.source = source
        self._future = future
        self._requests = requests
        self._positions = positions
        self._embedding = embedding
        self._selected: list = [None] * spec.num_layers
        self._probs: list = [None] * spec.num_layers
        self._predicted: list = [None] * spec.num_layers

    def require(self, prefetcher) -> None:
        missing = [column for column in prefetcher.requires if column not in LIVE_COLUMNS]
        if missing:
            raise ConfigError(f"prefetcher {prefetcher.name!r} needs {', '.join(missing)}, which the runtime "
                              "does not compute")

    def routed(self, layer: int, selected: np.ndarray, probs: np.ndarray, predicted: np.ndarray | None) -> None:
        """MoE layer ``layer``'s router ran: [tokens, K] experts, [tokens, J] probabilities, and router
        ``layer + 1``'s prediction from this layer's hidden state when the engine computes it."""
        if layer != self.layer_now + 1:
            raise RuntimeError(f"router of layer {layer} ran after layer {self.layer_now}")
        self._selected[layer], self._probs[layer], self._predicted[layer] = selected, probs, predicted
        self.layer_now = layer

    def at(self, layer: int) -> "LiveRoutingView":
        """The view as it was right after layer ``layer``'s router ran (-1: before layer 0), for a reader on
        another thread (runtime/matcher.py) while this one moves on: a layer's arrays are never changed once
        routed, so the snapshot shares them."""
        snapshot = copy.copy(self)
        snapshot.layer_now = layer
        return snapshot

    @property
    def requests(self) -> np.ndarray:
        return self._requests

    @property
    def positions(self) -> np.ndarray:
        return self._positions

    def _check(self, layer: int) -> None:
        if not 0 <= layer <= self.layer_now:
            raise LookupError(f"layer {layer} has not been routed yet (now at layer {self.layer_now})")

    def selected(self, layer: int) -> np.ndarray:
        self._check(layer)
        return self._selected[layer]

    def probs(self, layer: int) -> np.ndarray | None:
        self._check(layer)
        return self._probs[layer]

    def gate_prediction(self, layer: int) -> np.ndarray | None:
        self._check(layer)
        return self._predicted[layer]

    def embedding(self) -> np.ndarray | None:
        return self._embedding

    def oracle_selected(self, layer: int) -> np.ndarray:
        if self._future is None:
            raise ConfigError("the oracle prefetcher reads the future routing, which a running engine knows only "
                              "when it replays a trace's routing")
        return self._future(layer)
