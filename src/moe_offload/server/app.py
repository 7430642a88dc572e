"""The OpenAI-compatible HTTP server: FastAPI and uvicorn over the engine's continuous-batching scheduler.

Why FastAPI and uvicorn, not transformers' own serving layer (``transformers serve``): its handlers run
transformers' continuous-batching manager, whose passes do not give a request the bits it gets alone and
cannot tell the project's hooks which request a row belongs to (runtime/batching.py). The server is a thin
layer: it reads and checks the request (server/protocol.py), submits one scheduler request per choice
(``n`` per prompt), and turns their events into a response or a stream of server-sent events
(server/responses.py); the scheduler thread does all the work.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming or
not), ``GET /health`` (503 once the scheduler has stopped), ``GET /metrics`` (server/metrics.py). Every
error is OpenAI's error body with a 4xx status for what the client sent and a 5xx naming the problem for
what failed inside the engine, never a traceback. A client that goes away cancels its requests: they leave
the batch at the next iteration.

**Hostile input.** A body is read up to ``max_body_bytes`` (413 beyond, from its Content-Length before
reading when it declares one). Parsing the JSON, rendering the chat template and tokenizing run in a worker
thread, so a large prompt never stalls the event loop (/health, other streams). A text prompt longer than
the context could hold even if every token were the tokenizer's longest is refused before it is tokenized.
Invalid JSON, non-UTF-8 bytes, NaN, JSON nested too deeply, integers of thousands of digits and lone
surrogates are 400s (inputs.parse_json); a client that disconnects mid-body gets nothing and logs nothing.

**Shutdown** (SIGINT/SIGTERM, or ``ServerThread.stop``): new connections are refused and new requests get
a 503; running requests may finish for ``grace_seconds``; then each remaining request is cancelled and
answered with OpenAI's error (a 503 body; a stream gets an error event, then ``[DONE]``) before uvicorn's
own deadline, so no handler is killed mid-response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.inputs import parse_json
from moe_offload.models.hub import hub_id
from moe_offload.runtime.requests import Completion, SamplingParams, TextDelta
from moe_offload.server.connections import RequireKey
from moe_offload.server.metrics import ServerMetrics
from moe_offload.server.protocol import (CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS, MAX_CHOICES, APIError, ChatRequest,
                                         CompletionRequest, chat_text, new_id, parse)
from moe_offload.server.responses import LogprobWriter, chunk_body, completion_body, request_counters, usage
from moe_offload.server.routed_experts import attach as attach_routing

GRACE_SECONDS = 10  # on shutdown, running requests may finish for this long before they are cancelled
MAX_BODY_BYTES = 4 * 2**20
THROUGHPUT_LOG_SECONDS = 10
DISCONNECT_POLL_SECONDS = 0.25
LOG = logging.getLogger("moe_offload.server")


def model_name(model: str) -> str:
    """The id /v1/models lists for ``--model tiny|DIR|ORG/NAME[@REVISION]``: a hub id as given, as vLLM serves
    its ``--model``; a directory by its name."""
    return model if model == "tiny" or hub_id(model) is not None else Path(model).name


class Lifecycle:
    """Whether the server is draining (shutting down): new requests are then refused with a 503."""

    def __init__(self, scheduler, grace_seconds: float):
        self.scheduler, self.grace_seconds = scheduler, grace_seconds
        self.draining = False

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")


def create_app(engine, names: str | list[str], api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               grace_seconds: float = GRACE_SECONDS) -> FastAPI:
    """The server's FastAPI application around ``engine``, answering to the model ids ``names`` (the first is
    the one responses name); with ``api_key``, every path but /health wants ``Authorization: Bearer <api_key>``
    (server/connections.py, ``RequireKey``)."""
    names = [names] if isinstance(names, str) else list(names)
    name = names[0]
    metrics = ServerMetrics(engine)
    scheduler = engine.scheduler
    scheduler.observers.append(metrics)
    lifecycle = Lifecycle(scheduler, grace_seconds)
    longest_token: list[int] = []  # the tokenizer's longest token in characters, once read

    @asynccontextmanager
    async def lifespan(app):
        reporter = asyncio.create_task(_report_throughput(metrics, scheduler))
        yield
        reporter.cancel()
        with suppress(asyncio.CancelledError):
            await reporter
        scheduler.cancel_all()  # what the grace period did not finish is cancelled
        scheduler.observers.remove(metrics)

    app = FastAPI(title="moe-offload", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        metrics.rejected.labels(exc.code or f"http_{exc.status}").inc()
        LOG.info("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return await api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        running, waiting = scheduler.queued
        if scheduler.failure is not None:
            return JSONResponse({"status": "error", "error": f"the scheduler stopped: {scheduler.failure}",
                                 "running": running, "waiting": waiting}, status_code=503)
        return {"status": "draining" if lifecycle.draining else "ok", "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "moe-offload"}
                                           for n in names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str):
        received = time.perf_counter()
        lifecycle.refuse_if_draining()
        try:
            raw = await _body(request, max_body_bytes)
        except ClientDisconnect:  # gone mid-body: nobody reads an answer, nothing to log
            return Response(status_code=499)
        req, prompts = await asyncio.to_thread(_prepare, raw, kind)
        if req.model not in names:
            raise APIError(404, f"the model {req.model!r} does not exist: this server serves {name!r}",
                           param="model", code="model_not_found")
        lifecycle.refuse_if_draining()
        n = req.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"n: {len(prompts)} prompts x n {n} is more than {MAX_CHOICES} choices", param="n")
        if req.return_routed_experts and len(prompts) * n > 1:
            raise APIError(400, "return_routed_experts: the routing is returned for one prompt and one choice (n 1)",
                           param="return_routed_experts")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        handles = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(n):
                    params = _sampling(req, kind, len(ids), engine, j)
                    handles.append(scheduler.submit(ids, params, on_event=_deliver(loop, events, p * n + j)))
        except ConfigError as exc:
            _cancel(handles)
            raise APIError(400, str(exc), code="invalid_value", param=_param_of(str(exc))) from None
        except MoeOffloadError as exc:  # shutting down, or the scheduler stopped
            _cancel(handles)
            raise APIError(503, str(exc), "server_error", code="unavailable") from None
        rid = new_id("cmpl" if kind == "text" else "chatcmpl")
        writer = None if req.logprob_count() is None else LogprobWriter(kind, scheduler.tokenizer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(kind, rid, handles, events, include_usage, writer, n, received,
                                             req.routed_experts_start_len),
                                     media_type="text/event-stream")
        done = await _completions(handles, events, request)
        if done is None:  # the client went away: nobody reads an answer
            return Response(status_code=499)
        _log_request(rid, done, n, received, metrics)
        failure = _failure(done)
        if failure is not None:  # answered after work: an engine error or a shutdown, not a rejection
            return JSONResponse(failure.body(), status_code=failure.status)
        body = completion_body(kind, rid, name, done, n, writer)
        attach_routing(body, done[0], req.routed_experts_start_len)
        return body

    def _prepare(raw: bytes, kind: str):
        """The request and its prompts' token ids (in a worker thread: parsing and tokenizing may be long)."""
        try:
            body = parse_json(raw, "the request body", "request body")
        except ConfigError as exc:
            raise APIError(400, str(exc), code="invalid_json") from None
        _refuse_surrogates(body)
        req = parse(CompletionRequest if kind == "text" else ChatRequest, body)
        if req.model not in names:
            return req, []
        texts = req.prompts() if kind == "text" else [chat_text(scheduler.tokenizer, req.messages)]
        return req, [_encode(t) for t in texts]

    def _encode(prompt) -> list[int]:
        context = engine.manifest.max_position_embeddings
        if isinstance(prompt, str) and context and scheduler.tokenizer is not None:
            if not longest_token:
                longest_token.append(max(len(t) for t in scheduler.tokenizer.get_vocab()))
            if len(prompt) > context * longest_token[0]:
                raise APIError(400, f"prompt: {len(prompt):,} characters are more than {context:,} tokens (the "
                               f"model's context) even at {longest_token[0]} characters per token", param="prompt",
                               code="context_length_exceeded")
        try:
            return scheduler.encode(prompt)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None

    async def _completions(handles, events, request) -> list[Completion] | None:
        done: list[Completion | None] = [None] * len(handles)
        try:
            while None in done:
                try:
                    index, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        _cancel(handles)
                        return None
                    continue
                if isinstance(event, Completion):
                    done[index] = event
                    if event.finish_reason in ("error", "cancelled"):
                        _cancel(handles)  # the request fails as a whole: its other choices stop too
                        return [c for c in done if c is not None]
            return done
        except asyncio.CancelledError:
            _cancel(handles)
            raise

    async def _stream(kind, rid, handles, events, include_usage, writer, n, received, routed_experts_start_len):
        first = [True] * len(handles)
        sent = [0] * len(handles)  # characters of each choice's text sent (completions' text_offset)
        done: list[Completion] = []
        try:
            while len(done) < len(handles):
                index, event = await events.get()
                if isinstance(event, TextDelta):
                    if event.text or event.logprobs or (first[index] and kind == "chat"):
                        lp = None if writer is None or not event.logprobs else \
                            writer.body(event.token_ids, event.logprobs, sent[index])
                        yield _sse(chunk_body(kind, rid, name, index, event.text, first=first[index], logprobs=lp))
                        first[index] = False
                        sent[index] += len(event.text)
                    continue
                done.append(event)
                failure = _failure([event])
                if failure is not None:
                    _log_request(rid, done, n, received, metrics)
                    yield _sse(failure.body())
                    yield "data: [DONE]\n\n"
                    return
                last = chunk_body(kind, rid, name, index, "", event.finish_reason, first=first[index])
                last["moe_offload"] = request_counters(event.stats)
                attach_routing(last, event, routed_experts_start_len)
                yield _sse(last)
            _log_request(rid, done, n, received, metrics)
            if include_usage:
                yield _sse({"id": rid, "object": last["object"], "created": last["created"], "model": name,
                            "choices": [], "usage": usage(sum(c.prompt_tokens for c in done) // n,
                                                          sum(len(c.token_ids) for c in done))})
            yield "data: [DONE]\n\n"
        finally:
            _cancel(handles)  # a client that went away; nothing once the requests have finished

    return app


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, refused with a 413 past ``limit`` bytes (from its declared length when it has one)."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"the request body is larger than {limit:,} bytes", code="request_too_large")
    if declared.isascii() and declared.isdigit() and (len(declared) > 15 or int(declared) > limit):
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_surrogates(body) -> None:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"the request body holds a lone surrogate ({exc.object[exc.start:exc.end]!a}), "
                       "which is not Unicode text", code="invalid_json") from None


