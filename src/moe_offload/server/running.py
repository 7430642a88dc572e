"""Running the server: uvicorn in the foreground until a signal (``serve``) or in a background thread
(``ServerThread``), both with the drain of server/app.py: on shutdown, running requests may finish for the
grace period, then the rest are cancelled and answered with OpenAI's error, before uvicorn's own deadline
(``UVICORN_MARGIN_SECONDS`` later) would cut their connections; and both with the front door of
server/connections.py: a deadline on receiving each request, a bound on connections, floods logged once."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

from moe_offload.errors import ConfigError
from moe_offload.server.app import GRACE_SECONDS, MAX_BODY_BYTES, create_app
from moe_offload.server.connections import (KEEP_ALIVE_SECONDS, MAX_CONNECTIONS, MAX_HEADER_BYTES, REQUEST_SECONDS,
                                            deadline_for, loop_exception_handler, quiet_floods,
                                            raise_open_files_limit)

UVICORN_MARGIN_SECONDS = 5  # after the drain cancels, for the handlers to send their errors


def _server(engine, names, host: str, port: int, api_key: str | None, max_body_bytes: int, grace_seconds: float,
            request_seconds: float, max_connections: int):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose shutdown cancels what the grace period did not finish, in time for each
        request to be answered."""

        async def startup(self, sockets=None):
            asyncio.get_running_loop().set_exception_handler(loop_exception_handler)
            await super().startup(sockets=sockets)

        async def shutdown(self, sockets=None):
            lifecycle = self.config.app.state.lifecycle
            lifecycle.draining = True
            timer = asyncio.get_running_loop().call_later(lifecycle.grace_seconds, lifecycle.scheduler.cancel_all)
            try:
                await super().shutdown(sockets=sockets)
            finally:
                timer.cancel()

    app = create_app(engine, names, api_key=api_key, max_body_bytes=max_body_bytes, grace_seconds=grace_seconds)
    quiet_floods()
    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                         timeout_graceful_shutdown=grace_seconds + UVICORN_MARGIN_SECONDS,
                                         http=deadline_for(request_seconds), limit_concurrency=max_connections,
                                         timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                         h11_max_incomplete_event_size=MAX_HEADER_BYTES))


def serve(engine, names, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int = MAX_BODY_BYTES, grace_seconds: float = GRACE_SECONDS,
          request_seconds: float = REQUEST_SECONDS, max_connections: int = MAX_CONNECTIONS) -> None:
    """Serve until SIGINT or SIGTERM (then drain, see the module docstring), then close the engine. Each
    request's line and a periodic throughput line go to stderr. The open-files limit is raised to the hard
    one first: each connection holds a file."""
    import signal

    log = logging.getLogger("moe_offload.server")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s moe-offload: %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    raise_open_files_limit()
    server = _server(engine, names, host, port, api_key, max_body_bytes, grace_seconds, request_seconds,
                     max_connections)
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

    def __init__(self, engine, names, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, grace_seconds: float = GRACE_SECONDS,
                 request_seconds: float = REQUEST_SECONDS, max_connections: int = MAX_CONNECTIONS):
        self.server = _server(engine, names, host, port, api_key, max_body_bytes, grace_seconds, request_seconds,
                              max_connections)
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
