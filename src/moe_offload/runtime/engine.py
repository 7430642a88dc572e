"""The offloaded inference engine: a transformers MoE model whose experts live in tiers.

Data path (one page)::

    packed files (slow tier) --link worker--> [host tier] --link worker--> fast tier --> experts_forward
        ExpertStore.read         TransferQueue      ExpertCache     TransferQueue    ExpertCache   (models/experts.py)

- Start-up loads only the non-expert weights (runtime/packing.py); every expert starts in the slow tier.
- The fast tier is GPU memory with CUDA, otherwise a RAM budget of compute-ready tensors (float32 on CPU);
  an optional host tier (``host_budget``) caches stored-dtype copies between the files and the fast tier.
  Each tier is the simulators' :class:`~moe_offload.simulator.cache.ExpertCache` with a byte budget and an
  eviction policy object from ``moe_offload.policies``: residency, budgets and pinning live there.
- One worker thread per link serves that link's :class:`~moe_offload.simulator.transfers.TransferQueue`,
  the timed simulator's queue logic (demand loads jump the queue and hold prefetches back, no transfer is
  duplicated, prefetches go by priority).
- transformers runs attention, the KV cache and sampling. Every MoE layer's experts go through the
  registered experts function, which asks this engine (an ExpertSource) for its experts: they are pinned,
  the missing ones demand-loaded, and each is computed as soon as it is resident; computed experts are
  unpinned at once. The order of arrival does not change the result (models/experts.py), so generation is
  lossless: the same tokens and logits as the all-resident model.
- A RoutingTap on every router feeds the prefetcher (the same objects as the timed simulator's) through a
  :class:`LiveRoutingView` right after each layer's router ran, and the eviction policy through an
  :class:`AccessContext` filled as the simulators fill it.

All cache, queue and policy state is guarded by one condition variable; copies and expert compute run
outside it.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.hardware.profile import Link, format_bytes, parse_bytes
from moe_offload.policies import AccessContext, ModelSpec, policy_info
from moe_offload.prefetch import make_prefetcher, prefetcher_info
from moe_offload.reporting.results import RunResult
from moe_offload.runtime.live_view import LiveRoutingView
from moe_offload.runtime.packing import Manifest, load_skeleton, read_manifest
from moe_offload.runtime.storage import ExpertStore
from moe_offload.simulator.cache import ExpertCache, PartitionedCache
from moe_offload.simulator.transfers import TransferQueue


class EngineBusyError(MoeOffloadError):
    """generate was called on an engine that is already generating."""


def parse_budget(text, total_bytes: int, what: str) -> int:
    """``"30%"`` of all expert bytes, or a size (``"64MiB"``, ``"2e9"``)."""
    value = str(text).strip()
    if value.endswith("%"):
        try:
            share = float(value[:-1]) / 100
        except ValueError:
            raise ConfigError(f"{what} {text!r} is not a percentage or a size") from None
        if not 0 < share <= 1:
            raise ConfigError(f"{what} {text!r} must be above 0% and at most 100% of the expert bytes")
        return int(total_bytes * share)
    return parse_bytes(value, what)


@dataclass
class Counters:
    accesses: int = 0
    hits: int = 0
    on_demand_loads: int = 0
    prefetches_issued: int = 0
    prefetches_used: int = 0
    prefetches_wasted: int = 0
    stall_seconds: float = 0.0
    per_layer_accesses: list = field(default_factory=list)
    per_layer_hits: list = field(default_factory=list)
    per_layer_stall_seconds: list = field(default_factory=list)
    bytes_per_link: dict = field(default_factory=dict)

    @classmethod
    def zero(cls, num_layers: int) -> "Counters":
        return cls(per_layer_accesses=[0] * num_layers, per_layer_hits=[0] * num_layers,
                   per_layer_stall_seconds=[0.0] * num_layers)

    def copy(self) -> "Counters":
        return Counters(**{k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                           for k, v in self.__dict__.items()})

    def minus(self, before: "Counters") -> "Counters":
        out = self.copy()
        for name, value in self.__dict__.items():
            old = getattr(before, name)
            if isinstance(value, list):
                setattr(out, name, [a - b for a, b in zip(value, old)])
            elif isinstance(value, dict):
                setattr(out, name, {k: v - old.get(k, 0) for k, v in value.items()})
            else:
                setattr(out, name, value - old)
        return out


@dataclass
class Generation:
    """One generate call: the text, the tokens, and what it cost."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    stats: RunResult
    logits: list | None = None  # per generated token, [vocab] (when asked for)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.stats.total_seconds if self.stats.total_seconds else 0.0


