"""The routing of the requests that asked for it: what a server returns as SGLang's ``routed_experts``.

A forward hook on every MoE layer's router keeps, for the requests registered with :meth:`RoutingLog.keep`,
each token's K experts in the router's rank order (largest weight first, as the recorder writes them,
models/recorder.py). A pass's rows are committed to their requests only when the pass completed
(``pass_end``): a pass that failed and runs again is not counted twice. A request's rows are then the
tokens it fed the model, its prompt and every generated token but the last (which is never fed back),
``[prompt + completion - 1, L, K]``: SGLang's shape for ``routed_experts``.

Why hooks of its own rather than the runner's RoutingTap: the tap is installed only when a prefetcher or a
policy reads the routing, and then copies the full distribution of every layer to the host. These hooks
return at once when no request of the pass asked, so a server pays nothing for the option.
"""

from __future__ import annotations

import numpy as np


class RoutingLog:
    def __init__(self, adapter):
        self.adapter = adapter
        self.wanted: set[int] = set()
        self.kept: dict[int, list[np.ndarray]] = {}
        self._segments: list[tuple[int, int, int]] = []  # (request, first row, end row) of the pass's wanted ones
        self._layers: list[np.ndarray] = []  # this pass's [T, K] per MoE layer routed so far
        self._handles = []

    def install(self) -> None:
        self._handles = [self.adapter.router(layer).register_forward_hook(self._routed)
                         for layer in range(self.adapter.num_layers)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def keep(self, request: int) -> None:
        """Keep ``request``'s routing from its next pass on."""
        self.kept[request] = []
        self.wanted.add(request)

    def take(self, request: int) -> np.ndarray | None:
        """``request``'s routing [tokens fed, L, K] (int32), forgotten here; None if it was not kept."""
        self.wanted.discard(request)
        rows = self.kept.pop(request, None)
        if rows is None:
            return None
        if not rows:
            return np.zeros((0, self.adapter.num_layers, self.adapter.top_k), np.int32)
        return np.concatenate(rows).astype(np.int32)

    def pass_start(self, segments) -> None:
        """``segments``: (request, first row, end row, prefill) of each request in the pass that starts."""
        self._segments = [(request, start, end) for request, start, end, _ in segments if request in self.wanted]
        self._layers = []

    def pass_end(self) -> None:
        if not self._segments or len(self._layers) != self.adapter.num_layers:
            return
        routing = np.stack(self._layers, axis=1)  # [T, L, K]
        for request, start, end in self._segments:
            if request in self.kept:
                self.kept[request].append(routing[start:end])
        self._segments, self._layers = [], []

    def _routed(self, module, args, output) -> None:
        if not self._segments:
            return
        import torch

        _, weights, experts = output
        order = weights.float().argsort(dim=-1, descending=True, stable=True)
        self._layers.append(torch.gather(experts, -1, order).cpu().numpy())
