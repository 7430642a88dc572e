"""Importers of the routing logs of inference and training tools, and of a documented generic CSV.

``csv`` (the generic format, for any tool)
    A header ``request,token,layer,expert`` or ``request,token,layer,expert,weight``, then one row per
    expert a token selected in a layer, in the router's rank order within (request, token, layer):
    ``request`` and ``token`` are non-negative integers (a request id and the token's position in it),
    ``layer`` the layer number (any increasing numbering; every token lists the same layers and the same
    number of experts), ``expert`` the id, ``weight`` the router weight (finite, 0 to 65504). Each token is a
    decode step of its own iteration; requests run one after another, in order of their ids.

``llamacpp`` (llama.cpp's ``llama-moe-trace``, ggml-org/llama.cpp PR #28544, ``MOE_TRACE_OUT=trace.csv``)
    One ``layer,expert`` row per routed activation (an optional ``layer,expert`` header). The tool copies
    each MoE layer's ``ffn_moe_topk`` tensor ([top_k, n_tokens] int32) row by row after the layer runs, so
    the rows come a layer at a time, ubatch by ubatch: a run of one layer's rows is ``n_tokens * top_k``
    ids, token by token, and the layers restart with each ubatch. The file says neither top-k nor where a
    ubatch ends, so K (and J) come from the model's config (``--model-config``), and a ubatch ends where the
    layer number stops increasing. The ubatches before the first one-token ubatch are the prompt (prefill);
    each one-token ubatch after them is a decode step. The variant with a header
    ``phase,token,layer,rank,expert`` (a fork of the PR that records positions and phases) is read from
    its columns instead.

``megatron`` (Megatron-LM's ``RouterTracer``, NVIDIA/Megatron-LM PR #5220, ``router_trace_rank{R}.jsonl``)
    One JSON object per line and (step, layer, rank): ``step``, ``block`` (``decoder``, or ``mtp`` for
    multi-token-prediction heads, which are counted and left out), ``layer`` (Megatron's layer number),
    ``rank``, ``num_tokens``, ``topk`` and ``top_indices`` ([num_tokens][topk]). A step is one forward pass
    of a batch whose tokens carry no request ids, so each (step, rank) becomes one request whose tokens are
    one prefill pass, in step order. J comes from ``--experts`` or ``--model-config``.

Every row or line that breaks its format stops the import with one line naming the file, the line and the
problem.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.inputs import parse_json, read_text
from moe_offload.trace.format import DECODE, PREFILL, Trace
from moe_offload.trace.importers.common import (_as_paths, _assemble, _check_num_experts, _check_requests_ids,
                                                _is_int, _Request, quote)
from moe_offload.trace.importers.model_config import ModelShape

FLOAT16_MAX = 65504.0
CSV_HEADERS = (["request", "token", "layer", "expert"], ["request", "token", "layer", "expert", "weight"])
LLAMACPP_FORK_HEADER = ["phase", "token", "layer", "rank", "expert"]


def _shape_options(num_experts, expert_bytes, hidden_size, model_config: ModelShape | None):
    _check_num_experts(num_experts)
    if model_config is not None:
        return (num_experts or model_config.num_experts, expert_bytes or model_config.expert_bytes,
                hidden_size or model_config.hidden_size)
    return num_experts, expert_bytes, hidden_size


def _rows(path: Path) -> list[list[str]]:
    text = read_text(path, "routing CSV", TraceError)
    try:
        return list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise TraceError(path, f"not a readable CSV ({quote(str(exc))})") from None


def _int(text: str, path: Path, line: int, column: str, low: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, f"{column} {quote(text)} is not an integer", row=line, unit="line") from None
    if not low <= value < 2**31:
        raise TraceError(path, f"{column} {value} is outside {low}..{2**31 - 1}", row=line, unit="line")
    return value


def _finish(requests, paths, format_name, num_experts, model, expert_bytes, hidden_size, source, license, extra,
            details, how, starts=None) -> Trace:
    shape = requests[0].experts.shape[1:]
    for request in requests:
        if request.experts.shape[1:] != shape:
            raise TraceError(request.path, f"{list(request.experts.shape[1:])} layers x top-k, but the first request "
                                           f"has {list(shape)}", row=request.locator[0], unit=request.unit)
    _check_requests_ids(requests, num_experts, paths, how)
    return _assemble(requests, paths, format_name, num_experts=num_experts, model=model or "unknown",
                     expert_bytes=expert_bytes, hidden_size=hidden_size, source=source, license=license,
                     extra={"importer": format_name, "files": [p.name for p in paths], **details, **(extra or {})},
                     starts=starts)


# ----------------------------------------------------------------------------------------------- generic CSV

def import_csv(paths, *, num_experts: int | None = None, model: str | None = None, expert_bytes: int | None = None,
               hidden_size: int | None = None, source: str | None = None, license: str | None = None,
               extra: dict | None = None, model_config: ModelShape | None = None) -> Trace:
    """Import the generic ``request,token,layer,expert[,weight]`` CSV (one or more files, concatenated)."""
    paths = _as_paths(paths)
    num_experts, expert_bytes, hidden_size = _shape_options(num_experts, expert_bytes, hidden_size, model_config)
    tokens: dict[tuple[int, int], dict[int, list]] = defaultdict(lambda: defaultdict(list))
    where: dict[tuple[int, int], tuple[Path, int]] = {}
    with_weights = None
    for path in paths:
        rows = _rows(path)
        if not rows or [c.strip() for c in rows[0]] not in CSV_HEADERS:
            raise TraceError(path, "the first line must be the header request,token,layer,expert (or "
                                   f"...,weight), not {quote(','.join(rows[0]) if rows else '')}", row=1, unit="line")
        has_weight = len(rows[0]) == 5
        if with_weights is not None and has_weight != with_weights:
            raise TraceError(path, "some files have a weight column and others do not")
        with_weights = has_weight
        for line, row in enumerate(rows[1:], start=2):
            if not row:
                continue
            if len(row) != len(rows[0]):
                raise TraceError(path, f"{len(row)} columns, the header has {len(rows[0])}", row=line, unit="line")
            request, token = _int(row[0], path, line, "request"), _int(row[1], path, line, "token")
            layer, expert = _int(row[2], path, line, "layer"), _int(row[3], path, line, "expert")
            weight = None
            if has_weight:
                try:
                    weight = float(row[4])
                except ValueError:
                    weight = math.nan
                if not (math.isfinite(weight) and 0 <= weight <= FLOAT16_MAX):
                    raise TraceError(path, f"weight {quote(row[4])} is not a finite number in [0, 65504]", row=line,
                                     unit="line")
            tokens[(request, token)][layer].append((expert, weight))
            where.setdefault((request, token), (path, line))
    if not tokens:
        raise TraceError(paths[0], "no routing rows (only a header)")
    layers = sorted(next(iter(tokens.values())))
    top_k = len(next(iter(tokens.values()))[layers[0]])
    by_request: dict[int, list] = defaultdict(list)
    for (request, token), chosen in sorted(tokens.items()):
        path, line = where[(request, token)]
        if sorted(chosen) != layers:
            raise TraceError(path, f"request {request} token {token} lists layers {quote(sorted(chosen))}, the first "
                                   f"token {quote(layers)}", row=line, unit="line")
        for layer in layers:
            if len(chosen[layer]) != top_k:
                raise TraceError(path, f"request {request} token {token} layer {layer} lists {len(chosen[layer])} "
                                       f"experts, the first token {top_k} (top-k)", row=line, unit="line")
        by_request[request].append((token, chosen, path, line))
    requests = []
    for request, entries in sorted(by_request.items()):
        experts = np.asarray([[[e for e, _ in chosen[layer]] for layer in layers] for _, chosen, _, _ in entries],
                             dtype=np.int64)
        weights = (np.asarray([[[w for _, w in chosen[layer]] for layer in layers] for _, chosen, _, _ in entries])
                   if with_weights else None)
        requests.append(_Request(path=entries[0][2], experts=experts, position=[t for t, *_ in entries],
                                 phase=[DECODE] * len(entries), iteration=list(range(len(entries))),
                                 locator=[line for *_, line in entries], unit="line", weights=weights))
    details = {"experts_sorted": False, **({"layer_ids": layers} if layers != list(range(len(layers))) else {})}
    return _finish(requests, paths, "csv", num_experts, model, expert_bytes, hidden_size, source, license, extra,
                   details, "the generic CSV does not say how many experts each layer has; give --experts J or "
                         "--model-config config.json")


# ------------------------------------------------------------------------------------------------- llama.cpp

def import_llamacpp(paths, *, num_experts: int | None = None, model: str | None = None,
                    expert_bytes: int | None = None, hidden_size: int | None = None, source: str | None = None,
                    license: str | None = None, extra: dict | None = None,
                    model_config: ModelShape | None = None) -> Trace:
    """Import ``llama-moe-trace`` CSVs, one request (one sequence) per file."""
    paths = _as_paths(paths)
    num_experts, expert_bytes, hidden_size = _shape_options(num_experts, expert_bytes, hidden_size, model_config)
    requests = []
    for path in paths:
        rows = _rows(path)
        header = [c.strip() for c in rows[0]] if rows else []
        if header == LLAMACPP_FORK_HEADER:
            requests.append(_llamacpp_fork(path, rows))
        else:
            if model_config is None:
                raise ConfigError(f"{path}: llama-moe-trace's layer,expert rows do not say top-k or where a ubatch "
                                  "ends: give the model's config (--model-config config.json)")
            requests.append(_llamacpp_rows(path, rows[1:] if header == ["layer", "expert"] else rows,
                                           1 + (header == ["layer", "expert"]), model_config))
    return _finish(requests, paths, "llamacpp", num_experts, model, expert_bytes, hidden_size, source, license,
                   extra, {"experts_sorted": False}, "llama-moe-trace does not say how many experts each layer has; "
                                                     "give --experts J or --model-config config.json")


def _llamacpp_rows(path: Path, rows: list[list[str]], first_line: int, shape: ModelShape) -> _Request:
    K = shape.top_k
    pairs, lines = [], []
    for line, row in enumerate(rows, start=first_line):
        if not row:
            continue
        if len(row) != 2:
            raise TraceError(path, f"{len(row)} columns: a llama-moe-trace row is layer,expert", row=line, unit="line")
        pairs.append((_int(row[0], path, line, "layer"), _int(row[1], path, line, "expert")))
        lines.append(line)
    if not pairs:
        raise TraceError(path, "no routing rows (the file is empty)")
    # runs of one layer's rows, then ubatches: runs whose layer numbers increase
    runs, begin = [], 0
    for i in range(1, len(pairs) + 1):
        if i == len(pairs) or pairs[i][0] != pairs[begin][0]:
            runs.append((pairs[begin][0], begin, i))
            begin = i
    ubatches, current = [], []
    for run in runs:
        if current and run[0] <= current[-1][0]:
            ubatches.append(current)
            current = []
        current.append(run)
    ubatches.append(current)
    layers = [layer for layer, _, _ in ubatches[0]]
    if layers != list(shape.moe_layers) and layers != list(range(shape.num_layers)):
        raise TraceError(path, f"the first ubatch routes layers {quote(layers)}, but the model config's MoE layers are "
                               f"{quote(list(shape.moe_layers))}", row=lines[0], unit="line")
    experts, phases, positions, iterations, locators = [], [], [], [], []
    decoding = False
    for number, ubatch in enumerate(ubatches):
        line = lines[ubatch[0][1]]
        if [layer for layer, _, _ in ubatch] != layers:
            raise TraceError(path, f"ubatch {number} routes layers {quote([l for l, _, _ in ubatch])}, the first "
                                   f"{quote(layers)}: a ubatch routes every MoE layer once", row=line, unit="line")
        length = ubatch[0][2] - ubatch[0][1]
        if length % K or any(stop - start != length for _, start, stop in ubatch):
            raise TraceError(path, f"ubatch {number}: its layers route {[stop - start for _, start, stop in ubatch]} "
                                   f"ids, not one equal whole number of tokens of top-{K}", row=line, unit="line")
        n_tokens = length // K
        block = np.asarray([[pairs[start + t * K + k][1] for k in range(K)] for _, start, _ in ubatch
                            for t in range(n_tokens)], dtype=np.int64).reshape(len(layers), n_tokens, K)
        decoding = decoding or (n_tokens == 1 and number > 0)
        for t in range(n_tokens):
            experts.append(block[:, t, :])
            phases.append(DECODE if decoding else PREFILL)
            positions.append(len(positions))
            iterations.append(number)
            locators.append(lines[ubatch[0][1] + t * K])
    return _Request(path=path, experts=np.asarray(experts), position=positions, phase=phases, iteration=iterations,
                    locator=locators, unit="line")


def _llamacpp_fork(path: Path, rows: list[list[str]]) -> _Request:
    tokens: dict[int, dict] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != 5:
            raise TraceError(path, f"{len(row)} columns, the header has 5", row=line, unit="line")
        phase = row[0].strip()
        if phase not in ("prefill", "decode"):
            raise TraceError(path, f"phase {quote(phase)} is neither prefill nor decode", row=line, unit="line")
        token, layer = _int(row[1], path, line, "token"), _int(row[2], path, line, "layer")
        rank, expert = _int(row[3], path, line, "rank"), _int(row[4], path, line, "expert")
        entry = tokens.setdefault(token, {"phase": phase, "layers": defaultdict(dict), "line": line})
        if entry["phase"] != phase or rank in entry["layers"][layer]:
            raise TraceError(path, f"token {token} layer {layer} rank {rank} repeats or changes phase", row=line,
                             unit="line")
        entry["layers"][layer][rank] = expert
    if not tokens:
        raise TraceError(path, "no routing rows (only a header)")
    first = tokens[min(tokens)]
    layers = sorted(first["layers"])
    top_k = len(first["layers"][layers[0]])
    experts, phases, iterations = [], [], []
    for token in sorted(tokens):
        entry = tokens[token]
        chosen = entry["layers"]
        if sorted(chosen) != layers or any(sorted(chosen[layer]) != list(range(top_k)) for layer in layers):
            raise TraceError(path, f"token {token} does not route ranks 0..{top_k - 1} in each of layers "
                                   f"{quote(layers)}", row=entry["line"], unit="line")
        experts.append([[chosen[layer][rank] for rank in range(top_k)] for layer in layers])
        prefill = entry["phase"] == "prefill"
        if prefill and phases and phases[-1] == DECODE:
            raise TraceError(path, f"token {token}: a prefill token after a decode token", row=entry["line"],
                             unit="line")
        phases.append(PREFILL if prefill else DECODE)
        iterations.append(0 if prefill else (iterations[-1] + 1 if iterations else 0))
    return _Request(path=path, experts=np.asarray(experts, dtype=np.int64), position=sorted(tokens), phase=phases,
                    iteration=iterations, locator=[tokens[t]["line"] for t in sorted(tokens)], unit="line")


# -------------------------------------------------------------------------------------------------- Megatron

def import_megatron(paths, *, num_experts: int | None = None, model: str | None = None,
                    expert_bytes: int | None = None, hidden_size: int | None = None, source: str | None = None,
                    license: str | None = None, extra: dict | None = None,
                    model_config: ModelShape | None = None) -> Trace:
    """Import RouterTracer JSON lines (one file per rank, or several): each (step, rank) one request."""
    paths = _as_paths(paths)
    num_experts, expert_bytes, hidden_size = _shape_options(num_experts, expert_bytes, hidden_size, model_config)
    passes: dict[tuple[int, int], dict[int, tuple]] = defaultdict(dict)
    left_out = 0
    for path in paths:
        for line, text in enumerate(read_text(path, "RouterTracer trace", TraceError).split("\n"), start=1):
            if not text.strip():
                continue
            record = parse_json(text, path, "RouterTracer record", TraceError, row=line, unit="line")
            if not isinstance(record, dict):
                _raise(path, line, f"expected a JSON object, found {type(record).__name__}")
            missing = [k for k in ("step", "layer", "rank", "top_indices") if k not in record]
            if missing:
                _raise(path, line, f"missing key(s) {', '.join(missing)}")
            if record.get("block", "decoder") != "decoder":
                left_out += 1
                continue
            step, layer, rank = record["step"], record["layer"], record["rank"]
            for name, value in (("step", step), ("layer", layer), ("rank", rank)):
                if not _is_int(value) or not 0 <= value < 2**31:
                    _raise(path, line, f"{name} must be a non-negative integer, not {quote(value)}")
            indices = record["top_indices"]
            if not isinstance(indices, list) or not indices or not all(
                    isinstance(row, list) and row and len(row) == len(indices[0]) and
                    all(_is_int(v) and 0 <= v < 2**31 for v in row) for row in indices):
                _raise(path, line, f"top_indices must be [num_tokens][topk] non-negative integer ids, not {quote(indices)}")
            for name, expected in (("num_tokens", len(indices)), ("topk", len(indices[0]))):
                if name in record and record[name] != expected:
                    _raise(path, line, f"{name}={quote(record[name])}, but top_indices has {expected}")
            if layer in passes[(step, rank)]:
                _raise(path, line, f"step {step} rank {rank} layer {layer} appears twice")
            passes[(step, rank)][layer] = (indices, path, line)
    if not passes:
        raise TraceError(paths[0], "no decoder routing records")
    layers = sorted(next(iter(passes.values())))
    requests = []
    for iteration, ((step, rank), by_layer) in enumerate(sorted(passes.items())):
        path, line = next(iter(by_layer.values()))[1:]
        if sorted(by_layer) != layers:
            _raise(path, line, f"step {step} rank {rank} routes layers {quote(sorted(by_layer))}, the first pass "
                               f"{quote(layers)}")
        tokens = {len(by_layer[layer][0]) for layer in layers}
        if len(tokens) != 1:
            _raise(path, line, f"step {step} rank {rank}: its layers route different numbers of tokens "
                               f"{quote(sorted(tokens))}")
        experts = np.asarray([by_layer[layer][0] for layer in layers], dtype=np.int64).transpose(1, 0, 2)
        n = len(experts)
        requests.append(_Request(path=path, experts=experts, position=list(range(n)), phase=[PREFILL] * n,
                                 iteration=[0] * n, locator=[line] * n, unit="line"))
    starts = list(range(len(requests)))
    details = {"experts_sorted": False, "layer_ids": layers, "passes": [list(key) for key in sorted(passes)],
               "records_left_out": left_out}
    return _finish(requests, paths, "megatron", num_experts, model, expert_bytes, hidden_size, source, license,
                   extra, details, "RouterTracer traces do not say how many experts each layer has; give --experts J "
                                   "or --model-config config.json", starts=starts)


def _raise(path: Path, line: int, problem: str):
    raise TraceError(path, problem, row=line, unit="line")
