"""The routing-trace format: one Parquet file, one row per token, metadata in the schema.

The full specification, with an example, is docs/trace-format.md. In short:

* schema metadata key ``moe_offload.trace`` holds JSON: ``format_version``, ``model``, ``num_layers`` (L),
  ``num_experts`` (J), ``top_k`` (K), ``expert_bytes``, ``hidden_size``, ``source``, ``license`` and a free
  ``extra`` object (importer details, model config, prompt source);
* required columns: ``request`` (int32), ``position`` (int32, token index inside its request),
  ``phase`` (dictionary string, ``prefill`` or ``decode``), ``iteration`` (int32, the forward pass the token
  belongs to; rows are sorted by it), ``experts`` (fixed-size list of L*K unsigned ints, layer-major: the K
  experts of layer 0, then of layer 1, ...; within a layer in the router's rank order when known);
* optional columns: ``weights`` (L*K float16, router weights of ``experts``), ``probs`` (L*J float16, the
  router's full distribution, fMoE's expert map), ``embedding`` (D float16, the model's input embedding of
  the row's own token: what its embedding layer outputs for it; fMoE pools an iteration's semantic embedding
  from these), ``gate_prediction`` ((L-1)*J float16: entry l is layer l+1's router applied to layer l's
  hidden state, MoEpic's speculative prediction), ``next_token_gate_prediction`` (J float16: layer 0's router
  applied to the last layer's hidden state of the row's token, MoEpic's prediction of layer 0 of the
  request's next token).

The metadata's ``embedding_kind`` says what ``embedding`` holds: ``token`` (the above, what the recorder
writes) or ``request-prompt-mean`` (the mean input embedding of the request's prompt, repeated on every row:
what files written before the field existed hold, and what reading one without it assumes, so that nothing
takes it for per-token embeddings; fMoE refuses it).

Expert ids use the smallest unsigned type that holds J-1; probabilities are float16. Both are what keep a
million-token trace small.

Format version 2 seals every file with a checksum of its content (trace/integrity.py): ``read_trace``
returns exactly the trace that was written, or raises TraceError; a version-1 file (no checksum) is read
only by ``moe-offload trace seal``, which checks it and writes it sealed.

The consistency checks every trace passes (``Trace.validate``) are trace/validate.py's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.inputs import check_input, parse_json
from moe_offload.outputs import atomic_output
from moe_offload.trace import integrity
from moe_offload.trace.phases import DECODE, PHASES, PREFILL  # noqa: F401  (part of the format's vocabulary)
from moe_offload.trace.validate import validate_trace

FORMAT_VERSION = 2
# What the ``embedding`` column holds (TraceMeta.embedding_kind): each row's own token's input embedding
# (what the recorder writes), or the request's prompt mean repeated on its rows (files whose metadata does
# not say: every file written before embedding_kind existed).
EMBEDDING_TOKEN = "token"
EMBEDDING_PROMPT_MEAN = "request-prompt-mean"
EMBEDDING_KINDS = {
    EMBEDDING_TOKEN: "each row's own token's input embedding (the model's embedding layer output for it)",
    EMBEDDING_PROMPT_MEAN: "the mean input embedding of the request's prompt on every row of the request "
                           "(format version 1)",
}
UNSEALED_VERSION = 1  # the format before checksums: `trace seal` reads it
METADATA_KEY = b"moe_offload.trace"
# Bounds of the metadata, checked before anything is allocated from it. L * J bounds every per-expert array
# of the simulators and reports (flat ids, counts, a policy's slots): 16.7M experts is 250 times DeepSeek-V3's
# 61 x 256; ids then fit in uint32. An expert of 64 GiB is 50 times Mixtral-8x22B's; L * J of them stays
# within int64 bytes.
MAX_EXPERT_SLOTS = 2**24
MAX_EXPERT_BYTES = 2**36
MAX_HIDDEN_SIZE = 2**20


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer type that holds every expert id of a layer."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{num_experts} experts per layer is more than any supported id type holds")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int32_column(values, name: str, path) -> np.ndarray:
    """``values`` as int32, refusing fractions and values int32 cannot hold instead of wrapping them."""
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.number) or not np.all(np.mod(array, 1) == 0):
            raise TraceError(path, f"column {name} must hold integers")
    info = np.iinfo(np.int32)
    outside = np.flatnonzero((array < info.min) | (array > info.max)) if array.size else []
    if len(outside):
        raise TraceError(path, f"column {name} value {array[outside[0]]} does not fit in 32 bits",
                         row=int(outside[0]))
    return array.astype(np.int32)


@dataclass(frozen=True)
class TraceMeta:
    """What a trace says about the model it was recorded on and where it came from."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int | None = None
    hidden_size: int | None = None
    source: str = ""
    license: str | None = None
    extra: dict = field(default_factory=dict)
    embedding_kind: str = EMBEDDING_TOKEN  # what the embedding column holds (EMBEDDING_KINDS)

    @property
    def num_expert_slots(self) -> int:
        """L * J: how many distinct experts the model has, the largest cache that can be useful."""
        return self.num_layers * self.num_experts

    def to_json(self) -> str:
        """The metadata document as stored; TraceError when ``extra`` holds what JSON cannot (NaN, objects)."""
        try:
            return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TraceError("<metadata>", f"the trace metadata cannot be written as JSON ({exc})") from None

    @classmethod
    def from_document(cls, document: dict, path) -> "TraceMeta":
        """The metadata of a stored document (the parsed JSON object), checked."""
        raw = dict(document)
        version = raw.pop("format_version", None)
        if not _is_int(version) or version not in (UNSEALED_VERSION, FORMAT_VERSION):
            raise TraceError(path, f"trace format version {version!r} is not supported (this release reads "
                                   f"versions {UNSEALED_VERSION} and {FORMAT_VERSION}; a newer one needs a newer "
                                   "moe-offload)")
        known = {name: raw.pop(name) for name in list(raw) if name in cls.__dataclass_fields__}
        missing = [name for name in ("model", "num_layers", "num_experts", "top_k") if name not in known]
        if missing:
            raise TraceError(path, f"trace metadata lacks {', '.join(missing)}")
        # files written before embedding_kind existed hold the request's prompt mean, and said so only in prose
        known.setdefault("embedding_kind", EMBEDDING_PROMPT_MEAN)
        if not isinstance(known.get("extra", {}), dict):
            raise TraceError(path, f"metadata extra must be a JSON object, not {known['extra']!r}")
        meta = cls(**known)
        meta.extra.update(raw)  # fields of a later minor revision survive a round trip
        meta.check(path)
        return meta

    def check(self, path) -> None:
        """Refuse metadata no trace can have, before anything is allocated from it (MAX_* above)."""
        if not isinstance(self.model, str):
            raise TraceError(path, f"metadata model must be a string, not {self.model!r}")
        for name in ("num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TraceError(path, f"metadata {name} must be a positive integer, not {value!r}")
        if self.num_layers * self.num_experts > MAX_EXPERT_SLOTS:
            raise TraceError(path, f"metadata num_layers={self.num_layers} x num_experts={self.num_experts} is "
                                   f"{self.num_layers * self.num_experts:,} experts, more than the "
                                   f"{MAX_EXPERT_SLOTS:,} this release handles")
        if self.top_k > self.num_experts:
            raise TraceError(path, f"metadata top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name, bound in (("expert_bytes", MAX_EXPERT_BYTES), ("hidden_size", MAX_HIDDEN_SIZE)):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 1 <= value <= bound):
                raise TraceError(path, f"metadata {name} must be a positive integer of at most {bound:,}, "
                                       f"not {value!r}")
        if not isinstance(self.source, str) or not (self.license is None or isinstance(self.license, str)):
            raise TraceError(path, "metadata source and license must be strings")
        if not isinstance(self.extra, dict):
            raise TraceError(path, f"metadata extra must be a JSON object, not {self.extra!r}")
        if self.embedding_kind not in EMBEDDING_KINDS:
            raise TraceError(path, f"metadata embedding_kind must be one of {', '.join(EMBEDDING_KINDS)}, "
                                   f"not {self.embedding_kind!r}")


@dataclass
class Trace:
    """A routing trace in memory: per-token NumPy arrays, rows in iteration order.

    Shapes (N tokens, L layers, K experts per token and layer, J experts per layer, D embedding size):
    ``experts`` [N, L, K], ``weights`` [N, L, K], ``probs`` [N, L, J], ``embedding`` [N, D],
    ``gate_prediction`` [N, L-1, J], ``next_token_gate_prediction`` [N, J]; the optional ones are None when the
    trace lacks them.
    """

    meta: TraceMeta
    request: np.ndarray
    position: np.ndarray
    phase: np.ndarray
    iteration: np.ndarray
    experts: np.ndarray
    weights: np.ndarray | None = None
    probs: np.ndarray | None = None
    embedding: np.ndarray | None = None
    gate_prediction: np.ndarray | None = None
    next_token_gate_prediction: np.ndarray | None = None
    path: str = "<memory>"

    @classmethod
    def build(cls, meta: TraceMeta, experts, *, request=None, position=None, phase=None, iteration=None,
              weights=None, probs=None, embedding=None, gate_prediction=None, next_token_gate_prediction=None,
              path="<memory>") -> "Trace":
        """Make a validated trace from array-likes, filling the bookkeeping columns of a single
        decode-only request when they are not given."""
        experts = np.asarray(experts)
        n = experts.shape[0] if experts.ndim else 0
        trace = cls(
            meta=meta,
            request=np.zeros(n, np.int32) if request is None else _int32_column(request, "request", path),
            position=np.arange(n, dtype=np.int32) if position is None else _int32_column(position, "position", path),
            phase=np.full(n, DECODE, np.uint8) if phase is None else np.asarray(phase, np.uint8),
            iteration=(np.arange(n, dtype=np.int32) if iteration is None
                       else _int32_column(iteration, "iteration", path)),
            experts=experts,
            weights=None if weights is None else np.asarray(weights, np.float16),
            probs=None if probs is None else np.asarray(probs, np.float16),
            embedding=None if embedding is None else np.asarray(embedding, np.float16),
            gate_prediction=None if gate_prediction is None else np.asarray(gate_prediction, np.float16),
            next_token_gate_prediction=(None if next_token_gate_prediction is None
                                        else np.asarray(next_token_gate_prediction, np.float16)),
            path=str(path),
        )
        trace.validate()
        trace.experts = trace.experts.astype(expert_dtype(meta.num_experts), copy=False)
        return trace

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_requests(self) -> int:
        return int(np.unique(self.request).size)

    def select(self, rows) -> "Trace":
        """The trace restricted to ``rows`` (a slice, mask or index array), e.g. a train/test split."""
        pick = (lambda a: None if a is None else a[rows])
        return replace(self, request=self.request[rows], position=self.position[rows], phase=self.phase[rows],
                       iteration=self.iteration[rows], experts=self.experts[rows], weights=pick(self.weights),
                       probs=pick(self.probs), embedding=pick(self.embedding),
                       gate_prediction=pick(self.gate_prediction),
                       next_token_gate_prediction=pick(self.next_token_gate_prediction))

    def validate(self) -> None:
        """Raise TraceError naming the first offending row, or return when the trace is consistent
        (trace/validate.py)."""
        validate_trace(self)


# ---------------------------------------------------------------------------------------------- Parquet I/O

_REQUIRED = ("request", "position", "phase", "iteration", "experts")
_OPTIONAL = ("weights", "probs", "embedding", "gate_prediction", "next_token_gate_prediction")


def _stored_columns(trace: Trace) -> dict[str, np.ndarray]:
    """The columns as a file stores them and ``read_trace`` returns them, by name: what the checksum seals."""
    columns = {"request": trace.request.astype(np.int32, copy=False),
               "position": trace.position.astype(np.int32, copy=False),
               "phase": trace.phase.astype(np.uint8, copy=False),
               "iteration": trace.iteration.astype(np.int32, copy=False),
               "experts": trace.experts.astype(expert_dtype(trace.meta.num_experts), copy=False)}
    for name in _OPTIONAL:
        values = getattr(trace, name)
        if values is not None:
            columns[name] = values.astype(np.float16, copy=False)
    return columns


def write_trace(trace: Trace, path) -> Path:
    """Validate ``trace`` and write it to ``path`` (Parquet, zstd), sealed with its checksum, atomically: a
    failed write (disk full, a file-size limit, an interrupt) leaves whatever was at ``path`` as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    trace.validate()
    n = trace.num_tokens
    stored = _stored_columns(trace)

    def fixed_list(values: np.ndarray) -> pa.Array:
        flat = np.ascontiguousarray(values).reshape(n, -1)
        return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])

    columns = {name: pa.array(stored[name]) for name in ("request", "position", "iteration")}
    columns["phase"] = pa.DictionaryArray.from_arrays(pa.array(stored["phase"].astype(np.int8)), pa.array(PHASES))
    columns.update({name: fixed_list(values) for name, values in stored.items() if values.ndim > 1})
    metadata = trace.meta.to_json()
    checksum = integrity.seal(json.loads(metadata), stored)
    table = pa.table({name: columns[name] for name in stored}).replace_schema_metadata(
        {METADATA_KEY: metadata.encode(), integrity.CHECKSUM_KEY: checksum})
    path = Path(path)
    with atomic_output(path) as temporary:
        # Dictionary-encoded expert ids and delta-encoded counters are what keep a million-token trace small;
        # the dictionary option must name the list's leaf column, or Arrow silently ignores it.
        # Row groups of ROW_GROUP_REQUESTS expert requests at most: a reader decodes one at a time (_read_columns).
        pq.write_table(table, temporary, compression="zstd", use_dictionary=["phase", "experts.list.element"],
                       column_encoding={name: "DELTA_BINARY_PACKED" for name in ("request", "position", "iteration")},
                       row_group_size=max(1, ROW_GROUP_REQUESTS // (trace.meta.num_layers * trace.meta.top_k)))
    return path


def read_trace(path, columns: tuple[str, ...] | None = None, *, unsealed: bool = False) -> Trace:
    """Read, verify and validate a trace file (or a bundled trace by name: ``olmoe``, ``tiny``,
    ``tiny-history``). ``columns`` limits which optional columns are loaded (all by default).

    The data is checked against the file's checksum before anything else, so what is returned is exactly
    what was written. Every problem (missing or unreadable file, not Parquet, truncated, corrupt, wrong
    shapes, ids out of range...) raises TraceError naming the file and, where one is to blame, the row.
    ``unsealed`` also accepts a file of format 1, which has no checksum (``moe-offload trace seal``).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moe_offload.bundled import trace_path

    path = check_input(trace_path(str(path)), "trace file", TraceError)
    # A damaged footer makes pyarrow raise its own errors, OSError, or ValueError (names that are not UTF-8).
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        names = list(schema.names)
    except (pa.ArrowException, OSError, ValueError, MemoryError) as exc:
        raise TraceError(path, f"not a Parquet file, or corrupt or truncated ({_first_line(exc)})") from None
    stored = schema.metadata or {}
    raw_meta = stored.get(METADATA_KEY)
    if raw_meta is None:
        raise TraceError(path, "Parquet file without moe-offload trace metadata "
                               "(convert foreign traces with `moe-offload trace import`)")
    document = parse_json(raw_meta, path, "trace metadata", TraceError)
    if not isinstance(document, dict):
        raise TraceError(path, f"trace metadata must be a JSON object, not {type(document).__name__}")
    seal = None
    if document.get("format_version") == FORMAT_VERSION or integrity.CHECKSUM_KEY in stored:
        if integrity.CHECKSUM_KEY not in stored:
            raise TraceError(path, "corrupt: the checksum record is missing")
        seal = integrity.Seal(stored[integrity.CHECKSUM_KEY], path)
        seal.verify_metadata(document)
    meta = TraceMeta.from_document(document, path)
    if seal is None and not unsealed:
        raise TraceError(path, "has no checksum (trace format 1, written before moe-offload sealed its traces): "
                               "check it and seal it with `moe-offload trace seal FILE`")
    missing = [c for c in _REQUIRED if c not in names]
    if missing:
        raise TraceError(path, f"required column(s) {', '.join(missing)} missing")
    wanted = [c for c in names if c in _REQUIRED or (c in _OPTIONAL and (columns is None or c in columns))]
    try:
        arrays = _read_columns(parquet, wanted, meta, path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceError(path, f"corrupt or truncated trace data ({_first_line(exc)})") from None
    except MemoryError:
        raise TraceError(path, "the trace does not fit in this machine's memory") from None
    if seal is not None:
        seal.verify_columns(names, arrays)
    trace = Trace(meta=meta, path=str(path), **arrays)
    trace.validate()
    return trace


def seal_trace(path) -> bool:
    """Check the trace at ``path`` and write it back sealed with its checksum (format 2); returns whether it
    had one already. A sealed file is verified first, so a corrupt one is refused, never sealed anew."""
    trace = read_trace(path, unsealed=True)
    path = Path(trace.path)
    was_sealed = integrity.CHECKSUM_KEY in (_schema_metadata(path) or {})
    write_trace(trace, path)
    return was_sealed


def _schema_metadata(path: Path) -> dict | None:
    import pyarrow.parquet as pq

    return pq.read_schema(path).metadata


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Values decoded at a time (``_read_columns``), over the columns read: Arrow's decoding of the nested expert
# column needs scratch memory of several times its values, and a million values' worth stays in the CPU's cache
# and is reused; at 6.3M values a piece (16,384 rows of 48 x 8), the whole command read 20M requests in 0.25 to
# 0.43 s, against 0.18 to 0.21 s a million at a time (2-core AMD EPYC), where memory touched anew costs most.
READ_VALUES = 1 << 20
ROW_GROUP_REQUESTS = 1 << 22  # expert requests of a row group that write_trace writes


def _read_columns(parquet, columns: list[str], meta: TraceMeta, path) -> dict[str, np.ndarray]:
    """The file's ``columns`` as the arrays of a Trace, decoded (``_decode``) READ_VALUES values at a time into
    arrays made once, then Arrow's freed memory given back: Parquet's decoding of the nested expert column
    takes about 10 bytes a request of its row group (0.4 GB for one group of 38.4M requests, which write_trace
    no longer writes), and the whole table at once needed 17 (0.7 GB), many times the trace's own size. A
    problem's row counts from the file's first row."""
    import pyarrow as pa

    total = parquet.metadata.num_rows
    schema = parquet.schema_arrow
    per_row = sum(schema.field(name).type.list_size if pa.types.is_fixed_size_list(schema.field(name).type) else 1
                  for name in columns)
    arrays, start = None, 0
    for batch in parquet.iter_batches(batch_size=max(1, READ_VALUES // per_row), columns=columns):
        try:
            piece = _decode(pa.Table.from_batches([batch]), meta, path)
        except TraceError as error:
            if error.row is None:
                raise
            raise TraceError(error.path, error.problem, row=start + error.row) from None
        if arrays is None:
            arrays = {name: np.empty((total, *values.shape[1:]), values.dtype) for name, values in piece.items()}
        for name, values in piece.items():
            arrays[name][start:start + len(values)] = values
        start += batch.num_rows
    if arrays is None:  # no rows: the empty table's columns, checked as any
        return _decode(parquet.read(columns=columns), meta, path)
    if start != total:
        raise TraceError(path, f"truncated: {start:,} rows read of the {total:,} its footer declares")
    pa.default_memory_pool().release_unused()
    return arrays


def _decode(table, meta: TraceMeta, path) -> dict[str, np.ndarray]:
    """The table's columns as the arrays of a Trace (the dtypes of ``_stored_columns``), by name."""
    import pyarrow as pa

    n = table.num_rows
    L, J, K = meta.num_layers, meta.num_experts, meta.top_k

    def column(name):
        col = table.column(name)
        if col.null_count:
            first_null = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceError(path, f"column {name} is empty (null)", row=first_null)
        return col.combine_chunks()

    def fixed_list(name, per_row: int | None, shape):
        col = column(name)
        if not pa.types.is_fixed_size_list(col.type):
            raise TraceError(path, f"column {name} has type {col.type}, expected a fixed-size list")
        if per_row is not None and col.type.list_size != per_row:
            raise TraceError(path, f"column {name} holds {col.type.list_size} values per row, "
                                   f"metadata (L={L}, J={J}, K={K}) implies {per_row}")
        # the rows' values as flatten() gives them (column() has refused null rows), without flatten()'s import
        # of pyarrow.compute, a tenth of a second of every command that reads a trace
        size = col.type.list_size
        values = col.values.slice(col.offset * size, len(col) * size)
        if values.null_count:
            raise TraceError(path, f"column {name} holds an empty (null) value")
        if shape is None:
            shape = (n, col.type.list_size)
        return values.to_numpy(zero_copy_only=False).reshape(shape)

    phase = column("phase")
    if not pa.types.is_dictionary(phase.type):
        phase = phase.dictionary_encode()
    labels = phase.dictionary.to_pylist()
    code_of_label = np.array([PHASES.index(label) if label in PHASES else 255 for label in labels] + [255],
                             np.uint8)
    indices = phase.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    indices[(indices < 0) | (indices >= len(labels))] = len(labels)  # out of the dictionary: corrupt
    phase_codes = code_of_label[indices]
    bad = np.flatnonzero(phase_codes == 255)
    if bad.size:
        label = labels[indices[bad[0]]] if indices[bad[0]] < len(labels) else "(none)"
        raise TraceError(path, f"phase {label!r} is neither 'prefill' nor 'decode'", row=int(bad[0]))

    def ints(name):
        col = column(name)
        if not pa.types.is_integer(col.type):
            raise TraceError(path, f"column {name} has type {col.type}, expected integers")
        return _int32_column(col.to_numpy(), name, path)

    arrays = {"request": ints("request"), "position": ints("position"), "phase": phase_codes,
              "iteration": ints("iteration"), "experts": _ids(fixed_list("experts", L * K, (n, L, K)), J, path)}
    shapes = {"weights": (L * K, (n, L, K)), "probs": (L * J, (n, L, J)),
              "gate_prediction": ((L - 1) * J, (n, L - 1, J)), "next_token_gate_prediction": (J, (n, J)),
              "embedding": (None, None)}
    for name in _OPTIONAL:
        if name in table.column_names:
            values = fixed_list(name, *shapes[name])
            if not np.issubdtype(values.dtype, np.floating):
                raise TraceError(path, f"column {name} has type {values.dtype}, expected floats")
            arrays[name] = values.astype(np.float16, copy=False)
    return arrays


def _ids(values: np.ndarray, num_experts: int, path) -> np.ndarray:
    """Expert ids in the id type of ``num_experts`` (expert_dtype); a value that type cannot hold is refused,
    never wrapped around."""
    dtype = expert_dtype(num_experts)
    if values.dtype == dtype:
        return values
    if not np.issubdtype(values.dtype, np.integer):
        raise TraceError(path, f"expert ids must be integers, not {values.dtype}")
    converted = values.astype(dtype)
    beyond = np.flatnonzero((converted != values).reshape(values.shape[0], -1).any(axis=1))
    if beyond.size:
        row = int(beyond[0])
        raise TraceError(path, f"expert id {values[row][converted[row] != values[row]][0]} is beyond the ids of "
                               f"a model with {num_experts} experts per layer", row=row)
    return converted
