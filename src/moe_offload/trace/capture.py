"""`moe-offload trace capture`: send prompts to a running server that returns routed experts; keep the trace.

The server is any OpenAI-compatible one that returns the routing with its answers: vLLM started with
``--enable-return-routed-experts`` (it returns routing unasked), SGLang started with the same flag (asked
with ``"return_routed_experts": true``), or ``moe-offload serve``, which speaks SGLang's convention
(server/routed_experts.py). Each prompt is one ``/v1/completions`` request; at most ``concurrency`` are in
flight at once, so the server batches them as it would its users' traffic. The time each request was sent
and answered is recorded (one clock): requests enter the trace in the order they were sent, and one that
was sent after another was answered starts after it (importers/engines.py, ``schedule``). ``moe-offload
serve`` also says which forward passes each request ran in (``moe_offload.passes``): the trace's iterations
are then the server's batches exactly.

The responses are read by the importers' own code (``vllm_rows``, ``sglang_rows``), so a capture and an
import of the same responses give the same trace.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit
from typing import Callable

from moe_offload.errors import ConfigError
from moe_offload.text.prompts import Prompt
from moe_offload.trace.bounded_http import Limits, request_json
from moe_offload.trace.format import Trace
from moe_offload.trace.importers.engine_trace import Routed, build_trace
from moe_offload.trace.importers.engines import CAPTURE_ENGINES, sglang_rows, vllm_rows
from moe_offload.trace.importers.common import quote
from moe_offload.trace.importers.model_config import ModelShape
from moe_offload.trace.importers.responses import ResponseError
from moe_offload.values import integer, number


def capture(url: str, prompts: list[Prompt], *, engine: str = "moe-offload", model: str | None = None,
            max_tokens: int = 32, temperature: float = 0.0, concurrency: int = 8,
            model_config: ModelShape | None = None, num_experts: int | None = None, expert_bytes: int | None = None,
            limits: Limits = Limits(), on_answer: Callable[[], None] | None = None) -> Trace:
    """Send every prompt to the server at ``url`` and return the trace of their routing. ``on_answer`` is
    called (from a worker thread) after each answer. A request the server refuses, an answer without
    routing, or one that breaks ``limits`` (trace/bounded_http.py: deadlines and a size cap) ends the capture
    with a one-line error naming the prompt."""
    if engine not in CAPTURE_ENGINES:
        raise ConfigError(f"engine {engine!r} is not one of {', '.join(CAPTURE_ENGINES)}")
    concurrency = integer(concurrency, "--concurrency", low=1, high=1024)
    max_tokens = integer(max_tokens, "--max-tokens", low=1)
    temperature = number(temperature, "--temperature", low=0, high=2)
    if engine != "vllm" and model_config is None:
        raise ConfigError(f"{engine} returns routing as flat ids: give the model's config (--model-config "
                          "config.json, or 'tiny' for the bundled model) for its layers and top-k")
    base = server_url(url)
    model = model or served_model(base, limits)
    extra = {} if engine == "vllm" else {"return_routed_experts": True}
    clock = time.perf_counter

    def one(index: int, prompt: Prompt) -> list[Routed]:
        body = {"model": model, "prompt": prompt.text, "max_tokens": max_tokens, "temperature": temperature, **extra}
        sent = clock()
        response = _post(f"{base}/v1/completions", body, limits, f"prompt {index} ({prompt.source})")
        answered = clock()
        if engine == "vllm":
            rows = vllm_rows(response, base, index, shape=model_config)
        else:
            rows = sglang_rows(response, base, index, shape=model_config)
        if on_answer is not None:
            on_answer()
        counters = response.get("moe_offload") if engine == "moe-offload" else None
        if counters is not None and not isinstance(counters, dict):
            raise ResponseError(base, index, f"moe_offload must be an object, not {quote(counters)}")
        passes = (counters or {}).get("passes")
        if passes is not None and not (isinstance(passes, list)
                                       and all(isinstance(p, int) and not isinstance(p, bool) for p in passes)):
            raise ResponseError(base, index, f"moe_offload.passes must be a list of pass numbers, not {quote(passes)}")
        return [Routed(response.get("model"), base, index, choice, sent, answered, passes) for choice in rows]

    with ThreadPoolExecutor(concurrency, thread_name_prefix="capture") as pool:
        futures = [pool.submit(one, index, prompt) for index, prompt in enumerate(prompts)]
        try:
            routed = [entry for future in futures for entry in future.result()]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return build_trace("vllm" if engine == "vllm" else "sglang", routed, [base], num_experts=num_experts,
                       model=model, expert_bytes=expert_bytes, model_config=model_config,
                       source=f"trace capture of {len(prompts)} prompts from {base} ({engine}, max_tokens "
                              f"{max_tokens}, temperature {temperature:g}, concurrency {concurrency})",
                       extra={"importer": f"capture ({engine})", "files": []})


def server_url(url: str) -> str:
    """``--url`` checked: an http(s) address with a host. A path is the server's own prefix; a last ``/v1`` is
    dropped, as OpenAI clients take their ``base_url`` with it (``http://host:8000/v1``) and append
    ``/completions``, where this appends ``/v1/completions``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url {url!r}: give the server's http:// or https:// address, e.g. http://127.0.0.1:8000")
    if parts.query or parts.fragment:
        raise ConfigError(f"--url {url!r}: give the server's address without a query (?...) or fragment (#...)")
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"--url {url!r}: the port is not a number from 0 to 65535") from None
    base = url.rstrip("/")
    return base[:-len("/v1")] if base.endswith("/v1") else base


def served_model(base: str, limits: Limits = Limits()) -> str:
    """The first model the server lists at /v1/models; ConfigError when it cannot be reached or lists none."""
    url = f"{base}/v1/models"
    listing = request_json(url, None, limits, "the model list")
    models = listing.get("data") if isinstance(listing, dict) else None
    first = models[0] if isinstance(models, list) and models else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"]:
        raise ConfigError(f"{url}: lists no model (expected {{\"data\": [{{\"id\": NAME}}, ...]}}, got "
                          f"{quote(listing)}); give --model NAME")
    return first["id"]


def _post(url: str, body: dict, limits: Limits, what: str) -> dict:
    answer = request_json(url, body, limits, what)
    if not isinstance(answer, dict):
        raise ConfigError(f"{url}: {what}: the answer is not a JSON object: {quote(answer)}")
    return answer
