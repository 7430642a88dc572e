"""Routing replay: every router of the running model selects the experts a trace recorded, not its own.

A model with random weights at a real model's sizes then moves experts exactly as the real model did on
the trace's prompt: same experts, same layers, same order, same batch of tokens per forward pass, so the
runtime's data path, cache and prefetchers are measured under real access patterns without the real
weights. The top-k weights are the trace's (``weights="trace"``, when it has them) or the
router's own probabilities at the forced experts (``weights="router"``), renormalised when the
architecture renormalises its top-k.

Forward passes map to trace rows by request: the first forward pass (the prompt) takes the request's
prefill rows, or its first row when the trace has no prefill (a decode-only trace: the prompt is one
token), and each later forward pass takes the next row. :meth:`RoutingReplay.plan` tells the engine the
prompt length and the number of new tokens that consume exactly the request's rows. Because the future is
the trace, the oracle prefetcher can run in the runtime under a replay (``future``); MoEpic's gate
predictions are the trace's too, when it records them (``gate_prediction``).
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.plan.choices import REPLAY_WEIGHTS as WEIGHTS



def replay_rows(trace, request_index: int, max_new_tokens: int | None = None) -> np.ndarray:
    """The rows of ``trace`` that a replay of its ``request_index``-th request consumes (its prefill rows, or
    its first row, then one row per new token after the first), for at most ``max_new_tokens`` new tokens."""
    requests = list(dict.fromkeys(trace.request.tolist()))
    if not 0 <= request_index < len(requests):
        raise ConfigError(f"{trace.path}: request {request_index} does not exist ({len(requests)} requests)")
    rows = np.flatnonzero(trace.request == requests[request_index])
    first = int((trace.phase[rows] == 0).sum()) or 1
    if max_new_tokens is not None:
        rows = rows[:first + max(max_new_tokens, 1) - 1]
    return rows


class RoutingReplay:
    def __init__(self, trace, adapter, weights: str = "trace"):
        meta = trace.meta
        if (meta.num_layers, meta.num_experts, meta.top_k) != (adapter.num_layers, adapter.num_experts,
                                                               adapter.top_k):
            raise ConfigError(f"{trace.path}: a trace of {meta.num_layers} layers x {meta.num_experts} experts, "
                              f"top-{meta.top_k} cannot drive this model ({adapter.num_layers} x "
                              f"{adapter.num_experts}, top-{adapter.top_k})")
        if weights not in WEIGHTS:
            raise ConfigError(f"replay weights {weights!r}: choose from {', '.join(WEIGHTS)}")
        if weights == "trace" and trace.weights is None:
            raise ConfigError(f"{trace.path}: has no router weights; replay with weights='router'")
        self.trace, self.adapter, self.weights = trace, adapter, weights
        self.requests = [int(r) for r in dict.fromkeys(trace.request.tolist())]
        self._passes: list[np.ndarray] = []  # rows of each forward pass of the current request
        self._pass = -1
        self._handles = []

    def request_rows(self, request_index: int, max_new_tokens: int | None = None) -> np.ndarray:
        return replay_rows(self.trace, request_index, max_new_tokens)

    def plan(self, request_index: int, max_new_tokens: int | None = None) -> tuple[int, int]:
        """Start replaying the trace's ``request_index``-th request, at most ``max_new_tokens`` new tokens:
        (prompt tokens, new tokens)."""
        rows = self.request_rows(request_index, max_new_tokens)
        prefill = rows[self.trace.phase[rows] == 0]
        first = prefill if prefill.size else rows[:1]
        rest = rows[first.size:]
        self._passes = [first] + [rows_of_one for rows_of_one in rest.reshape(-1, 1)]
        self._pass = -1
        return int(first.size), len(self._passes)

    def next_pass(self, tokens: int) -> None:
        """A forward pass of ``tokens`` tokens begins."""
        self._pass += 1
        if self._pass >= len(self._passes) or self._passes[self._pass].size != tokens:
            raise RuntimeError(f"routing replay: forward pass {self._pass} of {tokens} tokens does not match the "
                               f"trace (planned {[p.size for p in self._passes]})")

    def rows(self) -> np.ndarray:
        return self._passes[self._pass]

    def future(self, layer: int) -> np.ndarray:
        """[tokens, K] experts the trace selects at ``layer`` in the current forward pass (the oracle's)."""
        return self.trace.experts[self.rows(), layer].astype(np.int64)

    def gate_prediction(self, layer: int) -> np.ndarray | None:
        """[tokens, J] the trace's MoEpic prediction after ``layer`` in the current forward pass (the next layer's,
        or after the last layer the next token's layer 0: prefetch/base.py RoutingView.gate_prediction), or
        None when the trace lacks it. A replayed model's own prediction would predict its own routers, which
        the replay overrides, from hidden states that are not the recording's."""
        last = layer == self.adapter.num_layers - 1
        recorded = self.trace.next_token_gate_prediction if last else self.trace.gate_prediction
        if recorded is None:
            return None
        return (recorded[self.rows()] if last else recorded[self.rows(), layer]).astype(np.float32)

    def install(self) -> None:
        """Hooks on the model: a pre-hook that starts each forward pass, one on every router that forces it.
        Install before other hooks that read the routing, so that they see the forced one."""
        def pass_start(module, args, kwargs):
            ids = kwargs.get("input_ids")
            ids = args[0] if ids is None and args else ids
            self.next_pass(int(ids.shape[-1]) if ids is not None else int(kwargs["inputs_embeds"].shape[-2]))

        self._handles.append(self.adapter.model.model.register_forward_pre_hook(pass_start, with_kwargs=True))
        for layer in range(self.adapter.num_layers):
            self._handles.append(self.adapter.router(layer).register_forward_hook(self._force(layer)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _force(self, layer: int):
        import torch

        def hook(module, args, output):
            logits, weights, _experts = output
            forced = torch.from_numpy(self.future(layer)).to(logits.device)
            if self.weights == "trace":
                chosen = torch.from_numpy(self.trace.weights[self.rows(), layer].astype(np.float32))
                chosen = chosen.to(device=weights.device, dtype=weights.dtype)
            else:
                scores = self.adapter.scores(logits).gather(-1, forced)
                if self.adapter.top_k_normalised:
                    scores = scores / scores.sum(dim=-1, keepdim=True)
                chosen = scores.to(weights.dtype)
            return logits, chosen, forced.to(_experts.dtype)
        return hook
