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
after all of them are computed, so the order of arrival never changes a bit of the result. Every product is
:func:`linear`: ``F.linear`` for float weights; a weight in a kernel's form computes its own product (PyTorch's
weight-only int4 matmul for int4 experts the fast tier holds in that kernel's form: runtime/int4_kernel.py,
runtime/expert_forms.py).

A packed forward pass (runtime/packed.py: several requests' tokens in one sequence, continuous batching)
carries its segments, the token ranges of its requests. Then each expert computes each segment's tokens
with its own matrix products, exactly the rows, in exactly the order, that the request's own forward pass
would give it: a matrix product over more rows does not give the same bits per row on every kernel (MKL on
this CPU does not), so the batch never changes a request's result. The weights are still fetched once for
the batch; the source is told how many tokens of each segment each expert serves.

MoEpic's split (paper 004, runtime/split.py): an expert may arrive in two *parts* along its intermediate
dimension, the top (intermediate rows [0, r): gate rows, up rows, down columns) and the bottom (rows [r, I)),
each a ``tensors`` dict of its own with ``part`` (0 top, 1 bottom) and ``parts`` (2). Each part computes as
soon as it arrives (the top while the bottom is still loading); the expert's output is top + bottom, added in
that order whatever the order of arrival, then weighted. Two GEMMs whose outputs are added do not round as the
one GEMM over the whole intermediate dimension does, so a split run is not bit-identical to the unsplit model:
its reference is the all-resident model computing with the same split (:func:`use_project_experts` with
``split_rows``: the same two contiguous parts from the module's own weights, :func:`split_parts`), and a split
run is bit-identical to that reference at every budget (README, "MoEpic's split in the runtime", says how far
that reference is from the unsplit model).
"""

from __future__ import annotations

import functools
from contextlib import closing
from typing import Iterator, Protocol

from moe_offload.models.host_experts import ON_HOST, HostInputs, host_expert_output

IMPLEMENTATION = "moe_offload"


def linear(x, weight):
    """``F.linear(x, weight)`` for a float weight; a weight in a kernel's form (runtime/int4_kernel.py Int4Weight)
    computes the product itself: the one product of every expert (this module, models/host_experts.py,
    runtime/packed.py)."""
    import torch

    if isinstance(weight, torch.Tensor):
        return torch.nn.functional.linear(x, weight)
    return weight.linear(x)


class ExpertSource(Protocol):
    """Where the weights of routed experts come from while a layer computes."""

    def layer_experts(self, layer: int, experts: list[int], tokens: list[list[int]]) -> Iterator[tuple[int, dict]]:
        """Yield ``(expert, tensors)`` once for each of ``experts`` (ascending, the layer's whole need; ``tokens[i]``
        holds how many tokens of each segment of this forward pass ``experts[i]`` is routed to: one segment
        unless the pass is packed), each as soon as it is resident and usable
        by the current stream; ``tensors`` holds ``gate_up_proj`` [2I, H] and ``down_proj`` [H, I]. The source
        may reclaim an expert's memory once the consumer asks for the next one, and releases everything when
        the generator is closed."""


def routing_plan(top_k_index, segment_starts=(0,)):
    """The layer's routing on the host, from one device-to-host copy of ``top_k_index`` [T, K] (the only
    synchronisation of a layer): (needed experts ascending, tokens of each segment per expert, groups, host
    tokens) where ``groups[i]`` lists expert ``needed[i]``'s (token index, top-k position index) pairs of tensors,
    one pair per segment it serves (segments start at ``segment_starts``), each in the order of the eager
    forward's ``torch.where`` on the transposed mask (top-k position first, then token); ``host_tokens[i]`` the
    same token indices in CPU memory (the rows of an expert computed on the host, models/host_experts.py)."""
    import numpy as np
    import torch

    routing = top_k_index.cpu().numpy()
    tokens = routing.shape[0]
    flat = routing.T.reshape(-1)                 # entry p * T + t is token t's p-th expert
    segment = np.searchsorted(np.asarray(segment_starts), np.arange(tokens), side="right") - 1
    # By expert, then segment; within one, ascending (p, t) as torch.where gives a segment's own pass.
    order = np.lexsort((np.arange(flat.size), segment[np.arange(flat.size) % tokens], flat))
    expert_of, segment_of = flat[order], segment[order % tokens]
    bounds = np.flatnonzero(np.r_[True, (np.diff(expert_of) != 0) | (np.diff(segment_of) != 0), True])
    host_index = index = torch.from_numpy(np.stack([order % tokens, order // tokens]))
    if top_k_index.device.type != "cpu":
        index = index.pin_memory().to(top_k_index.device, non_blocking=True)
    needed, counts, groups, host_tokens = [], [], [], []
    segments = len(segment_starts)
    for first, last in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        expert = int(expert_of[first])
        if not needed or needed[-1] != expert:
            needed.append(expert)
            counts.append([0] * segments)
            groups.append([])
            host_tokens.append([])
        counts[-1][int(segment_of[first])] = last - first
        groups[-1].append((index[0, first:last], index[1, first:last]))
        host_tokens[-1].append(host_index[0, first:last])
    return needed, counts, groups, host_tokens


def split_parts(gate_up, down, rows: int) -> list[dict]:
    """An expert's weights (``gate_up`` [2I, H], ``down`` [H, I]) as the contiguous parts of MoEpic's split at
    intermediate row ``rows``: the top (gate rows [0, rows), up rows [0, rows), down columns [0, rows)) and the
    bottom (the rest); one part, the weights as they are, when ``rows`` is I."""
    import torch

    intermediate = down.shape[1]
    if rows >= intermediate:
        return [{"gate_up_proj": gate_up, "down_proj": down, "part": 0, "parts": 1}]
    return [{"gate_up_proj": torch.cat([gate_up[first:last], gate_up[intermediate + first:intermediate + last]]),
             "down_proj": down[:, first:last].contiguous(), "part": part, "parts": 2}
            for part, (first, last) in enumerate([(0, rows), (rows, intermediate)])]


def _arrivals(module, needed: list[int], counts: list[list[int]]):
    source: ExpertSource | None = getattr(module, "expert_source", None)
    if source is None:
        rows = getattr(module, "split_rows", None)
        if rows is not None:  # the all-resident reference of a split run
            return ((expert, part) for expert in needed
                    for part in split_parts(module.gate_up_proj[expert], module.down_proj[expert], rows))
        return ((expert, {"gate_up_proj": module.gate_up_proj[expert], "down_proj": module.down_proj[expert]})
                for expert in needed)
    return source.layer_experts(module.moe_layer, needed, counts)


def _whole(partials: dict, expert: int, weights: dict, current):
    """The expert's output once all its parts are computed (top + bottom, in that order), else None (the
    part is kept until the others come); ``current`` itself for an expert in one piece."""
    parts = weights.get("parts", 1)
    if parts == 1:
        return current
    got = partials.setdefault(expert, [None] * parts)
    got[weights["part"]] = current
    if any(part is None for part in got):
        return None
    del partials[expert]
    return got[0] + got[1]


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    if hidden_states.shape[0] == 1:  # one token: one request's decode step
        final = _one_token_forward(self, hidden_states, top_k_index, top_k_weights)
        if final is not None:
            return final
    import torch

    packed = getattr(getattr(self, "expert_source", None), "packed", None)
    if packed is not None and not packed.longer:  # every request of the pass decodes one token
        final = _one_token_each_forward(self, packed, hidden_states, top_k_index, top_k_weights)
        if final is not None:
            return final
    needed, counts, groups, host_tokens = routing_plan(top_k_index,
                                                       packed.segment_starts if packed is not None else (0,))
    if packed is not None and not packed.exact:  # one product per expert over the whole pass
        groups = [[(torch.cat([t for t, _ in group]), torch.cat([p for _, p in group]))] if len(group) > 1 else group
                  for group in groups]
        host_tokens = [[torch.cat(tokens)] if len(tokens) > 1 else tokens for tokens in host_tokens]
    arrivals = _arrivals(self, needed, counts)
    position = {expert: i for i, expert in enumerate(needed)}
    outputs, partials = {}, {}
    inputs = HostInputs(self, hidden_states)
    with closing(arrivals):
        for expert, weights in arrivals:
            group = groups[position[expert]]
            if weights.get(ON_HOST):
                order = sorted(range(len(group)), key=lambda i: len(group[i][0]) > 1)  # as below
                sizes = [len(group[i][0]) for i in order]
                token_idx = torch.cat([group[i][0] for i in order])
                top_k_pos = torch.cat([group[i][1] for i in order])
                rows = torch.cat([host_tokens[position[expert]][i] for i in order])
                product = linear if len(group) == 1 else functools.partial(_blocks, packed, sizes)
                current = host_expert_output(self, inputs, rows, weights, product)
            elif len(group) == 1:
                token_idx, top_k_pos = group[0]
                current = self._apply_gate(linear(hidden_states[token_idx], weights["gate_up_proj"]))
                current = linear(current, weights["down_proj"])
            else:  # products per segment, those of one row in one product (packed.blocks), the element-wise
                # activation over all of them at once. Segments of one row first: an expert serves a token once,
                # so index_add_ adds one row to each token whatever their order.
                group = sorted(group, key=lambda pair: len(pair[0]) > 1)
                sizes = [len(t) for t, _ in group]
                token_idx, top_k_pos = torch.cat([g[0] for g in group]), torch.cat([g[1] for g in group])
                current = self._apply_gate(packed.blocks(hidden_states[token_idx], sizes, weights["gate_up_proj"]))
                current = packed.blocks(current, sizes, weights["down_proj"])
            current = _whole(partials, expert, weights, current)
            if current is None:
                continue
            outputs[expert] = (token_idx, current * top_k_weights[token_idx, top_k_pos, None])
    final_hidden_states = hidden_states.new_zeros(hidden_states.shape)
    for expert in needed:  # ascending: each token sums its experts in the eager forward's order
        token_idx, current = outputs[expert]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def _blocks(packed, sizes, x, weight):
    """A packed pass's products of ``x`` by ``weight``, segment by segment (runtime/packed.py)."""
    return packed.blocks(x, sizes, weight)


