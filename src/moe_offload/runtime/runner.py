"""The model runner: one forward pass of a transformers MoE model whose experts come from the tiers.

Everything here works per forward pass and knows nothing of prompts or generation loops, so that a
scheduler that batches several requests into one pass (continuous batching) drives it as the single-prompt
``generate`` of runtime/engine.py does:

- the **expert source** (:meth:`ModelRunner.layer_experts`, the :class:`~moe_offload.models.experts.ExpertSource`
  of models/experts.py): for each MoE layer, count the accesses in the policy's
  :class:`~moe_offload.policies.base.AccessContext` (filled as the simulators fill it, ``routed`` included),
  pin the layer's experts, demand-load the missing ones through the data path, and hand each expert to the
  compute as soon as it is resident; computed experts are unpinned at once;
- the **routing hooks**: a RoutingTap on every router feeds the prefetcher (the same objects as the timed
  simulator's) through a :class:`~moe_offload.runtime.live_view.LiveRoutingView` right after each layer's
  router ran; a pre-hook and a hook on the decoder mark where a forward pass starts and ends;
- **routing replay** (runtime/replay.py), when given: every router is forced to a trace's experts, and the
  oracle prefetcher may read the trace's future.

With neither a prefetcher nor a policy that reads the router's distribution, the routing hooks are not
installed at all: the decode path then does one host copy of each layer's routing (models/experts.py) and
one lock round per layer whose experts are all resident.
"""

from __future__ import annotations

import math
import time

import numpy as np

from moe_offload.runtime.counters import Counters
from moe_offload.runtime.datapath import DataPath
from moe_offload.runtime.live_view import LiveRoutingView


