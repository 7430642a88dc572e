"""The offloaded inference engine: a transformers MoE model whose experts live in tiers (the public API).

The engine is made from one Plan (plan/plan.py: ``moe_offload.load`` or ``make_plan`` makes it from the
user's options and checks it), puts the parts together and runs the single-prompt generation loop::

    runtime/skeleton.py  the skeleton model (non-expert weights only) of the packed files (runtime/packing.py)
    runtime/engine_setup.py  the device, the plan's budgets sized for the model, the tiers and the prefetcher
    runtime/tiers.py     the tiers: the simulators' ExpertCache with your policy, over a pool of slots
    runtime/datapath.py  link workers, reader pool, pinned ring and copy streams: files -> [host] -> fast
    runtime/runner.py    per forward pass: the experts source, routing hooks, prefetcher, AccessContext
    runtime/replay.py    routing replay: the routers select a trace's experts (and the oracle can run)
    runtime/placement.py a placing policy's placement and host tier: the misses it does not admit are
                         computed on the host from the host tier's copy (models/host_experts.py)
    runtime/split.py     MoEpic's split experts (``split_config``): per-layer top caches and a buffer are the fast
                         tier (runtime/segment_tier.py) of the same data path
    runtime/counters.py  what the run counts, and the RunResult it becomes (with the plan as its configuration)

- Start-up loads only the non-expert weights; every expert starts in the slow tier (the packed files).
- The fast tier is GPU memory with CUDA, otherwise a RAM budget of compute-ready tensors (float32 on a CPU);
  an optional host tier (the plan's ``host_budget``, pinned with CUDA) caches stored-dtype copies between the files
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

import threading
import time
from dataclasses import dataclass
from typing import Callable

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.plan import Plan
from moe_offload.policies import ModelSpec, policy_factory, policy_info
from moe_offload.results import RunResult
from moe_offload.runtime.counters import Counters, run_result
from moe_offload.runtime.cpu_threads import computing_threads, single_threaded
from moe_offload.runtime.datapath import DataPath
from moe_offload.runtime.engine_setup import (engine_prefetcher, host_tier, link_budget, make_tiers, read_replay,
                                              read_split, resolve_device, size_tiers)
from moe_offload.runtime.pack_cache import packed_directory
from moe_offload.runtime.packing import Manifest, read_manifest
from moe_offload.runtime.skeleton import load_skeleton
from moe_offload.runtime.placement import admit_by, fetch_or_compute_rule, host_keys, placement_keys
from moe_offload.runtime.runner import ModelRunner
from moe_offload.runtime.storage import ExpertStore
from moe_offload.runtime.streaming import TimingStreamer


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
    """Generate with a packed MoE model whose experts do not all fit in fast memory, as ``plan`` says
    (plan/plan.py: the budgets, tiers, placement, policy, prefetcher, split, forms, dtypes and batch limits;
    ``moe_offload.load`` makes one from keywords). ``store``: the slow tier's reader (runtime/storage.py),
    made from the plan unless given.

    A placing policy (static-layers, static-freq, pinned-lru) or ``fetch_or_compute`` computes the misses it
    does not admit on the host (runtime/placement.py). Without a split the prefetcher gets the budget of the
    plan's hardware link into the fast tier, as the timed simulator gives it (MoEpic's Y: the loads that fit in
    a layer's window). Under a replayed trace (``plan.replay``; generate with :meth:`generate_replayed`) the
    oracle prefetcher can run. ``plan.matcher``: where a prefetcher whose search is off the inference path
    (fMoE) searches (runtime/matcher.py); ``late_proposals`` counts what arrived too late."""

    def __init__(self, plan: Plan, *, store: ExpertStore | None = None):
        self.threads = computing_threads()  # the caller's count, for the thread that computes
        with single_threaded():  # this thread loads the model without an OpenMP team (runtime/cpu_threads.py)
            from moe_offload.models import quiet_transformers

            quiet_transformers()
            self.plan = plan
            self.device = resolve_device(plan.device)
            self.manifest: Manifest = read_manifest(packed_directory(str(plan.model),
                                                                    expert_dtype=plan.expert_dtype))
            m = self.manifest
            self.spec = ModelSpec(m.num_layers, m.num_experts, m.top_k)
            sizing = size_tiers(plan, m, self.spec, self.device)
            self.compute_dtype, self.expert_form = sizing.compute_dtype, sizing.expert_form
            self.compute_expert_bytes = sizing.expert_bytes
            split, online = read_split(plan, sizing, m, self.spec)
            info = policy_info(plan.policy)
            self.places = info.policy.places_or_bypasses or plan.fetch_or_compute  # computes bypassed experts
            self.replay_trace = read_replay(plan.replay)
            self.prefetcher = engine_prefetcher(plan.prefetch, plan.prefetch_options, plan.history,
                                                self.spec, self.replay_trace)
            self.model, self.adapter, self.startup_seconds = load_skeleton(m, self.device, self.compute_dtype,
                                                                           verify=plan.verify_checksums)
            make = policy_factory(plan.policy, self.spec, seed=plan.seed, options=plan.policy_options)
            self.whole_layers = info.whole_layers(plan.policy_options, self.spec)
            self.store = store or ExpertStore(m, verify=plan.verify_checksums, bypass_page_cache=plan.bypass_page_cache,
                                              retries=plan.retries, readers=plan.readers)
            self.counters = Counters.zero(m.num_layers)
            self.split = None
            if split is not None:  # MoEpic's tops and buffer (runtime/split.py) are the fast tier
                from moe_offload.runtime.segment_tier import SegmentTier

                self.split = SegmentTier(*split, m, self.store, self.counters, self.spec, make, self.device,
                                         self.compute_dtype, sizing.fast_budget_bytes)
                self.tiers = [self.split] + host_tier(m, self.spec, sizing.host_slots, self.device)
            else:
                self.tiers = make_tiers(m, self.spec, info.partitioned, make, sizing.fast_slots, sizing.host_slots,
                                        self.device, self.compute_dtype, self.compute_expert_bytes, self.expert_form,
                                        self.whole_layers)
            if plan.fetch_or_compute:
                admit_by(self.tiers[0].cache, fetch_or_compute_rule(plan.profile(), m,
                                                                    self.tiers[-1].cache))
            self.path = DataPath(self.tiers, self.store, self.counters, self.spec)
            for cache in self.split.tops if self.split is not None else [self.tiers[0].cache]:
                cache.on_decision = self.counters.decided  # the policy's own time (RunResult.policy_decision_seconds)
            self.replay = None
            if self.replay_trace is not None:
                from moe_offload.runtime.replay import RoutingReplay

                self.replay = RoutingReplay(self.replay_trace, self.adapter, plan.replay_weights)
            self.runner = ModelRunner(self.model, self.adapter, self.spec, self.path, self.counters,
                                      prefetcher=self.prefetcher, policy_needs_probs=info.policy.needs_probs,
                                      policy_needs_rounds=info.policy.needs_rounds,
                                      replay=self.replay, source=f"live generation with {m.directory}",
                                      matcher=plan.matcher, online=online,
                                      prefetch_budget=None if self.prefetcher is None
                                      else link_budget(plan.profile(), m))
            self.runner.computes_on_host = self.places
            self.runner.install()
            self._generate_lock = threading.Lock()
            self.max_batch, self.batch_math = plan.max_batch, plan.batch_math
            self._scheduler = None
            self.preload_seconds = self._preload(plan.preload) if plan.preload or self.places or self.whole_layers \
                else 0.0

    # ------------------------------------------------------------------------------------------ set-up
    def _preload(self, fill: bool) -> float:
        """Fill the fast tier before the first token: a placing policy's placement (policies/base.py, chosen
        from its profile or, in hindsight, the replayed trace) and the host tier with the other experts while
        they fit (runtime/placement.py); otherwise a -dist cache's whole layers, then (``fill``) experts in key
        order while they fit (the all-resident baseline)."""
        started = time.perf_counter()
        path = self.path
        host_only = []
        if self.places:
            keys = placement_keys(self.tiers[0].cache, self.compute_expert_bytes, self.replay_trace)
            host_only = host_keys(keys, self.spec, self.tiers[-1].pool.slots)
        else:
            J = self.spec.num_experts
            whole = [layer * J + expert for layer in self.whole_layers for expert in range(J)]
            held = set(whole)
            keys = whole + ([key for key in range(self.tiers[0].pool.slots) if key not in held] if fill else [])
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
        stats = run_result(self, delta, ttft=ttft, tpot=tpot, total=total)
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
    @property
    def stats(self) -> RunResult:
        """Everything since the engine started (or since preloading ended)."""
        with self.path.cond:
            return run_result(self, self.counters.copy())

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
