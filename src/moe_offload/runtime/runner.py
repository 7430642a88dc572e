"""The model runner: one forward pass of a transformers MoE model whose experts come from the tiers.

Everything here works per forward pass and knows nothing of prompts or generation loops: transformers'
``generate`` (one request, runtime/engine.py) and the continuous-batching scheduler (runtime/batching.py,
several requests packed into one pass: ``packed``, runtime/packed.py) drive it alike. A pass is made of
segments, one per request; a single-request pass has one:

- the **expert source** (:meth:`ModelRunner.layer_experts`, the :class:`~moe_offload.models.experts.ExpertSource`
  of models/experts.py): for each MoE layer, count the accesses in the policy's
  :class:`~moe_offload.policies.base.AccessContext` (filled as the simulators fill it, ``routed`` included),
  pin the layer's experts, demand-load the missing ones through the data path, and hand each expert to the
  compute as soon as it is resident; computed experts are unpinned at once. A miss the fast tier does not
  admit (``admits``: a placing policy's bypass, simulator/cache.py) is handed over from the host tier's copy
  instead, marked to be computed on the host (models/host_experts.py), after the resident ones. A batch's
  experts are the union of its tokens' selections: one access per expert and pass, whose ``routed`` carries
  each request's tokens, one load; each request's own counters (``request_counters``) see the accesses of its experts.
  What a hit is and what the compute is handed is the fast tier's (``fast``): a whole expert
  (runtime/tiers.py ``WholeExperts``), or, in a split run (MoEpic, runtime/split.py ``SplitExperts``), its top
  and its bottom, each handed over when it is in fast memory, the expert released once both are computed;
- the **routing hooks**: a RoutingTap on every router feeds the prefetcher (the same objects as the timed
  simulator's) through a :class:`~moe_offload.runtime.live_view.LiveRoutingView` right after each layer's
  router ran, with each row's request (``RoutingView.requests``) and, when the prefetcher reads them
  (``requires`` embedding: fMoE), each row's token input embedding (one lookup of the embedding layer and one
  copy to the host per pass, the trace's ``embedding`` column as the recorder writes it); a pre-hook and a
  hook on the decoder mark where a forward pass starts and ends; ``end_request`` tells the caches' policies
  and the prefetcher that a request left;
- the **matcher** (runtime/matcher.py): a prefetcher whose search is off the inference path (fMoE) gets its
  hooks on a thread of its own, with snapshots of the view, and its proposals are applied when they arrive
  (``_deliver``: those for a pass that is over or a layer already routed are late and dropped); the others
  are called on the decode thread and their proposals applied at once;
- **routing replay** (runtime/replay.py), when given: every router is forced to a trace's experts, and the
  oracle prefetcher may read the trace's future.
- **online reconfiguration** (a split run's, runtime/split_online.py), when given: after each pass.

With neither a prefetcher nor a policy that reads the router's distribution, the routing hooks are not
installed at all: the decode path then does one host copy of each layer's routing (models/experts.py) and
one lock round per layer whose experts are all resident.
"""

from __future__ import annotations

import math
import time

import numpy as np

from moe_offload.models.experts import use_project_experts
from moe_offload.models.host_experts import ON_HOST
from moe_offload.models.routing_tap import RoutingTap
from moe_offload.runtime.counters import Counters
from moe_offload.runtime.datapath import DataPath
from moe_offload.runtime.live_view import LiveRoutingView
from moe_offload.runtime.matcher import AsyncMatcher, runs_off_the_decode_thread
from moe_offload.runtime.packed import register_attention, segment_rows, unsegment_rows
from moe_offload.runtime.routing_log import RoutingLog
from moe_offload.runtime.split import SplitExperts
from moe_offload.runtime.tiers import WholeExperts