class ModelRunner:
    def __init__(self, model, adapter, spec, path: DataPath, counters: Counters, *, prefetcher=None,
                 policy_needs_probs: bool = False, replay=None, source: str = "live generation"):
        self.model, self.adapter, self.spec, self.path, self.counters = model, adapter, spec, path, counters
        self.prefetcher, self.replay, self.source = prefetcher, replay, source
        self.policy_needs_probs = policy_needs_probs
        self.needs_gate_prediction = "gate_prediction" in getattr(prefetcher, "requires", ())
        self.needs_routing = prefetcher is not None or policy_needs_probs
        self.iteration = 0
        self.request = -1
        self.tokens_in_pass = 0
        self.view: LiveRoutingView | None = None
        self.request_embedding = None
        self.probs = np.zeros((spec.num_layers, spec.num_experts), np.float32)
        self._hooks = []
        self._tap = None

    # ------------------------------------------------------------------------------------------ set-up
    def install(self) -> None:
        from moe_offload.models.experts import use_project_experts
        from moe_offload.models.routing_tap import RoutingTap

        use_project_experts(self.adapter, self)
        if self.replay is not None:
            self.replay.install()  # first: the hooks below see the forced routing and the pass already started
        base = self.model.model
        self._hooks = [base.register_forward_pre_hook(self._pass_start, with_kwargs=True),
                       base.register_forward_hook(self._pass_end)]
        if self.needs_routing:
            self._tap = RoutingTap(self.adapter, self._layer_routed, capture_hidden=self.needs_gate_prediction)
            self._tap.__enter__()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._tap is not None:
            self._tap.__exit__(None, None, None)
        if self.replay is not None:
            self.replay.remove()

    def start_request(self) -> None:
        """The next forward passes belong to a new request (sequence)."""
        self.request += 1
        self.view, self.request_embedding = None, None

    # ----------------------------------------------------------------------------------- expert source
    def layer_experts(self, layer: int, experts: list[int], tokens: list[int]):
        J = self.spec.num_experts
        keys = [layer * J + e for e in experts]
        c, path = self.counters, self.path
        fast_tier = path.tiers[0]
        fast = fast_tier.cache
        cond = path.cond
        with cond:
            path.raise_failure()
            ctx = path.ctx
            ctx.layer, ctx.iteration, ctx.token, ctx.request = layer, self.iteration, self.iteration, self.request
            if self.policy_needs_probs:
                ctx.probs = self.probs
                ctx.predicted = self.prefetcher.predicted_map() if self.prefetcher is not None else None
            pinned = path.pinned
            pinned.clear()
            pinned.update(keys)
            missing = False
            for key, count in zip(keys, tokens):
                ctx.clock += 1
                ctx.routed = {self.request: count}
                c.accesses += 1
                c.per_layer_accesses[layer] += 1
                if key in path.prefetched_unused:
                    path.prefetched_unused.discard(key)
                    c.prefetches_used += 1
                if fast.touch(key, ctx):
                    c.hits += 1
                    c.per_layer_hits[layer] += 1
                    continue
                missing = True
                if not path.on_wire_to_fast(key):  # a prefetch on the last wire is no demand load
                    path.route(key, demand=True, priority=math.inf)  # also on its way to the host: demand
                    c.on_demand_loads += 1
            ctx.routed = None
            if missing or self.prefetcher is not None:
                path.layer_routed(layer, keys)
                cond.notify_all()
            if not missing:  # every expert resident: hand them all over at once
                ready = [(key, fast_tier.tensors(key), fast_tier.ready.get(key)) for key in keys]
        try:
            if not missing:
                for key, tensors, event in ready:
                    _wait(event)
                    yield key - layer * J, tensors
                return
            remaining = list(keys)
            while remaining:
                with cond:
                    waited = time.perf_counter()
                    while True:
                        path.raise_failure()
                        key = next((k for k in remaining if k in fast), None)
                        if key is not None:
                            break
                        cond.wait()
                    stalled = time.perf_counter() - waited
                    c.stall_seconds += stalled
                    c.per_layer_stall_seconds[layer] += stalled
                    tensors, event = fast_tier.tensors(key), fast_tier.ready.get(key)
                remaining.remove(key)
                _wait(event)
                yield key - layer * J, tensors
                with cond:  # computed: it may be evicted from now on
                    pinned.discard(key)
                    cond.notify_all()
        finally:
            with cond:
                pinned.difference_update(keys)
                cond.notify_all()

    # -------------------------------------------------------------------------------- routing hooks
    def _pass_start(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        embeds = kwargs.get("inputs_embeds")
        self.tokens_in_pass = int(ids.shape[-1]) if ids is not None else int(embeds.shape[-2])
        if not self.needs_routing:
            return
        import torch

        prefill = self.view is None or self.request_embedding is None
        if prefill and ids is not None:
            with torch.no_grad():
                embedded = self.model.get_input_embeddings()(ids.reshape(1, -1)).float()
            self.request_embedding = embedded[0].mean(dim=0).cpu().numpy()
        self.view = LiveRoutingView(self.spec, self.iteration, self.tokens_in_pass, self.request, prefill,
                                    self.request_embedding, source=self.source,
                                    future=self.replay.future if self.replay is not None else None)
        if self.prefetcher is not None:
            proposals = self.prefetcher.on_iteration_start(self.view)
            with self.path.cond:
                self.path.propose(proposals, -1)

    def _layer_routed(self, layer: int, routing) -> None:
        view = self.view
        selected = routing.experts.cpu().numpy()
        probs = self.adapter.probabilities(routing.logits).cpu().numpy()
        predicted = None
        if self.needs_gate_prediction and layer + 1 < self.spec.num_layers:
            predicted = self.adapter.probabilities(
                self.adapter.predict_next_router_logits(layer, routing.hidden)).cpu().numpy()
        view.routed(layer, selected, probs, predicted)
        self.probs[layer] = probs.mean(axis=0)
        if self.prefetcher is not None:
            proposals = self.prefetcher.on_layer_routed(view)
            with self.path.cond:
                self.path.propose(proposals, layer)

    def _pass_end(self, module, args, output):
        if self.prefetcher is not None and self.view is not None:
            self.prefetcher.on_iteration_end(self.view)
        self.iteration += 1


def _wait(event) -> None:
    """CUDA: the current stream waits (on the GPU) for the expert's copy; nothing to do on a CPU."""
    if event is not None:
        import torch

        torch.cuda.current_stream().wait_event(event)