class _Tier:
    def __init__(self, name: str, cache, device, dtype):
        self.name, self.cache, self.device, self.dtype = name, cache, device, dtype
        self.tensors: dict[int, dict] = {}
        cache.on_evict = self.tensors.pop


class _LinkWorker(threading.Thread):
    """Serves one link's TransferQueue: picks the next transfer, makes room, copies outside the lock."""

    def __init__(self, engine: "OffloadEngine", source: int | None, destination: int, link: Link):
        super().__init__(name=f"moe-offload {link.name}", daemon=True)
        self.engine, self.source, self.destination = engine, source, destination
        self.link = link
        self.queue = TransferQueue(link, engine.tiers[destination].cache)
        self.copy_stream = None  # CUDA: this link's copies run on their own stream
        self.staging = None      # CUDA: the pinned buffer every expert passes through

    def run(self) -> None:
        engine, queue = self.engine, self.queue
        tier = engine.tiers[self.destination]
        cond = engine._cond
        with cond:
            while not engine._stopping:
                transfer = queue.next_transfer(time.perf_counter())
                if transfer is None:
                    cond.wait()
                    continue
                key, size = transfer.key, tier_size(engine, self.destination)
                engine.ctx.prefetch = self.destination == 0 and not transfer.demand  # held until used
                try:
                    room = tier.cache.reserve(key, engine.ctx, size)
                finally:
                    engine.ctx.prefetch = False
                if not room:  # the rest of the tier is pinned or on its way in
                    if transfer.demand:
                        cond.wait(0.05)
                    else:
                        queue.withdraw(key)
                        engine._forward.pop(key, None)
                    continue
                queue.start(time.perf_counter())
                if self.destination == 0 and not transfer.demand:
                    engine.counters.prefetches_issued += 1
                    engine._prefetched_unused.add(key)
                source_tensors = None if self.source is None else engine.tiers[self.source].tensors.get(key)
                cond.release()
                error = payload = None
                try:
                    payload = self.copy(key, source_tensors)
                except BaseException as exc:  # reported to the compute thread, which raises it
                    error = exc
                finally:
                    cond.acquire()
                queue.finish()
                links = engine.counters.bytes_per_link
                links[self.link.name] = links.get(self.link.name, 0) + engine.manifest.expert_bytes  # as stored
                if error is not None:
                    tier.cache.cancel(key)
                    engine._prefetched_unused.discard(key)
                    engine._failure = engine._failure or error
                    cond.notify_all()
                    continue
                tier.tensors[key] = payload
                engine.ctx.prefetch = not transfer.demand
                try:
                    tier.cache.complete(key, engine.ctx)
                finally:
                    engine.ctx.prefetch = False
                engine._next_hop(key, self.destination, transfer.demand)
                cond.notify_all()

    def copy(self, key: int, source_tensors: dict | None) -> dict:
        engine = self.engine
        layer, expert = divmod(key, engine.spec.num_experts)
        tensors = source_tensors if source_tensors is not None else engine.store.read_tensors(layer, expert)
        tier = engine.tiers[self.destination]
        if tier.device.type == "cuda":
            return self._to_gpu(tensors, tier)
        if self.destination > 0 and engine.device.type == "cuda":
            return {name: t.pin_memory() for name, t in tensors.items()}  # a host tier in front of a GPU
        return {name: t.to(tier.device, dtype=tier.dtype) for name, t in tensors.items()}

    def _to_gpu(self, tensors: dict, tier: _Tier) -> dict:
        """Copy on this link's own stream through one pinned staging buffer that is reused (grown, never
        reallocated per expert); return once the copy is complete, so resident means usable."""
        import torch

        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device=tier.device)
        need = sum(t.numel() * t.element_size() for t in tensors.values() if not t.is_pinned())
        if need and (self.staging is None or self.staging.numel() < need):
            self.staging = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        compute_stream = torch.cuda.default_stream(tier.device)
        out, offset = {}, 0
        with torch.cuda.stream(self.copy_stream):
            for name, tensor in tensors.items():
                source = tensor
                if not tensor.is_pinned():
                    size = tensor.numel() * tensor.element_size()
                    region = self.staging[offset:offset + size]
                    region.copy_(tensor.contiguous().view(torch.uint8).reshape(-1))
                    source = region.view(tensor.dtype).view(tensor.shape)
                    offset += size
                moved = source.to(tier.device, non_blocking=True).to(tier.dtype)
                moved.record_stream(compute_stream)  # the allocator must not reuse it while compute reads it
                out[name] = moved
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        done.synchronize()  # the staging buffer is free again, and the expert is ready for the compute stream
        return out


