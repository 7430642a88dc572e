"""Importers of routing traces published by research projects, one per public format below.

``topk-jsonl``
    One JSON object per line, ``{"tok": n, "layers": [[K expert ids] x L]}``: one decode token per line
    (sqliteai/warp's OLMoE trace). The file does not say how many experts a layer has, so the caller
    must give J. When every expert list is sorted by id, the router's rank order is lost; the importer
    then sets ``meta.extra["experts_sorted"]`` (see docs/trace-format.md). Nor does it say where a request
    ends or which lines were a prompt: a file is one request of decode tokens unless the caller says how the
    lines were recorded, ``request_rows`` lines a request one after the other and the first ``prompt_rows``
    of each its prompt (one prefill pass), as a recording's own notes give it (the SGLang Granite trace of
    ``openfabric-systems/simllm``: 8 requests of an 8-token prompt and 19 decode steps, 27 lines each).

``routes-json``
    One JSON document per request with ``meta``, ``prompt_tokens``, ``generated_tokens`` and ``routes``,
    one route per token: ``token_pos``, ``token_id``, ``phase`` (``prefill``/``decode``) and ``layers``
    = ``{"0": {"experts": [...], "weights": [...]}, ...}`` (jinlong-huo/moe_ocs_learning's Qwen1.5-MoE
    traces). Router weights are kept (float16). The prompt's tokens form one iteration (one prefill
    forward pass); every decode token is an iteration of its own.

Several files become several requests (request id = file order), one after the other.
Malformed input raises TraceError naming the file and the line (``topk-jsonl``, 1-based; invalid JSON
in either format) or the route (``routes-json``, the 0-based index into ``routes``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.inputs import parse_json, read_text
from moe_offload.trace.format import DECODE, PHASES, PREFILL, Trace
from moe_offload.trace.importers.common import (_are_ids, _as_paths, _assemble, _check_expert_ids, _check_requests_ids,
                                                _check_num_experts, _failer, _is_int, _is_number, _Request,
                                                quote)
from moe_offload.values import integer

FLOAT16_MAX = float(np.finfo(np.float16).max)


# ---------------------------------------------------------------------------------------------- topk-jsonl

def import_topk_jsonl(paths, *, num_experts: int | None = None, model: str | None = None,
                      expert_bytes: int | None = None, hidden_size: int | None = None, source: str | None = None,
                      license: str | None = None, extra: dict | None = None, request_rows: int | None = None,
                      prompt_rows: int = 0) -> Trace:
    """Import ``{"tok": n, "layers": [[K ids] x L]}`` lines: request = file order, position = ``tok``,
    phase decode, one iteration per line. ``num_experts`` (J) is required: the format does not record it.
    ``request_rows``: each file is requests of that many lines, one after the other (position: the line's
    place in its request); ``prompt_rows``: the first lines of each request are its prompt, one prefill
    iteration."""
    paths = _as_paths(paths)
    _check_num_experts(num_experts)
    if request_rows is not None:
        request_rows = integer(request_rows, "--request-rows", low=1)
    prompt_rows = integer(prompt_rows, "--prompt-rows", low=0)
    if prompt_rows >= (request_rows or math.inf):
        raise ConfigError(f"--prompt-rows {prompt_rows} leaves no decode line in a request of --request-rows "
                          f"{request_rows}")
    files = [_read_topk_jsonl(paths[0])]
    for path in paths[1:]:
        files.append(_read_topk_jsonl(path, shape=files[0].experts.shape[1:], shape_origin=paths[0].name))
    requests = [request for read in files for request in _cut_requests(read, request_rows, prompt_rows)]
    shape = requests[0].experts.shape[1:]
    _check_requests_ids(requests, num_experts, paths, "topk-jsonl traces do not say how many experts each layer "
                        "has; give it (num_experts, or --experts J on the command line)")

    # Sorted lists of K > 1 experts everywhere: the file kept the set of experts, not the router's ranking.
    every_layer_sorted = all(bool((np.diff(r.experts, axis=2) > 0).all()) for r in requests)
    details = {"importer": "topk-jsonl", "files": [p.name for p in paths],
               "experts_sorted": every_layer_sorted and shape[1] > 1}
    return _assemble(requests, paths, "topk-jsonl", num_experts=num_experts, model=model or "unknown",
                     expert_bytes=expert_bytes, hidden_size=hidden_size, source=source, license=license,
                     extra={**details, **(extra or {})})


def _read_topk_jsonl(path: Path, shape: tuple[int, int] | None = None, shape_origin: str = "") -> _Request:
    """Parse and check one file. ``shape`` = (L, K) that every row must have, taken from the first line of
    the file when not given (``shape_origin`` says where it came from, for messages)."""
    # Split on "\n" only (not str.splitlines, which also splits on other separators) so that line numbers
    # are the ones an editor shows. A complete file ends with "\n", leaving an empty last piece.
    lines = read_text(path, "trace source", TraceError).split("\n")
    rows, positions, numbers = [], [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = parse_json(line, path, "routing line", TraceError, row=number, unit="line")
        fail = _failer(path, number, "line")
        if not isinstance(record, dict):
            fail(f"expected a JSON object, found {type(record).__name__}")
        missing = [key for key in ("tok", "layers") if key not in record]
        if missing:
            fail(f"missing key(s) {', '.join(map(repr, missing))}")
        token, layers = record["tok"], record["layers"]
        if not _is_int(token) or token < 0:
            fail(f"'tok' must be a non-negative integer, not {quote(token)}")
        if not isinstance(layers, list) or not layers:
            fail("'layers' must be a non-empty list of per-layer expert lists")
        if shape is None:
            first_layer = layers[0]
            if not isinstance(first_layer, list) or not first_layer:
                fail("layer 0 must be a non-empty list of expert ids")
            shape, shape_origin = (len(layers), len(first_layer)), f"line {number}"
        num_layers, top_k = shape
        if len(layers) != num_layers:
            fail(f"{len(layers)} layers, but {shape_origin} has {num_layers}")
        for layer, ids in enumerate(layers):
            if not isinstance(ids, list):
                fail(f"layer {layer} must be a list of expert ids, not {quote(ids)}")
            if len(ids) != top_k:
                fail(f"layer {layer} lists {len(ids)} experts, but {shape_origin} lists {top_k} per layer (top-k)")
            if not _are_ids(ids):
                fail(f"layer {layer} has an expert id that is not an integer: {quote(ids)}")
        rows.append(layers)
        positions.append(token)
        numbers.append(number)
    if not rows:
        raise TraceError(path, "no routing rows (the file is empty)")
    return _Request(path=path, experts=np.asarray(rows, dtype=np.int64), position=positions,
                    phase=[DECODE] * len(rows), iteration=list(range(len(rows))), locator=numbers, unit="line")


def _cut_requests(read: _Request, request_rows: int | None, prompt_rows: int) -> list[_Request]:
    """A file's lines as requests of ``request_rows`` lines (None: the file is one), the first ``prompt_rows``
    of each its prompt."""
    lines = len(read.position)
    rows = request_rows or lines
    if lines % rows:
        raise TraceError(read.path, f"{lines} routing lines are not whole requests of --request-rows {rows}")
    if prompt_rows >= rows:
        raise TraceError(read.path, f"--prompt-rows {prompt_rows} leaves no decode line in its {rows} lines")
    local = [0 if i < prompt_rows else i - prompt_rows + (1 if prompt_rows else 0) for i in range(rows)]
    phase = [PREFILL] * prompt_rows + [DECODE] * (rows - prompt_rows)
    out = []
    for start in range(0, lines, rows):
        part = slice(start, start + rows)
        out.append(_Request(path=read.path, experts=read.experts[part],
                            position=list(range(rows)) if request_rows else read.position,
                            phase=phase, iteration=local, locator=read.locator[part], unit=read.unit))
    return out


# --------------------------------------------------------------------------------------------- routes-json

def import_routes_json(paths, *, num_experts: int | None = None, model: str | None = None,
                       expert_bytes: int | None = None, hidden_size: int | None = None, source: str | None = None,
                       license: str | None = None, extra: dict | None = None) -> Trace:
    """Import one routes-json document per request, keeping router weights. J comes from ``num_experts``
    or from the files' ``meta.num_experts``; when both are given they must agree."""
    paths = _as_paths(paths)
    _check_num_experts(num_experts)
    documents = [_load_routes_document(path) for path in paths]

    file_meta = documents[0]["meta"]
    if num_experts is None:
        num_experts = file_meta.get("num_experts")
        if num_experts is None:
            raise ConfigError(f"{paths[0]}: the routes-json meta does not give num_experts; give it (num_experts, or "
                              f"--experts J on the command line)")
    model = model or file_meta.get("model_id") or "unknown"

    layer_keys: list[str] | None = None
    top_k: int | None = None
    requests = []
    for path, document in zip(paths, documents):
        meta = document["meta"]
        if meta.get("num_experts", num_experts) != num_experts:
            raise TraceError(path, f"meta says num_experts={meta['num_experts']}, but the trace has "
                                   f"{num_experts} experts per layer (from the first file or the caller)")
        request, layer_keys, top_k = _read_routes(path, document, layer_keys, top_k)
        _check_expert_ids(request, num_experts)
        requests.append(request)

    details = {"importer": "routes-json", "experts_sorted": False,  # each layer lists its experts by weight
               "requests": [{"file": p.name, "meta": d["meta"]} for p, d in zip(paths, documents)]}
    if layer_keys != [str(i) for i in range(len(layer_keys))]:
        details["layer_ids"] = [int(key) for key in layer_keys]  # the model's layer numbers, e.g. MoE layers only
    return _assemble(requests, paths, "routes-json", num_experts=num_experts, model=model,
                     expert_bytes=expert_bytes, hidden_size=hidden_size, source=source, license=license,
                     extra={**details, **(extra or {})})


