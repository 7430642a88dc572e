"""The request sequence of the layered-paging model (paper 001), as the replay simulator serves it.

Order: tokens in trace order; a token selecting K experts per layer becomes K *rounds*; round r requests
the rank-r expert of layer 0, then of layer 1, ..., then of layer L-1 (paper 001, section 5.1: "one round
for the first expert, a second round for the second expert, etc."). So request number ``t`` has
``round = t // L`` and ``layer = t % L``, and token n's rounds are n*K .. n*K + K-1.

An expert's flat id is ``layer * J + expert`` everywhere in the project (the CSV export uses it too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_offload.compiled import njit_cached, numba_available
from moe_offload.outputs import atomic_output
from moe_offload.trace.format import Trace

NEVER = np.iinfo(np.int64).max  # next_use of a request whose expert is not requested again
DENSE_KEYS = 2**24  # keys below this index a table (every flat expert id does: trace/format.py MAX_EXPERT_SLOTS)


@dataclass(frozen=True)
class AccessSequence:
    """One entry per expert request, in replay order. ``next_use[t]`` is the index of the next request
    of the same expert (NEVER if none): the oracle that Belady's rule reads."""

    expert_id: np.ndarray  # int64 flat ids
    layer: np.ndarray      # int32
    token: np.ndarray      # int64, the trace row the request belongs to
    next_use: np.ndarray   # int64
    num_layers: int
    num_experts: int
    top_k: int

    def __len__(self) -> int:
        return int(self.expert_id.shape[0])

    @property
    def round(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64) // self.num_layers


def flatten_kernel(experts, num_experts, expert_id, layer, token):
    """Fill the request columns from ``experts`` [N, L, K] in the order of the module docstring, in one pass."""
    num_tokens, num_layers, top_k = experts.shape
    t = 0
    for row in range(num_tokens):
        for rank in range(top_k):
            for at in range(num_layers):
                expert_id[t] = at * num_experts + experts[row, at, rank]
                layer[t] = at
                token[t] = row
                t += 1


@functools.cache
def _flatten_kernel(dtype: str):
    """flatten_kernel compiled by Numba for expert ids of ``dtype``, read-only or not (a trace read from
    Parquet shares Arrow's read-only buffers)."""
    from numba import types

    experts = types.Array(getattr(types, dtype), 3, "C", readonly=True)
    column = types.Array(types.int64, 1, "C")
    return njit_cached(flatten_kernel, types.void(experts, types.int64, column, types.Array(types.int32, 1, "C"),
                                                  column))


def flatten(trace: Trace) -> AccessSequence:
    L, J, K = trace.meta.num_layers, trace.meta.num_experts, trace.meta.top_k
    n = trace.num_tokens
    if numba_available():  # one compiled pass, no temporaries
        experts = np.ascontiguousarray(trace.experts)
        expert_id, layer, token = np.empty(n * K * L, np.int64), np.empty(n * K * L, np.int32), np.empty(n * K * L,
                                                                                                       np.int64)
        _flatten_kernel(experts.dtype.name)(experts, J, expert_id, layer, token)
    else:  # experts[n, l, r] -> order (n, r, l): token-major, then rank, then layer
        layer = np.tile(np.arange(L, dtype=np.int32), n * K)
        expert_id = layer.astype(np.int64) * J + trace.experts.astype(np.int64).transpose(0, 2, 1).reshape(-1)
        token = np.repeat(np.arange(n, dtype=np.int64), K * L)
    return AccessSequence(expert_id=expert_id, layer=layer, token=token, next_use=next_use_times(expert_id),
                          num_layers=L, num_experts=J, top_k=K)


def next_use_kernel(keys, num_keys, next_use):
    """``next_use[t]``: the next position of ``keys[t]`` (NEVER if none), in one backward pass that remembers
    where each key was seen last."""
    seen = np.full(num_keys, NEVER, np.int64)
    for position in range(keys.shape[0] - 1, -1, -1):
        key = keys[position]
        next_use[position] = seen[key]
        seen[key] = position


@functools.cache
def _next_use_kernel():
    """next_use_kernel compiled by Numba when it is installed, else the plain function (slow)."""
    if not numba_available():
        return next_use_kernel
    return njit_cached(next_use_kernel, "void(int64[::1], int64, int64[::1])")


def next_use_times(keys: np.ndarray) -> np.ndarray:
    """For each position, the next position holding the same key (NEVER if none): one compiled pass, O(n), over
    flat expert ids. Without Numba, or for keys too sparse for a table of them, a stable sort by key lists each
    key's positions in time order, and each position's successor in that list is its next use (NumPy sorts
    16-bit keys by radix, in O(n))."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    nxt = np.empty(keys.size, dtype=np.int64)
    if not keys.size:
        return nxt
    if keys.min() < 0:
        raise ValueError("keys must not be negative")
    if numba_available() and keys.max() < DENSE_KEYS:
        _next_use_kernel()(keys, int(keys.max()) + 1, nxt)
        return nxt
    order = np.argsort(keys.astype(np.uint16) if keys.max() <= np.iinfo(np.uint16).max else keys, kind="stable")
    following = np.full(keys.size, NEVER, dtype=np.int64)  # in sorted order: the next position of the same key
    following[:-1] = np.where(keys[order[1:]] == keys[order[:-1]], order[1:], NEVER)
    nxt[order] = following
    return nxt


def write_csv(sequence: AccessSequence, path, expert_bytes: int | None) -> Path:
    """Write ``time,id,size`` rows (one expert request each) that any cache simulator can replay; the rows
    are formatted by Arrow's CSV writer, not one by one in Python, and written atomically (a failed write
    leaves an existing file as it was)."""
    import pyarrow as pa
    import pyarrow.csv as arrow_csv

    path = Path(path)
    n = len(sequence)
    table = pa.table({"time": np.arange(n, dtype=np.int64), "id": sequence.expert_id,
                      "size": np.full(n, expert_bytes or 1, dtype=np.int64)})
    with atomic_output(path) as temporary, temporary.open("wb") as out:
        out.write(b"time,id,size\r\n")  # Arrow quotes a header it writes
        arrow_csv.write_csv(table, out, arrow_csv.WriteOptions(include_header=False, eol="\r\n"))
    return path


ORACLE_GENERAL_RECORD = np.dtype([("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"),
                                  ("next_access_vtime", "<i8")])


def write_oracle_general(sequence: AccessSequence, path, expert_bytes: int | None) -> Path:
    """Write libCacheSim's binary oracleGeneral trace (24-byte records with the next access time, which
    its Belady needs); the request order and ids are those of the CSV."""
    path = Path(path)
    records = np.empty(len(sequence), dtype=ORACLE_GENERAL_RECORD)
    records["clock_time"] = np.arange(len(sequence), dtype=np.uint32)
    records["obj_id"] = sequence.expert_id
    records["obj_size"] = expert_bytes or 1
    records["next_access_vtime"] = np.where(sequence.next_use == NEVER, -1, sequence.next_use)
    with atomic_output(path) as temporary:
        records.tofile(temporary)
    return path


def last_row_of_each_request(requests: np.ndarray) -> np.ndarray:
    """The index of the last row (token) of each request in a trace's ``requests`` column, ascending."""
    _, last_reversed = np.unique(requests[::-1], return_index=True)
    return np.sort(requests.size - 1 - last_reversed)