class ModelRunner:
    def __init__(self, model, adapter, spec, path: DataPath, counters: Counters, *, prefetcher=None,
                 policy_needs_probs: bool = False, policy_needs_rounds: bool = False, replay=None,
                 source: str = "live generation", matcher: str = "async", prefetch_budget=None, online=None):
        """``matcher``: ``async``, ``inline`` or ``lockstep`` (runtime/matcher.py), for a prefetcher whose
        search is off the inference path; the others always run on the decode thread.
        ``policy_needs_rounds``: give each access the replay's round (AccessContext.round), from the routing.
        ``prefetch_budget``: what the link into the fast tier carries per layer (prefetch/budget.py, the timed
        simulator's on the same profile), given to the prefetcher with a split configuration's Y when it has them.
        ``online``: a split run's online reconfiguration (runtime/split_online.py), or None."""
        self.model, self.adapter, self.spec, self.path, self.counters = model, adapter, spec, path, counters
        self.prefetcher, self.replay, self.source = prefetcher, replay, source
        self.policy_needs_probs = policy_needs_probs
        # its statistics read every pass's routing and speculative gate predictions
        self.needs_gate_prediction = "gate_prediction" in getattr(prefetcher, "requires", ()) or online is not None
        self.policy_needs_rounds = policy_needs_rounds
        self.needs_routing = prefetcher is not None or policy_needs_probs or policy_needs_rounds or online is not None
        self.online = online
        if path.split is None:
            self.fast = WholeExperts(path)
            if prefetcher is not None and prefetch_budget is not None:
                prefetcher.set_budget(prefetch_budget)
        else:
            self.fast = SplitExperts(path, prefetcher, prefetch_budget, online)
        # the replay's rounds before this pass (K per token fed) and, per layer of this pass, each routed
        # expert's first position in the [tokens, K] selections, row-major: its round counted from the pass's
        self.rounds = 0
        self.first_round: list[dict] = [{} for _ in range(spec.num_layers)]
        self.needs_embedding = "embedding" in getattr(prefetcher, "requires", ())
        self.matcher = None
        if prefetcher is not None and matcher != "inline" and runs_off_the_decode_thread(prefetcher):
            self.matcher = AsyncMatcher(prefetcher, self._deliver, lockstep=matcher == "lockstep")
        self.proposals_arrived = 0  # proposals the matcher delivered (locked)
        self.proposals_late = 0     # ... for a pass that was over or a layer already routed: dropped
        self.routed_proposals = None  # the decode thread's prefetcher's, at the router: applied in layer_experts
        self.iteration = 0
        self.request = -1          # the request of transformers' generate (one segment per pass)
        self.packed = None         # the running packed pass (runtime/packed.py), set by the batching scheduler
        self.segment_requests: list[int] = []  # the requests of the running pass, by segment
        self.request_counters: dict = {}       # request -> its own Counters (the scheduler's requests)
        self.tokens_in_pass = 0
        self.tokens_fed: dict = {}  # request -> tokens it fed the model so far: the positions of the next
        self.view: LiveRoutingView | None = None
        self.keys_of: dict = {}     # request -> the experts it routed to in the running pass (failures)
        self.probs = np.zeros((spec.num_layers, spec.num_experts), np.float32)
        self.computes_on_host = False  # a placing policy's misses may be computed on the host (the engine sets it)
        self._hooks = []
        self._segmented = []
        self._tap = None
        self.routing_log = RoutingLog(adapter)  # the routing of the requests that ask for it (a server's)

    # ------------------------------------------------------------------------------------------ set-up
    def install(self) -> None:
        use_project_experts(self.adapter, self)
        register_attention(self.model)  # sdpa, and per request in a packed pass (runtime/packed.py)
        self._segmented = segment_rows(self.model, self.adapter, lambda: self.packed)
        if self.replay is not None:
            self.replay.install()  # first: the hooks below see the forced routing and the pass already started
        base = self.model.model
        self._hooks = [base.register_forward_pre_hook(self._pass_start, with_kwargs=True),
                       base.register_forward_hook(self._pass_end)]
        self.routing_log.install()
        if self.needs_routing:
            self._tap = RoutingTap(self.adapter, self._layer_routed, capture_hidden=self.needs_gate_prediction)
            self._tap.__enter__()

    def remove(self) -> None:
        unsegment_rows(self._segmented)
        self.routing_log.remove()
        for handle in self._hooks:
            handle.remove()
        if self._tap is not None:
            self._tap.__exit__(None, None, None)
        if self.replay is not None:
            self.replay.remove()
        if self.matcher is not None:
            self.matcher.close()

    def new_request(self) -> int:
        """A new request (sequence) id."""
        self.request += 1
        return self.request

    def start_request(self) -> None:
        """transformers' generate: the next forward passes belong to a new request (sequence)."""
        self.new_request()
        self.view = None

    def end_request(self, request: int) -> None:
        """``request`` has run its last iteration (finished, cancelled, failed): per-sequence state goes."""
        with self.path.cond:
            self.path.end_request(request)
            if self.prefetcher is not None and self.matcher is None:
                self.prefetcher.on_request_end(request)
        if self.matcher is not None:
            self.matcher.submit("on_request_end", request, self.iteration)
        self.request_counters.pop(request, None)
        self.tokens_fed.pop(request, None)
        if self.online is not None:
            self.online.end_request(request)

    def wait_for_matcher(self) -> None:
        """Until the matcher has run every hook submitted so far (a hook's failure is raised here)."""
        if self.matcher is not None:
            self.matcher.drain()

    # ----------------------------------------------------------------------------------- expert source
    def layer_experts(self, layer: int, experts: list[int], tokens: list[list[int]]):
        J = self.spec.num_experts
        keys = [layer * J + e for e in experts]
        c, path, fast = self.counters, self.path, self.fast
        requests = self.segment_requests
        own = [self.request_counters.get(request) for request in requests]
        per_request = any(counters is not None for counters in own)
        cond = path.cond
        with cond:
            path.raise_failure()
            ctx = path.ctx
            ctx.layer, ctx.iteration, ctx.token, ctx.request = layer, self.iteration, self.iteration, requests[0]
            if self.policy_needs_probs:
                ctx.probs = self.probs
                ctx.predicted = (None if self.prefetcher is None else self.matcher.predicted
                                 if self.matcher is not None else self.prefetcher.predicted_map())
            pinned = path.pinned
            pinned.clear()
            pinned.update(keys)
            missing = False
            on_host: set[int] = set()  # bypassed: computed from the host tier's copy
            first_round = self.first_round[layer] if self.policy_needs_rounds else None
            for expert, key, counts in zip(experts, keys, tokens):
                ctx.clock += 1
                if first_round is not None:
                    ctx.round = self.rounds + first_round[expert]
                ctx.routed = {request: n for request, n in zip(requests, counts) if n}
                c.accesses += 1
                c.per_layer_accesses[layer] += 1
                used = path.use(key)
                hit, lacking = fast.access(key, ctx)
                missing |= lacking
                demand = lacking and not path.on_wire_to_fast(key)  # a transfer on the last wire is no demand load
                bypassed = demand and not fast.admits(key, ctx)
                from_host = demand and len(path.tiers) > 1 and key in path.tiers[1].cache
                c.hits += hit
                c.per_layer_hits[layer] += hit
                c.host_hits += from_host
                if bypassed:
                    on_host.add(key)
                    path.compute_on_host(key)
                    c.bypassed += 1
                    c.per_layer_bypassed[layer] += 1
                elif demand:
                    path.route(key, demand=True, priority=math.inf)  # also on its way to the host: demand
                    c.on_demand_loads += 1
                if per_request:
                    for counters, n in zip(own, counts):
                        if counters is not None and n:
                            counters.count_access(layer, hit, demand, used, from_host, bypassed)
                for request in ctx.routed:
                    self.keys_of.setdefault(request, set()).add(key)
            ctx.routed = None
            if missing or self.prefetcher is not None:
                path.layer_routed(layer, keys)
                if self.routed_proposals:
                    path.propose(self.routed_proposals, layer)  # wakes the link workers when it queues one
                self.routed_proposals = None
                if missing:  # demand loads were queued
                    cond.notify_all()
                else:  # withdrawn prefetches and released holds may make room for a waiting load
                    path.room_freed()
            parts = [(key, part) for key in keys for part in range(fast.parts(key))]
            if not missing:  # every expert resident: hand them all over at once
                ready = [(key, *fast.part_tensors(key, part)) for key, part in parts]
        try:
            if not missing:
                for key, tensors, event in ready:
                    _wait(event)
                    yield key - layer * J, tensors
                return
            remaining = parts
            host = path.tiers[-1]
            while remaining:
                with cond:
                    waited = time.perf_counter()
                    while True:
                        path.raise_failure()
                        # the fast tier's first: their kernels are queued before the host computes (CUDA)
                        item = next((item for item in remaining if item[0] not in on_host and fast.has_part(*item)),
                                    None)
                        if item is None:
                            item = next((item for item in remaining if item[0] in on_host and item[0] in host.cache),
                                        None)
                        if item is not None:
                            break
                        cond.wait()
                    stalled = time.perf_counter() - waited
                    for counters in (c, *own):  # every request of the pass waits for the layer
                        if counters is not None:
                            counters.stalled(layer, stalled)
                    key = item[0]
                    if key in on_host:
                        tensors, event = {**host.tensors(key), ON_HOST: True}, None
                    else:
                        tensors, event = fast.part_tensors(*item)
                remaining.remove(item)
                _wait(event)
                computing = time.perf_counter()
                yield key - layer * J, tensors
                computed = time.perf_counter() - computing  # the consumer computed it on this thread meanwhile
                if any(other == key for other, _ in remaining):  # a part of it is still to come
                    continue
                with cond:  # computed: it may be evicted from now on
                    fast.computed(key)
                    if key in on_host:
                        path.computed_on_host(key)
                        self._count_host_compute(computed, own)
                    path.room_freed()
        finally:
            with cond:
                fast.release(keys)
                for key in on_host:
                    path.computed_on_host(key)
                path.room_freed()

    def _count_host_compute(self, seconds: float, own) -> None:
        """Seconds the layer computed a bypassed expert on the host, for the pass and each of its requests."""
        self.counters.host_compute_seconds += seconds
        for counters in own:
            if counters is not None:
                counters.host_compute_seconds += seconds

    # -------------------------------------------------------------------------------- routing hooks
    def _pass_start(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        embeds = kwargs.get("inputs_embeds")
        self.tokens_in_pass = int(ids.shape[-1]) if ids is not None else int(embeds.shape[-2])
        packed = self.packed
        if packed is not None:
            segments = [(s.request, s.start, s.end, s.prefill) for s in packed.segments]
        else:  # transformers' generate: one request, whose first pass is its prompt
            segments = [(self.request, 0, self.tokens_in_pass, self.view is None)]
        self.segment_requests = [request for request, *_ in segments]
        self.keys_of = {}
        self.routing_log.pass_start(segments)
        if not self.needs_routing:
            return
        requests = np.empty(self.tokens_in_pass, np.int64)
        positions = np.empty(self.tokens_in_pass, np.int64)
        for request, start, end, _ in segments:
            requests[start:end] = request
            fed = self.tokens_fed.get(request, 0)
            positions[start:end] = np.arange(fed, fed + end - start)
            self.tokens_fed[request] = fed + end - start
        embedding = None
        if self.needs_embedding:  # what the decoder's embedding layer is about to compute, as the recorder records it
            if embeds is None:
                import torch

                with torch.no_grad():
                    embeds = self.model.get_input_embeddings()(ids.reshape(1, -1))
            embedding = embeds.reshape(self.tokens_in_pass, -1).float().cpu().numpy()
        self.view = LiveRoutingView(self.spec, self.iteration, requests, positions, any(s[3] for s in segments),
                                    embedding,
                                    source=self.source,
                                    future=self.replay.future if self.replay is not None else None)
        if self.prefetcher is not None:
            self._consult("on_iteration_start", -1)

    def _layer_routed(self, layer: int, routing) -> None:
        view = self.view
        selected = routing.experts.cpu().numpy()
        probs = self.adapter.probabilities(routing.logits).cpu().numpy()
        predicted = None
        if self.needs_gate_prediction:  # under a replay the trace's (replay.py says why), else the next router's
            predicted = self.replay.gate_prediction(layer) if self.replay is not None else None
            if predicted is None:  # after the last layer: router 0's, for the next token (adapters.py)
                predicted = self.adapter.probabilities(
                    self.adapter.predict_next_router_logits(layer, routing.hidden)).cpu().numpy()
        view.routed(layer, selected, probs, predicted)
        self.probs[layer] = probs.mean(axis=0)
        if self.policy_needs_rounds:
            flat = selected.reshape(-1).tolist()
            self.first_round[layer] = {expert: flat.index(expert) for expert in set(flat)}
        if self.prefetcher is not None:
            self._consult("on_layer_routed", layer)

    def _pass_end(self, module, args, output):
        self.routing_log.pass_end()
        self.rounds += self.tokens_in_pass * self.spec.top_k
        view, iteration = self.view, self.iteration
        if self.prefetcher is not None and view is not None:
            if self.matcher is not None:
                self.matcher.submit("on_iteration_end", view, view.iteration)
            else:
                self.prefetcher.on_iteration_end(view)
        self.iteration += 1
        if self.online is not None and view is not None:
            self.fast.after_pass(view, iteration)

    # -------------------------------------------------------------------------------------- the matcher
    def _consult(self, hook: str, layer: int) -> None:
        """The prefetcher's ``hook`` now that layer ``layer`` was routed (-1: before layer 0): on the matcher's
        thread with a snapshot of the view, or here with its proposals applied at once."""
        view = self.view
        if self.matcher is not None:
            self.matcher.submit(hook, view.at(layer), view.iteration)
            return
        proposals = getattr(self.prefetcher, hook)(view)
        if hook == "on_layer_routed" and self.path.split is None:
            # applied once the layer has pinned its experts and queued its demand loads (layer_experts), as the
            # timed simulator orders them: applied now, from the router's hook, a prefetch for the next layer
            # could evict an expert this layer is about to use, and go on the wire ahead of its demand loads.
            # A split run's prefetches take its buffer, not the cache, and move on at routing (datapath.py)
            self.routed_proposals = proposals
            return
        with self.path.cond:
            self.path.propose(proposals, layer)

    def _deliver(self, iteration: int, proposals) -> None:
        """The matcher's proposals for pass ``iteration`` arrived (its thread): those whose layer the running pass
        has routed, all of them once that pass is over, are late and dropped, as the timed simulator drops them."""
        if not proposals:
            return
        J = self.spec.num_experts
        with self.path.cond:  # the view's router count is never behind the data path's (locked) layer_now
            view = self.view  # read once: the decode thread replaces it at the next pass
            now = view.layer_now if view is not None and view.iteration == iteration else self.spec.num_layers - 1
            late = sum(1 for key, _ in proposals if key // J <= now)
            self.proposals_arrived += len(proposals)
            self.proposals_late += late
            if late < len(proposals):
                self.path.propose(proposals, now)


def _wait(event) -> None:
    """CUDA: the current stream waits (on the GPU) for the expert's copy; nothing to do on a CPU."""
    if event is not None:
        import torch

        torch.cuda.current_stream().wait_event(event)