def _load_routes_document(path: Path) -> dict:
    document = parse_json(read_text(path, "trace source", TraceError), path, "routes document", TraceError)
    if not isinstance(document, dict):
        raise TraceError(path, f"expected a JSON object with 'routes', found {type(document).__name__}")
    if "routes" not in document:
        raise TraceError(path, "missing key 'routes'")
    if not isinstance(document["routes"], list) or not document["routes"]:
        raise TraceError(path, "'routes' must be a non-empty list")
    meta = document.setdefault("meta", {})
    if not isinstance(meta, dict):
        raise TraceError(path, f"'meta' must be an object, not {type(meta).__name__}")
    for name in ("num_experts", "top_k", "num_moe_layers"):
        if name in meta and (not _is_int(meta[name]) or meta[name] < 1):
            raise TraceError(path, f"meta {name} must be a positive integer, not {quote(meta[name])}")
    return document


def _read_routes(path: Path, document: dict, layer_keys: list[str] | None,
                 top_k: int | None) -> tuple[_Request, list[str], int]:
    """Parse and check every route of one document. ``layer_keys`` and ``top_k`` come from earlier files
    (None for the first): every route of every file must have the same layers and the same K."""
    routes, meta = document["routes"], document["meta"]
    if "top_k" in meta:
        if top_k is not None and meta["top_k"] != top_k:
            raise TraceError(path, f"meta says top_k={meta['top_k']}, but earlier files select {top_k} experts")
        top_k = meta["top_k"]
    experts, weights, positions, phases, iterations = [], [], [], [], []
    decode_seen = 0
    for index, route in enumerate(routes):
        fail = _failer(path, index, "route")
        if not isinstance(route, dict):
            fail(f"expected an object, found {type(route).__name__}")
        missing = [key for key in ("token_pos", "phase", "layers") if key not in route]
        if missing:
            fail(f"missing key(s) {', '.join(map(repr, missing))}")
        position, phase, layers = route["token_pos"], route["phase"], route["layers"]
        if not _is_int(position) or position < 0:
            fail(f"'token_pos' must be a non-negative integer, not {quote(position)}")
        if phase not in PHASES:
            fail(f"'phase' must be 'prefill' or 'decode', not {quote(phase)}")
        if phase == "prefill" and decode_seen:
            fail("a prefill route after a decode route: the prompt's tokens must come first")
        if not isinstance(layers, dict) or not layers:
            fail("'layers' must be a non-empty object {layer: {experts, weights}}")
        if layer_keys is None:
            if not all(key.isascii() and key.isdigit() for key in layers):
                fail(f"layer keys must be layer numbers, found {quote(sorted(layers))}")
            layer_keys = sorted(layers, key=int)
        if set(layers) != set(layer_keys):
            fail(f"{len(layers)} layers {sorted(layers)} differ from the {len(layer_keys)} layers {layer_keys} "
                 f"of the first route read")
        row_experts, row_weights = [], []
        for key in layer_keys:
            entry = layers[key]
            if not isinstance(entry, dict):
                fail(f"layer {key} must be an object with 'experts' and 'weights'")
            missing = [name for name in ("experts", "weights") if name not in entry]
            if missing:
                fail(f"layer {key} lacks {', '.join(map(repr, missing))}")
            ids, values = entry["experts"], entry["weights"]
            if not isinstance(ids, list) or not ids or not _are_ids(ids):
                fail(f"layer {key}: 'experts' must be a non-empty list of integer ids, not {quote(ids)}")
            if top_k is None:
                top_k = len(ids)
            if len(ids) != top_k:
                fail(f"layer {key} lists {len(ids)} experts, but other layers (or meta top_k) have {top_k}")
            if not isinstance(values, list) or len(values) != len(ids):
                count = len(values) if isinstance(values, list) else values
                fail(f"layer {key} has {count} weights for {len(ids)} experts")
            for value in values:
                if not _is_number(value) or not math.isfinite(value) or not 0 <= value <= FLOAT16_MAX:
                    fail(f"layer {key} has weight {quote(value)}: router weights must be finite numbers in "
                         f"[0, {FLOAT16_MAX:g}] (float16)")
            row_experts.append(ids)
            row_weights.append(values)
        experts.append(row_experts)
        weights.append(row_weights)
        positions.append(position)
        if phase == "prefill":
            phases.append(PREFILL)
            iterations.append(0)
        else:
            phases.append(DECODE)
            decode_seen += 1
            # The prompt, if any, is iteration 0; decode tokens follow it one iteration each.
            has_prompt = phases[0] == PREFILL
            iterations.append(decode_seen if has_prompt else decode_seen - 1)
    if "num_moe_layers" in meta and len(layer_keys) != meta["num_moe_layers"]:
        raise TraceError(path, f"routes have {len(layer_keys)} layers, but meta says "
                               f"num_moe_layers={meta['num_moe_layers']}")
    _check_token_counts(path, document, phases)
    request = _Request(path=path, experts=np.asarray(experts, dtype=np.int64), position=positions, phase=phases,
                       iteration=iterations, locator=list(range(len(routes))), unit="route",
                       weights=np.asarray(weights, dtype=np.float64))
    return request, layer_keys, top_k


def _check_token_counts(path: Path, document: dict, phases: list[int]) -> None:
    """The routes must cover the prompt and the generated tokens the file lists, or numbers would be
    silently missing from the trace."""
    for key, phase in (("prompt_tokens", PREFILL), ("generated_tokens", DECODE)):
        tokens = document.get(key)
        if tokens is None:
            continue
        if not isinstance(tokens, list):
            raise TraceError(path, f"'{key}' must be a list of token ids")
        routed = phases.count(phase)
        if routed != len(tokens):
            raise TraceError(path, f"{routed} {PHASES[phase]} routes, but '{key}' lists {len(tokens)} tokens")