def _one_token_forward(self, hidden_states, top_k_index, top_k_weights):
    """Decode's common case, one token routed to K distinct experts: the same arithmetic as the general path
    (the same GEMMs on the same [1, H] row, the same products, the outputs added to zeros in ascending expert
    order, as ``index_add_`` adds them), hence the same bits, without the index tensors, their host-to-device
    copy and the gathers and scatters the general path launches for each expert. None when an expert repeats."""

    chosen = top_k_index[0].tolist()  # the layer's one synchronisation
    needed = sorted(chosen)
    if len(set(needed)) != len(needed):
        return None
    position = {expert: p for p, expert in enumerate(chosen)}
    outputs, partials = {}, {}
    inputs = HostInputs(self, hidden_states)
    with closing(_arrivals(self, needed, [[1]] * len(needed))) as arrivals:
        for expert, weights in arrivals:
            if weights.get(ON_HOST):
                current = host_expert_output(self, inputs, None, weights, linear)
            else:
                current = self._apply_gate(linear(hidden_states, weights["gate_up_proj"]))
                current = _whole(partials, expert, weights, linear(current, weights["down_proj"]))
            if current is None:
                continue
            p = position[expert]
            outputs[expert] = current * top_k_weights[:, p:p + 1]
    final = hidden_states.new_zeros(hidden_states.shape)
    for expert in needed:
        final.add_(outputs[expert].to(final.dtype))
    return final


