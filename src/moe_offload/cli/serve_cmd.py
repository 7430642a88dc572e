"""`moe-offload serve`: an OpenAI-compatible server with continuous batching (moe_offload/server)."""

from __future__ import annotations

import argparse

from moe_offload.cli.options import add_runtime, apply_threads, plan_from_args
from moe_offload.errors import ConfigError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the model over HTTP with the OpenAI API, continuous batching and /metrics",
        description="An OpenAI-compatible server (/v1/models, /v1/completions, /v1/chat/completions, streaming "
                    "or not; /health; /metrics in the Prometheus format) over the offloaded engine. Requests "
                    "join and leave the running batch at iteration boundaries; one forward pass computes every "
                    "running request's next token, fetching the union of their experts once; a request's "
                    "greedy tokens are those it gets alone. Ctrl-C or SIGTERM: running requests finish (or are "
                    "cancelled after a grace period), the engine closes, exit 0. Needs the 'serve' extra.")
    add_runtime(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", default="8000", help="port (default 8000)")
    parser.add_argument("--max-batch", default="16", metavar="N",
                        help="requests in the running batch at most (default 16); the others wait")
    parser.add_argument("--batch-math", default="exact", choices=("exact", "fast"),
                        help="exact (default, so that an answer does not depend on what else the server runs): "
                             "each request's tokens and logits are the bits it gets alone, its products one row "
                             "at a time; fast: each matrix product once over the whole batch, faster, equal only "
                             "up to rounding (a greedy token may differ where two logits nearly tie)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model ids the server answers to (default: the model's directory name, or tiny); "
                             "responses name the first")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every path but /health (default: no key). "
                             "Also read from MOE_OFFLOAD_API_KEY")
    parser.add_argument("--max-body", default="4MiB", metavar="BYTES",
                        help="largest request body accepted (default 4MiB; larger: 413)")
    parser.add_argument("--request-timeout", default="30", metavar="SECONDS",
                        help="a request must be received whole (headers and body) within this many seconds of its "
                             "first byte, else its connection is closed (default 30)")
    parser.add_argument("--max-connections", default="1024", metavar="N",
                        help="connections at most; past them a request is answered 503 (default 1024)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moe_offload import values
    from moe_offload.models import require_model_stack
    from moe_offload.models.gguf import with_gguf_file

    args.model = with_gguf_file(args.model, args.gguf_file)
    max_batch = values.integer(args.max_batch, "--max-batch", low=1, high=4096)
    plan = plan_from_args(args, max_batch=max_batch, batch_math=args.batch_math)  # before the model stack, as generate
    require_model_stack("serve", serving=True)
    from moe_offload.runtime.engine import OffloadEngine
    from moe_offload.server import model_name, serve

    import os

    port = values.integer(args.port, "--port", low=1, high=65535)
    max_body = values.parse_bytes(args.max_body, "--max-body")
    if max_body < 1024:
        raise ConfigError(f"--max-body {args.max_body!r}: at least 1KiB (a request body is JSON)")
    names = [values.text(n, "--served-model-name") for n in args.served_model_name or [model_name(args.model)]]
    api_key = args.api_key if args.api_key is not None else os.environ.get("MOE_OFFLOAD_API_KEY")
    if api_key is not None and (not api_key.strip() or not api_key.isascii() or not api_key.isprintable()):
        raise ConfigError("--api-key: printable ASCII characters, not empty")
    request_seconds = values.number(args.request_timeout, "--request-timeout", low=0, low_open=True)
    max_connections = values.integer(args.max_connections, "--max-connections", low=1)
    host = values.text(args.host, "--host")
    if args.device is not None:
        values.device(args.device)
    apply_threads(args)
    _check_listen(host, port)
    engine = OffloadEngine(plan)
    print(f"moe-offload: serving {names[0]} on http://{host}:{port} (OpenAI API at /v1, metrics at /metrics); "
          "Ctrl-C to stop", flush=True)
    serve(engine, names, host, port, api_key=api_key, max_body_bytes=max_body, request_seconds=request_seconds,
          max_connections=max_connections)
    return 0


def _check_listen(host: str, port: int) -> None:
    """Refuse an address this machine cannot listen on (in use, not its own) before the model loads."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
