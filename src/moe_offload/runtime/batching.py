"""Continuous batching: requests join and leave the running batch at iteration boundaries.

One scheduler thread runs the iterations (and ``generate``'s jobs, below). Each iteration admits waiting
requests (up to ``max_batch`` running), drops cancelled ones, and runs **one forward pass** for the whole
batch: each new request's prompt and every running request's last token, packed into one sequence
(runtime/packed.py). The experts the pass needs are the union of its tokens' selections, fetched once (the
runner's expert source, one access per expert with ``routed`` = each request's tokens). Then each request
samples its next token from its own logits, with its own generator (runtime/request_step.py), and the finished
ones leave: their per-sequence state ends (``on_request_end`` of the caches' policies and the prefetcher).

Why a loop of our own and not transformers' ``ContinuousBatchingManager`` (``generate_batch``). It does
run the project's experts function and router hooks (its forward is the model's, over a packed
``[1, T]`` sequence with paged attention; checked with transformers 5.23 on this CPU: 3 prompts, 12 tokens
each, the greedy tokens equal generate's), but:

- its matrix products run over the packed rows, which on this CPU do not give a row the bits it gets in
  its own pass (MKL: another kernel for one row), and the issue requires bit equality with a request run
  alone; its paged attention is another kernel again;
- its hooks cannot tell which request a row of the pass belongs to (the per-request state of the
  prefetchers and policies), nor when a request left (``on_request_end``);
- its sampling has no per-request seeded generator, and its start-up (cache sizing, warm-up) took 36 s on
  this machine for three tiny prompts.

So this loop keeps transformers' model code (embeddings, decoder layers, norms, the LM head) and replaces
only the batching: the packing, the requests' keys and values (a KV pool, runtime/kv_pool.py), the
sampling and the stop rules. ``OffloadEngine.generate`` keeps transformers' ``generate`` for one request;
this scheduler serves ``submit``/``generate_batch`` and the server.

**The engine's one computing thread.** The scheduler's thread is the only thread that computes with the
model: ``OffloadEngine.generate`` runs there too, as a job between two iterations (:meth:`BatchScheduler.run`).
PyTorch gives every thread that runs a parallel operation an OpenMP team of its own, and with more OpenMP
threads than cores libgomp puts idle workers to sleep at once, so every operation waits for its team to wake
(runtime/cpu_threads.py): on this 2-core machine, 16 prompts batched after one ``generate`` on the caller's
thread took 3.5 times as long as without it (benchmarks/one_thread.py).

A forward pass that fails inside the engine (an expert file vanished, a checksum failed) fails the
requests that routed to the failing expert with the error; the other requests of the pass keep their KV
slots' lengths as they were (what the pass wrote there is overwritten) and run again at the next iteration.
A fault in one request's own step after the pass (its sampling, detokenising, stop check) ends that request
only: nothing of one request's sampling reaches another.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.runtime.counters import Counters, run_result
from moe_offload.runtime.cpu_threads import set_thread_count
from moe_offload.runtime.kv_pool import KVPool
from moe_offload.runtime.packed import PackedPass, Segment
from moe_offload.runtime.request_step import RunningRequest
from moe_offload.runtime.requests import Completion, RequestHandle, SamplingParams


class _Job:
    """A function to run on the scheduler's thread (:meth:`BatchScheduler.run`), and its outcome."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.taken = False  # by the scheduler's thread, under its lock
        self.result = self.error = None

    def execute(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            self.error = exc
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class BatchScheduler:
    """Continuous batching over an engine's runner (see the module docstring); made by the engine."""

    def __init__(self, engine, max_batch: int = 16):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be a whole number of at least 1, not {max_batch!r}")
        if engine.replay is not None:
            raise ConfigError("an engine that replays a trace's routing generates one request at a time "
                              "(generate_replayed), not in batches")
        self.engine, self.max_batch = engine, max_batch
        self.runner, self.model = engine.runner, engine.model
        self.cond = threading.Condition()
        self.waiting: deque[RunningRequest] = deque()
        self.running: list[RunningRequest] = []
        self._leaving: list[RunningRequest] = []
        self.jobs: deque[_Job] = deque()
        self.kv = KVPool(max_batch)
        self.stopping = False
        self.failure: BaseException | None = None  # what stopped the scheduler's thread, if anything did
        self.iterations = 0
        self.forward_seconds = 0.0   # in forward passes (expert loads waited for included)
        self.prompt_pass_seconds = 0.0  # ... of them, in passes with at least one prompt (prefill)
        self.advance_seconds = 0.0   # sampling, detokenising, stop checks and events after each pass
        self.observers: list = []  # objects with on_pass(batch, seconds) and on_finish(completion)
        self._thread: threading.Thread | None = None
        self._tokenizer = None
        self._tokenizer_checked = False
        self._tokenizer_lock = threading.Lock()

    # --------------------------------------------------------------------------------------------- intake
    @property
    def tokenizer(self):
        """The model's tokenizer, or None for a model without one (token ids in, token ids out). Loaded once,
        under a lock: the server tokenizes in worker threads, and a second caller must not see it unloaded."""
        with self._tokenizer_lock:
            if not self._tokenizer_checked:
                try:
                    self._tokenizer = self.engine.tokenizer
                except ConfigError:
                    self._tokenizer = None
                self._tokenizer_checked = True
        return self._tokenizer

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"{self.engine.manifest.directory} has no tokenizer: give the prompt as token ids")
            return self.tokenizer(prompt)["input_ids"]
        ids = [int(t) for t in prompt]
        vocab = int(self.model.config.vocab_size)
        if any(not 0 <= t < vocab for t in ids):
            raise ConfigError(f"a prompt token id is outside the vocabulary (0..{vocab - 1})")
        return ids

    def submit(self, prompt, params: SamplingParams | None = None, on_event=None) -> RequestHandle:
        """Queue a request (text or token ids); it joins the batch at the next iteration. Bad parameters and
        prompts longer than the context raise ConfigError here, before any work."""
        import torch

        params = params or SamplingParams()
        params.check()
        ids = self.encode(prompt)
        vocab = int(self.model.config.vocab_size)
        if any(token >= vocab for token in params.logit_bias):
            raise ConfigError(f"a logit_bias token id is outside the vocabulary (0..{vocab - 1})")
        self.engine.check_length(len(ids), params.max_tokens)
        window = getattr(self.model.config, "sliding_window", None)
        if window and len(ids) > window:  # a packed prompt attends causally over all of itself (packed.py)
            raise ConfigError(f"the prompt has {len(ids)} tokens, more than the model's sliding window of {window}: "
                              "the batching scheduler does not mask a window inside a prompt")
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop sequences need a tokenizer to read the text")
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int(torch.seed()))
        with self.cond:
            self._check_open()
            request = self.runner.new_request()
            if params.return_routed_experts:
                self.runner.routing_log.keep(request)
            handle = RequestHandle(request, self.cond, on_event)
            self.waiting.append(RunningRequest(request, ids, params, handle, generator,
                                               Counters.zero(self.engine.spec.num_layers), time.perf_counter()))
            self._start()
            self.cond.notify_all()
        return handle

    def _check_open(self) -> None:
        if self.failure is not None:
            raise MoeOffloadError(f"the engine's scheduler stopped: {type(self.failure).__name__}: {self.failure}")
        if self.stopping:
            raise MoeOffloadError("the engine is shutting down")

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moe-offload compute", daemon=True)
            self._thread.start()

    def run(self, fn, *args, cancel: threading.Event | None = None):
        """``fn(*args)`` on the scheduler's thread, between two iterations (the running requests wait for it);
        its result, or its exception raised here. Interrupted (Ctrl-C) while it runs: ``cancel`` is set, for
        ``fn`` to stop early, and the interruption is raised once ``fn`` has returned."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        job = _Job(fn, args)
        try:
            with self.cond:
                self._check_open()
                self.jobs.append(job)
                self._start()
                self.cond.notify_all()
            job.done.wait()
        except KeyboardInterrupt:
            # a signal lands between any two bytecodes, also before the wait (a busy machine may run the whole
            # job before the caller reaches it): a job still queued leaves the queue; one the scheduler took is
            # told to stop early and waited for, so that the caller never leaves while its job still computes
            with self.cond:
                queued = job in self.jobs
                if queued:
                    self.jobs.remove(job)
            if not queued and job.taken:
                if cancel is not None:
                    cancel.set()
                job.done.wait()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    @property
    def queued(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self.cond:
            return len(self.running), len(self.waiting)

    def cancel_all(self) -> None:
        """Every waiting and running request leaves at the next iteration (a server shutting down)."""
        with self.cond:
            for request in list(self.waiting) + self.running:
                request.handle.cancel()
            self.cond.notify_all()

    def close(self) -> None:
        """Cancel what has not finished and stop the thread (the engine closes the rest)."""
        self.cancel_all()
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        set_thread_count(self.engine.threads)  # not the count another thread set for itself (cpu_threads.py)
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a scheduler that cannot go on fails all it holds, below
            self._die(exc)

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.running and not self.jobs and not self.stopping:
                    self.cond.wait()
                job = self.jobs.popleft() if self.jobs and not self.stopping else None
                if job is not None:
                    job.taken = True
                if self.stopping:
                    leaving = list(self.waiting) + self.running
                    self.waiting.clear()
                    self.running = []
                    dropped, self.jobs = list(self.jobs), deque()
                else:
                    dropped = []
                    # each handle's flag read once, under the lock its cancel() takes
                    leaving, staying, still_waiting = [], [], deque()
                    for request in self.running:
                        (leaving if request.handle.cancelled else staying).append(request)
                    for request in self.waiting:
                        (leaving if request.handle.cancelled else still_waiting).append(request)
                    self.running, self.waiting = staying, still_waiting
                    # a request joins only with a free KV slot; without one it waits for the next iteration
                    while self.waiting and len(self.running) < self.max_batch and self.kv.available:
                        self.waiting[0].slot = self.kv.acquire()
                        self.waiting[0].joined = time.perf_counter()
                        self.running.append(self.waiting.popleft())
                self._leaving = leaving  # out of both queues until they have ended: _die ends them if need be
                batch = list(self.running)
            for request in leaving:
                self._finish(request, "cancelled")
            for waiting_job in dropped:
                waiting_job.fail(MoeOffloadError("the engine is shutting down"))
            if job is not None:
                job.execute()
            if self.stopping and not batch:
                return
            if batch:
                try:
                    self._iteration(batch)
                except Exception as exc:  # noqa: BLE001 - a fault outside the forward pass (sampling,
                    # detokenising, a stop check): the batch's requests end with it, the scheduler serves on
                    for request in batch:
                        with self.cond:
                            if request not in self.running:
                                continue
                            self.running.remove(request)
                        self._finish(request, "error", exc)

    def _die(self, exc: BaseException) -> None:
        """The scheduler's thread cannot go on: every request it holds ends with the error, every job fails, and
        new requests are refused (``failure``, which /health reports), so that nobody waits for it for good."""
        with self.cond:
            self.failure = exc
            self.stopping = True
            stranded = list(self.waiting) + self.running + self._leaving
            self.waiting.clear()
            self.running = []
            jobs, self.jobs = list(self.jobs), deque()
        for request in (r for r in stranded if r.handle.completion is None):
            try:
                self._finish(request, "error", exc)
            except Exception:  # noqa: BLE001 - its accounting failed too: it still gets its end
                request.handle._emit(Completion(request.id, request.text, list(request.tokens), len(request.prompt),
                                                "error", None, exc))
        for job in jobs:
            job.fail(MoeOffloadError(f"the engine's scheduler stopped: {exc}"))

    def _iteration(self, batch: list[RunningRequest]) -> None:
        import torch

        engine, runner = self.engine, self.runner
        segments, tokens, positions, start = [], [], [], 0
        for request in batch:
            new = [request.tokens[-1]] if request.prefilled else request.prompt
            past = self.kv.lengths[request.slot]
            positions.extend(range(past, past + len(new)))
            segments.append(Segment(request.id, start, start + len(new), not request.prefilled, request.slot, past))
            tokens.extend(new)
            start += len(new)
        device = engine.device
        packed = PackedPass(segments, self.kv, exact=engine.batch_math == "exact", device=device)
        # A 4-D mask is taken as built: the packed pass builds none (each segment attends over its own KV
        # slot, runtime/packed.py), and this placeholder is never read.
        no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        started = time.perf_counter()
        try:  # generate's jobs run on this thread too: nothing else uses the model meanwhile
            self.kv.reserve(max(s.slot for s in segments) + 1, max(s.past + s.end - s.start for s in segments))
            runner.packed = packed
            for request in batch:
                runner.request_counters[request.id] = request.counters
            try:
                with torch.inference_mode():
                    hidden = self.model.model(
                        input_ids=torch.tensor([tokens], device=device),
                        position_ids=torch.tensor([positions], device=device),
                        attention_mask=no_mask, use_cache=False, packed=packed).last_hidden_state
                    logits = list(packed.last_logits(hidden, self.model.lm_head).float())
            finally:
                runner.packed = None
        except Exception as exc:  # noqa: BLE001 - reported to the requests it concerns, the server goes on
            self._failed(batch, exc)
            return
        for segment in segments:
            self.kv.commit(segment.slot, segment.end - segment.start)
        now = time.perf_counter()
        for request in batch:
            request.passes.append(self.iterations)
        self.iterations += 1
        self.forward_seconds += now - started
        if any(s.prefill for s in segments):
            self.prompt_pass_seconds += now - started
        for observer in self.observers:
            observer.on_pass(len(batch), now - started)
        for request, row in zip(batch, logits):
            try:
                self._advance(request, row, now)
            except Exception as exc:  # noqa: BLE001 - its own sampling, detokenising or stop check: it alone ends
                with self.cond:
                    self.running.remove(request)
                self._finish(request, "error", exc)
        self.advance_seconds += time.perf_counter() - now

    def _failed(self, batch, exc) -> None:
        path = self.engine.path
        with path.cond:
            key = path.failed_key if path.failure is exc else None
            path.clear_failure()
        concerned = [r for r in batch if key is None or key in self.runner.keys_of.get(r.id, ())]
        for request in concerned:
            with self.cond:
                self.running.remove(request)
            self._finish(request, "error", exc)

    # ------------------------------------------------------------------------------------ per request
    def _advance(self, request: RunningRequest, logits, now: float) -> None:
        finish = request.step(logits, now, self._eos(), self.tokenizer)
        if finish is not None:
            with self.cond:
                self.running.remove(request)
            self._finish(request, finish)

    def _eos(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _finish(self, request: RunningRequest, reason: str, error: BaseException | None = None) -> None:
        routed_experts = self.runner.routing_log.take(request.id)
        self.runner.end_request(request.id)
        if request.slot is not None:
            self.kv.release(request.slot)
            request.slot = None
        times = request.token_times
        ttft = times[0] - request.arrived if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        total = (times[-1] if times else time.perf_counter()) - request.arrived
        stats = run_result(self.engine, request.counters, ttft=ttft, tpot=tpot, total=total)
        stats.bytes_per_link = stats.bytes_loaded = None  # the links are shared: see the engine's stats
        stats.token_latency_seconds = [b - a for a, b in zip(times, times[1:])]
        completion = Completion(request.id, request.text, list(request.tokens), len(request.prompt), reason, stats,
                                error, request.logits if request.params.return_logits else None, routed_experts,
                                request.passes if routed_experts is not None else None,
                                request.logprobs if request.params.logprobs is not None else None,
                                None if request.joined is None else request.joined - request.arrived)
        for observer in self.observers:
            observer.on_finish(completion)
        request.handle._emit(completion)
