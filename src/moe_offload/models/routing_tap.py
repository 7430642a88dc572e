"""Watch the routers of a transformers MoE model while it runs, without changing what it computes.

Forward hooks on every MoE layer's router (and, when asked, a pre-hook on the norm the router reads, whose
input is the post-attention hidden state MoEpic's speculative gate needs) call ``on_layer(layer, routing)``
as soon as the router of MoE layer ``layer`` has decided. The recorder keeps the routings; the runtime's
prefetchers act on them while the layer's experts are still loading. Hooks only read tensors, so the model's
outputs are the same with and without a tap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class LayerRouting:
    logits: object       # torch.Tensor [T, E]: the router's logits for the T tokens of this forward pass
    weights: object      # [T, K]: the top-k weights the experts are mixed with
    experts: object      # [T, K]: the selected experts
    hidden: object = None  # [T, H]: the post-attention hidden state the router's norm read (capture_hidden)


class RoutingTap:
    def __init__(self, adapter, on_layer: Callable[[int, LayerRouting], None], capture_hidden: bool = False):
        self.adapter = adapter
        self.on_layer = on_layer
        self.capture_hidden = capture_hidden
        self._hidden: dict[int, object] = {}
        self._handles = []

    def __enter__(self) -> "RoutingTap":
        for layer in range(self.adapter.num_layers):
            if self.capture_hidden:
                self._handles.append(self.adapter.router_norm(layer).register_forward_pre_hook(self._keep_hidden(layer)))
            self._handles.append(self.adapter.router(layer).register_forward_hook(self._routed(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hidden.clear()

    def _keep_hidden(self, layer: int):
        def hook(module, args):
            hidden = args[0]
            self._hidden[layer] = hidden.detach().reshape(-1, hidden.shape[-1])
        return hook

    def _routed(self, layer: int):
        def hook(module, args, output):
            logits, weights, experts = output
            self.on_layer(layer, LayerRouting(logits.detach(), weights.detach(), experts.detach(),
                                              self._hidden.pop(layer, None)))
        return hook
