"""One JSON request to a server that may be slow, broken or hostile, in bounded time and memory.

``trace capture`` talks to a server it does not control. Python's ``urllib`` bounds only each socket read: a
server that drips one byte every 2 s holds it forever, an endless answer is read into memory until the
process dies, and an error body is read whole. Here every request has four deadlines and a cap
(:class:`Limits`), each a one-line :class:`~moe_offload.errors.ConfigError` naming the address:

* **connect**: the TCP (and TLS) connection is made within ``connect_seconds``;
* **total**: the answer has ended within ``total_seconds`` of the start (the server's compute included:
  a completion's answer begins only when it has generated its tokens);
* **answer** (the header and idle deadlines at once): once the answer's first byte has come, its headers
  and body end within ``read_seconds``. A server sends a finished JSON answer at once, so a drip, a stall
  after the headers or an endless body is cut then, whatever the total left;
* **bytes**: the answer (headers and body) is at most ``max_bytes``; a body whose declared length is larger
  is refused before any of it is read, and an error body is read only to ``ERROR_BYTES``.

The deadlines are enforced under ``http.client`` by the raw reader its response reads through: each read from
the socket waits at most until the nearer deadline, so no thread and no timer is needed, and TLS sockets
behave alike. A message that quotes what the server sent quotes at most ``QUOTE_CHARACTERS`` characters of it,
on one line. Redirects are not followed and proxies are not used: ``--url`` is the server itself.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from moe_offload.errors import ConfigError
from moe_offload.inputs import parse_json

QUOTE_CHARACTERS = 300
ERROR_BYTES = 64 * 1024
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Limits:
    """The deadlines (seconds) and the size cap (bytes) of one request (module docstring)."""

    connect_seconds: float = 10.0
    total_seconds: float = 600.0
    read_seconds: float = 60.0
    max_bytes: int = 256 * 2**20


def excerpt(data: bytes | str) -> str:
    """At most QUOTE_CHARACTERS characters of what a server sent, on one line (control characters escaped)."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    shown = text[:QUOTE_CHARACTERS].strip()
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
    return shown + (f"... (cut at {QUOTE_CHARACTERS} characters)" if len(text) > QUOTE_CHARACTERS else "")


class _Late(Exception):
    """A deadline passed: ``args[0]`` says which."""


class _TooLarge(Exception):
    pass


class _DeadlineReader(io.RawIOBase):
    """The socket as the raw stream an HTTP response reads: each read waits at most until the nearer deadline
    (the total one; after the first byte, the answer's), and the bytes read are counted against the cap."""

    def __init__(self, sock: socket.socket, total_by: float, limits: Limits, socket_file):
        super().__init__()
        self.sock, self.total_by, self.limits = sock, total_by, limits
        self.socket_file = socket_file  # the response's own file of the socket: while open, the socket stays
        self.answer_by: float | None = None  # set by the answer's first byte
        self.received = 0

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        super().close()
        self.socket_file.close()

    def readinto(self, buffer) -> int:
        by = self.total_by if self.answer_by is None else min(self.total_by, self.answer_by)
        wait = by - time.monotonic()
        if wait <= 0:
            raise _Late(self._which())
        self.sock.settimeout(wait)
        try:
            count = self.sock.recv_into(buffer)
        except socket.timeout:
            raise _Late(self._which()) from None
        if count and self.answer_by is None:
            self.answer_by = time.monotonic() + self.limits.read_seconds
        self.received += count
        if self.received > self.limits.max_bytes:
            raise _TooLarge()
        return count

    def _which(self) -> str:
        if self.answer_by is not None and self.answer_by <= self.total_by:
            return (f"the answer began but did not end within {self.limits.read_seconds:g} s (a stalled or "
                    "dripping server; --read-timeout raises it)")
        return f"no complete answer within {self.limits.total_seconds:g} s (--timeout raises it)"


def _response_class(total_by: float, limits: Limits):
    """http.client's response class reading through a :class:`_DeadlineReader`."""

    class Response(http.client.HTTPResponse):
        def __init__(self, sock, *args, **kwargs):
            super().__init__(sock, *args, **kwargs)
            # http.client closes the connection's socket once a response that ends with the connection has
            # begin(): the socket lives on while a file of it is open, as the one kept here
            self.fp = io.BufferedReader(_DeadlineReader(sock, total_by, limits, self.fp))

    return Response


