"""The timed simulator's compute stream: forward passes over virtual time, with the prefetcher's hooks.

One compute stream (the GPU) runs the iterations one after another. An iteration runs layers 0..L-1;
each layer runs its attention, then its router, whose output makes the layer's *needed* experts known:
the union of the experts its tokens selected, each with the number of tokens routed to it (a prefill
iteration routes all prompt tokens at once, a decode iteration one token per request, a batch several
requests). Then each needed expert runs, as soon as it is resident in the fast tier (tier 0, the GPU),
for ``compute.expert_seconds(tokens routed to it)``; experts already resident run first, the others as
they arrive, and while no needed expert is resident the stream stalls (``per_layer_stall_seconds``).
After the last layer the LM head runs and the iteration's tokens are done. Costs come from the
hardware profile (moe_offload.hardware); how experts reach the GPU is tiers.py's business.

The prefetcher is called as prefetch/base.py says: ``on_iteration_start`` before layer 0,
``on_layer_routed`` right after each router, ``on_iteration_end`` after the LM head, and
``on_request_end`` for each request whose last iteration it was (every tier's cache hears it too). Its proposals go to
the transfer queues (simulator/transfers.py), which order them; proposals for layers already routed in
this iteration are ignored, and when a layer is routed its waiting prefetches are dropped (the needed
ones become demand loads). Once the last layer is routed every layer is ahead again: what is proposed
from then on (MoEpic's layer 0 of the next token) is for the next pass, and is dropped when that pass
routes its layer. A prefetcher's searches are charged as stream.py says, where the
virtual clock and the work on the compute stream are.

How AccessContext maps onto the timed model (the replay fills the same fields, see policies/base.py):

    clock       the position of the access in the *timed access order*: iteration by iteration, layer by
                layer, the layer's needed experts in order of first appearance over the iteration's tokens
                (row order, then router rank; needs.py). Between accesses (a transfer starting or landing later)
                it stays at the latest access.
    layer       the layer being computed.
    token, iteration
                the number of the simulated iteration (0, 1, ...): a time step is one forward pass,
                because all tokens of a batch or prefill are routed together. With one token per
                iteration, starting at iteration 0, this is the trace row, as in the replay.
    request     the request of the iteration's first token.
    routed      during an access, the tokens routed to the accessed expert by request; None between accesses.
    probs       the mean router distribution of the iteration's tokens, [L, J], when the trace has probs.
    predicted   ``prefetcher.predicted_map()`` after its latest hook call (None without a prefetcher).
    next_use    offline policies: the clock of the key's next access in the timed access order. Refused
                when serving arrivals (poisson, times), where that order depends on the timing itself.
    pinned      the experts the current layer still has to compute.
    prefetch    True while a prefetch into the GPU is reserved or lands.

The policy's own time: each eviction is a decision that costs the time decisions.py gives it (0 unless the
policy has a FLOPs rule or the profile a measured cost), and a load's bytes wait for the decisions that made
its room.

Host compute (host.py): a miss the GPU's cache does not admit is computed on the host CPU from its copy
there, beside the GPU's experts or, on a machine without a GPU, on the compute stream after them.

Uploads between passes (``uploads``, uploads.py: llama.cpp PR #27861's cache). The GPU cache admits no miss
when it happens: its misses run on the host, and after each pass the rule publishes the uploads that have
landed and schedules some of the pass's misses as uploads, off the compute stream. A pass larger than the
rule serves does not read the cache: all of its experts run on the host, but for the layers a -dist cache
holds whole (``whole_layers``, llama.cpp's layers kept in VRAM), which are ordinary GPU layers in every pass.

Streamed layers (``layerwise``, layerwise.py: KTransformers' full-GPU fallback, vLLM's and SGLang's layer
offloaders). A pass of at least its threshold of tokens brings its streamed layers' whole expert sets to the
GPU and runs every routed expert of them there: KTransformers' when the layer is routed (the compute stream
waits for it on the host link), then with the dynamic update the layer's GPU experts become that pass's most
routed; the offloaders' on a copy stream of their own, a few streamed layers ahead, the compute waiting for a
layer's copy before its attention (vLLM) or its experts (SGLang).

Split experts (``split``, MoEpic, paper 004). The GPU is then not one cache of whole experts but, per layer,
a cache of top segments and a buffer for the missing segments (simulator/split.py): a transfer into the
GPU carries what the expert lacks there (its bottom segment when its top is cached, else all of it),
resident means complete, and an expert computes the top segment's share of its time as soon as its top is
in VRAM, the rest once it is complete. Everything else (queues, pinning, prefetchers, counters) is the
same run; a hit is an expert complete when its layer is routed. With ``reconfiguration`` (reconfigure.py) the
split configuration changes every tau tokens, between two passes, as MoEpic's online loop decides.
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import AccessContext, ModelSpec, policy_factory, policy_info
from moe_offload.policies.fetch_or_compute import FetchOrCompute
from moe_offload.prefetch import Prefetcher, RoutingView, search_latency
from moe_offload.prefetch.budget import budget_from_hardware
from moe_offload.simulator.split import SplitConfig, SplitExperts
from moe_offload.simulator.timed.decisions import tier_decisions
from moe_offload.simulator.timed.host import HostWork
from moe_offload.simulator.timed.layerwise import StreamedLayers
from moe_offload.simulator.timed.reconfigure import OnlineConfigurator
from moe_offload.simulator.timed.schedule import Arrivals, make_schedule
from moe_offload.simulator.timed.stream import ComputeStream
from moe_offload.simulator.timed.needs import NextUses, pass_needs
from moe_offload.simulator.timed.tiers import TierNetwork, build_tiers
from moe_offload.simulator.timed.uploads import UploadsBetweenPasses
from moe_offload.trace.format import PREFILL, Trace


class TimedRun(ComputeStream):
    """One timed run: build it, then ``run()`` (see the module doc)."""

    def __init__(self, trace: Trace, hardware: HardwareProfile, policy: str, cache_bytes: int, expert_bytes: int,
                 prefetcher: Prefetcher | None, arrivals: Arrivals, seed: int, policy_options: dict | None,
                 all_resident: bool, split: SplitConfig | None = None,
                 reconfiguration: OnlineConfigurator | None = None, fetch_or_compute: bool = False,
                 uploads: UploadsBetweenPasses | None = None, layerwise: StreamedLayers | None = None):
        meta = trace.meta
        self.trace, self.hardware, self.arrivals = trace, hardware, arrivals
        self.spec = spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
        self.L, self.J, self.E = spec.num_layers, spec.num_experts, expert_bytes
        super().__init__(hardware.compute, prefetcher)
        self.host = HostWork(hardware, expert_bytes, meta.hidden_size, self.events)  # bypassed experts (host.py)
        info = policy_info(policy)
        self.offline = info.offline and not all_resident
        # Only a policy that reads the router's distribution gets the pass's mean of it: averaging a prefill's
        # [tokens, L, J] rows costs more than the rest of a small pass.
        self.averages_probs = info.policy.needs_probs and trace.probs is not None
        make = policy_factory(policy, spec, seed=seed, options=policy_options)  # every tier's policy
        whole_layers = info.whole_layers(policy_options, spec)
        self.ctx = ctx = AccessContext()
        self.pinned: set = set()
        ctx.pinned = self.pinned
        admission = FetchOrCompute.on_profile(self.host.costs) if fetch_or_compute else uploads
        tiers = build_tiers(trace, hardware, policy, make, cache_bytes, expert_bytes, ctx, all_resident, split,
                            admission, whole_layers)
        self.fast, middle, home = tiers.fast, tiers.middle, tiers.home
        self.split: SplitExperts | None = tiers.split  # the GPU tier of a split run
        self.decisions = tier_decisions(hardware, spec, policy, make, info.policy.static,
                                        [cache_bytes] + [tier.capacity_bytes for tier in hardware.tiers[1:home]],
                                        expert_bytes, self.events)
        self.net = TierNetwork(hardware, [self.fast] + middle,
                               home, expert_bytes, self.L, self.J, ctx, self.pinned, self.events, self.split,
                               self._next_use_after if self.offline else None, self.decisions)
        self.host.net = self.net
        self.uploads = uploads
        self.whole_layers = set(whole_layers)
        self.serving = True  # the GPU cache serves the current pass (module doc: Uploads between passes)
        self.layerwise = layerwise
        self.fallback = False      # the current pass streams whole layers to the GPU (module doc: Streamed layers)
        self.with_layer: set = set()  # the current layer's routed experts that came with its whole set
        self.reconfiguration = reconfiguration
        self.reconfigurations: list[dict] = []  # what each online reconfiguration chose, and its cost
        self.clock = -1
        self.rounds = 0  # the replay's rounds before the current pass: K per token (AccessContext.round)
        self.iteration = 0
        self.passed_last_router = False  # the current pass has routed its last layer
        # counters
        self.accesses = self.hits = self.on_demand = self.used = self.bypassed = 0
        self.per_layer_bypassed = [0] * self.L
        self.per_layer_accesses = [0] * self.L
        self.per_layer_hits = [0] * self.L
        self.per_layer_stall = [0.0] * self.L
        self.schedule = make_schedule(trace, arrivals)
        # offline policies: each key's next access in the timed access order (needs.py)
        self.next_uses = NextUses(trace, self.J) if self.offline else None

    @property
    def host_seconds(self) -> float:
        """The host CPU's time on bypassed experts in this run."""
        return self.host.seconds

    def _next_use_after(self, key: int) -> int:
        return self.next_uses.after(key, self.clock)

    # ------------------------------------------------------------------------------------------ the run

    def _route(self, layer: int, keys: list[int], routed: dict[int, dict[int, int]], rounds: list[int]) -> None:
        """Layer ``layer``'s router has run: its accesses, in order (each with its tokens by request, and the
        replay's round of its first request counted from the pass's first), and the demand loads of its
        misses."""
        ctx, fast = self.ctx, self.fast
        self.pinned.update(keys)
        if self.fallback and self.layerwise.streams(layer):
            self._bring_whole_layer(layer, keys)
            return
        if self.split is not None:
            self.split.drop_unneeded(layer, set(keys))
        net = self.net
        middle = net.caches[1:]
        serving = self.serving or layer in self.whole_layers
        for key, round_in_pass in zip(keys, rounds):
            self.clock += 1
            ctx.clock = self.clock
            ctx.round = self.rounds + round_in_pass
            if self.offline:
                ctx.next_use = self.next_uses.at[self.clock]
            ctx.routed = routed[key]
            hit = serving and fast.touch(key, ctx)
            prefetched = key in net.pending_use
            if prefetched:
                net.pending_use.discard(key)
            if hit:
                self.hits += 1
                self.per_layer_hits[layer] += 1
                self.used += prefetched
                continue
            for tier in middle:
                tier.touch(key, ctx)
            load = net.loads.get(key)
            # not admitted: computed on the host (module doc: Host compute)
            if load is None and self.split is None and (not serving or not fast.admits(key, ctx)):
                self.bypassed += 1
                self.per_layer_bypassed[layer] += 1
                self.host.bypassed[key] = sum(ctx.routed.values())
                self.pinned.discard(key)
                continue
            if load is not None and not load.demand and net.on_last_wire(key):
                self.used += prefetched  # a late prefetch, already on its last wire
                continue
            self.on_demand += 1
            net.demand(key, load)
        ctx.routed = None
        self.accesses += len(keys)
        self.per_layer_accesses[layer] += len(keys)
        net.drop_prefetches_of(layer)
        net.kick()

    def _bring_whole_layer(self, layer: int, keys: list[int]) -> None:
        """A streamed layer (layerwise.py) once routed: its J experts cross the host link now, or its copy ahead
        lands, while the compute stream waits; its routed experts then all run on the GPU, the resident ones
        counted as hits."""
        if not self.layerwise.prefetch_step:
            self._copy_layer(layer, self.now)
        self._await_copy(layer)
        hits = sum(key in self.fast for key in keys)
        self.clock += len(keys)
        self.hits += hits
        self.per_layer_hits[layer] += hits
        self.accesses += len(keys)
        self.per_layer_accesses[layer] += len(keys)
        self.with_layer = set(keys)

    def _copy_layer(self, layer: int, now: float) -> None:
        """Start the copy of ``layer``'s J experts over the host link at ``now`` (or once the copy stream is free)."""
        queue = self.net.queues[1]
        start, end = self.layerwise.copy(layer, now, queue.link.transfer_seconds(self.J * self.E))
        queue.bytes_moved += self.J * self.E
        self.events.append((queue.link.name, "layer", start, end, layer, -1))

    def _await_copy(self, layer: int) -> None:
        """The compute stream waits for the copy of ``layer``."""
        self._wait_until(self.layerwise.landed[layer], layer)

    def _wait_until(self, time: float, layer: int, kind: str = "stall") -> None:
        """The compute stream waits until ``time`` in ``layer``, if it is ahead."""
        if time > self.now:
            start = self.now
            self._advance_to(time)
            self._stalled(start, layer, kind)

    def _stalled(self, start: float, layer: int, kind: str = "stall") -> None:
        """The compute stream waited from ``start`` to now in ``layer``: its stall time and timeline event."""
        self.per_layer_stall[layer] += self.now - start
        self.events.append(("stall", kind, start, self.now, layer, -1))

    def _part_ready(self, key: int, top_done: bool) -> bool:
        """Whether the next part of expert ``key`` can run: all of it once resident (or come with its whole
        layer); split, its top share once it has its top, the rest once it is complete."""
        if key in self.with_layer:
            return True
        if self.split is None or top_done or key in self.fast:
            return key in self.fast
        return self.split.has_top(key)

    def _run_experts(self, layer: int, keys: list[int], counts: list[int], tokens: int) -> None:
        host = self.host
        bypassed = host.bypassed  # they run on the host
        # A host that is the compute device runs them on the compute stream: after the resident experts, or
        # while none is resident and a load is awaited (the runtime's order), not beside them.
        on_stream = list(bypassed.items()) if bypassed and self.hardware.host.on_compute_device else []
        if on_stream:
            host.bypassed = {}
        host_done = host.run_beside(layer, tokens, self.now) if bypassed and not on_stream else self.now
        remaining = [[key, count, False] for key, count in zip(keys, counts)  # [key, tokens, top share run]
                     if key not in bypassed]
        expert_seconds, E, split = self.compute.expert_seconds, self.E, self.split
        theta = split.ratio[layer] if split is not None else 1.0
        while remaining:
            ready = next((i for i, (key, _, top_done) in enumerate(remaining) if self._part_ready(key, top_done)),
                         None)
            if ready is None and on_stream:
                key, routed = on_stream.pop(0)
                self._compute(host.on_stream_seconds(key, routed), "host", layer, key)
                continue
            if ready is None:
                start = self.now
                while not any(self._part_ready(key, top_done) for key, _, top_done in remaining):
                    if self._next_event_time() == math.inf:
                        raise RuntimeError(f"no transfer can bring the experts layer {layer} waits for "
                                           f"{[k for k, _, _ in remaining]}")
                    self._process_next_event()
                self._stalled(start, layer)
                continue
            key, tokens, top_done = remaining[ready]
            seconds = expert_seconds(tokens, E)
            if theta < 1 and not top_done:  # the top segment's share; the bottom's may still be on the wire
                self._compute(theta * seconds, "expert", layer, key)
                remaining[ready][2] = True
                continue
            remaining.pop(ready)
            self._compute((1 - theta) * seconds if top_done else seconds, "expert", layer, key)
            self.pinned.discard(key)
            if split is not None:
                split.consume(key)
            self.net.kick()
        for key, routed in on_stream:
            self._compute(host.on_stream_seconds(key, routed), "host", layer, key)
        if self.fallback and self.layerwise.streams(layer):
            self.layerwise.update(self.fast, self.ctx, layer, keys, counts, self.J, self.E)
            self.with_layer = set()
            if self.layerwise.prefetch_step:  # its buffer is free: the copy s streamed layers ahead starts
                self._copy_layer(self.layerwise.copy_after(layer), self.now)
        self._wait_until(host_done, layer, "host")  # the layer is done when the host's share is

    def run(self) -> dict:
        trace, ctx, compute, L, J = self.trace, self.ctx, self.compute, self.L, self.J
        arrival: dict[int, float] = {}
        token_times: dict[int, list[float]] = {}
        spans = []  # (start, end, is_decode) of every iteration
        while True:
            batch = self.schedule.next_batch(self.now)
            if batch is None:
                break
            start, rows = batch
            if start > self.now:
                self._advance_to(start)
            requests = [int(r) for r in dict.fromkeys(trace.request[rows].tolist())]
            for request in requests:
                if request not in arrival:
                    arrival[request] = self.schedule.arrival(request, start)
                    token_times[request] = []
            n = len(rows)
            ctx.iteration = ctx.token = self.iteration
            ctx.request = requests[0]
            if self.averages_probs:
                ctx.probs = trace.probs[rows].astype(np.float32).mean(axis=0)
            view = RoutingView(trace, self.iteration, rows)
            self.serving = self.uploads is None or self.uploads.serves(n)
            self.fallback = self.layerwise is not None and self.layerwise.takes(n)
            if self.fallback:
                self.layerwise.passes += 1
            self.layer_now, self.passed_last_router = -1, False
            if self.prefetcher is not None:
                self._consult(self.prefetcher.on_iteration_start, view)
            needs = pass_needs(trace.experts, trace.request, rows, J)
            for layer in range(L):
                ctx.layer = layer
                if self.fallback and self.layerwise.before_attention and self.layerwise.streams(layer):
                    self._await_copy(layer)
                self._compute(compute.attention(n), "attention", layer)
                self._compute(compute.router(n), "router", layer)
                keys, counts, rounds, routed = needs[layer]
                self.layer_now = view.layer_now = layer
                self._route(layer, keys, routed, rounds)
                if layer == L - 1:  # every layer is ahead again: proposals and arrivals are for the next pass
                    self.layer_now, self.passed_last_router = -1, True
                if self.prefetcher is not None:
                    self._consult(self.prefetcher.on_layer_routed, view)
                self._run_experts(layer, keys, counts, n)
            self._compute(compute.lm_head(n), "lm_head", -1)
            self.rounds += n * self.spec.top_k
            for request in requests:
                token_times[request].append(self.now)
            spans.append((start, self.now, not (trace.phase[rows] == PREFILL).any()))
            if self.uploads is not None:
                self._upload_between_passes()
            if self.prefetcher is not None:
                self.prefetcher.on_iteration_end(view)
                seconds, on_inference_path = search_latency(self.prefetcher)
                self.search_seconds += seconds
                if seconds and on_inference_path:
                    self._compute(seconds, "search", -1)
                elif seconds:
                    self.matcher_free = max(self.now, self.matcher_free) + seconds
            if self.reconfiguration is not None:
                plan = self.reconfiguration.observe(trace, rows, self.iteration)
                if plan is not None:
                    self._reconfigure(plan)
            for request in self.schedule.batch_done():  # per-sequence state of the policies and prefetcher ends
                for tier in self.net.caches:
                    tier.end_request(request)
                if self.prefetcher is not None:
                    self.prefetcher.on_request_end(request)
            self.iteration += 1
        return {"arrival": arrival, "token_times": token_times, "spans": spans}

    def _upload_between_passes(self) -> None:
        """The step after a pass (uploads.py): publish, schedule; the uploads' bytes count on the host link."""
        queue = self.net.queues[1]
        scheduled = self.uploads.between_passes(self.fast, self.ctx, self.now, queue.link.transfer_seconds(self.E),
                                                self.J, self.E)
        queue.bytes_moved += len(scheduled) * self.E
        for key, start, end in scheduled:
            self.events.append((queue.link.name, "upload", start, end, key // self.J, key))

    def _reconfigure(self, plan: SplitConfig) -> None:
        """Apply MoEpic's new configuration between two passes (reconfigure.py): wait until nothing moves into
        the GPU, cache each layer's top-C_i experts by priority, load what their tops lack, and give the
        prefetcher its Y."""
        start, net = self.now, self.net
        while True:
            net.withdraw_prefetches()
            if not net.queues[1].busy:
                break
            self._process_next_event()
        transfers, loaded = self.split.reconfigure(plan, self.ctx, self.reconfiguration.ranked_tops(plan))
        self._advance_to(self.now + net.direct_load_seconds(transfers, loaded))
        self.events.append(("compute", "reconfigure", start, self.now, -1, -1))
        if self.prefetcher is not None:
            self.prefetcher.set_budget(budget_from_hardware(self.hardware, self.E, self.L, self.spec.top_k,
                                                            plan.prefetches))
        self.reconfigurations.append({
            "iteration": self.iteration, "tokens": self.reconfiguration.statistics.tokens,
            "seconds": self.now - start, "bytes_loaded": loaded,
            "layers": [{"cache_size": p.cached_experts, "split_ratio": p.split_ratio, "prefetches": p.prefetches}
                       for p in plan.layers]})
