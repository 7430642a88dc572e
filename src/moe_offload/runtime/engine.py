"""The offloaded inference engine: a transformers MoE model whose experts live in tiers (the public API).

The engine puts the parts together and runs the single-prompt generation loop::

    runtime/skeleton.py  the skeleton model (non-expert weights only) of the packed files (runtime/packing.py)
    runtime/engine_setup.py  the device and compute dtype, the tiers and the prefetcher, made from the arguments
    runtime/tiers.py     the tiers: the simulators' ExpertCache with your policy, over a pool of slots
    runtime/datapath.py  link workers, reader pool, pinned ring and copy streams: files -> [host] -> fast
    runtime/runner.py    per forward pass: the experts source, routing hooks, prefetcher, AccessContext
    runtime/replay.py    routing replay: the routers select a trace's experts (and the oracle can run)
    runtime/placement.py a placing policy's placement and host tier: the misses it does not admit are
                         computed on the host from the host tier's copy (models/host_experts.py)
    runtime/split.py     MoEpic's split experts (``split_config``): per-layer top caches and a buffer are the fast
                         tier (runtime/segment_tier.py) of the same data path

- Start-up loads only the non-expert weights; every expert starts in the slow tier (the packed files).
- The fast tier is GPU memory with CUDA, otherwise a RAM budget of compute-ready tensors (float32 on a CPU);
  an optional host tier (``host_budget``, pinned with CUDA) caches stored-dtype copies between the files
  and the fast tier. Budgets are bytes of the tier's own copies, rounded down to whole experts.
- transformers runs attention, the KV cache and sampling; every MoE layer's experts go through the
  registered experts function (models/experts.py), which asks the runner for its experts. The order of
  arrival does not change the result, so generation is lossless: the same tokens and logits as the
  all-resident model on the same device and dtype.

``generate`` is one request at a time, through transformers' ``generate``. ``submit`` and ``generate_batch``
go through the continuous-batching scheduler (runtime/batching.py, which says why it is a loop of the
project's own and not transformers' ContinuousBatchingManager): requests join and leave at iteration
boundaries, one forward pass computes every running request's next token, the experts of a pass are the
union of its tokens' selections, fetched once, and each request's tokens are the bits it gets alone
(runtime/packed.py). The server (moe_offload/server) is a thin layer over ``submit``.

    engine = moe_offload.load("tiny", fast_budget="30%", max_batch=16)
    outs = engine.generate_batch(["User: hi\nAssistant:", "User: why?\nAssistant:"], max_new_tokens=32)
    handle = engine.submit("User: hi\nAssistant:", SamplingParams(max_tokens=32, temperature=0.7, seed=1))
    for delta in handle: print(delta.text, end="")
    handle.result().stats      # the request's own counters (RunResult)
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload import values
from moe_offload.policies import ModelSpec, policy_factory, policy_info
from moe_offload.results import RunResult
from moe_offload.runtime.counters import Counters
from moe_offload.runtime.datapath import DataPath
from moe_offload.runtime.cpu_threads import single_threaded
from moe_offload.runtime.engine_setup import (compute_dtype, engine_prefetcher, host_tier, link_budget, make_tiers,
                                              read_replay, read_split, resolve_device)
from moe_offload.runtime.expert_forms import expert_form, profile_choices
from moe_offload.runtime.packing import Manifest, read_manifest
from moe_offload.runtime.skeleton import load_skeleton
from moe_offload.runtime.placement import (admit_by, fetch_or_compute_profile, fetch_or_compute_rule, host_keys,
                                           placement_keys, placing_host_budget)
from moe_offload.runtime.runner import ModelRunner
from moe_offload.runtime.storage import ExpertStore
from moe_offload.runtime.streaming import TimingStreamer
from moe_offload.values import format_bytes


class EngineBusyError(MoeOffloadError):
    """generate was called on an engine that is already generating."""


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


class OffloadEngine:
    """Generate with a packed MoE model whose experts do not all fit in fast memory.

    ``fast_budget`` and ``host_budget``: ``"30%"`` of all expert bytes (compute-ready bytes for the fast
    tier) or a size. ``policy``/``prefetch``: names from ``moe-offload policies``. ``prefetch_history``: a
    trace the prefetcher learns from first (MoE-Infinity's EAMs, fMoE's expert maps). ``readers``: reader
    threads of the slow tier. ``replay``: a trace (or its path) whose routing every router is forced to
    (runtime/replay.py; generate with :meth:`generate_replayed`), ``replay_weights`` ``"trace"`` or
    ``"router"``; under a replay the oracle prefetcher can run. ``max_batch``: requests a forward pass of
    the batching scheduler holds at most; ``batch_math``: ``"exact"`` (each request gets the bits it gets
    alone) or ``"fast"`` (products over the whole pass; runtime/packed.py). ``matcher``: where a prefetcher
    whose search is off the inference path (fMoE) searches: ``"async"`` on a thread of its own, its proposals
    applied when they arrive (paper 000), ``"inline"`` on the decode thread, ``"lockstep"`` on its own thread
    while the decode thread waits for each result (runtime/matcher.py); ``late_proposals`` counts what
    arrived too late. ``split_config``: MoEpic's split
    experts (runtime/split.py), a configuration of `moe-offload configure --json` (its path, or a
    SplitConfig) whose cached tops and buffer of top-k experts must fit in ``fast_budget``; the result is the
    all-resident model's computing with the same split. ``reconfiguration``: MoEpic's online loop
    (``Reconfiguration(every=tau)``, runtime/split_online.py) with the timings of ``hardware`` (a profile's
    name or file; default desktop-rtx4090), from ``split_config`` or the uniform start on ``fast_budget``.
    Without a split the prefetcher gets the budget of ``hardware``'s link into the fast tier, as the timed
    simulator gives it (MoEpic's Y: the loads that fit in a layer's window). ``fetch_or_compute``: a miss of
    the dynamic ``policy`` is computed on the host instead of loaded when ``hardware``'s costs say that is
    faster (Fiddler's rule, as ``simulate --timed --fetch-or-compute`` decides; runtime/placement.py).
    ``expert_compute``: how the fast tier holds and computes with int8/int4 experts, ``"per-use"``,
    ``"on-arrival"``, ``"kernel"`` or ``"auto"``/None (runtime/expert_forms.py). Where ``dtype`` or
    ``expert_compute`` is None, a ``hardware`` profile that ``hardware measure`` wrote gives them (its
    ``[runtime]`` choices for the pack's experts)."""

    def __init__(self, packed_dir, *, fast_budget="50%", host_budget=None, policy: str = "lru",
                 policy_options: dict | None = None, prefetch: str | None = None,
                 prefetch_options: dict | None = None, prefetch_history=None, device=None,
                 verify_checksums: bool = True, bypass_page_cache: bool = False, retries: int = 3,
                 store: ExpertStore | None = None, preload: bool = False, seed: int = 0,
                 readers: int | None = None, replay=None, replay_weights: str = "trace", max_batch: int = 16,
                 batch_math: str = "exact", matcher: str = "async", split_config=None, reconfiguration=None,
                 hardware=None, dtype: str | None = None, fetch_or_compute: bool = False,
                 expert_compute: str | None = None):
        with single_threaded():  # this thread loads the model without an OpenMP team (runtime/cpu_threads.py)
            import torch

            from moe_offload.models import quiet_transformers

            from moe_offload.runtime.matcher import MATCHERS
            from moe_offload.runtime.packed import BATCH_MATH
            from moe_offload.values import integer

            quiet_transformers()
            if batch_math not in BATCH_MATH:
                raise ConfigError(f"batch_math {batch_math!r}: choose from {', '.join(BATCH_MATH)}")
            if matcher not in MATCHERS:
                raise ConfigError(f"matcher {matcher!r}: choose from {', '.join(MATCHERS)}")
            max_batch = integer(max_batch, "max_batch", low=1)
            self.device = resolve_device(device)
            self.manifest: Manifest = read_manifest(packed_dir)
            m = self.manifest
            self.spec = ModelSpec(m.num_layers, m.num_experts, m.top_k)
            stored = getattr(torch, m.dtype)
            measured_dtype, measured_form = profile_choices(hardware, m, self.device)  # what is not given
            if dtype is not None and dtype != measured_dtype:
                measured_form = None  # the form was measured fastest in its own dtype, not in this one
            self.compute_dtype = compute_dtype(dtype or measured_dtype, self.device, stored)
            elements = sum(math.prod(tensor.shape) for tensor in m.tensors)
            # A share of the budget is of all experts in the compute dtype whatever the stored dtype, so "25%" is
            # the same memory for every pack of a model; quantized experts take the bytes of their form in the
            # fast tier (runtime/expert_forms.py: per use and the kernel about the stored bytes), so more fit in it.
            self.expert_form = expert_form(expert_compute or measured_form, m, self.device, self.compute_dtype)
            self.compute_expert_bytes = self.expert_form.slot_bytes if self.expert_form is not None else \
                elements * self.compute_dtype.itemsize
            self.total_expert_bytes = m.num_layers * m.num_experts * elements * self.compute_dtype.itemsize
            info = policy_info(policy)
            if info.offline:
                raise ConfigError(f"policy {policy!r} needs the future (next use of every expert), which a running "
                                  "engine does not know; use it in `moe-offload simulate`")
            fast_budget_bytes = values.budget_bytes(fast_budget, self.total_expert_bytes, "--fast-budget",
                                                    expert_bytes=self.compute_expert_bytes,
                                                    experts=m.num_layers * m.num_experts)
            fast_slots = self._slots(fast_budget_bytes, self.compute_expert_bytes)
            if m.quantized and (split_config is not None or reconfiguration is not None):
                raise ConfigError(f"{m.directory}: {m.expert_dtype} experts: MoEpic's split does not read quantized "
                                  "experts yet (docs/guides/checkpoints.md says why)")
            split, online = read_split(split_config, preload, reconfiguration, hardware, fast_budget_bytes, m, self.spec,
                                       self.compute_expert_bytes)
            rule_profile = fetch_or_compute_profile(policy, hardware, split is not None) if fetch_or_compute else None
            self.admission = "fetch-or-compute" if fetch_or_compute else None
            # computes bypassed experts on the host
            self.places = info.policy.places_or_bypasses or fetch_or_compute
            if self.places:
                host_budget = placing_host_budget(info, policy_options, host_budget, replay is not None,
                                                  split is not None, prefetch)
            if fast_slots < m.top_k and split is None and not info.policy.static:  # static: the rest on the host
                raise ConfigError(f"fast budget {fast_budget} cannot hold one layer's top-{m.top_k} experts "
                                  f"({format_bytes(m.top_k * self.compute_expert_bytes)}, "
                                  f"{format_bytes(self.compute_expert_bytes)} each)")
            if info.partitioned and split is None and fast_slots < m.num_layers:  # a layer with no slot waits forever
                raise ConfigError(f"policy {policy!r} splits the fast tier among the {m.num_layers} layers: "
                                  f"{fast_slots} experts leave a layer without one; give at least {m.num_layers} "
                                  f"({format_bytes(m.num_layers * self.compute_expert_bytes)})")
            host_slots = 0
            if host_budget is not None:
                host_slots = self._slots(values.budget_bytes(host_budget, m.num_layers * m.num_experts * m.expert_bytes,
                                                             "--host-budget", expert_bytes=m.expert_bytes),
                                         m.expert_bytes)
                if host_slots < 1:
                    raise ConfigError(f"host budget {host_budget} cannot hold one expert "
                                      f"({format_bytes(m.expert_bytes)})")
                if self.places and host_slots < m.top_k:  # a layer's bypassed experts are in the host tier at once
                    raise ConfigError(f"host budget {host_budget} cannot hold a layer's top-{m.top_k} experts "
                                      f"({format_bytes(m.expert_bytes)} each), which {policy!r} computes there")
            self.replay_trace = read_replay(replay)
            self.prefetcher = engine_prefetcher(prefetch, prefetch_options, prefetch_history, self.spec,
                                                self.replay_trace)
            self.policy_name, self.prefetch_name = policy, prefetch

            self.model, self.adapter, self.startup_seconds = load_skeleton(m, self.device, self.compute_dtype,
                                                                           verify=verify_checksums)
            make = policy_factory(policy, self.spec, seed=seed, options=policy_options)  # every partition's policy
            self.store = store or ExpertStore(m, verify=verify_checksums, bypass_page_cache=bypass_page_cache,
                                              retries=retries, readers=readers)
            self.counters = Counters.zero(m.num_layers)
            self.split = None
            if split is not None:  # MoEpic's tops and buffer (runtime/split.py) are the fast tier
                from moe_offload.runtime.segment_tier import SegmentTier

                self.split = SegmentTier(*split, m, self.store, self.counters, self.spec, make, self.device,
                                         self.compute_dtype, fast_budget_bytes)
                self.tiers = [self.split] + host_tier(m, self.spec, host_slots, self.device)
            else:
                self.tiers = make_tiers(m, self.spec, info.partitioned, make, fast_slots, host_slots, self.device,
                                        self.compute_dtype, self.compute_expert_bytes, self.expert_form)
            if rule_profile is not None:
                admit_by(self.tiers[0].cache, fetch_or_compute_rule(rule_profile, m, self.tiers[-1].cache))
            self.path = DataPath(self.tiers, self.store, self.counters, self.spec)
            for cache in self.split.tops if self.split is not None else [self.tiers[0].cache]:
                cache.on_decision = self.counters.decided  # the policy's own time (RunResult.policy_decision_seconds)
            self.replay = None
            if self.replay_trace is not None:
                from moe_offload.runtime.replay import RoutingReplay

                self.replay = RoutingReplay(self.replay_trace, self.adapter, replay_weights)
            self.runner = ModelRunner(self.model, self.adapter, self.spec, self.path, self.counters,
                                      prefetcher=self.prefetcher, policy_needs_probs=info.policy.needs_probs,
                                      policy_needs_rounds=info.policy.needs_rounds,
                                      replay=self.replay, source=f"live generation with {m.directory}",
                                      matcher=matcher, online=online,
                                      prefetch_budget=None if self.prefetcher is None else link_budget(hardware, m))
            self.runner.computes_on_host = self.places
            self.runner.install()
            self._generate_lock = threading.Lock()
            self.max_batch, self.batch_math = max_batch, batch_math
            self._scheduler = None
            self.preload_seconds = self._preload() if preload or self.places else 0.0

    # ------------------------------------------------------------------------------------------ set-up
    def _slots(self, budget_bytes: int, slot_bytes: int) -> int:
        return min(budget_bytes // slot_bytes, self.spec.num_layers * self.spec.num_experts)

    def _preload(self) -> float:
        """Fill the fast tier before the first token: a placing policy's placement (policies/base.py, chosen
        from its profile or, in hindsight, the replayed trace) and the host tier with the other experts while
        they fit (runtime/placement.py), otherwise experts in key order while they fit (the all-resident
        baseline)."""
        started = time.perf_counter()
        path = self.path
        host_only = []
        if self.places:
            keys = placement_keys(self.tiers[0].cache, self.compute_expert_bytes, self.replay_trace)
            host_only = host_keys(keys, self.spec, self.tiers[-1].pool.slots)
        else:
            keys = range(self.tiers[0].pool.slots)
        with path.cond:
            for key in host_only:  # into the host tier and no further, as a bypassed expert is loaded
                path.compute_on_host(key)
            for key in keys:
                path.route(key, demand=True, priority=float("inf"))
            path.cond.notify_all()
            while path.busy() and path.failure is None:
                path.cond.wait()
            path.raise_failure()
            for key in host_only:
                path.computed_on_host(key)
        self.counters.reset()
        path.prefetched_unused.clear()
        return time.perf_counter() - started

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, prompt: str | list[int], max_new_tokens: int = 64, *, tokenizer=None,
                 on_text: Callable[[str], None] | None = None, return_logits: bool = False) -> Generation:
        """Greedy generation of one prompt (text, or token ids: then the text is decoded only when the model
        has a tokenizer); ``on_text`` receives the text as it is produced. A prompt plus
        ``max_new_tokens`` longer than the model's context (max_position_embeddings) is refused."""
        if self.replay is not None:
            raise ConfigError("this engine replays a trace's routing: use generate_replayed(request)")
        return self._locked(self._generate, prompt, max_new_tokens, tokenizer, on_text, return_logits, False)

    def generate_replayed(self, request: int = 0, max_new_tokens: int | None = None, *,
                          return_logits: bool = False) -> Generation:
        """Generate as the replayed trace's ``request``-th request did: a prompt of its prefill length (token ids
        0, 1, 2, ... modulo the vocabulary: the routing is the trace's, not the text's) and as many new tokens
        as its rows (at most ``max_new_tokens``; end-of-sequence tokens do not stop it)."""
        if self.replay is None:
            raise ConfigError("generate_replayed needs an engine made with replay=TRACE")
        prompt_tokens, new_tokens = self.replay.plan(request, max_new_tokens)
        vocab = int(self.model.config.vocab_size)
        prompt = [i % vocab for i in range(prompt_tokens)]
        return self._locked(self._generate, prompt, new_tokens, None, None, return_logits, True)

    # -------------------------------------------------------------------------------- batched serving
    @property
    def scheduler(self):
        """The continuous-batching scheduler (runtime/batching.py), made on first use."""
        if self._scheduler is None:
            from moe_offload.runtime.batching import BatchScheduler

            self._scheduler = BatchScheduler(self, self.max_batch)
        return self._scheduler

    def submit(self, prompt, params=None, on_event=None):
        """Queue one request (text or token ids) with its SamplingParams; it joins the running batch at the next
        iteration. Returns a RequestHandle: iterate over its TextDeltas, or ``result()`` for its Completion."""
        return self.scheduler.submit(prompt, params, on_event)

    def generate_batch(self, prompts, max_new_tokens: int = 64, **params) -> list:
        """Every prompt's Completion, generated together by continuous batching (greedy unless ``temperature``
        is given; the other SamplingParams fields as keywords)."""
        from moe_offload.runtime.requests import SamplingParams

        with self.scheduler.cond:  # all join the batch at the same iteration (up to max_batch)
            handles = [self.submit(prompt, SamplingParams(max_tokens=max_new_tokens, **params)) for prompt in prompts]
        return [handle.result() for handle in handles]

    def _locked(self, fn, *args):
        """``fn(*args, cancel)``, one call at a time, on the engine's computing thread: the batching scheduler's
        (runtime/batching.py, "The engine's one computing thread"); on the caller's thread for an engine that
        replays a trace, which has no scheduler. ``cancel`` is set when the caller is interrupted."""
        if not self._generate_lock.acquire(blocking=False):
            raise EngineBusyError("this engine is already generating: one generate call at a time per engine "
                                  "(wait for it, or load a second engine)")
        try:
            cancel = threading.Event()
            if self.replay is not None:
                return fn(*args, cancel)
            return self.scheduler.run(fn, *args, cancel, cancel=cancel)
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

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse, before any work, a prompt or a generation longer than the model's context."""
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        if prompt_tokens == 0:
            raise ConfigError("the prompt is empty")
        context = self.manifest.max_position_embeddings
        if context is None:
            return
        if prompt_tokens > context:
            raise ConfigError(f"the prompt has {prompt_tokens} tokens, more than the model's context of {context}")
        if prompt_tokens + max_new_tokens > context:
            raise ConfigError(f"the prompt's {prompt_tokens} tokens + {max_new_tokens} new tokens exceed the model's "
                              f"context of {context}: ask for at most {context - prompt_tokens} new tokens")

    def _generate(self, prompt, max_new_tokens, tokenizer, on_text, return_logits, replayed, cancel) -> Generation:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Cancelled(StoppingCriteria):  # the caller was interrupted: stop after this token
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool, device=input_ids.device)

        if tokenizer is None and not replayed and (isinstance(prompt, str) or on_text is not None):
            tokenizer = self.tokenizer  # token ids without streamed text need none
        ids = torch.tensor([prompt]) if isinstance(prompt, list) else tokenizer(prompt, return_tensors="pt")["input_ids"]
        self.check_length(int(ids.numel()), max_new_tokens)
        ids = ids.to(self.device)
        streamer = TimingStreamer(tokenizer, on_text)
        before = self.counters.copy()
        self.runner.start_request()
        if tokenizer is not None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        else:
            pad = self.model.config.pad_token_id or 0
        extra = {"min_new_tokens": max_new_tokens} if replayed else {}
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, streamer=streamer, return_dict_in_generate=True,
                                      output_logits=return_logits, pad_token_id=pad,
                                      stopping_criteria=StoppingCriteriaList([Cancelled()]), **extra)
        total = time.perf_counter() - started
        streamer.end()
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        with self.path.cond:
            delta = self.counters.minus(before)
        times = streamer.token_times
        ttft = times[0] - started if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        stats = self._result(delta, ttft=ttft, tpot=tpot, total=total)
        stats.token_latency_seconds = [b - a for a, b in zip(times, times[1:])]
        logits = [step[0].float().cpu() for step in out.logits] if return_logits else None
        if tokenizer is None and not replayed:
            try:
                tokenizer = self.tokenizer
            except ConfigError:  # a model without a tokenizer: the token ids are the result
                pass
        text = "" if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)
        self.runner.end_request(self.runner.request)
        self.runner.wait_for_matcher()  # the request's last searches and store updates are in before it returns
        return Generation(text, tokens, int(ids.shape[1]), stats, logits)

    # ------------------------------------------------------------------------------------------ results
    def _result(self, c: Counters, ttft=None, tpot=None, total=None) -> RunResult:
        prefetching = self.prefetcher is not None
        return RunResult(
            trace=f"runtime:{self.manifest.directory.name}", policy=self.policy_name,
            cache_size=sum(self.split.cached_experts) if self.split else self.tiers[0].pool.slots,
            accesses=c.accesses,
            hits=c.hits, misses=c.accesses - c.hits - c.bypassed, per_layer_accesses=list(c.per_layer_accesses),
            bypassed=c.bypassed if self.places else None,
            per_layer_bypassed=list(c.per_layer_bypassed) if self.places else None,
            host_compute_seconds=c.host_compute_seconds if self.places else None, admission=self.admission,
            per_layer_hits=list(c.per_layer_hits), prefetches_issued=c.prefetches_issued if prefetching else None,
            prefetches_used=c.prefetches_used if prefetching else None,
            prefetches_wasted=c.prefetches_wasted if prefetching else None, stall_seconds=c.stall_seconds,
            per_layer_stall_seconds=list(c.per_layer_stall_seconds), ttft_seconds=ttft, tpot_seconds=tpot,
            total_seconds=total, prefetcher=self.prefetch_name, hardware=f"runtime ({self.device.type})",
            cache_bytes=self.split.memory_bytes if self.split else self.tiers[0].cache.capacity,
            on_demand_loads=c.on_demand_loads,
            policy_decisions=c.policy_decisions, policy_decision_seconds=c.policy_decision_seconds,
            bytes_per_link=dict(c.bytes_per_link),
            tier_requests={"fast": c.accesses, **({"host": c.on_demand_loads + c.bypassed} if self._has_host else {})},
            tier_hits={"fast": c.hits, **({"host": c.host_hits} if self._has_host else {})},
            bytes_loaded=sum(v for k, v in c.bytes_per_link.items() if k.endswith("->fast")))

    @property
    def _has_host(self) -> bool:
        return len(self.tiers) > 1

    @property
    def stats(self) -> RunResult:
        """Everything since the engine started (or since preloading ended)."""
        with self.path.cond:
            return self._result(self.counters.copy())

    @property
    def late_proposals(self) -> tuple[int, int]:
        """(proposals the asynchronous matcher delivered too late to be used, proposals it delivered) since the
        engine started."""
        with self.path.cond:
            return self.runner.proposals_late, self.runner.proposals_arrived

    def link_busy_seconds(self) -> dict:
        """Seconds a transfer was on each link since the engine started."""
        with self.path.cond:
            return dict(self.counters.link_busy_seconds)

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        self.runner.remove()  # the matcher's last deliveries first
        self.path.close()

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
