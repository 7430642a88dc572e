"""The experts implementation the project registers with transformers.

transformers 5.x dispatches every fused experts module's forward through
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``; registering :func:`experts_forward` under
:data:`IMPLEMENTATION` and calling ``model.set_experts_implementation(IMPLEMENTATION)`` routes every MoE layer
through it, while attention, the KV cache and sampling stay transformers' own.

The function performs exactly the arithmetic of transformers' eager forward (same expert order, same token
order, same ``index_add_`` accumulation), so its output is bit-identical to ``experts_implementation="eager"``.
The only difference: when an :class:`ExpertSource` is attached to the module (the runtime's tiers), the
weights of each expert come from it instead of the module's own fused tensors, and the source is told, before
the first expert is computed, every expert the layer needs, so that it can pin them and start the loads.
"""

from __future__ import annotations

from typing import Protocol

IMPLEMENTATION = "moe_offload"


class ExpertSource(Protocol):
    """Where the weights of routed experts come from while a layer computes."""

    def begin_layer(self, layer: int, experts: list[int]) -> None:
        """The layer is about to compute these experts (ascending): pin them, load the missing ones."""

    def expert_weights(self, layer: int, expert: int) -> dict:
        """The expert's compute-ready tensors (``gate_up_proj`` [2I, H], ``down_proj`` [H, I]); blocks until
        they are resident."""

    def end_layer(self, layer: int) -> None:
        """The layer is done with its experts: unpin them."""


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    import torch
    import torch.nn.functional as F

    final_hidden_states = torch.zeros_like(hidden_states)
    needed = torch.unique(top_k_index).tolist()  # ascending, as the eager forward's expert_hit
    source: ExpertSource | None = getattr(self, "expert_source", None)
    layer = getattr(self, "moe_layer", None)
    if source is not None:
        source.begin_layer(layer, needed)
    try:
        for expert in needed:
            if source is not None:
                weights = source.expert_weights(layer, expert)
                gate_up, down = weights["gate_up_proj"], weights["down_proj"]
            else:
                gate_up, down = self.gate_up_proj[expert], self.down_proj[expert]
            # (top_k, tokens) mask, so that torch.where yields the eager forward's (top_k_pos, token) order
            top_k_pos, token_idx = torch.where((top_k_index == expert).transpose(0, 1))
            current_state = hidden_states[token_idx]
            current_hidden_states = self._apply_gate(F.linear(current_state, gate_up))
            current_hidden_states = F.linear(current_hidden_states, down)
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    finally:
        if source is not None:
            source.end_layer(layer)
    return final_hidden_states


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
