"""The consistency checks of a routing trace in memory (``Trace.validate``): shapes against the metadata,
expert ids in range and distinct within a layer, phase codes, iteration order, one row per (request,
position), each request's rows in an order a model can have produced, and the float columns finite and in
range. Every refusal is a TraceError naming the first offending row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.trace.phases import DECODE

if TYPE_CHECKING:  # the annotation only: format.py imports this module to check every trace it builds
    from moe_offload.trace.format import Trace


def validate_trace(trace: Trace) -> None:
    """Raise TraceError naming the first offending row, or return when the trace is consistent."""
    meta, path = trace.meta, trace.path
    meta.check(path)
    L, J, K = meta.num_layers, meta.num_experts, meta.top_k
    n = trace.num_tokens
    for name in ("request", "position", "phase", "iteration"):
        column = getattr(trace, name)
        if column.shape != (n,):
            raise TraceError(path, f"column {name} has {column.shape[0] if column.ndim else 0} rows, "
                                   f"experts has {n}")
    if trace.experts.ndim != 3 or trace.experts.shape[1] != L:
        got = trace.experts.shape[1] if trace.experts.ndim == 3 else "?"
        raise TraceError(path, f"experts has {got} layers per row, metadata says num_layers={L}")
    if trace.experts.shape[2] != K:
        raise TraceError(path, f"experts has {trace.experts.shape[2]} experts per layer, "
                               f"metadata says top_k={K}")
    if n == 0:
        raise TraceError(path, "the trace has no tokens")
    if not np.issubdtype(trace.experts.dtype, np.integer):
        raise TraceError(path, f"expert ids must be integers, not {trace.experts.dtype}")
    # the smallest and largest id first (no temporaries): the rows are searched only when one is out of range
    in_range = trace.experts.min() >= 0 and trace.experts.max() < J
    bad = np.zeros(0, np.int64) if in_range else np.flatnonzero(((trace.experts < 0) | (trace.experts >= J))
                                                                  .any(axis=(1, 2)))
    if bad.size:
        row = int(bad[0])
        layer = int(np.flatnonzero(((trace.experts[row] < 0) | (trace.experts[row] >= J)).any(axis=1))[0])
        raise TraceError(path, f"layer {layer} selects expert {trace.experts[row, layer].tolist()}, "
                               f"but the model has experts 0..{J - 1}", row=row)
    if K > 1:
        # every pair of ranks compared over all rows and layers at once: K (K - 1) / 2 passes over N * L
        # bytes, cheaper than sorting each layer's K ids for the top-k of real models (at most a few dozen)
        twice = np.zeros((n, L), np.bool_)
        for first in range(K):
            for second in range(first + 1, K):
                twice |= trace.experts[:, :, first] == trace.experts[:, :, second]
        dup = np.flatnonzero(twice.any(axis=1))
        if dup.size:
            row = int(dup[0])
            layer = int(np.flatnonzero(twice[row])[0])
            raise TraceError(path, f"layer {layer} selects the same expert twice: "
                                   f"{trace.experts[row, layer].tolist()}", row=row)
    bad = np.flatnonzero(trace.phase > DECODE)
    if bad.size:
        raise TraceError(path, f"phase code {int(trace.phase[bad[0]])} is neither prefill (0) nor decode (1)",
                         row=int(bad[0]))
    bad = np.flatnonzero(np.diff(trace.iteration) < 0)
    if bad.size:
        raise TraceError(path, "rows are not in iteration order "
                               f"(iteration {int(trace.iteration[bad[0] + 1])} after {int(trace.iteration[bad[0]])})",
                         row=int(bad[0]) + 1)
    bad = np.flatnonzero(trace.position < 0)
    if bad.size:
        raise TraceError(path, f"negative position {int(trace.position[bad[0]])}", row=int(bad[0]))
    # A token is one (request, position): a repeated row would be served, and counted, twice.
    token = trace.request.astype(np.int64) << 32 | trace.position.astype(np.int64)
    order = np.argsort(token, kind="stable")
    repeated = np.flatnonzero(token[order][1:] == token[order][:-1])
    if repeated.size:
        first, again = sorted(int(row) for row in order[repeated[0]:repeated[0] + 2])
        raise TraceError(path, f"duplicates row {first}: request {int(trace.request[again])} has position "
                               f"{int(trace.position[again])} twice", row=again)
    _check_request_order(trace)
    _check_float(trace, "weights", trace.weights, (n, L, K))
    _check_float(trace, "probs", trace.probs, (n, L, J), upper=1.0)
    _check_float(trace, "gate_prediction", trace.gate_prediction, (n, L - 1, J), upper=1.0)
    _check_float(trace, "next_token_gate_prediction", trace.next_token_gate_prediction, (n, J), upper=1.0)
    if trace.embedding is not None:
        _check_float(trace, "embedding", trace.embedding,
                     (n, trace.embedding.shape[-1] if trace.embedding.ndim == 2 else -1), lower=None)


def _check_request_order(trace: Trace) -> None:
    """What a model can have produced: each request's rows, in file (iteration) order, have rising
    positions and its prompt (prefill) before its generated tokens (decode); and a forward pass decodes
    one token per request (a prompt may take many rows of one pass, a decode step only one)."""
    path = trace.path
    order = np.argsort(trace.request, kind="stable")  # each request's rows, in file order
    same = trace.request[order][1:] == trace.request[order][:-1]
    earlier, later = order[:-1][same], order[1:][same]
    bad = np.flatnonzero(trace.position[later] <= trace.position[earlier])
    if bad.size:
        row, before = int(later[bad[0]]), int(earlier[bad[0]])
        raise TraceError(path, f"request {int(trace.request[row])} has position {int(trace.position[row])} after "
                               f"position {int(trace.position[before])} (row {before}): a request's positions "
                               "must rise", row=row)
    bad = np.flatnonzero(trace.phase[later] < trace.phase[earlier])
    if bad.size:
        row, before = int(later[bad[0]]), int(earlier[bad[0]])
        raise TraceError(path, f"request {int(trace.request[row])} has a prefill row after its decode row "
                               f"{before}: a request's prompt comes before its generated tokens", row=row)
    decode = np.flatnonzero(trace.phase == DECODE)
    step = trace.request[decode].astype(np.int64) << 32 | trace.iteration[decode].astype(np.int64) & 0xFFFFFFFF
    ranked = np.argsort(step, kind="stable")
    repeated = np.flatnonzero(step[ranked][1:] == step[ranked][:-1])
    if repeated.size:
        row = int(decode[ranked[repeated[0] + 1]])
        raise TraceError(path, f"request {int(trace.request[row])} decodes more than one token in iteration "
                               f"{int(trace.iteration[row])}: a forward pass decodes one token per request",
                         row=row)


def _check_float(trace: Trace, name, values, shape, lower=0.0, upper=None):
    if values is None:
        return
    if values.shape != shape:
        raise TraceError(trace.path, f"column {name} has shape {values.shape}, expected {shape}")
    finite = np.isfinite(values).reshape(values.shape[0], -1).all(axis=1)
    if not finite.all():
        raise TraceError(trace.path, f"column {name} holds NaN or infinity", row=int(np.flatnonzero(~finite)[0]))
    if lower is not None:
        low = (values < lower).reshape(values.shape[0], -1).any(axis=1)
        if low.any():
            raise TraceError(trace.path, f"column {name} holds a negative value", row=int(np.flatnonzero(low)[0]))
    if upper is not None:
        # float16 rounds 1.0 - 1e-4 up to 1.0; anything clearly above 1 is not a probability.
        high = (values > upper + 1e-3).reshape(values.shape[0], -1).any(axis=1)
        if high.any():
            raise TraceError(trace.path, f"column {name} holds a probability above 1",
                             row=int(np.flatnonzero(high)[0]))
