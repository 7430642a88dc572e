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
import re
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.inputs import check_input, parse_json
from moe_offload.outputs import atomic_output
from moe_offload.trace import integrity
from moe_offload.trace.parquet_columns import (OPTIONAL_COLUMNS, REQUIRED_COLUMNS, expert_dtype, int32_column,
                                                read_columns, row_group_rows, stored_columns)
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
            request=np.zeros(n, np.int32) if request is None else int32_column(request, "request", path),
            position=np.arange(n, dtype=np.int32) if position is None else int32_column(position, "position", path),
            phase=np.full(n, DECODE, np.uint8) if phase is None else np.asarray(phase, np.uint8),
            iteration=(np.arange(n, dtype=np.int32) if iteration is None
                       else int32_column(iteration, "iteration", path)),
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

def write_trace(trace: Trace, path) -> Path:
    """Validate ``trace`` and write it to ``path`` (Parquet, zstd), sealed with its checksum, atomically: a
    failed write (disk full, a file-size limit, an interrupt) leaves whatever was at ``path`` as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    trace.validate()
    n = trace.num_tokens
    stored = stored_columns(trace)

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
        pq.write_table(table, temporary, compression="zstd", use_dictionary=["phase", "experts.list.element"],
                       column_encoding={name: "DELTA_BINARY_PACKED" for name in ("request", "position", "iteration")},
                       row_group_size=row_group_rows(trace.meta))
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
        foreign = _foreign_format(path)
        if foreign is not None:
            raise TraceError(path, f"not a trace of this project but {foreign}") from None
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
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TraceError(path, f"required column(s) {', '.join(missing)} missing")
    wanted = [c for c in names if c in REQUIRED_COLUMNS or (c in OPTIONAL_COLUMNS and (columns is None or c in columns))]
    try:
        arrays = read_columns(parquet, wanted, meta, path)
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


# The JSON formats `trace import` reads, each known by keys only it has (the first that matches wins: an SGLang
# response carries routed_experts too), with the options the format needs because its files do not say them.
EXPERTS = " --experts J", "J: the experts of each layer, which the file does not say; "
JSON_FORMATS = (
    ("sglang", (b"sgl_ext", b"sglext", b"meta_info"),
     (" --model-config config.json", "config.json: the model's Hugging Face config, for the shape of its flat ids; ")),
    ("vllm", (b"routed_experts", b"prompt_routed_experts"), EXPERTS),
    ("megatron", (b"top_indices",), EXPERTS),
    ("routes-json", (b"routes",), ("", "")),
    ("topk-jsonl", (b"tok",), (EXPERTS[0], EXPERTS[1] + "--request-rows N --prompt-rows P where its lines hold "
                                                      "several requests or prompts, which it does not say either; ")),
)
JSON_SNIFF_BYTES = 1 << 16  # the head searched for those keys: a response's base64 routing can be megabytes


def json_import_command(path, head: bytes) -> str:
    """The `trace import` command that converts the JSON file ``path`` whose first bytes are ``head``, with
    what its options stand for, when the keys named there tell its format; else the command with FORMAT and
    the JSON formats to choose from."""
    keys = set(re.findall(rb'"([A-Za-z_]+)"\s*:', head[:JSON_SNIFF_BYTES]))
    for name, markers, (options, meaning) in JSON_FORMATS:
        if keys.intersection(markers):
            return (f"`moe-offload trace import {name} {shlex.quote(str(path))}{options} -o TRACE.parquet` "
                    f"({meaning}docs/traces.md)")
    return (f"`moe-offload trace import FORMAT {shlex.quote(str(path))} -o TRACE.parquet` (FORMAT "
            f"{', '.join(name for name, _, _ in JSON_FORMATS[:-1])} or {JSON_FORMATS[-1][0]}; docs/traces.md)")


def _foreign_format(path) -> str | None:
    """What a file that is not Parquet looks like from its first bytes, and how to convert it (None: nothing
    recognised, a damaged Parquet file included)."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(JSON_SNIFF_BYTES)
    except OSError:
        return None
    convert = f"convert it with `moe-offload trace import FORMAT {shlex.quote(str(path))} -o TRACE.parquet`"
    if head.startswith(b"GGUF"):
        return "a GGUF model file: a routing trace is recorded or imported (docs/traces.md)"
    if head.startswith((b"\x93NUMPY", b"PK\x03\x04")):
        return f"a NumPy array file: {convert} (FORMAT npy, or vllm for vLLM's per-request .npz)"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] in (b"{", b"["):
        return f"JSON: convert it with {json_import_command(path, text)}"
    line = text[:256].split(b"\n", 1)[0]
    if b"," in line and line.replace(b",", b"").replace(b"\r", b"").decode("ascii", "replace").isprintable():
        return f"CSV: {convert} (FORMAT csv or llamacpp; docs/traces.md), or give a counts table as .csv to `report`"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