def _sampling(req, kind: str, prompt_tokens: int, engine, choice: int) -> SamplingParams:
    """Choice ``choice``'s SamplingParams (with a seed, choice j draws with seed + j: n distinct samples)."""
    max_tokens = req.max_tokens
    if kind == "chat" and req.max_completion_tokens is not None:  # OpenAI's newer name wins
        max_tokens = req.max_completion_tokens
    if max_tokens is None:
        room = (engine.manifest.max_position_embeddings or prompt_tokens + CHAT_MAX_TOKENS) - prompt_tokens
        max_tokens = COMPLETION_MAX_TOKENS if kind == "text" else min(CHAT_MAX_TOKENS, max(room, 1))
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=None if req.seed is None else (req.seed + choice) % 2**63, stop=req.stop_sequences(),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=req.token_bias(), logprobs=req.logprob_count(),
        top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        return_routed_experts=req.return_routed_experts)


def _param_of(message: str) -> str | None:
    """The parameter a scheduler's refusal names, when it begins with one."""
    for param in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                  "logit_bias", "logprobs"):
        if message.startswith(param) or f"a {param}" in message:
            return param
    return None


def _deliver(loop, events: asyncio.Queue, index: int):
    """The scheduler thread's callback for choice ``index``: its events into the request's queue."""
    def put(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the event loop has closed (the server stopped): nobody reads this request
            pass
    return put


def _cancel(handles) -> None:
    for handle in handles:
        handle.cancel()


def _failure(completions: list[Completion]) -> APIError | None:
    """The error that answers a request one of whose choices failed or was cancelled, if one was."""
    for completion in completions:
        if completion.finish_reason == "error":
            return APIError(500, f"the engine failed this request: {completion.error}", "server_error",
                            code="engine_error")
        if completion.finish_reason == "cancelled":
            return APIError(503, "the request was cancelled: the server is shutting down", "server_error",
                            code="cancelled")
    return None


def _log_request(rid: str, done: list[Completion], n: int, received: float, metrics: ServerMetrics) -> None:
    """The request's log line, and its end-to-end latency into /metrics."""
    total = time.perf_counter() - received
    metrics.e2e.observe(total)
    queue = max((c.queue_seconds or 0.0 for c in done), default=0.0)
    ttft = min((c.stats.ttft_seconds for c in done if c.stats and c.stats.ttft_seconds is not None), default=None)
    LOG.info("%s: %d choice(s), prompt %d tokens, completion %d tokens, finish %s, queue %.3f s, ttft %s, "
             "total %.3f s", rid, len(done), sum(c.prompt_tokens for c in done[::n]),
             sum(len(c.token_ids) for c in done), ",".join(sorted({c.finish_reason for c in done})) or "-", queue,
             "-" if ttft is None else f"{ttft:.3f} s", total)


async def _report_throughput(metrics: ServerMetrics, scheduler) -> None:
    """Every THROUGHPUT_LOG_SECONDS in which something ran: one line of throughput (vLLM's periodic line)."""
    before = metrics.throughput_counts()
    while True:
        await asyncio.sleep(THROUGHPUT_LOG_SECONDS)
        now = metrics.throughput_counts()
        prompt, generated = (b - a for a, b in zip(before, now))
        if prompt or generated:
            running, waiting = scheduler.queued
            LOG.info("throughput: prompt %.1f tokens/s, generation %.1f tokens/s, running %d, waiting %d",
                     prompt / THROUGHPUT_LOG_SECONDS, generated / THROUGHPUT_LOG_SECONDS, running, waiting)
        before = now


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
