"""The experts implementation the project registers with transformers.

transformers 5.x dispatches every fused experts module's forward through
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``; registering :func:`experts_forward` under
:data:`IMPLEMENTATION` and calling ``model.set_experts_implementation(IMPLEMENTATION)`` routes every MoE layer
through it, while attention, the KV cache and sampling stay transformers' own.

The function performs exactly the arithmetic of transformers' eager forward: every expert's output is computed
from the same inputs with the same operations, and the outputs are accumulated with ``index_add_`` in
ascending expert order, so the result is bit-identical to ``experts_implementation="eager"``. It reads the
routing on the host once per layer (one copy of ``top_k_index``), where the eager forward synchronises
once for the experts hit and once more per expert (``torch.where``). What it adds:
when an :class:`ExpertSource` is attached to the module (the runtime's tiers), the weights come from the
source, which yields the layer's experts in the order they become resident (an expert already in fast memory
computes while another is still loading); the outputs are kept and accumulated in ascending order only
after all of them are computed, so the order of arrival never changes a bit of the result.
"""

from __future__ import annotations

from contextlib import closing
from typing import Iterator, Protocol

IMPLEMENTATION = "moe_offload"


class ExpertSource(Protocol):
    """Where the weights of routed experts come from while a layer computes."""

    def layer_experts(self, layer: int, experts: list[int], tokens: list[int]) -> Iterator[tuple[int, dict]]:
        """Yield ``(expert, tensors)`` once for each of ``experts`` (ascending, the layer's whole need; ``tokens``
        are how many tokens of this forward pass each is routed to), each as soon as it is resident and usable
        by the current stream; ``tensors`` holds ``gate_up_proj`` [2I, H] and ``down_proj`` [H, I]. The source
        may reclaim an expert's memory once the consumer asks for the next one, and releases everything when
        the generator is closed."""


def routing_plan(top_k_index):
    """The layer's routing on the host, from one device-to-host copy of ``top_k_index`` [T, K] (the only
    synchronisation of a layer): (needed experts ascending, tokens per expert, index [2, S]) where, for each
    expert in turn, index[0] holds its tokens and index[1] their top-k positions in the order of the eager
    forward's ``torch.where`` on the transposed mask (top-k position first, then token)."""
    import numpy as np
    import torch

    routing = top_k_index.cpu().numpy()
    tokens = routing.shape[0]
    flat = routing.T.reshape(-1)                 # entry p * T + t is token t's p-th expert
    order = np.argsort(flat, kind="stable")      # by expert; within one, ascending (p, t) as torch.where
    needed, counts = np.unique(flat[order], return_counts=True)
    index = torch.from_numpy(np.stack([order % tokens, order // tokens]))
    if top_k_index.device.type != "cpu":
        index = index.pin_memory().to(top_k_index.device, non_blocking=True)
    return needed.tolist(), counts.tolist(), index


def _arrivals(module, needed: list[int], counts: list[int]):
    source: ExpertSource | None = getattr(module, "expert_source", None)
    if source is None:
        return ((expert, {"gate_up_proj": module.gate_up_proj[expert], "down_proj": module.down_proj[expert]})
                for expert in needed)
    return source.layer_experts(module.moe_layer, needed, counts)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    if hidden_states.shape[0] == 1:
        final = _one_token_forward(self, hidden_states, top_k_index, top_k_weights)
        if final is not None:
            return final
    import torch.nn.functional as F

    needed, counts, index = routing_plan(top_k_index)
    arrivals = _arrivals(self, needed, counts)
    starts, start = {}, 0
    for expert, count in zip(needed, counts):
        starts[expert] = (start, start + count)
        start += count
    outputs = {}
    with closing(arrivals):
        for expert, weights in arrivals:
            first, last = starts[expert]
            token_idx, top_k_pos = index[0, first:last], index[1, first:last]
            current = self._apply_gate(F.linear(hidden_states[token_idx], weights["gate_up_proj"]))
            current = F.linear(current, weights["down_proj"]) * top_k_weights[token_idx, top_k_pos, None]
            outputs[expert] = (token_idx, current)
    final_hidden_states = hidden_states.new_zeros(hidden_states.shape)
    for expert in needed:
        token_idx, current = outputs[expert]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def _one_token_forward(self, hidden_states, top_k_index, top_k_weights):
    """Decode's common case, one token routed to K distinct experts: the same arithmetic as the general path
    (the same GEMMs on the same [1, H] row, the same products, the outputs added to zeros in ascending expert
    order, as ``index_add_`` adds them), hence the same bits, without the index tensors, their host-to-device
    copy and the gathers and scatters the general path launches for each expert. None when an expert repeats."""
    import torch.nn.functional as F

    chosen = top_k_index[0].tolist()  # the layer's one synchronisation
    needed = sorted(chosen)
    if len(set(needed)) != len(needed):
        return None
    position = {expert: p for p, expert in enumerate(chosen)}
    outputs = {}
    with closing(_arrivals(self, needed, [1] * len(needed))) as arrivals:
        for expert, weights in arrivals:
            current = self._apply_gate(F.linear(hidden_states, weights["gate_up_proj"]))
            p = position[expert]
            outputs[expert] = F.linear(current, weights["down_proj"]) * top_k_weights[:, p:p + 1]
    final = hidden_states.new_zeros(hidden_states.shape)
    for expert in needed:
        final.add_(outputs[expert].to(final.dtype))
    return final


def register() -> None:
    """Make :data:`IMPLEMENTATION` a valid ``experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


def use_project_experts(adapter, source: ExpertSource | None = None) -> None:
    """Route every MoE layer of the adapter's model through :func:`experts_forward`, reading weights from
    ``source`` when one is given (None: the module's own weights)."""
    register()
    for layer in range(adapter.num_layers):
        module = adapter.experts(layer)
        module.moe_layer = layer
        module.expert_source = source
    adapter.model.set_experts_implementation(IMPLEMENTATION)
