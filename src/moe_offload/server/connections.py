"""The server's front door: a deadline on receiving each request, a bound on connections, the API key on
every path but /health, and a log that says a flood once instead of once per connection.

**Why a protocol of its own.** uvicorn has no timeout on receiving a request: ``timeout_keep_alive`` runs only
between two requests, and every byte received cancels it (h11_impl.py, ``data_received``); a connection that
sends nothing, or half a request, or one byte every few seconds, is held forever (uvicorn's own list of the
missing ones: Kludex/uvicorn#157, ``--timeout-request-start``). Each such connection holds a file descriptor,
and once the process has none left asyncio's accept loop logs a traceback per attempt ("socket.accept() out of
system resource"): half-sent requests made a normal request time out after 60 s, and the log grew by 417 MB in
100 s. ASGI middleware cannot help, as it runs only once the headers are parsed. :class:`DeadlineH11Protocol`
is uvicorn's h11 protocol with a deadline (``request_seconds``) from a request's first byte (or the connection's
opening) until it is received whole, headers and body; past it the connection is closed. The deadline ends
when the request is complete, so a long generation or stream that follows is never cut (the approach of
xorbitsai/inference#5213 for the same hole).

The other bounds are uvicorn's own settings (``uvicorn.Config``): ``h11_max_incomplete_event_size`` (a request
line and headers larger than it are a 400), ``timeout_keep_alive`` (an idle connection between requests is
closed) and ``limit_concurrency`` (past that many connections, a request is answered 503 at once).

**The key.** With an API key, :class:`RequireKey` wants it on every path but /health: the API, /metrics and
FastAPI's own /docs, /redoc and /openapi.json (which answered without it).

**A flood is logged once.** :class:`OncePerWindow` lets a message through once per ``WINDOW_SECONDS`` and
counts the repeats, which the next one let through reports; it filters uvicorn's per-connection warnings
("Invalid HTTP request received.") and the closes above, and the event loop's accept failures are one line
through it instead of a traceback each.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import resource
import time

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_offload.server.protocol import APIError

REQUEST_SECONDS = 30.0       # from a request's first byte until it is received whole
MAX_CONNECTIONS = 1024       # uvicorn's limit_concurrency: past it, requests are answered 503
KEEP_ALIVE_SECONDS = 5       # uvicorn's default, stated
MAX_HEADER_BYTES = 64 * 1024  # a request line and headers, at most (h11_max_incomplete_event_size)
WINDOW_SECONDS = 10.0
FLOOD = logging.getLogger("moe_offload.server.connections")


class OncePerWindow(logging.Filter):
    """Lets each distinct message through at most once per ``WINDOW_SECONDS``; the next one let through says
    how many were held back."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        now = time.monotonic()
        first, held = self.seen.get(message, (None, 0))
        if first is not None and now - first < WINDOW_SECONDS:
            self.seen[message] = (first, held + 1)
            return False
        self.seen[message] = (now, 0)
        record.exc_info = record.exc_text = None  # a flood's traceback says nothing the line does not
        if held:
            record.msg, record.args = f"{message} ({held:,} more like it in the {WINDOW_SECONDS:g} s before, " \
                                      "not logged)", None
        return True


_ONCE = OncePerWindow()
FLOOD.addFilter(_ONCE)  # this module's own per-connection lines


def quiet_floods() -> None:
    """Put the once-per-window filter on uvicorn's logger, which logs per connection (idempotent)."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _ONCE not in uvicorn_log.filters:
        uvicorn_log.addFilter(_ONCE)


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's errors as asyncio logs them, except that accept failures (out of file descriptors or
    memory) are one line through the flood filter, not a traceback per attempt."""
    if context.get("message") == "socket.accept() out of system resource":
        FLOOD.warning("cannot accept connections: %s; new connections wait until some close (those that have not "
                      "sent a whole request within --request-timeout are closed)", context.get("exception"))
        return
    loop.default_exception_handler(context)


def raise_open_files_limit() -> int:
    """The soft limit of open files raised to the hard one (each connection holds one); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request (module docstring). ``deadline_for``
    makes the class for a number of seconds."""

    request_seconds = REQUEST_SECONDS

    def connection_made(self, transport) -> None:
        self.receipt = None
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Armed while a request is being received (h11: the client IDLE or SEND_BODY), else not."""
        receiving = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if receiving and self.receipt is None and not self.transport.is_closing():
            self.receipt = self.loop.call_later(self.request_seconds, self._expired)
        elif not receiving:
            self._disarm()

    def _disarm(self) -> None:
        if self.receipt is not None:
            self.receipt.cancel()
            self.receipt = None

    def _expired(self) -> None:
        self.receipt = None
        if not self.transport.is_closing():
            FLOOD.info("closed a connection that had not sent a whole request within %g s", self.request_seconds)
            self.transport.close()


def deadline_for(seconds: float) -> type[DeadlineH11Protocol]:
    """The protocol class with a deadline of ``seconds``."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"request_seconds": seconds})


class RequireKey:
    """ASGI middleware: with an API key, every path but /health wants ``Authorization: Bearer <key>`` (the
    API, /metrics, and FastAPI's own /docs, /redoc and /openapi.json alike); a 401 in OpenAI's error body
    otherwise. Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streaming
    response and the client's disconnect."""

    def __init__(self, app, api_key: str, metrics):
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self._authorized(scope):
            refusal = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                               code="invalid_api_key")
            self.metrics.rejected.labels(refusal.code).inc()
            await JSONResponse(refusal.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
