"""The request sequence of the layered-paging model (paper 001), as the replay simulator serves it.

Order: tokens in trace order; a token selecting K experts per layer becomes K *rounds*; round r requests
the rank-r expert of layer 0, then of layer 1, ..., then of layer L-1 (paper 001, section 5.1: "one round
for the first expert, a second round for the second expert, etc."). So request number ``t`` has
``round = t // L`` and ``layer = t % L``, and token n's rounds are n*K .. n*K + K-1.

An expert's flat id is ``layer * J + expert`` everywhere in the project (the CSV export uses it too).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_offload.compiled import compile_pays, njit_cached, numba_available
from moe_offload.errors import ConfigError
from moe_offload.outputs import atomic_output
from moe_offload.trace.format import Trace

# The columns of a sequence are int32: flat ids (below MAX_EXPERT_SLOTS = 2**24), rows and positions, so a sequence
# has fewer than NEVER requests. Half of int64's bytes: at 38.4M requests each column is 154 MB, not 307 MB.
COLUMN = np.int32
NEVER = np.iinfo(np.int32).max  # next_use of a request whose expert is not requested again
DENSE_KEYS = 2**24  # keys below this index a table (every flat expert id does: trace/format.py MAX_EXPERT_SLOTS)


@dataclass(frozen=True)
class AccessSequence:
    """One entry per expert request, in replay order: the flat expert ids, and what the order implies about
    each request, computed when first asked for (a replay of most policies reads the ids alone, and a column
    of 4 bytes per request is 400 MB at a hundred million requests). ``next_use[t]`` is the index of the
    next request of the same expert (NEVER if none): the oracle that Belady's rule reads (the policy objects'
    replay and the exports; the compiled kernels find it a chunk at a time, ``fill_next_uses``)."""

    expert_id: np.ndarray  # int32 flat ids
    num_layers: int
    num_experts: int
    top_k: int
    rate: float = 1.0      # below 1: the requests of a spatial sample of the experts (``sample_sequence``)
    _columns: dict = field(default_factory=dict, repr=False, compare=False)  # the computed columns, by name
    _making: dict = field(default_factory=dict, repr=False, compare=False)  # a lock per column, while it is made
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # of _making

    def __len__(self) -> int:
        return int(self.expert_id.shape[0])

    @property
    def sampled(self) -> bool:
        return self.rate < 1.0

    @property
    def layer(self) -> np.ndarray:
        """int32: request t is of layer t % L (module docstring); in a sample, of its expert's layer."""
        if self.sampled:
            return self._computed("layer", lambda: (self.expert_id // self.num_experts).astype(np.int32))
        return self._computed("layer", lambda: np.tile(np.arange(self.num_layers, dtype=np.int32),
                                                       len(self) // max(1, self.num_layers)))

    @property
    def token(self) -> np.ndarray:
        """int32: the trace row request t belongs to, t // (L * K) (a sample is given its rows when made)."""
        return self._computed("token", lambda: np.arange(len(self), dtype=COLUMN) // COLUMN(self.num_layers * self.top_k))

    @property
    def next_use(self) -> np.ndarray:
        """int32: the next position of each request's expert, NEVER if none (``next_use_times``)."""
        return self._computed("next_use", lambda: next_use_times(self.expert_id))

    def _computed(self, name: str, make) -> np.ndarray:
        """The column ``name``, made once, on whichever thread asks first (the replay grid's threads read the
        columns their kernels need, each on its own thread; a thread asking for one being made waits for it)."""
        with self._lock:
            lock = self._making.setdefault(name, threading.Lock())
        with lock:
            if name not in self._columns:
                self._columns[name] = make()
            return self._columns[name]

    def forget(self, name: str) -> None:
        """Drop the computed column ``name`` (layer, token, next_use): it is made again if asked for. A
        long pipeline frees a column it no longer needs this way."""
        self._columns.pop(name, None)

    def __getstate__(self) -> dict:  # to a worker process: the ids, without locks or computed columns
        return {**self.__dict__, "_columns": {}, "_making": {}, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def per_layer_requests(self) -> np.ndarray:
        """Requests of each layer: every token requests K experts of every layer, so n / L each (in a sample,
        counted, once)."""
        if self.sampled:
            return self._computed("per_layer_requests", lambda: np.bincount(
                self.expert_id // self.num_experts, minlength=self.num_layers).astype(np.int64)).copy()
        return np.full(self.num_layers, len(self) // max(1, self.num_layers), np.int64)

    def layer_columns(self, column: np.ndarray, first: int, stop: int) -> list[np.ndarray]:
        """The requests of layers ``first`` .. ``stop``-1 taken from ``column`` (one of the sequence's columns),
        each layer's contiguous and in time order, gathered in one pass over the column where Numba is installed
        (a strided copy a layer reads every line of the column once per layer: 0.25 s a column of 38.4M requests
        of 48 layers, against 0.05 s in passes of 16 layers, measured on the 2-core machine)."""
        counts = self.per_layer_requests()[first:stop]
        offsets = np.zeros(stop - first + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        out = np.empty(int(offsets[-1]), column.dtype)
        if numba_available() and column.dtype == COLUMN and column.flags.c_contiguous:
            _gather_kernel()(column, self.expert_id, self.num_experts, self.num_layers, first, not self.sampled,
                             offsets, out)
        else:
            layer = self.expert_id // self.num_experts
            for g in range(stop - first):
                picked = slice(first + g, None, self.num_layers) if not self.sampled else layer == first + g
                out[offsets[g]:offsets[g + 1]] = column[picked]
        return [out[offsets[g]:offsets[g + 1]] for g in range(stop - first)]

    @property
    def round(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64) // self.num_layers


def flatten_kernel(experts, num_experts, expert_id):
    """Fill ``expert_id`` from ``experts`` [N, L, K] in the order of the module docstring, in one pass."""
    num_tokens, num_layers, top_k = experts.shape
    t = 0
    for row in range(num_tokens):
        for rank in range(top_k):
            for at in range(num_layers):
                expert_id[t] = at * num_experts + experts[row, at, rank]
                t += 1


def sample_count_kernel(experts, num_experts, sampled):
    """How many requests of ``experts`` [N, L, K] are of an expert ``sampled`` flags (flat ids)."""
    num_tokens, num_layers, top_k = experts.shape
    count = 0
    for row in range(num_tokens):
        for at in range(num_layers):
            first = at * num_experts
            for rank in range(top_k):
                count += sampled[first + experts[row, at, rank]]
    return count


def sample_fill_kernel(experts, num_experts, sampled, expert_id, token):
    """The requests of ``experts`` [N, L, K] of an expert ``sampled`` flags, in the order of the module docstring:
    their flat ids in ``expert_id`` and their trace rows in ``token``, each one longer than the sample: every
    request is written and only a sampled one kept (no branch to mispredict, where half the experts are in)."""
    num_tokens, num_layers, top_k = experts.shape
    t = 0
    for row in range(num_tokens):
        for rank in range(top_k):
            for at in range(num_layers):
                key = at * num_experts + experts[row, at, rank]
                expert_id[t] = key
                token[t] = row
                t += sampled[key]


def gather_kernel(column, expert_id, num_experts, num_layers, first, regular, offsets, out):
    """Copy the requests of layers ``first`` .. ``first`` + G - 1 (G = len(offsets) - 1) from ``column`` to
    out[offsets[g]:offsets[g + 1]] for layer ``first`` + g, in time order. Where ``regular``, request t is of
    layer t % L (module docstring), so each round's G requests are read together; else (a sample) of its
    expert's layer, ``expert_id[t] // num_experts``."""
    groups = offsets.shape[0] - 1
    if regular:
        for r in range(column.shape[0] // num_layers):
            at = r * num_layers + first
            for g in range(groups):
                out[offsets[g] + r] = column[at + g]
        return
    cursor = offsets[:groups].copy()
    for t in range(column.shape[0]):
        g = expert_id[t] // num_experts - first
        if 0 <= g < groups:
            out[cursor[g]] = column[t]
            cursor[g] += 1


@functools.cache
def _gather_kernel():
    """gather_kernel compiled by Numba for the sequence's int32 columns."""
    from numba import types

    column = types.Array(types.int32, 1, "C", readonly=True)
    return njit_cached(gather_kernel, types.void(column, column, types.int64, types.int64, types.int64,
                                                 types.boolean, types.Array(types.int64, 1, "C"),
                                                 types.Array(types.int32, 1, "C")))


@functools.cache
def _flatten_kernel(dtype: str):
    """flatten_kernel compiled by Numba for expert ids of ``dtype``, read-only or not (a trace read from
    Parquet shares Arrow's read-only buffers)."""
    from numba import types

    experts = types.Array(getattr(types, dtype), 3, "C", readonly=True)
    return njit_cached(flatten_kernel, types.void(experts, types.int64, types.Array(types.int32, 1, "C")))


@functools.cache
def _sample_kernels(dtype: str):
    """sample_count_kernel and sample_fill_kernel compiled by Numba for expert ids of ``dtype``."""
    from numba import types

    experts = types.Array(getattr(types, dtype), 3, "C", readonly=True)
    flags = types.Array(types.boolean, 1, "C", readonly=True)
    column = types.Array(types.int32, 1, "C")
    return (njit_cached(sample_count_kernel, types.int64(experts, types.int64, flags)),
            njit_cached(sample_fill_kernel, types.void(experts, types.int64, flags, column, column)))


def flatten_experts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """The flat expert ids of ``experts`` [N, L, K] in replay order (int32): one compiled pass where Numba is
    installed, else NumPy's transpose."""
    n, L, K = experts.shape
    if n * L * K >= NEVER:
        raise ConfigError(f"{n:,} tokens x {L} layers x top-{K} are {n * L * K:,} expert requests, more than the "
                          f"{NEVER - 1:,} a request sequence holds (its positions are 32-bit): replay a part of the "
                          "trace, or let the report sample it")
    if numba_available():  # one compiled pass, no temporaries
        experts = np.ascontiguousarray(experts)
        expert_id = np.empty(n * K * L, COLUMN)
        _flatten_kernel(experts.dtype.name)(experts, num_experts, expert_id)
        return expert_id
    # experts[n, l, r] -> order (n, r, l): token-major, then rank, then layer
    offsets = np.arange(L, dtype=COLUMN)[None, None, :] * COLUMN(num_experts)
    return (experts.astype(COLUMN).transpose(0, 2, 1) + offsets).reshape(-1)


PIECE_REQUESTS = 1 << 22  # requests of a piece of a long trace flattened at a time (32 MiB of ids)


def flattened_pieces(trace: Trace, requests: int = PIECE_REQUESTS):
    """The flat ids of ``trace`` in replay order, a piece of whole tokens (about ``requests``) at a time."""
    meta = trace.meta
    rows = max(1, requests // (meta.num_layers * meta.top_k))
    for start in range(0, trace.num_tokens, rows):
        yield flatten_experts(trace.experts[start:start + rows], meta.num_experts)


def sample_sequence(trace: Trace, rate: float) -> "AccessSequence":
    """The requests of ``trace`` whose expert is in the spatial sample at ``rate`` (``in_sample``), in replay
    order, with the trace row of each (its ``token``), never the whole sequence in memory: two compiled passes over
    the trace (count, then fill) where Numba is installed, else a piece of the sequence at a time."""
    meta = trace.meta
    sampled = sampled_experts(meta.num_expert_slots, rate)
    if numba_available():  # two compiled passes over the trace (count, fill), no temporaries
        experts = np.ascontiguousarray(trace.experts)
        count_kernel, fill_kernel = _sample_kernels(experts.dtype.name)
        size = count_kernel(experts, meta.num_experts, sampled)
        keys, tokens = np.empty(size + 1, COLUMN), np.empty(size + 1, COLUMN)
        fill_kernel(experts, meta.num_experts, sampled, keys, tokens)
        sequence = AccessSequence(expert_id=keys[:size], num_layers=meta.num_layers, num_experts=meta.num_experts,
                                  top_k=meta.top_k, rate=rate)
        sequence._columns["token"] = tokens[:size]
        return sequence
    rows = max(1, PIECE_REQUESTS // (meta.num_layers * meta.top_k))
    keys, tokens = [], []
    for piece, start in zip(flattened_pieces(trace), range(0, trace.num_tokens, rows)):
        keep = np.flatnonzero(sampled[piece])
        keys.append(piece[keep])
        tokens.append((start + keep // (meta.num_layers * meta.top_k)).astype(COLUMN))
    sequence = AccessSequence(expert_id=np.concatenate(keys) if keys else np.zeros(0, COLUMN),
                              num_layers=meta.num_layers, num_experts=meta.num_experts, top_k=meta.top_k, rate=rate)
    del keys
    sequence._columns["token"] = np.concatenate(tokens) if tokens else np.zeros(0, COLUMN)
    return sequence


def flatten(trace: Trace) -> AccessSequence:
    meta = trace.meta
    return AccessSequence(expert_id=flatten_experts(trace.experts, meta.num_experts), num_layers=meta.num_layers,
                          num_experts=meta.num_experts, top_k=meta.top_k)


SAMPLE_HASH = 0x9E3779B1  # Knuth's multiplicative hash: spreads consecutive flat ids over [0, 2**32)


def sampled_experts(num_keys: int, rate: float) -> np.ndarray:
    """Which of the flat expert ids 0 .. ``num_keys`` - 1 are in the spatial sample of the experts at ``rate``
    (SHARDS, Waldspurger et al., FAST 2015): an expert is in it when its hash falls below ``rate`` * 2**32, the
    same experts in every part of a trace. A table of one flag per expert, which a request reads by its id."""
    hashed = (np.arange(num_keys, dtype=np.uint64) * np.uint64(SAMPLE_HASH)) & np.uint64(0xFFFFFFFF)
    return hashed < np.uint64(min(2**32, int(rate * 2**32)))


def in_sample(keys: np.ndarray, rate: float) -> np.ndarray:
    """Which of ``keys`` (flat expert ids) are of an expert in the spatial sample at ``rate`` (``sampled_experts``)."""
    if keys.shape[0] == 0:
        return np.zeros(0, np.bool_)
    return sampled_experts(int(keys.max()) + 1, rate)[keys]


def next_use_kernel(keys, num_keys, next_use):
    """``next_use[t]``: the next position of ``keys[t]`` (NEVER if none), in one backward pass that remembers
    where each key was seen last."""
    seen = np.full(num_keys, NEVER, np.int32)
    for position in range(keys.shape[0] - 1, -1, -1):
        key = keys[position]
        next_use[position] = seen[key]
        seen[key] = position


# The next uses of a replay's requests a chunk at a time, for the kernels that read them (Belady's, OPT's curve):
# a column of them, 4 bytes a request, is memory that grows with the trace and costs more to make than a chunk's.
NEXT_USE_CHUNK = 1 << 20  # requests whose next uses a kernel holds at once (4 MiB)
NEXT_USE_CHUNKS = 256     # at most this many chunks (longer sequences have longer chunks): ``next_use_marks``'s rows


def next_use_chunk(requests):
    """The chunk length of a replay of ``requests`` requests (``next_use_marks``)."""
    return max(NEXT_USE_CHUNK, -(-requests // NEXT_USE_CHUNKS))


def next_use_marks(keys, num_keys, chunk):
    """For each chunk of ``chunk`` requests of ``keys`` and each key, the position of the key's first request
    after the chunk, NEVER if none: one backward pass, an array [chunks, num_keys] (``fill_next_uses`` reads a
    row)."""
    n = keys.shape[0]
    chunks = (n + chunk - 1) // chunk
    marks = np.empty((chunks, num_keys), np.int32)
    seen = np.full(num_keys, NEVER, np.int32)
    for c in range(chunks - 1, -1, -1):
        for key in range(num_keys):  # loops, not slices: Numba compiles them in a fraction of the time
            marks[c, key] = seen[key]
        for t in range(min(n, (c + 1) * chunk) - 1, c * chunk - 1, -1):
            seen[keys[t]] = t
    return marks


def fill_next_uses(keys, marks, row, first, stop, seen, ahead):
    """``ahead[t - first]``: the next position of the key of request t (NEVER if none), for t in [first, stop),
    chunk ``row`` of ``next_use_marks``, whose row of ``marks`` gives each key's first request after it
    (``seen``: where the backward pass keeps them): ``next_use_times`` a chunk at a time."""
    for key in range(seen.shape[0]):
        seen[key] = marks[row, key]
    for t in range(stop - 1, first - 1, -1):
        key = keys[t]
        ahead[t - first] = seen[key]
        seen[key] = t


@functools.cache
def _next_use_kernel():
    """next_use_kernel compiled by Numba when it is installed, else the plain function (slow)."""
    if not numba_available():
        return next_use_kernel
    return njit_cached(next_use_kernel, "void(int32[::1], int64, int32[::1])")


# Requests below which next uses take NumPy's sort (compiled.py compile_pays): 1 ms for the bundled OLMoE trace's
# 38,272, 0.13 s for 2M, against 0.65 s of CPU for the kernel's first compile (measured on a 2-core machine); the
# compiled replays find their own (``fill_next_uses``), so the sequences that ask are the Python replay's and the
# exports'.
NEXT_USE_NUMPY_BELOW = 1_000_000


def next_use_times(keys: np.ndarray) -> np.ndarray:
    """For each position, the next position holding the same key (NEVER if none; int32, as the sequence's
    columns): one compiled pass, O(n), over flat expert ids. Without Numba, below NEXT_USE_NUMPY_BELOW keys, or
    for keys too sparse for a table of them, a stable sort by key lists each key's positions in time order, and
    each position's successor in that list is its next use (NumPy sorts 16-bit keys by radix, in O(n))."""
    keys = np.ascontiguousarray(keys)
    nxt = np.empty(keys.size, dtype=COLUMN)
    if not keys.size:
        return nxt
    if keys.size >= NEVER:
        raise ValueError(f"{keys.size:,} positions do not fit the int32 columns of a sequence")
    if keys.min() < 0:
        raise ValueError("keys must not be negative")
    if compile_pays(keys.size, NEXT_USE_NUMPY_BELOW) and keys.max() < DENSE_KEYS:
        _next_use_kernel()(np.ascontiguousarray(keys, COLUMN), int(keys.max()) + 1, nxt)
        return nxt
    order = np.argsort(keys.astype(np.uint16) if keys.max() <= np.iinfo(np.uint16).max else keys, kind="stable")
    order = order.astype(COLUMN)
    following = np.full(keys.size, NEVER, dtype=COLUMN)  # in sorted order: the next position of the same key
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
