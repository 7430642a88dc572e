"""The OpenAI-compatible HTTP server: FastAPI and uvicorn over the engine's continuous-batching scheduler.

Why FastAPI and uvicorn, not transformers' own serving layer (``transformers serve``): its handlers run
transformers' continuous-batching manager, whose passes do not give a request the bits it gets alone and
cannot tell the project's hooks which request a row belongs to (runtime/batching.py). The server is a thin
layer: it parses and checks the request (server/protocol.py), submits it to the engine
(``OffloadEngine.submit``), and turns the request's events into a response or a stream of server-sent
events; the scheduler thread does all the work.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming or
not), ``GET /health``, ``GET /metrics`` (server/metrics.py). Every error is OpenAI's error body with a 4xx
status for what the client sent and a 5xx naming the problem for what failed inside the engine (an expert
file that vanished, a checksum), never a traceback. A client that goes away cancels its request: it
leaves the batch at the next iteration.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_offload.errors import ConfigError, MoeOffloadError
from moe_offload.runtime.batching import Completion, SamplingParams, TextDelta
from moe_offload.server.metrics import ServerMetrics
from moe_offload.server.protocol import (CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS, APIError, ChatRequest,
                                         CompletionRequest, chat_text, chunk_body, completion_body, new_id, parse,
                                         request_counters, usage)

GRACE_SECONDS = 10  # on SIGINT/SIGTERM, running requests may finish for this long before they are cancelled
DISCONNECT_POLL_SECONDS = 0.25


def model_name(model: str) -> str:
    """The id /v1/models lists for ``--model tiny|DIR|ORG/NAME[@REVISION]``: a hub id as given, as vLLM serves
    its ``--model``; a directory by its name."""
    from moe_offload.models.hub import hub_id

    return model if model == "tiny" or hub_id(model) is not None else Path(model).name


def create_app(engine, name: str) -> FastAPI:
    """The server's FastAPI application around ``engine``, serving the model id ``name``."""
    metrics = ServerMetrics(engine)
    scheduler = engine.scheduler
    scheduler.observers.append(metrics)

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.cancel_all()  # what the grace period did not finish is cancelled

    app = FastAPI(title="moe-offload", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        running, waiting = scheduler.queued
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "moe-offload"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        req = parse(CompletionRequest if kind == "text" else ChatRequest, body)
        if req.model != name:
            raise APIError(404, f"the model {req.model!r} does not exist: this server serves {name!r}",
                           param="model", code="model_not_found")
        try:
            ids = scheduler.encode(req.prompt_input() if kind == "text" else chat_text(scheduler.tokenizer,
                                                                                      req.messages))
            max_tokens = req.max_tokens
            if kind == "chat" and req.max_completion_tokens is not None:  # OpenAI's newer name wins
                max_tokens = req.max_completion_tokens
            if max_tokens is None:
                room = (engine.manifest.max_position_embeddings or len(ids) + CHAT_MAX_TOKENS) - len(ids)
                max_tokens = COMPLETION_MAX_TOKENS if kind == "text" else min(CHAT_MAX_TOKENS, max(room, 1))
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    seed=req.seed, stop=req.stop_sequences())
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            handle = scheduler.submit(ids, params, on_event=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        except ConfigError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        except MoeOffloadError as exc:  # shutting down
            raise APIError(503, str(exc), "server_error") from None
        rid = new_id("cmpl" if kind == "text" else "chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(kind, rid, handle, events, include_usage),
                                     media_type="text/event-stream")
        completion = await _completion(handle, events, request)
        if completion is None:  # the client went away: nobody reads an answer
            return Response(status_code=499)
        _raise_failure(completion)
        return completion_body(kind, rid, name, completion)

    async def _completion(handle, events, request) -> Completion | None:
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                        return None
                    continue
                if isinstance(event, Completion):
                    return event
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def _stream(kind, rid, handle, events, include_usage):
        first = True
        try:
            while True:
                event = await events.get()
                if isinstance(event, TextDelta):
                    if event.text or (first and kind == "chat"):
                        yield _sse(chunk_body(kind, rid, name, event.text, first=first))
                        first = False
                    continue
                try:
                    _raise_failure(event)
                except APIError as exc:
                    yield _sse(exc.body())
                    return
                last = chunk_body(kind, rid, name, "", event.finish_reason, first=first)
                last["moe_offload"] = request_counters(event.stats)
                yield _sse(last)
                if include_usage:
                    yield _sse({"id": rid, "object": last["object"], "created": last["created"], "model": name,
                                "choices": [], "usage": usage(event.prompt_tokens, len(event.token_ids))})
                yield "data: [DONE]\n\n"
                return
        finally:
            handle.cancel()  # a client that went away; nothing once the request has finished

    return app


def _raise_failure(completion: Completion) -> None:
    if completion.finish_reason == "error":
        raise APIError(500, f"the engine failed this request: {completion.error}", "server_error",
                       code="engine_error")
    if completion.finish_reason == "cancelled":
        raise APIError(503, "the request was cancelled: the server is shutting down", "server_error",
                       code="cancelled")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _config(engine, name: str, host: str, port: int):
    import uvicorn

    return uvicorn.Config(create_app(engine, name), host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=GRACE_SECONDS)


def serve(engine, name: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGINT or SIGTERM: running requests finish (or are cancelled after GRACE_SECONDS), then
    the engine is closed."""
    import signal

    import uvicorn

    server = uvicorn.Server(_config(engine, name, host, port))
    # uvicorn handles SIGINT and SIGTERM while it runs, then raises them again for the handlers it found:
    # these, so that a requested shutdown ends here, with the engine closed and exit status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        engine.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise ConfigError(f"cannot serve on {host}:{port} (in use, or not an address of this machine)")


class ServerThread:
    """The server in a background thread of this process (tests, benchmarks): ``with ServerThread(engine,
    "tiny") as server: server.url``. Port 0 picks a free port. The engine stays open after ``stop``."""

    def __init__(self, engine, name: str, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(_config(engine, name, host, port))
        self.thread = threading.Thread(target=self.server.run, name="moe-offload server", daemon=True)
        self.host = host
        self.port = port

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