def _one_token_each_forward(self, packed, hidden_states, top_k_index, top_k_weights):
    """A packed pass in which every request decodes one token (each segment one row, each routed to K distinct
    experts): the general path's arithmetic without its per-segment index tensors. The rows are sorted by
    expert once (one gather of the hidden states and one of the routing weights for the layer); each expert
    computes its rows in one product per weight (exact batch math: each row with the bits of its own
    product, ``packed.blocks``; fast: one product over them), and the outputs are added with ``index_add_``
    in ascending expert order, one row per token each, as the general path adds them. None when a token
    repeats an expert."""
    import numpy as np
    import torch

    routing = top_k_index.cpu().numpy()  # the layer's one synchronisation
    tokens, k = routing.shape
    if k > 1 and (np.diff(np.sort(routing, axis=1), axis=1) == 0).any():
        return None
    flat = routing.reshape(-1)                   # entry t * K + p is token t's p-th expert
    order = np.argsort(flat, kind="stable")      # by expert, then token
    bounds = np.flatnonzero(np.r_[True, np.diff(flat[order]) != 0, True])
    needed = flat[order[bounds[:-1]]].tolist()
    counts = np.zeros((len(needed), tokens), dtype=np.int64)  # tokens of each segment (one row each) per expert
    counts[np.repeat(np.arange(len(needed)), np.diff(bounds)), order // k] = 1
    entries = torch.from_numpy(order).to(hidden_states.device)
    token_idx = entries // k
    rows, gate_weights = hidden_states[token_idx], top_k_weights.reshape(-1)[entries]
    span = dict(zip(needed, zip(bounds[:-1].tolist(), bounds[1:].tolist())))

    def products(x, weight):
        return packed.blocks(x, [1] * len(x), weight) if packed.exact else linear(x, weight)

    outputs, partials = {}, {}
    inputs = HostInputs(self, hidden_states)
    host_rows = torch.from_numpy(order // k)  # token_idx in CPU memory
    with closing(_arrivals(self, needed, counts.tolist())) as arrivals:
        for expert, weights in arrivals:
            first, last = span[expert]
            if weights.get(ON_HOST):
                current = host_expert_output(self, inputs, host_rows[first:last], weights, products)
            else:
                current = self._apply_gate(products(rows[first:last], weights["gate_up_proj"]))
                current = _whole(partials, expert, weights, products(current, weights["down_proj"]))
            if current is None:
                continue
            outputs[expert] = current * gate_weights[first:last, None]
    final = hidden_states.new_zeros(hidden_states.shape)
    for expert in needed:
        first, last = span[expert]
        final.index_add_(0, token_idx[first:last], outputs[expert].to(final.dtype))
    return final


def register() -> None:
    """Make :data:`IMPLEMENTATION` a valid ``experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


def use_project_experts(adapter, source: ExpertSource | None = None, split_rows: list[int] | None = None) -> None:
    """Route every MoE layer of the adapter's model through :func:`experts_forward`, reading weights from
    ``source`` when one is given (None: the module's own weights, in the parts of MoEpic's split at
    intermediate row ``split_rows[layer]`` when given: a split run's all-resident reference)."""
    register()
    for layer in range(adapter.num_layers):
        module = adapter.experts(layer)
        module.moe_layer = layer
        module.expert_source = source
        module.split_rows = split_rows[layer] if split_rows is not None and source is None else None
    adapter.model.set_experts_implementation(IMPLEMENTATION)