def tier_size(engine: "OffloadEngine", tier: int) -> int:
    return engine.compute_expert_bytes if tier == 0 else engine.manifest.expert_bytes


class OffloadEngine:
    """Generate with a packed MoE model whose experts do not all fit in fast memory.

    ``fast_budget`` and ``host_budget``: ``"30%"`` of all expert bytes (compute-ready bytes for the fast
    tier) or a size. ``policy``/``prefetch``: names from ``moe-offload policies``. ``prefetch_history``: a
    trace the prefetcher learns from first (MoE-Infinity's EAMs, fMoE's expert maps)."""

    def __init__(self, packed_dir, *, fast_budget="50%", host_budget=None, policy: str = "lru",
                 policy_options: dict | None = None, prefetch: str | None = None,
                 prefetch_options: dict | None = None, prefetch_history=None, device=None,
                 verify_checksums: bool = True, bypass_page_cache: bool = False, retries: int = 3,
                 store: ExpertStore | None = None, preload: bool = False, seed: int = 0):
        import torch

        from moe_offload.models import quiet_transformers
        from moe_offload.models.experts import use_project_experts

        quiet_transformers()
        self.manifest: Manifest = read_manifest(packed_dir)
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        stored = getattr(torch, self.manifest.dtype)
        self.compute_dtype = torch.float32 if self.device.type == "cpu" else stored
        self.model, self.adapter, self.startup_seconds = load_skeleton(self.manifest, self.device,
                                                                       self.compute_dtype, verify=verify_checksums)
        m = self.manifest
        self.spec = ModelSpec(m.num_layers, m.num_experts, m.top_k)
        self.compute_expert_bytes = m.expert_bytes // stored.itemsize * self.compute_dtype.itemsize
        self.total_expert_bytes = m.num_layers * m.num_experts * self.compute_expert_bytes
        fast_bytes = parse_budget(fast_budget, self.total_expert_bytes, "--fast-budget")
        need = m.top_k * self.compute_expert_bytes
        if fast_bytes < need:
            raise ConfigError(f"fast budget {format_bytes(fast_bytes)} cannot hold one layer's top-{m.top_k} "
                              f"experts ({format_bytes(need)}, {format_bytes(self.compute_expert_bytes)} each)")
        info = policy_info(policy)
        if info.offline:
            raise ConfigError(f"policy {policy!r} needs the future (next use of every expert), which a running "
                              "engine does not know; use it in `moe-offload simulate`")
        make = lambda: info.policy(self.spec, seed=seed, **(policy_options or {}))  # noqa: E731

        def cache(capacity: int, partitioned: bool, slot: int):
            if partitioned:
                return PartitionedCache(capacity, m.num_layers, make, m.num_experts, slot_size=slot)
            return ExpertCache(capacity, make())

        self.tiers = [_Tier("fast", cache(fast_bytes, info.partitioned, self.compute_expert_bytes),
                            self.device, self.compute_dtype)]
        if host_budget is not None:
            host_bytes = parse_budget(host_budget, m.num_layers * m.num_experts * m.expert_bytes, "--host-budget")
            if host_bytes < m.expert_bytes:
                raise ConfigError(f"host budget {format_bytes(host_bytes)} cannot hold one expert "
                                  f"({format_bytes(m.expert_bytes)})")
            self.tiers.append(_Tier("host", ExpertCache(host_bytes, policy_info("lru").policy(self.spec)),
                                    torch.device("cpu"), stored))
        self.policy_name, self.prefetch_name = policy, prefetch
        self.store = store or ExpertStore(m, verify=verify_checksums, bypass_page_cache=bypass_page_cache,
                                          retries=retries)
        self.prefetcher = None
        if prefetch is not None:
            cls = prefetcher_info(prefetch)
            if cls.reads_future:
                raise ConfigError(f"prefetcher {prefetch!r} reads the future routing, which a running engine "
                                  "does not know; use it in `moe-offload simulate --timed`")
            self.prefetcher = make_prefetcher(prefetch, self.spec, prefetch_options)
            if prefetch_history is not None:
                self._fit_prefetcher(prefetch_history)
            elif cls.needs_history:
                raise ConfigError(f"prefetcher {prefetch!r} predicts from past sequences: give it a history trace "
                                  "of this model (prefetch_history=..., --prefetch-history TRACE)")
        self._needs_gate_prediction = "gate_prediction" in getattr(self.prefetcher, "requires", ())
        # the router's distribution is per-layer work on the decode path: only when someone reads it
        self._needs_routing = self.prefetcher is not None or info.policy.needs_probs

        self._cond = threading.Condition()
        self._generate_lock = threading.Lock()
        self._stopping = False
        self._failure: BaseException | None = None
        self._forward: dict[int, tuple[bool, float]] = {}  # key -> (demand, priority) of its next hop
        self._prefetched_unused: set[int] = set()
        self.ctx = AccessContext()
        self._pinned: set[int] = set()
        self.ctx.pinned = self._pinned
        L = m.num_layers
        self.counters = Counters.zero(L)
        self.tiers[0].cache.on_evict = self._on_fast_evict
        self.iteration = 0
        self.request = -1
        self._view: LiveRoutingView | None = None
        self._request_embedding = None
        self._probs = np.zeros((L, m.num_experts), np.float32)

        names = [tier.name for tier in self.tiers] + ["ssd"]
        self.workers = [_LinkWorker(self, i + 1 if i + 1 < len(self.tiers) else None, i,
                                    Link(names[i + 1], names[i], math.inf, 0.0)) for i in range(len(self.tiers))]
        for worker in self.workers:
            worker.start()
        use_project_experts(self.adapter, self)
        self._hooks = self._install_hooks()
        self.preload_seconds = self._preload() if preload else 0.0

    # ------------------------------------------------------------------------------------------ set-up
    def _fit_prefetcher(self, history) -> None:
        from moe_offload.trace.format import Trace, read_trace

        trace = history if isinstance(history, Trace) else read_trace(history)
        meta = trace.meta
        if (meta.num_layers, meta.num_experts, meta.top_k) != (self.spec.num_layers, self.spec.num_experts,
                                                               self.spec.top_k):
            raise ConfigError(f"{trace.path}: a trace of {meta.num_layers} layers x {meta.num_experts} experts, "
                              f"top-{meta.top_k} cannot teach a prefetcher for this model "
                              f"({self.spec.num_layers} x {self.spec.num_experts}, top-{self.spec.top_k})")
        self.prefetcher.fit(trace)

    def _install_hooks(self):
        from moe_offload.models.routing_tap import RoutingTap

        base = self.model.model
        handles = [base.register_forward_pre_hook(self._iteration_start, with_kwargs=True),
                   base.register_forward_hook(self._iteration_end)]
        self._tap = RoutingTap(self.adapter, self._layer_routed, capture_hidden=self._needs_gate_prediction)
        self._tap.__enter__()
        return handles

    def _preload(self) -> float:
        """Fill the fast tier before the first token (the all-resident baseline): load experts in key order
        while they fit."""
        started = time.perf_counter()
        fits = self.tiers[0].cache.capacity // self.compute_expert_bytes
        with self._cond:
            for key in range(min(fits, self.spec.num_layers * self.spec.num_experts)):
                self._route(key, demand=True, priority=math.inf)
            self._cond.notify_all()
            while any(w.queue.waiting() or w.queue.busy for w in self.workers) and self._failure is None:
                self._cond.wait()
            self._raise_failure()
        self.counters = Counters.zero(self.spec.num_layers)
        self._prefetched_unused.clear()
        return time.perf_counter() - started

    # ------------------------------------------------------------------------------- transfers (locked)
    def _route(self, key: int, demand: bool, priority: float) -> bool:
        """Queue ``key`` towards the fast tier from the nearest tier that holds it; True if queued."""
        for index in range(1, len(self.tiers)):
            if key in self.tiers[index].cache:
                worker = self.workers[index - 1]
                break
        else:
            worker = self.workers[-1]
            if len(self.tiers) > 1:  # to the host first; the last hop follows when it lands
                previous = self._forward.get(key)
                if demand or previous is None or not previous[0]:
                    self._forward[key] = (demand, priority)
        if demand:
            return worker.queue.demand(key, self.manifest.expert_bytes)
        return worker.queue.propose(key, priority, self.manifest.expert_bytes)

    def _next_hop(self, key: int, landed_in: int, demand: bool) -> None:
        if landed_in == 0:
            return
        demand_next, priority = self._forward.pop(key, (demand, 0.0))
        if key in self.tiers[0].cache:
            return
        queue = self.workers[landed_in - 1].queue
        if demand_next:
            queue.demand(key, self.manifest.expert_bytes)
        else:
            queue.propose(key, priority, self.manifest.expert_bytes)

    def _on_fast_evict(self, key: int) -> None:
        self.tiers[0].tensors.pop(key, None)
        if key in self._prefetched_unused:
            self._prefetched_unused.discard(key)
            self.counters.prefetches_wasted += 1

    def _on_wire_to_fast(self, key: int) -> bool:
        wire = self.workers[0].queue.on_wire
        return wire is not None and wire.key == key

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _propose(self, proposals, routed_layer: int) -> None:
        if not proposals:
            return
        J = self.spec.num_experts
        fast = self.tiers[0].cache
        for key, priority in proposals:
            key = int(key)
            if key // J <= routed_layer or key in fast or key in fast.reserved:
                continue
            self._route(key, demand=False, priority=float(priority))
        self._cond.notify_all()

    # ---------------------------------------------------------------------------- ExpertSource (compute)
    def layer_experts(self, layer: int, experts: list[int]):
        J = self.spec.num_experts
        keys = [layer * J + e for e in experts]
        c = self.counters
        with self._cond:
            self._raise_failure()
            ctx = self.ctx
            ctx.layer, ctx.iteration, ctx.token, ctx.request = layer, self.iteration, self.iteration, self.request
            ctx.probs = self._probs
            ctx.predicted = self.prefetcher.predicted_map() if self.prefetcher is not None else None
            self._pinned.clear()
            self._pinned.update(keys)
            fast = self.tiers[0].cache
            for key in keys:
                ctx.clock += 1
                c.accesses += 1
                c.per_layer_accesses[layer] += 1
                if key in self._prefetched_unused:
                    self._prefetched_unused.discard(key)
                    c.prefetches_used += 1
                if fast.touch(key, ctx):
                    c.hits += 1
                    c.per_layer_hits[layer] += 1
                elif not self._on_wire_to_fast(key):  # a prefetch on the last wire is no demand load
                    self._route(key, demand=True, priority=math.inf)  # also on its way to the host: demand
                    c.on_demand_loads += 1
            for worker in self.workers:  # the layer is routed: its waiting prefetches are too late
                for waiting in worker.queue.waiting_prefetches():
                    if waiting // J == layer and waiting not in keys:
                        worker.queue.withdraw(waiting)
                        self._forward.pop(waiting, None)
            for key in [key for key in fast.held if key // J == layer]:  # predicted wrongly: no longer held
                fast.release(key)
            self._cond.notify_all()
        remaining = list(keys)
        try:
            while remaining:
                with self._cond:
                    waited = time.perf_counter()
                    while True:
                        self._raise_failure()
                        ready = next((k for k in remaining if k in self.tiers[0].tensors), None)
                        if ready is not None:
                            break
                        self._cond.wait()
                    stalled = time.perf_counter() - waited
                    c.stall_seconds += stalled
                    c.per_layer_stall_seconds[layer] += stalled
                    tensors = self.tiers[0].tensors[ready]
                remaining.remove(ready)
                yield ready - layer * J, tensors
                with self._cond:  # computed: it may be evicted from now on
                    self._pinned.discard(ready)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._pinned.difference_update(keys)
                self._cond.notify_all()

    # -------------------------------------------------------------------------------- prefetcher hooks
    def _iteration_start(self, module, args, kwargs):
        import torch

        if not self._needs_routing:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        tokens = int(ids.shape[-1]) if ids is not None else 1
        prefill = self._view is None or self._request_embedding is None
        if prefill and ids is not None:
            with torch.no_grad():
                embedded = self.model.get_input_embeddings()(ids.reshape(1, -1)).float()
            self._request_embedding = embedded[0].mean(dim=0).cpu().numpy()
        self._view = LiveRoutingView(self.spec, self.iteration, tokens, self.request, prefill,
                                     self._request_embedding, source=f"live generation with {self.manifest.directory}")
        if self.prefetcher is not None:
            proposals = self.prefetcher.on_iteration_start(self._view)
            with self._cond:
                self._propose(proposals, -1)

    def _layer_routed(self, layer: int, routing) -> None:
        if not self._needs_routing:
            return
        view = self._view
        selected = routing.experts.cpu().numpy()
        probs = self.adapter.probabilities(routing.logits).cpu().numpy()
        predicted = None
        if self._needs_gate_prediction and layer + 1 < self.spec.num_layers:
            predicted = self.adapter.probabilities(
                self.adapter.predict_next_router_logits(layer, routing.hidden)).cpu().numpy()
        view.routed(layer, selected, probs, predicted)
        self._probs[layer] = probs.mean(axis=0)
        if self.prefetcher is not None:
            proposals = self.prefetcher.on_layer_routed(view)
            with self._cond:
                self._propose(proposals, layer)

    def _iteration_end(self, module, args, output):
        if self.prefetcher is not None and self._view is not None:
            self.prefetcher.on_iteration_end(self._view)
        self.iteration += 1

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, prompt: str | list[int], max_new_tokens: int = 64, *, tokenizer=None,
                 on_text: Callable[[str], None] | None = None, return_logits: bool = False) -> Generation:
        """Greedy generation of one prompt; ``on_text`` receives the text as it is produced."""
        if not self._generate_lock.acquire(blocking=False):
            raise EngineBusyError("this engine is already generating: one generate call at a time per engine "
                                  "(wait for it, or load a second engine)")
        try:
            return self._generate(prompt, max_new_tokens, tokenizer, on_text, return_logits)
        finally:
            self._generate_lock.release()

    @property
    def tokenizer(self):
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.manifest.directory)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{self.manifest.directory}: no usable tokenizer: {exc}") from None
        return self._tokenizer

    def _generate(self, prompt, max_new_tokens, tokenizer, on_text, return_logits) -> Generation:
        import torch

        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        tokenizer = tokenizer or self.tokenizer
        ids = torch.tensor([prompt]) if isinstance(prompt, list) else tokenizer(prompt, return_tensors="pt")["input_ids"]
        if ids.numel() == 0:
            raise ConfigError("the prompt is empty")
        ids = ids.to(self.device)
        streamer = _TimingStreamer(tokenizer, on_text)
        before = self.counters.copy()
        self.request += 1
        self._view, self._request_embedding = None, None
        started = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, streamer=streamer, return_dict_in_generate=True,
                                      output_logits=return_logits, pad_token_id=tokenizer.pad_token_id
                                      if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        total = time.perf_counter() - started
        streamer.end()
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        delta = self.counters.minus(before)
        times = streamer.token_times
        ttft = times[0] - started if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        stats = self._result(delta, ttft=ttft, tpot=tpot, total=total)
        logits = [step[0].float().cpu() for step in out.logits] if return_logits else None
        return Generation(tokenizer.decode(tokens, skip_special_tokens=True), tokens, int(ids.shape[1]), stats,
                          logits)

    # ------------------------------------------------------------------------------------------ results
    def _result(self, c: Counters, ttft=None, tpot=None, total=None) -> RunResult:
        return RunResult(
            trace=f"runtime:{self.manifest.directory.name}", policy=self.policy_name,
            cache_size=self.tiers[0].cache.capacity // self.compute_expert_bytes, accesses=c.accesses,
            hits=c.hits, misses=c.accesses - c.hits, per_layer_accesses=list(c.per_layer_accesses),
            per_layer_hits=list(c.per_layer_hits), prefetches_issued=c.prefetches_issued if self.prefetcher else None,
            prefetches_used=c.prefetches_used if self.prefetcher else None,
            prefetches_wasted=c.prefetches_wasted if self.prefetcher else None, stall_seconds=c.stall_seconds,
            per_layer_stall_seconds=list(c.per_layer_stall_seconds), ttft_seconds=ttft, tpot_seconds=tpot,
            total_seconds=total, prefetcher=self.prefetch_name, hardware=f"runtime ({self.device.type})",
            cache_bytes=self.tiers[0].cache.capacity, on_demand_loads=c.on_demand_loads,
            bytes_per_link=dict(c.bytes_per_link),
            bytes_loaded=sum(v for k, v in c.bytes_per_link.items() if k.endswith("->fast")))

    @property
    def stats(self) -> RunResult:
        """Everything since the engine started (or since preloading ended)."""
        with self._cond:
            return self._result(self.counters.copy())

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for worker in self.workers:
            worker.join(timeout=5)
        for handle in self._hooks:
            handle.remove()
        self._tap.__exit__(None, None, None)

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TimingStreamer:
    """transformers' streamer protocol: records when each generated token appears, forwards text."""

    def __init__(self, tokenizer, on_text):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.prompt_seen = False
        self.token_times: list[float] = []
        self._tokens: list[int] = []
        self._printed = 0

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.token_times.append(time.perf_counter())
        self._tokens.extend(value.reshape(-1).tolist())
        if self.on_text is not None:
            text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                self.on_text(text[self._printed:])
                self._printed = len(text)

    def end(self) -> None:
        if self.on_text is not None:
            text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
            if len(text) > self._printed:
                self.on_text(text[self._printed:])
                self._printed = len(text)