def request_json(url: str, body: dict | None, limits: Limits, what: str):
    """The JSON a server answers to a GET (``body`` None) or a POST of ``body`` at ``url``; ConfigError in one
    line naming ``url`` and ``what`` for every way it can fail (module docstring)."""
    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{url}: {what}: the port is not a number from 0 to 65535") from None
    started = time.monotonic()
    connection = connection_class(parts.hostname or "", port, timeout=limits.connect_seconds)
    connection.response_class = _response_class(started + limits.total_seconds, limits)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json", **({} if data is None else {"Content-Type": "application/json"})}
    try:
        try:
            connection.connect()
        except socket.timeout:
            raise ConfigError(f"{url}: {what}: cannot reach the server (no connection within "
                              f"{limits.connect_seconds:g} s; --connect-timeout raises it)") from None
        connection.sock.settimeout(max(0.001, started + limits.total_seconds - time.monotonic()))
        connection.request("GET" if data is None else "POST", path or "/", body=data, headers=headers)
        response = connection.getresponse()
        if response.status >= 300:
            raise ConfigError(f"{url}: {what}: {_refusal(response)}")
        return parse_json(_body(response, url, what, limits), f"{url}: {what}", "answer")
    except _Late as late:
        raise ConfigError(f"{url}: {what}: {late.args[0]}") from None
    except _TooLarge:
        raise ConfigError(f"{url}: {what}: the answer is larger than {limits.max_bytes:,} bytes (--max-response "
                          "raises the limit)") from None
    except http.client.IncompleteRead as exc:
        raise ConfigError(f"{url}: {what}: the connection closed mid-answer ({len(exc.partial):,} bytes of the "
                          "body received)") from None
    except http.client.RemoteDisconnected:
        raise ConfigError(f"{url}: {what}: the server closed the connection without answering") from None
    except http.client.HTTPException as exc:  # a status line or headers that are not HTTP
        raise ConfigError(f"{url}: {what}: not an HTTP answer ({type(exc).__name__}: {excerpt(str(exc))})") from None
    except socket.timeout:  # sending the request: bounded by the total deadline
        raise ConfigError(f"{url}: {what}: the request could not be sent within {limits.total_seconds:g} s") from None
    except OSError as exc:
        raise ConfigError(f"{url}: {what}: cannot reach the server ({exc.strerror or excerpt(str(exc))})") from None
    finally:
        connection.close()


def _body(response: http.client.HTTPResponse, url: str, what: str, limits: Limits) -> bytearray:
    """The answer's body, refused early when it declares more than the cap (the reader counts the rest)."""
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limits.max_bytes:
        raise ConfigError(f"{url}: {what}: the answer declares {int(declared):,} bytes, more than "
                          f"{limits.max_bytes:,} (--max-response raises the limit)")
    chunks = bytearray()
    while chunk := response.read(CHUNK):
        chunks += chunk
    if declared is not None and declared.strip().isdigit() and len(chunks) < int(declared):
        # http.client ends a short body quietly when read in parts
        raise http.client.IncompleteRead(bytes(chunks), int(declared) - len(chunks))
    return chunks  # json reads a bytearray as it is: no second copy of a large answer


def _refusal(response: http.client.HTTPResponse) -> str:
    """What a status of 300 or more says, from at most ERROR_BYTES of its body: OpenAI's error message when
    it has one, else the body's start."""
    status = f"the server answered {response.status} {excerpt(response.reason or '')}".rstrip()
    if 300 <= response.status < 400:
        return f"{status} (a redirect to {excerpt(response.getheader('Location') or '?')}): give that address"
    try:
        detail = response.read(ERROR_BYTES)
    except (_Late, _TooLarge, http.client.HTTPException, OSError):
        detail = b""
    try:
        message = json.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        message = detail
    shown = excerpt(message if isinstance(message, (str, bytes)) else json.dumps(message)[:QUOTE_CHARACTERS * 2])
    hint = " (is --url the server's address?)" if response.status == 404 else ""
    return f"{status}{hint}" + (f": {shown}" if shown else "")
