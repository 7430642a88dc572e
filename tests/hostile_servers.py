"""Servers that answer HTTP badly, on loopback, for the capture client's tests (tests/test_capture_hostile.py)
and the slow cases of benchmarks/hostile_network.py: each connection reads the request, then runs one
behaviour (``BEHAVIOURS``) on the raw socket. The server listens on 127.0.0.1 only, on a free port, in a
daemon thread, and stops when its ``with`` block ends (closing every connection it holds)."""

from __future__ import annotations

import json
import socket
import threading

MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()


def _answer(body: bytes, status: str = "200 OK", length: int | None = None, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body) if length is None else length}\r\n{extra}Connection: close\r\n\r\n").encode() + body


def _models_then(behaviour):
    """Answer /v1/models properly, and run ``behaviour`` for every other path."""
    def run(sock, path: str, stop: threading.Event, options: dict) -> None:
        if path.endswith("/v1/models"):
            sock.sendall(_answer(MODELS))
        else:
            behaviour(sock, path, stop, options)
    return run


def drip(sock, path, stop, options) -> None:
    """A valid answer sent one byte every ``interval`` seconds (never finishing in practice)."""
    for byte in _answer(b'{"choices": []}' + b" " * 10**6):
        if stop.wait(options.get("interval", 2.0)):
            return
        sock.sendall(bytes([byte]))


def endless(sock, path, stop, options) -> None:
    """Headers without a length, then JSON-looking bytes forever (as fast as the client reads)."""
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n[")
    block = b"0," * 32768
    while not stop.is_set():
        sock.sendall(block)


def huge_declared(sock, path, stop, options) -> None:
    """A valid-looking answer declaring 1 GB, of which a little is sent."""
    sock.sendall(_answer(b'{"choices": [', length=10**9))
    stop.wait(options.get("hold", 30))


def huge_error(sock, path, stop, options) -> None:
    """A 500 whose body is ``size`` bytes of one long line (1 GB in the issue; streamed, never held)."""
    size = options.get("size", 10**9)
    sock.sendall(f"HTTP/1.1 500 Internal Server Error\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
                 .encode())
    block = b"E" * 65536
    sent = 0
    while sent < size and not stop.is_set():
        sock.sendall(block[:size - sent])
        sent += min(len(block), size - sent)


def silent(sock, path, stop, options) -> None:
    """Accept the request and never answer."""
    stop.wait(options.get("hold", 30))


def cut(sock, path, stop, options) -> None:
    """Declare 1,000 bytes, send 10, close: http.client's IncompleteRead."""
    sock.sendall(_answer(b'{"choices":', length=1000))


def not_http(sock, path, stop, options) -> None:
    sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")


def not_found(sock, path, stop, options) -> None:
    """A 404 with a long HTML body, as a web server that is not the API answers."""
    sock.sendall(_answer(b"<html><body>" + b"Not Found " * 100_000 + b"</body></html>", status="404 Not Found"))


def shaped(body) -> callable:
    """A 200 whose JSON body is ``body`` (a wrong-shaped answer)."""
    def run(sock, path, stop, options) -> None:
        sock.sendall(_answer(json.dumps(body).encode()))
    return run


BEHAVIOURS = {"drip": drip, "endless": endless, "huge-declared": huge_declared, "huge-error": huge_error,
              "silent": silent, "cut": cut, "not-http": not_http, "not-found": not_found}


class ScriptedServer:
    """``with ScriptedServer(behaviour, models_first=True, **options) as server: server.url``. With
    ``models_first`` the model list is answered properly and only completions misbehave."""

    def __init__(self, behaviour, models_first: bool = True, **options):
        behaviour = BEHAVIOURS.get(behaviour, behaviour)
        self.behaviour = _models_then(behaviour) if models_first else behaviour
        self.options = options
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                continue
            self.connections.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                data = sock.recv(65536)
                if not data:
                    return
                request += data
            path = request.split(b" ", 2)[1].decode()
            head, _, body = request.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += sock.recv(65536)
            self.behaviour(sock, path, self.stop, self.options)
        except OSError:
            pass  # the client went away: what it is tested for
        finally:
            sock.close()

    def __enter__(self) -> "ScriptedServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
