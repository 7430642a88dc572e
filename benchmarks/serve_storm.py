"""A bounded hostile load test of the OpenAI-compatible server, on loopback: streaming clients that finish,
clients that disconnect after 1-3 chunks, and poisoned requests, for a fixed time; then the checks.

    python benchmarks/serve_storm.py [--clients 8] [--seconds 15] [--max-tokens 16] [--max-batch 4]
        [--disconnect 0.3] [--poison 0.2] [--slowloris 0] [--drip 2] [--request-timeout 30] [--json FILE]

(the default runs in under a minute on a 2-core machine; a longer run: ``--clients 64 --seconds 300
--max-batch 16``; the slowloris run of issue 33: ``--clients 1 --slowloris 200 --seconds 60``.)

The tiny model serves in this process on a free port (``ServerThread``); each of ``--clients`` threads
sends requests back to back over raw sockets until ``--seconds`` have passed. Each request is, at random:
poisoned (``--poison``: invalid JSON, a lone surrogate, JSON nested 10,000 deep, a 5,000-digit integer,
NaN, a 50 MiB declared body, a tool call, an unknown parameter, a body cut mid-way), a stream dropped after
1-3 events (``--disconnect``, half of them with a TCP reset), or a well-formed stream read to its end
(half of them at temperature 1e-300). Reported and checked (exit status 1 if any fails):

- hangs: a request that receives nothing for 120 s, or a server still running or holding waiting
  requests 30 s after the clients stopped;
- leaked KV slots: slots not free once the server is idle;
- every well-formed request answered (a stream ending with ``[DONE]`` and a finish reason ``length`` or
  ``stop``), every poisoned one refused with a 4xx;
- /health ok and one more request answered at the end;
- memory: this process's resident set after warm-up, at the end and its peak (sampled each second).

With ``--slowloris N``, N more connections are held half-open all along: each sends half a request's
headers, then one more byte every ``--drip`` seconds, and is opened again when the server closes it (at its
``--request-timeout``, server/connections.py). A prober sends a normal request every half second (``GET
/v1/models``: what the half-open connections could starve is the front door, not the engine, which the
clients keep busy) and times it: ``PROBES_ALONE`` before the connections open (what the request takes on the
machine now), then all along. Checked besides: every probe answered within
``PROBE_SECONDS`` (1 s), and the server's log (uvicorn's, asyncio's and the server's loggers, with
tracebacks, as ``serve`` prints them) under ``LOG_LIMIT_BYTES`` (1 MB).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import socket
import sys
import threading
import time

REQUEST_TIMEOUT = 120  # seconds without a byte: a hang (a busy 2-core machine can be slow, not silent)
PROBE_SECONDS = 1.0  # a normal request beside the slowloris connections answers within this
PROBES_ALONE = 6  # timed before the slowloris connections open: the same requests on this machine now
LOG_LIMIT_BYTES = 10**6
PROMPT = "User: tell me about caches\nAssistant:"


def poisoned_bodies() -> list[tuple[str, bytes, int | None]]:
    """(name, body, declared Content-Length or None for the body's own) of requests the server must refuse."""
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]'
    return [
        ("invalid JSON", b'{"model": "tiny", "prompt": ', None),
        ("lone surrogate", b'{"model": "tiny", "prompt": "\\ud800"}', None),
        ("not UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', None),
        ("nested 10,000 deep", b"[" * 10_000 + b"]" * 10_000, None),
        ("5,000-digit integer", b'{"model": "tiny", "prompt": [' + b"9" * 5000 + b"]}", None),
        ("NaN temperature", chat + b', "temperature": NaN}', None),
        ("50 MiB declared", b"", 50 * 2**20),
        ("a tool", chat + b', "tools": [{"type": "function", "function": {"name": "f"}}]}', None),
        ("unknown parameter", chat + b', "frobnicate": 1}', None),
        ("cut mid-body", b'{"model": "tiny", "pro', 4000),
    ]


def http(port: int, path: str, body: bytes, length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nConnection: close"
            f"\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def exchange(port: int, request: bytes, stop_after_events: int | None = None, reset: bool = False,
             close_after_send: bool = False) -> bytes:
    """Send ``request``; read the answer to its end (or ``stop_after_events`` events, then close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) as s:
        s.sendall(request)
        if close_after_send:
            return b""
        answer = b""
        while True:
            data = s.recv(65536)
            if not data:
                return answer
            answer += data
            if stop_after_events is not None and answer.count(b"data: ") >= stop_after_events:
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                return answer


def status_of(answer: bytes) -> int | None:
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.problems: list[str] = []

    def add(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if problem is not None:
                self.problems.append(problem)


def client(port: int, seed: int, deadline: float, args, tally: Tally) -> None:
    rng = random.Random(seed)
    poisons = poisoned_bodies()
    while time.monotonic() < deadline:
        roll = rng.random()
        try:
            if roll < args.poison:
                name, body, length = rng.choice(poisons)
                cut = name == "cut mid-body"
                answer = exchange(port, http(port, "/v1/chat/completions", body, length), close_after_send=cut)
                if not cut and not 400 <= (status_of(answer) or 0) < 500:
                    tally.add("poisoned answered wrongly", f"{name}: {answer[:120]!r}")
                else:
                    tally.add("poisoned refused")
                continue
            temperature = 1e-300 if rng.random() < 0.5 else 0
            body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": args.max_tokens,
                               "temperature": temperature, "stream": True}).encode()
            if roll < args.poison + args.disconnect:
                exchange(port, http(port, "/v1/completions", body), stop_after_events=rng.randint(1, 3),
                         reset=rng.random() < 0.5)
                tally.add("dropped")
                continue
            answer = exchange(port, http(port, "/v1/completions", body))
            events = [e for e in answer.split(b"\r\n\r\n", 1)[-1].split(b"\n\n") if b"data: " in e]
            finishes = [b'"finish_reason": "length"' in e or b'"finish_reason": "stop"' in e for e in events]
            if status_of(answer) == 200 and events and events[-1].strip().endswith(b"data: [DONE]") and any(finishes):
                tally.add("answered")
            else:
                tally.add("unanswered", f"status {status_of(answer)}: {answer[-200:]!r}")
        except socket.timeout:
            tally.add("hangs", f"no answer within {REQUEST_TIMEOUT} s")
        except OSError as exc:
            tally.add("unanswered", f"{type(exc).__name__}: {exc}")


class CountingLog(logging.Handler):
    """The bytes the server's loggers would print (tracebacks included), as ``serve``'s stderr handler would."""

    NAMES = ("uvicorn", "uvicorn.error", "asyncio", "moe_offload.server")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(asctime)s moe-offload: %(message)s"))
        self.bytes = self.records = 0
        self.lock_ = threading.Lock()

    def emit(self, record) -> None:
        with self.lock_:
            self.bytes += len(self.format(record)) + 1
            self.records += 1

    def __enter__(self) -> "CountingLog":
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        logging.getLogger("moe_offload.server").setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


def slowloris(port: int, count: int, drip: float, stop: threading.Event, tally: Tally) -> None:
    """``count`` half-open connections held until ``stop``: half the headers, then a byte every ``drip`` s;
    each one the server closes is counted and opened again."""
    def opened() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.setblocking(False)
        return s

    held = [opened() for _ in range(count)]
    while not stop.wait(drip):
        for i, s in enumerate(held):
            try:
                if s.recv(1024) == b"":  # closed by the server (or answered: a 4xx ends in a close too)
                    raise ConnectionResetError
            except BlockingIOError:  # still open, nothing to read: drip one more byte
                try:
                    s.send(b"X")
                    continue
                except OSError:
                    pass
            except OSError:
                pass
            s.close()
            tally.add("slowloris closed by the server")
            held[i] = opened()
    for s in held:
        s.close()


def probe(port: int, stop: threading.Event, latencies: list, tally: Tally) -> None:
    """A normal request (``GET /v1/models``: the front door, no engine work) every half second, timed."""
    request = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    while not stop.wait(0.5):
        started = time.perf_counter()
        try:
            answer = exchange(port, request)
        except OSError as exc:
            tally.add("probes unanswered", f"probe: {type(exc).__name__}: {exc}")
            continue
        latencies.append(time.perf_counter() - started)
        if status_of(answer) != 200:
            tally.add("probes unanswered", f"probe: {answer[:200]!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="8")
    parser.add_argument("--seconds", default="15")
    parser.add_argument("--max-tokens", default="16")
    parser.add_argument("--max-batch", default="4")
    parser.add_argument("--disconnect", default="0.3", help="share of requests dropped after 1-3 events")
    parser.add_argument("--poison", default="0.2", help="share of requests that are poisoned")
    parser.add_argument("--slowloris", default="0", metavar="N", help="half-open connections held all along")
    parser.add_argument("--drip", default="2", metavar="SECONDS", help="seconds between their bytes (default 2)")
    parser.add_argument("--request-timeout", default="30", metavar="SECONDS",
                        help="the server's deadline on receiving a request (default 30, serve's)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    from moe_offload import values
    from moe_offload.api import load
    from moe_offload.outputs import check_output, write_atomically
    from moe_offload.server import ServerThread

    clients = values.integer(args.clients, "--clients", low=1, high=1024)
    seconds = values.number(args.seconds, "--seconds", low=0, low_open=True)
    args.max_tokens = values.integer(args.max_tokens, "--max-tokens", low=1)
    max_batch = values.integer(args.max_batch, "--max-batch", low=1)
    args.disconnect = values.number(args.disconnect, "--disconnect", low=0, high=1)
    args.poison = values.number(args.poison, "--poison", low=0, high=1)
    half_open = values.integer(args.slowloris, "--slowloris", low=0, high=10_000)
    drip = values.number(args.drip, "--drip", low=0, low_open=True)
    request_seconds = values.number(args.request_timeout, "--request-timeout", low=0, low_open=True)
    if args.disconnect + args.poison > 1:
        values.refuse("--disconnect", args.disconnect, "plus --poison must be at most 1")
    if args.json:
        check_output(args.json, suffixes=(".json",), what="benchmark result")

    tally = Tally()
    latencies: list[float] = []
    stop = threading.Event()
    with CountingLog() as log, load("tiny", fast_budget="30%", max_batch=max_batch) as engine, \
            ServerThread(engine, "tiny", request_seconds=request_seconds) as server:
        exchange(server.port, http(server.port, "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).encode()))  # warm-up
        memory = {"after warm-up": resident_mib()}
        peak = [memory["after warm-up"]]
        prober = threading.Thread(target=probe, args=(server.port, stop, latencies, tally))
        side = [prober, threading.Thread(target=slowloris, args=(server.port, half_open, drip, stop, tally))] \
            if half_open else []
        if side:  # the probes alone first: what a normal request takes on this machine now
            prober.start()
            while len(latencies) < PROBES_ALONE and prober.is_alive():
                time.sleep(0.1)
        alone = len(latencies)
        started = time.perf_counter()
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=client, args=(server.port, i, deadline, args, tally)) for i in range(clients)]
        for thread in side[1:] + threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            peak.append(resident_mib())
            time.sleep(1)
        stop.set()
        for thread in side:
            thread.join()
        wall = time.perf_counter() - started
        scheduler = engine.scheduler
        idle_by = time.monotonic() + 30
        while sum(scheduler.queued) and time.monotonic() < idle_by:
            time.sleep(0.1)
        running, waiting = scheduler.queued
        if running or waiting:
            tally.add("hangs", f"{running} running and {waiting} waiting 30 s after the clients stopped")
        leaked = scheduler.kv.slots - scheduler.kv.available
        final = exchange(server.port, http(server.port, "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).encode()))
        if status_of(final) != 200:
            tally.add("unanswered", f"the request after the storm: {final[:200]!r}")
        memory["end"] = resident_mib()
        memory["peak"] = max(peak)
    counts = tally.counts
    result = {"clients": clients, "seconds": wall, "max_tokens": args.max_tokens, "max_batch": max_batch,
              **{key: counts.get(key, 0) for key in ("answered", "dropped", "poisoned refused", "unanswered",
                                                     "poisoned answered wrongly", "hangs")},
              "leaked_slots": leaked, "resident_mib": memory, "log_bytes": log.bytes, "log_records": log.records,
              "problems": tally.problems[:20]}
    if half_open:
        before, beside = sorted(latencies[:alone]), sorted(latencies[alone:])
        result["slowloris"] = {
            "half_open": half_open, "drip_seconds": drip, "request_timeout_seconds": request_seconds,
            "closed_by_server": counts.get("slowloris closed by the server", 0), "probes": len(beside),
            "probes_unanswered": counts.get("probes unanswered", 0),
            "probe_median_s": beside[len(beside) // 2] if beside else None,
            "probe_max_s": beside[-1] if beside else None,
            "alone_median_s": before[len(before) // 2] if before else None,
            "alone_max_s": before[-1] if before else None}
    print(f"{clients} clients for {wall:.0f} s (max batch {max_batch}, {args.max_tokens} tokens): "
          f"{result['answered']} answered, {result['dropped']} dropped by their clients, "
          f"{result['poisoned refused']} poisoned refused; {result['unanswered']} unanswered, "
          f"{result['poisoned answered wrongly']} poisoned not refused, {result['hangs']} hangs, "
          f"{leaked} leaked KV slots; resident memory {memory['after warm-up']:.0f} MiB after warm-up, "
          f"{memory['end']:.0f} at the end, peak {memory['peak']:.0f}")
    print(f"server log: {log.bytes:,} bytes in {log.records:,} records")
    failed = result["unanswered"] + result["poisoned answered wrongly"] + result["hangs"] + leaked
    failed += log.bytes >= LOG_LIMIT_BYTES
    if half_open:
        slow = result["slowloris"]
        print(f"slowloris: {half_open} half-open connections held (a byte every {drip:g} s), "
              f"{slow['closed_by_server']} closed by the server's {request_seconds:g} s deadline and opened again; "
              f"{slow['probes']} normal requests beside them, median {slow['probe_median_s'] or 0:.3f} s, "
              f"max {slow['probe_max_s'] or 0:.3f} s, {slow['probes_unanswered']} unanswered (alone before: median "
              f"{slow['alone_median_s'] or 0:.3f} s, max {slow['alone_max_s'] or 0:.3f} s)")
        failed += slow["probes_unanswered"] + (not slow["probes"]) + ((slow["probe_max_s"] or 0) > PROBE_SECONDS)
    if args.json:
        write_atomically(args.json, json.dumps(result, indent=1))
    for problem in tally.problems[:5]:
        print(f"  {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from script import run

    run(main)
