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

Version 2 changed what ``embedding`` holds: in version 1 files it is the mean input embedding of the
request's prompt, repeated on every row. Reading a version 1 file sets ``TraceMeta.embedding_kind`` to
``request-prompt-mean`` so that nothing takes it for per-token embeddings (fMoE refuses it).

Expert ids use the smallest unsigned type that holds J-1; probabilities are float16. Both are what keep a
million-token trace small.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError

FORMAT_VERSION = 2
# What the ``embedding`` column holds (TraceMeta.embedding_kind): each row's own token's input embedding
# (version 2), or the request's prompt mean repeated on its rows (every version 1 file that has the column).
EMBEDDING_TOKEN = "token"
EMBEDDING_PROMPT_MEAN = "request-prompt-mean"
EMBEDDING_KINDS = {
    EMBEDDING_TOKEN: "each row's own token's input embedding (the model's embedding layer output for it)",
    EMBEDDING_PROMPT_MEAN: "the mean input embedding of the request's prompt on every row of the request "
                           "(format version 1)",
}
METADATA_KEY = b"moe_offload.trace"
PHASES = ("prefill", "decode")
PREFILL, DECODE = 0, 1


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
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, path) -> "TraceMeta":
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise TraceError(path, f"trace metadata is not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise TraceError(path, f"trace metadata must be a JSON object, not {type(raw).__name__}")
        version = raw.pop("format_version", None)
        if not _is_int(version) or version > FORMAT_VERSION:
            raise TraceError(path, f"trace format version {version!r} is not supported (this release reads "
                                   f"versions up to {FORMAT_VERSION}; upgrade moe-offload)")
        known = {name: raw.pop(name) for name in list(raw) if name in cls.__dataclass_fields__}
        missing = [name for name in ("model", "num_layers", "num_experts", "top_k") if name not in known]
        if missing:
            raise TraceError(path, f"trace metadata lacks {', '.join(missing)}")
        if version < 2:  # version 1 wrote the request's prompt mean, and said so only in prose
            known.setdefault("embedding_kind", EMBEDDING_PROMPT_MEAN)
        if not isinstance(known.get("extra", {}), dict):
            raise TraceError(path, f"metadata extra must be a JSON object, not {known['extra']!r}")
        meta = cls(**known)
        meta.extra.update(raw)  # fields of a later minor revision survive a round trip
        meta.check(path)
        return meta

    def check(self, path) -> None:
        if not isinstance(self.model, str):
            raise TraceError(path, f"metadata model must be a string, not {self.model!r}")
        for name in ("num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TraceError(path, f"metadata {name} must be a positive integer, not {value!r}")
        if self.top_k > self.num_experts:
            raise TraceError(path, f"metadata top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.expert_bytes is not None and (not _is_int(self.expert_bytes) or self.expert_bytes < 1):
            raise TraceError(path, f"metadata expert_bytes must be a positive integer, not {self.expert_bytes!r}")
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
        """Raise TraceError naming the first offending row, or return when the trace is consistent."""
        meta, path = self.meta, self.path
        meta.check(path)
        L, J, K = meta.num_layers, meta.num_experts, meta.top_k
        n = self.num_tokens
        for name in ("request", "position", "phase", "iteration"):
            column = getattr(self, name)
            if column.shape != (n,):
                raise TraceError(path, f"column {name} has {column.shape[0] if column.ndim else 0} rows, "
                                       f"experts has {n}")
        if self.experts.ndim != 3 or self.experts.shape[1] != L:
            got = self.experts.shape[1] if self.experts.ndim == 3 else "?"
            raise TraceError(path, f"experts has {got} layers per row, metadata says num_layers={L}")
        if self.experts.shape[2] != K:
            raise TraceError(path, f"experts has {self.experts.shape[2]} experts per layer, "
                                   f"metadata says top_k={K}")
        if n == 0:
            raise TraceError(path, "the trace has no tokens")
        if not np.issubdtype(self.experts.dtype, np.integer):
            raise TraceError(path, f"expert ids must be integers, not {self.experts.dtype}")
        bad = np.flatnonzero(((self.experts < 0) | (self.experts >= J)).any(axis=(1, 2)))
        if bad.size:
            row = int(bad[0])
            layer = int(np.flatnonzero(((self.experts[row] < 0) | (self.experts[row] >= J)).any(axis=1))[0])
            raise TraceError(path, f"layer {layer} selects expert {self.experts[row, layer].tolist()}, "
                                   f"but the model has experts 0..{J - 1}", row=row)
        if K > 1:
            ordered = np.sort(self.experts, axis=2)
            dup = np.flatnonzero((ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=(1, 2)))
            if dup.size:
                row = int(dup[0])
                layer = int(np.flatnonzero((ordered[row, :, 1:] == ordered[row, :, :-1]).any(axis=1))[0])
                raise TraceError(path, f"layer {layer} selects the same expert twice: "
                                       f"{self.experts[row, layer].tolist()}", row=row)
        bad = np.flatnonzero(self.phase > DECODE)
        if bad.size:
            raise TraceError(path, f"phase code {int(self.phase[bad[0]])} is neither prefill (0) nor decode (1)",
                             row=int(bad[0]))
        bad = np.flatnonzero(np.diff(self.iteration) < 0)
        if bad.size:
            raise TraceError(path, "rows are not in iteration order "
                                   f"(iteration {int(self.iteration[bad[0] + 1])} after {int(self.iteration[bad[0]])})",
                             row=int(bad[0]) + 1)
        bad = np.flatnonzero(self.position < 0)
        if bad.size:
            raise TraceError(path, f"negative position {int(self.position[bad[0]])}", row=int(bad[0]))
        self._check_float("weights", self.weights, (n, L, K))
        self._check_float("probs", self.probs, (n, L, J), upper=1.0)
        self._check_float("gate_prediction", self.gate_prediction, (n, L - 1, J), upper=1.0)
        self._check_float("next_token_gate_prediction", self.next_token_gate_prediction, (n, J), upper=1.0)
        if self.embedding is not None:
            self._check_float("embedding", self.embedding, (n, self.embedding.shape[-1] if self.embedding.ndim == 2
                                                              else -1), lower=None)

    def _check_float(self, name, values, shape, lower=0.0, upper=None):
        if values is None:
            return
        if values.shape != shape:
            raise TraceError(self.path, f"column {name} has shape {values.shape}, expected {shape}")
        finite = np.isfinite(values).reshape(values.shape[0], -1).all(axis=1)
        if not finite.all():
            raise TraceError(self.path, f"column {name} holds NaN or infinity", row=int(np.flatnonzero(~finite)[0]))
        if lower is not None:
            low = (values < lower).reshape(values.shape[0], -1).any(axis=1)
            if low.any():
                raise TraceError(self.path, f"column {name} holds a negative value", row=int(np.flatnonzero(low)[0]))
        if upper is not None:
            # float16 rounds 1.0 - 1e-4 up to 1.0; anything clearly above 1 is not a probability.
            high = (values > upper + 1e-3).reshape(values.shape[0], -1).any(axis=1)
            if high.any():
                raise TraceError(self.path, f"column {name} holds a probability above 1",
                                 row=int(np.flatnonzero(high)[0]))


# ---------------------------------------------------------------------------------------------- Parquet I/O

_OPTIONAL = ("weights", "probs", "embedding", "gate_prediction", "next_token_gate_prediction")


def write_trace(trace: Trace, path) -> Path:
    """Validate ``trace`` and write it to ``path`` (Parquet, zstd)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    trace.validate()
    n = trace.num_tokens

    def fixed_list(values: np.ndarray, arrow_type) -> pa.Array:
        flat = np.ascontiguousarray(values).reshape(n, -1)
        return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1), type=arrow_type), flat.shape[1])

    ids = trace.experts.astype(expert_dtype(trace.meta.num_experts), copy=False)
    columns = {
        "request": pa.array(trace.request, pa.int32()),
        "position": pa.array(trace.position, pa.int32()),
        "phase": pa.DictionaryArray.from_arrays(pa.array(trace.phase.astype(np.int8)), pa.array(PHASES)),
        "iteration": pa.array(trace.iteration, pa.int32()),
        "experts": fixed_list(ids, pa.from_numpy_dtype(ids.dtype)),
    }
    for name in _OPTIONAL:
        values = getattr(trace, name)
        if values is not None:
            columns[name] = fixed_list(values.astype(np.float16, copy=False), pa.float16())
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: trace.meta.to_json().encode()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Dictionary-encoded expert ids and delta-encoded counters are what keep a million-token trace small;
    # the dictionary option must name the list's leaf column, or Arrow silently ignores it.
    pq.write_table(table, path, compression="zstd", use_dictionary=["phase", "experts.list.element"],
                   column_encoding={name: "DELTA_BINARY_PACKED" for name in ("request", "position", "iteration")})
    return path


def read_trace(path, columns: tuple[str, ...] | None = None) -> Trace:
    """Read and validate a trace file. ``columns`` limits which optional columns are loaded (all by default).

    Every problem (missing file, not Parquet, truncated, wrong shapes, ids out of range...) raises
    TraceError naming the file and, where one is to blame, the row.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise TraceError(path, "no such file")
    if path.is_dir():
        raise TraceError(path, "is a directory, not a trace file")
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(path, f"not a readable Parquet file, corrupt or truncated ({exc})") from None
    raw_meta = (schema.metadata or {}).get(METADATA_KEY)
    if raw_meta is None:
        raise TraceError(path, "Parquet file without moe-offload trace metadata "
                               "(convert foreign traces with `moe-offload trace import`)")
    meta = TraceMeta.from_json(raw_meta, path)
    names = set(schema.names)
    missing = [c for c in ("request", "position", "phase", "iteration", "experts") if c not in names]
    if missing:
        raise TraceError(path, f"required column(s) {', '.join(missing)} missing")
    wanted = [c for c in schema.names if c in ("request", "position", "phase", "iteration", "experts")
              or (c in _OPTIONAL and (columns is None or c in columns))]
    try:
        table = parquet.read(columns=wanted)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(path, f"corrupt or truncated trace data ({exc})") from None
    n = table.num_rows
    L, J, K = meta.num_layers, meta.num_experts, meta.top_k

    def column(name):
        col = table.column(name)
        if col.null_count:
            first_null = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceError(path, f"column {name} is empty (null)", row=first_null)
        return col.combine_chunks()

    def fixed_list(name, per_row: int, shape):
        col = column(name)
        if not pa.types.is_fixed_size_list(col.type):
            raise TraceError(path, f"column {name} has type {col.type}, expected a fixed-size list")
        if col.type.list_size != per_row:
            raise TraceError(path, f"column {name} holds {col.type.list_size} values per row, "
                                   f"metadata (L={L}, J={J}, K={K}) implies {per_row}")
        return col.flatten().to_numpy(zero_copy_only=False).reshape(shape)

    phase = column("phase")
    if not pa.types.is_dictionary(phase.type):
        phase = phase.dictionary_encode()
    labels = phase.dictionary.to_pylist()
    code_of_label = np.array([PHASES.index(label) if label in PHASES else 255 for label in labels], np.uint8)
    phase_codes = code_of_label[phase.indices.to_numpy(zero_copy_only=False)] if n else np.zeros(0, np.uint8)
    bad = np.flatnonzero(phase_codes == 255)
    if bad.size:
        label = labels[phase.indices[int(bad[0])].as_py()]
        raise TraceError(path, f"phase {label!r} is neither 'prefill' nor 'decode'", row=int(bad[0]))

    optional = {}
    shapes = {"weights": (L * K, (n, L, K)), "probs": (L * J, (n, L, J)),
              "gate_prediction": ((L - 1) * J, (n, L - 1, J)), "next_token_gate_prediction": (J, (n, J))}
    for name in _OPTIONAL:
        if name not in table.column_names:
            continue
        if name == "embedding":
            col = column(name)
            size = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
            if size is None:
                raise TraceError(path, f"column embedding has type {col.type}, expected a fixed-size list")
            optional[name] = fixed_list(name, size, (n, size))
        else:
            optional[name] = fixed_list(name, *shapes[name])
        optional[name] = optional[name].astype(np.float16, copy=False)

    def ints(name):
        col = column(name)
        if not pa.types.is_integer(col.type):
            raise TraceError(path, f"column {name} has type {col.type}, expected integers")
        return _int32_column(col.to_numpy(), name, path)

    trace = Trace(meta=meta, request=ints("request"), position=ints("position"), phase=phase_codes,
                  iteration=ints("iteration"), experts=fixed_list("experts", L * K, (n, L, K)), path=str(path),
                  **optional)
    trace.validate()
    return trace
