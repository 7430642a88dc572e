"""What every importer shares: the rows one request contributed, their checks, and the trace they become."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from moe_offload.errors import ConfigError, TraceError
from moe_offload.trace.format import MAX_EXPERT_SLOTS, Trace, TraceMeta
from moe_offload.values import integer


_SHORT_REPR = reprlib.Repr()  # Python 3.11's Repr takes its limits as attributes
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict = 4, 16, 8
_SHORT_REPR.maxstring, _SHORT_REPR.maxlong, _SHORT_REPR.maxother = 120, 60, 120


@dataclass
class _Request:
    """The rows one request contributed, before its request id and iteration offset are known."""

    path: Path
    experts: np.ndarray        # [n, L, K] int64
    position: list[int]
    phase: list[int]
    iteration: list[int]       # 0-based inside the request
    locator: list[int]         # line number, route index or response index of each row, for error messages
    unit: str                  # "line", "route" or "response"
    weights: np.ndarray | None = None  # [n, L, K] float64


def _assemble(requests: list[_Request], paths: list[Path], format_name: str, *, num_experts: int, model: str,
              expert_bytes, hidden_size, source, license, extra: dict, starts: list[int] | None = None) -> Trace:
    """One trace from per-request rows, request id = list order.

    Without ``starts`` each request runs alone, after the one before it (iterations continued across
    requests). With them, request r's local iteration i is iteration ``starts[r] + i``: requests that share
    the engine, as a continuous-batching server runs them (engines.py says how it places them); rows of one
    iteration are in request order."""
    _, num_layers, top_k = requests[0].experts.shape
    request_ids, iterations = [], []
    next_iteration = 0
    for request_id, request in enumerate(requests):
        request_ids.append(np.full(len(request.position), request_id, dtype=np.int32))
        local = np.asarray(request.iteration, dtype=np.int64)
        iterations.append(local + (next_iteration if starts is None else starts[request_id]))
        next_iteration += int(local.max()) + 1
    iteration = np.concatenate(iterations)
    order = np.argsort(iteration, kind="stable")  # rows sorted by iteration, requests in list order within one
    weights = [r.weights for r in requests]
    meta = TraceMeta(model=model, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                     expert_bytes=expert_bytes, hidden_size=hidden_size,
                     source=source or f"{format_name} import of {', '.join(p.name for p in paths)}",
                     license=license, extra=extra)
    path = paths[0] if len(paths) == 1 else "<" + ", ".join(map(str, paths)) + ">"
    meta.check(path)
    return Trace.build(meta, np.concatenate([r.experts for r in requests])[order],
                       request=np.concatenate(request_ids)[order], iteration=iteration[order],
                       position=np.concatenate([r.position for r in requests])[order],
                       phase=np.concatenate([r.phase for r in requests])[order],
                       weights=None if any(w is None for w in weights) else np.concatenate(weights)[order],
                       path=path)


def _check_requests_ids(requests: list[_Request], num_experts: int | None, paths: list[Path], how: str) -> None:
    """Every request's ids checked against J (_check_expert_ids); a format that does not carry J, given none,
    is refused with ``how`` to give it and the least J its ids allow."""
    if num_experts is None:
        largest = max(int(r.experts.max()) for r in requests)
        raise ConfigError(f"{', '.join(map(str, paths))}: {how}. Hint: the largest expert id in the file(s) is "
                          f"{largest}, so J is at least {largest + 1}")
    for request in requests:
        _check_expert_ids(request, num_experts)


def _check_expert_ids(request: _Request, num_experts: int) -> None:
    """Raise TraceError at the first line/route selecting an id outside 0..J-1 or one expert twice."""
    experts = request.experts
    out_of_range = (experts < 0) | (experts >= num_experts)
    ordered = np.sort(experts, axis=2)
    duplicated = ordered[:, :, 1:] == ordered[:, :, :-1]
    for bad, problem in ((out_of_range, f"expert id out of range 0..{num_experts - 1} (num_experts={num_experts})"),
                         (duplicated, "the same expert listed twice")):
        rows = np.flatnonzero(bad.any(axis=2).any(axis=1))
        if rows.size:
            row = int(rows[0])
            layer = int(np.flatnonzero(bad[row].any(axis=1))[0])
            raise TraceError(request.path, f"layer {layer}: {problem}: {experts[row, layer].tolist()}",
                             row=request.locator[row], unit=request.unit)


def _failer(path: Path, row: int, unit: str) -> Callable[[str], None]:
    def fail(problem: str) -> None:
        raise TraceError(path, problem, row=row, unit=unit)
    return fail


def _as_paths(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ConfigError("no trace files given to import")
    return paths


def _check_num_experts(num_experts) -> None:
    if num_experts is not None:
        integer(num_experts, "num_experts (--experts)", low=1, high=MAX_EXPERT_SLOTS,
                why="experts per layer, at most the experts of a whole model this release handles")


def _are_ids(values: list) -> bool:
    """Whether every value is an integer that fits the int64 array the ids are checked in."""
    return all(_is_int(v) and -2**63 <= v < 2**63 for v in values)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def quote(value, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message quotes what it received, never all of a
    hostile megabyte (an int of more digits than Python prints is named, not printed)."""
    try:
        text = _SHORT_REPR.repr(value)
    except (ValueError, RecursionError):
        text = f"({type(value).__name__} too large or too deep to print)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


